package idempotency

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
)

// hookStore is a Store whose Lookup and Claim can be replaced, over a
// memory store.
type hookStore struct {
	*Memory
	lookup func(ctx context.Context, k Key) (Record, bool, bool, error)
	claim  func(ctx context.Context, k Key, fp Fingerprint) (Claim, error)
}

func (h *hookStore) Lookup(ctx context.Context, k Key) (Record, bool, bool, error) {
	if h.lookup != nil {
		return h.lookup(ctx, k)
	}
	return h.Memory.Lookup(ctx, k)
}

func (h *hookStore) Claim(ctx context.Context, k Key, fp Fingerprint) (Claim, error) {
	if h.claim != nil {
		return h.claim(ctx, k, fp)
	}
	return h.Memory.Claim(ctx, k, fp)
}

// leaderWithWaiters runs a leader for req on s and, once its forward (or
// Claim) has closed entered, n identical callers; when they are all parked
// on their deadline timers it closes proceed, which lets the leader end.
// It returns the leader's result and the waiters'.
func leaderWithWaiters(t *testing.T, s *Sends, clk *clock.Fake, req Send, n int,
	forward ForwardFunc, entered <-chan struct{}, proceed chan<- struct{}) (Result, []Result) {
	t.Helper()
	leader := make(chan Result, 1)
	go func() { leader <- s.Do(bg, req, clk.Now().Add(time.Hour), forward) }()
	<-entered
	waiters := make([]Result, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			waiters[i] = s.Do(bg, req, clk.Now().Add(time.Hour), nil)
		}()
	}
	// Every waiter is parked on its deadline timer, so it joined the
	// flight; the fake clock never fires them.
	waitFor(t, "the waiters to park", func() bool { return clk.Pending() == n })
	close(proceed)
	return recv(t, "the leader", leader), waitAll(t, &wg, waiters)
}

func waitAll(t *testing.T, wg *sync.WaitGroup, out []Result) []Result {
	t.Helper()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	recv(t, "the waiters", done)
	return out
}

// A forward that panics after it may have sent the /send: the gateway
// stays up (no panic escapes Do), the leader and every waiter get a 500
// naming the failure, and the key is never forwarded again: the 500 is
// its record.
func TestSendsForwardPanicReleasesItsWaiters(t *testing.T) {
	clk := clock.NewFake(t0)
	mem := NewMemory(1000, 1024, time.Hour, clk)
	reg := prometheus.NewRegistry()
	s := NewSends(mem, DefaultConfig(), clk, zap.NewNop(), NewMetrics(reg, mem))
	entered := make(chan struct{})
	proceed := make(chan struct{})
	var forwards atomic.Int32
	forward := func(time.Duration) (Answer, bool) {
		forwards.Add(1)
		close(entered)
		<-proceed
		panic("boom in the answer copy")
	}
	req := sendReq("h:1", Fingerprint{1, 2}, 2)
	lead, waiters := leaderWithWaiters(t, s, clk, req, 8, forward, entered, proceed)
	if lead.Outcome != Failed || lead.Status != 500 || !strings.Contains(lead.Err.Error(), "may have reached the encoder") {
		t.Fatalf("leader: %+v", lead)
	}
	for i, w := range waiters {
		if w.Outcome != Failed || w.Status != 500 || w.Err == nil {
			t.Fatalf("waiter %d: %+v", i, w)
		}
	}
	later := s.Do(bg, req, clk.Now().Add(time.Hour), forward)
	if later.Outcome != Replayed || later.Answer.Status != 500 || !strings.Contains(string(later.Answer.Body), `"req_id":"r"`) {
		t.Fatalf("a later duplicate: %+v (%s)", later, later.Answer.Body)
	}
	if n := forwards.Load(); n != 1 {
		t.Fatalf("%d forwards, want 1", n)
	}
	if got := metricValue(t, reg, "encgate_send_forward_panics_total"); got != 1 {
		t.Errorf("encgate_send_forward_panics_total = %v", got)
	}
}

// A panic before anything was forwarded (here in the store's Claim)
// abandons the key: the next call forwards it.
func TestSendsPanicBeforeForwardingLeavesTheKeyFree(t *testing.T) {
	clk := clock.NewFake(t0)
	mem := NewMemory(1000, 1024, time.Hour, clk)
	h := &hookStore{Memory: mem}
	h.claim = func(context.Context, Key, Fingerprint) (Claim, error) { panic("boom in claim") }
	s := NewSends(h, DefaultConfig(), clk, zap.NewNop(), NewMetrics(prometheus.NewRegistry(), mem))
	forwards := 0
	fwd := func(time.Duration) (Answer, bool) { forwards++; return okAnswer, true }
	req := sendReq("h:1", Fingerprint{}, 0)
	if r := s.Do(bg, req, clk.Now().Add(time.Hour), fwd); r.Outcome != Failed || r.Status != 500 ||
		!strings.Contains(r.Err.Error(), "was not sent") {
		t.Fatalf("panicking claim: %+v", r)
	}
	h.claim = nil
	if r := s.Do(bg, req, clk.Now().Add(time.Hour), fwd); r.Outcome != Forwarded || forwards != 1 {
		t.Fatalf("after the panic: %+v, %d forwards", r, forwards)
	}
}

// Waiters coalesced on a leader that was refused get that refusal, not an
// empty answer: here the destination bound (400) and an unreachable store
// (503).
func TestSendsWaitersGetTheirLeadersRefusal(t *testing.T) {
	for name, refusal := range map[string]error{
		"bound":       &DestinationLimitError{ReqID: "r", Dest: "h:1", Limit: 1, Bound: "idempotency.max_destinations_per_req_id"},
		"unavailable": &unavailableError{op: "claim", err: errors.New("connection refused")},
	} {
		t.Run(name, func(t *testing.T) {
			clk := clock.NewFake(t0)
			mem := NewMemory(1000, 1024, time.Hour, clk)
			entered := make(chan struct{})
			proceed := make(chan struct{})
			h := &hookStore{Memory: mem, claim: func(context.Context, Key, Fingerprint) (Claim, error) {
				close(entered)
				<-proceed
				return Claim{}, refusal
			}}
			s := NewSends(h, DefaultConfig(), clk, zap.NewNop(), NewMetrics(prometheus.NewRegistry(), mem))
			lead, waiters := leaderWithWaiters(t, s, clk, sendReq("h:1", Fingerprint{}, 0), 4, nil, entered, proceed)
			for i, r := range append([]Result{lead}, waiters...) {
				if r.Outcome == Inflight || r.Err == nil || !errors.Is(r.Err, refusal) && !strings.Contains(r.Err.Error(), refusal.Error()) {
					t.Fatalf("caller %d: %+v, want the refusal %v", i, r, refusal)
				}
			}
		})
	}
}

// With fail_open, a forward made without dedupe (the store unreachable)
// that panics is answered too; nothing is stored.
func TestSendsFailOpenForwardPanicIsAnswered(t *testing.T) {
	clk := clock.NewFake(t0)
	mem := NewMemory(1000, 1024, time.Hour, clk)
	h := &hookStore{Memory: mem, lookup: func(context.Context, Key) (Record, bool, bool, error) {
		return Record{}, false, false, &unavailableError{op: "lookup", err: errors.New("connection refused")}
	}}
	cfg := DefaultConfig()
	cfg.FailOpen = true
	reg := prometheus.NewRegistry()
	s := NewSends(h, cfg, clk, zap.NewNop(), NewMetrics(reg, mem))
	r := s.Do(bg, sendReq("h:1", Fingerprint{}, 0), clk.Now().Add(time.Hour), func(time.Duration) (Answer, bool) { panic("boom") })
	if r.Outcome != Failed || r.Status != 500 || mem.Records() != 0 {
		t.Fatalf("%+v, %d records", r, mem.Records())
	}
	if got := metricValue(t, reg, "encgate_send_forward_panics_total"); got != 1 {
		t.Errorf("encgate_send_forward_panics_total = %v", got)
	}
}
