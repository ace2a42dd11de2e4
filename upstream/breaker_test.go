package upstream

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
	"go.yaml.in/yaml/v3"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/sglang"
)

// breakerTransition is one onChange call.
type breakerTransition struct {
	name     string
	from, to BreakerState
}

func (tr breakerTransition) String() string { return fmt.Sprintf("%s->%s", tr.from, tr.to) }

// testEpoch is where the breaker tests' fake clocks start.
var testEpoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// testBreaker is a breaker on a fake clock whose transitions and trips
// arrive on channels.
type testBreaker struct {
	*Breaker
	clk   *clock.Fake
	ch    chan breakerTransition
	trips chan BreakerTrip
}

// newTestBreaker returns a breaker on a fake clock whose transitions arrive
// on the channel.
func newTestBreaker(t *testing.T, cfg BreakerConfig) (*testBreaker, <-chan breakerTransition) {
	t.Helper()
	tb := &testBreaker{clk: clock.NewFake(testEpoch), ch: make(chan breakerTransition, 64), trips: make(chan BreakerTrip, 64)}
	tb.Breaker = NewBreaker("enc-a", cfg, tb.clk, BreakerHooks{
		OnChange: func(name string, from, to BreakerState) { tb.ch <- breakerTransition{name, from, to} },
		OnTrip:   func(_ string, trip BreakerTrip) { tb.trips <- trip },
	})
	t.Cleanup(tb.Stop)
	return tb, tb.ch
}

// trip sends consecutive_failures faults and checks that the breaker
// opened, for want.
func (tb *testBreaker) trip(t *testing.T, from BreakerState, want time.Duration) {
	t.Helper()
	n := tb.cfg.ConsecutiveFailures
	if from == BreakerHalfOpen {
		n = 1
	}
	for i := 0; i < n; i++ {
		send(t, tb.Breaker, answer500)
	}
	waitTransition(t, tb.ch, from, BreakerOpen)
	if s := tb.Snapshot(); s.State != BreakerOpen || s.Ejection != want || !s.Ejected || !s.Until.Equal(tb.clk.Now().Add(want)) {
		t.Fatalf("after the trip: %+v, want open for %s", s, want)
	}
	if tr := <-tb.trips; !tr.Ejected || tr.Ejection != want {
		t.Fatalf("trip %+v, want an ejection of %s", tr, want)
	}
}

// waitTransition waits for the next onChange call; the timeout only turns a
// hang into a failure.
func waitTransition(t *testing.T, ch <-chan breakerTransition, from, to BreakerState) {
	t.Helper()
	select {
	case tr := <-ch:
		if tr.name != "enc-a" || tr.from != from || tr.to != to {
			t.Fatalf("transition %s of %q, want %s->%s", tr, tr.name, from, to)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("no %s->%s transition", from, to)
	}
}

func noTransition(t *testing.T, ch <-chan breakerTransition) {
	t.Helper()
	select {
	case tr := <-ch:
		t.Fatalf("unexpected transition %s", tr)
	default:
	}
}

// send runs one /encode through b with outcome o, as the exchange judges
// it; it fails if b refuses.
func send(t *testing.T, b interface{ Allow() (func(Mark), bool) }, o Observation) {
	t.Helper()
	done, ok := b.Allow()
	if !ok {
		t.Fatal("Allow refused")
	}
	done(mark(o))
}

// mark is the Mark the exchange's verdict gives o on /encode.
func mark(o Observation) Mark {
	return Judge(sglang.RouteEncode, nil, nil, Target{Encoder: "enc-a"}, o).Breaker
}

var (
	answer500   = Observation{Status: 500, Body: []byte(`{"status":"error","message":"CUDA error: out of memory"}`)}
	answer400   = Observation{Status: 400, Body: []byte(`{"status":"error","message":"bad request"}`)}
	answer200   = Observation{Status: 200, Body: []byte(`null`)}
	answerLag   = Observation{Status: 504, Body: []byte(`{"status":"error","message":"encode metadata not ready","req_id":"r1"}`)}
	answerGone  = Observation{Status: 500, Body: []byte(`{"status":"error","message":"no staged embedding for req_id=r1 (already released)"}`)}
	answerRelsd = Observation{Status: 500, Body: []byte(`{"status":"error","message":"Encoder request was released: r1"}`)}
	dialFailure = Observation{Err: &DialError{Encoder: "enc-a", Err: errors.New("connect: connection refused")}}
	timedOut    = Observation{Err: fmt.Errorf("exchange: %w", fasthttp.ErrTimeout)}
)

// consecutiveOnly trips on consecutive faults only.
func consecutiveOnly() BreakerConfig {
	c := DefaultBreaker()
	c.MinRequests = maxMinRequests
	return c
}

func TestBreakerTripsAfterConsecutiveFaults(t *testing.T) {
	b, ch := newTestBreaker(t, consecutiveOnly())
	for i := 0; i < 4; i++ {
		send(t, b, answer500)
	}
	send(t, b, answer200) // a success resets the run
	for i := 0; i < 4; i++ {
		send(t, b, answer500)
	}
	if s := b.State(); s != BreakerClosed {
		t.Fatalf("state after 4 faults in a row = %s", s)
	}
	if c := b.Counts(); c.ConsecutiveFailures != 4 || c.TotalFailures != 8 || c.Requests != 9 {
		t.Fatalf("counts = %+v", c)
	}
	noTransition(t, ch)
	send(t, b, answer500)
	if s := b.State(); s != BreakerOpen {
		t.Fatalf("state after 5 faults in a row = %s", s)
	}
	waitTransition(t, ch, BreakerClosed, BreakerOpen)
	if tr := <-b.trips; tr.Reason != "consecutive_failures" || !tr.Ejected || tr.Trips != 1 || tr.Ejection != 30*time.Second {
		t.Fatalf("trip %+v", tr)
	}
	if done, ok := b.Allow(); ok || done != nil {
		t.Fatal("open breaker allowed a request")
	}
}

// Issue 25: one /encode every 3 s, each a fault, never tripped a breaker
// that forgot its counts every 10 s. Faults are not forgotten with time.
func TestBreakerFaultsFarApartStillTrip(t *testing.T) {
	cfg := DefaultBreaker()
	b, ch := newTestBreaker(t, cfg)
	for i := 0; i < cfg.ConsecutiveFailures-1; i++ {
		send(t, b, answer500)
		b.clk.Advance(time.Hour)
	}
	noTransition(t, ch)
	send(t, b, answer500)
	waitTransition(t, ch, BreakerClosed, BreakerOpen)
}

func TestBreakerNoAnswerFaultsCount(t *testing.T) {
	for name, o := range map[string]Observation{"dial error": dialFailure, "timeout": timedOut,
		"broken exchange": {Err: errors.New("connection reset by peer")},
		"stale":           {Err: &StaleConnError{Err: errors.New("EOF")}}} {
		t.Run(name, func(t *testing.T) {
			b, ch := newTestBreaker(t, consecutiveOnly())
			for i := 0; i < 5; i++ {
				send(t, b, o)
			}
			waitTransition(t, ch, BreakerClosed, BreakerOpen)
			if b.State() != BreakerOpen {
				t.Fatalf("state = %s", b.State())
			}
		})
	}
}

func TestBreakerRatioTrip(t *testing.T) {
	cfg := DefaultBreaker()
	cfg.ConsecutiveFailures = 1000
	b, ch := newTestBreaker(t, cfg)
	// Ignored answers and requests still in flight count toward neither
	// min_requests nor the ratio.
	for i := 0; i < 30; i++ {
		send(t, b, answerLag)
	}
	inflight, ok := b.Allow()
	if !ok {
		t.Fatal("Allow refused")
	}
	// success, fault, success, fault...: 19 counted outcomes stay closed.
	for i := 0; i < 19; i++ {
		if i%2 == 0 {
			send(t, b, answer200)
		} else {
			send(t, b, answer500)
		}
		b.clk.Advance(time.Minute) // time forgets nothing
	}
	if s := b.State(); s != BreakerClosed {
		t.Fatalf("state after 19 outcomes = %s (counts %+v)", s, b.Counts())
	}
	if s := b.Snapshot(); s.RecentCounted != 19 || s.RecentFaults != 9 {
		t.Fatalf("ring %d/%d, want 9 faults of 19", s.RecentFaults, s.RecentCounted)
	}
	noTransition(t, ch)
	send(t, b, answer500) // 20 counted, 10 faults: ratio 0.5
	waitTransition(t, ch, BreakerClosed, BreakerOpen)
	if tr := <-b.trips; tr.Reason != "failure_ratio" {
		t.Fatalf("trip %+v", tr)
	}
	inflight(mark(answer200)) // from before the trip: no effect
	if s := b.State(); s != BreakerOpen {
		t.Fatalf("state = %s", s)
	}
}

// The ratio is over the last min_requests outcomes: older ones slide out,
// and a long good history does not dilute a recent run of faults.
func TestBreakerRatioRingSlides(t *testing.T) {
	cfg := DefaultBreaker()
	cfg.ConsecutiveFailures = 1000
	cfg.MinRequests = 4
	b, ch := newTestBreaker(t, cfg)
	send(t, b, answer500) // slides out below
	for i := 0; i < 8; i++ {
		send(t, b, answer200)
	}
	send(t, b, answer500) // ring: S S S F
	if s := b.Snapshot(); s.State != BreakerClosed || s.RecentCounted != 4 || s.RecentFaults != 1 {
		t.Fatalf("snapshot %+v, want closed with 1 fault of 4", s)
	}
	noTransition(t, ch)
	send(t, b, answer500) // ring: S S F F, 2 of 11 overall
	waitTransition(t, ch, BreakerClosed, BreakerOpen)
}

func TestBreakerRatioBelowThresholdStaysClosed(t *testing.T) {
	cfg := DefaultBreaker()
	cfg.ConsecutiveFailures = 1000
	b, ch := newTestBreaker(t, cfg)
	for i := 0; i < 300; i++ { // one fault in three
		if i%3 == 0 {
			send(t, b, answer500)
		} else {
			send(t, b, answer200)
		}
	}
	noTransition(t, ch)
	if s := b.State(); s != BreakerClosed {
		t.Fatalf("state = %s", s)
	}
}

// sglang #25811: a burst of 4xx must not open breakers; nor may the
// caller-side 5xx messages.
func TestBreakerCallerErrorsNeverTrip(t *testing.T) {
	cfg := DefaultBreaker()
	cfg.ConsecutiveFailures = 1
	cfg.MinRequests = 1
	cfg.FailureRatio = 0.01
	b, ch := newTestBreaker(t, cfg)
	for i := 0; i < 200; i++ {
		send(t, b, answer400)
		send(t, b, Observation{Status: 404 + i%20, Body: []byte(`{"message":"Unknown req_id"}`)})
		send(t, b, answerLag)
		send(t, b, answerGone)
		send(t, b, answerRelsd)
		send(t, b, Observation{Err: context.Canceled})
		send(t, b, Observation{Err: fasthttp.ErrNoFreeConns})
	}
	noTransition(t, ch)
	if s := b.State(); s != BreakerClosed {
		t.Fatalf("state = %s", s)
	}
	c := b.Counts()
	if c.TotalFailures != 0 || c.TotalSuccesses != 400 || c.TotalExclusions != 1000 || c.Requests != 1400 {
		t.Fatalf("counts = %+v", c)
	}
	if s := b.Snapshot(); s.RecentCounted != 1 || s.RecentFaults != 0 {
		t.Fatalf("ring %d/%d: ignored outcomes entered it", s.RecentFaults, s.RecentCounted)
	}
}

func TestBreakerHalfOpenCycle(t *testing.T) {
	cfg := consecutiveOnly()
	base := cfg.BaseEjectionTime.D()
	b, ch := newTestBreaker(t, cfg)
	b.trip(t, BreakerClosed, base)
	if _, ok := b.Allow(); ok {
		t.Fatal("open breaker allowed a request")
	}
	b.clk.Advance(base - time.Nanosecond)
	if _, ok := b.Allow(); ok || b.State() != BreakerOpen {
		t.Fatalf("a breaker %s short of its ejection's end allowed a request or left open", time.Nanosecond)
	}
	noTransition(t, ch)

	// Nobody asks the breaker anything: its timer on the clock moves it.
	b.clk.Advance(time.Nanosecond)
	waitTransition(t, ch, BreakerOpen, BreakerHalfOpen)
	if s := b.Snapshot(); s.State != BreakerHalfOpen || !s.Ejected {
		t.Fatalf("snapshot %+v, want half-open and still ejected", s)
	}
	probe, ok := b.Allow()
	if !ok {
		t.Fatal("half-open breaker refused its trial")
	}
	if _, ok := b.Allow(); ok {
		t.Fatal("half-open breaker allowed a second trial")
	}
	probe(mark(answer200))
	waitTransition(t, ch, BreakerHalfOpen, BreakerClosed)
	if s := b.Snapshot(); s.State != BreakerClosed || s.Ejected || s.Trips != 1 || s.Ejections != 1 {
		t.Fatalf("snapshot after a good trial %+v", s)
	}
	send(t, b, answer200)

	// Tripped again at once: the second ejection is twice the first; its
	// failed trial makes the third three times.
	b.trip(t, BreakerClosed, 2*base)
	b.clk.Advance(2 * base)
	waitTransition(t, ch, BreakerOpen, BreakerHalfOpen)
	b.trip(t, BreakerHalfOpen, 3*base)
	if _, ok := b.Allow(); ok {
		t.Fatal("reopened breaker allowed a request")
	}
	b.clk.Advance(3 * base)
	waitTransition(t, ch, BreakerOpen, BreakerHalfOpen)
	if s := b.Snapshot(); s.Ejections != 3 || s.Trips != 3 {
		t.Fatalf("snapshot %+v, want 3 ejections", s)
	}
}

// Each trip of the same encoder ejects it for one more base, up to the max.
func TestBreakerEjectionGrowsAndIsCapped(t *testing.T) {
	cfg := consecutiveOnly()
	cfg.BaseEjectionTime = configfile.Duration(30 * time.Second)
	cfg.MaxEjectionTime = configfile.Duration(100 * time.Second)
	b, ch := newTestBreaker(t, cfg)
	want := []time.Duration{30 * time.Second, 60 * time.Second, 90 * time.Second, 100 * time.Second, 100 * time.Second}
	b.trip(t, BreakerClosed, want[0])
	for _, d := range want[1:] {
		b.clk.Advance(b.Snapshot().Ejection)
		waitTransition(t, ch, BreakerOpen, BreakerHalfOpen)
		b.trip(t, BreakerHalfOpen, d) // its trial fails
	}
	if d := cfg.ejectionFor(1 << 40); d != 100*time.Second {
		t.Fatalf("ejectionFor(2^40) = %s: overflowed past the cap", d)
	}
}

// A closed breaker forgets one trip per full ejection_decay without one;
// an ejected one forgets nothing.
func TestBreakerEjectionDecay(t *testing.T) {
	cfg := consecutiveOnly()
	base, decay := cfg.BaseEjectionTime.D(), cfg.EjectionDecay.D()
	b, ch := newTestBreaker(t, cfg)
	// Three ejections: 1, 2, 3 bases; the last lasts longer than a decay
	// period and forgets nothing meanwhile.
	b.trip(t, BreakerClosed, base)
	for k := 2; k <= 3; k++ {
		b.clk.Advance(b.Snapshot().Ejection)
		waitTransition(t, ch, BreakerOpen, BreakerHalfOpen)
		b.trip(t, BreakerHalfOpen, time.Duration(k)*base)
	}
	if 3*base <= decay {
		t.Fatalf("the test needs an ejection longer than the decay period")
	}
	b.clk.Advance(3 * base)
	waitTransition(t, ch, BreakerOpen, BreakerHalfOpen)
	send(t, b, answer200)
	waitTransition(t, ch, BreakerHalfOpen, BreakerClosed)
	if n := b.Snapshot().Trips; n != 3 {
		t.Fatalf("trips after the ejections = %d, want 3", n)
	}
	b.clk.Advance(decay - time.Nanosecond)
	if n := b.Snapshot().Trips; n != 3 {
		t.Fatalf("trips short of a decay period = %d, want 3", n)
	}
	b.clk.Advance(time.Nanosecond)
	if n := b.Snapshot().Trips; n != 2 {
		t.Fatalf("trips after a decay period = %d, want 2", n)
	}
	b.clk.Advance(decay + decay/2) // one more full period, and half of one
	if n := b.Snapshot().Trips; n != 1 {
		t.Fatalf("trips after two and a half periods = %d, want 1", n)
	}
	b.clk.Advance(decay / 2) // the half completes the third period
	if n := b.Snapshot().Trips; n != 0 {
		t.Fatalf("trips after three periods = %d, want 0", n)
	}
	b.clk.Advance(10 * decay)
	b.trip(t, BreakerClosed, base) // back at base
	b.clk.Advance(base)
	waitTransition(t, ch, BreakerOpen, BreakerHalfOpen)
	send(t, b, answer200)
	waitTransition(t, ch, BreakerHalfOpen, BreakerClosed)
	b.clk.Advance(decay / 2)
	b.trip(t, BreakerClosed, 2*base) // within a period: remembered
}

func TestBreakerHalfOpenIgnoredProbeFreesTheSlot(t *testing.T) {
	cfg := consecutiveOnly()
	b, ch := newTestBreaker(t, cfg)
	b.trip(t, BreakerClosed, cfg.BaseEjectionTime.D())
	b.clk.Advance(cfg.BaseEjectionTime.D())
	waitTransition(t, ch, BreakerOpen, BreakerHalfOpen)
	send(t, b, answerLag) // says nothing about the encoder
	done, ok := b.Allow() // a request the gateway never sent
	if !ok {
		t.Fatal("an ignored trial kept its slot")
	}
	done(MarkNone)
	if s := b.State(); s != BreakerHalfOpen {
		t.Fatalf("state = %s", s)
	}
	send(t, b, answer400) // an answer: the encoder is back
	waitTransition(t, ch, BreakerHalfOpen, BreakerClosed)
}

// half_open_requests trials go; all must succeed, one fault reopens.
func TestBreakerHalfOpenRequests(t *testing.T) {
	cfg := consecutiveOnly()
	cfg.HalfOpenRequests = 3
	base := cfg.BaseEjectionTime.D()
	b, ch := newTestBreaker(t, cfg)
	b.trip(t, BreakerClosed, base)
	trials := func() []func(Mark) {
		t.Helper()
		var out []func(Mark)
		for i := 0; i < 3; i++ {
			done, ok := b.Allow()
			if !ok {
				t.Fatalf("trial %d refused", i)
			}
			out = append(out, done)
		}
		if _, ok := b.Allow(); ok {
			t.Fatal("fourth trial allowed")
		}
		return out
	}
	b.clk.Advance(base)
	waitTransition(t, ch, BreakerOpen, BreakerHalfOpen)
	probes := trials()
	probes[0](MarkSuccess)
	probes[1](MarkFault)
	waitTransition(t, ch, BreakerHalfOpen, BreakerOpen)
	probes[2](MarkSuccess) // of the last generation: no effect
	if s := b.Snapshot(); s.State != BreakerOpen || s.Ejection != 2*base {
		t.Fatalf("snapshot %+v", s)
	}
	b.clk.Advance(2 * base)
	waitTransition(t, ch, BreakerOpen, BreakerHalfOpen)
	probes = trials()
	probes[0](MarkSuccess)
	probes[1](MarkSuccess)
	if s := b.State(); s != BreakerHalfOpen {
		t.Fatalf("state after 2 of 3 = %s", s)
	}
	probes[2](MarkSuccess)
	waitTransition(t, ch, BreakerHalfOpen, BreakerClosed)
}

// A gate that admits nothing keeps the encoder in service: the trip is
// counted and the breaker counts afresh.
type refusingGate struct{ admits, releases atomic.Int32 }

func (g *refusingGate) Admit(*Breaker) bool { g.admits.Add(1); return false }
func (g *refusingGate) Release(*Breaker)    { g.releases.Add(1) }

func TestBreakerGateKeepsInService(t *testing.T) {
	cfg := consecutiveOnly()
	var g refusingGate
	ch := make(chan breakerTransition, 8)
	trips := make(chan BreakerTrip, 8)
	b := NewBreaker("enc-a", cfg, clock.NewFake(testEpoch), BreakerHooks{
		OnChange: func(n string, from, to BreakerState) { ch <- breakerTransition{n, from, to} },
		OnTrip:   func(_ string, tr BreakerTrip) { trips <- tr },
		Gate:     &g,
	})
	defer b.Stop()
	for i := 0; i < 5; i++ {
		send(t, b, answer500)
	}
	if tr := <-trips; tr.Ejected || tr.Reason != "consecutive_failures" {
		t.Fatalf("trip %+v, want one kept in service", tr)
	}
	noTransition(t, ch)
	s := b.Snapshot()
	if s.State != BreakerClosed || s.Ejected || s.Skipped != 1 || s.Ejections != 0 || s.Counts.ConsecutiveFailures != 0 || s.Trips != 0 {
		t.Fatalf("snapshot %+v", s)
	}
	// Counting starts afresh: four more faults are not a trip.
	for i := 0; i < 4; i++ {
		send(t, b, answer500)
	}
	if g.admits.Load() != 1 {
		t.Fatalf("gate asked %d times", g.admits.Load())
	}
	send(t, b, answer500)
	if g.admits.Load() != 2 || b.Snapshot().Skipped != 2 {
		t.Fatalf("gate asked %d times, %d skipped", g.admits.Load(), b.Snapshot().Skipped)
	}
	if g.releases.Load() != 0 {
		t.Fatal("released what it never held")
	}
}

func TestBreakerDoneTwiceCountsOnce(t *testing.T) {
	b, _ := newTestBreaker(t, consecutiveOnly())
	done, _ := b.Allow()
	done(mark(answer500))
	done(mark(answer500))
	if c := b.Counts(); c.TotalFailures != 1 || c.Requests != 1 {
		t.Fatalf("counts = %+v", c)
	}
}

func TestBreakerDisabled(t *testing.T) {
	cfg := DefaultBreaker()
	cfg.Disabled = true
	cfg.ConsecutiveFailures = 1
	b, ch := newTestBreaker(t, cfg)
	for i := 0; i < 100; i++ {
		send(t, b, dialFailure)
		send(t, b, answer500)
	}
	noTransition(t, ch)
	if s := b.State(); s != BreakerClosed {
		t.Fatalf("state = %s", s)
	}
	if c := b.Counts(); c != (BreakerCounts{}) {
		t.Fatalf("counts = %+v", c)
	}
}

func TestBreakerStopSilencesHooksAndTimer(t *testing.T) {
	cfg := consecutiveOnly()
	b, ch := newTestBreaker(t, cfg)
	b.trip(t, BreakerClosed, cfg.BaseEjectionTime.D())
	if n := b.clk.Pending(); n != 1 {
		t.Fatalf("%d timers pending on an open breaker, want 1", n)
	}
	b.Stop()
	if n := b.clk.Pending(); n != 0 {
		t.Fatalf("%d timers pending after Stop", n)
	}
	b.clk.Advance(cfg.BaseEjectionTime.D())
	if s := b.State(); s != BreakerHalfOpen {
		t.Fatalf("state = %s", s)
	}
	send(t, b, answer500)
	if s := b.State(); s != BreakerOpen {
		t.Fatalf("state = %s", s)
	}
	noTransition(t, ch)
	if len(b.trips) != 0 {
		t.Fatalf("%d trips heard after Stop", len(b.trips))
	}
	b.Stop() // twice is fine
}

func TestBreakerNilHooksAndClock(t *testing.T) {
	cfg := consecutiveOnly()
	b := NewBreaker("enc-a", cfg, nil, BreakerHooks{})
	defer b.Stop()
	for i := 0; i < 5; i++ {
		send(t, b, answer500)
	}
	if b.State() != BreakerOpen {
		t.Fatal("breaker did not trip")
	}
	if b.Name() != "enc-a" {
		t.Fatalf("Name = %q", b.Name())
	}
}

// countingGate admits every ejection and counts what the breaker asks.
type countingGate struct{ admits, releases atomic.Int64 }

func (g *countingGate) Admit(*Breaker) bool { g.admits.Add(1); return true }
func (g *countingGate) Release(*Breaker)    { g.releases.Add(1) }

// Eight goroutines hammer one breaker (a quarter of the outcomes faults, a
// share that trips it; the clock moving past ejections) while reading it. Whatever the interleaving, the
// breaker must keep its invariants: its state changes form one chain of
// legal edges starting at closed; each ejection is one trip, one change to
// open and, from closed, one Admit of the gate, and every Admit is
// Released once it closes or stops; the half-open trials never exceed
// half_open_requests; and the counts it ends with add up.
func TestBreakerConcurrent(t *testing.T) {
	cfg := DefaultBreaker()
	cfg.HalfOpenRequests = 3
	cfg.FailureRatio, cfg.MinRequests = 0.25, 12
	clk := clock.NewFake(testEpoch)
	gate := &countingGate{}
	type change struct{ from, to BreakerState }
	var (
		mu      sync.Mutex
		changes []change
		trips   []BreakerTrip
	)
	b := NewBreaker("enc-a", cfg, clk, BreakerHooks{
		OnChange: func(_ string, from, to BreakerState) {
			mu.Lock()
			changes = append(changes, change{from, to})
			mu.Unlock()
		},
		OnTrip: func(_ string, trip BreakerTrip) {
			mu.Lock()
			trips = append(trips, trip)
			mu.Unlock()
		},
		Gate: gate,
	})
	var admitted, reported atomic.Int64
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 1)) // seeded: a fault in four, no pattern
			report := func(done func(Mark)) {
				if rng.IntN(4) == 0 {
					done(MarkFault)
				} else {
					done(MarkSuccess)
				}
				done(MarkFault) // a second call is ignored
				reported.Add(1)
			}
			// Half the requests stay in flight for one more turn of this
			// goroutine's loop: trials overlap, and some answers come
			// after the state they were sent in.
			var pending func(Mark)
			defer func() {
				if pending != nil {
					report(pending)
				}
			}()
			for i := 0; i < 2000; i++ {
				held := pending
				pending = nil
				done, ok := b.Allow()
				// Looked at while the held answer is still out.
				if s := b.Snapshot(); s.State == BreakerHalfOpen && s.Counts.Requests > uint32(cfg.HalfOpenRequests) {
					t.Errorf("half-open with %d requests admitted, half_open_requests is %d", s.Counts.Requests, cfg.HalfOpenRequests)
				}
				if ok {
					admitted.Add(1)
					if rng.IntN(2) == 0 {
						report(done)
					} else {
						pending = done
					}
				}
				if held != nil {
					report(held)
				}
				if i%10 == 0 {
					clk.Advance(time.Minute)
				}
				_ = b.State()
				_ = b.Counts()
			}
		}()
	}
	wg.Wait()
	final := b.Snapshot()
	b.Stop()

	mu.Lock()
	defer mu.Unlock()
	if admitted.Load() == 0 || admitted.Load() != reported.Load() {
		t.Fatalf("admitted %d, reported %d", admitted.Load(), reported.Load())
	}
	legal := map[change]bool{
		{BreakerClosed, BreakerOpen}: true, {BreakerOpen, BreakerHalfOpen}: true,
		{BreakerHalfOpen, BreakerClosed}: true, {BreakerHalfOpen, BreakerOpen}: true,
	}
	state, toOpen, fromClosed, closes := BreakerClosed, 0, 0, 0
	for i, c := range changes {
		if c.from != state || !legal[c] {
			t.Fatalf("change %d: %v->%v after %v (changes %v)", i, c.from, c.to, state, changes)
		}
		state = c.to
		switch c {
		case change{BreakerClosed, BreakerOpen}:
			toOpen++
			fromClosed++
		case change{BreakerHalfOpen, BreakerOpen}:
			toOpen++
		case change{BreakerHalfOpen, BreakerClosed}:
			closes++
		}
	}
	if state != final.State {
		t.Errorf("the changes end at %v, the breaker is %v", state, final.State)
	}
	if toOpen == 0 {
		t.Fatalf("the breaker never tripped: the test exercised nothing (%d admitted, %+v)", admitted.Load(), final)
	}
	if len(trips) != toOpen || int(final.Ejections) != toOpen || final.Skipped != 0 {
		t.Errorf("%d trips, %d ejections, %d skipped; %d changes to open", len(trips), final.Ejections, final.Skipped, toOpen)
	}
	for i, tr := range trips {
		if !tr.Ejected || tr.Trips < 1 || tr.Ejection != cfg.ejectionFor(tr.Trips) {
			t.Errorf("trip %d: %+v", i, tr)
		}
	}
	if int(gate.admits.Load()) != fromClosed {
		t.Errorf("the gate admitted %d ejections; %d trips from closed", gate.admits.Load(), fromClosed)
	}
	// Each admitted ejection gives its place back when the breaker closes
	// or, still ejected, stops.
	if gate.admits.Load() != gate.releases.Load() {
		t.Errorf("the gate admitted %d ejections and had %d released", gate.admits.Load(), gate.releases.Load())
	}
	if want := int64(closes); final.Ejected && gate.releases.Load() != want+1 || !final.Ejected && gate.releases.Load() != want {
		t.Errorf("%d releases with %d closes (ejected at the end: %v)", gate.releases.Load(), closes, final.Ejected)
	}
	// Every request admitted since the last change has reported: the
	// counts add up, and what they hold fits the state.
	c := final.Counts
	if c.Requests != c.TotalSuccesses+c.TotalFailures+c.TotalExclusions || c.TotalExclusions != 0 {
		t.Errorf("final counts %+v do not add up", c)
	}
	switch final.State {
	case BreakerClosed:
		if int(c.ConsecutiveFailures) >= cfg.ConsecutiveFailures ||
			final.RecentCounted != min(int(c.TotalSuccesses+c.TotalFailures), cfg.MinRequests) ||
			final.RecentFaults > int(c.TotalFailures) ||
			(final.RecentCounted == cfg.MinRequests && float64(final.RecentFaults) >= cfg.FailureRatio*float64(cfg.MinRequests)) {
			t.Errorf("closed with counts %+v, ring %d of %d faults: it should have tripped, or the ring is off", c, final.RecentFaults, final.RecentCounted)
		}
	case BreakerHalfOpen:
		if c.Requests > uint32(cfg.HalfOpenRequests) || c.TotalFailures != 0 || int(c.TotalSuccesses) >= cfg.HalfOpenRequests {
			t.Errorf("half-open with counts %+v (half_open_requests %d)", c, cfg.HalfOpenRequests)
		}
	case BreakerOpen:
		if c.Requests != 0 || !final.Ejected {
			t.Errorf("open with counts %+v, ejected %v", c, final.Ejected)
		}
	}
	t.Logf("%d admitted; %d changes: %d ejections (%d from closed), %d closes; ends %v", admitted.Load(), len(changes), toOpen, fromClosed, closes, final.State)
}

func TestBreakerStateString(t *testing.T) {
	for s, want := range map[BreakerState]string{BreakerClosed: "closed", BreakerHalfOpen: "half_open", BreakerOpen: "open", 7: "unknown(7)"} {
		if got := s.String(); got != want {
			t.Errorf("%d.String() = %q, want %q", int(s), got, want)
		}
	}
	if BreakerClosed != 0 || BreakerHalfOpen != 1 || BreakerOpen != 2 {
		t.Fatal("gauge values changed")
	}
}

func TestBreakerValidate(t *testing.T) {
	var p configfile.Problems
	DefaultBreaker().Validate(&p, "breaker")
	if err := p.Err(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	d := DefaultBreaker()
	if len(d.Ignore) != 0 || d.ConsecutiveFailures != 5 || d.FailureRatio != 0.5 || d.MinRequests != 20 ||
		d.BaseEjectionTime.D() != 30*time.Second || d.MaxEjectionTime.D() != 300*time.Second ||
		d.EjectionDecay.D() != 60*time.Second || d.MaxEjectedPercent != 50 || d.HalfOpenRequests != 1 || d.Disabled {
		t.Fatalf("defaults = %+v", d)
	}

	bad := BreakerConfig{
		ConsecutiveFailures: 0,
		FailureRatio:        1.5,
		MinRequests:         -1,
		BaseEjectionTime:    0,
		MaxEjectionTime:     -1,
		EjectionDecay:       0,
		MaxEjectedPercent:   101,
		HalfOpenRequests:    0,
		Ignore: []Condition{
			{Kind: OnStatus, Status: 504, BodyContains: "x"},
			{Kind: OnConnectFailure},
			{Kind: OnTimeout},
		},
	}
	p = configfile.Problems{}
	bad.Validate(&p, "breaker")
	err := p.Err()
	if err == nil {
		t.Fatal("bad config accepted")
	}
	msg := err.Error()
	for _, want := range []string{
		"breaker.consecutive_failures: must be >= 1",
		"breaker.failure_ratio: must be in (0, 1]",
		"breaker.min_requests: must be >= 1",
		"breaker.base_ejection_time: must be > 0",
		"breaker.max_ejection_time: must be >= base_ejection_time (0s), got -1ns",
		"breaker.ejection_decay: must be > 0",
		"breaker.max_ejected_percent: must be between 0 and 100, got 101",
		"breaker.half_open_requests: must be >= 1",
		"breaker.ignore[1]: connect_failure cannot be ignored",
		"breaker.ignore[2]: timeout cannot be ignored",
	} {
		if !strings.Contains(msg, want) {
			t.Errorf("problems lack %q:\n%s", want, msg)
		}
	}
	if strings.Contains(msg, "ignore[0]") {
		t.Errorf("a status condition was refused:\n%s", msg)
	}
	for _, mut := range []struct {
		f    func(*BreakerConfig)
		want string
	}{
		{func(c *BreakerConfig) { c.FailureRatio = 0 }, "failure_ratio"},
		{func(c *BreakerConfig) { c.FailureRatio = -0.1 }, "failure_ratio"},
		{func(c *BreakerConfig) { c.FailureRatio = 1.0000001 }, "failure_ratio"},
		{func(c *BreakerConfig) { c.MinRequests = maxMinRequests + 1 }, "b.min_requests: must be <= 65536, got 65537"},
		{func(c *BreakerConfig) { c.MaxEjectedPercent = -1 }, "b.max_ejected_percent: must be between 0 and 100, got -1"},
		{func(c *BreakerConfig) { c.MaxEjectionTime = configfile.Duration(29 * time.Second) },
			"b.max_ejection_time: must be >= base_ejection_time (30s), got 29s"},
	} {
		c := DefaultBreaker()
		mut.f(&c)
		p = configfile.Problems{}
		c.Validate(&p, "b")
		if err := p.Err(); err == nil || !strings.Contains(err.Error(), mut.want) {
			t.Errorf("%+v: %v, want %q", c, err, mut.want)
		}
	}
	for _, mut := range []func(*BreakerConfig){
		func(c *BreakerConfig) { c.FailureRatio = 1 },
		func(c *BreakerConfig) { c.MaxEjectedPercent = 0 },
		func(c *BreakerConfig) { c.MaxEjectedPercent = 100 },
		func(c *BreakerConfig) { c.MinRequests = maxMinRequests },
		func(c *BreakerConfig) { c.MaxEjectionTime = c.BaseEjectionTime },
	} {
		c := DefaultBreaker()
		mut(&c)
		p = configfile.Problems{}
		c.Validate(&p, "b")
		if err := p.Err(); err != nil {
			t.Errorf("%+v refused: %v", c, err)
		}
	}
}

func TestBreakerYAML(t *testing.T) {
	cfg := DefaultBreaker()
	err := configfile.Decode([]byte(`
consecutive_failures: 3
failure_ratio: 0.25
min_requests: 8
base_ejection_time: 5s
max_ejection_time: 1m
ejection_decay: 2m
max_ejected_percent: 34
half_open_requests: 2
ignore:
  - {status: 504, body_contains: "encode metadata not ready"}
disabled: false
`), &cfg)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.ConsecutiveFailures != 3 || cfg.FailureRatio != 0.25 || cfg.MinRequests != 8 ||
		cfg.BaseEjectionTime.D() != 5*time.Second || cfg.MaxEjectionTime.D() != time.Minute ||
		cfg.EjectionDecay.D() != 2*time.Minute || cfg.MaxEjectedPercent != 34 || cfg.HalfOpenRequests != 2 ||
		len(cfg.Ignore) != 1 || cfg.Ignore[0] != (Condition{Kind: OnStatus, Status: 504, BodyContains: "encode metadata not ready"}) {
		t.Fatalf("decoded %+v", cfg)
	}
	var p configfile.Problems
	cfg.Validate(&p, "breaker")
	if err := p.Err(); err != nil {
		t.Fatal(err)
	}

	cfg = DefaultBreaker()
	if err := configfile.Decode([]byte("ignore: [connect_failure]\n"), &cfg); err != nil {
		t.Fatal(err)
	}
	p = configfile.Problems{}
	cfg.Validate(&p, "breaker")
	if err := p.Err(); err == nil || !strings.Contains(err.Error(), "breaker.ignore[0]") {
		t.Fatalf("connect_failure in ignore: %v", err)
	}
}

// The keys of the gobreaker-era breaker are refused with what replaced
// them, and are never written out.
func TestBreakerMovedKeys(t *testing.T) {
	cfg := DefaultBreaker()
	if err := configfile.Decode([]byte("interval: 10s\nopen_timeout: 30s\n"), &cfg); err != nil {
		t.Fatal(err)
	}
	var p configfile.Problems
	cfg.Validate(&p, "breaker")
	err := p.Err()
	if err == nil {
		t.Fatal("interval and open_timeout accepted")
	}
	for _, want := range []string{
		"breaker.interval: is gone: faults are no longer counted in a time window that forgets them; the breaker trips on breaker.consecutive_failures in a row, or on breaker.failure_ratio over the last breaker.min_requests outcomes",
		"breaker.open_timeout: is gone: an ejection lasts breaker.base_ejection_time times the encoder's trips, up to breaker.max_ejection_time",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("problems lack %q:\n%v", want, err)
		}
	}
	out, err := yaml.Marshal(DefaultBreaker())
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(out), "interval") || strings.Contains(string(out), "open_timeout") {
		t.Fatalf("a moved key is written out:\n%s", out)
	}
}

// A dial to a dead address, through a dialer like the pool's, is a fault.
func TestBreakerCountsARealDialError(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	c := deadClient(addr)
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI("http://" + addr + "/encode")
	req.Header.SetMethod("POST")
	err = c.DoTimeout(req, resp, 5*time.Second)
	v := Judge(sglang.RouteEncode, nil, nil, Target{Encoder: "enc-a"}, Observation{Err: err})
	if err == nil || v.Kind != KindDialFailed || v.Delivery != NotSent || v.Breaker != MarkFault {
		t.Fatalf("err = %v: verdict %+v", err, v)
	}
}

// deadClient is a HostClient with a dialer that reports failures as the
// pool's does.
func deadClient(addr string) *fasthttp.HostClient {
	return &fasthttp.HostClient{
		Addr:       addr,
		RetryIfErr: func(*fasthttp.Request, int, error) (bool, bool) { return false, false },
		Dial: func(a string) (net.Conn, error) {
			c, err := net.DialTimeout("tcp", a, 5*time.Second)
			if err != nil {
				return nil, &DialError{Encoder: "enc-a", Err: err}
			}
			return c, nil
		},
	}
}
