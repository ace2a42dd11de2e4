package discovery

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/secretfile/secretfiletest"
)

// bsToken is a valid bootstrap token (32 characters of the URL-safe set).
const bsToken = "boot-token_0123456789.abcdef~XYZ"

// bsRefused is encgate_bootstrap_refused_total{reason} on reg.
func bsRefused(t *testing.T, reg *prometheus.Registry, reason string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "encgate_bootstrap_refused_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetLabel()[0].GetValue() == reason {
				return m.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("no encgate_bootstrap_refused_total{reason=%q}", reason)
	return 0
}

// bsToken's rules, through the handler on a real socket: with a token
// every route is served only under /t/<token>/. The bare routes, any other
// token (of the same length or not, a prefix of it, it with more after it)
// and every method get one and the same 404, and nothing registers; with
// the token the routes answer as before. A new token (a reload) applies to
// the next request.
func TestBootstrapTokenGuardsEveryRoute(t *testing.T) {
	reg := bsMemRegistry(8)
	metrics := prometheus.NewRegistry()
	core, logs := observer.New(zapcore.InfoLevel)
	var mu sync.Mutex
	token := bsToken
	base := serveBootstrapWith(t, reg, zap.NewNop(), BootstrapAccess{
		Token:    func() string { mu.Lock(); defer mu.Unlock(); return token },
		Quiet:    zap.New(core),
		Registry: metrics,
	})
	body := `{"url":"http://10.0.0.1:30000"}`
	notFound := bsErrorBody(msgNotFound)
	sameLength := strings.Repeat("x", len(bsToken))
	refusedPrefixes := []string{
		"",
		"/t/" + sameLength,
		"/t/" + bsToken[:len(bsToken)-1],
		"/t/" + bsToken + "x",
		"/t/x" + bsToken,
		"/t/" + strings.ToUpper(bsToken),
		"/t/",
		"/T/" + bsToken,
		"/" + bsToken,
	}
	routes := []struct{ method, path string }{
		{"POST", "/register_encoder_url"}, {"DELETE", "/unregister_encoder_url"},
		{"GET", "/list_encoder_urls"}, {"GET", "/health"}, {"GET", "/register_encoder_url"}, {"GET", "/nope"},
	}
	n := 0
	for _, pre := range refusedPrefixes {
		for _, r := range routes {
			a := bsCall(t, r.method, base+pre+r.path, body)
			n++
			if a.status != 404 || a.body != notFound || a.header.Get("Allow") != "" {
				t.Errorf("%s %s: %d %q (Allow %q), want 404 %s and nothing else", r.method, pre+r.path, a.status, a.body, a.header.Get("Allow"), notFound)
			}
		}
	}
	if urls, err := reg.listURLs(context.Background()); err != nil || len(urls) != 0 {
		t.Fatalf("after the refused calls the registry holds %v (%v), want nothing", urls, err)
	}
	if got := bsRefused(t, metrics, RefusedToken); got != float64(n) {
		t.Errorf("refused{token} = %v, want %d", got, n)
	}
	for _, e := range logs.All() {
		for _, v := range e.ContextMap() {
			if s, ok := v.(string); ok && strings.Contains(s, bsToken) {
				t.Errorf("a log line shows the token: %v", e.ContextMap())
			}
		}
	}
	if logs.FilterMessageSnippet("not under /t/").Len() == 0 {
		t.Errorf("no refusal logged")
	}

	under := base + "/t/" + bsToken
	if a := bsCall(t, "GET", under+"/health", ""); a.status != 200 || a.body != "OK" {
		t.Fatalf("health under the token: %d %s", a.status, a.body)
	}
	if a := bsCall(t, "POST", under+"/register_encoder_url", body); a.status != 200 || a.body != "OK" {
		t.Fatalf("register under the token: %d %s", a.status, a.body)
	}
	if a := bsCall(t, "GET", under+"/list_encoder_urls", ""); a.status != 200 || a.body != `{"encoder_urls":["http://10.0.0.1:30000"]}` {
		t.Fatalf("list under the token: %d %s", a.status, a.body)
	}
	// The route is what follows the token: the old answers are unchanged.
	if a := bsCall(t, "GET", under+"/register_encoder_url", ""); a.status != 405 || a.header.Get("Allow") != "POST" {
		t.Errorf("wrong method under the token: %d Allow %q, want 405 POST", a.status, a.header.Get("Allow"))
	}
	if a := bsCall(t, "GET", under+"/nope", ""); a.status != 404 || !strings.HasPrefix(a.body, `{"error":"not found: the bootstrap API serves`) {
		t.Errorf("unknown route under the token: %d %s", a.status, a.body)
	}
	// sglang joins f"{url}/register_encoder_url": a URL given with a
	// trailing slash sends //, which the server's path normalisation folds.
	if a := bsCall(t, "GET", under+"//health", ""); a.status != 200 {
		t.Errorf("GET %s//health: %d, want 200", under, a.status)
	}

	mu.Lock()
	token = "rotated-" + bsToken
	mu.Unlock()
	if a := bsCall(t, "GET", under+"/list_encoder_urls", ""); a.status != 404 || a.body != notFound {
		t.Errorf("the old token after a rotation: %d %s, want 404", a.status, a.body)
	}
	if a := bsCall(t, "DELETE", base+"/t/rotated-"+bsToken+"/unregister_encoder_url", body); a.status != 200 {
		t.Errorf("the new token: %d %s", a.status, a.body)
	}
	t.Logf("%d refused calls (9 paths x 6 routes) all 404 %s; refused{token}=%v", n, notFound, bsRefused(t, metrics, RefusedToken))
}

// The token is compared as a whole path segment: one of the right length
// but other content, one shorter or longer (a prefix of it, it with a
// suffix) are all refused. Timing is not tested (bearer.Equal compares
// SHA-256 digests with crypto/subtle).
func TestBootstrapTokenSegmentCompare(t *testing.T) {
	wrongContent := []byte(bsToken)
	wrongContent[len(wrongContent)-1] ^= 1
	for _, c := range []struct {
		path, route string
		ok          bool
	}{
		{"/t/" + bsToken + "/health", "/health", true},
		{"/t/" + bsToken, "", true},
		{"/t/" + string(wrongContent) + "/health", "", false},
		{"/t/" + bsToken[:len(bsToken)-1] + "/health", "", false},
		{"/t/" + bsToken[:1] + "/health", "", false},
		{"/t/" + bsToken + "0/health", "", false},
		{"/t/" + bsToken + bsToken + "/health", "", false},
		{"/t//health", "", false},
		{"/health", "", false},
		{"/t/" + bsToken[:len(bsToken)/2] + "/" + bsToken[len(bsToken)/2:] + "/health", "", false},
	} {
		route, ok := underToken(c.path, bsToken)
		if ok != c.ok || route != c.route {
			t.Errorf("underToken(%q) = %q, %v; want %q, %v", c.path, route, ok, c.route, c.ok)
		}
	}
}

// resolverFunc is a BootstrapAccess.Resolve from a table; "slow" waits
// for its context (the resolve timeout) to end.
func resolverFunc(table map[string][]string) func(context.Context, string) ([]netip.Addr, error) {
	return func(ctx context.Context, host string) ([]netip.Addr, error) {
		if host == "slow.example" {
			<-ctx.Done()
			return nil, &net.DNSError{Err: ctx.Err().Error(), Name: host, IsTimeout: true}
		}
		ips, ok := table[host]
		if !ok {
			return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
		}
		var out []netip.Addr
		for _, s := range ips {
			out = append(out, netip.MustParseAddr(s))
		}
		return out, nil
	}
}

// allow_networks, on a real socket (the caller is 127.0.0.1): a caller
// outside the networks gets a 403 naming the reason on every route; a
// caller inside may register a URL whose host, or every address its name
// resolves to, is inside, and gets a 400 naming the address otherwise.
// A name that does not exist is a 400; a lookup that times out (at
// ResolveTimeout) a 503 with Retry-After.
func TestBootstrapAllowNetworks(t *testing.T) {
	metrics := prometheus.NewRegistry()
	resolve := resolverFunc(map[string][]string{
		"enc-in.example":    {"127.0.0.7", "::ffff:10.1.2.3"},
		"enc-mixed.example": {"10.1.2.3", "192.168.1.9"},
		"enc-empty.example": {},
	})
	outside := BootstrapAccess{Networks: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, Registry: metrics}
	regOut := bsMemRegistry(8)
	baseOut := serveBootstrapWith(t, regOut, zap.NewNop(), outside)
	for _, r := range []struct{ method, path string }{{"POST", "/register_encoder_url"}, {"GET", "/list_encoder_urls"}, {"GET", "/health"}, {"GET", "/nope"}} {
		a := bsCall(t, r.method, baseOut+r.path, `{"url":"http://10.0.0.1:30000"}`)
		if want := bsErrorBody("forbidden: the caller's address 127.0.0.1 is outside bootstrap.allow_networks"); a.status != 403 || a.body != want {
			t.Errorf("%s %s from outside: %d %s, want 403 %s", r.method, r.path, a.status, a.body, want)
		}
	}
	if urls, _ := regOut.listURLs(context.Background()); len(urls) != 0 {
		t.Errorf("a caller outside the networks registered %v", urls)
	}

	inside := BootstrapAccess{
		Networks: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("10.0.0.0/8")},
		Resolve:  resolve, ResolveTimeout: 20 * time.Millisecond, Registry: metrics,
	}
	reg := bsMemRegistry(8)
	base := serveBootstrapWith(t, reg, zap.NewNop(), inside)
	for _, c := range []struct {
		url        string
		status     int
		body       string
		retryAfter string
	}{
		{"http://10.9.8.7:30000", 200, "OK", ""},
		{"http://[::ffff:10.9.8.6]:30000", 200, "OK", ""},
		{"http://enc-in.example:30000", 200, "OK", ""},
		{"http://192.168.1.9:30000", 400, bsErrorBody("url http://192.168.1.9:30000: host 192.168.1.9 is outside bootstrap.allow_networks"), ""},
		{"http://[fd00::1]:30000", 400, bsErrorBody("url http://[fd00::1]:30000: host fd00::1 is outside bootstrap.allow_networks"), ""},
		{"http://enc-mixed.example:30000", 400, bsErrorBody("url http://enc-mixed.example:30000: host enc-mixed.example resolves to 192.168.1.9, which is outside bootstrap.allow_networks"), ""},
		{"http://enc-gone.example:30000", 400, bsErrorBody("url http://enc-gone.example:30000: host enc-gone.example does not resolve, so it cannot be checked against bootstrap.allow_networks"), ""},
		{"http://enc-empty.example:30000", 400, bsErrorBody("url http://enc-empty.example:30000: host enc-empty.example does not resolve, so it cannot be checked against bootstrap.allow_networks"), ""},
		{"http://slow.example:30000", 503, "", "5"},
		{"ftp://10.0.0.1:1", 400, bsErrorBody(`url "ftp://10.0.0.1:1": scheme must be http or https`), ""},
	} {
		a := bsCall(t, "POST", base+"/register_encoder_url", fmt.Sprintf(`{"url":%q}`, c.url))
		if a.status != c.status || (c.body != "" && a.body != c.body) || a.header.Get("Retry-After") != c.retryAfter {
			t.Errorf("register %s: %d %s (Retry-After %q), want %d %s (%q)", c.url, a.status, a.body, a.header.Get("Retry-After"), c.status, c.body, c.retryAfter)
		}
		if c.status == 503 && !strings.Contains(a.body, "within bootstrap.resolve_timeout 20ms") {
			t.Errorf("the 503 does not name the timeout: %s", a.body)
		}
	}
	a := bsCall(t, "GET", base+"/list_encoder_urls", "")
	if want := `{"encoder_urls":["http://10.9.8.7:30000","http://[::ffff:10.9.8.6]:30000","http://enc-in.example:30000"]}`; a.body != want {
		t.Errorf("list: %s, want %s", a.body, want)
	}
	// An unregistration is not checked: removing is always safe.
	if a := bsCall(t, "DELETE", base+"/unregister_encoder_url", `{"url":"http://192.168.1.9:30000"}`); a.status != 200 {
		t.Errorf("unregister of a URL outside: %d %s", a.status, a.body)
	}
	got := map[string]float64{}
	for _, r := range refusedReasons {
		got[r] = bsRefused(t, metrics, r)
	}
	if want := map[string]float64{RefusedToken: 0, RefusedNetwork: 4, RefusedURLNetwork: 3, RefusedURLResolve: 3}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("refused counts %v, want %v", got, want)
	}
	t.Logf("refused by reason: %v", got)
}

// Both checks at once: the network is checked first (a 403 whatever the
// token), then the token.
func TestBootstrapNetworkBeforeToken(t *testing.T) {
	base := serveBootstrapWith(t, bsMemRegistry(8), zap.NewNop(), BootstrapAccess{
		Token: func() string { return bsToken }, Networks: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}})
	for _, p := range []string{"/health", "/t/" + bsToken + "/health"} {
		if a := bsCall(t, "GET", base+p, ""); a.status != 403 {
			t.Errorf("GET %s from outside: %d, want 403", p, a.status)
		}
	}
}

func TestReadBootstrapToken(t *testing.T) {
	good := secretfiletest.Write(t, "token", bsToken+"\n", 0o640)
	if tok, err := ReadBootstrapToken(good); err != nil || tok != bsToken {
		t.Fatalf("ReadBootstrapToken = %q, %v", tok, err)
	}
	for _, c := range []struct{ name, body, want string }{
		{"short", "abc123", "the token must be at least 32 characters, got 6"},
		{"slash", strings.Repeat("a", 31) + "/", "the token must use only letters, digits and -._~"},
		{"plus", strings.Repeat("a", 31) + "+", "the token must use only letters, digits and -._~"},
		{"percent", strings.Repeat("a", 31) + "%", "the token must use only letters, digits and -._~"},
		{"space", "aaaa " + strings.Repeat("b", 31), "the token must use only letters, digits and -._~"},
		{"base64 padding", strings.Repeat("a", 40) + "==", "the token must use only letters, digits and -._~"},
	} {
		f := secretfiletest.Write(t, "token", c.body+"\n", 0o600)
		_, err := ReadBootstrapToken(f)
		if err == nil || !strings.Contains(err.Error(), "token file "+f+": "+c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
		if err != nil && strings.Contains(err.Error(), c.body) {
			t.Errorf("%s: the error quotes the token: %v", c.name, err)
		}
	}
	open := secretfiletest.Write(t, "token", bsToken+"\n", 0o644)
	if _, err := ReadBootstrapToken(open); err == nil || !strings.Contains(err.Error(), "has mode 0644") {
		t.Errorf("a token file others may read: %v", err)
	}
}

// Every new bootstrap key's problems, each with its field path.
func TestBootstrapAccessValidate(t *testing.T) {
	good := secretfiletest.Write(t, "token", bsToken+"\n", 0o600)
	short := secretfiletest.Write(t, "token", "short\n", 0o600)
	open := secretfiletest.Write(t, "token", bsToken+"\n", 0o604)
	missing := filepath.Join(t.TempDir(), "missing")
	many := make([]string, maxAllowNetworks+1)
	for i := range many {
		many[i] = fmt.Sprintf("10.%d.%d.0/24", i/256, i%256)
	}
	cases := []struct {
		name string
		set  func(*BootstrapConfig)
		want string // "" = valid
	}{
		{"token only", func(c *BootstrapConfig) { c.TokenFile = good }, ""},
		{"networks only", func(c *BootstrapConfig) { c.AllowNetworks = []string{"10.244.0.0/16", "fd00::/8"} }, ""},
		{"both", func(c *BootstrapConfig) { c.TokenFile, c.AllowNetworks = good, []string{"10.244.0.0/16"} }, ""},
		{"insecure", func(c *BootstrapConfig) { c.Insecure = true }, ""},
		{"off, nothing", func(c *BootstrapConfig) { c.Listen = "" }, ""},
		{"neither", func(c *BootstrapConfig) {},
			"bootstrap.listen: serves sglang's bootstrap API, where whoever registers an encoder receives users' images: set bootstrap.token_file (then sglang's --encoder-register-urls is http://HOST:PORT/t/<token>), bootstrap.allow_networks (the networks the encoders are in, e.g. the pod CIDR), or both; or write bootstrap.insecure: true to serve it to whoever reaches it"},
		{"insecure with a token", func(c *BootstrapConfig) { c.Insecure, c.TokenFile = true, good },
			"bootstrap.insecure: cannot be true with token_file or allow_networks: they would not be required"},
		{"insecure with networks", func(c *BootstrapConfig) { c.Insecure, c.AllowNetworks = true, []string{"10.0.0.0/8"} },
			"bootstrap.insecure: cannot be true with token_file or allow_networks"},
		{"short token", func(c *BootstrapConfig) { c.TokenFile = short },
			"bootstrap.token_file: token file " + short + ": the token must be at least 32 characters, got 5"},
		{"open token file", func(c *BootstrapConfig) { c.TokenFile = open },
			"bootstrap.token_file: token file " + open + " has mode 0604, which grants others access: chmod 600 (or 640) it"},
		{"missing token file", func(c *BootstrapConfig) { c.TokenFile = missing },
			"bootstrap.token_file: open " + missing + ": no such file or directory"},
		{"not a CIDR", func(c *BootstrapConfig) { c.AllowNetworks = []string{"10.0.0.0/8", "pods"} },
			`bootstrap.allow_networks[1]: must be a CIDR such as 10.0.0.0/8 or fd00::/8, got "pods"`},
		{"an address", func(c *BootstrapConfig) { c.AllowNetworks = []string{"10.1.2.3"} },
			`bootstrap.allow_networks[0]: "10.1.2.3" is an address, not a CIDR: write 10.1.2.3/32 for it alone`},
		{"host bits", func(c *BootstrapConfig) { c.AllowNetworks = []string{"10.1.2.3/8"} },
			`bootstrap.allow_networks[0]: "10.1.2.3/8" has address bits set past /8: write 10.0.0.0/8`},
		{"everything", func(c *BootstrapConfig) { c.AllowNetworks = []string{"0.0.0.0/0"} },
			`bootstrap.allow_networks[0]: "0.0.0.0/0" takes every address, so it checks nothing`},
		{"everything v6", func(c *BootstrapConfig) { c.AllowNetworks = []string{"::/0"} },
			`bootstrap.allow_networks[0]: "::/0" takes every address`},
		{"mapped", func(c *BootstrapConfig) { c.AllowNetworks = []string{"::ffff:10.0.0.0/104"} },
			`bootstrap.allow_networks[0]: "::ffff:10.0.0.0/104" is an IPv4-mapped IPv6 prefix`},
		{"too many", func(c *BootstrapConfig) { c.AllowNetworks = many },
			"bootstrap.allow_networks: must list at most 256 networks, got 257"},
		{"resolve timeout zero", func(c *BootstrapConfig) { c.TokenFile, c.ResolveTimeout = good, 0 },
			"bootstrap.resolve_timeout: must be above 0 and at most 5s (sglang's registration call gives up after 5 s), got 0s"},
		{"resolve timeout long", func(c *BootstrapConfig) { c.TokenFile, c.ResolveTimeout = good, configfile.Duration(6*time.Second) },
			"bootstrap.resolve_timeout: must be above 0 and at most 5s"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := DefaultBootstrap()
			cfg.Listen = "0.0.0.0:8997"
			c.set(&cfg)
			var p configfile.Problems
			cfg.Validate(&p, "bootstrap")
			err := p.Err()
			if c.want == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Validate: %v\nwant %q", err, c.want)
			}
			if strings.Contains(err.Error(), bsToken) {
				t.Errorf("the problem quotes the token: %v", err)
			}
		})
	}
	cfg := DefaultBootstrap()
	cfg.AllowNetworks = []string{"10.244.0.0/16", "fd00:10:244::/56"}
	if got := fmt.Sprint(cfg.Networks()); got != "[10.244.0.0/16 fd00:10:244::/56]" {
		t.Errorf("Networks() = %s", got)
	}
}
