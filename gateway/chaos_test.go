package gateway

// The chaos suite: fake encoders with real faults (crashes that reset
// connections, hangs, slow answers, flapping health, 504 storms, truncated
// answers) behind a real gateway on loopback, with many callers at once.
// Every test checks the same invariants (see chaos.check):
//
//   - no (req_id, destination) /send reaches the encoders more than once,
//     counted where it arrives (fakeencoder Stats.SendArrivals), and every
//     /send a caller got a 200 for arrived exactly once;
//   - every call is answered within the gateway's own bound for its route,
//     derived from the config (chaos.bound), plus half a per-try timeout
//     (chaos.slack), and the answer names the caller's own req_id (and, for
//     a /send, its own destination);
//   - breakers open on the faults and close after recovery, and new work
//     reaches the recovered encoder again (chaos.awaitReturn);
//   - no goroutine and no file descriptor outlives the test (chaosLeakCheck).
//
// TestChaosSoak repeats the mixed-fault rounds for -chaos.soak (off by
// default): go test ./gateway/ -run ChaosSoak -chaos.soak=2m

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"go.uber.org/zap"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/idempotency"
	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/sglang"
	"github.com/encgate/encgate/upstream"
)

var (
	chaosSoak = flag.Duration("chaos.soak", 0, "run TestChaosSoak's mixed-fault rounds for this long (0: skip it)")
	chaosSeed = flag.Uint64("chaos.seed", 0, "seed of the mixed-fault schedule (0: from the clock; the seed used is logged)")
)

const (
	routeEncode   = "/encode"
	routeMetadata = "/scheduler_receive_meta_data"
	routeSend     = "/send"
)

// chaosLeakCheck makes the test fail if a goroutine started during it, or a
// file descriptor opened during it, is still there once its cleanups ran.
// Call it first, so that its check runs after every other cleanup. Ignored:
// fasthttp's process-wide Date updater and its worker-pool and idle-conn
// cleaners, which sleep up to MaxIdleWorkerDuration (10s) /
// MaxIdleConnDuration before they notice a stopped server or an empty pool.
func chaosLeakCheck(t *testing.T) {
	t.Helper()
	current := goleak.IgnoreCurrent()
	fds := openFDs()
	t.Cleanup(func() {
		goleak.VerifyNone(t, current,
			goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
			goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"),
			goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*HostClient).connsCleaner"))
		if fds >= 0 {
			eventually(t, fmt.Sprintf("open file descriptors back to %d (now %d)", fds, openFDs()),
				func() bool { return openFDs() <= fds })
		}
	})
}

// openFDs counts the process's open file descriptors; -1 where /proc is
// missing.
func openFDs() int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return -1
	}
	return len(ents)
}

// chaosConfig is the gateway config of the chaos tests: short per-try
// timeouts and deadlines so that hangs end in seconds, a breaker that trips
// after 3 faults and ejects for 200ms, growing to 800ms (the tests on the
// wall clock wait for it; those on a fake clock advance it), no active
// health (TestChaosHealthFlapping turns it on).
func chaosConfig(c *Config) {
	c.Health.Disabled = true
	c.Breaker.ConsecutiveFailures = 3
	c.Breaker.BaseEjectionTime = configfile.Duration(200 * time.Millisecond)
	c.Breaker.MaxEjectionTime = configfile.Duration(800 * time.Millisecond)
	c.Affinity.UnknownWait = configfile.Duration(time.Second)
	for _, p := range []*upstream.RetryPolicy{&c.Retry.Encode, &c.Retry.Metadata, &c.Retry.Send, &c.Retry.ReceiveURL} {
		p.PerTryTimeout = configfile.Duration(time.Second)
		p.Deadline = configfile.Duration(2 * time.Second)
	}
}

// chaos is one chaos test's fleet, gateway and callers.
type chaos struct {
	t      *testing.T
	encs   []*fakeencoder.Encoder
	g      *gw
	clk    clock.Clock
	cfg    Config
	client *http.Client
	tp     int // receiver ranks: /sends per part
	dups   int // identical copies of each /send sent at once

	mu    sync.Mutex
	ok200 map[string]bool // "req_id|destination" of /sends answered 200
	calls int
}

// newChaos starts n fake encoders (answering /send with their req_id and
// destination) and a gateway in front of them with chaosConfig, then
// mutate, on clk (nil: the wall clock).
func newChaos(t *testing.T, n int, mutate func(*Config), clk clock.Clock) *chaos {
	t.Helper()
	encs := startFakes(t, n, func(_ int, o *fakeencoder.Options) { o.EchoSend = true })
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	for i, e := range encs {
		cfg.Encoders = append(cfg.Encoders, upstream.EncoderConfig{Name: "enc-" + strconv.Itoa(i), URL: e.URL()})
	}
	chaosConfig(&cfg)
	if mutate != nil {
		mutate(&cfg)
	}
	if clk == nil {
		clk = clock.Real{}
	}
	g := serveGateway(t, cfg, zap.NewNop(), clk)
	tr := &http.Transport{MaxIdleConnsPerHost: 128}
	t.Cleanup(tr.CloseIdleConnections)
	return &chaos{
		t: t, encs: encs, clk: clk, cfg: cfg, tp: 2, dups: 3, ok200: map[string]bool{},
		g: g, client: &http.Client{Transport: tr},
	}
}

// bound is the longest the gateway may take to answer a call on route, by
// its config: an /encode's attempts and backoffs end by retry.encode's
// deadline; a follow-up may first wait affinity.unknown_wait for its pin,
// then its attempts end by its route's deadline (a duplicate /send waits
// for the first one at most retry.send's deadline).
func (c *chaos) bound(route string) time.Duration {
	r := c.cfg.Retry
	switch route {
	case routeEncode:
		return r.Encode.Deadline.D()
	case routeMetadata:
		return c.cfg.Affinity.UnknownWait.D() + r.Metadata.Deadline.D()
	default:
		return c.cfg.Affinity.UnknownWait.D() + r.Send.Deadline.D()
	}
}

// slack is what a caller allows beyond bound: half the route's per-try
// timeout. An attempt that escaped the deadline cap would overrun by up to
// a whole per_try_timeout, so this catches it, while scheduling and
// loopback delays stay far below it.
func (c *chaos) slack(route string) time.Duration {
	r := c.cfg.Retry
	switch route {
	case routeEncode:
		return r.Encode.PerTryTimeout.D() / 2
	case routeMetadata:
		return r.Metadata.PerTryTimeout.D() / 2
	default:
		return r.Send.PerTryTimeout.D() / 2
	}
}

// reply is a caller's answer.
type reply struct {
	status int
	header http.Header
	body   string
}

// call POSTs body to route as a caller whose deadline is bound + slack, and
// checks the answer: it came in time, and it is this request's (its req_id;
// a /send's 200 also its destination). ok is false when no answer came.
func (c *chaos) call(route, id, body, dest string) (reply, bool) {
	return c.callAt(c.g, route, id, body, dest)
}

// callAt is call against gateway g (a second replica, say).
func (c *chaos) callAt(g *gw, route, id, body, dest string) (reply, bool) {
	limit := c.bound(route) + c.slack(route)
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, g.base+route, strings.NewReader(body))
	if err != nil {
		c.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	c.mu.Lock()
	c.calls++
	c.mu.Unlock()
	start := time.Now()
	resp, err := c.client.Do(req)
	var b []byte
	if err == nil {
		b, err = io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	if err != nil {
		c.t.Errorf("%s %s via %s: no answer within %v (bound %v + slack %v), after %v: %v",
			route, id, g.base, limit, c.bound(route), c.slack(route), time.Since(start).Round(time.Millisecond), err)
		return reply{}, false
	}
	var v struct {
		ReqID       *string `json:"req_id"`
		Destination *string `json:"destination"`
	}
	if err := json.Unmarshal(b, &v); err != nil || v.ReqID == nil || *v.ReqID != id {
		c.t.Errorf("%s %s: answer %d %q is not this request's", route, id, resp.StatusCode, b)
	}
	if route == routeSend && resp.StatusCode == http.StatusOK {
		if v.Destination == nil || *v.Destination != dest {
			c.t.Errorf("/send %s to %s: answer %q is another destination's", id, dest, b)
		}
		c.mu.Lock()
		c.ok200[id+"|"+dest] = true
		c.mu.Unlock()
	}
	return reply{resp.StatusCode, resp.Header, string(b)}, true
}

// partResult is how one part's calls went.
type partResult struct {
	id      string
	encoder string // X-Encgate-Encoder of the /encode answer
	status  []int  // every status, in order
	ok      bool   // every call answered 200
	last    string // the body of the last answer that was not a 200
}

func sendDest(rank int) string { return "10.0.0.1:" + strconv.Itoa(40000+rank) }

// part makes one part's calls as sglang does: /encode, a metadata pull,
// then each receiver rank's /send, each sent dups times at once (a retrying
// middleware), and finally rank 0's /send once more after every answer came
// (a late duplicate).
func (c *chaos) part(id string) partResult {
	res := partResult{id: id}
	a, ok := c.call(routeEncode, id, encodeBody(id), "")
	if !ok {
		return res
	}
	res.encoder = a.header.Get("X-Encgate-Encoder")
	res.status = append(res.status, a.status)
	if a.status != http.StatusOK {
		res.last = a.body
		return res
	}
	m, ok := c.call(routeMetadata, id, metaBody(id), "")
	if !ok {
		return res
	}
	res.status = append(res.status, m.status)
	if m.status != http.StatusOK {
		res.last = m.body
		return res
	}
	res.status = append(res.status, c.sends(id)...)
	res.ok = len(res.status) == 2+c.tp*c.dups+1
	for _, s := range res.status {
		res.ok = res.ok && s == http.StatusOK
	}
	return res
}

// sends sends every rank's /send for id dups times at once, then rank 0's
// once more; it returns the statuses of the calls that were answered.
func (c *chaos) sends(id string) []int {
	var mu sync.Mutex
	var out []int
	var wg sync.WaitGroup
	for rank := 0; rank < c.tp; rank++ {
		for d := 0; d < c.dups; d++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if r, ok := c.call(routeSend, id, tpSend(id, rank, c.tp), sendDest(rank)); ok {
					mu.Lock()
					out = append(out, r.status)
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	if r, ok := c.call(routeSend, id, tpSend(id, 0, c.tp), sendDest(0)); ok {
		out = append(out, r.status)
	}
	return out
}

// wave runs the parts of ids at once and returns their results in order.
func (c *chaos) wave(ids []string) []partResult {
	out := make([]partResult, len(ids))
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i] = c.part(id)
		}()
	}
	wg.Wait()
	return out
}

// ids returns n req_ids "<prefix>-<i>_local_part_0".
func ids(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%d_local_part_0", prefix, i)
	}
	return out
}

// owned returns n req_ids whose rendezvous owner is the encoder name. Call
// it while every encoder is usable: ownership is then the fleet's own.
func (c *chaos) owned(prefix, name string, n int) []string {
	c.t.Helper()
	var out []string
	for i := 0; len(out) < n; i++ {
		if i > 100*n {
			c.t.Fatalf("no req_ids owned by %s", name)
		}
		id := fmt.Sprintf("%s-%d_local_part_0", prefix, i)
		if e, err := c.g.Pool().Owner(id); err == nil && e.Name == name {
			out = append(out, id)
		}
	}
	return out
}

func (c *chaos) encoder(name string) *upstream.Encoder {
	e, ok := c.g.Pool().Lookup(name)
	if !ok {
		c.t.Fatalf("no encoder %s", name)
	}
	return e
}

// transitions is encgate_breaker_transitions_total for one encoder and move.
func (c *chaos) transitions(name string, from, to upstream.BreakerState) float64 {
	return seriesValue(c.t, c.g, "encgate_breaker_transitions_total",
		"encoder", name, "from", from.String(), "to", to.String())
}

// awaitReturn waits until name takes new work again: its breaker has left
// the open state by itself (its timer; on a fake clock, awaitReturn moves
// the clock to the ejection's end), and an /encode owned by name (from ids,
// in turn) was answered 200 by name with its breaker closed. Each try is a
// real /encode: a half-open breaker closes on a request that succeeds.
// It returns the ids it did not use.
func (c *chaos) awaitReturn(name string, ids []string) []string {
	c.t.Helper()
	e := c.encoder(name)
	i := 0
	eventually(c.t, name+" to take /encodes again", func() bool {
		if fake, ok := c.clk.(*clock.Fake); ok {
			if s := e.Breaker.Snapshot(); s.State == upstream.BreakerOpen {
				fake.Advance(s.Until.Sub(fake.Now()))
			}
		}
		if e.Breaker.State() == upstream.BreakerOpen || !e.Health.Up() {
			return false
		}
		if i == len(ids) {
			c.t.Fatalf("%s: %d /encodes owned by it did not bring it back", name, i)
		}
		id := ids[i]
		i++
		r, ok := c.call(routeEncode, id, encodeBody(id), "")
		return ok && r.status == http.StatusOK && r.header.Get("X-Encgate-Encoder") == name &&
			e.Breaker.State() == upstream.BreakerClosed
	})
	opened := c.transitions(name, upstream.BreakerClosed, upstream.BreakerOpen) + c.transitions(name, upstream.BreakerHalfOpen, upstream.BreakerOpen)
	if closed := c.transitions(name, upstream.BreakerHalfOpen, upstream.BreakerClosed); opened > 0 && closed < 1 {
		c.t.Errorf("%s: breaker back in service without a half_open->closed transition", name)
	}
	return ids[i:]
}

// check asserts the delivery invariant over everything the fleet received:
// no (req_id, destination) /send arrived more than once at the encoders
// together, and each one a caller got a 200 for arrived exactly once.
func (c *chaos) check() {
	c.t.Helper()
	arrivals := map[string]int64{}
	where := map[string][]string{}
	for _, e := range c.encs {
		s := e.Stats()
		for k, n := range s.SendArrivals {
			arrivals[k] += n
			where[k] = append(where[k], fmt.Sprintf("%s x%d", s.Name, n))
		}
	}
	for k, n := range arrivals {
		if n > 1 {
			c.t.Errorf("/send %s reached the encoders %d times: %v", k, n, where[k])
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for k := range c.ok200 {
		if arrivals[k] != 1 {
			c.t.Errorf("/send %s was answered 200 but arrived %d times", k, arrivals[k])
		}
	}
	c.t.Logf("%d calls; %d distinct /sends arrived; %d answered 200", c.calls, len(arrivals), len(c.ok200))
}

// seriesValue sums the series of metric name whose labels include the given
// name/value pairs; 0 when there is none yet.
func seriesValue(t *testing.T, g *gw, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := g.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, lp := range m.GetLabel() {
					found = found || (lp.GetName() == labels[i] && lp.GetValue() == labels[i+1])
				}
				if !found {
					continue series
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}

// requireServed fails unless every part succeeded, and the parts owned by
// name were served by it.
func (c *chaos) requireServed(results []partResult, ownedBy map[string]string) {
	c.t.Helper()
	for _, r := range results {
		if !r.ok {
			c.t.Errorf("part %s after recovery: statuses %v", r.id, r.status)
		}
		if want := ownedBy[r.id]; want != "" && r.encoder != want {
			c.t.Errorf("part %s owned by %s was served by %q", r.id, want, r.encoder)
		}
	}
}

// TestChaosEncoderCrashMidRequest: an encoder crashes when its 6th /send
// arrives, in the middle of 24 parts at once, resetting every connection;
// it restarts on the same address with its state gone.
func TestChaosEncoderCrashMidRequest(t *testing.T) {
	chaosLeakCheck(t)
	c := newChaos(t, 3, nil, nil)
	const victim = "enc-1"
	down, back := c.owned("crash-down", victim, 12), c.owned("crash-back", victim, 200)
	after := ids("crash-after", 12)
	ownedAfter := map[string]string{}
	for _, id := range after {
		if e, _ := c.g.Pool().Owner(id); e != nil {
			ownedAfter[id] = e.Name
		}
	}
	v := c.encs[1]
	v.SetFaults(fakeencoder.Faults{CrashAt: 6, CrashRoutes: []string{routeSend}})
	c.wave(ids("crash", 24))
	if !v.Crashed() {
		t.Fatalf("%s did not crash: it got %d /sends", victim, v.Stats().Routes[routeSend])
	}
	// New /encodes owned by the crashed encoder find nothing listening: each
	// goes to the next encoder, until the breaker opens on those faults.
	for i := 0; c.transitions(victim, upstream.BreakerClosed, upstream.BreakerOpen) < 1; i++ {
		if i == len(down) {
			t.Fatalf("%s: breaker still closed after %d /encodes to a crashed encoder", victim, i)
		}
		r, ok := c.call(routeEncode, down[i], encodeBody(down[i]), "")
		if ok && (r.status != http.StatusOK || r.header.Get("X-Encgate-Encoder") == victim) {
			t.Errorf("/encode %s owned by the crashed %s: %d from %q %s", down[i], victim, r.status, r.header.Get("X-Encgate-Encoder"), r.body)
		}
	}
	if err := v.Restart(); err != nil {
		t.Fatal(err)
	}
	c.awaitReturn(victim, back)
	c.requireServed(c.wave(after), ownedAfter)
	c.check()
}

// TestChaosCrashedEncoderIdleConnsDeliverNothing: right after a crash, an
// /encode owned by the crashed encoder (its breaker still closed) provably
// reaches nothing: it must go to the next encoder, as a refused connect
// does, not come back as a 502 remembered for the part.
func TestChaosCrashedEncoderIdleConnsDeliverNothing(t *testing.T) {
	chaosLeakCheck(t)
	c := newChaos(t, 2, nil, nil)
	owned := c.owned("idle", "enc-1", 16)
	for _, r := range c.wave(owned[:8]) { // leaves several idle connections to enc-1
		if !r.ok {
			t.Fatalf("part %s before the crash: %v", r.id, r.status)
		}
	}
	c.encs[1].Crash()
	for _, id := range owned[8:11] {
		r, ok := c.call(routeEncode, id, encodeBody(id), "")
		if ok && (r.status != http.StatusOK || r.header.Get("X-Encgate-Encoder") != "enc-0") {
			t.Errorf("/encode %s owned by the crashed enc-1: %d from %q %s, want 200 from enc-0",
				id, r.status, r.header.Get("X-Encgate-Encoder"), r.body)
		}
	}
	c.check()
}

// TestChaosHangingEncoder: an encoder accepts and reads every request but
// never answers, while /sends for parts it holds arrive with duplicates
// and new parts come in.
func TestChaosHangingEncoder(t *testing.T) {
	chaosLeakCheck(t)
	c := newChaos(t, 3, nil, nil)
	const victim = "enc-2"
	v := c.encs[2]
	held := append(c.owned("hang-held", victim, 4), ids("hang-other", 4)...)
	back := c.owned("hang-back", victim, 200)
	// Every held part is encoded and its metadata pulled; its /sends wait.
	var wg sync.WaitGroup
	for _, id := range held {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, call := range [][2]string{{routeEncode, encodeBody(id)}, {routeMetadata, metaBody(id)}} {
				if r, ok := c.call(call[0], id, call[1], ""); ok && r.status != http.StatusOK {
					t.Errorf("%s %s before the hang: %d %s", call[0], id, r.status, r.body)
				}
			}
		}()
	}
	wg.Wait()

	v.SetFaults(fakeencoder.Faults{Hang: true})
	var statuses sync.Map // req_id -> []int, its /sends' statuses
	for _, id := range held {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st := c.sends(id)
			statuses.Store(id, st)
		}()
	}
	c.wave(ids("hang-new", 12))
	wg.Wait()
	if n := c.transitions(victim, upstream.BreakerClosed, upstream.BreakerOpen); n < 1 {
		t.Errorf("%s: breaker never opened on timeouts", victim)
	}
	// The held parts on the hung encoder got a 504 (stored: the encoder took
	// the /send) or a fast 503 once its breaker was open, never a 200.
	for _, id := range held[:4] {
		st, _ := statuses.Load(id)
		for _, s := range st.([]int) {
			if s != http.StatusGatewayTimeout && s != http.StatusServiceUnavailable {
				t.Errorf("/send %s on the hung encoder: statuses %v", id, st)
				break
			}
		}
	}
	v.SetFaults(fakeencoder.Faults{})
	// Late duplicates after the hang: a /send the encoder took is answered
	// from the store; it never reaches the encoder again.
	for _, id := range held[:4] {
		c.call(routeSend, id, tpSend(id, 1, c.tp), sendDest(1))
	}
	c.awaitReturn(victim, back)
	c.check()
}

// TestChaosSlowEncoders: one encoder answers slowly but well within the
// per-try timeout (a tenth of it), another beyond it.
func TestChaosSlowEncoders(t *testing.T) {
	chaosLeakCheck(t)
	c := newChaos(t, 3, nil, nil)
	slow, stuck := c.encs[1], c.encs[2]
	back := c.owned("slow-back", "enc-2", 200)
	slow.SetFaults(fakeencoder.Faults{Latency: c.cfg.Retry.Encode.PerTryTimeout.D() / 10})
	stuck.SetFaults(fakeencoder.Faults{Latency: 3 * c.cfg.Retry.Encode.PerTryTimeout.D()})
	results := c.wave(ids("slow", 18))
	for _, r := range results {
		switch r.encoder {
		case "enc-0", "enc-1":
			if !r.ok {
				t.Errorf("part %s on %s (not stuck): statuses %v", r.id, r.encoder, r.status)
			}
		case "enc-2":
			if r.ok || r.status[0] != http.StatusGatewayTimeout {
				t.Errorf("part %s on the stuck encoder: statuses %v, want a 504 /encode", r.id, r.status)
			}
		}
	}
	if n := c.transitions("enc-1", upstream.BreakerClosed, upstream.BreakerOpen); n != 0 {
		t.Errorf("the slow but answering enc-1 was opened %v times", n)
	}
	if n := c.transitions("enc-2", upstream.BreakerClosed, upstream.BreakerOpen); n < 1 {
		t.Errorf("the stuck enc-2 never opened")
	}
	stuck.SetFaults(fakeencoder.Faults{})
	slow.SetFaults(fakeencoder.Faults{})
	c.awaitReturn("enc-2", back)
	c.check()
}

// TestChaosHealthFlapping: an encoder's /health flaps (2 passes, 2
// failures, ...) while parts come and go. Probes run on the gateway's fake
// clock, one round at a time: after each, the encoder takes new /encodes
// exactly while it is up, and a follow-up pinned to it fails fast while it
// is down.
func TestChaosHealthFlapping(t *testing.T) {
	chaosLeakCheck(t)
	clk := clock.NewFake(time.Now())
	c := newChaos(t, 3, func(cfg *Config) {
		cfg.Health = upstream.HealthConfig{Path: "/health", Interval: configfile.Duration(time.Second),
			Timeout: configfile.Duration(500 * time.Millisecond), DownAfter: 2, UpAfter: 2}
	}, clk)
	const victim = "enc-1"
	e := c.encoder(victim)
	fresh := c.owned("flap-new", victim, 40)
	c.encs[1].SetFaults(fakeencoder.Faults{HealthFlap: 2})
	// Parked on the clock: one health loop per encoder, the pin sweeper and
	// the /send store's sweeper.
	parked := len(c.encs) + 2
	var checks [3]uint64
	probe := func() {
		eventually(t, "every health loop parked on the clock", func() bool { return clk.Pending() == parked })
		clk.Advance(c.cfg.Health.Interval.D())
		for i, enc := range c.g.Pool().Encoders() {
			checks[i]++
			eventually(t, enc.Name+"'s probe", func() bool { return enc.Health.Snapshot().Checks == checks[i] })
		}
	}
	// Probe k (1-based) fails when (k-1)/2 is odd; down after 2 failures,
	// up after 2 passes: up, up, up, down, down, up, up, down, ...
	wantUp := []bool{true, true, true, false, false, true, true, false, false, true}
	var pinned []string // encoded on the victim while it was up
	for round, up := range wantUp {
		probe()
		if e.Health.Up() != up {
			t.Fatalf("round %d: %s up=%v, want %v", round, victim, e.Health.Up(), up)
		}
		// Follow-ups of parts encoded on the victim in earlier rounds.
		for _, id := range pinned {
			r, ok := c.call(routeMetadata, id, metaBody(id), "")
			switch {
			case !ok:
			case up && r.status != http.StatusOK:
				t.Errorf("round %d: metadata %s on the up %s: %d %s", round, id, victim, r.status, r.body)
			case !up && (r.status != http.StatusServiceUnavailable || !strings.Contains(r.body, "down (active health)")):
				t.Errorf("round %d: metadata %s on the down %s: %d %s", round, id, victim, r.status, r.body)
			}
		}
		pinned = pinned[:0]
		for _, r := range c.wave(append(fresh[:0:0], fresh[4*round:4*round+4]...)) {
			if r.ok != true || (r.encoder == victim) != up {
				t.Errorf("round %d (up=%v): part %s owned by %s served by %s: %v", round, up, r.id, victim, r.encoder, r.status)
			}
		}
		if up {
			id := fmt.Sprintf("flap-pinned-%d_local_part_0", round)
			for k := 0; ; k++ {
				if o, err := c.g.Pool().Owner(id); err == nil && o.Name == victim {
					break
				}
				id = fmt.Sprintf("flap-pinned-%d-%d_local_part_0", round, k)
			}
			if r, ok := c.call(routeEncode, id, encodeBody(id), ""); ok && r.status == http.StatusOK {
				pinned = append(pinned, id)
			}
		}
	}
	if got := seriesValue(t, c.g, "encgate_upstream_healthy", "encoder", victim); got != 1 {
		t.Errorf("encgate_upstream_healthy{%s} = %v at the end, want 1", victim, got)
	}
	c.check()
}

// TestChaos504Storms: every encoder answers every metadata pull "encode
// metadata not ready" (the retry budget must cap the retries, and no breaker
// may open on it); then one encoder answers every /encode 504 "encoder
// batch timed out" (a real fault: its breaker opens, then closes once it
// recovers). The gateway runs on a fake clock that never moves, so the
// whole storm falls in one budget window.
func TestChaos504Storms(t *testing.T) {
	chaosLeakCheck(t)
	c := newChaos(t, 3, func(cfg *Config) {
		cfg.Retry.Budget = upstream.BudgetConfig{Ratio: 0.2, MinPerSecond: 1, Window: configfile.Duration(10 * time.Second)}
	}, clock.NewFake(time.Now()))
	back := c.owned("storm-back", "enc-1", 200)
	storm := fakeencoder.Faults{FailureRate: 1, FailStatus: http.StatusGatewayTimeout,
		FailMessage: sglang.MetadataNotReady, FailRoutes: []string{routeMetadata}}
	for _, e := range c.encs {
		e.SetFaults(storm)
	}
	const parts = 30
	for _, r := range c.wave(ids("storm", parts)) {
		if len(r.status) != 2 || r.status[1] != http.StatusGatewayTimeout {
			t.Errorf("part %s in the metadata storm: %v", r.id, r.status)
		}
	}
	retries := seriesValue(t, c.g, "encgate_retries_total", "route", "metadata")
	b := c.cfg.Retry.Budget
	if limit := b.Ratio*parts + b.MinPerSecond*b.Window.D().Seconds(); retries > limit || retries == 0 {
		t.Errorf("metadata retries %v, want 1..%v (ratio x requests + min_per_second x window)", retries, limit)
	}
	if seriesValue(t, c.g, "encgate_retry_budget_exhausted_total", "route", "metadata") == 0 {
		t.Error("the budget never ran out in a storm of", parts*c.cfg.Retry.Metadata.MaxAttempts, "wanted pulls")
	}
	var pulls int64
	for _, e := range c.encs {
		pulls += e.Stats().Routes[routeMetadata]
	}
	if pulls != parts+int64(retries) {
		t.Errorf("encoders got %d metadata pulls, want %d requests + %v retries", pulls, parts, retries)
	}
	if n := seriesValue(t, c.g, "encgate_breaker_transitions_total"); n != 0 {
		t.Errorf("%v breaker transitions on \"not ready\" answers, want none", n)
	}

	for _, e := range c.encs {
		e.SetFaults(fakeencoder.Faults{})
	}
	c.encs[1].SetFaults(fakeencoder.Faults{FailureRate: 1, FailStatus: http.StatusGatewayTimeout,
		FailMessage: "encoder batch timed out", FailRoutes: []string{routeEncode}})
	// Parts owned by enc-1 meet the storm (an /encode answered 504 is a
	// fault and is not retried) until its breaker opens; from then on they go
	// to the next encoders, except one that finds it half-open, which meets
	// the storm again. The breaker cannot open before consecutive_failures
	// of them met it.
	stormed := 0
	for _, r := range c.wave(c.owned("storm-enc", "enc-1", 12)) {
		switch {
		case r.encoder == "enc-1" && len(r.status) == 1 && r.status[0] == http.StatusGatewayTimeout:
			stormed++
		case r.encoder == "enc-1" || !r.ok:
			t.Errorf("part %s owned by the failing enc-1: served by %q, %v", r.id, r.encoder, r.status)
		}
	}
	if n := c.transitions("enc-1", upstream.BreakerClosed, upstream.BreakerOpen); n < 1 || stormed < c.cfg.Breaker.ConsecutiveFailures {
		t.Errorf("enc-1 opened %v times after %d parts met its storm of 504 batch timeouts, want >= 1 after >= %d",
			n, stormed, c.cfg.Breaker.ConsecutiveFailures)
	}
	c.encs[1].SetFaults(fakeencoder.Faults{})
	c.awaitReturn("enc-1", back)
	c.check()
}

// TestChaosHalfOpenAdmitsOneEncode: a half-open breaker lets
// half_open_requests probes through. While one slow probe is out, other new
// /encodes owned by that encoder must go to the next encoder (nothing holds
// them there), not pile onto an encoder that is still failing.
func TestChaosHalfOpenAdmitsOneEncode(t *testing.T) {
	chaosLeakCheck(t)
	c := newChaos(t, 3, nil, nil)
	owned := c.owned("half", "enc-1", 12)
	v := c.encs[1]
	v.SetFaults(fakeencoder.Faults{Latency: 300 * time.Millisecond, FailureRate: 1, FailRoutes: []string{routeEncode}})
	for _, id := range owned[:3] {
		c.call(routeEncode, id, encodeBody(id), "")
	}
	e := c.encoder("enc-1")
	eventually(t, "enc-1 half-open", func() bool { return e.Breaker.State() == upstream.BreakerHalfOpen })
	before := v.Stats().Routes[routeEncode]
	c.wave(owned[3:9])
	if got, limit := v.Stats().Routes[routeEncode]-before, int64(c.cfg.Breaker.HalfOpenRequests); got > limit {
		t.Errorf("a half-open enc-1 (half_open_requests %d) got %d of 6 concurrent /encodes", limit, got)
	}
	c.check()
}

// TestChaosTruncatedAnswers: an encoder does the work, then sends answers
// whose Content-Length promises more bytes than come before it closes the
// connection. The breaker trips after 20 faults in a row (and not on the
// failure ratio), so exactly 12 /sends and 8 /encodes meet the truncation.
func TestChaosTruncatedAnswers(t *testing.T) {
	chaosLeakCheck(t)
	c := newChaos(t, 3, func(cfg *Config) {
		cfg.Breaker.ConsecutiveFailures = 20
		cfg.Breaker.MinRequests = 1000
	}, nil)
	const victim = "enc-0"
	v := c.encs[0]
	held := c.owned("trunc-held", victim, 6)
	encodes := c.owned("trunc-enc", victim, 10)
	back := c.owned("trunc-back", victim, 200)
	var wg sync.WaitGroup
	for _, id := range held {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, call := range [][2]string{{routeEncode, encodeBody(id)}, {routeMetadata, metaBody(id)}} {
				if r, ok := c.call(call[0], id, call[1], ""); ok && r.status != http.StatusOK {
					t.Errorf("%s %s before truncation: %d %s", call[0], id, r.status, r.body)
				}
			}
		}()
	}
	wg.Wait()

	v.SetFaults(fakeencoder.Faults{Truncate: true, TruncateRoutes: []string{routeSend, routeEncode}})
	for _, id := range held {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, s := range c.sends(id) {
				if s != http.StatusBadGateway {
					t.Errorf("/send %s with truncated answers: status %d, want 502", id, s)
				}
			}
		}()
	}
	wg.Wait()
	st := v.Stats()
	for _, id := range held {
		for rank := 0; rank < c.tp; rank++ {
			if k := id + "|" + sendDest(rank); st.Sends[k] != 1 {
				t.Errorf("/send %s: the encoder handled it %d times, want once (the work was done, the answer lost)", k, st.Sends[k])
			}
		}
	}
	for i, id := range encodes {
		r, ok := c.call(routeEncode, id, encodeBody(id), "")
		if !ok {
			continue
		}
		if i < 8 {
			// Delivered, so never retried elsewhere; remembered for the
			// follow-ups, which get it without a round trip.
			if r.status != http.StatusBadGateway || !strings.Contains(r.body, "exchange with encoder "+victim+" failed") {
				t.Errorf("/encode %d (%s): %d %s, want a 502 naming %s", i, id, r.status, r.body, victim)
			}
			if m, ok := c.call(routeMetadata, id, metaBody(id), ""); ok && m.status != http.StatusBadGateway {
				t.Errorf("metadata %s after a truncated /encode: %d %s", id, m.status, m.body)
			}
			continue
		}
		if r.status != http.StatusOK || r.header.Get("X-Encgate-Encoder") == victim {
			t.Errorf("/encode %d (%s) after the breaker opened: %d from %q", i, id, r.status, r.header.Get("X-Encgate-Encoder"))
		}
	}
	if got := v.Stats().Routes[routeEncode] - int64(len(held)); got != 8 {
		t.Errorf("the victim got %d truncated /encodes, want 8", got)
	}
	if got := v.Stats().Routes[routeMetadata]; got != int64(len(held)) {
		t.Errorf("the victim got %d metadata pulls, want %d (none for failed /encodes)", got, len(held))
	}
	if n := c.transitions(victim, upstream.BreakerClosed, upstream.BreakerOpen); n != 1 {
		t.Errorf("breaker opened %v times, want 1", n)
	}
	v.SetFaults(fakeencoder.Faults{})
	c.awaitReturn(victim, back)
	c.check()
}

// chaosFaults are the faults a mixed round draws from. apply sets one on an
// encoder; heal restarts a crashed encoder and clears its faults.
var chaosFaults = []struct {
	name  string
	apply func(e *fakeencoder.Encoder, rnd *rand.Rand, perTry time.Duration)
}{
	{"crash", func(e *fakeencoder.Encoder, rnd *rand.Rand, _ time.Duration) {
		routes := [][]string{{routeEncode}, {routeSend}, {routeMetadata}, nil}
		e.SetFaults(fakeencoder.Faults{CrashAt: 1 + rnd.IntN(6), CrashRoutes: routes[rnd.IntN(len(routes))]})
	}},
	{"hang", func(e *fakeencoder.Encoder, _ *rand.Rand, _ time.Duration) {
		e.SetFaults(fakeencoder.Faults{Hang: true})
	}},
	{"slow", func(e *fakeencoder.Encoder, rnd *rand.Rand, perTry time.Duration) {
		e.SetFaults(fakeencoder.Faults{Latency: time.Duration(rnd.Float64() * 1.5 * float64(perTry))})
	}},
	{"truncate", func(e *fakeencoder.Encoder, rnd *rand.Rand, _ time.Duration) {
		e.SetFaults(fakeencoder.Faults{Truncate: true, TruncateRoutes: [][]string{{routeSend}, {routeEncode}, nil}[rnd.IntN(3)]})
	}},
	{"504-storm", func(e *fakeencoder.Encoder, rnd *rand.Rand, _ time.Duration) {
		e.SetFaults(fakeencoder.Faults{FailureRate: 0.5 + rnd.Float64()/2, FailStatus: http.StatusGatewayTimeout,
			FailMessage: sglang.MetadataNotReady, FailRoutes: []string{routeMetadata}})
	}},
	{"500s", func(e *fakeencoder.Encoder, rnd *rand.Rand, _ time.Duration) {
		e.SetFaults(fakeencoder.Faults{FailureRate: rnd.Float64(), FailMessage: "Internal encoding error: CUDA out of memory"})
	}},
	{"refuse", func(e *fakeencoder.Encoder, _ *rand.Rand, _ time.Duration) {
		e.SetFaults(fakeencoder.Faults{Refuse: true})
	}},
}

// mixedRounds runs rounds of mixed faults until more() is false: each round
// puts a drawn fault on two drawn encoders, runs 16 parts at once, heals
// them, and waits until both take new work again. backIDs is how many
// req_ids owned by each encoder to set aside for that. At the end a clean
// wave must succeed everywhere.
func mixedRounds(t *testing.T, backIDs int, more func(round int) bool) {
	seed := *chaosSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("fault schedule seed %d (rerun with -chaos.seed=%d)", seed, seed)
	rnd := rand.New(rand.NewPCG(seed, 7))
	c := newChaos(t, 4, nil, nil)
	back := map[string][]string{}
	for i := range c.encs {
		name := "enc-" + strconv.Itoa(i)
		back[name] = c.owned("mixed-back", name, backIDs)
	}
	perTry := c.cfg.Retry.Encode.PerTryTimeout.D()
	rounds := 0
	for ; more(rounds); rounds++ {
		victims := rnd.Perm(len(c.encs))[:2]
		var drawn []string
		for _, i := range victims {
			f := chaosFaults[rnd.IntN(len(chaosFaults))]
			f.apply(c.encs[i], rnd, perTry)
			drawn = append(drawn, fmt.Sprintf("enc-%d:%s", i, f.name))
		}
		results := c.wave(ids(fmt.Sprintf("mixed-%d", rounds), 16))
		t.Logf("round %d: %v: %s", rounds, drawn, summarize(results))
		for _, i := range victims {
			if c.encs[i].Crashed() {
				if err := c.encs[i].Restart(); err != nil {
					t.Fatal(err)
				}
			}
			c.encs[i].SetFaults(fakeencoder.Faults{})
		}
		for _, i := range victims {
			name := "enc-" + strconv.Itoa(i)
			back[name] = c.awaitReturn(name, back[name])
		}
	}
	for _, r := range c.wave(ids("mixed-final", 16)) {
		if !r.ok {
			t.Errorf("part %s after every fault healed: %v", r.id, r.status)
		}
	}
	c.check()
	t.Logf("%d rounds", rounds)
}

// summarize counts parts by how far they got: "ok" or the failing route
// and status ("encode:503"), with one failing /encode or metadata answer of
// each kind.
func summarize(results []partResult) string {
	counts := map[string]int{}
	examples := map[string]string{}
	for _, r := range results {
		switch {
		case r.ok:
			counts["ok"]++
		case len(r.status) == 0:
			counts["unanswered"]++
		default:
			step := [...]string{"encode", "metadata"}
			at := "send"
			if i := len(r.status) - 1; i < len(step) {
				at = step[i]
			}
			kind := fmt.Sprintf("%s:%d", at, r.status[len(r.status)-1])
			counts[kind]++
			if r.last != "" {
				examples[kind] = r.last
			}
		}
	}
	return fmt.Sprint(counts, examples)
}

// TestChaosMixedFaults runs three rounds of mixed faults.
func TestChaosMixedFaults(t *testing.T) {
	chaosLeakCheck(t)
	mixedRounds(t, 100, func(round int) bool { return round < 3 })
}

// TestChaosSoak runs mixed-fault rounds for -chaos.soak.
func TestChaosSoak(t *testing.T) {
	if *chaosSoak <= 0 {
		t.Skip("the soak is off; run it with: go test ./gateway/ -run ChaosSoak -chaos.soak=2m")
	}
	chaosLeakCheck(t)
	end := time.Now().Add(*chaosSoak)
	mixedRounds(t, 5000, func(int) bool { return time.Now().Before(end) })
}

// heapInUse returns the live heap after full collections (two: the
// first only moves sync.Pool contents to their victim caches).
func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// TestChaosMemoryBoundedMillionReqIDs drives memoryReqIDs distinct req_ids
// (10^6; 10^5 under the race detector, which makes each step ~10x dearer)
// through the gateway's own per-req_id state, with the calls its request
// path makes, without sockets: each /encode pins its req_id (serveEncode);
// a quarter of them fail and are remembered (the pin table's Fail); half are /sent by
// one receiver rank through the /send deduplicator over the memory store,
// stored, released and unpinned (serveSend, writeSendResult); a quarter
// never get a /send (zmq mode) and keep their pin. The clock never moves,
// so nothing expires: only the configured bounds (affinity.max_pins,
// idempotency.capacity) keep the state in check. Their counts, and the
// live heap, must stay under bounds computed from that config.
func TestChaosMemoryBoundedMillionReqIDs(t *testing.T) {
	chaosLeakCheck(t)
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Encoders = []upstream.EncoderConfig{{Name: "enc-0", URL: "http://" + deadAddr(t)}}
	cfg.Health.Disabled = true
	cfg.Affinity.MaxPins = 4096
	cfg.Idempotency.Capacity = 4096
	clk := clock.NewFake(time.Now())
	reg := prometheus.NewRegistry()
	s, err := New(cfg, Deps{Log: zap.NewNop(), Registry: reg, Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Shutdown(context.Background()) }()
	g := &gw{Server: s, reg: reg}
	enc := s.pool.Encoders()[0]
	pins, store := s.pool.PinTableForTest(), s.store.Memory
	// The pin table's bound is exact; the store holds up to capacity/64+1
	// records in each of its 64 shards.
	maxPins, maxRecords := cfg.Affinity.MaxPins, 64*(cfg.Idempotency.Capacity/64+1)
	// 512 B per entry is about twice what a pin or a one-destination
	// record costs; 8 MiB covers the rest of the heap this test touches.
	heapBound := uint64(maxPins+maxRecords)*512 + 8<<20
	before := heapInUse()
	answer := idempotency.Answer{Status: 200, ContentType: "application/json", Body: []byte("null")}
	forward := func(time.Duration) (idempotency.Answer, bool) { return answer, true }
	deadline := clk.Now().Add(cfg.Retry.Send.Deadline.D())
	body := make([]byte, 0, 512)
	check := func(i int) {
		if pins.Len() > maxPins || store.Records() > int64(maxRecords) {
			t.Fatalf("after %d req_ids: %d pins (bound %d), %d records (bound %d)", i, pins.Len(), maxPins, store.Records(), maxRecords)
		}
		if h := heapInUse(); h > before && h-before > heapBound {
			t.Fatalf("after %d req_ids the heap grew %d KiB, bound %d KiB", i, (h-before)>>10, heapBound>>10)
		}
	}
	for i := 0; i < memoryReqIDs; i++ {
		body = strconv.AppendInt(append(body[:0], `{"req_id":"mem-`...), int64(i), 10)
		body = append(body, `_local_part_0`...)
		id := string(body[len(`{"req_id":"`):])
		pins.Set(id, enc.Name, enc.ID())
		switch i % 4 {
		case 0:
			pins.Fail(id, upstream.Failure{Status: 500, Message: "Internal encoding error: injected", Answered: true, Placed: true})
		case 1, 2:
			body = append(body, `","part_idx":0,"embedding_size":524288,"embedding_len":256,"embedding_dim":1024,`+
				`"prefill_host":"10.0.0.1","embedding_port":40000,"session_id":"10.0.0.1:17000",`+
				`"buffer_address":140737488355328,"receive_count":1}`...)
			parsed, err := sglang.ParseSend(body, sglang.Limits{})
			if err != nil {
				t.Fatal(err)
			}
			res := s.sends.Do(context.Background(), idempotency.NewSend(parsed), deadline, forward)
			if res.Outcome != idempotency.Forwarded || !res.Released {
				t.Fatalf("/send %s: outcome %v, released %v", id, res.Outcome, res.Released)
			}
			pins.Delete(id)
		}
		if (i+1)%(memoryReqIDs/4) == 0 {
			check(i + 1)
		}
	}
	if pins.Evictions() == 0 || store.Evictions() == 0 {
		t.Fatalf("evictions: %d pins, %d records; the bounds were never reached", pins.Evictions(), store.Evictions())
	}
	if p, r := seriesValue(t, g, "encgate_pins"), seriesValue(t, g, "encgate_idempotency_records"); int(p) != pins.Len() || int64(r) != store.Records() {
		t.Errorf("gauges say %v pins and %v records, the tables %d and %d", p, r, pins.Len(), store.Records())
	}
	t.Logf("%d req_ids: %d pins (bound %d, %d evicted), %d records (bound %d, %d evicted), heap +%d KiB (bound %d KiB)",
		memoryReqIDs, pins.Len(), maxPins, pins.Evictions(), store.Records(), maxRecords, store.Evictions(),
		(int64(heapInUse())-int64(before))>>10, heapBound>>10)
}

// TestChaosMemoryBoundedOverHTTP is the same over real sockets, smaller:
// 1,000 distinct parts through a gateway whose bounds are 128 pins and 128
// records; two thirds get one /send out of receive_count 2 (never released),
// a third none.
func TestChaosMemoryBoundedOverHTTP(t *testing.T) {
	chaosLeakCheck(t)
	c := newChaos(t, 1, func(cfg *Config) {
		cfg.Affinity.MaxPins = 128
		cfg.Idempotency.Capacity = 128
	}, nil)
	maxPins, maxRecords := 128, 64*(128/64+1)
	const parts, workers = 1000, 8
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < parts; i += workers {
				id := fmt.Sprintf("memhttp-%d_local_part_0", i)
				if r, ok := c.call(routeEncode, id, encodeBody(id), ""); !ok || r.status != http.StatusOK {
					t.Errorf("/encode %s: %d %s", id, r.status, r.body)
					return
				}
				if i%3 != 0 {
					if r, ok := c.call(routeSend, id, tpSend(id, 0, 2), sendDest(0)); !ok || r.status != http.StatusOK {
						t.Errorf("/send %s: %d %s", id, r.status, r.body)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	pins, store := c.g.Pool(), c.g.store.Memory
	if pins.PinsHeld() > maxPins || store.Records() > int64(maxRecords) || pins.PinEvictionsTotal() == 0 || store.Evictions() == 0 {
		t.Fatalf("%d pins (bound %d, %d evicted), %d records (bound %d, %d evicted)",
			pins.PinsHeld(), maxPins, pins.PinEvictionsTotal(), store.Records(), maxRecords, store.Evictions())
	}
	c.check()
}
