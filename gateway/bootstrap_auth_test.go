package gateway

import (
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/secretfile/secretfiletest"
)

// bootToken is a valid bootstrap token.
const bootToken = "gw-boot-token-0123456789abcdefXYZ"

// authGateway is dynamicGateway with bootstrap.token_file holding
// bootToken (no insecure), and allow_networks as given; it returns the
// token file too.
func authGateway(t *testing.T, networks ...string) (*gw, string) {
	t.Helper()
	file := secretfiletest.Write(t, "bootstrap.token", bootToken+"\n", 0o600)
	return dynamicGateway(t, func(c *Config) {
		c.Bootstrap.Insecure = false
		c.Bootstrap.TokenFile = file
		c.Bootstrap.AllowNetworks = networks
	}), file
}

// joiner starts a fake encoder that registers itself with bootstrap (as
// sglang's --encoder-register-urls bootstrap, the route joined by
// f-string) a few times at most, advertising advertise ("" for its own URL),
// and waits until its registration loop has ended: registered or given up.
func joiner(t *testing.T, name, bootstrap, advertise string) *fakeencoder.Encoder {
	t.Helper()
	e := startFakes(t, 1, func(_ int, o *fakeencoder.Options) {
		o.Name = name
		o.RegisterURLs = []string{bootstrap}
		o.AdvertiseURL = advertise
		o.RegistrationInterval = time.Millisecond
		o.RegistrationAttempts = 3
	})[0]
	select {
	case <-e.RegistrationDone():
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: the registration loop did not end", name)
	}
	return e
}

// registeredNames are /admin/upstreams' registered encoders.
func registeredNames(t *testing.T, g *gw) []string {
	t.Helper()
	var out []string
	for _, r := range upstreamRows(t, g) {
		if r.Source == "registered" {
			out = append(out, r.Name)
		}
	}
	return out
}

// With bootstrap.token_file: an sglang-style registration without the
// token, or with another token, is a 404 and nothing joins (neither the
// fleet nor /list_encoder_urls shows it); with
// --encoder-register-urls http://<bootstrap>/t/<token> the encoder joins.
func TestBootstrapTokenDecidesWhoJoins(t *testing.T) {
	g, _ := authGateway(t)
	addr := "http://" + g.BootstrapAddr()
	under := addr + "/t/" + bootToken

	bare := joiner(t, "bare", addr, "")
	wrong := joiner(t, "wrong", addr+"/t/"+strings.Repeat("x", len(bootToken)), "")
	for _, e := range []*fakeencoder.Encoder{bare, wrong} {
		if s := e.Stats(); s.RegistrationsOK != 0 || s.RegistrationAttempts != 3 {
			t.Errorf("%s: %d of %d registrations accepted, want 0 of 3", e.Stats().Name, s.RegistrationsOK, s.RegistrationAttempts)
		}
	}
	for _, p := range []string{addr + "/register_encoder_url", addr + "/t/" + strings.Repeat("x", len(bootToken)) + "/register_encoder_url",
		addr + "/t/" + bootToken[:8] + "/register_encoder_url"} {
		a := post(t, p, fmt.Sprintf(`{"url":%q}`, bare.URL()))
		if a.status != http.StatusNotFound || a.body != `{"error":"not found"}` {
			t.Errorf("POST %s: %d %s, want 404 {\"error\":\"not found\"}", strings.TrimPrefix(p, addr), a.status, a.body)
		}
	}
	if a := do(t, http.MethodGet, addr+"/list_encoder_urls", ""); a.status != http.StatusNotFound {
		t.Errorf("the bare list: %d %s, want 404", a.status, a.body)
	}

	good := joiner(t, "good", under, "")
	if s := good.Stats(); s.RegistrationsOK != 1 {
		t.Fatalf("the registration under the token: %d of %d accepted", s.RegistrationsOK, s.RegistrationAttempts)
	}
	eventually(t, "the encoder registered under the token usable", func() bool {
		rows := upstreamRows(t, g)
		return len(rows) == 1 && rows[0].Usable
	})
	// The refused ones came first: had any been stored, the fleet computed
	// after the good one's registration would hold it too.
	if got, want := registeredNames(t, g), []string{nameOf(good)}; !slices.Equal(got, want) {
		t.Errorf("the fleet holds %v, want %v", got, want)
	}
	l := do(t, http.MethodGet, under+"/list_encoder_urls", "")
	if want := fmt.Sprintf(`{"encoder_urls":[%q]}`, good.URL()); l.status != 200 || l.body != want {
		t.Errorf("/list_encoder_urls under the token: %d %s, want %s", l.status, l.body, want)
	}
	refused := 3 + 3 + 3 + 1 // the two fakes' attempts, the three POSTs, the bare list
	wantLines(t, scrape(t, g), fmt.Sprintf(`encgate_bootstrap_refused_total{reason="token"} %d`, refused),
		`encgate_bootstrap_refused_total{reason="network"} 0`)

	// sglang unregisters at exit through the same URL.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := good.Unregister(ctx); err != nil {
		t.Fatalf("unregistering under the token: %v", err)
	}
	eventually(t, "the unregistered encoder gone", func() bool { return len(registeredNames(t, g)) == 0 })
	t.Logf("refused: bare %d/%d, wrong token %d/%d attempts; under the token 1/1, joined and left; encgate_bootstrap_refused_total{reason=\"token\"} %d",
		bare.Stats().RegistrationAttempts-bare.Stats().RegistrationsOK, bare.Stats().RegistrationAttempts,
		wrong.Stats().RegistrationAttempts-wrong.Stats().RegistrationsOK, wrong.Stats().RegistrationAttempts, refused)
}

// With bootstrap.allow_networks: a URL whose host is outside them is
// refused with a 400 naming the reason (and does not join), one inside
// joins; a caller outside them gets a 403 naming the reason, token or not.
func TestBootstrapAllowNetworksDecidesWhoJoins(t *testing.T) {
	g, _ := authGateway(t, "127.0.0.0/8")
	under := "http://" + g.BootstrapAddr() + "/t/" + bootToken

	outside := joiner(t, "outside", under, "http://10.1.2.3:30000")
	if s := outside.Stats(); s.RegistrationsOK != 0 {
		t.Errorf("a URL outside allow_networks was accepted")
	}
	a := post(t, under+"/register_encoder_url", `{"url":"http://10.1.2.3:30000"}`)
	if want := `{"error":"url http://10.1.2.3:30000: host 10.1.2.3 is outside bootstrap.allow_networks"}`; a.status != http.StatusBadRequest || a.body != want {
		t.Errorf("register a URL outside: %d %s, want 400 %s", a.status, a.body, want)
	}
	inside := joiner(t, "inside", under, "")
	if s := inside.Stats(); s.RegistrationsOK != 1 {
		t.Fatalf("a URL inside allow_networks: %d accepted", s.RegistrationsOK)
	}
	eventually(t, "the encoder inside usable", func() bool {
		rows := upstreamRows(t, g)
		return len(rows) == 1 && rows[0].Usable
	})
	if got, want := registeredNames(t, g), []string{nameOf(inside)}; !slices.Equal(got, want) {
		t.Errorf("the fleet holds %v, want %v", got, want)
	}
	wantLines(t, scrape(t, g), `encgate_bootstrap_refused_total{reason="url_network"} 4`)

	// The caller (127.0.0.1) outside the networks.
	g2, _ := authGateway(t, "10.0.0.0/8")
	under2 := "http://" + g2.BootstrapAddr() + "/t/" + bootToken
	peer := joiner(t, "peer", under2, "")
	if s := peer.Stats(); s.RegistrationsOK != 0 {
		t.Errorf("a caller outside allow_networks registered")
	}
	for _, p := range []string{under2 + "/register_encoder_url", "http://" + g2.BootstrapAddr() + "/register_encoder_url"} {
		a := post(t, p, `{"url":"http://10.1.2.3:30000"}`)
		if want := `{"error":"forbidden: the caller's address 127.0.0.1 is outside bootstrap.allow_networks"}`; a.status != http.StatusForbidden || a.body != want {
			t.Errorf("POST from outside: %d %s, want 403 %s", a.status, a.body, want)
		}
	}
	if n := len(upstreamRows(t, g2)); n != 0 {
		t.Errorf("the fleet of the gateway that refused the caller holds %d encoders", n)
	}
	wantLines(t, scrape(t, g2), `encgate_bootstrap_refused_total{reason="network"} 5`, `encgate_bootstrap_refused_total{reason="token"} 0`)
	t.Logf("URL outside: 400 %s; caller outside: 403; the encoder inside joined", a.body)
}

// A registered URL's host name is resolved through Deps.Resolve, bounded
// by bootstrap.resolve_timeout; every address must be inside.
func TestBootstrapResolvesRegisteredNames(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen, cfg.Bootstrap.Listen = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	cfg.Bootstrap.AllowNetworks = []string{"127.0.0.0/8"}
	asked := make(chan string, 4)
	g := serveGatewayDeps(t, cfg, Deps{Log: zap.NewNop(),
		Resolver: resolverFunc(func(ctx context.Context, host string) ([]netip.Addr, error) {
			asked <- host
			if _, ok := ctx.Deadline(); !ok {
				return nil, fmt.Errorf("no deadline")
			}
			if host == "enc-in.example" {
				return []netip.Addr{netip.MustParseAddr("127.0.0.9")}, nil
			}
			return []netip.Addr{netip.MustParseAddr("127.0.0.9"), netip.MustParseAddr("10.0.0.1")}, nil
		})})
	base := "http://" + g.BootstrapAddr()
	if a := post(t, base+"/register_encoder_url", `{"url":"http://enc-in.example:30000"}`); a.status != 200 {
		t.Errorf("a name inside: %d %s", a.status, a.body)
	}
	a := post(t, base+"/register_encoder_url", `{"url":"http://enc-out.example:30000"}`)
	if want := `{"error":"url http://enc-out.example:30000: host enc-out.example resolves to 10.0.0.1, which is outside bootstrap.allow_networks"}`; a.status != 400 || a.body != want {
		t.Errorf("a name with one address outside: %d %s, want 400 %s", a.status, a.body, want)
	}
	if got := []string{<-asked, <-asked}; !slices.Equal(got, []string{"enc-in.example", "enc-out.example"}) {
		t.Errorf("resolved %v", got)
	}
}

// bootstrap.token_file is read again on every reload: after the file is
// rewritten (a rotated Secret) and the config reloaded, the old token is
// refused and the new one served; a reload whose file turned unreadable is
// refused and the token in force stays.
func TestBootstrapTokenFileIsReadAgainOnReload(t *testing.T) {
	g, file := authGateway(t)
	addr := "http://" + g.BootstrapAddr()
	const second = "gw-boot-token-second-0123456789abcdef"
	health := func(token string) int {
		t.Helper()
		return do(t, http.MethodGet, addr+"/t/"+token+"/health", "").status
	}
	if health(bootToken) != 200 || health(second) != 404 {
		t.Fatalf("before the rotation: first %d, second %d", health(bootToken), health(second))
	}
	if err := os.WriteFile(file, []byte(second+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if health(bootToken) != 200 {
		t.Fatalf("the rewritten file applied before the reload")
	}
	if err := g.Reload(nextConfig(g)); err != nil {
		t.Fatalf("Reload: %v", err)
	}
	if a, b := health(bootToken), health(second); a != 404 || b != 200 {
		t.Fatalf("after the reload: the old token %d (want 404), the new %d (want 200)", a, b)
	}
	if err := os.WriteFile(file, []byte("short\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	err := g.Reload(nextConfig(g))
	if err == nil || !strings.Contains(err.Error(), "bootstrap.token_file: token file "+file+": the token must be at least 32 characters") {
		t.Fatalf("Reload with a short token: %v", err)
	}
	if health(second) != 200 {
		t.Errorf("the token in force after the refused reload changed")
	}
	wantLines(t, scrape(t, g), `encgate_config_reloads_total{result="refused"} 1`, `encgate_config_reloads_total{result="applied"} 1`)
}

// The config file: bootstrap.listen alone is refused, naming the field
// and what to write; with token_file, allow_networks or insecure it loads.
func TestBootstrapListenNeedsAccessInTheFile(t *testing.T) {
	token := secretfiletest.Write(t, "token", bootToken+"\n", 0o600)
	load := func(extra string) error {
		body := "bootstrap:\n  listen: \"127.0.0.1:8997\"\n" + extra
		_, err := LoadConfig(secretfiletest.Write(t, "gateway.yaml", body, 0o600))
		return err
	}
	err := load("")
	if err == nil || !strings.Contains(err.Error(), "bootstrap.listen: serves sglang's bootstrap API, where whoever registers an encoder receives users' images: set bootstrap.token_file") ||
		!strings.Contains(err.Error(), "bootstrap.insecure: true") {
		t.Errorf("bootstrap.listen alone: %v", err)
	}
	for _, extra := range []string{
		fmt.Sprintf("  token_file: %q\n", token),
		"  allow_networks: [\"10.244.0.0/16\"]\n",
		"  insecure: true\n",
	} {
		if err := load(extra); err != nil {
			t.Errorf("%s: %v", strings.TrimSpace(extra), err)
		}
	}
	if err := load("  insecure: true\n  allow_networks: [\"10.244.0.0/16\"]\n"); err == nil || !strings.Contains(err.Error(), "bootstrap.insecure: cannot be true with token_file or allow_networks") {
		t.Errorf("insecure with allow_networks: %v", err)
	}
}

// resolverFunc makes a func a Resolver (network is always "ip" here).
type resolverFunc func(ctx context.Context, host string) ([]netip.Addr, error)

func (f resolverFunc) LookupNetIP(ctx context.Context, _, host string) ([]netip.Addr, error) {
	return f(ctx, host)
}
