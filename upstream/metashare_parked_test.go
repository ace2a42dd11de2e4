package upstream

import (
	"context"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
)

// Parked pulls share a flight too: a pull of a part whose pull (another
// TP rank's) is at the encoder waits for it parked, with no goroutine of
// its own, and judges its answer as a pull that waited on its goroutine
// would.

func metaPoolParked(t *testing.T, encs ...string) (*Pool, *prometheus.Registry) {
	t.Helper()
	aff := DefaultAffinity()
	aff.UnknownWait = 0
	set := testSettings(encs...)
	set.Retry.Metadata.MaxAttempts = 1 // each pull one attempt: the counts are the round trips
	reg := prometheus.NewRegistry()
	p, err := NewPool(set, aff, Deps{Log: zap.NewNop(), Registry: reg, Clock: clock.NewFake(time.Unix(1e9, 0)),
		Rand: func() float64 { return 0 }, Park: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p, reg
}

// pullParked runs c through ExchangeParked on a goroutine of its own and
// returns, once ExchangeParked has (the call ended or parked), the channel
// its result comes on, however the call ends. Its Stop and Done end with
// stop. A call that waits on that goroutine fails the test.
func pullParked(t *testing.T, p *Pool, c *Call, stop context.Context) <-chan Result {
	t.Helper()
	c.Stop, c.Done = stop, stop.Done()
	out := make(chan Result, 1)
	returned := make(chan struct{})
	go func() {
		defer close(returned)
		if res, ended := p.ExchangeParked(c, func(res Result) { out <- res }); ended {
			out <- res
		}
	}()
	select {
	case <-returned:
	case <-time.After(10 * time.Second):
		t.Fatal("ExchangeParked did not return: the pull waits on its goroutine")
	}
	return out
}

// runGoroutines counts goroutines inside a call's run or a flight wait.
func runGoroutines(t *testing.T) int {
	t.Helper()
	var b strings.Builder
	if err := pprof.Lookup("goroutine").WriteTo(&b, 2); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, g := range strings.Split(b.String(), "\n\n") {
		if strings.Contains(g, "upstream.(*run)") || strings.Contains(g, "upstream.(*metaShare).wait") {
			n++
		}
	}
	return n
}

// pullsOnAFlight pins id's part to enc-0 and runs k parked pulls of it:
// the first held by enc, the others parked on its flight once it returns.
func pullsOnAFlight(t *testing.T, p *Pool, enc *metaEncoder, id string, k int) []<-chan Result {
	t.Helper()
	e0, _ := p.Lookup("enc-0")
	p.pins.Set(id, "enc-0", e0.ID())
	out := make([]<-chan Result, k)
	out[0] = pullParked(t, p, pullCall(id, 0), context.Background())
	<-enc.arrived
	for i := 1; i < k; i++ {
		out[i] = pullParked(t, p, pullCall(id, 0), context.Background())
	}
	waitFlightWaiters(t, p, int64(k-1))
	return out
}

func TestParkedPullsShareAFlightWithNoGoroutine(t *testing.T) {
	enc := newMetaEncoder(t, "enc-0", true)
	p, reg := metaPoolParked(t, "enc-0", enc.srv.URL)
	const tp = 8
	out := pullsOnAFlight(t, p, enc, "req-p_local_part_0", tp)
	if got := flightWaiters(p); got != tp-1 {
		t.Errorf("encgate_metadata_pulls_waiting %v, want %d", got, tp-1)
	}
	if k := runGoroutines(t); k != 0 {
		t.Fatalf("%d goroutines in a run or a flight wait with %d pulls of one part held, want 0", k, tp)
	}
	enc.open()
	for i, ch := range out {
		res := <-ch
		if v := res.Verdict; v.Kind != KindAnswered || v.Status != 200 || v.Shared != (i > 0) {
			t.Errorf("pull %d: %+v", i, v)
		}
	}
	if n := enc.pulls.Load(); n != 1 {
		t.Fatalf("%d pulls of one part: the encoder saw %d, want 1", tp, n)
	}
	if got := flightWaiters(p); got != 0 {
		t.Errorf("encgate_metadata_pulls_waiting %v after the answers, want 0", got)
	}
	if got := shared(t, reg, SharedInflight); got != tp-1 {
		t.Errorf("shared inflight %v, want %d", got, tp-1)
	}
}

// A parked waiter whose call is stopped (the server's shutdown) ends
// canceled, as one that waited on its goroutine does when its Done ends;
// one past its try is a timeout that expired. Neither touches the
// leader's pull.
func TestParkedFlightWaiterHonoursStopAndItsTryTimeout(t *testing.T) {
	enc := newMetaEncoder(t, "enc-0", true)
	p, _ := metaPoolParked(t, "enc-0", enc.srv.URL)
	e0, _ := p.Lookup("enc-0")
	id := "req-q_local_part_0"
	p.pins.Set(id, "enc-0", e0.ID())
	lead := pullParked(t, p, pullCall(id, 0), context.Background())
	<-enc.arrived
	ctx, stop := context.WithCancel(context.Background())
	stopped := pullParked(t, p, pullCall(id, 0), ctx)
	waitFlightWaiters(t, p, 1)
	stop()
	if v := (<-stopped).Verdict; v.Kind != KindCanceled {
		t.Errorf("the waiter stopped: %v, want canceled", v.Kind)
	}
	expired := pullParked(t, p, pullCall(id, 0), context.Background())
	waitFlightWaiters(t, p, 1)
	p.clk.(*clock.Fake).Advance(DefaultRetry().Metadata.PerTryTimeout.D())
	if v := (<-expired).Verdict; v.Kind != KindTimeout || v.Cause != CauseExpired {
		t.Errorf("the waiter past its try: %v cause %v, want a timeout that expired", v.Kind, v.Cause)
	}
	enc.open()
	if v := (<-lead).Verdict; v.Status != 200 || v.Shared {
		t.Errorf("leader: %+v", v)
	}
	if n := flightWaiters(p); n != 0 {
		t.Errorf("%d flight waits left", n)
	}
}

// The encoder drops the leader's pull (a crash or a reset mid-hold): the
// pulls parked on its flight each get that failure as a shared verdict,
// as waiting ones would, and nothing is left waiting.
func TestParkedFlightWaitersShareTheLeadersFault(t *testing.T) {
	enc := newMetaEncoder(t, "enc-0", true)
	p, _ := metaPoolParked(t, "enc-0", enc.srv.URL)
	const tp = 4
	out := pullsOnAFlight(t, p, enc, "req-r_local_part_0", tp)
	enc.srv.CloseClientConnections()
	lead := (<-out[0]).Verdict
	if lead.Kind == KindAnswered || lead.Shared {
		t.Fatalf("leader after its connection dropped: %+v", lead)
	}
	for i := 1; i < tp; i++ {
		if v := (<-out[i]).Verdict; v.Kind != lead.Kind || !v.Shared {
			t.Errorf("waiter %d: %v shared %v, want the leader's %v, shared", i, v.Kind, v.Shared, lead.Kind)
		}
	}
	if n := flightWaiters(p); n != 0 {
		t.Errorf("%d flight waits left", n)
	}
	if n := enc.pulls.Load(); n != 1 {
		t.Errorf("the encoder saw %d pulls, want 1", n)
	}
}
