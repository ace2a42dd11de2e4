package gateway

import (
	"sync"
	"time"
)

// recentFailures keeps the last answers the gateway gave itself instead of
// an encoder's (a breaker open, no encoder usable, a timeout, a remembered
// failure), for the status page: an operator sees what callers were told
// without grepping logs. It is a fixed ring: a client that makes the gateway
// answer itself at any rate costs a bounded copy per answer, and every
// field is cut to a bounded length.
type recentFailures struct {
	mu   sync.Mutex
	ring [recentFailuresKept]recentFailure
	next int // where the next one goes
	n    int // how many are held (at most len(ring))
}

// recentFailuresKept is how many the status page shows.
const recentFailuresKept = 32

// recentFieldBytes bounds each text field kept (req_ids and messages come
// from callers and encoders).
const recentFieldBytes = 256

type recentFailure struct {
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

// add records one answer.
func (r *recentFailures) add(f recentFailure) {
	f.ReqID, f.Message, f.Encoder = cut(f.ReqID), cut(f.Message), cut(f.Encoder)
	r.mu.Lock()
	r.ring[r.next] = f
	r.next = (r.next + 1) % len(r.ring)
	if r.n < len(r.ring) {
		r.n++
	}
	r.mu.Unlock()
}

// list returns the failures held, newest first.
func (r *recentFailures) list() []recentFailure {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]recentFailure, 0, r.n)
	for i := 1; i <= r.n; i++ {
		out = append(out, r.ring[(r.next-i+len(r.ring))%len(r.ring)])
	}
	return out
}
