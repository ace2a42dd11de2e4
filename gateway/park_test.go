package gateway

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/redistest"
	"github.com/encgate/encgate/internal/sglang"
	"github.com/encgate/encgate/upstream"
)

// Parked exchanges (park.go): a long poll the encoder holds waits with no
// goroutine of its own, and everything it holds is freed whatever ends it.

// requestGoroutines counts goroutines inside the gateway's request path
// (a handler, an exchange's attempts): what a held request used to keep.
func requestGoroutines(t *testing.T) int {
	t.Helper()
	var b strings.Builder
	if err := pprof.Lookup("goroutine").WriteTo(&b, 2); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, g := range strings.Split(b.String(), "\n\n") {
		if strings.Contains(g, "gateway.(*Server).serveClient") || strings.Contains(g, "upstream.(*run)") {
			n++
		}
	}
	return n
}

// encodeAt publishes id's part on the fake directly, which releases the
// pulls it holds for it.
func encodeAt(t *testing.T, e *fakeencoder.Encoder, id string) {
	t.Helper()
	if a := post(t, e.URL()+"/encode", encodeBody(id)); a.status != http.StatusOK {
		t.Fatalf("/encode %s at the fake: %d %s", id, a.status, a.body)
	}
}

func parkedGateway(t *testing.T, encs []*fakeencoder.Encoder, mutate func(*Config)) *gw {
	t.Helper()
	return startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Affinity.UnknownWait = 0 // never-pinned pulls go straight to the owner
		if mutate != nil {
			mutate(c)
		}
	})
}

func TestHeldPullsParkWithNoGoroutineOfTheirOwn(t *testing.T) {
	chaosLeakCheck(t) // no goroutine or descriptor outlives it
	const n = 100
	encs := startFakes(t, 1, nil)
	g := parkedGateway(t, encs, nil)
	waiting := func() int { return encs[0].Stats().Waiting[fakeencoder.RouteMetadata] }
	pl := g.Pool().Poller()
	if pl == nil {
		t.Fatal("no poller: long polls cannot park here")
	}
	pulls := map[string]<-chan result{}
	for i := range n {
		id := fmt.Sprintf("held-%d_local_part_0", i)
		pulls[id] = postAsync(g.base+"/scheduler_receive_meta_data", metaBody(id))
	}
	eventually(t, "every pull held by the encoder and parked, and its client watched", func() bool {
		return waiting() == n && metricValue(t, g, "encgate_upstream_parked") == n && pl.Armed() == 2*n
	})
	// Each parked pull is watched twice (its encoder's connection, its
	// client's) and kept by no goroutine in the request path.
	if a := pl.Armed(); a != 2*n {
		t.Fatalf("poller has %d watches armed, want %d", a, 2*n)
	}
	if k := requestGoroutines(t); k != 0 {
		t.Fatalf("%d goroutines in the request path with %d pulls parked, want 0", k, n)
	}
	for id := range pulls {
		encodeAt(t, encs[0], id)
	}
	for id, ch := range pulls {
		r := <-ch
		if r.err != nil || r.a.status != http.StatusOK || !strings.Contains(r.a.body, id) {
			t.Fatalf("pull %s: %v %d %s", id, r.err, r.a.status, r.a.body)
		}
		if r.a.header.Get(headerEncoder) != "enc-0" || r.a.header.Get(headerAttempts) != "1" {
			t.Fatalf("pull %s headers %v", id, r.a.header)
		}
	}
	eventually(t, "nothing parked or watched", func() bool {
		return metricValue(t, g, "encgate_upstream_parked") == 0 && pl.Armed() == 0 &&
			g.Pool().Encoders()[0].Inflight() == 0
	})
	// Answered parked pulls are counted as answers like any other (each
	// once its answer is written: the last may be counted just after its
	// client read it).
	eventually(t, "every parked pull counted as an answer", func() bool {
		return metricValue(t, g, "encgate_requests_total") >= n
	})
}

// rawPull writes a metadata pull for id on c.
func rawPull(t *testing.T, c net.Conn, id string, extra string) {
	t.Helper()
	body := metaBody(id)
	if _, err := fmt.Fprintf(c, "POST /scheduler_receive_meta_data HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s",
		extra, len(body), body); err != nil {
		t.Fatal(err)
	}
}

func readAnswer(t *testing.T, br *bufio.Reader) answer {
	t.Helper()
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b strings.Builder
	if _, err := bufio.NewReader(resp.Body).WriteTo(&b); err != nil {
		t.Fatal(err)
	}
	if resp.Close { // net/http takes "Connection: close" out of the header
		resp.Header.Set("Connection", "close")
	}
	return answer{resp.StatusCode, resp.Header, b.String()}
}

func TestParkedPullWhoseClientHangsUpFreesItsConnection(t *testing.T) {
	chaosLeakCheck(t) // no goroutine or descriptor outlives it
	encs := startFakes(t, 1, nil)
	g := parkedGateway(t, encs, nil)
	pl := g.Pool().Poller()
	c, err := net.Dial("tcp", g.Addr())
	if err != nil {
		t.Fatal(err)
	}
	id := "gone_local_part_0"
	rawPull(t, c, id, "")
	eventually(t, "the pull parked", func() bool { return metricValue(t, g, "encgate_upstream_parked") == 1 })
	open := g.conns.Open()
	c.Close()
	eventually(t, "the client's connection closed and counted", func() bool {
		return metricValue(t, g, "encgate_parked_clients_gone_total") == 1 && g.conns.Open() == open-1 && pl.Armed() == 1
	})
	// The exchange goes on to its verdict; then nothing is left.
	encodeAt(t, encs[0], id)
	eventually(t, "the exchange ended and freed its encoder's connection", func() bool {
		return metricValue(t, g, "encgate_upstream_parked") == 0 && pl.Armed() == 0 &&
			g.Pool().Encoders()[0].Inflight() == 0
	})
	if v := g.Pool().Encoders()[0].Breaker.State(); v.String() != "closed" {
		t.Fatalf("breaker %v after a client hung up", v)
	}
}

// A parked connection goes back to serving: its pipelined request (read
// by the server before the first one parked) and its next ones.
func TestParkedConnectionServesItsPipelinedAndNextRequests(t *testing.T) {
	chaosLeakCheck(t) // no goroutine or descriptor outlives it
	encs := startFakes(t, 1, nil)
	g := parkedGateway(t, encs, nil)
	c, err := net.Dial("tcp", g.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	a, b := "pipe-a_local_part_0", "pipe-b_local_part_0"
	// Both in one write: the server reads b's bytes with a's.
	var both strings.Builder
	for _, id := range []string{a, b} {
		body := metaBody(id)
		fmt.Fprintf(&both, "POST /scheduler_receive_meta_data HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	}
	if _, err := c.Write([]byte(both.String())); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a parked", func() bool { return metricValue(t, g, "encgate_upstream_parked") == 1 })
	encodeAt(t, encs[0], a)
	if ans := readAnswer(t, br); ans.status != http.StatusOK || !strings.Contains(ans.body, a) {
		t.Fatalf("first answer %d %s", ans.status, ans.body)
	}
	eventually(t, "b parked in turn", func() bool {
		return metricValue(t, g, "encgate_upstream_parked") == 1 && encs[0].Stats().Waiting[fakeencoder.RouteMetadata] == 1
	})
	encodeAt(t, encs[0], b)
	if ans := readAnswer(t, br); ans.status != http.StatusOK || !strings.Contains(ans.body, b) {
		t.Fatalf("pipelined answer %d %s", ans.status, ans.body)
	}
	// And the next request, for a part already encoded, is answered on the
	// same connection.
	rawPull(t, c, a, "")
	if ans := readAnswer(t, br); ans.status != http.StatusOK || !strings.Contains(ans.body, a) {
		t.Fatalf("next answer %d %s", ans.status, ans.body)
	}
	// Connection: close is honoured after a parked answer.
	rawPull(t, c, "close_local_part_0", "Connection: close\r\n")
	eventually(t, "parked", func() bool { return metricValue(t, g, "encgate_upstream_parked") == 1 })
	encodeAt(t, encs[0], "close_local_part_0")
	ans := readAnswer(t, br)
	if ans.status != http.StatusOK || ans.header.Get("Connection") != "close" {
		t.Fatalf("answer %d %v", ans.status, ans.header)
	}
	if _, err := br.ReadByte(); err == nil {
		t.Fatal("the connection stayed open after Connection: close")
	}
}

// Faults while parked give the verdicts they give unparked: the same
// status, message and attempts, with park_long_polls on and off.
func TestParkedPullsUnderFaultsGiveTheUnparkedVerdict(t *testing.T) {
	type outcome struct {
		status   int
		body     string
		attempts string
	}
	cases := []struct {
		name   string
		faults fakeencoder.Faults
		encode bool // encode the part first (through the fake)
	}{
		{"crash while held", fakeencoder.Faults{CrashAt: 1, CrashRoutes: []string{"/scheduler_receive_meta_data"}}, false},
		{"hang past the per-try timeout", fakeencoder.Faults{Hang: true}, false},
		{"truncated answer", fakeencoder.Faults{Truncate: true, TruncateRoutes: []string{"/scheduler_receive_meta_data"}}, true},
		{"error answer", fakeencoder.Faults{FailureRate: 1, FailStatus: 500, FailRoutes: []string{"/scheduler_receive_meta_data"}}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			chaosLeakCheck(t)
			var got [2]outcome
			for i, park := range []bool{true, false} {
				encs := startFakes(t, 1, nil)
				g := parkedGateway(t, encs, func(c *Config) {
					c.Limits.ParkLongPolls = park
					c.Health.Disabled = true
					c.Retry.Metadata.PerTryTimeout = configfile.Duration(300 * time.Millisecond)
					c.Retry.Metadata.Deadline = configfile.Duration(2 * time.Second)
					c.Retry.Metadata.MaxAttempts = 2
				})
				id := fmt.Sprintf("fault-%d_local_part_0", i)
				if tc.encode {
					encodeAt(t, encs[0], id)
				}
				encs[0].SetFaults(tc.faults)
				a := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id))
				got[i] = outcome{a.status, a.body, a.header.Get(headerAttempts)}
				eventually(t, "nothing left parked", func() bool {
					return metricValue(t, g, "encgate_upstream_parked") == 0 && g.Pool().Poller().Armed() == 0
				})
			}
			t.Logf("parked %+v", got[0])
			if strings.ReplaceAll(got[0].body, "fault-0", "fault-1") != got[1].body || got[0].status != got[1].status || got[0].attempts != got[1].attempts {
				t.Fatalf("parked %+v, unparked %+v", got[0], got[1])
			}
		})
	}
}

func TestDrainAnswersParkedPullsAndClosesTheirConnections(t *testing.T) {
	chaosLeakCheck(t) // no goroutine or descriptor outlives it
	encs := startFakes(t, 1, nil)
	g := parkedGateway(t, encs, nil)
	c, err := net.Dial("tcp", g.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	id := "drain_local_part_0"
	rawPull(t, c, id, "")
	eventually(t, "parked", func() bool { return metricValue(t, g, "encgate_upstream_parked") == 1 })
	stopped := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		stopped <- g.Shutdown(ctx)
	}()
	eventually(t, "draining", func() bool { return !g.ready.Load() })
	select {
	case err := <-stopped:
		t.Fatalf("Shutdown returned (%v) with a pull parked", err)
	default:
	}
	encodeAt(t, encs[0], id)
	ans := readAnswer(t, bufio.NewReader(c))
	if ans.status != http.StatusOK || ans.header.Get("Connection") != "close" || !strings.Contains(ans.body, id) {
		t.Fatalf("answer while draining: %d %v %s", ans.status, ans.header, ans.body)
	}
	if err := <-stopped; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
}

// Drain ends a parked pull's wait for its pin as it ends a waiting one's
// (Call.Stop, as Done): the pull goes on to its part's rendezvous owner
// at once rather than after affinity.unknown_wait (an hour here), and is
// answered on a connection that then closes; with the pins in this
// table and with them shared through Redis.
func TestDrainEndsParkedPinWaits(t *testing.T) {
	for _, shared := range []bool{false, true} {
		t.Run(map[bool]string{false: "local", true: "redis"}[shared], func(t *testing.T) {
			chaosLeakCheck(t)
			encs := startFakes(t, 1, nil)
			var addr string
			if shared {
				addr = redistest.Start(t).Addr()
			}
			g := startGateway(t, fakeURLs(encs), func(c *Config) {
				c.Affinity.UnknownWait = configfile.Duration(time.Hour)
				if shared {
					c.Idempotency.Store = "redis"
					c.Redis.Addr = addr
					c.Health.Disabled = true
				}
			})
			c, err := net.Dial("tcp", g.Addr())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			id := "drain-pin-wait_local_part_0"
			rawPull(t, c, id, "")
			eventually(t, "waiting for its pin, parked", func() bool {
				return metricValue(t, g, "encgate_pin_waiters") == 1 && g.Pool().Poller().Armed() == 1
			})
			stopped := make(chan error, 1)
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				stopped <- g.Shutdown(ctx)
			}()
			eventually(t, "the pull at its owner once the drain began", func() bool {
				return encs[0].Stats().Waiting[fakeencoder.RouteMetadata] == 1
			})
			encodeAt(t, encs[0], id)
			ans := readAnswer(t, bufio.NewReader(c))
			if ans.status != http.StatusOK || ans.header.Get("Connection") != "close" || !strings.Contains(ans.body, id) {
				t.Fatalf("answer while draining: %d %v %s", ans.status, ans.header, ans.body)
			}
			if err := <-stopped; err != nil {
				t.Fatalf("Shutdown: %v", err)
			}
		})
	}
}

// A pull that comes before its part's /encode waits for the pin
// (affinity.unknown_wait) parked too, and the /encode's pin ends the wait.
func TestPullsWaitingForTheirPinPark(t *testing.T) {
	chaosLeakCheck(t) // no goroutine or descriptor outlives it
	const n = 50
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Affinity.UnknownWait = configfile.Duration(time.Minute) })
	pulls := earlyPulls(t, g, n, "early")
	if got := encs[0].Stats().Routes["/scheduler_receive_meta_data"]; got != 0 {
		t.Fatalf("the encoder saw %d pulls before their /encode", got)
	}
	encodeEach(t, g, pulls)
	eachAnsweredWithItsPart(t, pulls)
	nothingWaiting(t, g)
}

// earlyPulls posts n pulls to g, each for a part of its own whose /encode
// has not come (prefix-<i>_local_part_0), and waits until every one waits
// for its pin with its client watched, none in the request path.
func earlyPulls(t *testing.T, g *gw, n int, prefix string) map[string]<-chan result {
	t.Helper()
	pulls := map[string]<-chan result{}
	for i := range n {
		id := fmt.Sprintf("%s-%d_local_part_0", prefix, i)
		pulls[id] = postAsync(g.base+"/scheduler_receive_meta_data", metaBody(id))
	}
	pl := g.Pool().Poller()
	eventually(t, "every pull waiting for its pin, its client watched", func() bool {
		return metricValue(t, g, "encgate_pin_waiters") == float64(n) && pl.Armed() == n
	})
	if k := requestGoroutines(t); k != 0 {
		t.Fatalf("%d goroutines in the request path with %d pulls waiting for their pins, want 0", k, n)
	}
	return pulls
}

// encodeEach posts each pull's /encode to g.
func encodeEach(t *testing.T, g *gw, pulls map[string]<-chan result) {
	t.Helper()
	for id := range pulls {
		if a := post(t, g.base+"/encode", encodeBody(id)); a.status != http.StatusOK {
			t.Fatalf("/encode %s: %d %s", id, a.status, a.body)
		}
	}
}

// eachAnsweredWithItsPart waits for every pull's answer: 200, naming its
// own req_id.
func eachAnsweredWithItsPart(t *testing.T, pulls map[string]<-chan result) {
	t.Helper()
	for id, ch := range pulls {
		r := <-ch
		if r.err != nil || r.a.status != http.StatusOK || !strings.Contains(r.a.body, id) {
			t.Fatalf("pull %s: %v %d %s", id, r.err, r.a.status, r.a.body)
		}
	}
}

// nothingWaiting waits until no pull waits on g for its pin, is parked or
// is watched.
func nothingWaiting(t *testing.T, g *gw) {
	t.Helper()
	pl := g.Pool().Poller()
	eventually(t, "nothing waiting, parked or watched", func() bool {
		return metricValue(t, g, "encgate_pin_waiters") == 0 && metricValue(t, g, "encgate_upstream_parked") == 0 && pl.Armed() == 0
	})
}

// Every receiver TP rank pulls each part: while one rank's pull is at the
// encoder, the others wait for it (affinity.metadata_cache) parked too,
// with no goroutine in the request path, and all get its answer.
func TestPullsOfOnePartWaitForItParked(t *testing.T) {
	chaosLeakCheck(t) // no goroutine or descriptor outlives it
	const tp = 8
	encs := startFakes(t, 1, nil)
	g := parkedGateway(t, encs, nil)
	pl := g.Pool().Poller()
	id := "tp-ranks_local_part_0"
	var pulls [tp]<-chan result
	for i := range pulls {
		pulls[i] = postAsync(g.base+"/scheduler_receive_meta_data", metaBody(id))
	}
	eventually(t, "one pull at the encoder, parked, the others waiting for it, every client watched", func() bool {
		return metricValue(t, g, "encgate_upstream_parked") == 1 && metricValue(t, g, "encgate_metadata_pulls_waiting") == tp-1 &&
			pl.Armed() == tp+1
	})
	if k := requestGoroutines(t); k != 0 {
		t.Fatalf("%d goroutines in the request path with %d pulls of one part held, want 0", k, tp)
	}
	encodeAt(t, encs[0], id)
	for i, ch := range pulls {
		r := <-ch
		if r.err != nil || r.a.status != http.StatusOK || !strings.Contains(r.a.body, id) {
			t.Fatalf("pull %d: %v %d %s", i, r.err, r.a.status, r.a.body)
		}
	}
	if got := encs[0].Stats().Routes["/scheduler_receive_meta_data"]; got != 1 {
		t.Fatalf("the encoder saw %d pulls of the part, want 1", got)
	}
	eventually(t, "nothing parked, waiting or watched", func() bool {
		return metricValue(t, g, "encgate_upstream_parked") == 0 && metricValue(t, g, "encgate_metadata_pulls_waiting") == 0 && pl.Armed() == 0
	})
}

// With the replicas sharing their pins through Redis, a pull that comes
// to one replica before its part's /encode (sent to another) waits parked
// as well: no goroutine in the request path while it waits, and the
// placement published by the other replica ends its wait.
func TestPullsWaitingForASharedPinPark(t *testing.T) {
	chaosLeakCheck(t) // no goroutine or descriptor outlives it
	const n = 20
	encs := startFakes(t, 1, nil)
	rd := redistest.Start(t)
	var gws [2]*gw
	for i := range gws {
		gws[i] = startGateway(t, fakeURLs(encs), func(c *Config) {
			c.Idempotency.Store = "redis"
			c.Redis.Addr = rd.Addr()
			c.Affinity.UnknownWait = configfile.Duration(time.Minute)
			c.Health.Disabled = true
		})
	}
	waiting, placing := gws[0], gws[1]
	pulls := earlyPulls(t, waiting, n, "shared-early")
	encodeEach(t, placing, pulls) // on the other replica
	eachAnsweredWithItsPart(t, pulls)
	nothingWaiting(t, waiting)
}

// A slow /encode (GEN1 answers once the part is encoded) parks like a long
// poll, places its pin, and its part's follow-ups find it.
func TestSlowEncodeParks(t *testing.T) {
	chaosLeakCheck(t)
	release := make(chan struct{})
	arrived := make(chan string, 1)
	encs := startFakes(t, 2, func(_ int, o *fakeencoder.Options) {
		o.EncodeHook = func(ctx context.Context, id string) {
			arrived <- id
			select {
			case <-release:
			case <-ctx.Done():
			}
		}
	})
	g := parkedGateway(t, encs, nil)
	id := "slow_local_part_0"
	enc := postAsync(g.base+"/encode", encodeBody(id))
	<-arrived
	eventually(t, "the /encode parked", func() bool { return metricValue(t, g, "encgate_upstream_parked") == 1 })
	if k := requestGoroutines(t); k != 0 {
		t.Fatalf("%d goroutines in the request path with the /encode parked, want 0", k)
	}
	close(release)
	r := <-enc
	if r.err != nil || r.a.status != http.StatusOK {
		t.Fatalf("/encode: %v %d %s", r.err, r.a.status, r.a.body)
	}
	holder := r.a.header.Get(headerEncoder)
	pull := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id))
	if pull.status != http.StatusOK || pull.header.Get(headerEncoder) != holder {
		t.Fatalf("pull after the parked /encode: %d from %q, want 200 from %q", pull.status, pull.header.Get(headerEncoder), holder)
	}
}

// Pulls the encoder answers with a quick 504 at once (a storm) wait out
// their retry backoffs parked: a timer each, no goroutine in the request
// path. Shutdown ends those waits as it ends slept ones, and each call
// then gets its last answer, as an unparked call does.
func TestBackoffsParkWithNoGoroutineOfTheirOwn(t *testing.T) {
	type outcome struct {
		status   int
		body     string
		attempts string
		conn     string
	}
	const n = 20
	var got [2]outcome
	for i, park := range []bool{true, false} {
		t.Run(fmt.Sprintf("park_long_polls %v", park), func(t *testing.T) {
			chaosLeakCheck(t)
			encs := startFakes(t, 1, nil)
			g := parkedGateway(t, encs, func(c *Config) {
				c.Limits.ParkLongPolls = park
				c.Health.Disabled = true
				c.Breaker.Disabled = true
				m := &c.Retry.Metadata
				m.MaxAttempts = 3
				m.InitialBackoff = configfile.Duration(time.Hour) // never over before Shutdown
				m.MaxBackoff = configfile.Duration(time.Hour)
				m.Jitter = upstream.Jitter{Mode: upstream.JitterNone}
				m.Deadline = configfile.Duration(2 * time.Hour)
				c.Retry.Budget.MinPerSecond = 1000
			})
			encs[0].SetFaults(fakeencoder.Faults{FailureRate: 1, FailStatus: http.StatusGatewayTimeout, FailMessage: sglang.MetadataNotReady,
				FailRoutes: []string{"/scheduler_receive_meta_data"}})
			pulls := make([]<-chan result, n)
			for k := range n {
				pulls[k] = postAsync(g.base+"/scheduler_receive_meta_data", metaBody(fmt.Sprintf("storm-%d_local_part_0", k)))
			}
			eventually(t, "every pull answered 504 once and waiting out its backoff", func() bool {
				return metricOrZero(t, g, "encgate_retries_total") == n
			})
			if park {
				if v := metricValue(t, g, "encgate_upstream_backoffs_parked"); v != n {
					t.Fatalf("encgate_upstream_backoffs_parked %v, want %d", v, n)
				}
				if k := requestGoroutines(t); k != 0 {
					t.Fatalf("%d goroutines in the request path with %d backoffs parked, want 0", k, n)
				}
			} else if k := requestGoroutines(t); k < n {
				t.Fatalf("%d goroutines in the request path with %d backoffs slept, want >= %d", k, n, n)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			if err := g.Shutdown(ctx); err != nil {
				t.Fatalf("Shutdown: %v", err)
			}
			for k, ch := range pulls {
				r := <-ch
				if r.err != nil {
					t.Fatalf("pull %d: %v", k, r.err)
				}
				o := outcome{r.a.status, strings.ReplaceAll(r.a.body, fmt.Sprintf("storm-%d_", k), "storm-K_"), r.a.header.Get(headerAttempts), r.a.header.Get("Connection")}
				if k == 0 {
					got[i] = o
				} else if o != got[i] {
					t.Fatalf("pull %d: %+v, pull 0: %+v", k, o, got[i])
				}
			}
			if park && metricValue(t, g, "encgate_upstream_backoffs_parked") != 0 {
				t.Fatal("backoffs still parked after Shutdown")
			}
		})
	}
	t.Logf("parked %+v", got[0])
	if got[0] != got[1] || got[0].status != http.StatusGatewayTimeout || got[0].attempts != "1" {
		t.Fatalf("parked %+v, unparked %+v: want the same 504 after 1 attempt", got[0], got[1])
	}
}

// metricOrZero is metricValue for a metric vector that may have no series
// yet (0 then).
func metricOrZero(t *testing.T, g *gw, name string) float64 {
	t.Helper()
	mfs, err := g.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return metricValue(t, g, name)
		}
	}
	return 0
}
