package fleet

import (
	"context"
	"maps"
	"net"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/discovery"
	"github.com/encgate/encgate/upstream"
)

// members is the gateway's encoder list from every source: the config file's
// encoders (static), registrations through sglang's bootstrap API and DNS
// answers. A name seen from two sources is one encoder; the file's entry
// wins (it may name an agent and a generation), then a registration, then
// DNS.
//
// An encoder that leaves every source (it unregisters, vanishes from DNS,
// or is removed from the file) drains: from that moment it gets no new
// /encode, while the follow-ups of req_ids pinned to it still go to it.
// Once no live pin and no exchange needs it (upstream.Pool.Drained), the
// next drain check drops it.
type members struct {
	mu         sync.Mutex // serialises apply; protects everything below
	registered []discovery.Member
	dns        []discovery.Member
	// active is what the last apply put in service, by name.
	active map[string]upstream.EncoderConfig
	// draining holds encoders that left their sources and still hold pins,
	// as they were configured when they left.
	draining map[string]upstream.EncoderConfig

	// refused holds the members the last apply left out as this gateway
	// itself ("source name" -> the reason), so that each refusal is logged
	// and counted once, when it starts; unresolved, the URLs whose host
	// name did not resolve ("source url"), logged once each likewise.
	refused    map[string]string
	unresolved map[string]bool

	gauge       *prometheus.GaugeVec   // encgate_fleet_encoders{source,state}
	selfRefused *prometheus.CounterVec // encgate_fleet_self_refused_total{source}
	// draining is signalled when an apply leaves encoders draining: the
	// drain checks run (and arm timers) only while some encoder drains.
	drainWake chan struct{}
}

func newMembers(reg prometheus.Registerer) *members {
	m := &members{
		active:    map[string]upstream.EncoderConfig{},
		draining:  map[string]upstream.EncoderConfig{},
		drainWake: make(chan struct{}, 1),
		gauge: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "encgate_fleet_encoders",
			Help: "Encoders in the fleet by source (static: the config file, registered: sglang's bootstrap API, dns) and state (active: takes new work; draining: left its source, still serves the req_ids pinned to it).",
		}, []string{"source", "state"}),
		selfRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_fleet_self_refused_total",
			Help: "Encoders refused because they are this gateway itself (one of its listeners or its advertise_url), by source: static and dns count each encoder once as it is left out, registered each bootstrap registration answered 400 and each stored registration left out.",
		}, []string{"source"}),
	}
	for _, src := range []string{upstream.SourceStatic, upstream.SourceRegistered, upstream.SourceDNS} {
		m.selfRefused.WithLabelValues(src)
	}
	if reg != nil {
		reg.MustRegister(m.gauge, m.selfRefused)
	}
	return m
}

// merge returns the encoder list for static plus the discovered members
// registered and dns, with the draining encoders after the active ones,
// and updates the draining set: an active encoder missing from the new
// list starts to drain, and a draining one that is back in a source is
// active again. An encoder named in self (refused as this gateway itself)
// does not drain: it leaves at once, as its pins could only loop. m.mu is
// held.
func (m *members) merge(static []upstream.EncoderConfig, registered, dns []discovery.Member, self map[string]bool) (list []upstream.EncoderConfig, left []string) {
	list = make([]upstream.EncoderConfig, 0, len(static)+len(registered)+len(dns)+len(m.draining))
	seen := map[string]bool{} // names and URLs: either seen makes a member the same encoder
	for _, ec := range static {
		ec.Source, ec.Draining, ec.Joining = upstream.SourceStatic, false, false
		list = append(list, ec)
		seen[ec.Name], seen[ec.URL] = true, true
	}
	for _, src := range [][]discovery.Member{registered, dns} {
		for _, m := range src {
			if seen[m.Name] || seen[m.URL] {
				continue
			}
			seen[m.Name], seen[m.URL] = true, true
			list = append(list, upstream.EncoderConfig{Name: m.Name, URL: m.URL, Source: m.Source, Joining: true})
		}
	}
	next := make(map[string]upstream.EncoderConfig, len(list))
	for _, ec := range list {
		next[ec.Name] = ec
		delete(m.draining, ec.Name)
	}
	for name := range self {
		if _, stays := next[name]; !stays {
			delete(m.draining, name)
		}
	}
	for name, ec := range m.active {
		if _, stays := next[name]; !stays && !self[name] {
			ec.Draining, ec.Joining = true, false
			m.draining[name] = ec
			left = append(left, name)
		}
	}
	sort.Strings(left)
	m.active = next
	names := make([]string, 0, len(m.draining))
	for name := range m.draining {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		list = append(list, m.draining[name])
	}
	return list, left
}

// count sets encgate_fleet_encoders from list. m.mu is held.
func (m *members) count(list []upstream.EncoderConfig) {
	m.gauge.Reset()
	for _, src := range []string{upstream.SourceStatic, upstream.SourceRegistered, upstream.SourceDNS} {
		m.gauge.WithLabelValues(src, "active").Set(0)
		m.gauge.WithLabelValues(src, "draining").Set(0)
	}
	for _, ec := range list {
		state := "active"
		if ec.Draining {
			state = "draining"
		}
		m.gauge.WithLabelValues(ec.Source, state).Inc()
	}
}

// apply puts in force the fleet of next (its static encoders and
// settings; nil: the config in force) plus the discovered members. It is
// how every change of the fleet reaches the pool: a reload, a
// registration, a DNS answer, a drain. commit, when set, runs on success
// before the fleet's lock is released: a reload stores its config there, so
// a discovery change applied next uses that config and not the one before.
func (f *Fleet) apply(next *Config, commit func()) (ch Change, err error) {
	m := f.members
	m.mu.Lock()
	defer m.mu.Unlock()
	c := next
	if c == nil {
		c = f.conf()
	}
	prevActive, prevDraining := maps.Clone(m.active), maps.Clone(m.draining)
	static, registered, dns, self := f.withoutSelf(c)
	list, left := m.merge(static, registered, dns, self)
	set := c.Pool
	set.Encoders = list
	added, removed, err := f.pool.Reload(set)
	if err != nil {
		m.active, m.draining = prevActive, prevDraining // nothing changed
		return Change{}, err
	}
	ch = Change{Added: added, Removed: removed, Draining: left}
	m.count(list)
	if len(m.draining) > 0 {
		select {
		case m.drainWake <- struct{}{}:
		default:
		}
	}
	if commit != nil {
		commit()
	}
	return ch, nil
}

// Change is what an apply changed: encoders that started (Added),
// stopped (Removed: dropped after a drain, or a name moved to another URL)
// and started to drain (Draining).
type Change struct{ Added, Removed, Draining []string }

// Empty reports whether the apply changed nothing.
func (c Change) Empty() bool { return len(c.Added)+len(c.Removed)+len(c.Draining) == 0 }

// setDiscovered records a source's members and applies the fleet.
func (f *Fleet) setDiscovered(source string, ms []discovery.Member) {
	f.members.mu.Lock()
	switch source {
	case upstream.SourceRegistered:
		f.members.registered = ms
	case upstream.SourceDNS:
		f.members.dns = ms
	}
	f.members.mu.Unlock()
	ch, err := f.apply(nil, nil)
	if err != nil {
		f.log.Error("fleet change refused", zap.String("source", source), zap.Error(err))
		return
	}
	if !ch.Empty() {
		f.log.Info("fleet changed", zap.String("source", source), zap.Strings("encoders_added", ch.Added),
			zap.Strings("encoders_draining", ch.Draining), zap.Strings("encoders_removed", ch.Removed),
			zap.Int("members", len(ms)))
	}
}

// CheckDrained drops the draining encoders that no longer hold anything,
// and reports whether some still drain. The drain checks call it every
// drainCheckEvery while some encoder drains; a caller may run one now.
func (f *Fleet) CheckDrained() bool {
	done := f.pool.Drained()
	if len(done) == 0 {
		return f.stillDraining()
	}
	f.members.mu.Lock()
	for _, name := range done {
		delete(f.members.draining, name)
	}
	f.members.mu.Unlock()
	if _, err := f.apply(nil, nil); err != nil {
		f.log.Error("dropping drained encoders refused", zap.Strings("encoders", done), zap.Error(err))
		return true
	}
	f.log.Info("drained encoders dropped", zap.Strings("encoders", done))
	return f.stillDraining()
}

func (f *Fleet) stillDraining() bool {
	f.members.mu.Lock()
	defer f.members.mu.Unlock()
	return len(f.members.draining) > 0
}

// drainCheckEvery is how often the gateway looks for drained encoders. The
// check walks the pin table only while some encoder drains.
const drainCheckEvery = time.Second

// runDrainChecks calls CheckDrained every drainCheckEvery while some
// encoder drains, until ctx ends; with none draining it waits for one.
func (f *Fleet) runDrainChecks(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-f.members.drainWake:
		}
		for draining := true; draining; {
			t := f.clk.NewTimer(drainCheckEvery)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C():
				draining = f.CheckDrained()
			}
		}
	}
}

// maxParallelLookups bounds the host-name lookups one apply runs at once.
const maxParallelLookups = 16

// withoutSelf returns c's static encoders and the discovered members less
// those that are this gateway itself (selfGuard.check), and the names of
// those left out. Host names on one of the gateway's ports are looked up
// first, all at once (at most maxParallelLookups in flight, each within
// self_guard.resolve_timeout; a lookup younger than
// self_guard.recheck_interval stands). A name that does not resolve
// refuses nothing. Each refusal is logged and counted once, when it
// starts. f.members.mu is held.
func (f *Fleet) withoutSelf(c *Config) (static []upstream.EncoderConfig, registered, dns []discovery.Member, self map[string]bool) {
	m, g := f.members, f.guard
	ctx := context.Background()
	how := selfCheck{timeout: c.SelfGuard.ResolveTimeout.D(), fresh: c.SelfGuard.RecheckInterval.D()}
	names := map[string]bool{}
	note := func(u string) {
		if h, ok := g.namedHost(u); ok {
			names[h] = true
		}
	}
	for _, ec := range c.Encoders {
		note(ec.URL)
		note(ec.Agent)
	}
	for _, m := range append(append([]discovery.Member(nil), m.registered...), m.dns...) {
		note(m.URL)
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, maxParallelLookups)
	for h := range names {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			_, _ = g.lookup(ctx, h, how)
		}()
	}
	wg.Wait()
	g.keepNames(names)

	refused := map[string]string{}
	unresolved := map[string]bool{}
	self = map[string]bool{}
	isSelf := func(source, name string, urls ...string) bool {
		for _, u := range urls {
			if u == "" {
				continue
			}
			why, err := g.check(ctx, u, how)
			if err != nil {
				key := source + " " + u
				unresolved[key] = true
				if !m.unresolved[key] {
					f.quiet.Info("cannot tell whether an encoder is this gateway: its host name does not resolve; it stays, and is checked again every self_guard.recheck_interval",
						zap.String("source", source), zap.String("encoder", name), zap.String("url", u), zap.Error(err))
				}
				continue
			}
			if why == "" {
				continue
			}
			key := source + " " + name
			refused[key] = u + " " + why
			self[name] = true
			if _, was := m.refused[key]; !was {
				m.selfRefused.WithLabelValues(source).Inc()
				log := f.log
				if source == upstream.SourceRegistered {
					log = f.quiet // registrations come from whoever reaches the bootstrap API
				}
				log.Warn("encoder refused: it is this gateway itself", zap.String("source", source),
					zap.String("encoder", name), zap.String("reason", u+" "+why))
			}
			return true
		}
		return false
	}
	for _, ec := range c.Encoders {
		if !isSelf(upstream.SourceStatic, ec.Name, ec.URL, ec.Agent) {
			static = append(static, ec)
		}
	}
	for _, m := range m.registered {
		if !isSelf(upstream.SourceRegistered, m.Name, m.URL) {
			registered = append(registered, m)
		}
	}
	for _, m := range m.dns {
		if !isSelf(upstream.SourceDNS, m.Name, m.URL) {
			dns = append(dns, m)
		}
	}
	m.refused, m.unresolved = refused, unresolved
	return static, registered, dns, self
}

// bindSelf tells the self check the listeners as bound (the ports a
// listen of :0 got are known only now) and applies the fleet again, so a
// static encoder that turns out to be the gateway leaves before any
// traffic.
func (f *Fleet) bindSelf(boot net.Listener) {
	ls := map[string]net.Addr{"listen": f.ln, "admin_listen": f.adln}
	if boot != nil {
		ls["bootstrap.listen"] = boot.Addr()
	}
	f.guard.bind(ls)
	f.reapply("self check")
}

// RecheckSelf looks up every encoder host name again and applies the
// fleet, so a name that now resolves to the gateway (or resolves at all)
// is checked; it reports whether some name is still kept.
func (f *Fleet) RecheckSelf() bool {
	if f.guard.expireNames() == 0 {
		return false
	}
	f.reapply("self recheck")
	return f.guard.namesKept() > 0
}

// reapply applies the fleet in force again and logs what changed.
func (f *Fleet) reapply(why string) {
	ch, err := f.apply(nil, nil)
	if err != nil {
		f.log.Error("fleet change refused", zap.String("cause", why), zap.Error(err))
		return
	}
	if !ch.Empty() {
		f.log.Info("fleet changed", zap.String("cause", why), zap.Strings("encoders_added", ch.Added),
			zap.Strings("encoders_draining", ch.Draining), zap.Strings("encoders_removed", ch.Removed))
	}
}

// runSelfRechecks calls RecheckSelf every self_guard.recheck_interval
// while the fleet has encoders named by a host name on one of the
// gateway's ports, until ctx ends; with none it waits for one (no timer).
func (f *Fleet) runSelfRechecks(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-f.guard.named:
		}
		for named := true; named; {
			t := f.clk.NewTimer(f.conf().SelfGuard.RecheckInterval.D())
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C():
			}
			named = f.RecheckSelf()
		}
	}
}

// registrationSelfCheck is the registry's discovery.SelfCheck: a
// registration of the gateway itself is refused (400), logged (sampled:
// anyone who reaches the bootstrap API can send them) and counted. A name
// that does not resolve refuses nothing: it joins, and the fleet's checks
// look it up again.
func (f *Fleet) registrationSelfCheck(ctx context.Context, u string) string {
	why, _ := f.guard.check(ctx, u, selfCheck{timeout: f.conf().SelfGuard.ResolveTimeout.D()})
	if why != "" {
		f.members.selfRefused.WithLabelValues(upstream.SourceRegistered).Inc()
		f.quiet.Warn("encoder registration refused: it is this gateway itself", zap.String("url", u), zap.String("reason", why))
	}
	return why
}
