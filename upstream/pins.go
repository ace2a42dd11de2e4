package upstream

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/encgate/encgate/internal/clock"
)

// Pin is what the gateway remembers about one req_id: the encoder its
// /encode went to and, when that /encode ended in a non-200, the answer, so
// follow-ups can get the same status and message at once.
type Pin struct {
	Encoder string // empty when the gateway failed the /encode before choosing one
	// EncoderID identifies the encoder's name and URL at pin time: a reload
	// that moves a name to another URL must not send its pins there.
	EncoderID uint64
	Failed    bool
	Status    int
	Message   string
}

const pinShards = 64

// PinTable maps req_id to Pin with a TTL and a size bound. It is safe for
// concurrent use. Follow-ups that arrive before their /encode can Wait for
// the pin.
type PinTable struct {
	clk      clock.Clock
	ttl      time.Duration
	perShard int
	shards   [pinShards]pinShard

	count     atomic.Int64
	evictions atomic.Int64
}

type pinShard struct {
	mu      sync.Mutex // protects m and waiting
	m       map[string]pinEntry
	waiting map[string]*pinWaiters
}

type pinEntry struct {
	pin     Pin
	expires int64 // unix nanoseconds
}

type pinWaiters struct {
	ch chan struct{} // closed when the req_id is pinned or failed
	n  int           // goroutines waiting on ch
}

// NewPinTable returns a table holding up to max pins for ttl each.
func NewPinTable(ttl time.Duration, max int, clk clock.Clock) *PinTable {
	t := &PinTable{clk: clk, ttl: ttl, perShard: max/pinShards + 1}
	for i := range t.shards {
		t.shards[i].m = make(map[string]pinEntry)
		t.shards[i].waiting = make(map[string]*pinWaiters)
	}
	return t
}

func (t *PinTable) shard(reqID string) *pinShard {
	return &t.shards[xxhash.Sum64String(reqID)%pinShards]
}

// Set pins reqID to the encoder named encoder with identity id (see
// Encoder.ID), replacing any earlier pin or failure.
func (t *PinTable) Set(reqID, encoder string, id uint64) {
	t.store(reqID, Pin{Encoder: encoder, EncoderID: id})
}

// Fail records that reqID's /encode ended with status and message. The
// encoder it was pinned to, if any, is kept for the admin view.
func (t *PinTable) Fail(reqID string, status int, message string) {
	p, _ := t.Get(reqID)
	p.Failed, p.Status, p.Message = true, status, message
	t.store(reqID, p)
}

func (t *PinTable) store(reqID string, p Pin) {
	now := t.clk.Now().UnixNano()
	s := t.shard(reqID)
	s.mu.Lock()
	if _, exists := s.m[reqID]; !exists {
		t.count.Add(1)
		if len(s.m) >= t.perShard {
			t.makeRoom(s, now)
		}
	}
	s.m[reqID] = pinEntry{pin: p, expires: now + int64(t.ttl)}
	if w := s.waiting[reqID]; w != nil {
		close(w.ch)
		delete(s.waiting, reqID)
	}
	s.mu.Unlock()
}

// makeRoom drops one entry of a full shard: an expired one, or failing that
// the entry nearest to expiry, among a few (map order is random). It never
// walks the whole shard: a table full of live pins would otherwise scan
// max_pins/64 entries on every new req_id; Sweep removes the rest of the
// expired ones. s.mu is held.
func (t *PinTable) makeRoom(s *pinShard, now int64) {
	var victim string
	var soonest int64
	n := 0
	for k, e := range s.m {
		if n == 0 || e.expires < soonest {
			victim, soonest = k, e.expires
		}
		if n++; n == 8 || soonest <= now {
			break
		}
	}
	delete(s.m, victim)
	t.count.Add(-1)
	if soonest > now {
		t.evictions.Add(1)
	}
}

// Get returns reqID's pin if it has one that has not expired.
func (t *PinTable) Get(reqID string) (Pin, bool) {
	now := t.clk.Now().UnixNano()
	s := t.shard(reqID)
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.m[reqID]
	if !ok || e.expires <= now {
		return Pin{}, false
	}
	return e.pin, true
}

// Wait returns reqID's pin, waiting up to d for one to be set. It gives up
// early when done is closed. ok is false when no pin came.
func (t *PinTable) Wait(reqID string, d time.Duration, done <-chan struct{}) (Pin, bool) {
	if p, ok := t.Get(reqID); ok || d <= 0 {
		return p, ok
	}
	s := t.shard(reqID)
	s.mu.Lock()
	if e, ok := s.m[reqID]; ok && e.expires > t.clk.Now().UnixNano() {
		s.mu.Unlock()
		return e.pin, true
	}
	w := s.waiting[reqID]
	if w == nil {
		w = &pinWaiters{ch: make(chan struct{})}
		s.waiting[reqID] = w
	}
	w.n++
	s.mu.Unlock()

	timer := t.clk.NewTimer(d)
	select {
	case <-w.ch:
	case <-timer.C():
	case <-done:
	}
	timer.Stop()

	s.mu.Lock()
	if w.n--; w.n == 0 && s.waiting[reqID] == w {
		delete(s.waiting, reqID)
	}
	s.mu.Unlock()
	return t.Get(reqID)
}

// Delete forgets reqID.
func (t *PinTable) Delete(reqID string) {
	s := t.shard(reqID)
	s.mu.Lock()
	if _, ok := s.m[reqID]; ok {
		delete(s.m, reqID)
		t.count.Add(-1)
	}
	s.mu.Unlock()
}

// Len returns the number of pins held, expired ones not yet swept included.
func (t *PinTable) Len() int { return int(t.count.Load()) }

// Evictions returns how many live pins were dropped to respect the bound.
func (t *PinTable) Evictions() int64 { return t.evictions.Load() }

// Waiting returns how many req_ids have follow-ups waiting for a pin.
func (t *PinTable) Waiting() int {
	n := 0
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		n += len(s.waiting)
		s.mu.Unlock()
	}
	return n
}

// Sweep removes expired pins and returns how many it removed.
func (t *PinTable) Sweep() int {
	now := t.clk.Now().UnixNano()
	n := 0
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		n += t.sweepShard(s, now)
		s.mu.Unlock()
	}
	return n
}

func (t *PinTable) sweepShard(s *pinShard, now int64) int {
	n := 0
	for k, e := range s.m {
		if e.expires <= now {
			delete(s.m, k)
			n++
		}
	}
	t.count.Add(int64(-n))
	return n
}

// CountByEncoder returns the number of live pins per encoder name. It walks
// the whole table, so it is for the admin API, not the request path.
func (t *PinTable) CountByEncoder() map[string]int {
	now := t.clk.Now().UnixNano()
	out := map[string]int{}
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		for _, e := range s.m {
			if e.expires > now && e.pin.Encoder != "" {
				out[e.pin.Encoder]++
			}
		}
		s.mu.Unlock()
	}
	return out
}
