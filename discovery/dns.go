package discovery

import (
	"context"
	"errors"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
)

// dnsSource is Member.Source for members found by DNS, and the source label
// of encgate_discovery_errors_total for DNS lookups that failed.
const dnsSource = "dns"

// DNSConfig is one DNS name whose addresses are encoders, typically a
// Kubernetes headless Service: its A/AAAA answer lists one address per ready
// pod, so the fleet follows the Service without a config reload.
type DNSConfig struct {
	// Name is the A/AAAA name to look up, e.g.
	// encoders.ns.svc.cluster.local. It goes through the resolver's search
	// list like any other name; end it with a dot to skip the list.
	Name string `yaml:"name"`
	// Port is the encoders' port: an A/AAAA answer carries none.
	Port int `yaml:"port"`
	// Scheme is http (default) or https, the scheme of each member's URL.
	Scheme string `yaml:"scheme"`
	// Interval is the time between lookups (default 10s, at least 1s). A
	// Service's answer changes when pods come and go, which is rare next to
	// this; looking up more often only loads the DNS server.
	Interval configfile.Duration `yaml:"interval"`
	// Resolver is host:port of the DNS server to ask, e.g. 10.96.0.10:53;
	// empty means the system resolver (/etc/resolv.conf).
	Resolver string `yaml:"resolver"`
}

// DefaultDNS returns the defaults of one DNS name: scheme http, interval
// 10s. Name and Port have no sensible default and stay empty, so Validate
// reports them if the file leaves them out.
func DefaultDNS() DNSConfig {
	return DNSConfig{
		Scheme:   "http",
		Interval: configfile.Duration(10 * time.Second),
	}
}

// minDNSInterval is the shortest lookup interval Validate accepts.
const minDNSInterval = time.Second

// maxLookupTimeout bounds one lookup when the interval is longer: a DNS
// server that has not answered in 5 s (glibc's default timeout) will not.
const maxLookupTimeout = 5 * time.Second

// Validate records c's problems in p; path is its field path
// ("discovery.dns[0]").
func (c DNSConfig) Validate(p *configfile.Problems, path string) {
	if msg := checkDNSName(c.Name); msg != "" {
		p.Addf(path+".name", "%s", msg)
	}
	if c.Port < 1 || c.Port > 65535 {
		p.Addf(path+".port", "must be 1..65535, got %d", c.Port)
	}
	if c.Scheme != "http" && c.Scheme != "https" {
		p.Addf(path+".scheme", "must be http or https, got %q", c.Scheme)
	}
	if c.Interval.D() < minDNSInterval {
		p.Addf(path+".interval", "must be >= %s, got %s", minDNSInterval, c.Interval)
	}
	if c.Resolver != "" {
		if msg := checkHostPort(c.Resolver); msg != "" {
			p.Addf(path+".resolver", "%s", msg)
		}
	}
}

// checkDNSName says what is wrong with name as a DNS name to look up, or ""
// when nothing is: at most 253 characters, dot-separated labels of 1 to 63
// letters, digits, hyphens and underscores, none starting or ending with a
// hyphen. One trailing dot (an absolute name) is allowed.
func checkDNSName(name string) string {
	if name == "" {
		return "must not be empty"
	}
	n := strings.TrimSuffix(name, ".")
	if n == "" || len(n) > 253 {
		return "must be a DNS name of 1 to 253 characters, got " + strconv.Quote(name)
	}
	for label := range strings.SplitSeq(n, ".") {
		if label == "" || len(label) > 63 {
			return strconv.Quote(name) + " is not a DNS name: every label between dots must have 1 to 63 characters"
		}
		if label[0] == '-' || label[len(label)-1] == '-' {
			return strconv.Quote(name) + " is not a DNS name: a label must not start or end with a hyphen"
		}
		for i := 0; i < len(label); i++ {
			b := label[i]
			if !(b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' || b == '-' || b == '_') {
				return strconv.Quote(name) + " is not a DNS name: labels hold only letters, digits, '-' and '_'"
			}
		}
	}
	return ""
}

// checkHostPort says what is wrong with s as a DNS server's address, or ""
// when nothing is.
func checkHostPort(s string) string {
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return "must be host:port (an IPv6 address in brackets), got " + strconv.Quote(s)
	}
	if host == "" {
		return "must name a host, got " + strconv.Quote(s)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return "port must be a number 1..65535, got " + strconv.Quote(port)
	}
	return ""
}

// DNSDeps are what a DNS source takes from its caller.
type DNSDeps struct {
	// Log gets a warning for every failed lookup; nil means no logging.
	Log *zap.Logger
	// Registry gets encgate_discovery_errors_total; it is required.
	Registry prometheus.Registerer
	// Clock times the rounds; nil means the wall clock. Lookups themselves
	// are bounded by real time, since the resolver's sockets are.
	Clock clock.Clock
}

// DNS discovers encoders by looking up DNS names again and again. Make one
// with NewDNS and start it with Run.
type DNS struct {
	log   *zap.Logger
	clk   clock.Clock
	errs  prometheus.Counter // encgate_discovery_errors_total{source="dns"}
	names []dnsName
}

// dnsName is one configured name with what it is looked up with.
type dnsName struct {
	cfg      DNSConfig
	port     string // cfg.Port, formatted once
	interval time.Duration
	timeout  time.Duration // per lookup: min(interval, maxLookupTimeout)
	resolver *net.Resolver
}

// NewDNS returns a source for cfgs, each of which should have passed
// Validate (an interval below 1s is raised to the default, never a busy
// loop). It registers encgate_discovery_errors_total on deps.Registry,
// sharing the collector if another source registered it first.
func NewDNS(cfgs []DNSConfig, deps DNSDeps) *DNS {
	d := &DNS{
		log:  deps.Log,
		clk:  deps.Clock,
		errs: discoveryErrors(deps.Registry).WithLabelValues(dnsSource),
	}
	if d.log == nil {
		d.log = zap.NewNop()
	}
	if d.clk == nil {
		d.clk = clock.Real{}
	}
	for _, c := range cfgs {
		n := dnsName{cfg: c, port: strconv.Itoa(c.Port), interval: c.Interval.D()}
		if n.interval < minDNSInterval {
			n.interval = DefaultDNS().Interval.D()
		}
		n.timeout = min(n.interval, maxLookupTimeout)
		n.resolver = newResolver(c.Resolver)
		d.names = append(d.names, n)
	}
	return d
}

// newResolver returns the system resolver for addr "", else a pure-Go
// resolver whose every query (UDP, and TCP for a truncated answer) goes to
// addr, whatever servers /etc/resolv.conf lists.
func newResolver(addr string) *net.Resolver {
	if addr == "" {
		return &net.Resolver{}
	}
	return &net.Resolver{
		PreferGo: true,
		Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var dialer net.Dialer
			return dialer.DialContext(ctx, network, addr)
		},
	}
}

// discoveryErrors returns encgate_discovery_errors_total, registered on reg.
// Every discovery source counts its failures on this one vector, labelled
// by source, so a second source that asks for it gets the collector the
// first registered instead of a registration error.
func discoveryErrors(reg prometheus.Registerer) *prometheus.CounterVec {
	return registerOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "encgate_discovery_errors_total",
		Help: "Discovery attempts that failed, by source (dns: a lookup that timed out or got SERVFAIL, REFUSED or a network error; " +
			"the name keeps its last answer). An NXDOMAIN or empty answer is not an error: it empties that name's fleet.",
	}, []string{"source"}))
}

// lookupResult is the outcome of one name's lookup in a round.
type lookupResult struct {
	addrs []net.IPAddr
	err   error // a failure; nil for an answer, an empty one included
}

// Run looks up every configured name at once and then each again every
// its own interval, until ctx is done; call it once per DNS. After every round in which the union of
// answers changed (and after the first round, even if empty), it calls
// update with the full current list of Members (Source "dns", Name
// "ip:port" with IPv6 in brackets via net.JoinHostPort, URL
// scheme://ip:port), sorted by Name, deduplicated.
//
// A lookup that fails (timeout, SERVFAIL, REFUSED, network error) keeps its
// name's last answer, so a DNS outage does not empty the fleet; it counts
// in encgate_discovery_errors_total{source="dns"} and logs a warning. An
// NXDOMAIN or an answer without addresses is an answer: that name's fleet
// becomes empty. An address found under several names is one member, with
// the scheme of the first name in the config that has it.
//
// The names due in a round are looked up in parallel and the round ends
// when the slowest is done (each bounded by min(interval, 5s)), so a name's
// interval counts from the start of its last round. update is called on
// Run's goroutine and owns the slice it gets; until it returns, no lookups
// run.
func (d *DNS) Run(ctx context.Context, update func([]Member)) {
	next := make([]time.Time, len(d.names)) // zero: due at once
	answers := make([][]net.IPAddr, len(d.names))
	failing := make([]bool, len(d.names))
	results := make([]lookupResult, len(d.names))
	var last []Member
	first := true
	for {
		now := d.clk.Now()
		var wg sync.WaitGroup
		var due []int
		for i := range d.names {
			if !next[i].After(now) {
				due = append(due, i)
				wg.Go(func() { results[i] = d.names[i].lookup(ctx) })
			}
		}
		wg.Wait()
		if ctx.Err() != nil {
			return // lookups cut short by the end of Run are not failures
		}
		for _, i := range due {
			n := &d.names[i]
			next[i] = now.Add(n.interval)
			if r := results[i]; r.err != nil {
				failing[i] = true
				d.errs.Inc()
				d.log.Warn("dns discovery lookup failed; keeping its last answer",
					zap.String("name", n.cfg.Name), zap.String("resolver", n.cfg.Resolver),
					zap.Int("kept", len(answers[i])), zap.Error(r.err))
			} else {
				if failing[i] {
					failing[i] = false
					d.log.Info("dns discovery lookup answered again",
						zap.String("name", n.cfg.Name), zap.Int("addresses", len(r.addrs)))
				}
				answers[i] = r.addrs
			}
		}
		members := d.members(answers)
		if first || !slices.Equal(members, last) {
			first = false
			last = members
			d.log.Info("dns discovery fleet", zap.Int("members", len(members)))
			update(slices.Clone(members))
		}
		if len(next) == 0 {
			<-ctx.Done() // nothing to look up: the first, empty update was all
			return
		}
		wake := slices.MinFunc(next, time.Time.Compare)
		timer := d.clk.NewTimer(wake.Sub(d.clk.Now()))
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-timer.C():
		}
	}
}

// lookup asks for n's A and AAAA records once, within n.timeout. NXDOMAIN
// and no-address answers (both net.DNSError.IsNotFound) are an empty
// answer, not an error.
func (n *dnsName) lookup(ctx context.Context) lookupResult {
	ctx, cancel := context.WithTimeout(ctx, n.timeout)
	defer cancel()
	addrs, err := n.resolver.LookupIPAddr(ctx, n.cfg.Name)
	if err != nil {
		if de, ok := errors.AsType[*net.DNSError](err); ok && de.IsNotFound {
			return lookupResult{}
		}
		return lookupResult{err: err}
	}
	return lookupResult{addrs: addrs}
}

// members is the union of answers as Members, sorted by Name, each Name
// once (the first name in config order wins).
func (d *DNS) members(answers [][]net.IPAddr) []Member {
	seen := map[string]bool{}
	out := []Member{}
	for i, addrs := range answers {
		n := &d.names[i]
		for _, a := range addrs {
			// The zone of a link-local address is dropped: a URL would
			// need it escaped, and encoders are not reached that way.
			hp := net.JoinHostPort(a.IP.String(), n.port)
			if seen[hp] {
				continue
			}
			seen[hp] = true
			out = append(out, Member{Name: hp, URL: n.cfg.Scheme + "://" + hp, Source: dnsSource})
		}
	}
	slices.SortFunc(out, func(a, b Member) int { return strings.Compare(a.Name, b.Name) })
	return out
}
