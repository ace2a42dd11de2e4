package gateway

import (
	"bytes"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/loopguard"
	"github.com/encgate/encgate/upstream"
)

// fixedID is the instance id drawn from fixedEntropy.
const fixedID = "0102030405060708"

func fixedEntropy() *bytes.Reader { return bytes.NewReader([]byte{1, 2, 3, 4, 5, 6, 7, 8}) }

// serveGatewayID is serveGateway with the instance id drawn from
// fixedEntropy.
func serveGatewayID(t *testing.T, cfg Config) *gw {
	t.Helper()
	return serveGatewayDeps(t, cfg, Deps{Log: zap.NewNop(), Entropy: fixedEntropy()})
}

// requestsOn sums encgate_requests_total{route}; forwarded sums
// encgate_upstream_requests_total.
func requestsOn(t *testing.T, g *gw, route string) float64 {
	t.Helper()
	mfs, err := g.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != "encgate_requests_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "route" && l.GetValue() == route {
					sum += m.GetCounter().GetValue()
				}
			}
		}
	}
	return sum
}

func loops(t *testing.T, g *gw, reason string) float64 {
	return seriesValue(t, g, "encgate_loops_detected_total", "reason", reason)
}

// Two gateways whose static encoder is each other: neither URL is the
// gateway's own address, so only the hop mark can see the loop. An
// /encode to A reaches B, comes back to A carrying A's mark and is
// answered 508 there: two forwards in all, then the 508 travels back.
func TestChainedGatewaysLoopEndsWith508(t *testing.T) {
	pa, pb := freePort(t), freePort(t)
	for pa == pb {
		pb = freePort(t)
	}
	conf := func(listen, encoder int) Config {
		cfg := DefaultConfig()
		cfg.Listen, cfg.AdminListen = "127.0.0.1:"+strconv.Itoa(listen), "127.0.0.1:0"
		cfg.Encoders = []upstream.EncoderConfig{{Name: "peer", URL: "http://127.0.0.1:" + strconv.Itoa(encoder)}}
		return cfg
	}
	a := serveGateway(t, conf(pa, pb), zap.NewNop(), nil)
	b := serveGateway(t, conf(pb, pa), zap.NewNop(), nil)
	if a.loop.Mark() == b.loop.Mark() {
		t.Fatalf("both gateways drew the instance id %s", a.loop.Mark())
	}

	x := post(t, a.base+"/encode", encodeBody("chain_local_part_0"))
	fwdA, fwdB := metricValue(t, a, "encgate_upstream_requests_total"), metricValue(t, b, "encgate_upstream_requests_total")
	recA, recB := requestsOn(t, a, "encode"), requestsOn(t, b, "encode")
	t.Logf("/encode to A: %d %s; A received %v and forwarded %v, B received %v and forwarded %v; loops A=%v B=%v; A accepted %v connections, B %v",
		x.status, x.body, recA, fwdA, recB, fwdB, loops(t, a, loopguard.OwnMark), loops(t, b, loopguard.OwnMark),
		metricValue(t, a, "encgate_connections_accepted_total"), metricValue(t, b, "encgate_connections_accepted_total"))
	if x.status != fasthttp.StatusLoopDetected || !strings.Contains(x.body, "loop detected") || !strings.Contains(x.body, a.loop.Mark()) {
		t.Fatalf("/encode to A: %d %s, want 508 naming A's mark", x.status, x.body)
	}
	if fwdA+fwdB > 2 || fwdA != 1 || fwdB != 1 {
		t.Errorf("forwards: A %v, B %v; want one each", fwdA, fwdB)
	}
	if recA != 2 || recB != 1 {
		t.Errorf("received /encodes: A %v, B %v; want 2 (the client's and the loop's) and 1", recA, recB)
	}
	if loops(t, a, loopguard.OwnMark) != 1 || loops(t, b, loopguard.OwnMark) != 0 {
		t.Errorf("loops detected: A %v, B %v; want 1 and 0", loops(t, a, loopguard.OwnMark), loops(t, b, loopguard.OwnMark))
	}
	// The 508 is no fault of the peer: its breaker ignores it.
	for _, g := range []*gw{a, b} {
		wantLines(t, scrape(t, g), `encgate_breaker_outcomes_total{encoder="peer",outcome="ignored"} 1`,
			`encgate_breaker_outcomes_total{encoder="peer",outcome="fault"} 0`)
	}
}

// Every route that forwards carries the hop list it arrived with plus this
// gateway's entry, and refuses (508, nothing forwarded) a request that
// carries this gateway's entry already or more than max_hops entries.
func TestEveryForwardingRouteCarriesAndChecksTheHopMark(t *testing.T) {
	enc := newScripted(t)
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Affinity.UnknownWait = 0
	cfg.SelfGuard.MaxHops = 4
	cfg.Encoders = []upstream.EncoderConfig{{Name: "enc-0", URL: enc.URL}}
	g := serveGatewayID(t, cfg)
	mine := "1.1 encgate-" + fixedID
	routes := []struct {
		method, path string
		body         func(id string) string
	}{
		{http.MethodPost, "/encode", func(id string) string { return encodeBody(id) }},
		{http.MethodPost, "/scheduler_receive_meta_data", metaBody},
		{http.MethodPost, "/scheduler_receive_url", func(id string) string { return registerBody(id, "10.0.0.1:5000", 1) }},
		{http.MethodPost, "/send", func(id string) string { return sendBody(id, 40000) }},
		{http.MethodPost, "/start_profile", func(string) string { return "" }},
		{http.MethodGet, "/stop_profile", func(string) string { return "" }},
		{http.MethodPost, "/p/3/encode", func(id string) string { return encodeBody(id) }},
	}
	for i, r := range routes {
		id := fmt.Sprintf("hop-%d_local_part_0", i)
		path := strings.TrimPrefix(r.path, "/p/3")
		for _, c := range []struct {
			name string
			via  []string
			want string // the Via the encoder sees; "" refused
		}{
			{"no via", nil, mine},
			{"a proxy before", []string{"1.1 ingress (nginx, 1.25)"}, "1.1 ingress (nginx, 1.25), " + mine},
			{"two fields", []string{"1.0 a", "1.1 b, 2 c"}, "1.0 a, 1.1 b, 2 c, " + mine},
			{"max hops", []string{"1.1 a, 1.1 b", "1.1 c, 1.1 d"}, "1.1 a, 1.1 b, 1.1 c, 1.1 d, " + mine},
			{"own mark", []string{"1.1 ingress, " + mine + " (encgate)"}, ""},
			{"own mark alone", []string{mine}, ""},
			{"past max hops", []string{"1.1 a, 1.1 b, 1.1 c, 1.1 d, 1.1 e"}, ""},
		} {
			before := len(enc.received(path))
			h := http.Header{}
			if c.via != nil {
				h["Via"] = c.via
			}
			a := doWith(t, r.method, g.base+r.path, r.body(id+strings.ReplaceAll(c.name, " ", "-")), h)
			got := enc.received(path)
			if c.want == "" {
				if a.status != fasthttp.StatusLoopDetected || !strings.HasPrefix(a.body, `{"status":"error","message":"encgate: loop detected`) || len(got) != before {
					t.Errorf("%s %s with %s: %d %s, %d forwarded; want 508, nothing forwarded", r.method, r.path, c.name, a.status, a.body, len(got)-before)
				}
				continue
			}
			if a.status != 200 || len(got) != before+1 {
				t.Errorf("%s %s with %s: %d %s, %d forwarded; want 200, one forwarded", r.method, r.path, c.name, a.status, a.body, len(got)-before)
				continue
			}
			if v := enc.header(path).Values("Via"); len(v) != 1 || v[0] != c.want {
				t.Errorf("%s %s with %s: the encoder saw Via %q, want %q", r.method, r.path, c.name, v, c.want)
			}
		}
	}
	// Health is answered by the gateway and forwards nothing: never refused.
	if a := doWith(t, http.MethodGet, g.base+"/health", "", http.Header{"Via": {mine}}); a.status != 200 {
		t.Errorf("/health with the gateway's own mark: %d", a.status)
	}
	if own, hops := loops(t, g, loopguard.OwnMark), loops(t, g, loopguard.MaxHops); own != 2*float64(len(routes)) || hops != float64(len(routes)) {
		t.Errorf("encgate_loops_detected_total own_mark=%v max_hops=%v, want %d and %d", own, hops, 2*len(routes), len(routes))
	}
}

// Each attempt's request is built afresh: an /encode retried on the next
// encoder after a failed connect carries the mark there too.
func TestRetriedAttemptCarriesTheHopMark(t *testing.T) {
	enc := newScripted(t)
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Encoders = []upstream.EncoderConfig{{Name: "dead", URL: "http://" + deadAddr(t)}, {Name: "live", URL: enc.URL}}
	g := serveGatewayID(t, cfg)
	id := ownedBy(t, g, "dead", "retry-hop")
	a := doWith(t, http.MethodPost, g.base+"/encode", encodeBody(id), http.Header{"Via": {"1.1 ingress"}})
	if a.status != 200 || a.header.Get("X-Encgate-Attempts") != "2" {
		t.Fatalf("/encode: %d attempts=%q %s, want 200 after 2 attempts", a.status, a.header.Get("X-Encgate-Attempts"), a.body)
	}
	if v := enc.header("/encode").Get("Via"); v != "1.1 ingress, 1.1 encgate-"+fixedID {
		t.Fatalf("the second attempt carried Via %q", v)
	}
}
