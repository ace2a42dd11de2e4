//go:build linux

package gateway

import (
	"context"
	"errors"
	"net"
	"net/http"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/upstream"
)

// predialed hands out connections dialed before the descriptors ran out:
// a caller that needs a new one under exhaustion would fail in the test's
// own socket(2), which says nothing about the gateway (the test, the
// gateway and the encoders share one process and one descriptor table).
type predialed struct {
	mu    sync.Mutex
	conns []net.Conn
}

func (p *predialed) dial(context.Context, string, string) (net.Conn, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.conns) == 0 {
		return nil, errors.New("test: no pre-dialed connection left")
	}
	c := p.conns[0]
	p.conns = p.conns[1:]
	return c, nil
}

func (p *predialed) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
}

// exhaustion holds every descriptor the process may open: the soft limit is
// lowered to a little above what is open, and idle connections to both of
// the gateway's listeners take the rest.
type exhaustion struct {
	t     *testing.T
	old   syscall.Rlimit
	conns []net.Conn
	spare []*os.File
}

// exhaust runs the process out of descriptors, then makes each listener's
// accept meet EMFILE: a spare descriptor is freed and a connection dialed in
// its place, so that the gateway finds none left for it.
func exhaust(t *testing.T, g *gw) *exhaustion {
	t.Helper()
	ex := &exhaustion{t: t}
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &ex.old); err != nil {
		t.Fatal(err)
	}
	for range 8 {
		f, err := os.Open(os.DevNull)
		if err != nil {
			t.Fatal(err)
		}
		ex.spare = append(ex.spare, f)
	}
	lowered := syscall.Rlimit{Cur: uint64(openFDs() + 64), Max: ex.old.Max}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lowered); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ex.end)
	for i := 0; ; i++ {
		addr := g.Addr()
		if i%4 == 3 {
			addr = g.AdminAddr()
		}
		c, err := net.Dial("tcp", addr)
		if errors.Is(err, syscall.EMFILE) {
			break
		}
		if err != nil {
			t.Fatalf("filling the descriptor table: %v", err)
		}
		ex.conns = append(ex.conns, c)
	}
	for _, l := range [][2]string{{"main", g.Addr()}, {"admin", g.AdminAddr()}} {
		for len(ex.spare) > 0 && seriesValue(t, g, "encgate_accept_errors_total", "listener", l[0], "errno", "EMFILE") == 0 {
			_ = ex.spare[0].Close()
			ex.spare = ex.spare[1:]
			if c, err := net.Dial("tcp", l[1]); err == nil {
				ex.conns = append(ex.conns, c)
				eventually(t, l[0]+" listener's accept to meet EMFILE", func() bool {
					select {
					case err := <-g.Done():
						t.Fatalf("a listener stopped when descriptors ran out: %v", err)
					default:
					}
					return seriesValue(t, g, "encgate_accept_errors_total", "listener", l[0], "errno", "EMFILE") > 0
				})
			}
		}
		if seriesValue(t, g, "encgate_accept_errors_total", "listener", l[0], "errno", "EMFILE") == 0 {
			t.Fatalf("the %s listener never met EMFILE", l[0])
		}
	}
	return ex
}

// end gives every descriptor back and restores the limit.
func (ex *exhaustion) end() {
	for _, c := range ex.conns {
		_ = c.Close()
	}
	for _, f := range ex.spare {
		_ = f.Close()
	}
	ex.conns, ex.spare = nil, nil
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &ex.old); err != nil {
		ex.t.Errorf("restoring RLIMIT_NOFILE: %v", err)
	}
}

// TestChaosDescriptorExhaustion: the process runs out of descriptors, taken
// by idle connections to both listeners, while callers keep sending whole
// parts (/encode, metadata, /sends with duplicates) on the connections they
// have. The listeners wait EMFILE out instead of stopping; exchanges that
// need a new connection to an encoder fail to dial (nothing was sent, so a
// /send is not stored and may come again) and those that find a pooled one
// go through. No (req_id, destination) /send reaches an encoder twice,
// every caller is answered within its bound, and once descriptors are back
// new connections are served and the encoders take work again.
//
// It lowers the process's RLIMIT_NOFILE, so it must not run in parallel
// with other tests.
func TestChaosDescriptorExhaustion(t *testing.T) {
	chaosLeakCheck(t)
	c := newChaos(t, 3, func(cfg *Config) {
		// The idle connections that take the descriptors are held, not cut
		// or refused, for as long as the test needs.
		cfg.Limits.ReadHeaderTimeout = configfile.Duration(time.Minute)
		cfg.Admin.ReadTimeout = configfile.Duration(time.Minute)
		cfg.Admin.MaxConns = 4096
	}, nil)
	c.requireServed(c.wave(ids("fd-warm", 8)), nil) // pooled connections to every encoder
	back := map[string][]string{}                   // while every encoder is usable: ownership is the fleet's own
	for _, e := range c.encs {
		name := e.Stats().Name
		back[name] = c.owned("fd-back-"+name, name, 200)
	}

	pre := &predialed{}
	t.Cleanup(pre.close)
	for range 96 {
		conn, err := net.Dial("tcp", c.g.Addr())
		if err != nil {
			t.Fatal(err)
		}
		pre.conns = append(pre.conns, conn)
	}
	eventually(t, "the gateway to accept the callers' connections", func() bool {
		return seriesValue(t, c.g, "encgate_connections_open") >= 96
	})
	own := c.client
	tr := &http.Transport{DialContext: pre.dial, MaxIdleConnsPerHost: 96}
	c.client = &http.Client{Transport: tr}

	ex := exhaust(t, c.g)
	results := c.wave(ids("fd-exhausted", 8))
	statuses := map[int]int{}
	for _, r := range results {
		for _, s := range r.status {
			statuses[s]++
		}
	}
	select {
	case err := <-c.g.Done():
		t.Fatalf("a listener stopped under descriptor exhaustion: %v", err)
	default:
	}
	ex.end()
	tr.CloseIdleConnections()
	pre.close()
	c.client = own
	t.Logf("under exhaustion: statuses %v; accept errors: main %v, admin %v", statuses,
		seriesValue(t, c.g, "encgate_accept_errors_total", "listener", "main"),
		seriesValue(t, c.g, "encgate_accept_errors_total", "listener", "admin"))

	// Descriptors are back: new connections are served, and an encoder
	// whose breaker opened on the failed dials takes work again.
	for _, e := range c.encs {
		name := e.Stats().Name
		if c.transitions(name, upstream.BreakerClosed, upstream.BreakerOpen) > 0 {
			c.awaitReturn(name, back[name])
		}
	}
	c.requireServed(c.wave(ids("fd-after", 8)), nil)
	if a := do(t, http.MethodGet, c.g.admin+"/readyz", ""); a.status != http.StatusOK {
		t.Errorf("/readyz after the exhaustion: %d %s", a.status, a.body)
	}
	c.check()
}
