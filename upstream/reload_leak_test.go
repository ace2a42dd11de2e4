package upstream

import (
	"net/http"
	"net/http/httptest"
	"runtime"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"weak"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/sglang"
)

// retiredObjects are weak pointers to what a reload retires: Encoders, and
// the fasthttp.HostClients they held (traffic, probes). collected counts
// the HostClients the collector has freed, via runtime.AddCleanup.
type retiredObjects struct {
	encoders  []weak.Pointer[Encoder]
	clients   []weak.Pointer[fasthttp.HostClient]
	collected atomic.Int64
	freed     chan struct{} // one send per freed HostClient
}

func newRetired() *retiredObjects { return &retiredObjects{freed: make(chan struct{}, 1024)} }

// add records the encoders of p's fleet now, before a reload retires them.
// It keeps no strong reference.
func (r *retiredObjects) add(p *Pool) {
	for _, e := range p.Encoders() {
		r.encoders = append(r.encoders, weak.Make(e))
		for _, c := range []*fasthttp.HostClient{e.self.client, e.probes} {
			r.clients = append(r.clients, weak.Make(c))
			runtime.AddCleanup(c, func(ch chan struct{}) { ch <- struct{}{} }, r.freed)
		}
	}
}

// encodersAlive counts the recorded Encoders still reachable after a full
// collection. Nothing else holds a retired Encoder once Reload returned
// (its health loop is stopped and awaited, its breaker's timer stopped), so
// one runtime.GC decides it: a weak pointer reads nil once the collector
// found its object unreachable.
func (r *retiredObjects) encodersAlive() int {
	runtime.GC()
	n := 0
	for _, w := range r.encoders {
		if w.Value() != nil {
			n++
		}
	}
	return n
}

// waitClientsFreed waits for every recorded HostClient to be collected.
// fasthttp's connection cleaner goroutine holds its HostClient until its
// next round after the last connection closed, up to the idle connection
// timeout after Reload closed them: the wait is on the cleanups' signal,
// with a collection each round to find the client unreachable.
func (r *retiredObjects) waitClientsFreed(t *testing.T, round time.Duration) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for freed := 0; freed < len(r.clients); {
		runtime.GC()
		select {
		case <-r.freed:
			freed++
		case <-time.After(round):
			if time.Now().After(deadline) {
				alive := 0
				for _, w := range r.clients {
					if w.Value() != nil {
						alive++
					}
				}
				t.Fatalf("%d of %d retired HostClients are still reachable", alive, len(r.clients))
			}
		}
	}
}

// hotEntries counts p's hot map.
func hotEntries(p *Pool) int {
	n := 0
	p.m.hot.Range(func(any, any) bool {
		n++
		return true
	})
	return n
}

// encoderSeries lists the registry's series that carry an encoder label,
// as "name{encoder=...}" strings, sorted.
func encoderSeries(t *testing.T, reg *prometheus.Registry) []string {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var labels []string
			enc := false
			for _, lp := range m.GetLabel() {
				labels = append(labels, lp.GetName()+"="+lp.GetValue())
				enc = enc || lp.GetName() == "encoder"
			}
			if enc {
				out = append(out, mf.GetName()+"{"+strings.Join(labels, ",")+"}")
			}
		}
	}
	sort.Strings(out)
	return out
}

// exchangeAll sends an /encode and a metadata pull owned by each encoder
// and wants 200s, so that each name has its hot series.
func exchangeAll(t *testing.T, p *Pool, round int) {
	t.Helper()
	for _, e := range p.Encoders() {
		id := ownedBy(t, p, e.Name, e.Name+"-"+itoa(round))
		for _, rt := range []*sglang.Route{sglang.RouteEncode, sglang.RouteMetadata} {
			if res := p.Exchange(newCall(rt, id)); res.Verdict.Kind != KindAnswered || res.Verdict.Status != 200 {
				t.Fatalf("round %d %s %s: %+v", round, e.Name, rt.Path, res.Verdict)
			}
		}
	}
}

// A reload that rebuilds every encoder (a changed breaker, health or
// upstream section) leaves nothing of the old ones behind: the hot map and
// the registry hold the same entries after 12 rebuilds as after none (they
// are keyed by name), and every retired Encoder and HostClient is
// collected. Removing an encoder then deletes its entries and series.
func TestReloadKeepsNoRetiredEncoder(t *testing.T) {
	a, b := liveEncoder(t, "a"), liveEncoder(t, "b")
	set := testSettings("a", a.URL, "b", b.URL)
	set.Health.Disabled = false // health loops run on the pool's fake clock: never probed, but started and stopped
	// Short, so that fasthttp's cleaner lets go of a retired client soon
	// after Reload closed its connections.
	const idle = 20 * time.Millisecond
	set.Client.IdleConnTimeout = configfile.Duration(idle)
	reg := prometheus.NewRegistry()
	p := newTestPool(t, set, reg)
	exchangeAll(t, p, 0)
	const wantHot = 4 // a and b, each with its /encode and metadata 200s
	if got := hotEntries(p); got != wantHot {
		t.Fatalf("hot entries after the first exchanges: %v, want %v", got, wantHot)
	}
	series := encoderSeries(t, reg)

	retired := newRetired()
	const reloads = 12
	for i := 1; i <= reloads; i++ {
		next := set
		// Each reload changes a section that rebuilds every encoder.
		switch i % 3 {
		case 0:
			next.Breaker.ConsecutiveFailures = set.Breaker.ConsecutiveFailures + i
		case 1:
			next.Health.Timeout = configfile.Duration(time.Duration(i) * time.Second)
		case 2:
			next.Client.MaxConnsPerEncoder = set.Client.MaxConnsPerEncoder + i
		}
		retired.add(p)
		if added, removed, err := p.Reload(next); err != nil || len(added) != 0 || len(removed) != 0 {
			t.Fatalf("reload %d: added %v removed %v: %v", i, added, removed, err)
		}
		exchangeAll(t, p, i)
	}
	if got := hotEntries(p); got != wantHot {
		t.Errorf("hot entries after %d rebuilding reloads: %v, want %v", reloads, got, wantHot)
	}
	if got := encoderSeries(t, reg); strings.Join(got, "\n") != strings.Join(series, "\n") {
		t.Errorf("series with an encoder label after %d reloads:\n%s\nwant as before them:\n%s",
			reloads, strings.Join(got, "\n"), strings.Join(series, "\n"))
	}
	if n := retired.encodersAlive(); n != 0 {
		t.Errorf("%d of %d retired Encoders are still reachable after %d reloads", n, len(retired.encoders), reloads)
	}
	retired.waitClientsFreed(t, idle)

	// Remove b: its entries and series go, and so does it.
	gone := newRetired()
	gone.add(p)
	onlyA := set
	onlyA.Encoders = set.Encoders[:1]
	if _, removed, err := p.Reload(onlyA); err != nil || len(removed) != 1 || removed[0] != "b" {
		t.Fatalf("removing b: removed %v: %v", removed, err)
	}
	if got := hotEntries(p); got != 2 {
		t.Errorf("hot entries after b left: %d, want a's 2", got)
	}
	for _, s := range encoderSeries(t, reg) {
		if strings.Contains(s, "encoder=b") {
			t.Errorf("a series of the removed encoder b is still exported: %s", s)
		}
	}
	gone.encoders = gone.encoders[1:] // a stays; b must go
	if n := gone.encodersAlive(); n != 0 {
		t.Errorf("the removed encoder b is still reachable")
	}
}

// An exchange still in flight on an encoder when a reload removes it ends
// after forget deleted the encoder's series: it must not bring them back.
func TestRemovedEncoderInFlightLeavesNoSeries(t *testing.T) {
	release := make(chan struct{})
	arrived := make(chan struct{}, 1)
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-release
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`null`))
	}))
	t.Cleanup(slow.Close)
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	a := liveEncoder(t, "a")
	set := testSettings("a", a.URL, "b", slow.URL)
	reg := prometheus.NewRegistry()
	p := newTestPool(t, set, reg)
	id := ownedBy(t, p, "b", "late")
	done := make(chan Result, 1)
	go func() { done <- p.Exchange(newCall(sglang.RouteEncode, id)) }()
	<-arrived

	onlyA := set
	onlyA.Encoders = set.Encoders[:1]
	if _, removed, err := p.Reload(onlyA); err != nil || len(removed) != 1 {
		t.Fatalf("removing b: %v %v", removed, err)
	}
	close(release)
	if res := <-done; res.Verdict.Status != 200 {
		t.Fatalf("the in-flight /encode on b: %+v", res.Verdict)
	}
	for _, s := range encoderSeries(t, reg) {
		if strings.Contains(s, "encoder=b") {
			t.Errorf("the exchange that ended after b was removed brought back %s", s)
		}
	}
	if got := hotEntries(p); got != 0 {
		t.Errorf("%d hot entries, want none: only the removed b answered", got)
	}
}
