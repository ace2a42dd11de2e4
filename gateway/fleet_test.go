package gateway

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/encgate/encgate/discovery"
	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/dnstest"
	"github.com/encgate/encgate/internal/redistest"
	"github.com/encgate/encgate/internal/secretfile/secretfiletest"
	"github.com/encgate/encgate/upstream"
)

// dynamicGateway is a gateway with no static encoder, serving sglang's
// bootstrap API on loopback, open (bootstrap.insecure: what these tests
// check is not who may register; bootstrap_auth_test.go is). A registered
// encoder is probed at once and joins after up_after=1 passed probe, so
// within one health interval.
func dynamicGateway(t *testing.T, mutate func(*Config)) *gw {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Bootstrap.Listen = "127.0.0.1:0"
	cfg.Bootstrap.Insecure = true
	cfg.Health.UpAfter = 1
	cfg.Affinity.UnknownWait = 0
	if mutate != nil {
		mutate(&cfg)
	}
	return serveGateway(t, cfg, zap.NewNop(), nil)
}

// registeredFakes starts n fake encoders that register themselves with
// bootstrap, as sglang's encoders do with --encoder-register-urls.
func registeredFakes(t *testing.T, n int, bootstrap string) []*fakeencoder.Encoder {
	return startFakes(t, n, func(i int, o *fakeencoder.Options) {
		o.RegisterURLs = []string{bootstrap}
		o.RegistrationInterval = 10 * time.Millisecond
	})
}

// nameOf is a registered fake's encoder name in the gateway: its host:port.
func nameOf(e *fakeencoder.Encoder) string { return strings.TrimPrefix(e.URL(), "http://") }

// Two encoders that register themselves take /encode traffic once they
// pass their health checks. One unregisters while it holds pins: its pinned
// follow-ups still reach it, no new /encode does, and it is dropped once its
// req_ids are released.
func TestRegisteredEncodersJoinAndOneDrains(t *testing.T) {
	g := dynamicGateway(t, nil)
	boot := "http://" + g.BootstrapAddr()
	encs := registeredFakes(t, 2, boot)
	names := []string{nameOf(encs[0]), nameOf(encs[1])}
	sort.Strings(names)
	eventually(t, "both registered encoders usable", func() bool {
		rows := upstreamRows(t, g)
		usable := 0
		for _, r := range rows {
			if r.Source == "registered" && r.Membership == "active" && r.Usable {
				usable++
			}
		}
		return usable == 2
	})
	if got := upstreamNames(t, g); !slices.Equal(got, names) {
		t.Fatalf("/admin/upstreams lists %v, want %v", got, names)
	}
	l := do(t, http.MethodGet, boot+"/list_encoder_urls", "")
	if l.status != 200 || !strings.Contains(l.body, encs[0].URL()) || !strings.Contains(l.body, encs[1].URL()) {
		t.Fatalf("/list_encoder_urls: %d %s", l.status, l.body)
	}

	// /encode traffic reaches both.
	holder := map[string]string{}
	count := map[string]int{}
	for i := 0; i < 32; i++ {
		id := fmt.Sprintf("join-%d_local_part_0", i)
		a := post(t, g.base+"/encode", encodeBody(id))
		if a.status != 200 {
			t.Fatalf("/encode %s: %d %s", id, a.status, a.body)
		}
		holder[id] = a.header.Get("X-Encgate-Encoder")
		count[holder[id]]++
	}
	if count[names[0]] == 0 || count[names[1]] == 0 {
		t.Fatalf("/encode spread %v: both registered encoders should take some", count)
	}

	// encs[1] leaves while it still holds pins.
	leaving := nameOf(encs[1])
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := encs[1].Unregister(ctx); err != nil {
		t.Fatal(err)
	}
	eventually(t, leaving+" draining", func() bool { return upstreamRow(t, g, leaving).Membership == "draining" })
	wantLines(t, scrape(t, g), `encgate_fleet_encoders{source="registered",state="draining"} 1`,
		`encgate_fleet_encoders{source="registered",state="active"} 1`)
	var pinned []string
	for id, h := range holder {
		if h == leaving {
			pinned = append(pinned, id)
		}
	}
	sort.Strings(pinned)
	for _, id := range pinned {
		if m := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id)); m.status != 200 || m.header.Get("X-Encgate-Encoder") != leaving {
			t.Fatalf("pinned follow-up %s while %s drains: %d encoder=%q %s", id, leaving, m.status, m.header.Get("X-Encgate-Encoder"), m.body)
		}
	}
	for i := 0; i < 16; i++ {
		id := fmt.Sprintf("after-%d_local_part_0", i)
		if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 || a.header.Get("X-Encgate-Encoder") == leaving {
			t.Fatalf("new /encode %s while %s drains: %d encoder=%q", id, leaving, a.status, a.header.Get("X-Encgate-Encoder"))
		}
	}
	// Its req_ids are released (a TP=2 receiver's two /sends each).
	g.fleet.CheckDrained()
	if !slices.Contains(upstreamNames(t, g), leaving) {
		t.Fatalf("%s dropped while its pins still need it", leaving)
	}
	for _, id := range pinned {
		for _, port := range []int{40000, 40001} {
			if s := post(t, g.base+"/send", sendBody(id, port)); s.status != 200 {
				t.Fatalf("/send %s:%d: %d %s", id, port, s.status, s.body)
			}
		}
	}
	g.fleet.CheckDrained()
	if got := upstreamNames(t, g); !slices.Equal(got, []string{nameOf(encs[0])}) {
		t.Fatalf("/admin/upstreams lists %v once %s drained, want only %s", got, leaving, nameOf(encs[0]))
	}
	l = do(t, http.MethodGet, boot+"/list_encoder_urls", "")
	if strings.Contains(l.body, encs[1].URL()) {
		t.Fatalf("/list_encoder_urls still lists the unregistered encoder: %s", l.body)
	}
}

// A registration that is not an encoder URL is refused with sglang's
// answer, and the gateway needs no static encoder when it can find them.
func TestBootstrapRefusesBadRegistrations(t *testing.T) {
	g := dynamicGateway(t, nil)
	boot := "http://" + g.BootstrapAddr()
	if a := do(t, http.MethodPost, boot+"/register_encoder_url", `{"url":""}`); a.status != 400 || !strings.Contains(a.body, "Missing or empty 'url' field") {
		t.Fatalf("empty url: %d %s", a.status, a.body)
	}
	if a := do(t, http.MethodPost, boot+"/register_encoder_url", `{"url":"ftp://x:1"}`); a.status != 400 {
		t.Fatalf("ftp url: %d %s", a.status, a.body)
	}
	if a := do(t, http.MethodGet, boot+"/health", ""); a.status != 200 {
		t.Fatalf("/health: %d %s", a.status, a.body)
	}
	if rows := upstreamRows(t, g); len(rows) != 0 {
		t.Fatalf("refused registrations joined the fleet: %+v", rows)
	}
}

// Every route is served under /p/<k>/ as without it.
func TestFanoutPrefixServesEveryRoute(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), nil)
	id := "fan-1_local_part_0"
	if a := post(t, g.base+"/p/3/encode", encodeBody(id)); a.status != 200 {
		t.Fatalf("/p/3/encode: %d %s", a.status, a.body)
	}
	if a := post(t, g.base+"/p/3/scheduler_receive_meta_data", metaBody(id)); a.status != 200 || !strings.Contains(a.body, id) {
		t.Fatalf("/p/3/scheduler_receive_meta_data: %d %s", a.status, a.body)
	}
	if a := do(t, http.MethodGet, g.base+"/p/1023/health", ""); a.status != 200 {
		t.Fatalf("/p/1023/health: %d %s", a.status, a.body)
	}
	if a := post(t, g.base+"/p/1024/encode", encodeBody(id)); a.status != 404 {
		t.Fatalf("/p/1024/encode: %d, want 404", a.status)
	}
	if got := encs[0].Stats().ReqIDs[id]; got["/encode"] != 1 || got["/scheduler_receive_meta_data"] != 1 {
		t.Fatalf("the encoder saw %v through the prefix, want one /encode and one metadata call", got)
	}
}

// bootstrapRecorder is a language server's bootstrap: it records what
// registers and unregisters.
type bootstrapRecorder struct {
	*httptest.Server
	mu         sync.Mutex
	registered map[string]bool
	deletes    []string
}

func newBootstrapRecorder(t *testing.T) *bootstrapRecorder {
	b := &bootstrapRecorder{registered: map[string]bool{}}
	b.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		u := strings.TrimSuffix(strings.TrimPrefix(string(body), `{"url":"`), `"}`)
		b.mu.Lock()
		defer b.mu.Unlock()
		switch {
		case r.Method == http.MethodPost && r.URL.Path == "/register_encoder_url":
			b.registered[u] = true
		case r.Method == http.MethodDelete && r.URL.Path == "/unregister_encoder_url":
			delete(b.registered, u)
			b.deletes = append(b.deletes, u)
		case r.Method == http.MethodGet && r.URL.Path == "/list_encoder_urls":
			var urls []string
			for k := range b.registered {
				urls = append(urls, `"`+k+`"`)
			}
			fmt.Fprintf(w, `{"encoder_urls":[%s]}`, strings.Join(urls, ","))
			return
		}
		_, _ = io.WriteString(w, "OK")
	}))
	t.Cleanup(b.Close)
	return b
}

func (b *bootstrapRecorder) urls() (registered, deleted []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for k := range b.registered {
		registered = append(registered, k)
	}
	sort.Strings(registered)
	deleted = slices.Clone(b.deletes)
	sort.Strings(deleted)
	return registered, deleted
}

// The gateway registers advertise_url/p/0 … /p/<fanout-1> with each
// bootstrap, and takes them back on shutdown, before it drains.
func TestGatewayRegistersItselfWithFanout(t *testing.T) {
	boot := newBootstrapRecorder(t)
	encs := startFakes(t, 1, nil)
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Encoders = []upstream.EncoderConfig{{Name: "enc-0", URL: encs[0].URL()}}
	cfg.RegisterWith, cfg.AdvertiseURL, cfg.Fanout = []string{boot.URL}, "http://gw.example:8080", 4
	s, err := New(cfg, Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	want := []string{"http://gw.example:8080/p/0", "http://gw.example:8080/p/1", "http://gw.example:8080/p/2", "http://gw.example:8080/p/3"}
	eventually(t, "four registrations", func() bool { r, _ := boot.urls(); return slices.Equal(r, want) })
	// The registrar marks them registered once their answers are in.
	eventually(t, "four registered rows in /admin/registrations", func() bool {
		adm := do(t, http.MethodGet, "http://"+s.AdminAddr()+"/admin/registrations", "")
		return adm.status == 200 && strings.Count(adm.body, `"registered": true`) == 4
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	registered, deleted := boot.urls()
	if len(registered) != 0 || !slices.Equal(deleted, want) {
		t.Fatalf("after shutdown: registered %v, deleted %v; want none registered and %v deleted", registered, deleted, want)
	}
}

// Two replicas on one Redis: an encoder registered with one replica is used
// by both, and every req_id's /encodes land on one encoder whichever replica
// takes them.
func TestReplicasShareRegistrationsThroughRedis(t *testing.T) {
	rd := redistest.Start(t)
	redisCfg := func(c *Config) {
		c.Idempotency.Store = "redis"
		c.Redis.Addr = rd.Addr()
		c.Health.Interval = configfile.Duration(time.Second) // the registry's poll, too
		c.Health.Timeout = configfile.Duration(500 * time.Millisecond)
	}
	a, b := dynamicGateway(t, redisCfg), dynamicGateway(t, redisCfg)
	encs := registeredFakes(t, 3, "http://"+a.BootstrapAddr()) // registered with a only
	for _, g := range []*gw{a, b} {
		eventually(t, "three registered encoders usable on "+g.base, func() bool {
			n := 0
			for _, r := range upstreamRows(t, g) {
				if r.Source == "registered" && r.Usable {
					n++
				}
			}
			return n == 3
		})
	}
	if la, lb := do(t, http.MethodGet, "http://"+a.BootstrapAddr()+"/list_encoder_urls", ""), do(t, http.MethodGet, "http://"+b.BootstrapAddr()+"/list_encoder_urls", ""); la.body != lb.body {
		t.Fatalf("the replicas' lists differ: %s / %s", la.body, lb.body)
	}
	// A GEN0 receiver's TP ranks each send the same /encode; here rank 0
	// reaches one replica and rank 1 the other.
	for i := 0; i < 24; i++ {
		id := fmt.Sprintf("both-%d_local_part_0", i)
		first, second := a, b
		if i%2 == 1 {
			first, second = b, a
		}
		x := post(t, first.base+"/encode", encodeBody(id))
		y := post(t, second.base+"/encode", encodeBody(id))
		if x.status != 200 || y.status != 200 || x.header.Get("X-Encgate-Encoder") != y.header.Get("X-Encgate-Encoder") {
			t.Fatalf("%s: %d on %q through one replica, %d on %q through the other", id,
				x.status, x.header.Get("X-Encgate-Encoder"), y.status, y.header.Get("X-Encgate-Encoder"))
		}
	}
	_ = encs
}

// Two replicas serve a fleet that joined only by registration, each
// encoder registering once, as sglang's do. Redis restarts empty: both keep
// serving /encode on it, and re-assert the registrations, so that
// /list_encoder_urls lists them again and a third replica started after
// the restart serves them too.
func TestRegisteredFleetSurvivesARedisRestart(t *testing.T) {
	rd := redistest.Start(t)
	redisCfg := func(c *Config) {
		c.Idempotency.Store = "redis"
		c.Redis.Addr = rd.Addr()
		c.Redis.KeyPrefix = "restart:"
		c.Health.Interval = configfile.Duration(time.Second) // the registry's poll and refresh, too
		c.Health.Timeout = configfile.Duration(500 * time.Millisecond)
	}
	a, b := dynamicGateway(t, redisCfg), dynamicGateway(t, redisCfg)
	encs := registeredFakes(t, 2, "http://"+a.BootstrapAddr())
	want := `{"encoder_urls":["` + encs[0].URL() + `","` + encs[1].URL() + `"]}`
	if encs[1].URL() < encs[0].URL() {
		want = `{"encoder_urls":["` + encs[1].URL() + `","` + encs[0].URL() + `"]}`
	}
	usable := func(g *gw) func() bool {
		return func() bool {
			n := 0
			for _, r := range upstreamRows(t, g) {
				if r.Source == "registered" && r.Membership == "active" && r.Usable {
					n++
				}
			}
			return n == 2
		}
	}
	for _, g := range []*gw{a, b} {
		eventually(t, "both registered encoders usable on "+g.base, usable(g))
	}

	rd.Restart()
	// From its first read of the empty Redis on, each replica still lists
	// what it served (whether or not its refresh has run yet).
	for _, g := range []*gw{a, b} {
		var l answer
		eventually(t, "a list from "+g.base+" once Redis is back", func() bool {
			l = do(t, http.MethodGet, "http://"+g.BootstrapAddr()+"/list_encoder_urls", "")
			return l.status == 200
		})
		if l.body != want {
			t.Fatalf("%s lists %s after the restart, want %s", g.base, l.body, want)
		}
	}
	raw := redis.NewClient(&redis.Options{Addr: rd.Addr(), DisableIdentity: true})
	t.Cleanup(func() { _ = raw.Close() })
	eventually(t, "both registrations back in Redis", func() bool {
		n, err := raw.ZCount(context.Background(), "restart:bootstrap:encoders", "(0", "+inf").Result()
		return err == nil && n == 2
	})
	for _, g := range []*gw{a, b} {
		if !usable(g)() {
			t.Fatalf("%s: registered encoders not both usable after the restart: %+v", g.base, upstreamRows(t, g))
		}
		for i := 0; i < 8; i++ {
			id := fmt.Sprintf("restart-%d_local_part_0", i)
			if x := post(t, g.base+"/encode", encodeBody(id)); x.status != 200 {
				t.Fatalf("/encode %s through %s after the restart: %d %s", id, g.base, x.status, x.body)
			}
		}
	}
	c := dynamicGateway(t, redisCfg)
	eventually(t, "a replica started after the restart serving both", usable(c))
}

// twoLoopbackFakes starts fake encoders on 127.0.0.2 and 127.0.0.3 at one
// port, as a headless Service's pods would be.
func twoLoopbackFakes(t *testing.T) (encs []*fakeencoder.Encoder, port int) {
	t.Helper()
	for attempt := 0; attempt < 20; attempt++ {
		ln, err := net.Listen("tcp", "127.0.0.2:0")
		if err != nil {
			t.Skipf("127.0.0.2 is not a loopback address here: %v", err)
		}
		port = ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		encs = nil
		ok := true
		for _, host := range []string{"127.0.0.2", "127.0.0.3"} {
			e := fakeencoder.New(fakeencoder.Options{Name: host, Mode: fakeencoder.ModeMooncake})
			if err := e.Start(net.JoinHostPort(host, strconv.Itoa(port))); err != nil {
				ok = false
				break
			}
			t.Cleanup(func() { _ = e.Close() })
			encs = append(encs, e)
		}
		if ok {
			return encs, port
		}
		for _, e := range encs {
			_ = e.Close()
		}
	}
	t.Fatal("no port free on both 127.0.0.2 and 127.0.0.3")
	return nil, 0
}

// Encoders found in DNS join; one that leaves the answer drains as a
// registered one does; a DNS server that fails keeps the last fleet.
func TestDNSDiscoveredEncodersJoinDrainAndSurviveAFailingServer(t *testing.T) {
	srv := dnstest.Start(t)
	const name = "encoders.encgate.test."
	srv.Set(name, "127.0.0.2", "127.0.0.3")
	encs, port := twoLoopbackFakes(t)
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Health.UpAfter = 1
	cfg.Affinity.UnknownWait = 0
	cfg.Discovery.DNS = []discovery.DNSConfig{{Name: name, Port: port, Scheme: "http",
		Interval: configfile.Duration(time.Second), Resolver: srv.Addr()}}
	g := serveGateway(t, cfg, zap.NewNop(), nil)
	a, b := net.JoinHostPort("127.0.0.2", strconv.Itoa(port)), net.JoinHostPort("127.0.0.3", strconv.Itoa(port))
	eventually(t, "both DNS encoders usable", func() bool {
		n := 0
		for _, r := range upstreamRows(t, g) {
			if r.Source == "dns" && r.Usable && r.Membership == "active" {
				n++
			}
		}
		return n == 2
	})
	var onB []string
	for i := 0; i < 32; i++ {
		id := fmt.Sprintf("dns-%d_local_part_0", i)
		x := post(t, g.base+"/encode", encodeBody(id))
		if x.status != 200 {
			t.Fatalf("/encode %s: %d %s", id, x.status, x.body)
		}
		if x.header.Get("X-Encgate-Encoder") == b {
			onB = append(onB, id)
		}
	}
	if len(onB) == 0 || len(onB) == 32 {
		t.Fatalf("%d of 32 /encodes on %s: both DNS encoders should take some", len(onB), b)
	}

	// The answer loses 127.0.0.3: it drains.
	srv.Set(name, "127.0.0.2")
	eventually(t, b+" draining", func() bool { return upstreamRow(t, g, b).Membership == "draining" })
	for _, id := range onB {
		if m := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id)); m.status != 200 || m.header.Get("X-Encgate-Encoder") != b {
			t.Fatalf("pinned follow-up %s while %s drains: %d encoder=%q", id, b, m.status, m.header.Get("X-Encgate-Encoder"))
		}
	}
	if x := post(t, g.base+"/encode", encodeBody("dns-new_local_part_0")); x.status != 200 || x.header.Get("X-Encgate-Encoder") != a {
		t.Fatalf("new /encode while %s drains: %d encoder=%q", b, x.status, x.header.Get("X-Encgate-Encoder"))
	}
	for _, id := range onB {
		for _, p := range []int{40000, 40001} {
			if s := post(t, g.base+"/send", sendBody(id, p)); s.status != 200 {
				t.Fatalf("/send %s: %d %s", id, s.status, s.body)
			}
		}
	}
	g.fleet.CheckDrained()
	if got := upstreamNames(t, g); !slices.Equal(got, []string{a}) {
		t.Fatalf("fleet %v once %s drained, want [%s]", got, b, a)
	}

	// The DNS server fails: the last answer stays, and the failures count.
	srv.Fail(name, dnsRcodeServerFailure)
	eventually(t, "a counted DNS failure", func() bool {
		for _, l := range strings.Split(scrape(t, g), "\n") {
			if v, ok := strings.CutPrefix(l, `encgate_discovery_errors_total{source="dns"} `); ok && v != "0" {
				return true
			}
		}
		return false
	})
	if got := upstreamNames(t, g); !slices.Equal(got, []string{a}) {
		t.Fatalf("fleet %v after the DNS server failed, want [%s] kept", got, a)
	}
	if row := upstreamRow(t, g, a); row.Membership != "active" || !row.Usable {
		t.Fatalf("%s after the DNS failure: %+v", a, row)
	}
	_ = encs
}

// dnsRcodeServerFailure is SERVFAIL (RFC 1035).
const dnsRcodeServerFailure = 2

// Both Redis clients of a gateway (the /send store's and the bootstrap
// registry's) authenticate with redis.password_file: two
// replicas on a Redis that requires the password share a registration and
// a /send record.
func TestRedisPasswordFileAuthenticatesBothClients(t *testing.T) {
	const password = "the redis password 0123"
	rd := redistest.Start(t, redistest.WithPassword(password))
	file := secretfiletest.Write(t, "redis.password", password+"\n", 0o640)
	redisCfg := func(c *Config) {
		c.Idempotency.Store = "redis"
		c.Redis.Addr = rd.Addr()
		c.Redis.PasswordFile = file
		// The registry's poll: b sees a's registration within one interval,
		// which the default (10s) made as long as the test's whole wait.
		c.Health.Interval = configfile.Duration(time.Second)
		c.Health.Timeout = configfile.Duration(500 * time.Millisecond)
	}
	a, b := dynamicGateway(t, redisCfg), dynamicGateway(t, redisCfg)
	enc := registeredFakes(t, 1, "http://"+a.BootstrapAddr())[0] // registered with a only
	eventually(t, "b to list the encoder registered with a", func() bool {
		return strings.Contains(do(t, http.MethodGet, "http://"+b.BootstrapAddr()+"/list_encoder_urls", "").body, enc.URL())
	})
	for _, g := range []*gw{a, b} {
		eventually(t, "the registered encoder usable on "+g.base, func() bool {
			rows := upstreamRows(t, g)
			return len(rows) == 1 && rows[0].Usable
		})
	}
	id := "pw_local_part_0"
	if x := post(t, a.base+"/encode", encodeBody(id)); x.status != 200 {
		t.Fatalf("/encode: %d %s", x.status, x.body)
	}
	if x := post(t, a.base+"/send", tpSend(id, 0, 2)); x.status != 200 || x.header.Get("X-Encgate-Replayed") != "" {
		t.Fatalf("/send on a: %d %q %s", x.status, x.header.Get("X-Encgate-Replayed"), x.body)
	}
	if y := post(t, b.base+"/send", tpSend(id, 0, 2)); y.status != 200 || y.header.Get("X-Encgate-Replayed") != "true" {
		t.Fatalf("the duplicate /send on b: %d replayed=%q %s (b's store did not read a's record)", y.status, y.header.Get("X-Encgate-Replayed"), y.body)
	}
	if n := sendsReceived(enc, id); n != 1 {
		t.Errorf("the encoder received %d /sends of %s, want 1", n, id)
	}
}
