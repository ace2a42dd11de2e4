package discovery

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
)

// Every top-level identifier here starts with "registrar" or "rt": other
// files of this package are written alongside, and their tests share the
// package's namespace.

// rtBootstrap is a loopback stand-in for sglang's EncoderBootstrapServer: it
// keeps the registered URLs in a set (as sglang dedupes them), records every
// request, can fail the next requests with 503, can forget registrations
// (a language-server restart) and can hold DELETEs until the client gives up.
type rtBootstrap struct {
	t   *testing.T
	srv *httptest.Server

	mu       sync.Mutex
	urls     map[string]bool
	posts    []string // the url of every accepted POST, in order
	deletes  []string // the url of every accepted DELETE, in order
	lists    int      // answered GETs of the list
	failNext int      // the next failNext requests (any route) get 503
	// hangDeletes makes DELETEs report on arrived and wait for the client
	// to go away.
	hangDeletes bool
	arrived     chan string
}

func rtNewBootstrap(t *testing.T) *rtBootstrap {
	b := &rtBootstrap{t: t, urls: map[string]bool{}, arrived: make(chan string, 64)}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /register_encoder_url", func(w http.ResponseWriter, r *http.Request) {
		u, ok := b.admit(w, r)
		if !ok {
			return
		}
		b.mu.Lock()
		b.urls[u] = true
		b.posts = append(b.posts, u)
		b.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"status":"ok"}`))
	})
	mux.HandleFunc("DELETE /unregister_encoder_url", func(w http.ResponseWriter, r *http.Request) {
		b.mu.Lock()
		hang := b.hangDeletes
		b.mu.Unlock()
		if hang {
			// Read the body first: only then does the server watch the
			// connection and end r's context when the client hangs up.
			_, _ = io.Copy(io.Discard, r.Body)
			b.arrived <- r.URL.Path
			<-r.Context().Done()
			return
		}
		u, ok := b.admit(w, r)
		if !ok {
			return
		}
		b.mu.Lock()
		delete(b.urls, u)
		b.deletes = append(b.deletes, u)
		b.mu.Unlock()
		_, _ = w.Write([]byte(`{"status":"ok"}`))
	})
	mux.HandleFunc("GET /list_encoder_urls", func(w http.ResponseWriter, r *http.Request) {
		if b.fail(w) {
			return
		}
		b.mu.Lock()
		list := make([]string, 0, len(b.urls))
		for u := range b.urls {
			list = append(list, u)
		}
		b.lists++
		b.mu.Unlock()
		slices.Sort(list)
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string][]string{"encoder_urls": list})
	})
	b.srv = httptest.NewServer(mux)
	t.Cleanup(b.srv.Close)
	return b
}

// fail answers 503 if the bootstrap is to fail this request.
func (b *rtBootstrap) fail(w http.ResponseWriter) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.failNext == 0 {
		return false
	}
	b.failNext--
	http.Error(w, "language server restarting", http.StatusServiceUnavailable)
	return true
}

// admit checks a (un)registration's body as sglang's bootstrap does and
// returns its url, having answered the request unless ok.
func (b *rtBootstrap) admit(w http.ResponseWriter, r *http.Request) (string, bool) {
	if b.fail(w) {
		return "", false
	}
	if ct := r.Header.Get("Content-Type"); ct != "application/json" {
		b.t.Errorf("%s %s with Content-Type %q", r.Method, r.URL.Path, ct)
	}
	var body struct {
		URL string `json:"url"`
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil || body.URL == "" {
		w.WriteHeader(http.StatusBadRequest)
		_, _ = w.Write([]byte(`{"error": "Missing or empty 'url' field"}`))
		b.t.Errorf("%s %s without a url: %v", r.Method, r.URL.Path, err)
		return "", false
	}
	return body.URL, true
}

func (b *rtBootstrap) setFailNext(n int) {
	b.mu.Lock()
	b.failNext = n
	b.mu.Unlock()
}

// forget drops the given URLs, or every one with none given.
func (b *rtBootstrap) forget(urls ...string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(urls) == 0 {
		clear(b.urls)
	}
	for _, u := range urls {
		delete(b.urls, u)
	}
}

// registered returns the set's URLs, sorted.
func (b *rtBootstrap) registered() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []string
	for u := range b.urls {
		out = append(out, u)
	}
	slices.Sort(out)
	return out
}

func (b *rtBootstrap) counts() (posts, deletes, lists int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.posts), len(b.deletes), b.lists
}

// rtClock is a clock.Fake that also reports the duration of every timer the
// code under test arms, once it is armed: the test knows a round is over
// (the loop only arms a timer between rounds) and which wait was chosen.
type rtClock struct {
	*clock.Fake
	armed chan time.Duration
}

func rtNewClock() *rtClock {
	return &rtClock{Fake: clock.NewFake(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)), armed: make(chan time.Duration, 64)}
}

func (c *rtClock) NewTimer(d time.Duration) clock.Timer {
	t := c.Fake.NewTimer(d)
	c.armed <- d
	return t
}

// rtGuard only turns a hang into a failure that says what was awaited; it
// is never what a test synchronises on.
const rtGuard = time.Minute

// waitArmed returns the duration of the next timer armed.
func (c *rtClock) waitArmed(t *testing.T, what string) time.Duration {
	t.Helper()
	select {
	case d := <-c.armed:
		return d
	case <-time.After(rtGuard):
		t.Fatalf("no timer armed: %s", what)
		return 0
	}
}

// expectArmed waits for the next timer and fails unless it is for want.
func (c *rtClock) expectArmed(t *testing.T, want time.Duration, what string) {
	t.Helper()
	if d := c.waitArmed(t, what); d != want {
		t.Fatalf("%s: armed a %v wait, want %v", what, d, want)
	}
}

// rtRetry and rtCheck differ, so the wait the loop chose is visible.
const (
	rtRetry = 5 * time.Second
	rtCheck = 30 * time.Second
)

func rtConfig(fanout int, bootstraps ...*rtBootstrap) RegistrarConfig {
	cfg := DefaultRegistrar()
	for _, b := range bootstraps {
		cfg.RegisterWith = append(cfg.RegisterWith, b.srv.URL+"/")
	}
	cfg.AdvertiseURL = "http://gw:8080/"
	cfg.Fanout = fanout
	cfg.RetryInterval = configfile.Duration(rtRetry)
	cfg.CheckInterval = configfile.Duration(rtCheck)
	return cfg
}

// rtHarness is a registrar under test with its clock, metrics and logs.
type rtHarness struct {
	r    *Registrar
	clk  *rtClock
	reg  *prometheus.Registry
	logs *observer.ObservedLogs
}

func rtNew(cfg RegistrarConfig) *rtHarness {
	core, logs := observer.New(zapcore.DebugLevel)
	h := &rtHarness{clk: rtNewClock(), reg: prometheus.NewRegistry(), logs: logs}
	h.r = NewRegistrar(cfg, RegistrarDeps{Log: zap.New(core), Registry: h.reg, Clock: h.clk})
	return h
}

// run starts Run and returns a stop that cancels it and waits for it to
// return.
func (h *rtHarness) run(t *testing.T) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.r.Run(ctx)
	}()
	stopped := false
	stop = func() {
		t.Helper()
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case <-done:
		case <-time.After(rtGuard):
			t.Fatal("Run did not return after its context was cancelled")
		}
	}
	t.Cleanup(stop)
	return stop
}

// metric returns the value of the series name{labels}, failing if there is
// no such series.
func (h *rtHarness) metric(t *testing.T, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := h.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, lp := range m.GetLabel() {
				got[lp.GetName()] = lp.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if got[labels[i]] != labels[i+1] {
					continue series
				}
			}
			return rtValue(m)
		}
	}
	t.Fatalf("no series %s%v", name, labels)
	return 0
}

func rtValue(m *dto.Metric) float64 {
	if g := m.GetGauge(); g != nil {
		return g.GetValue()
	}
	return m.GetCounter().GetValue()
}

// expectMetric fails unless name{labels} is want.
func (h *rtHarness) expectMetric(t *testing.T, want float64, name string, labels ...string) {
	t.Helper()
	if got := h.metric(t, name, labels...); got != want {
		t.Errorf("%s%v = %v, want %v", name, labels, got, want)
	}
}

// states counts h's registrations by state.
func (h *rtHarness) states() map[RegistrationState]int {
	out := map[RegistrationState]int{}
	for _, s := range h.r.Status() {
		out[s.State]++
	}
	return out
}

var rtWant4 = []string{"http://gw:8080/p/0", "http://gw:8080/p/1", "http://gw:8080/p/2", "http://gw:8080/p/3"}

func TestRegistrarRegistersFanoutURLs(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	b := rtNewBootstrap(t)
	defer b.srv.Close() // before goleak looks
	h := rtNew(rtConfig(4, b))
	stop := h.run(t)

	h.clk.expectArmed(t, rtCheck, "after registering everything the next step is a check")
	if got := b.registered(); !slices.Equal(got, rtWant4) {
		t.Fatalf("bootstrap holds %q, want %q", got, rtWant4)
	}
	b.mu.Lock()
	posts := slices.Sorted(slices.Values(b.posts))
	b.mu.Unlock()
	if !slices.Equal(posts, rtWant4) {
		t.Errorf("POSTed %q, want each of %q once", posts, rtWant4)
	}
	st := h.r.Status()
	if len(st) != 4 {
		t.Fatalf("Status has %d entries, want 4: %+v", len(st), st)
	}
	for i, s := range st {
		if s.Bootstrap != b.srv.URL || s.URL != rtWant4[i] || s.State != RegistrationRegistered || !s.Registered ||
			s.Attempts != 1 || s.LastError != "" || !s.RegisteredAt.Equal(h.clk.Now()) {
			t.Errorf("Status[%d] = %+v", i, s)
		}
	}
	h.expectMetric(t, 4, "encgate_self_registrations", "bootstrap", b.srv.URL, "state", "registered")
	h.expectMetric(t, 0, "encgate_self_registrations", "bootstrap", b.srv.URL, "state", "pending")
	h.expectMetric(t, 4, "encgate_self_registration_attempts_total", "bootstrap", b.srv.URL, "result", "ok")
	h.expectMetric(t, 0, "encgate_self_registration_attempts_total", "bootstrap", b.srv.URL, "result", "error")
	if n := h.logs.FilterLevelExact(zapcore.WarnLevel).Len(); n != 0 {
		t.Errorf("%d warnings on a clean registration: %v", n, h.logs.All())
	}
	stop()
}

func TestRegistrarRetriesUntilBootstrapAccepts(t *testing.T) {
	b := rtNewBootstrap(t)
	b.setFailNext(6) // round 1: all 4 fail; round 2: 2 of 4 fail
	h := rtNew(rtConfig(4, b))
	h.run(t)

	h.clk.expectArmed(t, rtRetry, "round 1 failed: retry")
	if s := h.states(); s[RegistrationPending] != 4 {
		t.Fatalf("after round 1 states %v, want 4 pending", s)
	}
	for _, s := range h.r.Status() {
		if s.Attempts != 1 || !strings.Contains(s.LastError, "503") || !strings.Contains(s.LastError, "language server restarting") {
			t.Errorf("after round 1: %+v", s)
		}
	}
	h.expectMetric(t, 4, "encgate_self_registrations", "bootstrap", b.srv.URL, "state", "pending")

	h.clk.Advance(rtRetry)
	h.clk.expectArmed(t, rtRetry, "round 2 still had failures: retry")
	if s := h.states(); s[RegistrationPending] != 2 || s[RegistrationRegistered] != 2 {
		t.Fatalf("after round 2 states %v, want 2 pending, 2 registered", s)
	}
	if got := len(b.registered()); got != 2 {
		t.Fatalf("bootstrap holds %d URLs after round 2, want 2", got)
	}

	h.clk.Advance(rtRetry)
	h.clk.expectArmed(t, rtCheck, "round 3 registered the rest: check next")
	if got := b.registered(); !slices.Equal(got, rtWant4) {
		t.Fatalf("bootstrap holds %q, want %q", got, rtWant4)
	}
	total := 0
	for _, s := range h.r.Status() {
		total += s.Attempts
		if !s.Registered || s.LastError != "" {
			t.Errorf("after round 3: %+v", s)
		}
	}
	if total != 10 {
		t.Errorf("%d attempts in all, want 10 (4 + 4 + 2)", total)
	}
	if posts, _, _ := b.counts(); posts != 4 {
		t.Errorf("bootstrap accepted %d POSTs, want 4: a registered URL was sent again", posts)
	}
	h.expectMetric(t, 4, "encgate_self_registration_attempts_total", "bootstrap", b.srv.URL, "result", "ok")
	h.expectMetric(t, 6, "encgate_self_registration_attempts_total", "bootstrap", b.srv.URL, "result", "error")
	h.expectMetric(t, 4, "encgate_self_registrations", "bootstrap", b.srv.URL, "state", "registered")

	warns := h.logs.FilterLevelExact(zapcore.WarnLevel).All()
	if len(warns) != 1 || warns[0].ContextMap()["consecutive_failures"] != int64(1) {
		t.Errorf("warnings %v, want one, for the first failed round", warns)
	}
	ok := h.logs.FilterMessage("registered with bootstrap").All()
	if len(ok) != 1 || ok[0].ContextMap()["after_failures"] != int64(2) {
		t.Errorf("success lines %v, want one saying after_failures=2", ok)
	}
}

func TestRegistrarLogsFirstAndEveryTenthFailure(t *testing.T) {
	b := rtNewBootstrap(t)
	b.setFailNext(25)
	h := rtNew(rtConfig(1, b))
	h.run(t)
	for round := 1; round <= 25; round++ {
		h.clk.expectArmed(t, rtRetry, "a failed round")
		h.clk.Advance(rtRetry)
	}
	h.clk.expectArmed(t, rtCheck, "round 26 succeeded")
	var at []int64
	for _, e := range h.logs.FilterLevelExact(zapcore.WarnLevel).All() {
		at = append(at, e.ContextMap()["consecutive_failures"].(int64))
	}
	if want := []int64{1, 10, 20}; !slices.Equal(at, want) {
		t.Errorf("warned at failures %v, want %v", at, want)
	}
	if n := h.logs.FilterLevelExact(zapcore.DebugLevel).FilterMessage("registering with bootstrap failed").Len(); n != 22 {
		t.Errorf("%d failed rounds at debug, want 22", n)
	}
	if got := b.registered(); !slices.Equal(got, []string{"http://gw:8080/p/0"}) {
		t.Errorf("bootstrap holds %q", got)
	}
	if s := h.r.Status()[0]; s.Attempts != 26 || !s.Registered {
		t.Errorf("Status = %+v, want registered after 26 attempts", s)
	}
}

func TestRegistrarReregistersWhatBootstrapForgot(t *testing.T) {
	b := rtNewBootstrap(t)
	h := rtNew(rtConfig(4, b))
	h.run(t)
	h.clk.expectArmed(t, rtCheck, "registered")

	// The bootstrap loses one URL (an eviction): only that one goes again.
	b.forget("http://gw:8080/p/2")
	h.clk.Advance(rtCheck)
	h.clk.expectArmed(t, rtCheck, "the check re-registered what was missing")
	if got := b.registered(); !slices.Equal(got, rtWant4) {
		t.Fatalf("after the check the bootstrap holds %q, want %q", got, rtWant4)
	}
	b.mu.Lock()
	posts, lists := slices.Clone(b.posts), b.lists
	b.mu.Unlock()
	if len(posts) != 5 || posts[4] != "http://gw:8080/p/2" || lists != 1 {
		t.Fatalf("POSTs %q and %d lists, want p/2 sent again after one list", posts, lists)
	}
	for _, s := range h.r.Status() {
		forgot := s.URL == "http://gw:8080/p/2"
		if !s.Registered || (s.Forgotten == 1) != forgot || s.Attempts != 1 || !s.LastCheck.Equal(h.clk.Now()) {
			t.Errorf("after the check: %+v", s)
		}
	}
	h.expectMetric(t, 1, "encgate_self_registration_forgotten_total", "bootstrap", b.srv.URL)

	// The language server restarts: down at the next check, then back
	// with an empty list.
	b.forget()
	b.setFailNext(1)
	h.clk.Advance(rtCheck)
	h.clk.expectArmed(t, rtRetry, "the check failed: read the list again soon")
	for _, s := range h.r.Status() {
		if !strings.Contains(s.CheckError, "503") {
			t.Errorf("after a failed check: %+v", s)
		}
	}
	h.clk.Advance(rtRetry)
	h.clk.expectArmed(t, rtCheck, "the check found nothing listed and registered all again")
	if got := b.registered(); !slices.Equal(got, rtWant4) {
		t.Fatalf("after the restart the bootstrap holds %q, want %q", got, rtWant4)
	}
	if posts, _, lists := b.counts(); posts != 9 || lists != 2 {
		t.Errorf("%d POSTs and %d lists, want 9 (4 + 1 + 4) and 2", posts, lists)
	}
	for _, s := range h.r.Status() {
		if !s.Registered || s.CheckError != "" {
			t.Errorf("after the restart: %+v", s)
		}
	}
	h.expectMetric(t, 5, "encgate_self_registration_forgotten_total", "bootstrap", b.srv.URL)
	h.expectMetric(t, 2, "encgate_self_registration_checks_total", "bootstrap", b.srv.URL, "result", "ok")
	h.expectMetric(t, 1, "encgate_self_registration_checks_total", "bootstrap", b.srv.URL, "result", "error")
	h.expectMetric(t, 4, "encgate_self_registrations", "bootstrap", b.srv.URL, "state", "registered")
}

func TestRegistrarOneBootstrapDownDoesNotHoldUpAnother(t *testing.T) {
	up, down := rtNewBootstrap(t), rtNewBootstrap(t)
	down.setFailNext(2)
	h := rtNew(rtConfig(2, up, down))
	h.run(t)
	got := []time.Duration{h.clk.waitArmed(t, "first bootstrap's round"), h.clk.waitArmed(t, "second bootstrap's round")}
	slices.Sort(got)
	if want := []time.Duration{rtRetry, rtCheck}; !slices.Equal(got, want) {
		t.Fatalf("armed %v, want %v (one check, one retry)", got, want)
	}
	want2 := []string{"http://gw:8080/p/0", "http://gw:8080/p/1"}
	if g := up.registered(); !slices.Equal(g, want2) {
		t.Errorf("healthy bootstrap holds %q, want %q", g, want2)
	}
	if g := down.registered(); len(g) != 0 {
		t.Errorf("failing bootstrap holds %q", g)
	}
	h.clk.Advance(rtRetry) // fires only the failing bootstrap's retry
	h.clk.expectArmed(t, rtCheck, "the retry registered the rest")
	if g := down.registered(); !slices.Equal(g, want2) {
		t.Errorf("recovered bootstrap holds %q, want %q", g, want2)
	}
	if posts, _, lists := up.counts(); posts != 2 || lists != 0 {
		t.Errorf("healthy bootstrap saw %d POSTs and %d lists, want 2 and 0", posts, lists)
	}
	for _, s := range h.r.Status() {
		if !s.Registered {
			t.Errorf("not registered: %+v", s)
		}
	}
}

func TestRegistrarUnregisterSendsEveryURL(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	b := rtNewBootstrap(t)
	defer b.srv.Close()
	h := rtNew(rtConfig(4, b))
	stop := h.run(t)
	h.clk.expectArmed(t, rtCheck, "registered")
	stop()

	if err := h.r.Unregister(context.Background()); err != nil {
		t.Fatalf("Unregister: %v", err)
	}
	b.mu.Lock()
	deletes := slices.Sorted(slices.Values(b.deletes))
	b.mu.Unlock()
	if !slices.Equal(deletes, rtWant4) {
		t.Errorf("DELETEs for %q, want each of %q once", deletes, rtWant4)
	}
	if g := b.registered(); len(g) != 0 {
		t.Errorf("bootstrap still holds %q", g)
	}
	if s := h.states(); s[RegistrationUnregistered] != 4 {
		t.Errorf("states %v, want 4 unregistered", s)
	}
	h.expectMetric(t, 4, "encgate_self_registrations", "bootstrap", b.srv.URL, "state", "unregistered")
	h.expectMetric(t, 0, "encgate_self_registrations", "bootstrap", b.srv.URL, "state", "registered")
	h.expectMetric(t, 4, "encgate_self_unregistrations_total", "bootstrap", b.srv.URL, "result", "ok")
}

func TestRegistrarUnregisterReportsFailures(t *testing.T) {
	refusing, gone := rtNewBootstrap(t), rtNewBootstrap(t)
	refusing.setFailNext(100)
	gone.srv.Close() // connection refused
	h := rtNew(rtConfig(4, refusing, gone))

	err := h.r.Unregister(context.Background())
	if err == nil {
		t.Fatal("Unregister reported no failure")
	}
	joined, ok := err.(interface{ Unwrap() []error })
	if !ok || len(joined.Unwrap()) != 2 {
		t.Fatalf("Unregister = %v, want one error per bootstrap", err)
	}
	for _, want := range []string{
		"unregistering 4 of 4 URLs from " + refusing.srv.URL, "503",
		"unregistering 4 of 4 URLs from " + gone.srv.URL,
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Unregister = %v, want it to say %q", err, want)
		}
	}
	h.expectMetric(t, 4, "encgate_self_unregistrations_total", "bootstrap", refusing.srv.URL, "result", "error")
	h.expectMetric(t, 4, "encgate_self_unregistrations_total", "bootstrap", gone.srv.URL, "result", "error")
	for _, s := range h.r.Status() {
		if s.State != RegistrationPending || !strings.HasPrefix(s.LastError, "unregister: ") {
			t.Errorf("after failed unregistering: %+v", s)
		}
	}
}

func TestRegistrarUnregisterEndsWithItsContext(t *testing.T) {
	b := rtNewBootstrap(t)
	b.mu.Lock()
	b.hangDeletes = true
	b.mu.Unlock()
	h := rtNew(rtConfig(4, b))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- h.r.Unregister(ctx) }()
	for range 4 { // all four in flight at once
		select {
		case <-b.arrived:
		case <-time.After(rtGuard):
			t.Fatal("the DELETEs did not all arrive while none had been answered")
		}
	}
	cancel()
	var err error
	select {
	case err = <-done:
	case <-time.After(rtGuard):
		t.Fatal("Unregister did not return after its context was cancelled")
	}
	if !errors.Is(err, context.Canceled) {
		t.Errorf("Unregister = %v, want it to wrap context.Canceled", err)
	}
}

func TestRegistrarURLs(t *testing.T) {
	cfg := DefaultRegistrar()
	cfg.AdvertiseURL, cfg.Fanout = "http://gw:8080/", 3
	if got, want := cfg.URLs(), []string{"http://gw:8080/p/0", "http://gw:8080/p/1", "http://gw:8080/p/2"}; !slices.Equal(got, want) {
		t.Errorf("URLs = %q, want %q", got, want)
	}
	cfg.AdvertiseURL, cfg.Fanout = "https://gw.example:8443/enc", 1
	if got, want := cfg.URLs(), []string{"https://gw.example:8443/enc/p/0"}; !slices.Equal(got, want) {
		t.Errorf("URLs = %q, want %q", got, want)
	}

	// Off: Run has nothing to do and returns without its context ending.
	r := NewRegistrar(DefaultRegistrar(), RegistrarDeps{})
	r.Run(context.Background())
	if err := r.Unregister(context.Background()); err != nil || len(r.Status()) != 0 {
		t.Errorf("an unconfigured registrar: Unregister = %v, Status = %v", err, r.Status())
	}
}

func TestRegistrarValidate(t *testing.T) {
	valid := DefaultRegistrar()
	valid.RegisterWith = []string{"http://lang:8997", "https://lang2:8997/"}
	valid.AdvertiseURL = "http://encgate:8080/"
	for _, c := range []RegistrarConfig{DefaultRegistrar(), valid} {
		var p configfile.Problems
		c.Validate(&p, "")
		if err := p.Err(); err != nil {
			t.Errorf("Validate(%+v) = %v", c, err)
		}
	}

	for _, tc := range []struct {
		name string
		path string
		edit func(*RegistrarConfig)
		want []string // each the start of a line of the error
	}{
		{"bad bootstraps", "", func(c *RegistrarConfig) {
			c.RegisterWith = []string{"ftp://lang:8997", "http://lang:8997", "http://lang:8997/", "http://:8997", "http://lang:8997/?x=1", "http://lang:99999"}
			c.AdvertiseURL = "http://encgate:8080"
		}, []string{
			`register_with[0]: must be an http:// or https:// URL, got "ftp://lang:8997"`,
			`register_with[2]: "http://lang:8997/" is already register_with[1]`,
			"register_with[3]: must name a host",
			"register_with[4]: must not have a query",
			"register_with[5]: port must be 1..65535",
		}},
		{"advertise missing", "", func(c *RegistrarConfig) { c.RegisterWith = []string{"http://lang:8997"} },
			[]string{"advertise_url: required when register_with is set"}},
		{"advertise without a port", "", func(c *RegistrarConfig) { c.AdvertiseURL = "http://encgate" },
			[]string{"advertise_url: must name a port"}},
		{"advertise with a query", "", func(c *RegistrarConfig) { c.AdvertiseURL = "http://encgate:8080/?a=1" },
			[]string{"advertise_url: must not have a query"}},
		{"advertise with a fragment", "", func(c *RegistrarConfig) { c.AdvertiseURL = "http://encgate:8080/#top" },
			[]string{"advertise_url: must not have a fragment"}},
		{"advertise without a scheme", "", func(c *RegistrarConfig) { c.AdvertiseURL = "encgate:8080" },
			[]string{`advertise_url: "encgate:8080" has no scheme; did you mean "http://encgate:8080"?`}},
		{"advertise not http", "", func(c *RegistrarConfig) { c.AdvertiseURL = "ftp://encgate:8080" },
			[]string{"advertise_url: must be an http:// or https:// URL"}},
		{"fanout 0", "", func(c *RegistrarConfig) { c.Fanout = 0 }, []string{"fanout: must be 1..1024, got 0"}},
		{"fanout too big", "", func(c *RegistrarConfig) { c.Fanout = 1025 }, []string{"fanout: must be 1..1024, got 1025"}},
		{"durations", "", func(c *RegistrarConfig) { c.RetryInterval, c.Timeout, c.CheckInterval = 0, -1, 0 }, []string{
			"retry_interval: must be > 0", "timeout: must be > 0", "check_interval: must be > 0",
		}},
		{"nested path", "self", func(c *RegistrarConfig) {
			c.RegisterWith = []string{"lang:8997"}
			c.Fanout = 0
		}, []string{`self.register_with[0]: "lang:8997" has no scheme; did you mean "http://lang:8997"?`, "self.advertise_url: required", "self.fanout: must be"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := DefaultRegistrar()
			tc.edit(&c)
			var p configfile.Problems
			c.Validate(&p, tc.path)
			err := p.Err()
			if err == nil {
				t.Fatal("no problem reported")
			}
			lines := strings.Split(err.Error(), "\n")
			if len(lines) != len(tc.want) {
				t.Errorf("%d problems, want %d: %v", len(lines), len(tc.want), err)
			}
			for _, w := range tc.want {
				if !slices.ContainsFunc(lines, func(l string) bool { return strings.HasPrefix(l, w) }) {
					t.Errorf("no problem starting %q in:\n%v", w, err)
				}
			}
		})
	}
}
