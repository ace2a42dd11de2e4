package fakeencoder

import (
	"context"
	"encoding/json"
	"flag"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
)

// bootstrapCall is one call a test bootstrap server received.
type bootstrapCall struct {
	method, path, ctype string
	url                 string // the body's "url"
	raw                 string // the whole body
}

// bootstrap is a tiny EncoderBootstrapServer: it records every call and
// answers each POST with the next scripted status (the last one repeats;
// 200 when none), every DELETE with 200.
type bootstrap struct {
	srv   *httptest.Server
	calls chan bootstrapCall

	mu       sync.Mutex
	statuses []int
}

// newBootstrap starts a bootstrap server on loopback, closed at test end.
func newBootstrap(t *testing.T, postStatuses ...int) *bootstrap {
	t.Helper()
	b := &bootstrap{calls: make(chan bootstrapCall, 256), statuses: postStatuses}
	b.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		raw, _ := io.ReadAll(r.Body)
		var body registrationBody
		_ = json.Unmarshal(raw, &body)
		status := http.StatusOK
		if r.Method == http.MethodPost {
			status = b.nextStatus()
		}
		b.calls <- bootstrapCall{method: r.Method, path: r.URL.Path, ctype: r.Header.Get("Content-Type"), url: body.URL, raw: string(raw)}
		w.WriteHeader(status)
	}))
	t.Cleanup(b.srv.Close)
	return b
}

func (b *bootstrap) nextStatus() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.statuses) == 0 {
		return http.StatusOK
	}
	s := b.statuses[0]
	if len(b.statuses) > 1 {
		b.statuses = b.statuses[1:]
	}
	return s
}

// next waits for the next call.
func (b *bootstrap) next(t *testing.T) bootstrapCall {
	t.Helper()
	select {
	case c := <-b.calls:
		return c
	case <-time.After(10 * time.Second):
		t.Fatal("no bootstrap call within 10s")
	}
	return bootstrapCall{}
}

// none fails the test if a call was received and not yet taken.
func (b *bootstrap) none(t *testing.T, when string) {
	t.Helper()
	select {
	case c := <-b.calls:
		t.Fatalf("%s: unexpected bootstrap call %+v", when, c)
	default:
	}
}

// expectCall takes the next call and checks it is method path with url.
func (b *bootstrap) expectCall(t *testing.T, method, path, url string) {
	t.Helper()
	c := b.next(t)
	if c.method != method || c.path != path || c.url != url || c.ctype != "application/json" {
		t.Fatalf("got %s %s %q (%s), want %s %s url %q application/json", c.method, c.path, c.raw, c.ctype, method, path, url)
	}
	if want, _ := json.Marshal(registrationBody{URL: url}); c.raw != string(want) {
		t.Fatalf("body %s, want %s", c.raw, want)
	}
}

// regOptions are testOptions registering with the bootstraps and retrying
// at once.
func regOptions(bs ...*bootstrap) Options {
	o := testOptions()
	for _, b := range bs {
		o.RegisterURLs = append(o.RegisterURLs, b.srv.URL)
	}
	o.RegistrationInterval = time.Millisecond
	o.RegistrationTimeout = 5 * time.Second
	return o
}

// waitRegistered waits until e's registration loops have all ended.
func waitRegistered(t *testing.T, e *Encoder) {
	t.Helper()
	select {
	case <-e.RegistrationDone():
	case <-time.After(10 * time.Second):
		t.Fatal("registration loops did not end within 10s")
	}
}

// expectRegStats checks the registration counters.
func expectRegStats(t *testing.T, e *Encoder, attempts, ok, unregs int64) {
	t.Helper()
	s := e.Stats()
	if s.RegistrationAttempts != attempts || s.RegistrationsOK != ok || s.Unregistrations != unregs {
		t.Fatalf("attempts/ok/unregistrations %d/%d/%d, want %d/%d/%d",
			s.RegistrationAttempts, s.RegistrationsOK, s.Unregistrations, attempts, ok, unregs)
	}
}

func TestRegisterAdvertisesOwnURLAndUnregistersOnClose(t *testing.T) {
	b := newBootstrap(t)
	e := New(regOptions(b))
	if err := e.Start("127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	b.expectCall(t, http.MethodPost, PathRegisterEncoder, e.URL())
	waitRegistered(t, e)
	b.none(t, "after a 200")
	expectRegStats(t, e, 1, 1, 0)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	b.expectCall(t, http.MethodDelete, PathUnregisterEncoder, e.URL())
	expectRegStats(t, e, 1, 1, 1)
	if err := e.Close(); err != nil { // idempotent: no second DELETE
		t.Fatal(err)
	}
	b.none(t, "second Close")
}

func TestRegisterRetriesAfter503(t *testing.T) {
	b := newBootstrap(t, http.StatusServiceUnavailable, http.StatusOK)
	e := start(t, regOptions(b))
	b.expectCall(t, http.MethodPost, PathRegisterEncoder, e.URL())
	b.expectCall(t, http.MethodPost, PathRegisterEncoder, e.URL())
	waitRegistered(t, e)
	b.none(t, "after the retry's 200")
	expectRegStats(t, e, 2, 1, 0)
}

func TestRegisterGivesUpAfterAttemptsAndStillUnregisters(t *testing.T) {
	b := newBootstrap(t, http.StatusServiceUnavailable)
	opts := regOptions(b)
	opts.RegistrationAttempts = 3
	e := start(t, opts)
	for range 3 {
		b.expectCall(t, http.MethodPost, PathRegisterEncoder, e.URL())
	}
	waitRegistered(t, e)
	b.none(t, "after giving up")
	expectRegStats(t, e, 3, 0, 0)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	b.expectCall(t, http.MethodDelete, PathUnregisterEncoder, e.URL())
	expectRegStats(t, e, 3, 0, 1)
}

func TestUnregisterWhileServingThenRejoin(t *testing.T) {
	b := newBootstrap(t)
	e := start(t, regOptions(b))
	b.expectCall(t, http.MethodPost, PathRegisterEncoder, e.URL())
	waitRegistered(t, e)
	if err := e.Unregister(context.Background()); err != nil {
		t.Fatal(err)
	}
	b.expectCall(t, http.MethodDelete, PathUnregisterEncoder, e.URL())
	expectRegStats(t, e, 1, 1, 1)
	// Out of the fleet, the fake still serves.
	if r := post(t, e, RouteEncode, encodeBody("after-leave")); r.status != http.StatusOK {
		t.Fatalf("encode after Unregister: %d %s", r.status, r.body)
	}
	if err := e.Unregister(context.Background()); err != nil { // not joined: nothing sent
		t.Fatal(err)
	}
	b.none(t, "second Unregister")
	if err := e.Register(); err != nil {
		t.Fatal(err)
	}
	b.expectCall(t, http.MethodPost, PathRegisterEncoder, e.URL())
	waitRegistered(t, e)
	expectRegStats(t, e, 2, 2, 1)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	b.expectCall(t, http.MethodDelete, PathUnregisterEncoder, e.URL())
	expectRegStats(t, e, 2, 2, 2)
}

func TestUnregisterStopsRetryLoops(t *testing.T) {
	b := newBootstrap(t, http.StatusServiceUnavailable)
	opts := regOptions(b)
	opts.RegistrationInterval = time.Hour // the loop waits on its timer after the first 503
	e := start(t, opts)
	b.expectCall(t, http.MethodPost, PathRegisterEncoder, e.URL())
	if err := e.Unregister(context.Background()); err != nil {
		t.Fatal(err)
	}
	b.expectCall(t, http.MethodDelete, PathUnregisterEncoder, e.URL())
	waitRegistered(t, e) // already closed: Unregister waited for the loop
	b.none(t, "after Unregister")
	expectRegStats(t, e, 1, 0, 1)
}

func TestRegisterAdvertiseURLWithEveryBootstrap(t *testing.T) {
	b1, b2 := newBootstrap(t), newBootstrap(t, http.StatusInternalServerError, http.StatusOK)
	opts := regOptions(b1, b2)
	opts.AdvertiseURL = "http://gateway.example:8080"
	e := start(t, opts)
	b1.expectCall(t, http.MethodPost, PathRegisterEncoder, opts.AdvertiseURL)
	b2.expectCall(t, http.MethodPost, PathRegisterEncoder, opts.AdvertiseURL)
	b2.expectCall(t, http.MethodPost, PathRegisterEncoder, opts.AdvertiseURL)
	waitRegistered(t, e)
	expectRegStats(t, e, 3, 2, 0)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	b1.expectCall(t, http.MethodDelete, PathUnregisterEncoder, opts.AdvertiseURL)
	b2.expectCall(t, http.MethodDelete, PathUnregisterEncoder, opts.AdvertiseURL)
	expectRegStats(t, e, 3, 2, 2)
}

func TestUnregisterReportsUnreachableBootstrap(t *testing.T) {
	b := newBootstrap(t)
	e := start(t, regOptions(b))
	b.expectCall(t, http.MethodPost, PathRegisterEncoder, e.URL())
	waitRegistered(t, e)
	b.srv.Close()
	if err := e.Unregister(context.Background()); err == nil {
		t.Fatal("Unregister with the bootstrap gone reported no error")
	}
	expectRegStats(t, e, 1, 1, 0)
	if err := e.Close(); err != nil { // left already: Close has nothing to send
		t.Fatal(err)
	}
}

func TestRegisterWithoutURLsOrBeforeStart(t *testing.T) {
	e := start(t, testOptions())
	if err := e.Register(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-e.RegistrationDone():
	default:
		t.Fatal("RegistrationDone open with no bootstrap URLs")
	}
	expectRegStats(t, e, 0, 0, 0)

	b := newBootstrap(t)
	unstarted := New(regOptions(b))
	t.Cleanup(func() { _ = unstarted.Close() })
	if err := unstarted.Register(); err == nil {
		t.Fatal("Register before Start without AdvertiseURL succeeded")
	}
	if err := unstarted.Close(); err != nil {
		t.Fatal(err)
	}
	if err := unstarted.Register(); err == nil {
		t.Fatal("Register after Close succeeded")
	}
	b.none(t, "never started")
}

func TestRegistrationDefaultsAndStatsJSON(t *testing.T) {
	e := New(Options{})
	o := e.opts
	if o.RegistrationInterval != 5*time.Second || o.RegistrationAttempts != 30 ||
		o.RegistrationTimeout != 5*time.Second || o.UnregistrationTimeout != 2*time.Second || o.CacheItems != 0 {
		t.Fatalf("defaults %v %d %v %v %d", o.RegistrationInterval, o.RegistrationAttempts,
			o.RegistrationTimeout, o.UnregistrationTimeout, o.CacheItems)
	}
	_ = e.Close()

	e = start(t, testOptions())
	var m map[string]json.RawMessage
	if err := json.Unmarshal([]byte(get(t, e, RouteStats).body), &m); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"registrations_ok", "registration_attempts", "unregistrations", "cache_hits", "cache_misses"} {
		if string(m[k]) != "0" {
			t.Fatalf("/_fake/stats %s = %s, want 0", k, m[k])
		}
	}
}

func TestBindFlagsRegistrationAndCache(t *testing.T) {
	parse := func(args ...string) (Options, error) {
		var o Options
		fs := flag.NewFlagSet("fake-encoder", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		o.BindFlags(fs)
		return o, fs.Parse(args)
	}
	o, err := parse("--register-url=http://127.0.0.1:8997", "--register-url", "https://lang.example:8997/",
		"--advertise-url=http://gw:30000", "--registration-interval=10ms", "--registration-attempts=4",
		"--registration-timeout=1s", "--unregistration-timeout=500ms", "--cache-items=64")
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"http://127.0.0.1:8997", "https://lang.example:8997/"}; !reflect.DeepEqual(o.RegisterURLs, want) {
		t.Fatalf("register URLs %q, want %q", o.RegisterURLs, want)
	}
	if o.AdvertiseURL != "http://gw:30000" || o.RegistrationInterval != 10*time.Millisecond || o.RegistrationAttempts != 4 ||
		o.RegistrationTimeout != time.Second || o.UnregistrationTimeout != 500*time.Millisecond || o.CacheItems != 64 {
		t.Fatalf("options %+v", o)
	}
	if o, err = parse(); err != nil || o.RegisterURLs != nil || o.AdvertiseURL != "" || o.CacheItems != 0 || o.RegistrationAttempts != 0 {
		t.Fatalf("defaults %+v %v", o, err)
	}
	for _, bad := range []string{"127.0.0.1:8997", "ftp://h:1", "http://", "http://h:1/?x=1"} {
		if _, err := parse("--register-url=" + bad); err == nil {
			t.Fatalf("--register-url=%s accepted", bad)
		}
	}
	if _, err := parse("--register-url=127.0.0.1:8997"); err == nil || !strings.Contains(err.Error(), `did you mean "http://127.0.0.1:8997"?`) {
		t.Fatalf("--register-url without a scheme: %v, want a hint", err)
	}
}

// The route is joined onto each bootstrap URL as sglang's f-string
// f"{url}/register_encoder_url" does: a path in the URL (encgate's
// /t/<token>) is kept, and a trailing slash is not trimmed (sglang would
// send "//register_encoder_url").
func TestRegisterJoinsTheRouteAsSglangDoes(t *testing.T) {
	b1, b2 := newBootstrap(t), newBootstrap(t)
	opts := regOptions()
	opts.RegisterURLs = []string{b1.srv.URL + "/t/some-token", b2.srv.URL + "/t/some-token/"}
	e := start(t, opts)
	b1.expectCall(t, http.MethodPost, "/t/some-token"+PathRegisterEncoder, e.URL())
	b2.expectCall(t, http.MethodPost, "/t/some-token/"+PathRegisterEncoder, e.URL())
	waitRegistered(t, e)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	b1.expectCall(t, http.MethodDelete, "/t/some-token"+PathUnregisterEncoder, e.URL())
	b2.expectCall(t, http.MethodDelete, "/t/some-token/"+PathUnregisterEncoder, e.URL())
}
