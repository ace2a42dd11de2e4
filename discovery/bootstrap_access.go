package discovery

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/bearer"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/secretfile"
)

// Who may use the bootstrap API. sglang's encoders send no token, but the
// registration URL is theirs to choose and sglang joins the route onto it as
// it is (f"{url}/register_encoder_url"), so a token in that URL's path costs
// them nothing: with bootstrap.token_file the routes are served only under
// /t/<token>/. With bootstrap.allow_networks the caller's address, and the
// addresses of the URL it registers, must be in the listed networks.

// MinBootstrapTokenLen is the shortest bootstrap token accepted: 32
// characters, e.g. `openssl rand -hex 16` (128 bits).
const MinBootstrapTokenLen = 32

// maxAllowNetworks bounds bootstrap.allow_networks: every request is
// checked against the list in turn, and a cluster has a few pod CIDRs.
const maxAllowNetworks = 256

// maxResolveTimeout bounds bootstrap.resolve_timeout: sglang's registration
// call times out after 5 s, so a longer wait would answer nobody.
const maxResolveTimeout = 5 * time.Second

// bootstrapTokenPrefix is the path segment before the token.
const bootstrapTokenPrefix = "/t/"

// Reasons of encgate_bootstrap_refused_total.
const (
	// RefusedToken: the path is not under /t/<token>/ (no token, or
	// another one): 404.
	RefusedToken = "token"
	// RefusedNetwork: the caller's address is outside allow_networks: 403.
	RefusedNetwork = "network"
	// RefusedURLNetwork: an address of the registered URL's host is
	// outside allow_networks: 400.
	RefusedURLNetwork = "url_network"
	// RefusedURLResolve: the registered URL's host name did not resolve
	// (400 when it does not exist, 503 when the lookup failed).
	RefusedURLResolve = "url_resolve"
)

// refusedReasons are the reasons, each series created at zero.
var refusedReasons = []string{RefusedToken, RefusedNetwork, RefusedURLNetwork, RefusedURLResolve}

// ReadBootstrapToken reads the token in the file at path (bootstrap.token_file)
// with secretfile.Read, the rules of every token file: its content without
// surrounding whitespace, refused when the file is not a regular file, is
// over 4KiB, is empty, or, on Unix, grants any permission to others. It
// also refuses a token shorter than MinBootstrapTokenLen or with a
// character outside letters, digits and -._~ (RFC 3986's unreserved set,
// which a URL path carries as it is). Its errors name the path, never the
// token.
func ReadBootstrapToken(path string) (string, error) {
	token, err := secretfile.Read(path, "token file")
	if err != nil {
		return "", err
	}
	if ps := bootstrapTokenProblems(token); len(ps) > 0 {
		return "", fmt.Errorf("token file %s: the token %s", path, strings.Join(ps, "; it "))
	}
	return token, nil
}

func bootstrapTokenProblems(token string) []string {
	var out []string
	if len(token) < MinBootstrapTokenLen {
		out = append(out, fmt.Sprintf("must be at least %d characters, got %d", MinBootstrapTokenLen, len(token)))
	}
	for i := 0; i < len(token); i++ {
		if !urlUnreserved(token[i]) {
			out = append(out, "must use only letters, digits and -._~, which a URL path carries as they are (e.g. the output of `openssl rand -hex 32`)")
			break
		}
	}
	return out
}

// urlUnreserved reports whether c is in RFC 3986's unreserved set.
func urlUnreserved(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	case c == '-', c == '.', c == '_', c == '~':
		return true
	}
	return false
}

// parseAllowNetwork parses one allow_networks entry, or says what is wrong
// with it.
func parseAllowNetwork(s string) (netip.Prefix, string) {
	pr, err := netip.ParsePrefix(s)
	if err != nil {
		if a, aerr := netip.ParseAddr(s); aerr == nil {
			return netip.Prefix{}, fmt.Sprintf("%q is an address, not a CIDR: write %s/%d for it alone", s, s, a.BitLen())
		}
		return netip.Prefix{}, fmt.Sprintf("must be a CIDR such as 10.0.0.0/8 or fd00::/8, got %q", s)
	}
	switch {
	case pr.Addr().Is4In6():
		return netip.Prefix{}, fmt.Sprintf("%q is an IPv4-mapped IPv6 prefix, which no address is checked against (they are checked as IPv4): write the IPv4 CIDR", s)
	case pr != pr.Masked():
		return netip.Prefix{}, fmt.Sprintf("%q has address bits set past /%d: write %s", s, pr.Bits(), pr.Masked())
	case pr.Bits() == 0:
		return netip.Prefix{}, fmt.Sprintf("%q takes every address, so it checks nothing: list the networks the encoders are in (the pod CIDR)", s)
	}
	return pr, ""
}

// validateAccess checks the keys of who may use the API.
func (c BootstrapConfig) validateAccess(p *configfile.Problems, path string) {
	if c.TokenFile != "" {
		if _, err := ReadBootstrapToken(c.TokenFile); err != nil {
			p.Addf(path+".token_file", "%v", err)
		}
	}
	if n := len(c.AllowNetworks); n > maxAllowNetworks {
		p.Addf(path+".allow_networks", "must list at most %d networks, got %d", maxAllowNetworks, n)
	}
	for i, n := range c.AllowNetworks {
		if _, msg := parseAllowNetwork(n); msg != "" {
			p.Addf(fmt.Sprintf("%s.allow_networks[%d]", path, i), "%s", msg)
		}
	}
	if c.Insecure && (c.TokenFile != "" || len(c.AllowNetworks) > 0) {
		p.Addf(path+".insecure", "cannot be true with token_file or allow_networks: they would not be required")
	}
	if c.Listen != "" && !c.Insecure && c.TokenFile == "" && len(c.AllowNetworks) == 0 {
		p.Addf(path+".listen", "serves sglang's bootstrap API, where whoever registers an encoder receives users' images: "+
			"set %[1]s.token_file (then sglang's --encoder-register-urls is http://HOST:PORT/t/<token>), "+
			"%[1]s.allow_networks (the networks the encoders are in, e.g. the pod CIDR), or both; "+
			"or write %[1]s.insecure: true to serve it to whoever reaches it", path)
	}
	if d := c.ResolveTimeout.D(); d <= 0 || d > maxResolveTimeout {
		p.Addf(path+".resolve_timeout", "must be above 0 and at most %s (sglang's registration call gives up after 5 s), got %s",
			configfile.Duration(maxResolveTimeout), c.ResolveTimeout)
	}
}

// Networks returns AllowNetworks parsed; entries Validate refuses are
// left out.
func (c BootstrapConfig) Networks() []netip.Prefix {
	var out []netip.Prefix
	for _, n := range c.AllowNetworks {
		if pr, msg := parseAllowNetwork(n); msg == "" {
			out = append(out, pr)
		}
	}
	return out
}

// BootstrapAccess is who may use the bootstrap API that Handler serves.
// The zero value lets everyone in (bootstrap.insecure).
type BootstrapAccess struct {
	// Token returns the token the routes are served under, read on every
	// request so that the caller can change it (a reload); nil or "" means
	// none. With one, only /t/<token>/<route> answers; the bare routes and
	// every other token get the same 404, so a caller without it learns
	// nothing of it, and the comparison takes the same time whatever the
	// token sent (bearer.Equal: SHA-256 digests compared in constant time).
	Token func() string
	// Networks, when not empty, must hold the caller's address (else 403)
	// and every address of the host of a URL it registers (else 400).
	Networks []netip.Prefix
	// Resolve returns the addresses of a registered URL's host name; nil
	// is the system resolver.
	Resolve func(ctx context.Context, host string) ([]netip.Addr, error)
	// ResolveTimeout bounds Resolve (bootstrap.resolve_timeout; 2s when 0).
	ResolveTimeout time.Duration
	// Quiet logs the refusals; it should be sampled, as any caller can
	// send them at any rate. nil: the handler's logger.
	Quiet *zap.Logger
	// Registry, when set, receives encgate_bootstrap_refused_total{reason}
	// (reasons token, network, url_network, url_resolve); a second handler
	// on the same registry shares the series.
	Registry prometheus.Registerer
}

// bootstrapGuard is BootstrapAccess ready for the handler.
type bootstrapGuard struct {
	BootstrapAccess
	refused map[string]prometheus.Counter // by reason; nil without a Registry
}

func newBootstrapGuard(a BootstrapAccess, log *zap.Logger) *bootstrapGuard {
	g := &bootstrapGuard{BootstrapAccess: a}
	if g.Quiet == nil {
		g.Quiet = log
	}
	if g.ResolveTimeout <= 0 {
		g.ResolveTimeout = 2 * time.Second
	}
	if g.Resolve == nil {
		g.Resolve = func(ctx context.Context, host string) ([]netip.Addr, error) {
			return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
		}
	}
	if a.Registry != nil {
		vec := registerOrReuse(a.Registry, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_bootstrap_refused_total",
			Help: "Requests to the bootstrap API refused by bootstrap.token_file or bootstrap.allow_networks, by reason: token (no token or another one in the path, 404), network (the caller's address, 403), url_network (an address of the registered URL's host, 400), url_resolve (the registered URL's host name did not resolve).",
		}, []string{"reason"}))
		g.refused = make(map[string]prometheus.Counter, len(refusedReasons))
		for _, r := range refusedReasons {
			g.refused[r] = vec.WithLabelValues(r)
		}
	}
	return g
}

// count counts a refusal.
func (g *bootstrapGuard) count(reason string) {
	if c := g.refused[reason]; c != nil {
		c.Inc()
	}
}

// msgNotFound is the body of every 404 of a path not under the token: the
// same for no token and a wrong one.
const msgNotFound = "not found"

// admit checks the caller's address and the path's token, answering a
// refusal itself. It returns the route (the path without /t/<token>) and
// whether to go on.
func (g *bootstrapGuard) admit(ctx *fasthttp.RequestCtx) (string, bool) {
	path := string(ctx.Path())
	if len(g.Networks) > 0 {
		peer, ok := netip.AddrFromSlice(ctx.RemoteIP())
		peer = peer.Unmap()
		if !ok || !inNetworks(g.Networks, peer) {
			g.count(RefusedNetwork)
			g.Quiet.Warn("bootstrap: caller refused: its address is outside bootstrap.allow_networks",
				zap.Stringer("remote", ctx.RemoteAddr()), zap.ByteString("method", ctx.Method()))
			bootstrapError(ctx, fasthttp.StatusForbidden, "forbidden: the caller's address "+ctx.RemoteIP().String()+
				" is outside bootstrap.allow_networks")
			return "", false
		}
	}
	want := ""
	if g.Token != nil {
		want = g.Token()
	}
	if want == "" {
		return path, true
	}
	route, ok := underToken(path, want)
	if !ok {
		g.count(RefusedToken)
		// Neither the path nor the token: a near miss would be in the log.
		g.Quiet.Warn("bootstrap: request refused: its path is not under /t/<bootstrap.token_file's token>/",
			zap.Stringer("remote", ctx.RemoteAddr()), zap.ByteString("method", ctx.Method()))
		bootstrapError(ctx, fasthttp.StatusNotFound, msgNotFound)
		return "", false
	}
	return route, true
}

// underToken returns what path has after /t/<want>, and whether its token
// segment is want. The whole segment is compared, in constant time
// whatever its length and content.
func underToken(path, want string) (string, bool) {
	rest, ok := strings.CutPrefix(path, bootstrapTokenPrefix)
	if !ok {
		return "", false
	}
	seg, route := rest, ""
	if i := strings.IndexByte(rest, '/'); i >= 0 {
		seg, route = rest[:i], rest[i:]
	}
	if !bearer.Equal(seg, want) {
		return "", false
	}
	return route, true
}

func inNetworks(nets []netip.Prefix, a netip.Addr) bool {
	if !a.IsValid() {
		return false
	}
	a = a.WithZone("")
	for _, n := range nets {
		if n.Contains(a) {
			return true
		}
	}
	return false
}

// checkURL checks the host of normalised, a URL being registered, against
// Networks, resolving a name within ResolveTimeout; every address must be
// in. It answers a refusal itself and reports whether to go on.
func (g *bootstrapGuard) checkURL(ctx *fasthttp.RequestCtx, normalised string) bool {
	if len(g.Networks) == 0 {
		return true
	}
	_, hostPort, _ := strings.Cut(normalised, "://")
	host, _, err := net.SplitHostPort(hostPort)
	if err != nil { // ParseEncoderURL made it host:port
		host = hostPort
	}
	var addrs []netip.Addr
	if a, err := netip.ParseAddr(host); err == nil {
		addrs = []netip.Addr{a}
	} else {
		// Not under ctx: a *fasthttp.RequestCtx is reset for the next
		// request once the handler returns, and the deadline's timer may
		// still read it then (go test -race caught it). The lookup is
		// bounded by ResolveTimeout (at most 5 s) either way.
		rctx, cancel := context.WithTimeout(context.Background(), g.ResolveTimeout)
		addrs, err = g.Resolve(rctx, host)
		cancel()
		var dnsErr *net.DNSError
		switch {
		case err == nil && len(addrs) == 0, errors.As(err, &dnsErr) && dnsErr.IsNotFound:
			g.count(RefusedURLResolve)
			g.Quiet.Warn("bootstrap: registration refused: its URL's host does not resolve",
				zap.String("url", normalised), zap.Stringer("remote", ctx.RemoteAddr()))
			bootstrapError(ctx, fasthttp.StatusBadRequest, "url "+normalised+": host "+host+
				" does not resolve, so it cannot be checked against bootstrap.allow_networks")
			return false
		case err != nil:
			g.count(RefusedURLResolve)
			g.Quiet.Warn("bootstrap: registration refused: resolving its URL's host failed",
				zap.String("url", normalised), zap.Stringer("remote", ctx.RemoteAddr()), zap.Error(err))
			ctx.Response.Header.Set("Retry-After", retryAfterFull)
			bootstrapError(ctx, fasthttp.StatusServiceUnavailable, "url "+normalised+": resolving host "+host+
				" (within bootstrap.resolve_timeout "+configfile.Duration(g.ResolveTimeout).String()+
				") failed, so it cannot be checked against bootstrap.allow_networks: "+err.Error())
			return false
		}
	}
	for _, a := range addrs {
		if a = a.Unmap(); !inNetworks(g.Networks, a) {
			g.count(RefusedURLNetwork)
			g.Quiet.Warn("bootstrap: registration refused: its URL's host is outside bootstrap.allow_networks",
				zap.String("url", normalised), zap.String("address", a.String()), zap.Stringer("remote", ctx.RemoteAddr()))
			msg := "url " + normalised + ": host " + host
			if a.String() != host {
				msg += " resolves to " + a.String() + ", which is"
			} else {
				msg += " is"
			}
			bootstrapError(ctx, fasthttp.StatusBadRequest, msg+" outside bootstrap.allow_networks")
			return false
		}
	}
	return true
}
