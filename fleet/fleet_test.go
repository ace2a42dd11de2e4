package fleet

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"go.uber.org/zap"

	"github.com/encgate/encgate/discovery"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/upstream"
)

// A name or URL seen from two sources is one encoder: the file's entry
// wins, then a registration, then DNS. One that leaves every source drains,
// and one that comes back is active again.
func TestFleetMergeDedupesAndDrains(t *testing.T) {
	f := newMembers(nil)
	static := []upstream.EncoderConfig{{Name: "enc-a", URL: "http://10.0.0.1:30000", Agent: "http://10.0.0.1:7401"}}
	f.registered = []discovery.Member{
		{Name: "10.0.0.1:30000", URL: "http://10.0.0.1:30000", Source: "registered"}, // enc-a's URL
		{Name: "10.0.0.2:30000", URL: "http://10.0.0.2:30000", Source: "registered"},
	}
	f.dns = []discovery.Member{
		{Name: "10.0.0.2:30000", URL: "http://10.0.0.2:30000", Source: "dns"}, // registered already
		{Name: "10.0.0.3:30000", URL: "http://10.0.0.3:30000", Source: "dns"},
	}
	list, left := f.merge(static, f.registered, f.dns, nil)
	got := func(l []upstream.EncoderConfig) []string {
		var out []string
		for _, ec := range l {
			out = append(out, fmt.Sprintf("%s %s draining=%v joining=%v", ec.Name, ec.Source, ec.Draining, ec.Joining))
		}
		return out
	}
	want := []string{"enc-a static draining=false joining=false", "10.0.0.2:30000 registered draining=false joining=true",
		"10.0.0.3:30000 dns draining=false joining=true"}
	if g := got(list); !slices.Equal(g, want) || len(left) != 0 {
		t.Fatalf("merge = %v, left %v; want %v", g, left, want)
	}
	if list[0].Agent == "" {
		t.Fatal("the file's entry lost its agent to a registration of the same URL")
	}
	// 10.0.0.2 unregisters but DNS still has it: it stays, now from DNS.
	f.registered = f.registered[:1]
	list, left = f.merge(static, f.registered, f.dns, nil)
	if g := got(list); !slices.Contains(g, "10.0.0.2:30000 dns draining=false joining=true") || len(left) != 0 {
		t.Fatalf("after the registration left: %v, left %v", g, left)
	}
	// 10.0.0.3 leaves DNS: it drains, after the active ones.
	f.dns = f.dns[:1]
	list, left = f.merge(static, f.registered, f.dns, nil)
	if g := got(list); g[len(g)-1] != "10.0.0.3:30000 dns draining=true joining=false" || !slices.Equal(left, []string{"10.0.0.3:30000"}) {
		t.Fatalf("after 10.0.0.3 left DNS: %v, left %v", g, left)
	}
	// It comes back: active again, not listed twice.
	f.dns = append(f.dns, discovery.Member{Name: "10.0.0.3:30000", URL: "http://10.0.0.3:30000", Source: "dns"})
	list, _ = f.merge(static, f.registered, f.dns, nil)
	if g := got(list); len(g) != 3 || g[2] != "10.0.0.3:30000 dns draining=false joining=true" {
		t.Fatalf("after 10.0.0.3 came back: %v", g)
	}
}

// fakePool records what the fleet feeds it; drained is what its next
// Drained reports.
type fakePool struct {
	mu      sync.Mutex
	list    []upstream.EncoderConfig
	drained []string
}

func (p *fakePool) Reload(set upstream.Settings) (added, removed []string, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	was, now := map[string]bool{}, map[string]bool{}
	for _, ec := range p.list {
		was[ec.Name] = true
	}
	for _, ec := range set.Encoders {
		now[ec.Name] = true
		if !was[ec.Name] {
			added = append(added, ec.Name)
		}
	}
	for _, ec := range p.list {
		if !now[ec.Name] {
			removed = append(removed, ec.Name)
		}
	}
	p.list = set.Encoders
	return added, removed, nil
}

func (p *fakePool) Drained() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	d := p.drained
	p.drained = nil
	return d
}

func (p *fakePool) Encoders() []*upstream.Encoder { return nil }

// fed is the pool's list as "name source state".
func (p *fakePool) fed() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []string
	for _, ec := range p.list {
		state := "active"
		if ec.Draining {
			state = "draining"
		}
		out = append(out, ec.Name+" "+ec.Source+" "+state)
	}
	return out
}

// The fleet alone, on a pool of its own: New feeds the file's encoders, an
// encoder at the gateway's advertise_url is left out, an Apply that drops
// one drains it, and the drain check drops it once the pool reports it
// drained.
func TestFleetFeedsThePoolAndDrains(t *testing.T) {
	pool := &fakePool{}
	cfg := Config{
		Listen: "127.0.0.1:0", AdminListen: "127.0.0.1:0", AdvertiseURL: "http://10.0.0.9:8080",
		Encoders: []upstream.EncoderConfig{
			{Name: "enc-a", URL: "http://10.0.0.1:30000"},
			{Name: "enc-b", URL: "http://10.0.0.2:30000"},
			{Name: "enc-self", URL: "http://10.0.0.9:8080"},
		},
		SelfGuard: DefaultSelfGuard(),
	}
	f, err := New(cfg, Deps{Log: zap.NewNop(), Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := pool.fed(), []string{"enc-a static active", "enc-b static active"}; !slices.Equal(got, want) {
		t.Fatalf("fed at New: %v, want %v", got, want)
	}

	next := cfg
	next.Encoders = cfg.Encoders[:1]
	committed := false
	ch, err := f.Apply(next, func() { committed = true })
	if err != nil {
		t.Fatal(err)
	}
	if !committed || len(ch.Added)+len(ch.Removed) != 0 || !slices.Equal(ch.Draining, []string{"enc-b"}) {
		t.Fatalf("Apply without enc-b: %+v, committed %v; want enc-b draining", ch, committed)
	}
	if got, want := pool.fed(), []string{"enc-a static active", "enc-b static draining"}; !slices.Equal(got, want) {
		t.Fatalf("fed after the Apply: %v, want %v", got, want)
	}

	if !f.CheckDrained() {
		t.Fatal("CheckDrained with enc-b still held reports nothing draining")
	}
	pool.mu.Lock()
	pool.drained = []string{"enc-b"}
	pool.mu.Unlock()
	if f.CheckDrained() {
		t.Fatal("CheckDrained after enc-b drained reports some still draining")
	}
	if got, want := pool.fed(), []string{"enc-a static active"}; !slices.Equal(got, want) {
		t.Fatalf("fed after the drain: %v, want %v", got, want)
	}
}

// Validate names the gateway's fields: a static encoder at the gateway's
// own advertise_url is a problem of encoders[i].url.
func TestConfigValidateNamesTheGatewaysFields(t *testing.T) {
	c := Config{Listen: "127.0.0.1:8080", AdminListen: "127.0.0.1:9090", AdvertiseURL: "http://gw.example:8080",
		Encoders:  []upstream.EncoderConfig{{Name: "self", URL: "http://gw.example:8080"}},
		SelfGuard: DefaultSelfGuard(), Fanout: 1}
	var p configfile.Problems
	c.Validate(&p)
	err := p.Err()
	if err == nil || !strings.Contains(err.Error(), "encoders[0].url") || !strings.Contains(err.Error(), "advertise_url") {
		t.Fatalf("Validate = %v, want encoders[0].url named as the advertise_url", err)
	}
}
