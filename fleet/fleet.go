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

// fleet is the gateway's encoder list from every source: the config file's
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
type fleet struct {
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

func newFleet(reg prometheus.Registerer) *fleet {
	f := &fleet{
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
		f.selfRefused.WithLabelValues(src)
	}
	if reg != nil {
		reg.MustRegister(f.gauge, f.selfRefused)
	}
	return f
}

// merge returns the encoder list for static plus the discovered members
// registered and dns, with the draining encoders after the active ones,
// and updates the draining set: an active encoder missing from the new
// list starts to drain, and a draining one that is back in a source is
// active again. An encoder named in self (refused as this gateway itself)
// does not drain: it leaves at once, as its pins could only loop. f.mu is
// held.
func (f *fleet) merge(static []upstream.EncoderConfig, registered, dns []discovery.Member, self map[string]bool) (list []upstream.EncoderConfig, left []string) {
	list = make([]upstream.EncoderConfig, 0, len(static)+len(registered)+len(dns)+len(f.draining))
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
		delete(f.draining, ec.Name)
	}
	for name := range self {
		if _, stays := next[name]; !stays {
			delete(f.draining, name)
		}
	}
	for name, ec := range f.active {
		if _, stays := next[name]; !stays && !self[name] {
			ec.Draining, ec.Joining = true, false
			f.draining[name] = ec
			left = append(left, name)
		}
	}
	sort.Strings(left)
	f.active = next
	names := make([]string, 0, len(f.draining))
	for name := range f.draining {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		list = append(list, f.draining[name])
	}
	return list, left
}

// count sets encgate_fleet_encoders from list. f.mu is held.
func (f *fleet) count(list []upstream.EncoderConfig) {
	f.gauge.Reset()
	for _, src := range []string{upstream.SourceStatic, upstream.SourceRegistered, upstream.SourceDNS} {
		f.gauge.WithLabelValues(src, "active").Set(0)
		f.gauge.WithLabelValues(src, "draining").Set(0)
	}
	for _, ec := range list {
		state := "active"
		if ec.Draining {
			state = "draining"
		}
		f.gauge.WithLabelValues(ec.Source, state).Inc()
	}
}

// applyFleet puts in force the fleet of next (its static encoders and
// settings; nil: the config in force) plus the discovered members. It is
// how every change of the fleet reaches the pool: a reload, a
// registration, a DNS answer, a drain. commit, when set, runs on success
// before the fleet's lock is released: a reload stores its config there, so
// a discovery change applied next uses that config and not the one before.
func (s *Fleet) applyFleet(next *Config, commit func()) (ch Change, err error) {
	f := s.fleet
	f.mu.Lock()
	defer f.mu.Unlock()
	c := next
	if c == nil {
		c = s.conf()
	}
	prevActive, prevDraining := maps.Clone(f.active), maps.Clone(f.draining)
	static, registered, dns, self := s.withoutSelf(c)
	list, left := f.merge(static, registered, dns, self)
	set := c.Pool
	set.Encoders = list
	added, removed, err := s.pool.Reload(set)
	if err != nil {
		f.active, f.draining = prevActive, prevDraining // nothing changed
		return Change{}, err
	}
	ch = Change{Added: added, Removed: removed, Draining: left}
	f.count(list)
	if len(f.draining) > 0 {
		select {
		case f.drainWake <- struct{}{}:
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
func (s *Fleet) setDiscovered(source string, members []discovery.Member) {
	s.fleet.mu.Lock()
	switch source {
	case upstream.SourceRegistered:
		s.fleet.registered = members
	case upstream.SourceDNS:
		s.fleet.dns = members
	}
	s.fleet.mu.Unlock()
	ch, err := s.applyFleet(nil, nil)
	if err != nil {
		s.log.Error("fleet change refused", zap.String("source", source), zap.Error(err))
		return
	}
	if !ch.Empty() {
		s.log.Info("fleet changed", zap.String("source", source), zap.Strings("encoders_added", ch.Added),
			zap.Strings("encoders_draining", ch.Draining), zap.Strings("encoders_removed", ch.Removed),
			zap.Int("members", len(members)))
	}
}

// CheckDrained drops the draining encoders that no longer hold anything,
// and reports whether some still drain.
func (s *Fleet) CheckDrained() bool {
	done := s.pool.Drained()
	if len(done) == 0 {
		return s.stillDraining()
	}
	s.fleet.mu.Lock()
	for _, name := range done {
		delete(s.fleet.draining, name)
	}
	s.fleet.mu.Unlock()
	if _, err := s.applyFleet(nil, nil); err != nil {
		s.log.Error("dropping drained encoders refused", zap.Strings("encoders", done), zap.Error(err))
		return true
	}
	s.log.Info("drained encoders dropped", zap.Strings("encoders", done))
	return s.stillDraining()
}

func (s *Fleet) stillDraining() bool {
	s.fleet.mu.Lock()
	defer s.fleet.mu.Unlock()
	return len(s.fleet.draining) > 0
}

// drainCheckEvery is how often the gateway looks for drained encoders. The
// check walks the pin table only while some encoder drains.
const drainCheckEvery = time.Second

// runDrainChecks calls CheckDrained every drainCheckEvery while some
// encoder drains, until ctx ends; with none draining it waits for one.
func (s *Fleet) runDrainChecks(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.fleet.drainWake:
		}
		for draining := true; draining; {
			t := s.clk.NewTimer(drainCheckEvery)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C():
				draining = s.CheckDrained()
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
// starts. f.mu is held.
func (s *Fleet) withoutSelf(c *Config) (static []upstream.EncoderConfig, registered, dns []discovery.Member, self map[string]bool) {
	f, g := s.fleet, s.guard
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
	for _, m := range append(append([]discovery.Member(nil), f.registered...), f.dns...) {
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
				if !f.unresolved[key] {
					s.quiet.Info("cannot tell whether an encoder is this gateway: its host name does not resolve; it stays, and is checked again every self_guard.recheck_interval",
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
			if _, was := f.refused[key]; !was {
				f.selfRefused.WithLabelValues(source).Inc()
				log := s.log
				if source == upstream.SourceRegistered {
					log = s.quiet // registrations come from whoever reaches the bootstrap API
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
	for _, m := range f.registered {
		if !isSelf(upstream.SourceRegistered, m.Name, m.URL) {
			registered = append(registered, m)
		}
	}
	for _, m := range f.dns {
		if !isSelf(upstream.SourceDNS, m.Name, m.URL) {
			dns = append(dns, m)
		}
	}
	f.refused, f.unresolved = refused, unresolved
	return static, registered, dns, self
}

// bindSelf tells the self check the listeners as bound (the ports a
// listen of :0 got are known only now) and applies the fleet again, so a
// static encoder that turns out to be the gateway leaves before any
// traffic.
func (s *Fleet) bindSelf(boot net.Listener) {
	ls := map[string]net.Addr{"listen": s.ln, "admin_listen": s.adln}
	if boot != nil {
		ls["bootstrap.listen"] = boot.Addr()
	}
	s.guard.bind(ls)
	s.reapply("self check")
}

// RecheckSelf looks up every encoder host name again and applies the
// fleet, so a name that now resolves to the gateway (or resolves at all)
// is checked; it reports whether some name is still kept.
func (s *Fleet) RecheckSelf() bool {
	if s.guard.expireNames() == 0 {
		return false
	}
	s.reapply("self recheck")
	return s.guard.namesKept() > 0
}

// reapply applies the fleet in force again and logs what changed.
func (s *Fleet) reapply(why string) {
	ch, err := s.applyFleet(nil, nil)
	if err != nil {
		s.log.Error("fleet change refused", zap.String("cause", why), zap.Error(err))
		return
	}
	if !ch.Empty() {
		s.log.Info("fleet changed", zap.String("cause", why), zap.Strings("encoders_added", ch.Added),
			zap.Strings("encoders_draining", ch.Draining), zap.Strings("encoders_removed", ch.Removed))
	}
}

// runSelfRechecks calls RecheckSelf every self_guard.recheck_interval
// while the fleet has encoders named by a host name on one of the
// gateway's ports, until ctx ends; with none it waits for one (no timer).
func (s *Fleet) runSelfRechecks(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.guard.named:
		}
		for named := true; named; {
			t := s.clk.NewTimer(s.conf().SelfGuard.RecheckInterval.D())
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C():
			}
			named = s.RecheckSelf()
		}
	}
}

// registrationSelfCheck is the registry's discovery.SelfCheck: a
// registration of the gateway itself is refused (400), logged (sampled:
// anyone who reaches the bootstrap API can send them) and counted. A name
// that does not resolve refuses nothing: it joins, and the fleet's checks
// look it up again.
func (s *Fleet) registrationSelfCheck(ctx context.Context, u string) string {
	why, _ := s.guard.check(ctx, u, selfCheck{timeout: s.conf().SelfGuard.ResolveTimeout.D()})
	if why != "" {
		s.fleet.selfRefused.WithLabelValues(upstream.SourceRegistered).Inc()
		s.quiet.Warn("encoder registration refused: it is this gateway itself", zap.String("url", u), zap.String("reason", why))
	}
	return why
}
