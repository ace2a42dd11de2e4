package upstream

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
)

// healthRig runs a Health on a fake clock with a scripted prober.
type healthRig struct {
	t   *testing.T
	clk *clock.Fake
	h   *Health
	cfg HealthConfig

	mu      sync.Mutex
	script  []error // results, consumed in order; nil = pass
	probes  int
	changes []bool
	results []error

	cancel context.CancelFunc
	done   chan struct{}
}

var errProbe503 = &ProbeStatusError{Status: 503}

func newHealthRig(t *testing.T, cfg HealthConfig) *healthRig {
	t.Helper()
	r := &healthRig{t: t, clk: clock.NewFake(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)), cfg: cfg, done: make(chan struct{})}
	probe := func(ctx context.Context) error {
		if _, ok := ctx.Deadline(); !ok {
			t.Error("probe without a deadline")
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		r.probes++
		if len(r.script) == 0 {
			t.Error("probe beyond the script")
			return nil
		}
		err := r.script[0]
		r.script = r.script[1:]
		if err == errPanic {
			panic("prober blew up")
		}
		return err
	}
	r.h = NewHealth("enc-a", cfg, probe, r.clk,
		func(up bool) { r.mu.Lock(); r.changes = append(r.changes, up); r.mu.Unlock() },
		func(err error) { r.mu.Lock(); r.results = append(r.results, err); r.mu.Unlock() },
		nil)
	return r
}

var errPanic = errors.New("panic please")

// start runs the loop and waits until it waits on its first timer.
func (r *healthRig) start() {
	r.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	created := r.clk.TimerCreated()
	go func() {
		defer close(r.done)
		r.h.Run(ctx)
	}()
	r.wait(created)
	r.t.Cleanup(r.stop)
}

func (r *healthRig) wait(c <-chan struct{}) {
	r.t.Helper()
	select {
	case <-c:
	case <-time.After(30 * time.Second):
		r.t.Fatal("health loop did not come back to its timer")
	}
}

// step scripts the next probe result, lets Interval pass, and waits until
// the loop has applied the result and waits on its next timer.
func (r *healthRig) step(result error) {
	r.t.Helper()
	r.mu.Lock()
	r.script = append(r.script, result)
	r.mu.Unlock()
	created := r.clk.TimerCreated()
	r.clk.Advance(r.cfg.Interval.D())
	r.wait(created)
}

func (r *healthRig) stop() {
	r.cancel()
	select {
	case <-r.done:
	case <-time.After(30 * time.Second):
		r.t.Fatal("Run did not return after cancel")
	}
}

func (r *healthRig) record() (probes int, changes []bool, results []error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.probes, append([]bool(nil), r.changes...), append([]error(nil), r.results...)
}

func TestHealthDownAndUp(t *testing.T) {
	cfg := DefaultHealth()
	r := newHealthRig(t, cfg)
	if !r.h.Up() || !r.h.Snapshot().Up {
		t.Fatal("a fresh encoder is not up")
	}
	r.start()

	// Less than an interval: no probe.
	r.clk.Advance(cfg.Interval.D() - time.Nanosecond)
	if n, _, _ := r.record(); n != 0 {
		t.Fatalf("probed after %s", cfg.Interval.D()-time.Nanosecond)
	}

	r.step(errProbe503)
	r.step(errProbe503)
	s := r.h.Snapshot()
	if !r.h.Up() || !s.Up || s.ConsecutiveFailures != 2 || s.ConsecutivePasses != 0 || s.Checks != 2 || s.LastError != "status 503" {
		t.Fatalf("after 2 failures: up %v, %+v", r.h.Up(), s)
	}
	if !s.LastCheck.Equal(r.clk.Now()) {
		t.Fatalf("LastCheck %v, now %v", s.LastCheck, r.clk.Now())
	}
	r.step(errors.New("dial encoder enc-a: connection refused"))
	s = r.h.Snapshot()
	if r.h.Up() || s.Up || s.ConsecutiveFailures != 3 || s.Checks != 3 || !strings.Contains(s.LastError, "connection refused") {
		t.Fatalf("after 3 failures: up %v, %+v", r.h.Up(), s)
	}
	_, changes, results := r.record()
	if len(changes) != 1 || changes[0] {
		t.Fatalf("changes = %v", changes)
	}
	if len(results) != 3 || results[0] != errProbe503 || results[2] == nil {
		t.Fatalf("results = %v", results)
	}

	// More failures: still down, no more transitions.
	r.step(errProbe503)
	r.step(nil) // one pass is not enough
	s = r.h.Snapshot()
	if r.h.Up() || s.ConsecutivePasses != 1 || s.ConsecutiveFailures != 0 || s.LastError != "" {
		t.Fatalf("after 1 pass: up %v, %+v", r.h.Up(), s)
	}
	r.step(errProbe503) // a failure resets the passes
	r.step(nil)
	if r.h.Up() {
		t.Fatal("up after a broken run of passes")
	}
	r.step(nil)
	s = r.h.Snapshot()
	if !r.h.Up() || !s.Up || s.ConsecutivePasses != 2 || s.Checks != 8 {
		t.Fatalf("after 2 passes: up %v, %+v", r.h.Up(), s)
	}
	r.step(nil)
	probes, changes, results := r.record()
	if probes != 9 || len(results) != 9 {
		t.Fatalf("probes %d, results %d", probes, len(results))
	}
	if len(changes) != 2 || changes[0] || !changes[1] {
		t.Fatalf("changes = %v", changes)
	}
	for i, want := range []bool{false, false, false, false, true, false, true, true, true} {
		if (results[i] == nil) != want {
			t.Fatalf("results[%d] = %v", i, results[i])
		}
	}
}

func TestHealthRunStopsOnCancel(t *testing.T) {
	cfg := DefaultHealth()
	r := newHealthRig(t, cfg)
	r.start()
	r.step(nil)
	if r.clk.Pending() != 1 {
		t.Fatalf("pending timers = %d", r.clk.Pending())
	}
	r.stop()
	if r.clk.Pending() != 0 {
		t.Fatalf("Run left %d timers behind", r.clk.Pending())
	}
	// Time passing after the stop probes nothing.
	r.clk.Advance(10 * cfg.Interval.D())
	if n, _, _ := r.record(); n != 1 {
		t.Fatalf("probes = %d", n)
	}
}

func TestHealthPanickingProber(t *testing.T) {
	cfg := DefaultHealth()
	cfg.DownAfter = 1
	r := newHealthRig(t, cfg)
	r.start()
	r.step(errPanic)
	s := r.h.Snapshot()
	if r.h.Up() || !strings.Contains(s.LastError, "prober panicked") {
		t.Fatalf("after a panic: %+v", s)
	}
	r.step(nil) // up_after is 2
	r.step(nil)
	if !r.h.Up() {
		t.Fatal("the loop did not survive the panic")
	}
}

func TestHealthPanickingCallbacks(t *testing.T) {
	cfg := DefaultHealth()
	cfg.DownAfter = 1
	clk := clock.NewFake(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	var probes int
	h := NewHealth("enc-a", cfg, func(context.Context) error { probes++; return errProbe503 }, clk,
		func(bool) { panic("onChange") }, func(error) { panic("onResult") }, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	created := clk.TimerCreated()
	go func() { defer close(done); h.Run(ctx) }()
	<-created
	for i := 0; i < 3; i++ {
		created = clk.TimerCreated()
		clk.Advance(cfg.Interval.D())
		<-created
	}
	cancel()
	<-done
	if probes != 3 || h.Up() || h.Snapshot().Checks != 3 {
		t.Fatalf("probes %d, %+v", probes, h.Snapshot())
	}
}

func TestHealthDisabled(t *testing.T) {
	cfg := DefaultHealth()
	cfg.Disabled = true
	clk := clock.NewFake(time.Now())
	h := NewHealth("enc-a", cfg, func(context.Context) error {
		t.Error("probed while disabled")
		return errProbe503
	}, clk, nil, nil, nil)
	h.Run(context.Background()) // returns at once
	if !h.Up() || clk.Pending() != 0 {
		t.Fatal("disabled health is not up, or left a timer")
	}
	if s := h.Snapshot(); !s.Up || !s.Disabled || s.Checks != 0 {
		t.Fatalf("snapshot = %+v", s)
	}
}

func TestHealthValidate(t *testing.T) {
	var p configfile.Problems
	d := DefaultHealth()
	d.Validate(&p, "health")
	if err := p.Err(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	if d.Disabled || d.Path != "/health" || d.Interval.D() != 10*time.Second || d.Timeout.D() != 5*time.Second || d.DownAfter != 3 || d.UpAfter != 2 {
		t.Fatalf("defaults = %+v", d)
	}
	cases := []struct {
		mod  func(*HealthConfig)
		want string
	}{
		{func(c *HealthConfig) {
			c.Interval = configfile.Duration(500 * time.Millisecond)
			c.Timeout = configfile.Duration(100 * time.Millisecond)
		}, "health.interval: must be >= 1s, got 500ms: each probe of an idle encoder runs a GPU forward"},
		{func(c *HealthConfig) { c.Timeout = 0 }, "health.timeout: must be > 0"},
		{func(c *HealthConfig) { c.Timeout = c.Interval }, "health.timeout: must be < interval (10s), got 10s"},
		{func(c *HealthConfig) { c.DownAfter = 0 }, "health.down_after: must be >= 1"},
		{func(c *HealthConfig) { c.UpAfter = -1 }, "health.up_after: must be >= 1"},
		{func(c *HealthConfig) { c.Path = "health" }, `health.path: must start with "/"`},
		{func(c *HealthConfig) { c.Path = "" }, `health.path: must start with "/"`},
	}
	for _, c := range cases {
		cfg := DefaultHealth()
		c.mod(&cfg)
		p := configfile.Problems{}
		cfg.Validate(&p, "health")
		err := p.Err()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("want %q, got %v", c.want, err)
		}
	}
	cfg := DefaultHealth()
	if err := configfile.Decode([]byte("interval: 30s\ntimeout: 20s\ndown_after: 5\nup_after: 1\npath: /health_generate\n"), &cfg); err != nil {
		t.Fatal(err)
	}
	p = configfile.Problems{}
	cfg.Validate(&p, "health")
	if err := p.Err(); err != nil || cfg.Interval.D() != 30*time.Second || cfg.Path != "/health_generate" || cfg.DownAfter != 5 {
		t.Fatalf("decoded %+v: %v", cfg, err)
	}
}

// proberServer serves GET /health through handler and returns a HostClient
// pointed at it.
func proberServer(t *testing.T, handler http.HandlerFunc) (*fasthttp.HostClient, string) {
	t.Helper()
	srv := httptest.NewServer(handler)
	t.Cleanup(srv.Close)
	host := strings.TrimPrefix(srv.URL, "http://")
	c := &fasthttp.HostClient{Addr: host, RetryIfErr: func(*fasthttp.Request, int, error) (bool, bool) { return false, false }}
	t.Cleanup(c.CloseIdleConnections)
	return c, host
}

func TestHTTPProberHealthy(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	c, host := proberServer(t, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.Method+" "+r.URL.Path+" "+r.Host)
		mu.Unlock()
		w.WriteHeader(200)
	})
	probe := HTTPProber(c, "http", host, "/health", 5*time.Second)
	for i := 0; i < 3; i++ { // pooled connections are reused cleanly
		if err := probe(context.Background()); err != nil {
			t.Fatalf("probe %d: %v", i, err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 3 || seen[0] != "GET /health "+host {
		t.Fatalf("server saw %q", seen)
	}
}

func TestHTTPProberUnhealthy(t *testing.T) {
	for _, status := range []int{503, 500, 404, 204} {
		c, host := proberServer(t, func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(status)
			_, _ = w.Write([]byte(`{"status":"error"}`))
		})
		err := HTTPProber(c, "http", host, "/health", 5*time.Second)(context.Background())
		var se *ProbeStatusError
		if !errors.As(err, &se) || se.Status != status {
			t.Fatalf("status %d: err = %v", status, err)
		}
		if want := "status " + itoa(status); err.Error() != want {
			t.Fatalf("err = %q, want %q", err, want)
		}
	}
}

// hangingServer never answers until the test ends.
func hangingServer(t *testing.T) (*fasthttp.HostClient, string, <-chan struct{}) {
	t.Helper()
	release := make(chan struct{})
	entered := make(chan struct{}, 16)
	c, host := proberServer(t, func(w http.ResponseWriter, r *http.Request) {
		entered <- struct{}{}
		<-release
	})
	t.Cleanup(func() { close(release) }) // runs before srv.Close
	return c, host, entered
}

func TestHTTPProberTimeout(t *testing.T) {
	c, host, _ := hangingServer(t)
	err := HTTPProber(c, "http", host, "/health", 100*time.Millisecond)(context.Background())
	if err == nil || !isTimeout(err) {
		t.Fatalf("err = %v", err)
	}
}

func TestHTTPProberContext(t *testing.T) {
	c, host, entered := hangingServer(t)
	probe := HTTPProber(c, "http", host, "/health", time.Hour)

	// A context deadline shorter than the timeout bounds the probe.
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	err := probe(ctx)
	cancel()
	if err == nil || !isTimeout(err) {
		t.Fatalf("err = %v", err)
	}

	// Cancelling returns at once.
	ctx, cancel = context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- probe(ctx) }()
	<-entered
	<-entered // the first probe's request is there too
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v", err)
	}
	// An already cancelled context sends nothing.
	if err := probe(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v", err)
	}
}

func TestHTTPProberDeadAddress(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	err = HTTPProber(deadClient(addr), "http", addr, "/health", 5*time.Second)(context.Background())
	var de *DialError
	if !errors.As(err, &de) {
		t.Fatalf("err = %v", err)
	}
}

// Health with the real HTTP prober against a real server, end to end.
func TestHealthWithHTTPProber(t *testing.T) {
	var mu sync.Mutex
	status := 503
	c, host := proberServer(t, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		w.WriteHeader(status)
	})
	cfg := DefaultHealth()
	cfg.DownAfter, cfg.UpAfter = 1, 1
	clk := clock.NewFake(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	changes := make(chan bool, 4)
	h := NewHealth("enc-a", cfg, HTTPProber(c, "http", host, cfg.Path, cfg.Timeout.D()), clk,
		func(up bool) { changes <- up }, nil, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	created := clk.TimerCreated()
	go func() { defer close(done); h.Run(ctx) }()
	<-created
	created = clk.TimerCreated()
	clk.Advance(cfg.Interval.D())
	<-created
	if up := <-changes; up || h.Snapshot().LastError != "status 503" {
		t.Fatalf("after a 503: up=%v %+v", up, h.Snapshot())
	}
	mu.Lock()
	status = 200
	mu.Unlock()
	created = clk.TimerCreated()
	clk.Advance(cfg.Interval.D())
	<-created
	if up := <-changes; !up || !h.Up() {
		t.Fatalf("after a 200: %+v", h.Snapshot())
	}
	cancel()
	<-done
}

// A probe this process could not even start (out of descriptors) is not a
// failure of the encoder: however many, the encoder stays up, and its
// streaks are as they were.
func TestHealthIgnoresTheGatewaysOwnShortage(t *testing.T) {
	cfg := DefaultHealth()
	r := newHealthRig(t, cfg)
	r.start()
	r.step(errProbe503)
	emfile := &DialError{Encoder: "enc-a", Err: &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("socket", syscall.EMFILE)}}
	for i := 0; i < 3*cfg.DownAfter; i++ {
		r.step(emfile)
	}
	s := r.h.Snapshot()
	if !r.h.Up() || s.ConsecutiveFailures != 1 || s.Checks != 1 || !strings.HasPrefix(s.LastError, "not checked: ") {
		t.Fatalf("after the gateway's own shortage: up %v, %+v", r.h.Up(), s)
	}
	if _, _, results := r.record(); len(results) != 1 {
		t.Fatalf("%d results reached the breaker's trial, want 1", len(results))
	}
}
