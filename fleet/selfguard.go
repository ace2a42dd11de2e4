package fleet

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
)

// The gateway never routes to itself. An encoder whose address is one of
// the gateway's own listeners (listen, admin_listen, bootstrap.listen), or
// its advertise_url, is refused from every source:
//
//   - static (the file, a reload): an encoder URL or agent that names a
//     listener literally (its IP or localhost, and its configured port) is a
//     config error naming the field (checkSelfEncoders, so --check and a
//     reload catch it). What only the running process knows (the ports a
//     listen of :0 bound, this host's interface addresses, what a name
//     resolves to) is checked when the fleet is applied: the encoder is
//     left out, logged and counted.
//   - registered: the bootstrap API answers the registration 400 with the
//     reason (discovery.SelfCheck) and stores nothing; registrations another
//     replica stored are left out when the fleet is applied.
//   - dns: a member that is the gateway is left out of what DNS contributes.
//
// Every refusal counts in encgate_fleet_self_refused_total{source}. What
// addresses cannot show (NAT, a Service in front of the gateway, a second
// gateway chained back) the gateway's hop mark ends (internal/loopguard).

// selfGuard knows the gateway's own addresses and says whether an encoder
// URL leads to one of them.
type selfGuard struct {
	resolver Resolver
	ifaddrs  func() ([]net.Addr, error)
	clk      clock.Clock

	mu        sync.Mutex
	own       []ownAddr                  // the listeners, as bound (or, before Start, as configured)
	advertise string                     // advertise_url's host:port, lower case; "" without one
	names     map[string]resolvedName    // host -> its last lookup, for the fleet's checks
	lookups   map[string]*sync.WaitGroup // hosts being looked up now
	// named is signalled (never blocking; capacity 1) when the fleet's
	// checks keep looked-up names: the rechecks run only while some are.
	named chan struct{}
}

// Resolver looks up a host name's addresses; *net.Resolver is one.
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

// ownAddr is one of the gateway's listeners.
type ownAddr struct {
	field string     // its config key: listen, admin_listen, bootstrap.listen
	shown string     // host:port as bound or configured, for messages
	ip    netip.Addr // the IP it is bound to; invalid: every local address (0.0.0.0, ::, empty)
	port  uint16
}

// resolvedName is one lookup of a host name.
type resolvedName struct {
	addrs []netip.Addr
	err   error
	at    time.Time
}

func newSelfGuard(cfg Config, resolver Resolver, ifaddrs func() ([]net.Addr, error), clk clock.Clock) *selfGuard {
	if resolver == nil {
		resolver = net.DefaultResolver
	}
	if ifaddrs == nil {
		ifaddrs = net.InterfaceAddrs
	}
	return &selfGuard{resolver: resolver, ifaddrs: ifaddrs, clk: clk,
		own: configuredListeners(cfg), advertise: advertisedHostPort(cfg.AdvertiseURL),
		names: map[string]resolvedName{}, lookups: map[string]*sync.WaitGroup{}, named: make(chan struct{}, 1)}
}

// configuredListeners are cfg's listeners whose port is known before they
// are bound: a port of 0, or a host that is a name other than localhost,
// is known only once bound (bind).
func configuredListeners(cfg Config) []ownAddr {
	var out []ownAddr
	for _, l := range [][2]string{{"listen", cfg.Listen}, {"admin_listen", cfg.AdminListen}, {"bootstrap.listen", cfg.Bootstrap.Listen}} {
		host, portText, err := net.SplitHostPort(l[1])
		if err != nil {
			continue
		}
		port, err := strconv.ParseUint(portText, 10, 16)
		if err != nil || port == 0 {
			continue
		}
		o := ownAddr{field: l[0], shown: l[1], port: uint16(port)}
		switch ip, err := netip.ParseAddr(host); {
		case host == "":
		case err == nil:
			if !ip.IsUnspecified() {
				o.ip = ip.Unmap().WithZone("")
			}
		case strings.EqualFold(host, "localhost"):
			o.ip = netip.AddrFrom4([4]byte{127, 0, 0, 1})
		default:
			continue
		}
		out = append(out, o)
	}
	return out
}

// bind replaces the configured listeners by the addresses actually bound
// (a listen of :0 binds a port only then). A nil listener is off.
func (g *selfGuard) bind(listeners map[string]net.Addr) {
	var own []ownAddr
	for _, field := range []string{"listen", "admin_listen", "bootstrap.listen"} {
		a, ok := listeners[field].(*net.TCPAddr)
		if !ok || a == nil {
			continue
		}
		ap := a.AddrPort()
		o := ownAddr{field: field, shown: a.String(), port: ap.Port()}
		if ip := ap.Addr().Unmap().WithZone(""); !ip.IsUnspecified() {
			o.ip = ip
		}
		own = append(own, o)
	}
	g.mu.Lock()
	g.own = own
	g.mu.Unlock()
}

// advertisedHostPort is advertise_url's host:port in lower case (the
// scheme's port when it names none), or "".
func advertisedHostPort(raw string) string {
	u, err := url.Parse(raw)
	if raw == "" || err != nil || u.Host == "" {
		return ""
	}
	port := u.Port()
	if port == "" {
		port = map[string]string{"http": "80", "https": "443"}[u.Scheme]
	}
	return strings.ToLower(net.JoinHostPort(u.Hostname(), port))
}

// selfCheck says how one URL is checked.
type selfCheck struct {
	// timeout bounds a lookup (self_guard.resolve_timeout).
	timeout time.Duration
	// fresh, when positive, lets a lookup younger than it stand
	// (self_guard.recheck_interval), for the fleet's checks; 0 looks up
	// every time and keeps nothing (a registration: any caller can send
	// names, which must not grow what the gateway keeps).
	fresh time.Duration
}

// check says why the encoder at rawURL is this gateway ("" when it is
// not, or when that cannot be told). err is a failed lookup of its host
// name: the encoder is not refused for it.
func (g *selfGuard) check(ctx context.Context, rawURL string, how selfCheck) (reason string, err error) {
	u, perr := url.Parse(rawURL)
	if perr != nil {
		return "", nil
	}
	host := strings.ToLower(u.Hostname())
	port, perr := strconv.ParseUint(u.Port(), 10, 16)
	if perr != nil {
		return "", nil
	}
	g.mu.Lock()
	adv := g.advertise
	var own []ownAddr
	for _, o := range g.own {
		if uint64(o.port) == port {
			own = append(own, o)
		}
	}
	g.mu.Unlock()
	if adv != "" && net.JoinHostPort(host, strconv.FormatUint(port, 10)) == adv {
		return "is this gateway's own advertise_url", nil
	}
	if len(own) == 0 {
		return "", nil // no listener on its port: no lookup needed
	}
	var addrs []netip.Addr
	ip, literal := parseHostIP(host)
	if literal {
		addrs = []netip.Addr{ip}
	} else if addrs, err = g.lookup(ctx, host, how); err != nil {
		return "", err
	}
	return ownMatch(literal, addrs, own, g.localAddrs), nil
}

// parseHostIP is host as an IP address (IPv4-mapped unmapped, no zone).
func parseHostIP(host string) (netip.Addr, bool) {
	ip, err := netip.ParseAddr(strings.Trim(host, "[]"))
	if err != nil {
		return netip.Addr{}, false
	}
	return ip.Unmap().WithZone(""), true
}

// ownMatch says why one of addrs (a host's addresses; literal: the host
// is an address) is one of own, or "". local lists this host's addresses, read
// only when a listener takes every address; nil: none known.
func ownMatch(literal bool, addrs []netip.Addr, own []ownAddr, local func() []netip.Addr) string {
	var locals []netip.Addr
	read := false
	for _, a := range addrs {
		a = a.Unmap().WithZone("")
		for _, o := range own {
			var hit bool
			switch {
			case !o.ip.IsValid(): // every local address
				hit = a.IsLoopback() || a.IsUnspecified()
				if !hit && local != nil {
					if !read {
						locals, read = local(), true
					}
					for _, l := range locals {
						hit = hit || l == a
					}
				}
			default:
				// A connect to 0.0.0.0 or :: reaches the loopback listener.
				hit = a == o.ip || a.IsUnspecified() && o.ip.IsLoopback()
			}
			if !hit {
				continue
			}
			what := fmt.Sprintf("this gateway's own %s address (%s)", o.field, o.shown)
			if !o.ip.IsValid() {
				what = fmt.Sprintf("this gateway's own %s address (%s, which takes every local address)", o.field, o.shown)
			}
			if literal {
				return "is " + what
			}
			return fmt.Sprintf("resolves to %s, %s", a, what)
		}
	}
	return ""
}

// localAddrs are this host's interface addresses; none when they cannot
// be read (loopback and the unspecified address still match).
func (g *selfGuard) localAddrs() []netip.Addr {
	as, err := g.ifaddrs()
	if err != nil {
		return nil
	}
	out := make([]netip.Addr, 0, len(as))
	for _, a := range as {
		var ip net.IP
		switch v := a.(type) {
		case *net.IPNet:
			ip = v.IP
		case *net.IPAddr:
			ip = v.IP
		}
		if x, ok := netip.AddrFromSlice(ip); ok {
			out = append(out, x.Unmap())
		}
	}
	return out
}

// lookup resolves host within how.timeout. With how.fresh a lookup younger
// than it stands, and concurrent lookups of one host share one query.
func (g *selfGuard) lookup(ctx context.Context, host string, how selfCheck) ([]netip.Addr, error) {
	if how.fresh <= 0 {
		return g.query(ctx, host, how.timeout)
	}
	for {
		g.mu.Lock()
		if r, ok := g.names[host]; ok && g.clk.Now().Sub(r.at) < how.fresh {
			g.mu.Unlock()
			return r.addrs, r.err
		}
		if wg, busy := g.lookups[host]; busy {
			g.mu.Unlock()
			wg.Wait()
			continue
		}
		wg := &sync.WaitGroup{}
		wg.Add(1)
		g.lookups[host] = wg
		g.mu.Unlock()
		addrs, err := g.query(ctx, host, how.timeout)
		g.mu.Lock()
		g.names[host] = resolvedName{addrs: addrs, err: err, at: g.clk.Now()}
		delete(g.lookups, host)
		g.mu.Unlock()
		wg.Done()
		return addrs, err
	}
}

// query asks the resolver within timeout.
func (g *selfGuard) query(ctx context.Context, host string, timeout time.Duration) ([]netip.Addr, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return g.resolver.LookupNetIP(ctx, "ip", host)
}

// keepNames drops the lookups of hosts not in keep, and reports how many
// are left: the names the fleet's checks looked up. While some are, the
// rechecks run (named).
func (g *selfGuard) keepNames(keep map[string]bool) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	for h := range g.names {
		if !keep[h] {
			delete(g.names, h)
		}
	}
	if len(g.names) > 0 {
		select {
		case g.named <- struct{}{}:
		default:
		}
	}
	return len(g.names)
}

// namesKept is how many looked-up names the fleet's checks keep.
func (g *selfGuard) namesKept() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.names)
}

// expireNames makes the next check of every name look it up again.
func (g *selfGuard) expireNames() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	n := len(g.names)
	clear(g.names)
	return n
}

// namedHost reports whether rawURL's host is a name (not an address)
// and its port one of the listeners': the URLs whose check looks a name up.
func (g *selfGuard) namedHost(rawURL string) (string, bool) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", false
	}
	host := strings.ToLower(u.Hostname())
	if _, literal := parseHostIP(host); literal || host == "" {
		return "", false
	}
	port, err := strconv.ParseUint(u.Port(), 10, 16)
	if err != nil {
		return "", false
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, o := range g.own {
		if uint64(o.port) == port {
			return host, true
		}
	}
	return "", false
}

// checkSelfEncoders records, for each static encoder whose URL or agent
// names one of c's listeners literally (its address, or localhost, with
// its configured port; a listener on 0.0.0.0 or :: matches loopback), a
// problem naming the field. It needs neither DNS nor this host's
// interfaces, so `--check` on another machine gives the same answer; the
// rest is checked when the fleet is applied.
func checkSelfEncoders(p *configfile.Problems, c Config) {
	own := configuredListeners(c)
	adv := advertisedHostPort(c.AdvertiseURL)
	for i, e := range c.Encoders {
		for _, f := range []struct{ key, raw string }{{"url", e.URL}, {"agent", e.Agent}} {
			if why := staticSelfReason(f.raw, own, adv); why != "" {
				p.Addf(fmt.Sprintf("encoders[%d].%s", i, f.key), "%s %s", f.raw, why)
			}
		}
	}
}

// staticSelfReason is checkSelfEncoders' test of one URL.
func staticSelfReason(raw string, own []ownAddr, adv string) string {
	u, err := url.Parse(raw)
	if raw == "" || err != nil {
		return ""
	}
	host := strings.ToLower(u.Hostname())
	port, err := strconv.ParseUint(u.Port(), 10, 16)
	if err != nil {
		return ""
	}
	if adv != "" && net.JoinHostPort(host, strconv.FormatUint(port, 10)) == adv {
		return "is this gateway's own advertise_url"
	}
	var same []ownAddr
	for _, o := range own {
		if uint64(o.port) == port {
			same = append(same, o)
		}
	}
	ip, literal := parseHostIP(host)
	switch {
	case len(same) == 0:
		return ""
	case literal:
		return ownMatch(true, []netip.Addr{ip}, same, nil)
	case host == "localhost":
		// localhost is loopback on every host this file may run on.
		return ownMatch(true, []netip.Addr{netip.AddrFrom4([4]byte{127, 0, 0, 1}), netip.IPv6Loopback()}, same, nil)
	}
	return ""
}
