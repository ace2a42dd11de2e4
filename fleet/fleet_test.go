package fleet

import (
	"fmt"
	"slices"
	"testing"

	"github.com/encgate/encgate/discovery"
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
