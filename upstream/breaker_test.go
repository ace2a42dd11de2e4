package upstream

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/sglang"
)

// breakerTransition is one onChange call.
type breakerTransition struct {
	name     string
	from, to BreakerState
}

func (tr breakerTransition) String() string { return fmt.Sprintf("%s->%s", tr.from, tr.to) }

// newTestBreaker returns a breaker whose transitions arrive on the channel.
func newTestBreaker(t *testing.T, cfg BreakerConfig) (*Breaker, <-chan breakerTransition) {
	t.Helper()
	ch := make(chan breakerTransition, 64)
	b := NewBreaker("enc-a", cfg, func(name string, from, to BreakerState) {
		ch <- breakerTransition{name, from, to}
	})
	t.Cleanup(b.Stop)
	return b, ch
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
func send(t *testing.T, b *Breaker, o Observation) {
	t.Helper()
	done, ok := b.Allow()
	if !ok {
		t.Fatalf("Allow refused in state %s", b.State())
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
	c.MinRequests = 1 << 20
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
	if done, ok := b.Allow(); ok || done != nil {
		t.Fatal("open breaker allowed a request")
	}
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
	}
	if s := b.State(); s != BreakerClosed {
		t.Fatalf("state after 19 outcomes = %s (counts %+v)", s, b.Counts())
	}
	noTransition(t, ch)
	send(t, b, answer500) // 20 counted, 10 faults: ratio 0.5
	waitTransition(t, ch, BreakerClosed, BreakerOpen)
	inflight(mark(answer200)) // from the old generation: no effect
	if s := b.State(); s != BreakerOpen {
		t.Fatalf("state = %s", s)
	}
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
}

func TestBreakerHalfOpenCycle(t *testing.T) {
	cfg := consecutiveOnly()
	cfg.OpenTimeout = configfile.Duration(50 * time.Millisecond)
	cfg.Interval = configfile.Duration(time.Hour)
	b, ch := newTestBreaker(t, cfg)

	trip := func() {
		t.Helper()
		for i := 0; i < 5; i++ {
			send(t, b, dialFailure)
		}
		waitTransition(t, ch, BreakerClosed, BreakerOpen)
		if _, ok := b.Allow(); ok {
			t.Fatal("open breaker allowed a request")
		}
	}
	trip()

	// Nobody asks the breaker anything: its own timer moves it.
	waitTransition(t, ch, BreakerOpen, BreakerHalfOpen)
	if s := b.State(); s != BreakerHalfOpen {
		t.Fatalf("state = %s", s)
	}
	probe, ok := b.Allow()
	if !ok {
		t.Fatal("half-open breaker refused its probe")
	}
	if _, ok := b.Allow(); ok {
		t.Fatal("half-open breaker allowed a second probe")
	}
	probe(mark(answer200))
	waitTransition(t, ch, BreakerHalfOpen, BreakerClosed)
	if s := b.State(); s != BreakerClosed {
		t.Fatalf("state after a good probe = %s", s)
	}
	send(t, b, answer200)

	trip()
	waitTransition(t, ch, BreakerOpen, BreakerHalfOpen)
	probe, ok = b.Allow()
	if !ok {
		t.Fatal("half-open breaker refused its probe")
	}
	probe(mark(answer500))
	waitTransition(t, ch, BreakerHalfOpen, BreakerOpen)
	if _, ok := b.Allow(); ok {
		t.Fatal("reopened breaker allowed a request")
	}
	// and it comes back to half-open again by itself
	waitTransition(t, ch, BreakerOpen, BreakerHalfOpen)
}

func TestBreakerHalfOpenIgnoredProbeFreesTheSlot(t *testing.T) {
	cfg := consecutiveOnly()
	cfg.OpenTimeout = configfile.Duration(50 * time.Millisecond)
	b, ch := newTestBreaker(t, cfg)
	for i := 0; i < 5; i++ {
		send(t, b, answer500)
	}
	waitTransition(t, ch, BreakerClosed, BreakerOpen)
	waitTransition(t, ch, BreakerOpen, BreakerHalfOpen)
	send(t, b, answerLag) // says nothing about the encoder
	if s := b.State(); s != BreakerHalfOpen {
		t.Fatalf("state = %s", s)
	}
	send(t, b, answer400) // an answer: the encoder is back
	waitTransition(t, ch, BreakerHalfOpen, BreakerClosed)
}

func TestBreakerHalfOpenRequests(t *testing.T) {
	cfg := consecutiveOnly()
	cfg.OpenTimeout = configfile.Duration(50 * time.Millisecond)
	cfg.HalfOpenRequests = 3
	b, ch := newTestBreaker(t, cfg)
	for i := 0; i < 5; i++ {
		send(t, b, answer500)
	}
	waitTransition(t, ch, BreakerClosed, BreakerOpen)
	waitTransition(t, ch, BreakerOpen, BreakerHalfOpen)
	var probes []func(Mark)
	for i := 0; i < 3; i++ {
		done, ok := b.Allow()
		if !ok {
			t.Fatalf("probe %d refused", i)
		}
		probes = append(probes, done)
	}
	if _, ok := b.Allow(); ok {
		t.Fatal("fourth probe allowed")
	}
	probes[0](mark(answer200))
	probes[1](mark(answer200))
	if s := b.State(); s != BreakerHalfOpen {
		t.Fatalf("state after 2 of 3 = %s", s)
	}
	probes[2](mark(answer200))
	waitTransition(t, ch, BreakerHalfOpen, BreakerClosed)
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

func TestBreakerStopSilencesOnChange(t *testing.T) {
	cfg := consecutiveOnly()
	cfg.OpenTimeout = configfile.Duration(time.Millisecond)
	b, ch := newTestBreaker(t, cfg)
	b.Stop()
	for i := 0; i < 5; i++ {
		send(t, b, answer500)
	}
	if s := b.State(); s != BreakerOpen && s != BreakerHalfOpen {
		t.Fatalf("state = %s", s)
	}
	noTransition(t, ch)
}

func TestBreakerNilOnChange(t *testing.T) {
	cfg := consecutiveOnly()
	cfg.OpenTimeout = configfile.Duration(time.Millisecond)
	b := NewBreaker("enc-a", cfg, nil)
	defer b.Stop()
	for i := 0; i < 5; i++ {
		send(t, b, answer500)
	}
	if b.State() == BreakerClosed {
		t.Fatal("breaker did not trip")
	}
	if b.Name() != "enc-a" {
		t.Fatalf("Name = %q", b.Name())
	}
}

func TestBreakerConcurrent(t *testing.T) {
	cfg := DefaultBreaker()
	cfg.OpenTimeout = configfile.Duration(time.Millisecond)
	b := NewBreaker("enc-a", cfg, func(string, BreakerState, BreakerState) {})
	defer b.Stop()
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 2000; i++ {
				if done, ok := b.Allow(); ok {
					if i%3 == 0 {
						done(MarkFault)
					} else {
						done(MarkSuccess)
					}
				}
				_ = b.State()
				_ = b.Counts()
			}
		}()
	}
	wg.Wait()
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
		d.Interval.D() != 10*time.Second || d.OpenTimeout.D() != 30*time.Second || d.HalfOpenRequests != 1 || d.Disabled {
		t.Fatalf("defaults = %+v", d)
	}

	bad := BreakerConfig{
		ConsecutiveFailures: 0,
		FailureRatio:        1.5,
		MinRequests:         -1,
		Interval:            0,
		OpenTimeout:         -1,
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
		"breaker.interval: must be > 0",
		"breaker.open_timeout: must be > 0",
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
	for _, r := range []float64{0, -0.1, 1.0000001} {
		c := DefaultBreaker()
		c.FailureRatio = r
		p = configfile.Problems{}
		c.Validate(&p, "b")
		if p.Err() == nil {
			t.Errorf("failure_ratio %v accepted", r)
		}
	}
	c := DefaultBreaker()
	c.FailureRatio = 1
	p = configfile.Problems{}
	c.Validate(&p, "b")
	if err := p.Err(); err != nil {
		t.Errorf("failure_ratio 1 refused: %v", err)
	}
}

func TestBreakerYAML(t *testing.T) {
	cfg := DefaultBreaker()
	err := configfile.Decode([]byte(`
consecutive_failures: 3
failure_ratio: 0.25
min_requests: 8
interval: 5s
open_timeout: 1m
half_open_requests: 2
ignore:
  - {status: 504, body_contains: "encode metadata not ready"}
disabled: false
`), &cfg)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.ConsecutiveFailures != 3 || cfg.FailureRatio != 0.25 || cfg.MinRequests != 8 ||
		cfg.Interval.D() != 5*time.Second || cfg.OpenTimeout.D() != time.Minute || cfg.HalfOpenRequests != 2 ||
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
