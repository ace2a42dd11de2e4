package gateway

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/upstream"
)

// readToClose reads c until the gateway closes it (EOF, or a reset when the
// client still had bytes on the way) and returns what came before. The
// deadline only keeps a broken gateway from hanging the test.
func readToClose(t *testing.T, c net.Conn) []byte {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	b, err := io.ReadAll(c)
	if err != nil && !errors.Is(err, syscall.ECONNRESET) {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatalf("the gateway did not close the connection; read so far %q", b)
		}
		t.Fatalf("reading until the gateway closes: %v (read %q)", err, b)
	}
	return b
}

// parseAnswer parses raw as one HTTP response.
func parseAnswer(t *testing.T, raw []byte) (answer, *http.Response) {
	t.Helper()
	resp, err := http.ReadResponse(bufio.NewReader(strings.NewReader(string(raw))), nil)
	if err != nil {
		t.Fatalf("not an HTTP answer: %v: %q", err, raw)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("answer body: %v: %q", err, raw)
	}
	return answer{resp.StatusCode, resp.Header, string(b)}, resp
}

const wantTimeoutMsg = "encgate: request not read in time (limits.read_header_timeout %s for the headers, limits.read_timeout %s for the body)"

// A client that opens a request and trickles its header a byte at a time is
// answered 408 and cut off at read_header_timeout, however long it keeps
// trickling; a normal request on another connection is served meanwhile, and
// the connection count shows the slow one gone.
func TestSlowHeadersAreCutAtReadHeaderTimeout(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Limits.ReadHeaderTimeout = configfile.Duration(200 * time.Millisecond)
	})
	slow, err := net.Dial("tcp", g.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	if _, err := io.WriteString(slow, "POST /encode HTTP/1.1\r\nHost: gw\r\nX-Slow: "); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	trickled := make(chan int, 1)
	go func() { // the slowloris: one more header byte every 10ms until the gateway cuts it
		n := 0
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				trickled <- n
				return
			case <-tick.C:
			}
			if _, err := slow.Write([]byte("a")); err != nil {
				trickled <- n
				return
			}
			n++
		}
	}()
	eventually(t, "the slow connection to be accepted", func() bool {
		return metricValue(t, g, "encgate_connections_accepted_total") >= 1
	})

	if a := post(t, g.base+"/encode", encodeBody("normal_local_part_0")); a.status != 200 {
		t.Fatalf("a normal request beside the slow one: %d %s", a.status, a.body)
	}

	got, resp := parseAnswer(t, readToClose(t, slow))
	close(stop)
	<-trickled
	wantEnvelopeMsg(t, got, http.StatusRequestTimeout, fmt.Sprintf(wantTimeoutMsg, "200ms", "1m0s"), nil)
	if !resp.Close {
		t.Error("the 408 does not say Connection: close")
	}
	client.CloseIdleConnections()
	eventually(t, "no connection left open", func() bool {
		return metricValue(t, g, "encgate_connections_open") == 0
	})
	wantLines(t, scrape(t, g), `encgate_requests_total{code="408",route="unknown"} 1`,
		`encgate_requests_total{code="200",route="encode"} 1`)
	if n := encs[0].Stats().Routes["/encode"]; n != 1 {
		t.Fatalf("the encoder received %d /encode, want the normal one only", n)
	}
}

// read_header_timeout bounds the headers only: a body that takes longer
// than it is still read (under read_timeout), and a body that stops coming
// is cut at read_timeout.
func TestBodyGetsReadTimeoutNotReadHeaderTimeout(t *testing.T) {
	const headerTimeout = 100 * time.Millisecond
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Limits.ReadHeaderTimeout = configfile.Duration(headerTimeout)
		c.Limits.ReadTimeout = configfile.Duration(time.Second)
	})
	body := encodeBody("slowbody_local_part_0")
	head := "POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: " +
		strconv.Itoa(len(body)) + "\r\n\r\n"

	t.Run("a slow body is read", func(t *testing.T) {
		resp, got := rawExchange(t, g.Addr(), head+body[:10], func(w io.Writer) error {
			time.Sleep(3 * headerTimeout) // the condition under test: the body outlives read_header_timeout
			_, err := io.WriteString(w, body[10:])
			return err
		})
		if resp.StatusCode != 200 || !strings.Contains(got, `"req_id":"slowbody_local_part_0"`) {
			t.Fatalf("%d %s", resp.StatusCode, got)
		}
	})
	t.Run("a body that stops is cut at read_timeout", func(t *testing.T) {
		c, err := net.Dial("tcp", g.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := io.WriteString(c, head+body[:10]); err != nil {
			t.Fatal(err)
		}
		got, _ := parseAnswer(t, readToClose(t, c))
		wantEnvelopeMsg(t, got, http.StatusRequestTimeout, fmt.Sprintf(wantTimeoutMsg, "100ms", "1s"), nil)
	})
	if n := encs[0].Stats().Routes["/encode"]; n != 1 {
		t.Fatalf("the encoder received %d /encode, want the whole one only", n)
	}
}

func TestIdleKeepAliveConnectionIsClosed(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Limits.IdleTimeout = configfile.Duration(100 * time.Millisecond)
	})
	c, err := net.Dial("tcp", g.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, "GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	got, resp := parseAnswer(t, readToClose(t, c))
	if got.status != 200 || resp.Close {
		t.Fatalf("GET /health: %d close=%v", got.status, resp.Close)
	}
	eventually(t, "the idle connection to be counted closed", func() bool {
		return metricValue(t, g, "encgate_connections_open") == 0
	})
}

func TestOversizedHeaderIs431(t *testing.T) {
	encs := startFakes(t, 1, nil) // limits.max_header_bytes 64KiB
	g := startGateway(t, fakeURLs(encs), nil)
	exchange := func(headerBytes int, id string) (*http.Response, string) {
		body := encodeBody(id)
		head := "POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: " +
			strconv.Itoa(len(body)) + "\r\nX-Big: "
		return rawExchange(t, g.Addr(), head, func(w io.Writer) error {
			if _, err := io.WriteString(w, strings.Repeat("a", headerBytes)+"\r\n\r\n"+body); err != nil && headerBytes < 64<<10 {
				return err
			}
			return nil
		})
	}
	// fasthttp's default read buffer (4KiB) would refuse this one.
	if resp, body := exchange(48<<10, "bighead_local_part_0"); resp.StatusCode != 200 {
		t.Fatalf("a 48KiB header: %d %s", resp.StatusCode, body)
	}
	resp, body := exchange(100<<10, "hugehead_local_part_0")
	wantEnvelopeMsg(t, answer{resp.StatusCode, resp.Header, body}, http.StatusRequestHeaderFieldsTooLarge,
		"encgate: request line and headers exceed limits.max_header_bytes (64KiB)", nil)
	if !resp.Close {
		t.Error("the 431 does not say Connection: close")
	}
	if n := encs[0].Stats().Routes["/encode"]; n != 1 {
		t.Fatalf("the encoder received %d /encode, want 1", n)
	}
	wantLines(t, scrape(t, g), `encgate_requests_total{code="431",route="unknown"} 1`)
}

// With limits.max_conns open connections, one more is answered with a 503
// envelope and closed (the listener refuses it; fasthttp's own refusal is
// plain text); once one closes, a new connection is served.
func TestMaxConnsRefusesWithA503Envelope(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Limits.MaxConns = 2 })
	dial := func() net.Conn {
		t.Helper()
		c, err := net.Dial("tcp", g.Addr())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	a, b := dial(), dial()
	eventually(t, "two connections open", func() bool {
		return metricValue(t, g, "encgate_connections_open") == 2
	})
	const wantMsg = "encgate: too many connections (limits.max_conns is 2); try again later"
	check := func(raw []byte) {
		t.Helper()
		got, resp := parseAnswer(t, raw)
		wantEnvelopeMsg(t, got, http.StatusServiceUnavailable, wantMsg, nil)
		if !resp.Close || got.header.Get("Retry-After") != "1" {
			t.Errorf("refusal headers %v", got.header)
		}
	}
	check(readToClose(t, dial())) // a client that waits for the server first
	c := dial()                   // a client that sends its request at once
	if _, err := io.WriteString(c, "POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}"); err != nil {
		t.Fatal(err)
	}
	check(readToClose(t, c))
	wantLines(t, scrape(t, g), "encgate_connections_rejected_total 2", "encgate_connections_open 2")

	// The two open connections are served as usual.
	if _, err := io.WriteString(a, "GET /health HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	if got, _ := parseAnswer(t, readToClose(t, a)); got.status != 200 {
		t.Fatalf("GET /health on an open connection: %d %s", got.status, got.body)
	}
	b.Close()
	eventually(t, "both connections closed", func() bool {
		return metricValue(t, g, "encgate_connections_open") == 0
	})
	if got := post(t, g.base+"/encode", encodeBody("after_local_part_0")); got.status != 200 {
		t.Fatalf("/encode after the refusals: %d %s", got.status, got.body)
	}
	if n := encs[0].Stats().Routes["/encode"]; n != 1 {
		t.Fatalf("the encoder received %d /encode, want 1", n)
	}
}

// holdingFakes starts n fakes; enc-0's /encode waits in its hook until
// release is closed, announcing each req_id on arrived.
func holdingFakes(t *testing.T, n int) (encs []*fakeencoder.Encoder, arrived chan string, release func()) {
	t.Helper()
	arrived = make(chan string, 64)
	ch := make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(ch) }) }
	encs = startFakes(t, n, func(i int, o *fakeencoder.Options) {
		if i == 0 {
			o.EncodeHook = func(ctx context.Context, id string) {
				arrived <- id
				select {
				case <-ch:
				case <-ctx.Done():
				}
			}
		}
	})
	t.Cleanup(release) // before the fakes close, if the test fails early
	return encs, arrived, release
}

type result struct {
	a   answer
	err error
}

// postAsync posts body to url in the background.
func postAsync(url, body string) <-chan result {
	out := make(chan result, 1)
	go func() {
		a, err := tryDo(http.MethodPost, url, body)
		out <- result{a, err}
	}()
	return out
}

// With limits.max_inflight_per_encoder exchanges held by an encoder, one
// more gets a 503 envelope at once, naming the encoder and the limit, and
// is never sent; refusals are counted, do not trip the breaker, and a
// reload changes the limit at once.
func TestMaxInflightPerEncoderRefusesAtOnce(t *testing.T) {
	encs, arrived, release := holdingFakes(t, 1)
	g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Limits.MaxInflightPerEncoder = 2 })
	var held []<-chan result
	for i := 0; i < 2; i++ {
		held = append(held, postAsync(g.base+"/encode", encodeBody(fmt.Sprintf("held-%d_local_part_0", i))))
		<-arrived
	}
	// More refusals than breaker.consecutive_failures (5).
	for i := 0; i < 7; i++ {
		id := fmt.Sprintf("over-%d_local_part_0", i)
		a := post(t, g.base+"/encode", encodeBody(id))
		wantEnvelopeMsg(t, a, http.StatusServiceUnavailable,
			"encgate: encoder enc-0 already has 2 requests in flight (limits.max_inflight_per_encoder); try again later", &id)
	}
	if n := encs[0].Stats().Routes["/encode"]; n != 2 {
		t.Fatalf("the encoder received %d /encode, want the 2 held", n)
	}
	e := g.Pool().Encoders()[0]
	if st, bc := e.Breaker.State(), e.Breaker.Counts(); st != upstream.BreakerClosed || bc.TotalFailures != 0 {
		t.Fatalf("refusals reached the breaker: %v %+v", st, bc)
	}
	if e.Inflight() != 2 {
		t.Fatalf("inflight %d, want 2", e.Inflight())
	}
	wantLines(t, scrape(t, g),
		`encgate_upstream_refused_total{encoder="enc-0",reason="max_inflight"} 7`,
		`encgate_upstream_refused_total{encoder="enc-0",reason="max_conns"} 0`,
		`encgate_upstream_requests_total{code="refused",encoder="enc-0",route="encode"} 7`,
		`encgate_requests_total{code="503",route="encode"} 7`,
	)

	next := nextConfig(g)
	next.Limits.MaxInflightPerEncoder = 3
	if err := g.Reload(next); err != nil {
		t.Fatal(err)
	}
	held = append(held, postAsync(g.base+"/encode", encodeBody("held-2_local_part_0")))
	if id := <-arrived; id != "held-2_local_part_0" {
		t.Fatalf("the encoder got %q", id)
	}
	release()
	for i, ch := range held {
		r := <-ch
		if r.err != nil || r.a.status != 200 {
			t.Fatalf("held /encode %d: %v %d %s", i, r.err, r.a.status, r.a.body)
		}
	}
	if a := post(t, g.base+"/encode", encodeBody("after_local_part_0")); a.status != 200 {
		t.Fatalf("/encode after the release: %d %s", a.status, a.body)
	}
}

// A refused /encode is nothing delivered, so its retry policy
// (connect_failure) sends it to the next encoder in rendezvous order.
func TestMaxInflightSendsEncodeToTheNextEncoder(t *testing.T) {
	encs, arrived, release := holdingFakes(t, 2)
	g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Limits.MaxInflightPerEncoder = 1 })
	held := postAsync(g.base+"/encode", encodeBody(ownedBy(t, g, "enc-0", "held")))
	<-arrived
	id := ownedBy(t, g, "enc-0", "moved")
	a := post(t, g.base+"/encode", encodeBody(id))
	if a.status != 200 || a.header.Get("X-Encgate-Encoder") != "enc-1" || a.header.Get("X-Encgate-Attempts") != "2" {
		t.Fatalf("/encode owned by the full enc-0: %d encoder=%q attempts=%q %s", a.status,
			a.header.Get("X-Encgate-Encoder"), a.header.Get("X-Encgate-Attempts"), a.body)
	}
	if m := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id)); m.status != 200 ||
		m.header.Get("X-Encgate-Encoder") != "enc-1" {
		t.Fatalf("its follow-up: %d %q %s", m.status, m.header.Get("X-Encgate-Encoder"), m.body)
	}
	wantLines(t, scrape(t, g), `encgate_retries_total{reason="connect_failure",route="encode"} 1`)
	release()
	if r := <-held; r.err != nil || r.a.status != 200 {
		t.Fatalf("held /encode: %v %+v", r.err, r.a)
	}
}

const adminToken = "s3cret-admin-token_0123456789"

// With admin.token set, /admin/... and /debug/pprof/... need the bearer
// token; /healthz, /readyz and /metrics stay open; a reload changes it.
func TestAdminTokenProtectsAdminRoutes(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Admin.Token = adminToken })
	get := func(path, authorization string) answer {
		t.Helper()
		req, err := http.NewRequest(http.MethodGet, g.admin+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		if authorization != "" {
			req.Header.Set("Authorization", authorization)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return answer{resp.StatusCode, resp.Header, string(b)}
	}
	refused := func(a answer, challenge, msg string) {
		t.Helper()
		wantEnvelopeMsg(t, a, http.StatusUnauthorized, msg, nil)
		if got := a.header.Get("WWW-Authenticate"); got != challenge {
			t.Errorf("WWW-Authenticate %q, want %q", got, challenge)
		}
	}
	const missing = `encgate: this admin route needs "Authorization: Bearer <admin.token>"`
	const wrong = "encgate: the bearer token is not admin.token"
	for _, path := range []string{"/admin/upstreams", "/admin/sends/x_local_part_0", "/debug/pprof/", "/debug/pprof/cmdline"} {
		refused(get(path, ""), `Bearer realm="encgate admin"`, missing)
		refused(get(path, "Basic "+adminToken), `Bearer realm="encgate admin"`, missing)
		refused(get(path, "Bearer "), `Bearer realm="encgate admin"`, missing)
		refused(get(path, "Bearer "+adminToken[:len(adminToken)-1]), `Bearer realm="encgate admin", error="invalid_token"`, wrong)
		refused(get(path, "Bearer "+adminToken+"x"), `Bearer realm="encgate admin", error="invalid_token"`, wrong)
		for _, auth := range []string{"Bearer " + adminToken, "bearer " + adminToken} {
			if a := get(path, auth); a.status != 200 {
				t.Errorf("%s with %q: %d %s", path, auth[:7], a.status, a.body)
			}
		}
	}
	for _, path := range []string{"/healthz", "/readyz", "/metrics"} {
		if a := get(path, ""); a.status != 200 {
			t.Errorf("%s without a token: %d %s", path, a.status, a.body)
		}
	}
	wantLines(t, scrape(t, g), "encgate_admin_unauthorized_total 20")

	next := nextConfig(g)
	next.Admin.Token = adminToken + "-rotated"
	if err := g.Reload(next); err != nil {
		t.Fatal(err)
	}
	refused(get("/admin/upstreams", "Bearer "+adminToken), `Bearer realm="encgate admin", error="invalid_token"`, wrong)
	if a := get("/admin/upstreams", "Bearer "+adminToken+"-rotated"); a.status != 200 {
		t.Fatalf("the rotated token: %d %s", a.status, a.body)
	}
	next.Admin.Token = ""
	if err := g.Reload(next); err != nil {
		t.Fatal(err)
	}
	if a := get("/admin/upstreams", ""); a.status != 200 {
		t.Fatalf("no token configured: %d %s", a.status, a.body)
	}
}

// Shutdown goes not-ready first and keeps serving through shutdown.delay
// (on the injected clock, so the order is certain), with every answer
// closing its connection; only then does the listener close.
func TestShutdownGoesNotReadyBeforeClosingTheListener(t *testing.T) {
	encs := startFakes(t, 1, nil)
	clk := clock.NewFake(time.Unix(1_800_000_000, 0))
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Encoders = []upstream.EncoderConfig{{Name: "enc-0", URL: encs[0].URL()}}
	cfg.Shutdown.Delay = configfile.Duration(5 * time.Second)
	s, err := New(cfg, Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry(), Clock: clk, Rand: func() float64 { return 0 }})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	shutDown := false
	t.Cleanup(func() { // a test that failed before its Shutdown
		if !shutDown {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			_ = s.Shutdown(ctx)
		}
	})
	base, admin := "http://"+s.Addr(), "http://"+s.AdminAddr()
	keepAlive := &http.Client{Transport: &http.Transport{}}
	defer keepAlive.CloseIdleConnections()
	postWith := func(c *http.Client, id string) *http.Response {
		t.Helper()
		resp, err := c.Post(base+"/encode", "application/json", strings.NewReader(encodeBody(id)))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	if r := postWith(keepAlive, "before_local_part_0"); r.StatusCode != 200 || r.Close {
		t.Fatalf("before: %d close=%v", r.StatusCode, r.Close)
	}

	shut := make(chan error, 1)
	shutDown = true
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		shut <- s.Shutdown(ctx)
	}()
	eventually(t, "/readyz to answer 503", func() bool {
		a, err := tryDo(http.MethodGet, admin+"/readyz", "")
		return err == nil && a.status == http.StatusServiceUnavailable
	})
	// The fake clock has not moved: the delay cannot have ended.
	for i, c := range []*http.Client{keepAlive, {Transport: &http.Transport{}}} {
		r := postWith(c, fmt.Sprintf("during-%d_local_part_0", i))
		if r.StatusCode != 200 || !r.Close {
			t.Fatalf("request %d during the delay: %d close=%v; want 200 closing its connection", i, r.StatusCode, r.Close)
		}
	}
	select {
	case err := <-shut:
		t.Fatalf("Shutdown returned (%v) before its delay", err)
	default:
	}

	eventually(t, "the listener to close once the delay is over", func() bool {
		clk.Advance(time.Second)
		c, err := net.Dial("tcp", s.Addr())
		if err != nil {
			return errors.Is(err, syscall.ECONNREFUSED)
		}
		c.Close()
		return false
	})
	if err := <-shut; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if n := encs[0].Stats().Routes["/encode"]; n != 3 {
		t.Fatalf("the encoder received %d /encode, want 3", n)
	}
}

// Metadata pulls held at an encoder for req_ids never encoded (a confused
// or restarted rank, or anyone) fill only limits.poll_share of
// limits.max_inflight_per_encoder: the pulls past that share are refused at
// once with a 503 naming it, and an encoded part's /encode, metadata pull
// and /send still go through on the reserved rest. A held pull answered
// frees its place for the next long poll. Real sockets throughout: the
// gateway in front of a fake encoder that holds each pull until its part
// is encoded.
func TestLongPollLimitLeavesTheReserveToCompletingCalls(t *testing.T) {
	const total, held = 32, 24 // held: floor(limits.poll_share 0.75 × 32)
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Limits.MaxInflightPerEncoder = total
		// A pull for a req_id without a pin waits affinity.unknown_wait for
		// one before going to the rendezvous owner, classed a long poll
		// either way: no waiting needed here.
		c.Affinity.UnknownWait = 0
		// One attempt per pull: a refused pull's retries (the default
		// policy retries connect_failure, on the same encoder, the pull's
		// state being there) would only be refused again while the others
		// are held, and each attempt would count.
		c.Retry.Metadata.MaxAttempts = 1
	})
	e := g.Pool().Encoders()[0]
	waiting := func() int { return encs[0].Stats().Waiting[fakeencoder.RouteMetadata] }

	// total pulls for never-encoded req_ids, all at once.
	pulls := map[string]<-chan result{}
	for i := 0; i < total; i++ {
		id := fmt.Sprintf("never-%d_local_part_0", i)
		pulls[id] = postAsync(g.base+"/scheduler_receive_meta_data", metaBody(id))
	}
	// Each is either held by the encoder or answered by the gateway.
	answered := map[string]result{}
	collect := func() {
		for id, ch := range pulls {
			select {
			case r := <-ch:
				answered[id] = r
				delete(pulls, id)
			default:
			}
		}
	}
	eventually(t, "every pull held by the encoder or answered", func() bool {
		collect()
		return waiting()+len(answered) == total
	})
	t.Logf("max_inflight_per_encoder %d, poll_share 0.75: %d pulls held at the encoder, %d answered at once; gateway: %d in flight, %d long polls",
		total, waiting(), len(answered), e.Inflight(), e.Polls())
	if waiting() != held || len(pulls) != held || e.Polls() != held || e.Inflight() != held {
		t.Fatalf("%d pulls held at the encoder (%d unanswered), gateway counts %d long polls of %d in flight; want %d",
			waiting(), len(pulls), e.Polls(), e.Inflight(), held)
	}
	const pollMsg = "encgate: encoder enc-0 already holds 24 long polls (metadata pulls and registrations of parts not yet encoded; " +
		"limits.poll_share 0.75 of limits.max_inflight_per_encoder 32); try again later"
	for id, r := range answered {
		if r.err != nil {
			t.Fatalf("pull %s: %v", id, r.err)
		}
		wantEnvelopeMsg(t, r.a, http.StatusServiceUnavailable, pollMsg, &id)
	}

	// A part encoded now: its /encode, its pull and its /send each take a
	// place in the reserve.
	part := "good_local_part_0"
	for _, c := range []struct{ path, body string }{
		{"/encode", encodeBody(part)},
		{"/scheduler_receive_meta_data", metaBody(part)},
		{"/send", sendBody(part, 40000)},
	} {
		a := post(t, g.base+c.path, c.body)
		t.Logf("%s of %s beside %d held pulls: %d", c.path, part, e.Polls(), a.status)
		if a.status != 200 {
			t.Fatalf("%s of the encoded part: %d %s", c.path, a.status, a.body)
		}
	}
	var rows []upstream.EncoderState
	if a := do(t, http.MethodGet, g.admin+"/admin/upstreams", ""); json.Unmarshal([]byte(a.body), &rows) != nil ||
		len(rows) != 1 || rows[0].Inflight != held || rows[0].Polls != held {
		t.Errorf("/admin/upstreams does not show %d long polls of %d in flight: %s", held, held, a.body)
	}
	wantLines(t, scrape(t, g),
		`encgate_upstream_refused_total{encoder="enc-0",reason="poll_share"} 8`,
		`encgate_upstream_refused_total{encoder="enc-0",reason="max_inflight"} 0`,
		`encgate_upstream_polls_inflight{encoder="enc-0"} 24`,
		`encgate_upstream_requests_total{code="refused",encoder="enc-0",route="metadata"} 8`,
	)

	// One held pull answered (its part encoded) frees a place: the next
	// pull for a never-encoded req_id is held, and the one after refused.
	var freed string
	for id := range pulls {
		freed = id
		break
	}
	if a := post(t, g.base+"/encode", encodeBody(freed)); a.status != 200 {
		t.Fatalf("/encode %s: %d %s", freed, a.status, a.body)
	}
	if r := <-pulls[freed]; r.err != nil || r.a.status != 200 {
		t.Fatalf("the held pull of %s once encoded: %v %d %s", freed, r.err, r.a.status, r.a.body)
	}
	delete(pulls, freed)
	eventually(t, "the answered pull to leave the count", func() bool { return e.Polls() == held-1 })
	next := "never-next_local_part_0"
	pulls[next] = postAsync(g.base+"/scheduler_receive_meta_data", metaBody(next))
	eventually(t, "the next pull to be held", func() bool { return waiting() == held })
	over := "never-over_local_part_0"
	wantEnvelopeMsg(t, post(t, g.base+"/scheduler_receive_meta_data", metaBody(over)), http.StatusServiceUnavailable, pollMsg, &over)

	// A reload changes the share at once: 0.8 of 32 is 25, so the pull
	// just refused is held when it comes again.
	cfg := nextConfig(g)
	cfg.Limits.PollShare = 0.8
	if err := g.Reload(cfg); err != nil {
		t.Fatal(err)
	}
	pulls[over] = postAsync(g.base+"/scheduler_receive_meta_data", metaBody(over))
	eventually(t, "the pull to be held under the reloaded share", func() bool { return waiting() == held+1 })
	if e.Polls() != held+1 {
		t.Fatalf("%d long polls after the reload, want %d", e.Polls(), held+1)
	}

	// Release: every held pull is answered 200 once its part is encoded.
	for id, ch := range pulls {
		if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 {
			t.Fatalf("/encode %s: %d %s", id, a.status, a.body)
		}
		if r := <-ch; r.err != nil || r.a.status != 200 {
			t.Fatalf("the held pull of %s once encoded: %v %d %s", id, r.err, r.a.status, r.a.body)
		}
	}
	eventually(t, "no long poll left", func() bool { return e.Polls() == 0 && e.Inflight() == 0 })
}
