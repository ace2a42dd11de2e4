package gateway

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/encgate/encgate/discovery"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/dnstest"
	"github.com/encgate/encgate/upstream"
)

// freePort is a loopback port nothing listens on now, for a listener whose
// port must be known before the gateway starts (a DNS source pointing at
// it): unlike deadAddr's, it is free to be bound.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()
	return port
}

// dnsResolver is a resolver that asks srv (and reads /etc/hosts first, so
// localhost is loopback).
func dnsResolver(srv *dnstest.Server) *net.Resolver {
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, network, srv.Addr())
	}}
}

// serveGatewayResolving is serveGateway with the self check's resolver
// asking srv.
func serveGatewayResolving(t *testing.T, cfg Config, srv *dnstest.Server) *gw {
	t.Helper()
	return serveGatewayDeps(t, cfg, Deps{Log: zap.NewNop(), Resolver: dnsResolver(srv)})
}

// selfRefused is encgate_fleet_self_refused_total{source}.
func selfRefused(t *testing.T, g *gw, source string) float64 {
	t.Helper()
	return counterWith(t, g, "encgate_fleet_self_refused_total", "source", source)
}

// The operator's report: the gateway's own bootstrap URL, its main port as
// localhost, and a DNS name that resolves to it all joined its fleet, and
// /encodes looped through it or hit the bootstrap API. Each is refused with
// a reason and counted, from the bootstrap API and from the DNS source;
// two real encoders serve every /encode, and no request loops.
func TestSelfRoutingRefusedFromEverySource(t *testing.T) {
	srv := dnstest.Start(t)
	const selfName = "gateway.encgate.test."
	srv.Set(selfName, "127.0.0.1")
	encs := startFakes(t, 2, nil)
	port := freePort(t)
	p := strconv.Itoa(port)
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:"+p, "127.0.0.1:0"
	cfg.Bootstrap.Listen = "127.0.0.1:0"
	cfg.Bootstrap.Insecure = true // the self check is what is tested; the token is TestBootstrapTokenGuardsEveryRoute's
	cfg.Health.UpAfter = 1
	cfg.Affinity.UnknownWait = 0
	cfg.Encoders = []upstream.EncoderConfig{{Name: "enc-0", URL: encs[0].URL()}, {Name: "enc-1", URL: encs[1].URL()}}
	cfg.Discovery.DNS = []discovery.DNSConfig{{Name: selfName, Port: port, Scheme: "http",
		Interval: configfile.Duration(time.Second), Resolver: srv.Addr()}}
	g := serveGatewayResolving(t, cfg, srv)
	boot := "http://" + g.BootstrapAddr()

	// The DNS source's member, 127.0.0.1:<port>, is the gateway.
	eventually(t, "the DNS member refused", func() bool { return selfRefused(t, g, "dns") == 1 })

	cases := []struct{ url, want string }{
		{boot, "is this gateway's own bootstrap.listen address (" + g.BootstrapAddr() + ")"},
		{"http://localhost:" + p, "resolves to 127.0.0.1, this gateway's own listen address (127.0.0.1:" + p + ")"},
		{"http://" + strings.TrimSuffix(selfName, ".") + ":" + p, "resolves to 127.0.0.1, this gateway's own listen address (127.0.0.1:" + p + ")"},
		{g.admin, "is this gateway's own admin_listen address (" + g.AdminAddr() + ")"},
	}
	for _, c := range cases {
		a := post(t, boot+"/register_encoder_url", fmt.Sprintf(`{"url":%q}`, c.url))
		t.Logf("register %s: %d %s", c.url, a.status, a.body)
		if a.status != http.StatusBadRequest || !strings.Contains(a.body, c.want) {
			t.Errorf("registering %s: %d %s, want 400 saying %q", c.url, a.status, a.body, c.want)
		}
	}
	if got := selfRefused(t, g, "registered"); got != float64(len(cases)) {
		t.Errorf("encgate_fleet_self_refused_total{source=registered} = %v, want %d", got, len(cases))
	}
	if l := do(t, http.MethodGet, boot+"/list_encoder_urls", ""); l.body != `{"encoder_urls":[]}` {
		t.Errorf("/list_encoder_urls: %s, want none", l.body)
	}

	failed := 0
	for i := 0; i < 30; i++ {
		a := post(t, g.base+"/encode", encodeBody(fmt.Sprintf("self-%d_local_part_0", i)))
		if enc := a.header.Get("X-Encgate-Encoder"); a.status != 200 || (enc != "enc-0" && enc != "enc-1") {
			failed++
			t.Errorf("/encode %d: %d encoder=%q %.160s", i, a.status, enc, a.body)
		}
	}
	served := encs[0].Stats().Routes["/encode"] + encs[1].Stats().Routes["/encode"]
	accepted := metricValue(t, g, "encgate_connections_accepted_total")
	t.Logf("%d of 30 /encodes failed; encoders served %d; fleet %v; refused static=%v registered=%v dns=%v; loops %v; accepted connections %v",
		failed, served, upstreamNames(t, g), selfRefused(t, g, "static"), selfRefused(t, g, "registered"), selfRefused(t, g, "dns"),
		metricValue(t, g, "encgate_loops_detected_total"), accepted)
	if names := upstreamNames(t, g); !slices.Equal(names, []string{"enc-0", "enc-1"}) {
		t.Errorf("fleet %v, want the two encoders alone", names)
	}
	if served != 30 {
		t.Errorf("the encoders served %d /encodes, want 30", served)
	}
	// The test's client and the gateway's own health probes of nothing
	// but the two encoders: no connection comes from the gateway itself.
	if accepted > 5 {
		t.Errorf("%v connections accepted for 30 /encodes over keep-alive", accepted)
	}
}

// A static encoder (its URL or its agent) that names one of the gateway's
// listeners literally is a config error naming the field: at start, on a
// reload and with --check alike. Names other than localhost, and ports the
// file leaves to the kernel (:0), are checked once bound (the next test).
func TestStaticSelfEncoderIsAConfigError(t *testing.T) {
	base := func() Config {
		c := DefaultConfig()
		c.Listen, c.AdminListen, c.Bootstrap.Listen = "127.0.0.1:8080", "0.0.0.0:9090", "[::]:8997"
		return c
	}
	for _, c := range []struct {
		name    string
		listen  string
		enc     upstream.EncoderConfig
		adv     string
		problem string // "" valid
	}{
		{"its listen address", "", upstream.EncoderConfig{URL: "http://127.0.0.1:8080"}, "",
			"encoders[2].url: http://127.0.0.1:8080 is this gateway's own listen address (127.0.0.1:8080)"},
		{"localhost", "", upstream.EncoderConfig{URL: "http://LOCALHOST:8080/"}, "",
			"encoders[2].url: http://LOCALHOST:8080/ is this gateway's own listen address (127.0.0.1:8080)"},
		{"admin on every address", "", upstream.EncoderConfig{URL: "http://127.0.0.7:9090"}, "",
			"encoders[2].url: http://127.0.0.7:9090 is this gateway's own admin_listen address (0.0.0.0:9090, which takes every local address)"},
		{"bootstrap on every address, v6 loopback", "", upstream.EncoderConfig{URL: "http://[::1]:8997"}, "",
			"encoders[2].url: http://[::1]:8997 is this gateway's own bootstrap.listen address ([::]:8997, which takes every local address)"},
		{"its agent", "", upstream.EncoderConfig{URL: "http://10.0.0.9:30000", Agent: "http://localhost:8080"}, "",
			"encoders[2].agent: http://localhost:8080 is this gateway's own listen address (127.0.0.1:8080)"},
		{"the advertised URL", "", upstream.EncoderConfig{URL: "http://GW.ns.svc:80"}, "http://gw.ns.svc",
			"encoders[2].url: http://GW.ns.svc:80 is this gateway's own advertise_url"},
		{"listen by localhost", "localhost:8080", upstream.EncoderConfig{URL: "http://127.0.0.1:8080"}, "",
			"encoders[2].url: http://127.0.0.1:8080 is this gateway's own listen address (localhost:8080)"},
		{"another port", "", upstream.EncoderConfig{URL: "http://127.0.0.1:8081"}, "", ""},
		{"another address, listen on one", "", upstream.EncoderConfig{URL: "http://127.0.0.2:8080"}, "", ""},
		{"a name: checked once running", "", upstream.EncoderConfig{URL: "http://gw.internal:8080"}, "", ""},
		{"a port chosen by the kernel", "127.0.0.1:0", upstream.EncoderConfig{URL: "http://127.0.0.1:0"}, "", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := base()
			if c.listen != "" {
				cfg.Listen = c.listen
			}
			cfg.AdvertiseURL = c.adv
			if c.adv != "" {
				cfg.RegisterWith = []string{"http://lang:8997"}
			}
			c.enc.Name = "self"
			cfg.Encoders = []upstream.EncoderConfig{{Name: "a", URL: "http://10.0.0.1:30000"}, {Name: "b", URL: "http://10.0.0.2:30000"}, c.enc}
			err := cfg.Validate()
			switch {
			case c.problem == "" && err != nil && strings.Contains(err.Error(), "this gateway"):
				t.Fatalf("refused: %v", err)
			case c.problem != "" && (err == nil || !strings.Contains(err.Error(), c.problem)):
				t.Fatalf("Validate: %v, want the problem %q", err, c.problem)
			}
		})
	}
}

// What only the running gateway knows is checked when the fleet is
// applied: a static encoder named by a host name that resolves to the
// gateway is left out (logged, counted), at start and on a reload; a
// reload that names the listener literally is refused with the field.
func TestStaticSelfEncoderRefusedAtApplyAndOnReload(t *testing.T) {
	srv := dnstest.Start(t)
	srv.Set("self-a.encgate.test.", "127.0.0.1")
	srv.Set("self-b.encgate.test.", "127.0.0.1")
	encs := startFakes(t, 1, nil)
	port := freePort(t)
	p := strconv.Itoa(port)
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:"+p, "127.0.0.1:0"
	cfg.Encoders = []upstream.EncoderConfig{{Name: "enc-0", URL: encs[0].URL()}, {Name: "self-a", URL: "http://self-a.encgate.test:" + p}}
	core, logs := observer.New(zap.InfoLevel)
	g := serveGatewayDeps(t, cfg, Deps{Log: zap.New(core), Resolver: dnsResolver(srv)})
	if names := upstreamNames(t, g); !slices.Equal(names, []string{"enc-0"}) {
		t.Fatalf("fleet %v, want enc-0 alone", names)
	}
	if got := selfRefused(t, g, "static"); got != 1 {
		t.Fatalf("encgate_fleet_self_refused_total{source=static} = %v, want 1", got)
	}
	lines := logs.FilterMessage("encoder refused: it is this gateway itself").All()
	if len(lines) != 1 || lines[0].ContextMap()["reason"] != "http://self-a.encgate.test:"+p+" resolves to 127.0.0.1, this gateway's own listen address (127.0.0.1:"+p+")" {
		t.Fatalf("refusal log lines %v", lines)
	}

	// A reload that keeps self-a and adds self-b: self-b is refused too,
	// self-a is not counted again.
	next := cfg
	next.Encoders = append(slices.Clone(cfg.Encoders), upstream.EncoderConfig{Name: "self-b", URL: "http://self-b.encgate.test:" + p})
	if err := g.Reload(next); err != nil {
		t.Fatal(err)
	}
	if names := upstreamNames(t, g); !slices.Equal(names, []string{"enc-0"}) || selfRefused(t, g, "static") != 2 {
		t.Fatalf("after the reload: fleet %v, %v refused; want enc-0 alone, 2", names, selfRefused(t, g, "static"))
	}
	// A reload naming the listener literally is refused whole.
	bad := next
	bad.Encoders = append(slices.Clone(next.Encoders), upstream.EncoderConfig{Name: "self-c", URL: "http://127.0.0.1:" + p})
	err := g.Reload(bad)
	want := "encoders[3].url: http://127.0.0.1:" + p + " is this gateway's own listen address (127.0.0.1:" + p + ")"
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("reload naming the listener: %v, want %q", err, want)
	}
	if a := post(t, g.base+"/encode", encodeBody("static-self_local_part_0")); a.status != 200 || a.header.Get("X-Encgate-Encoder") != "enc-0" {
		t.Fatalf("/encode: %d %s", a.status, a.body)
	}
}

// A registered name that does not resolve is not refused for that: it
// joins. Once it resolves to the gateway, the next recheck leaves it out.
func TestUnresolvedNameJoinsAndIsRefusedOnceItResolves(t *testing.T) {
	srv := dnstest.Start(t)
	const later = "later.encgate.test."
	srv.NXDomain(later)
	port := freePort(t)
	p := strconv.Itoa(port)
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen, cfg.Bootstrap.Listen = "127.0.0.1:"+p, "127.0.0.1:0", "127.0.0.1:0"
	cfg.Bootstrap.Insecure = true
	g := serveGatewayResolving(t, cfg, srv)
	boot := "http://" + g.BootstrapAddr()
	laterURL := "http://" + strings.TrimSuffix(later, ".") + ":" + p
	if a := post(t, boot+"/register_encoder_url", fmt.Sprintf(`{"url":%q}`, laterURL)); a.status != 200 {
		t.Fatalf("registering %s while its name does not resolve: %d %s", laterURL, a.status, a.body)
	}
	name := strings.TrimPrefix(laterURL, "http://")
	eventually(t, name+" in the fleet", func() bool { return slices.Contains(upstreamNames(t, g), name) })
	if got := selfRefused(t, g, "registered"); got != 0 {
		t.Fatalf("%v refused while the name does not resolve", got)
	}
	srv.Set(later, "127.0.0.1")
	if !g.fleet.RecheckSelf() {
		t.Errorf("recheckSelf reports no name kept, want the name it looked up again")
	}
	if names := upstreamNames(t, g); len(names) != 0 {
		t.Fatalf("after the recheck: fleet %v, want none", names)
	}
	if got := selfRefused(t, g, "registered"); got != 1 {
		t.Fatalf("encgate_fleet_self_refused_total{source=registered} = %v, want 1", got)
	}
}
