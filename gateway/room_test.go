package gateway

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/fleet"
	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/upstream"
)

// closedURLs returns n URLs of loopback ports that nothing listens on
// (deadAddr): a dial is refused at once, and no listener the test starts
// later (the live encoder) can take one of their ports and "register" as
// a dead URL.
func closedURLs(t *testing.T, n int) []string {
	t.Helper()
	var out []string
	for range n {
		out = append(out, "http://"+deadAddr(t))
	}
	return out
}

// Issue 26, must-show "dead weight": bootstrap.max_encoders 16, and a client
// keeps 16 closed-port URLs registered, registering each again every (fake)
// second, as a crash-looping or hostile registrant does. A healthy encoder
// that registers as sglang's does (retrying until its first 200, then never
// again) is in service within two TTLs: in the pool, usable, taking
// /encodes. It stays in while the dead URLs keep registering, which evict
// one another. The gateway runs on a fake clock, one health interval at a
// time, every loop parked on the clock before the next.
func TestDeadRegistrationsMakeRoomForALiveEncoder(t *testing.T) {
	const (
		max      = 16
		ttl      = 10 * time.Second
		interval = time.Second
	)
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Bootstrap.Listen = "127.0.0.1:0"
	cfg.Bootstrap.Insecure = true
	cfg.Bootstrap.MaxEncoders = max
	cfg.Bootstrap.TTL = configfile.Duration(ttl)
	cfg.Health = upstream.HealthConfig{Path: "/health", Interval: configfile.Duration(interval),
		Timeout: configfile.Duration(500 * time.Millisecond), DownAfter: 3, UpAfter: 2}
	cfg.Affinity.UnknownWait = 0
	g := serveGateway(t, cfg, zap.NewNop(), clk)
	boot := "http://" + g.BootstrapAddr()
	window := fleet.RoomWindow(cfg.Health)

	// Parked on the clock: a health loop per encoder in the pool, the pin
	// sweeper, the /send store's sweeper, the registry's Run and the
	// registration refresh; and the drain checks after a fleet change,
	// until a check finds nothing draining.
	const loops = 4
	settle := func() {
		t.Helper()
		eventually(t, "every loop parked on the clock", func() bool {
			n, p := loops+len(g.Pool().Encoders()), clk.Pending()
			return p == n || p == n+1
		})
	}
	register := func(u string) int {
		t.Helper()
		return post(t, boot+"/register_encoder_url", `{"url":"`+u+`"}`).status
	}
	dead := closedURLs(t, max)
	for _, u := range dead {
		if st := register(u); st != http.StatusOK {
			t.Fatalf("registering %s: %d", u, st)
		}
	}
	settle()
	start := clk.Now()
	live := startFakes(t, 1, func(_ int, o *fakeencoder.Options) {
		o.RegisterURLs = []string{boot}
		o.RegistrationInterval = 5 * time.Millisecond // real time: it retries until in, as sglang's does every 5 s
		o.RegistrationAttempts = 1 << 30
	})[0]
	name := nameOf(live)

	var (
		inService     time.Time
		deadOK        int
		deadRefused   int
		encodes       int
		stayedSeconds int
	)
	for step := 1; ; step++ {
		clk.Advance(interval)
		settle()
		for _, u := range dead {
			switch st := register(u); st {
			case http.StatusOK:
				deadOK++
			case http.StatusServiceUnavailable:
				deadRefused++
			default:
				t.Fatalf("registering %s again: %d", u, st)
			}
		}
		settle()
		e, ok := g.Pool().Lookup(name)
		usable := ok && !e.Draining() && e.Usable()
		switch {
		case inService.IsZero() && usable:
			inService = clk.Now()
		case inService.IsZero() && clk.Now().Sub(start) > 2*ttl:
			t.Fatalf("the live encoder not in service %s after it started registering (two TTLs): in pool %v, list %s",
				clk.Now().Sub(start), ok, do(t, http.MethodGet, boot+"/list_encoder_urls", "").body)
		case inService.IsZero():
			continue
		case !usable:
			t.Fatalf("the live encoder left service at %s, %s after it joined (in pool %v)", clk.Now().Sub(start), clk.Now().Sub(inService), ok)
		}
		if l := do(t, http.MethodGet, boot+"/list_encoder_urls", ""); l.status != 200 || !strings.Contains(l.body, live.URL()) {
			t.Fatalf("step %d: the live encoder is not registered any more: %d %s", step, l.status, l.body)
		}
		if step%3 == 0 || stayedSeconds == 0 {
			id := fmt.Sprintf("room-%d_local_part_0", step)
			a := post(t, g.base+"/encode", encodeBody(id))
			if a.status != http.StatusOK || a.header.Get("X-Encgate-Encoder") != name {
				t.Fatalf("/encode %s: %d encoder=%q %s, want 200 from %s", id, a.status, a.header.Get("X-Encgate-Encoder"), a.body, name)
			}
			encodes++
		}
		if clk.Now().Sub(inService) >= 3*ttl {
			break
		}
		stayedSeconds++
	}
	if got := live.Stats().Routes[routeEncode]; got != int64(encodes) {
		t.Errorf("the live encoder received %d /encodes, want %d", got, encodes)
	}
	<-live.RegistrationDone()
	if st := live.Stats(); st.RegistrationsOK != 1 {
		t.Errorf("the live encoder registered %d times, want once (it never had to again)", st.RegistrationsOK)
	}
	evictions := seriesValue(t, g, "encgate_bootstrap_evictions_total")
	neverPassed := seriesValue(t, g, "encgate_bootstrap_evictions_total", "reason", "never_passed")
	if evictions == 0 || neverPassed != evictions {
		t.Errorf("evictions %v (never_passed %v): the dead URLs should have made room, for the live encoder and for one another", evictions, neverPassed)
	}
	if n := seriesValue(t, g, "encgate_bootstrap_registrations_refused_total", "reason", "full_all_passing"); n != 0 {
		t.Errorf("refused as full of passing encoders %v times: the dead ones never pass", n)
	}
	var registered []string
	for _, e := range g.Pool().Encoders() {
		if e.Source() == upstream.SourceRegistered && !e.Draining() {
			registered = append(registered, e.URL)
		}
	}
	if len(registered) > max || !slices.Contains(registered, live.URL()) {
		t.Errorf("registered encoders in the pool at the end: %d %v", len(registered), registered)
	}
	t.Logf("in service %s after it started registering (grace %s, ttl %s), then %s in service while 16 dead URLs registered every second; "+
		"dead registrations: %d ok, %d refused (503); evictions %v (never_passed); refusals: full_unchecked %v; /encodes served by it %d",
		inService.Sub(start), window, ttl, clk.Now().Sub(inService), deadOK, deadRefused, evictions,
		seriesValue(t, g, "encgate_bootstrap_registrations_refused_total", "reason", "full_unchecked"), encodes)
}
