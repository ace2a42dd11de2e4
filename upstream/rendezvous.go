package upstream

import (
	"math"

	"github.com/cespare/xxhash/v2"
)

// score is the rendezvous (highest-random-weight) weight of an encoder for a
// key (a req_id's hash, or a content hash). Both hashes are stable across
// processes, so every gateway replica ranks encoders identically.
func score(keyHash, encHash uint64) uint64 {
	// splitmix64 finaliser over the combination: cheap and well mixed.
	z := keyHash ^ encHash
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// rank appends the candidates to dst in rendezvous order for reqID, best
// first, and returns it.
func rank(reqID string, candidates []*Encoder, dst []*Encoder) []*Encoder {
	return rankHash(xxhash.Sum64String(reqID), candidates, dst)
}

// rankHash appends the candidates to dst in rendezvous order for the key
// hash h, best first, and returns it.
func rankHash(h uint64, candidates []*Encoder, dst []*Encoder) []*Encoder {
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

// contentHash is the placement key of an /encode's media: the raw bytes of
// its mm_items value, as the encoder's media cache keys them (equal bytes,
// equal media).
func contentHash(mmItems []byte) uint64 { return xxhash.Sum64(mmItems) }

// boundLoad reorders list, a rendezvous order over the usable encoders, for
// bounded load (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing
// with Bounded Loads"): with n encoders holding total exchanges, one more
// may go where at most capacity = ceil(factor × (total+1) / n) would then
// be in flight. Those over it move behind the others, each group keeping
// its rendezvous order, so media stays on its encoder unless that one is
// overloaded, and then goes to the same next one from every replica that
// sees the same loads. Some encoder always fits (the least loaded holds at
// most total/n), so with steady counts the first of the new order is never
// over the bound. Counts are read as they are, without a lock: a placement
// is a heuristic, and one that moves meanwhile errs by an exchange or two.
// It allocates nothing.
func boundLoad(list []*Encoder, factor float64) {
	n := len(list)
	if n < 2 {
		return
	}
	var total int64
	for _, e := range list {
		total += e.Inflight()
	}
	capacity := int64(math.Ceil(factor * float64(total+1) / float64(n)))
	k := 0 // where the next encoder under the bound goes
	for i, e := range list {
		if e.Inflight()+1 > capacity {
			continue
		}
		// A stable partition in place: shift the overloaded ones seen so
		// far (list[k:i]) one slot back and put e before them.
		copy(list[k+1:i+1], list[k:i])
		list[k] = e
		k++
	}
}
