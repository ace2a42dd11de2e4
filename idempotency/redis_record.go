package idempotency

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// encodeRecord writes rec in the version-2 layout described on Redis.
func encodeRecord(rec *Record) []byte {
	b := make([]byte, 0, 1+4*binary.MaxVarintLen64+16+len(rec.ContentType)+len(rec.Encoder)+len(rec.Body))
	b = append(b, recordVersion)
	b = binary.AppendVarint(b, int64(rec.Status))
	b = binary.BigEndian.AppendUint64(b, rec.FP.SessionID)
	b = binary.BigEndian.AppendUint64(b, rec.FP.BufferAddress)
	b = binary.AppendUvarint(b, uint64(len(rec.ContentType)))
	b = append(b, rec.ContentType...)
	b = binary.AppendUvarint(b, uint64(len(rec.Encoder)))
	b = append(b, rec.Encoder...)
	b = binary.AppendUvarint(b, uint64(len(rec.Body)))
	return append(b, rec.Body...)
}

// errCorruptRecord is returned for a stored value that is not a record.
var errCorruptRecord = errors.New("corrupt record")

// decodeRecord reads a version-2 record, or a version-1 one (no encoder);
// anything else, truncated or with bytes left over, is errCorruptRecord.
func decodeRecord(s string) (*Record, error) {
	b := []byte(s)
	if len(b) == 0 || b[0] != recordVersion && b[0] != 1 {
		return nil, fmt.Errorf("%w: unknown version", errCorruptRecord)
	}
	version := b[0]
	b = b[1:]
	status, n := binary.Varint(b)
	if n <= 0 || int64(int(status)) != status {
		return nil, fmt.Errorf("%w: bad status", errCorruptRecord)
	}
	b = b[n:]
	if len(b) < 16 {
		return nil, fmt.Errorf("%w: short fingerprint", errCorruptRecord)
	}
	rec := &Record{Status: int(status), FP: Fingerprint{
		SessionID:     binary.BigEndian.Uint64(b),
		BufferAddress: binary.BigEndian.Uint64(b[8:]),
	}}
	b = b[16:]
	ct, b, ok := lengthPrefixed(b)
	if !ok {
		return nil, fmt.Errorf("%w: bad content type", errCorruptRecord)
	}
	if version >= 2 {
		var enc []byte
		if enc, b, ok = lengthPrefixed(b); !ok {
			return nil, fmt.Errorf("%w: bad encoder", errCorruptRecord)
		}
		rec.Encoder = string(enc)
	}
	body, b, ok := lengthPrefixed(b)
	if !ok || len(b) != 0 {
		return nil, fmt.Errorf("%w: bad body", errCorruptRecord)
	}
	rec.ContentType, rec.Body = string(ct), body
	return rec, nil
}

// lengthPrefixed splits a uvarint-length-prefixed field off b.
func lengthPrefixed(b []byte) (field, rest []byte, ok bool) {
	n, w := binary.Uvarint(b)
	if w <= 0 || n > uint64(len(b)-w) {
		return nil, nil, false
	}
	b = b[w:]
	return b[:n:n], b[n:], true
}
