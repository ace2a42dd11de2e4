package admin

import (
	"sync"
	"time"
)

// Recent keeps the last answers the gateway gave itself instead of
// an encoder's (a breaker open, no encoder usable, a timeout, a remembered
// failure), for the status page: an operator sees what callers were told
// without grepping logs. It is a fixed ring: a client that makes the gateway
// answer itself at any rate costs a bounded copy per answer, and every
// field is cut to a bounded length.
type Recent struct {
	mu   sync.Mutex
	ring [RecentKept]Failure
	next int // where the next one goes
	n    int // how many are held (at most len(ring))
}

// RecentKept is how many the status page shows.
const RecentKept = 32

// recentFieldBytes bounds each text field kept (req_ids and messages come
// from callers and encoders).
const recentFieldBytes = 256

// Failure is one answer the gateway gave itself.
type Failure struct {
	At      time.Time
	Route   string
	ReqID   string
	Encoder string
	Status  int
	Kind    string
	Message string
}

func cut(s string) string {
	if len(s) > recentFieldBytes {
		return s[:recentFieldBytes] + "…"
	}
	return s
}

// Add records one answer.
func (r *Recent) Add(f Failure) {
	f.ReqID, f.Message, f.Encoder = cut(f.ReqID), cut(f.Message), cut(f.Encoder)
	r.mu.Lock()
	r.ring[r.next] = f
	r.next = (r.next + 1) % len(r.ring)
	if r.n < len(r.ring) {
		r.n++
	}
	r.mu.Unlock()
}

// List returns the failures held, newest first.
func (r *Recent) List() []Failure {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Failure, 0, r.n)
	for i := 1; i <= r.n; i++ {
		out = append(out, r.ring[(r.next-i+len(r.ring))%len(r.ring)])
	}
	return out
}
