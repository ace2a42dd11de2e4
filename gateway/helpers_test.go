package gateway

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"go.uber.org/zap"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/upstream"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// net/http's client keeps idle connections' readers until they time out.
		goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
		// fasthttp's own sleepers: a process-wide Date updater, and cleaners
		// that exit by themselves within MaxIdleWorkerDuration (10s) of Stop
		// or once a client holds no connection.
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"),
		goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*HostClient).connsCleaner"),
	)
}

// startFakes starts n fake encoders named enc-0..enc-(n-1).
func startFakes(t *testing.T, n int, mutate func(i int, o *fakeencoder.Options)) []*fakeencoder.Encoder {
	t.Helper()
	var out []*fakeencoder.Encoder
	for i := 0; i < n; i++ {
		o := fakeencoder.Options{Name: "enc-" + string(rune('0'+i)), Mode: fakeencoder.ModeMooncake}
		if mutate != nil {
			mutate(i, &o)
		}
		e := fakeencoder.New(o)
		if err := e.Start("127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = e.Close() })
		out = append(out, e)
	}
	return out
}

type gw struct {
	*Server
	base  string
	admin string
	reg   *prometheus.Registry
}

// startGateway runs a gateway in front of the given encoder URLs.
func startGateway(t *testing.T, urls []string, mutate func(*Config)) *gw {
	t.Helper()
	return startGatewayWith(t, urls, mutate, zap.NewNop())
}

// startGatewayWith is startGateway with the given logger.
func startGatewayWith(t *testing.T, urls []string, mutate func(*Config), log *zap.Logger) *gw {
	t.Helper()
	return startGatewayDeps(t, urls, mutate, log, nil)
}

// startGatewayDeps is startGateway with the logger and clock (nil: the wall
// clock) given.
func startGatewayDeps(t testing.TB, urls []string, mutate func(*Config), log *zap.Logger, clk clock.Clock) *gw {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	for i, u := range urls {
		cfg.Encoders = append(cfg.Encoders, upstream.EncoderConfig{Name: "enc-" + string(rune('0'+i)), URL: u})
	}
	if mutate != nil {
		mutate(&cfg)
	}
	return serveGateway(t, cfg, log, clk)
}

// serveGateway starts a gateway with cfg and stops it at cleanup. Backoff
// jitter is zero: full-jitter backoff waits 0, so retries need no sleeping.
func serveGateway(t testing.TB, cfg Config, log *zap.Logger, clk clock.Clock) *gw {
	t.Helper()
	return serveGatewayDeps(t, cfg, Deps{Log: log, Clock: clk})
}

// serveGatewayDeps is serveGateway with deps (Registry is always a fresh
// one; Rand is zero jitter unless deps has one).
func serveGatewayDeps(t testing.TB, cfg Config, deps Deps) *gw {
	t.Helper()
	reg := prometheus.NewRegistry()
	deps.Registry = reg
	if deps.Rand == nil {
		deps.Rand = func() float64 { return 0 }
	}
	s, err := New(cfg, deps)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.Shutdown(ctx)
	})
	return &gw{Server: s, base: "http://" + s.Addr(), admin: "http://" + s.AdminAddr(), reg: reg}
}

func fakeURLs(encs []*fakeencoder.Encoder) []string {
	var out []string
	for _, e := range encs {
		out = append(out, e.URL())
	}
	return out
}

type answer struct {
	status int
	header http.Header
	body   string
}

var client = &http.Client{Timeout: 30 * time.Second}

func do(t *testing.T, method, url, body string) answer {
	t.Helper()
	return doWith(t, method, url, body, nil)
}

// doWith is do with extra request headers.
func doWith(t *testing.T, method, url, body string, header http.Header) answer {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header, string(b)}
}

func post(t *testing.T, url, body string) answer { return do(t, http.MethodPost, url, body) }

// eventually polls cond (a state the test is waiting for) until it holds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// scripted is a real HTTP server that records what it receives and answers
// each path with a fixed status, content type (nil = none) and body.
type scripted struct {
	*httptest.Server
	mu       sync.Mutex
	bodies   map[string][]string
	headers  map[string]http.Header
	answers  map[string]scriptedAnswer
	fallback scriptedAnswer
}

type scriptedAnswer struct {
	status      int
	contentType *string
	body        string
}

func ct(s string) *string { return &s }

func newScripted(t *testing.T) *scripted {
	s := &scripted{bodies: map[string][]string{}, headers: map[string]http.Header{},
		answers: map[string]scriptedAnswer{}, fallback: scriptedAnswer{200, ct("application/json"), "null"}}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		s.bodies[r.URL.Path] = append(s.bodies[r.URL.Path], string(b))
		s.headers[r.URL.Path] = r.Header.Clone()
		a, ok := s.answers[r.URL.Path]
		if !ok {
			a = s.fallback
		}
		s.mu.Unlock()
		if a.contentType == nil {
			w.Header()["Content-Type"] = nil // suppress net/http's sniffing
		} else {
			w.Header().Set("Content-Type", *a.contentType)
		}
		w.WriteHeader(a.status)
		_, _ = io.WriteString(w, a.body)
	}))
	t.Cleanup(s.Close)
	return s
}

func (s *scripted) answer(path string, a scriptedAnswer) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.answers[path] = a
}

func (s *scripted) received(path string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.bodies[path]...)
}

// deadAddr returns a loopback address on which connections are refused.
// Its port stays bound until the test ends, by a socket that never listens
// and has no SO_REUSEADDR, so that no listener started meanwhile (this
// test's, or another package's running beside it: Go binds with
// SO_REUSEADDR) can be given the same port and answer. CI once saw a port
// freed by listen-and-close answered by another listener, which turned a
// refused connect into a closed connection.
func deadAddr(t *testing.T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("127.0.0.1:%d", sa.(*syscall.SockaddrInet4).Port)
}
