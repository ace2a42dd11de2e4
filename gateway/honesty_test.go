package gateway

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/redistest"
	"github.com/encgate/encgate/internal/testtool"
)

// heldEncoder answers /encode at once and holds every /send until release
// is closed, telling arrived of each.
type heldEncoder struct {
	*httptest.Server
	arrived chan struct{}
	release chan struct{}
	sends   atomic.Int64
}

func newHeldEncoder(t *testing.T) *heldEncoder {
	h := &heldEncoder{arrived: make(chan struct{}, 16), release: make(chan struct{})}
	h.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if r.URL.Path == "/send" {
			h.sends.Add(1)
			h.arrived <- struct{}{}
			<-h.release
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, "null")
	}))
	t.Cleanup(func() {
		select {
		case <-h.release:
		default:
			close(h.release)
		}
		h.Close()
	})
	return h
}

// wantHonest checks a /send answer's status and its two headers:
// X-Encgate-Replayed (true, or absent) and X-Encgate-Encoder (a name, or
// absent when "").
func wantHonest(t *testing.T, what string, a answer, status int, replayed bool, encoder string) {
	t.Helper()
	want := ""
	if replayed {
		want = "true"
	}
	if a.status != status || a.header.Get(headerReplayed) != want || a.header.Get(headerEncoder) != encoder {
		t.Errorf("%s: %d %s=%q %s=%q (%s), want %d %q %q", what, a.status, headerReplayed, a.header.Get(headerReplayed),
			headerEncoder, a.header.Get(headerEncoder), a.body, status, want, encoder)
	}
}

// wantMayRetry fails unless a is an envelope for a /send refused before it
// was forwarded, whose message tells the caller it may retry.
func wantMayRetry(t *testing.T, what string, a answer) {
	t.Helper()
	var env struct{ Status, Message string }
	if err := json.Unmarshal([]byte(a.body), &env); err != nil || env.Status != "error" ||
		!strings.HasSuffix(env.Message, "; this call forwarded nothing, so the caller may retry it") {
		t.Errorf("%s: %s, want an envelope whose message says the caller may retry (%v)", what, a.body, err)
	}
}

// TestSendAnswersAreHonest walks one req_id through every /send outcome:
// X-Encgate-Replayed is on exactly the answers that are another call's
// (replayed from the store, or shared by an identical call in flight),
// never on the answers the gateway makes itself; X-Encgate-Encoder names
// the encoder holding the req_id on every answer while one does.
func TestSendAnswersAreHonest(t *testing.T) {
	enc := newHeldEncoder(t)
	// The fake clock times the waits of identical calls in flight: a
	// waiter's deadline passes when the test says, and its wait is seen
	// starting (its timer).
	clk := clock.NewFake(time.Now())
	const deadline = 5 * time.Second
	g := startGatewayDeps(t, []string{enc.URL}, func(c *Config) {
		c.Health.Disabled = true
		c.Retry.Send.Deadline = configfile.Duration(deadline)
	}, zap.NewNop(), clk)
	const id = "honest_local_part_0"
	if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 || a.header.Get(headerEncoder) != "enc-0" {
		t.Fatalf("/encode: %d %q %s", a.status, a.header.Get(headerEncoder), a.body)
	}
	rank0 := tpSend(id, 0, 2)
	async := func(body string) <-chan answer {
		c := make(chan answer, 1)
		go func() { c <- post(t, g.base+"/send", body) }()
		return c
	}
	// joined sends body while the first call is held at the encoder and
	// returns once it waits on that call (its wait's timer is set).
	joined := func(body string) <-chan answer {
		before := clk.Pending()
		c := async(body)
		eventually(t, "the identical call waiting", func() bool { return clk.Pending() > before })
		return c
	}

	first := async(rank0)
	<-enc.arrived

	// An identical call whose deadline passes while the first is in
	// flight: the gateway's own 504, not a replay.
	late := joined(rank0)
	clk.Advance(deadline + time.Second)
	a := <-late
	wantHonest(t, "wait past the deadline", a, 504, false, "enc-0")
	wantMayRetry(t, "wait past the deadline", a)

	// An identical call that waits for the first: the first's answer,
	// shared.
	shared := joined(rank0)
	close(enc.release)
	wantHonest(t, "the forwarded call", <-first, 200, false, "enc-0")
	wantHonest(t, "coalesced on the call in flight", <-shared, 200, true, "enc-0")

	wantHonest(t, "replayed from the store", post(t, g.base+"/send", rank0), 200, true, "enc-0")
	changed := strings.Replace(rank0, `"buffer_address":`, `"buffer_address":1`, 1)
	wantHonest(t, "same key, other payload (422)", post(t, g.base+"/send", changed), 422, false, "enc-0")

	// The second destination releases the req_id (receive_count 2) and
	// its pin: from then on no encoder holds it.
	wantHonest(t, "the releasing call", post(t, g.base+"/send", tpSend(id, 1, 2)), 200, false, "enc-0")
	wantHonest(t, "a new destination after release", post(t, g.base+"/send", tpSend(id, 2, 2)), 500, false, "")
	// Still a replay, and still named: the store keeps which encoder
	// answered, though no pin says it any more.
	wantHonest(t, "replayed after release", post(t, g.base+"/send", rank0), 200, true, "enc-0")

	if n := enc.sends.Load(); n != 2 {
		t.Errorf("the encoder received %d /sends, want 2 (one per destination)", n)
	}
	for reason, want := range map[string]float64{"inflight": 1, "replay": 2} {
		if got := counterWith(t, g, "encgate_send_duplicates_suppressed_total", "reason", reason); got != want {
			t.Errorf("duplicates suppressed (%s) = %v, want %v", reason, got, want)
		}
	}

	// The store unreachable: the gateway's 503, or a forward without
	// dedupe with redis.fail_open; neither is a replay.
	for _, failOpen := range []bool{false, true} {
		encs := startFakes(t, 1, nil)
		g := startGateway(t, fakeURLs(encs), func(c *Config) {
			c.Idempotency.Store = "redis"
			c.Redis.Addr = deadAddr(t)
			c.Idempotency.FailOpen = failOpen
		})
		const id = "storedown_local_part_0"
		if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 {
			t.Fatalf("/encode: %d %s", a.status, a.body)
		}
		if failOpen {
			wantHonest(t, "forwarded without dedupe", post(t, g.base+"/send", tpSend(id, 0, 2)), 200, false, "enc-0")
		} else {
			a := post(t, g.base+"/send", tpSend(id, 0, 2))
			wantHonest(t, "store unavailable", a, 503, false, "enc-0")
			wantMayRetry(t, "store unavailable", a)
		}
	}
}

// counterWith is the value of the named counter's series whose label is
// value.
func counterWith(t *testing.T, g *gw, name, label, value string) float64 {
	t.Helper()
	mfs, err := g.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// TestWaitOnACallThatEndsWithoutAnswerIsNotA200: two replicas share Redis.
// Replica A forwards a /send, held at the encoder. On replica B two
// identical calls arrive: one waits on A's claim until its deadline (the
// gateway's 504), the other waits on that one. The second must not get the
// first's missing answer as a 200: nothing told B that the /send was
// delivered.
func TestWaitOnACallThatEndsWithoutAnswerIsNotA200(t *testing.T) {
	testtool.Need(t, redistest.Binary, "redis-server")
	rd := redistest.Start(t)
	enc := newHeldEncoder(t)
	replica := func(deadline time.Duration, clk clock.Clock) *gw {
		return startGatewayDeps(t, []string{enc.URL}, func(c *Config) {
			c.Health.Disabled = true
			c.Affinity.UnknownWait = 0
			c.Idempotency.Store = "redis"
			c.Redis.Addr = rd.Addr()
			c.Retry.Send.Deadline = configfile.Duration(deadline)
		}, zap.NewNop(), clk)
	}
	a := replica(time.Minute, clock.Real{})
	// On B the clock stands still: the call waiting on A's claim does so
	// until its deadline in real time (Redis's wait is a context deadline),
	// while the call waiting on it in B waits on a fake timer that never
	// fires, so it ends only when the first does.
	clkB := clock.NewFake(time.Now())
	b := replica(2*time.Second, clkB)
	const id = "replicas_local_part_0"
	if r := post(t, a.base+"/encode", encodeBody(id)); r.status != 200 {
		t.Fatalf("/encode: %d %s", r.status, r.body)
	}
	body := tpSend(id, 0, 2)
	onA := make(chan answer, 1)
	go func() { onA <- post(t, a.base+"/send", body) }()
	<-enc.arrived
	waiting := clkB.Pending()
	onB := make(chan answer, 2)
	for i := 0; i < 2; i++ {
		go func() { onB <- post(t, b.base+"/send", body) }()
	}
	eventually(t, "one call on B waiting on the other", func() bool { return clkB.Pending() > waiting })
	for i := 0; i < 2; i++ {
		r := <-onB
		if r.status == 200 || r.header.Get(headerReplayed) != "" {
			t.Errorf("a call on replica B while A's is in flight: %d %s=%q %q, want the gateway's own refusal",
				r.status, headerReplayed, r.header.Get(headerReplayed), r.body)
		}
	}
	close(enc.release)
	if r := <-onA; r.status != 200 || r.header.Get(headerReplayed) != "" {
		t.Errorf("replica A's call: %d %q", r.status, r.body)
	}
	if n := enc.sends.Load(); n != 1 {
		t.Errorf("the encoder received %d /sends, want 1", n)
	}
}
