package cuda

import (
	"encoding/binary"
	"fmt"
)

// The test pattern: byte i of a buffer filled for seed is byte i%8 of the
// little-endian 64-bit word w(i/8), where w(k) is the k-th output (from 0)
// of SplitMix64 seeded with seed:
//
//	z := seed + (k+1)*0x9E3779B97F4A7C15
//	z = (z ^ z>>30) * 0xBF58476D1CE4E5B9
//	z = (z ^ z>>27) * 0x94D049BB133111EB
//	w(k) = z ^ z>>31
//
// Any byte can be computed on its own, so chunks can be filled or checked at
// any offset, by the exporter (cudaexport), by tests and by verifiers in
// other languages.

func patternWord(seed, k uint64) uint64 {
	z := seed + (k+1)*0x9E3779B97F4A7C15
	z = (z ^ z>>30) * 0xBF58476D1CE4E5B9
	z = (z ^ z>>27) * 0x94D049BB133111EB
	return z ^ z>>31
}

// PatternByte is byte i of the pattern for seed.
func PatternByte(seed uint64, i int64) byte {
	return byte(patternWord(seed, uint64(i)/8) >> (8 * (uint64(i) % 8)))
}

// FillPattern fills b with bytes offset, offset+1, ... of the pattern for
// seed (offset >= 0).
func FillPattern(b []byte, seed uint64, offset int64) {
	i := 0
	for ; i < len(b) && (offset+int64(i))%8 != 0; i++ {
		b[i] = PatternByte(seed, offset+int64(i))
	}
	for ; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], patternWord(seed, uint64(offset+int64(i))/8))
	}
	for ; i < len(b); i++ {
		b[i] = PatternByte(seed, offset+int64(i))
	}
}

// CheckPattern is nil when b holds bytes offset, offset+1, ... of the
// pattern for seed, else an error naming the first byte that differs.
func CheckPattern(b []byte, seed uint64, offset int64) error {
	var want [8]byte
	for i := 0; i < len(b); {
		at := offset + int64(i)
		k := uint64(at) / 8
		binary.LittleEndian.PutUint64(want[:], patternWord(seed, k))
		for j := int(uint64(at) % 8); j < 8 && i < len(b); j, i = j+1, i+1 {
			if b[i] != want[j] {
				return fmt.Errorf("byte %d (offset %d) is %#02x, the pattern for seed %d has %#02x", i, offset+int64(i), b[i], seed, want[j])
			}
		}
	}
	return nil
}
