package upstream

import "github.com/cespare/xxhash/v2"

// score is the rendezvous (highest-random-weight) weight of an encoder for a
// req_id. Both hashes are stable across processes, so every gateway replica
// ranks encoders identically.
func score(reqHash, encHash uint64) uint64 {
	// splitmix64 finaliser over the combination: cheap and well mixed.
	z := reqHash ^ encHash
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// rank appends the candidates to dst in rendezvous order for reqID, best
// first, and returns it.
func rank(reqID string, candidates []*Encoder, dst []*Encoder) []*Encoder {
	h := xxhash.Sum64String(reqID)
	start := len(dst)
	for _, e := range candidates {
		dst = append(dst, e)
		// insertion sort: fleets are small and this allocates nothing
		for i := len(dst) - 1; i > start && score(h, dst[i].hash) > score(h, dst[i-1].hash); i-- {
			dst[i], dst[i-1] = dst[i-1], dst[i]
		}
	}
	return dst
}
