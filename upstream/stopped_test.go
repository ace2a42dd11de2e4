package upstream

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/sglang"
)

// What the protocol reference (§1.1, §7, §9.5) says bounds an /encode.
const (
	// sglangReqTimeout is SGLANG_ENCODER_REQ_TIMEOUT: the batch watchdog
	// (504 "encoder batch timed out") and a DP rank's future.
	sglangReqTimeout = 180 * time.Second
	// sglangSendTimeout is SGLANG_ENCODER_SEND_TIMEOUT: how long a
	// zmq_to_scheduler /encode waits, after its encode, for the receivers'
	// registrations before it answers 200 anyway.
	sglangSendTimeout = 180 * time.Second
	// sglangHTTPTimeout is SGLANG_ENCODER_HTTP_TIMEOUT: the receiver's whole
	// budget for one call to an encoder (here, to the gateway).
	sglangHTTPTimeout = 1800 * time.Second
)

// The exchange's per-try timeout is a socket deadline (fasthttp reads the
// wall clock), so no injected clock can make a default-config try end
// early, and a test that waited out a default try would take minutes. What
// can be checked cheaply and honestly is the default's value against the
// encoder's own bounds, which the stopped-encoder tests (here with short
// timeouts, and TestStoppedEncoderIsBoundedAndRecovers with a real SIGSTOP)
// show the gateway applies to every try: a stopped encoder holds an /encode
// per_try_timeout at most, and the whole call ends by deadline.
func TestDefaultEncodeTimeoutBoundsAStoppedEncoder(t *testing.T) {
	pol := DefaultRetry().Encode
	healthiest := sglangReqTimeout + sglangSendTimeout // the longest a healthy encoder takes to answer
	// What a healthy encoder may take beyond its two bounds (media loading,
	// the queue before a batch, the answer on the wire): a margin, not a
	// second budget.
	const margin = time.Minute
	perTry, deadline := pol.PerTryTimeout.D(), pol.Deadline.D()
	if perTry <= healthiest {
		t.Errorf("retry.encode.per_try_timeout %s cuts a healthy /encode: sglang may take up to %s (REQ_TIMEOUT %s + SEND_TIMEOUT %s)",
			perTry, healthiest, sglangReqTimeout, sglangSendTimeout)
	}
	if perTry > healthiest+margin {
		t.Errorf("retry.encode.per_try_timeout %s holds an /encode to a stopped encoder more than %s past the longest a healthy one takes (%s)",
			perTry, margin, healthiest)
	}
	// Retries follow only outcomes with nothing sent, which end by the
	// connect timeout; the last try must still get all of per_try_timeout.
	connect := DefaultClient().ConnectTimeout.D()
	retriesBefore := time.Duration(pol.MaxAttempts-1) * (connect + pol.MaxBackoff.D())
	if deadline < perTry+retriesBefore {
		t.Errorf("retry.encode.deadline %s leaves the last of %d attempts less than per_try_timeout %s after %s of failed connects and backoffs",
			deadline, pol.MaxAttempts, perTry, retriesBefore)
	}
	if deadline > perTry+retriesBefore+margin {
		t.Errorf("retry.encode.deadline %s is more than %s above what its attempts can use (%s)", deadline, margin, perTry+retriesBefore)
	}
	// The gateway must answer before the receiver gives up on it: then the
	// receiver hears the gateway's 504 naming the stopped encoder, not its
	// own timeout.
	if deadline >= sglangHTTPTimeout {
		t.Errorf("retry.encode.deadline %s is not below the receiver's own budget (SGLANG_ENCODER_HTTP_TIMEOUT %s): it gives up first", deadline, sglangHTTPTimeout)
	}
	var p configfile.Problems
	d := DefaultRetry()
	d.Validate(&p, "retry")
	if err := p.Err(); err != nil {
		t.Errorf("the defaults do not validate: %v", err)
	}
}

// holding is an encoder that takes requests and never answers, and tells
// got of each request's first bytes: what a wedged encoder process is to
// a client, with a signal that a request arrived. kill resets its
// connections and closes its listener, as the process's death would.
type holding struct {
	addr string
	got  <-chan struct{}
	kill func()
}

func holdingListener(t *testing.T) *holding {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan struct{}, 64)
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			go func() {
				buf := make([]byte, 4096)
				if n, _ := c.Read(buf); n > 0 {
					got <- struct{}{}
				}
				_, _ = io.Copy(io.Discard, c)
			}()
		}
	}()
	var once sync.Once
	kill := func() {
		once.Do(func() {
			_ = ln.Close()
			mu.Lock()
			defer mu.Unlock()
			for _, c := range conns {
				if tc, ok := c.(*net.TCPConn); ok {
					_ = tc.SetLinger(0)
				}
				_ = c.Close()
			}
		})
	}
	t.Cleanup(kill)
	return &holding{addr: ln.Addr().String(), got: got, kill: kill}
}

// liveEncoder answers every POST 200 with a JSON body naming itself.
func liveEncoder(t *testing.T, name string) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"encoder":%q}`, name)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// testSettings is a fleet of the given name → URL pairs with the defaults,
// health checks off and no in-flight limit.
func testSettings(encoders ...string) Settings {
	set := Settings{Client: DefaultClient(), Breaker: DefaultBreaker(), Health: DefaultHealth(), Retry: DefaultRetry()}
	set.Health.Disabled = true
	for i := 0; i+1 < len(encoders); i += 2 {
		set.Encoders = append(set.Encoders, EncoderConfig{Name: encoders[i], URL: encoders[i+1]})
	}
	return set
}

func newTestPool(t *testing.T, set Settings, reg *prometheus.Registry) *Pool {
	t.Helper()
	aff := DefaultAffinity()
	aff.UnknownWait = 0
	p, err := NewPool(set, aff, Deps{Log: zap.NewNop(), Registry: reg, Clock: clock.NewFake(time.Unix(1e9, 0)),
		Rand: func() float64 { return 0 }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// ownedBy returns a req_id whose rendezvous owner is name.
func ownedBy(t *testing.T, p *Pool, name, prefix string) string {
	t.Helper()
	for i := 0; i < 10000; i++ {
		id := fmt.Sprintf("%s-%d_local_part_0", prefix, i)
		if e, err := p.Owner(id); err == nil && e.Name == name {
			return id
		}
	}
	t.Fatalf("no req_id owned by %s", name)
	return ""
}

func newCall(rt *sglang.Route, id string) *Call {
	return &Call{Route: rt, ReqID: id, Method: []byte("POST"), ContentType: []byte("application/json"),
		Body: []byte(`{"req_id":"` + id + `","part_idx":0}`), Resp: &fasthttp.Response{}}
}

// waitInflight waits for e to hold n exchanges, the state the test drives
// it to (nothing signals it; it is a counter the exchanges move).
func waitInflight(t *testing.T, e *Encoder, n int64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for e.Inflight() != n {
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d exchanges in flight, want %d", e.Name, e.Inflight(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// An encoder that stopped answering holds the exchanges sent to it until
// their tries end; once they fill limits.max_inflight_per_encoder, new work
// for it is refused at once with nothing sent: an /encode it owns goes to
// the next encoder in rendezvous order (its first attempt judged refused,
// not sent, a connect_failure for the retry policy, ignored by the breaker),
// and a follow-up pinned to it gets the gateway's 503 without waiting.
func TestStoppedEncoderAtItsInflightLimitRefusesAtOnce(t *testing.T) {
	stopped := holdingListener(t)
	live := liveEncoder(t, "live")
	set := testSettings("stopped", "http://"+stopped.addr, "live", live.URL)
	set.MaxInflight = 2
	// Long tries: the held exchanges must outlast the rest of the test,
	// which ends them by closing the listener (a reset, as a killed
	// process would give).
	set.Retry.Encode.PerTryTimeout = configfile.Duration(time.Minute)
	set.Retry.Metadata.PerTryTimeout = configfile.Duration(time.Minute)
	reg := prometheus.NewRegistry()
	p := newTestPool(t, set, reg)
	enc, _ := p.Lookup("stopped")

	held := make(chan Result, 2)
	for i := 0; i < 2; i++ {
		c := newCall(sglang.RouteEncode, ownedBy(t, p, "stopped", fmt.Sprintf("held%d", i)))
		go func() { held <- p.Exchange(c) }()
	}
	waitInflight(t, enc, 2)
	// Counted in flight is not yet written: wait for both requests to reach
	// the encoder, or the close below could find one still connecting (a
	// refused connect, which is retried on the next encoder).
	for i := 0; i < 2; i++ {
		<-stopped.got
	}

	moved := newCall(sglang.RouteEncode, ownedBy(t, p, "stopped", "moved"))
	res := p.Exchange(moved)
	if v := res.Verdict; v.Kind != KindAnswered || v.Status != 200 || res.enc == nil || res.enc.Name != "live" || res.Attempts != 2 {
		t.Fatalf("an /encode owned by the stopped encoder at its limit: %+v after %d attempts on %v", v, res.Attempts, res.enc)
	}
	if pin, ok := p.pins.Get(moved.ReqID); !ok || pin.Encoder != "live" || pin.State != PinEncoded {
		t.Fatalf("the moved /encode's pin: %+v %v", pin, ok)
	}
	// Its first attempt, as the metrics read that one verdict: refused with
	// nothing sent, retried as a connect_failure, not told to the breaker
	// as a fault.
	for _, c := range []struct {
		what string
		m    prometheus.Collector
		want float64
	}{
		{"refused /encode exchanges", p.m.requests.WithLabelValues("stopped", "encode", "refused"), 1},
		{"max_inflight refusals", p.m.refused.WithLabelValues("stopped", RefusedMaxInflight), 1},
		{"connect_failure retries", p.m.retries.WithLabelValues("encode", ReasonConnectFailure), 1},
		{"breaker faults", p.m.outcomes.WithLabelValues("stopped", MarkFault.String()), 0},
		{"breaker ignored", p.m.outcomes.WithLabelValues("stopped", MarkIgnored.String()), 1},
		{"200s from the next encoder", p.m.requests.WithLabelValues("live", "encode", "200"), 1},
	} {
		if got := testutil.ToFloat64(c.m); got != c.want {
			t.Errorf("%s: %g, want %g", c.what, got, c.want)
		}
	}
	if st := enc.Breaker.State(); st != BreakerClosed {
		t.Errorf("the refusal moved the breaker to %s", st)
	}

	// A follow-up pinned to the stopped encoder: refused at once on every
	// attempt (its state cannot move), answered with the gateway's 503.
	p.pins.Set(moved.ReqID+"-pinned", "stopped", enc.ID())
	follow := p.Exchange(newCall(sglang.RouteMetadata, moved.ReqID+"-pinned"))
	if v := follow.Verdict; v.Kind != KindRefused || v.Delivery != NotSent || v.Status != 503 || follow.Delivered ||
		!strings.Contains(v.Message, "already has 2 requests in flight") {
		t.Fatalf("a pull pinned to the stopped encoder at its limit: %+v (delivered %v)", v, follow.Delivered)
	}

	// The held /encodes end when the encoder dies, each after one attempt:
	// what may have reached it is never sent again.
	stopped.kill()
	for i := 0; i < 2; i++ {
		r := <-held
		if r.Attempts != 1 || r.Verdict.Delivery == NotSent || r.Verdict.Status < 500 {
			t.Errorf("held /encode %d: %+v after %d attempts", i, r.Verdict, r.Attempts)
		}
	}
	if enc.Inflight() != 0 {
		t.Errorf("%d exchanges still counted in flight", enc.Inflight())
	}
}
