package fleet

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"
)

// blockingResolver answers nothing until its context ends.
type blockingResolver struct{}

func (blockingResolver) LookupNetIP(ctx context.Context, _, _ string) ([]netip.Addr, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

// A lookup that runs out of self_guard.resolve_timeout refuses nothing:
// the check says it cannot tell.
func TestSelfGuardLookupTimesOut(t *testing.T) {
	g := newSelfGuard(Config{Listen: "127.0.0.1:8080", AdminListen: "127.0.0.1:9090"}, blockingResolver{}, nil, nil)
	g.bind(map[string]net.Addr{"listen": &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 8080}})
	why, err := g.check(context.Background(), "http://slow.encgate.test:8080", selfCheck{timeout: 20 * time.Millisecond})
	if why != "" || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("check of a name whose lookup runs out: %q %v, want no reason and the deadline", why, err)
	}
}

// The address check itself: a listener on every address takes this host's
// interface addresses (injected), loopback and the unspecified address;
// one on an address takes that address alone; only a listener's port is
// looked at, and names are resolved.
func TestSelfGuardCheck(t *testing.T) {
	g := newSelfGuard(Config{Listen: "127.0.0.1:8080", AdminListen: "127.0.0.1:9090"}, nil, func() ([]net.Addr, error) {
		return []net.Addr{&net.IPNet{IP: net.ParseIP("10.1.2.3"), Mask: net.CIDRMask(24, 32)},
			&net.IPAddr{IP: net.ParseIP("fd00::5")}}, nil
	}, nil)
	g.bind(map[string]net.Addr{
		"listen":           &net.TCPAddr{IP: net.IPv6unspecified, Port: 8080},
		"admin_listen":     &net.TCPAddr{IP: net.ParseIP("10.1.2.3"), Port: 9090},
		"bootstrap.listen": nil,
	})
	how := selfCheck{timeout: time.Second}
	for _, c := range []struct{ url, want string }{
		{"http://10.1.2.3:8080", "is this gateway's own listen address ([::]:8080, which takes every local address)"},
		{"http://[fd00::5]:8080", "is this gateway's own listen address ([::]:8080, which takes every local address)"},
		{"http://[::ffff:10.1.2.3]:8080", "is this gateway's own listen address ([::]:8080, which takes every local address)"},
		{"http://127.9.9.9:8080", "is this gateway's own listen address ([::]:8080, which takes every local address)"},
		{"http://0.0.0.0:8080", "is this gateway's own listen address ([::]:8080, which takes every local address)"},
		{"http://localhost:8080", "resolves to 127.0.0.1, this gateway's own listen address ([::]:8080, which takes every local address)"},
		{"http://10.1.2.4:8080", ""},
		{"http://10.1.2.3:8081", ""},
		{"http://10.1.2.3:9090", "is this gateway's own admin_listen address (10.1.2.3:9090)"},
		{"http://127.0.0.1:9090", ""},
		{"http://[fd00::5]:9090", ""},
		{"http://no-such-name.invalid:7777", ""}, // no listener on 7777: not even looked up
	} {
		got, err := g.check(context.Background(), c.url, how)
		if strings.HasPrefix(got, "resolves to ::1,") { // /etc/hosts may list ::1 first
			got = strings.Replace(got, "::1", "127.0.0.1", 1)
		}
		if got != c.want || err != nil {
			t.Errorf("%s: %q (%v), want %q", c.url, got, err, c.want)
		}
	}
}
