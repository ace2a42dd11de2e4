package upstream

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/sglang"
)

// metaEncoder stands in for an encoder: it counts the metadata pulls that
// reach it by part_idx, holds each until the test releases them (when
// hold is set), and answers 200 with the part's metadata, or the
// not-ready 504 while notReady is set.
type metaEncoder struct {
	srv      *httptest.Server
	pulls    atomic.Int64
	arrived  chan struct{}
	release  chan struct{}
	hold     bool
	notReady atomic.Bool
}

func newMetaEncoder(t *testing.T, name string, hold bool) *metaEncoder {
	t.Helper()
	m := &metaEncoder{arrived: make(chan struct{}, 64), release: make(chan struct{}), hold: hold}
	m.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path != sglang.PathMetadata {
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprint(w, `{}`)
			return
		}
		m.pulls.Add(1)
		m.arrived <- struct{}{}
		if m.hold {
			select {
			case <-m.release:
			case <-req.Context().Done():
				return
			}
		}
		if m.notReady.Load() {
			w.WriteHeader(http.StatusGatewayTimeout)
			fmt.Fprint(w, sglang.MetadataNotReady)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"encoder":%q,"embedding_dim":1024}`, name)
	}))
	t.Cleanup(m.srv.Close)
	t.Cleanup(m.open) // first: held pulls end before the server closes
	return m
}

func (m *metaEncoder) open() {
	select {
	case <-m.release:
	default:
		close(m.release)
	}
}

func metaPool(t *testing.T, cacheSize int, encs ...string) (*Pool, *prometheus.Registry) {
	t.Helper()
	aff := DefaultAffinity()
	aff.UnknownWait = 0
	aff.MetadataCache = cacheSize
	set := testSettings(encs...)
	set.Retry.Metadata.MaxAttempts = 1 // each pull one attempt: the counts are the round trips
	reg := prometheus.NewRegistry()
	p, err := NewPool(set, aff, Deps{Log: zap.NewNop(), Registry: reg, Clock: clock.NewFake(time.Unix(1e9, 0)),
		Rand: func() float64 { return 0 }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p, reg
}

func pullCall(id string, part int) *Call {
	c := newCall(sglang.RouteMetadata, id)
	c.Body = []byte(fmt.Sprintf(`{"req_id":%q,"part_idx":%d}`, id, part))
	return c
}

// pullAll runs k concurrent pulls of id's part on enc (pinned there) while
// the encoder holds them: it waits for the first to arrive, then for the
// others to be waiting on it, then releases the encoder.
func pullAll(t *testing.T, p *Pool, enc *metaEncoder, id string, part, k int, shared bool) []*Call {
	t.Helper()
	calls := make([]*Call, k)
	var wg sync.WaitGroup
	for i := range calls {
		calls[i] = pullCall(id, part)
		wg.Add(1)
		go func(c *Call) {
			defer wg.Done()
			p.Exchange(c)
		}(calls[i])
	}
	<-enc.arrived
	if shared {
		waitFlightWaiters(t, p, int64(k-1))
	} else {
		for i := 1; i < k; i++ {
			<-enc.arrived
		}
	}
	enc.open()
	wg.Wait()
	return calls
}

// flightWaiters is how many pulls wait on a flight (its gauge).
func flightWaiters(p *Pool) int64 { return int64(testutil.ToFloat64(p.meta.waiting)) }

// waitFlightWaiters waits until n pulls are waiting on a flight: the
// state the test drives to. Each waiter arms its try timer on the fake
// clock after it counts itself, so each timer made is the signal to look.
func waitFlightWaiters(t *testing.T, p *Pool, n int64) {
	t.Helper()
	fc := p.clk.(*clock.Fake)
	for {
		made := fc.TimerCreated()
		if flightWaiters(p) >= n {
			return
		}
		select {
		case <-made:
		case <-time.After(10 * time.Second):
			t.Fatalf("%d pulls waiting on a flight, want %d", flightWaiters(p), n)
		}
	}
}

func shared(t *testing.T, reg *prometheus.Registry, how string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "encgate_metadata_pulls_shared_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetLabel()[0].GetValue() == how {
				return m.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("no encgate_metadata_pulls_shared_total{how=%q}", how)
	return 0
}

func TestMetadataPullsShareOneRoundTrip(t *testing.T) {
	enc := newMetaEncoder(t, "enc-0", true)
	other := newMetaEncoder(t, "enc-1", false)
	p, reg := metaPool(t, 64, "enc-0", enc.srv.URL, "enc-1", other.srv.URL)
	e0, _ := p.Lookup("enc-0")
	e1, _ := p.Lookup("enc-1")
	id := "req-a_local_part_0"
	p.pins.Set(id, "enc-0", e0.ID())

	calls := pullAll(t, p, enc, id, 0, 6, true)
	if n := enc.pulls.Load(); n != 1 {
		t.Fatalf("six concurrent pulls of one part: the encoder saw %d, want 1", n)
	}
	for i, c := range calls {
		if c.Resp.StatusCode() != 200 || !strings.Contains(string(c.Resp.Body()), `"enc-0"`) ||
			string(c.Resp.Header.ContentType()) != "application/json" {
			t.Errorf("pull %d: %d %q %q", i, c.Resp.StatusCode(), c.Resp.Body(), c.Resp.Header.ContentType())
		}
	}
	// Each caller's answer is its own copy.
	calls[1].Resp.Body()[0] = 'X'
	if calls[2].Resp.Body()[0] != '{' {
		t.Errorf("the answers share a buffer")
	}
	if got := shared(t, reg, SharedInflight); got != 5 {
		t.Errorf("shared inflight %g, want 5", got)
	}
	// Only the leader's exchange is a request.
	if got := testutil.ToFloat64(p.m.requests.WithLabelValues("enc-0", sglang.LabelMetadata, "200")); got != 1 {
		t.Errorf("requests counted %g, want 1", got)
	}

	// Only the leader's exchange is told to the breaker.
	if got := testutil.ToFloat64(e0.outcomes[MarkSuccess]); got != 1 {
		t.Errorf("breaker successes %g, want 1", got)
	}

	// A later pull: answered from the kept 200.
	c := pullCall(id, 0)
	if res := p.Exchange(c); res.Verdict.Status != 200 || c.Resp.StatusCode() != 200 {
		t.Fatalf("later pull: %+v", res.Verdict)
	}
	if n := enc.pulls.Load(); n != 1 {
		t.Errorf("a later pull reached the encoder: %d pulls", n)
	}
	if got := shared(t, reg, SharedAnswered); got != 1 {
		t.Errorf("shared answered %g, want 1", got)
	}

	// Another part_idx: its own round trip.
	p.Exchange(pullCall(id, 1))
	if n := enc.pulls.Load(); n != 2 {
		t.Errorf("another part_idx: %d pulls, want 2", n)
	}
	// The same part at another encoder: its own.
	p.pins.Set(id, "enc-1", e1.ID())
	p.Exchange(pullCall(id, 0))
	if n := other.pulls.Load(); n != 1 {
		t.Errorf("another encoder: %d pulls, want 1", n)
	}

	// The req_id's /encode placed again: its kept answers are dropped.
	if n := p.meta.Len(); n != 3 {
		t.Fatalf("%d answers kept, want 3", n)
	}
	p.pins.Delete(id)
	if res := p.Exchange(newCall(sglang.RouteEncode, id)); res.Verdict.Status != 200 {
		t.Fatalf("/encode: %+v", res.Verdict)
	}
	if n := p.meta.Len(); n != 0 {
		t.Errorf("after a new /encode %d answers kept, want 0", n)
	}
}

func TestMetadataNotReadyIsNotKept(t *testing.T) {
	enc := newMetaEncoder(t, "enc-0", false)
	enc.notReady.Store(true)
	p, _ := metaPool(t, 64, "enc-0", enc.srv.URL)
	e0, _ := p.Lookup("enc-0")
	id := "req-b_local_part_0"
	p.pins.Set(id, "enc-0", e0.ID())
	for i := 1; i <= 3; i++ {
		c := pullCall(id, 0)
		p.Exchange(c)
		if c.Resp.StatusCode() != 504 {
			t.Fatalf("pull %d: %d, want the encoder's 504", i, c.Resp.StatusCode())
		}
		if n := enc.pulls.Load(); n != int64(i) {
			t.Fatalf("after %d pulls the encoder saw %d: a 504 was kept", i, n)
		}
	}
	enc.notReady.Store(false)
	p.Exchange(pullCall(id, 0))
	p.Exchange(pullCall(id, 0))
	if n := enc.pulls.Load(); n != 4 {
		t.Errorf("after the part was ready: %d pulls, want 4", n)
	}
}

func TestMetadataSharingOff(t *testing.T) {
	enc := newMetaEncoder(t, "enc-0", true)
	p, reg := metaPool(t, 0, "enc-0", enc.srv.URL)
	e0, _ := p.Lookup("enc-0")
	id := "req-c_local_part_0"
	p.pins.Set(id, "enc-0", e0.ID())
	pullAll(t, p, enc, id, 0, 6, false)
	if n := enc.pulls.Load(); n != 6 {
		t.Fatalf("sharing off: the encoder saw %d pulls, want 6", n)
	}
	p.Exchange(pullCall(id, 0))
	if n := enc.pulls.Load(); n != 7 {
		t.Errorf("sharing off, a later pull: %d, want 7", n)
	}
	if got := shared(t, reg, SharedInflight) + shared(t, reg, SharedAnswered); got != 0 {
		t.Errorf("shared %g with sharing off", got)
	}
}

// A waiter whose caller goes away stops waiting; the leader's pull still
// answers and is kept.
func TestMetadataWaiterHonoursDone(t *testing.T) {
	enc := newMetaEncoder(t, "enc-0", true)
	p, _ := metaPool(t, 64, "enc-0", enc.srv.URL)
	e0, _ := p.Lookup("enc-0")
	id := "req-d_local_part_0"
	p.pins.Set(id, "enc-0", e0.ID())
	lead := pullCall(id, 0)
	leadDone := make(chan Result, 1)
	go func() { leadDone <- p.Exchange(lead) }()
	<-enc.arrived
	done := make(chan struct{})
	w := pullCall(id, 0)
	w.Done = done
	wDone := make(chan Result, 1)
	go func() { wDone <- p.Exchange(w) }()
	waitFlightWaiters(t, p, 1)
	close(done)
	if res := <-wDone; res.Verdict.Kind != KindCanceled {
		t.Errorf("the waiter whose caller left: %v, want canceled", res.Verdict.Kind)
	}
	enc.open()
	if res := <-leadDone; res.Verdict.Status != 200 {
		t.Errorf("leader: %+v", res.Verdict)
	}
	if n := p.meta.Len(); n != 1 {
		t.Errorf("%d answers kept, want 1", n)
	}
}

// A waiter stops at its own try timeout, judged as a pull that ran out.
func TestMetadataWaiterHonoursItsTryTimeout(t *testing.T) {
	enc := newMetaEncoder(t, "enc-0", true)
	p, _ := metaPool(t, 64, "enc-0", enc.srv.URL)
	e0, _ := p.Lookup("enc-0")
	id := "req-e_local_part_0"
	p.pins.Set(id, "enc-0", e0.ID())
	leadDone := make(chan Result, 1)
	go func() { leadDone <- p.Exchange(pullCall(id, 0)) }()
	<-enc.arrived
	wDone := make(chan Result, 1)
	go func() { wDone <- p.Exchange(pullCall(id, 0)) }()
	waitFlightWaiters(t, p, 1)
	p.clk.(*clock.Fake).Advance(DefaultRetry().Metadata.PerTryTimeout.D())
	if v := (<-wDone).Verdict; v.Kind != KindTimeout || v.Cause != CauseExpired {
		t.Errorf("the waiter past its try: %v cause %v, want a timeout that expired", v.Kind, v.Cause)
	}
	enc.open()
	<-leadDone
}

// TestMetadataShareRoundTrips prints the encoder round trips per part for
// the TP ranks of one part, with and without sharing.
func TestMetadataShareRoundTrips(t *testing.T) {
	for _, tp := range []int{2, 4, 8} {
		var trips [2]int64
		for i, size := range []int{0, 64} {
			enc := newMetaEncoder(t, "enc-0", true)
			p, _ := metaPool(t, size, "enc-0", enc.srv.URL)
			e0, _ := p.Lookup("enc-0")
			id := fmt.Sprintf("tp%d-%d_local_part_0", tp, size)
			p.pins.Set(id, "enc-0", e0.ID())
			// Half the ranks pull at once, the rest after the answer.
			pullAll(t, p, enc, id, 0, tp/2, size > 0)
			for r := tp / 2; r < tp; r++ {
				p.Exchange(pullCall(id, 0))
			}
			trips[i] = enc.pulls.Load()
		}
		t.Logf("TP=%d: %d round trips per part without sharing, %d with", tp, trips[0], trips[1])
		if trips[0] != int64(tp) || trips[1] != 1 {
			t.Errorf("TP=%d: %d and %d round trips, want %d and 1", tp, trips[0], trips[1], tp)
		}
	}
}
