package gateway

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/admin"
	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/listener"
)

// testBound is how long a test waits for the gateway to do what it must do
// at once or after a timeout of a fraction of a second; reaching it is a
// failure, never a pass. It is below the admin listener's old fixed
// 10s header timeout, so that a gateway without admin.read_timeout fails.
const testBound = 5 * time.Second

func dialAdmin(t *testing.T, g *gw) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(g.admin, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(testBound))
	return c
}

// untilClosed reads r (a connection with a deadline of testBound) until
// the gateway closes it and returns what came.
func untilClosed(t *testing.T, r io.Reader, what string) string {
	t.Helper()
	b, err := io.ReadAll(r)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("%s: the connection was still open after %v; got %q", what, testBound, b)
	}
	if err != nil && !errors.Is(err, net.ErrClosed) && !strings.Contains(err.Error(), "connection reset") {
		t.Fatalf("%s: %v after %q", what, err, b)
	}
	return string(b)
}

// With admin.max_conns open, the next admin connection is answered 503
// with the envelope naming the limit and closed, without waiting for a
// request; once one closes, admin requests are served again.
func TestAdminMaxConnsRefusesTheOneTooManyWithA503(t *testing.T) {
	g := startGateway(t, fakeURLs(startFakes(t, 1, nil)), func(c *Config) {
		c.Admin.MaxConns = 2
		c.Admin.ReadTimeout = configfile.Duration(time.Hour) // the idle ones stay open
	})
	held := []net.Conn{dialAdmin(t, g), dialAdmin(t, g)}
	// The admin listener takes connections in order, so these two are
	// counted before the third.
	third := dialAdmin(t, g)
	got := untilClosed(t, third, "the connection past admin.max_conns")
	if !strings.HasPrefix(got, "HTTP/1.1 503 Service Unavailable\r\n") || !strings.Contains(got, "Retry-After: 1\r\n") ||
		!strings.Contains(got, `"message":"encgate: too many admin connections (admin.max_conns is 2); try again later"`) {
		t.Fatalf("the connection past admin.max_conns got %q, want a 503 envelope naming admin.max_conns", got)
	}
	if n := seriesValue(t, g, "encgate_admin_connections_rejected_total"); n != 1 {
		t.Errorf("encgate_admin_connections_rejected_total = %v, want 1", n)
	}
	if n := seriesValue(t, g, "encgate_admin_connections_open"); n != 2 {
		t.Errorf("encgate_admin_connections_open = %v, want 2", n)
	}
	// The encoder-facing listener has its own limit: it is unaffected.
	if a := do(t, http.MethodGet, g.base+"/health", ""); a.status != http.StatusOK {
		t.Errorf("encoder-facing /health while the admin listener is full: %d %s", a.status, a.body)
	}

	_ = held[0].Close()
	eventually(t, "the closed admin connection to be counted", func() bool {
		return seriesValue(t, g, "encgate_admin_connections_open") == 1
	})
	c := dialAdmin(t, g)
	if _, err := io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	if got := untilClosed(t, c, "an admin request below the limit"); !strings.HasPrefix(got, "HTTP/1.1 200 OK\r\n") {
		t.Fatalf("an admin request below the limit got %q", got)
	}
}

// A keep-alive admin connection is closed after admin.idle_timeout without
// a request.
func TestAdminIdleConnectionIsClosedAtIdleTimeout(t *testing.T) {
	g := startGateway(t, fakeURLs(startFakes(t, 1, nil)), func(c *Config) {
		c.Admin.IdleTimeout = configfile.Duration(200 * time.Millisecond)
		c.Admin.ReadTimeout = configfile.Duration(time.Hour)
	})
	c := dialAdmin(t, g)
	if _, err := io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Close {
		t.Fatalf("/healthz: %d, close %v; want a kept-alive 200", resp.StatusCode, resp.Close)
	}
	if rest := untilClosed(t, br, "an idle keep-alive admin connection"); rest != "" {
		t.Fatalf("the idle connection got %q before its close", rest)
	}
	eventually(t, "the idle admin connection to be counted closed", func() bool {
		return seriesValue(t, g, "encgate_admin_connections_open") == 0
	})
}

// An admin request whose headers do not all come is cut at
// admin.read_timeout: the connection is closed.
func TestAdminSlowRequestIsCutAtReadTimeout(t *testing.T) {
	g := startGateway(t, fakeURLs(startFakes(t, 1, nil)), func(c *Config) {
		c.Admin.ReadTimeout = configfile.Duration(200 * time.Millisecond)
		c.Admin.IdleTimeout = configfile.Duration(time.Hour)
	})
	c := dialAdmin(t, g)
	if _, err := io.WriteString(c, "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: "); err != nil {
		t.Fatal(err)
	}
	if got := untilClosed(t, c, "a slow admin request"); got != "" {
		t.Fatalf("a slow admin request got %q, want the connection closed", got)
	}
	eventually(t, "the cut admin connection to be counted closed", func() bool {
		return seriesValue(t, g, "encgate_admin_connections_open") == 0
	})
}

// admin.read_timeout bounds reading a request, not running it: a handler
// that runs past it (a 30-second CPU profile does) keeps its context. This
// is net/http's own behaviour (it lifts the read deadline once a request is
// read), which the choice of ReadTimeout for admin.read_timeout relies on.
// The signal that read_timeout has passed for the long request is a second
// connection, opened after the long request began, being cut by it.
func TestAdminReadTimeoutDoesNotCutALongHandler(t *testing.T) {
	started, release := make(chan struct{}), make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/long" {
			return
		}
		close(started)
		select {
		case <-release:
			_, _ = io.WriteString(w, "done")
		case <-r.Context().Done():
			_, _ = io.WriteString(w, "canceled")
		}
	})
	cfg := DefaultConfig().Admin
	cfg.ReadTimeout = configfile.Duration(200 * time.Millisecond)
	conns := listener.NewLimiter(listener.Options{Name: "admin", Max: 8, Linger: 1, Key: "admin.max_conns", What: "admin connections", One: "admin connection",
		Counter: "c"}, clock.Real{}, zap.NewNop(), listener.NewAcceptErrors(prometheus.NewRegistry()))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	conns.Listener = ln
	srv := admin.NewServer(cfg, h, conns, zap.NewNop())
	go func() { _ = srv.Serve(conns) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), testBound)
		defer cancel()
		_ = srv.Shutdown(ctx)
	})

	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	long := make(chan string, 1)
	go func() {
		resp, err := client.Get("http://" + ln.Addr().String() + "/long")
		if err != nil {
			long <- err.Error()
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		long <- string(b)
	}()
	<-started
	slow, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	_ = slow.SetDeadline(time.Now().Add(testBound))
	if _, err := io.WriteString(slow, "GET /other HTTP/1.1\r\n"); err != nil {
		t.Fatal(err)
	}
	if got := untilClosed(t, slow, "a request slower than admin.read_timeout"); got != "" {
		t.Fatalf("the slow request got %q", got)
	}
	close(release)
	if got := <-long; got != "done" {
		t.Fatalf("the long handler's answer: %q, want done (its context was canceled at admin.read_timeout)", got)
	}
}

// The admin section's bounds are validated with their field paths, and a
// reload keeps them (they need a restart) while it applies a new token.
func TestAdminBoundsAreValidatedAndNeedARestart(t *testing.T) {
	for _, tc := range []struct {
		mutate func(*admin.Config)
		want   string
	}{
		{func(a *admin.Config) { a.MaxConns = 0 }, "admin.max_conns: must be between 1 and 65536, got 0"},
		{func(a *admin.Config) { a.MaxConns = 1 << 20 }, "admin.max_conns: must be between 1 and 65536, got 1048576"},
		{func(a *admin.Config) { a.ReadTimeout = 0 }, "admin.read_timeout: must be > 0"},
		{func(a *admin.Config) { a.IdleTimeout = -1 }, "admin.idle_timeout: must be > 0"},
	} {
		c := validConfig()
		tc.mutate(&c.Admin)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Validate: %v, want %q", err, tc.want)
		}
	}

	g := startGateway(t, fakeURLs(startFakes(t, 1, nil)), nil)
	next := *g.conf()
	next.Admin.MaxConns, next.Admin.IdleTimeout = 3, configfile.Duration(time.Second)
	next.Admin.Token = "0123456789abcdef"
	if err := g.Reload(next); err != nil {
		t.Fatal(err)
	}
	if a := g.conf().Admin; a.MaxConns != admin.DefaultMaxConns || a.IdleTimeout != DefaultConfig().Admin.IdleTimeout || a.Token != next.Admin.Token {
		t.Errorf("admin section after a reload: %+v, want the bounds kept and the token applied", a)
	}
}
