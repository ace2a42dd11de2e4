package discovery

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/urlhint"
)

// SourceRegistered is the Member.Source of encoders that registered through
// the bootstrap API.
const SourceRegistered = "registered"

// ErrFull is matched (errors.Is) by the error Register (and Store.Add)
// returns when a new URL would take the registry past
// bootstrap.max_encoders and no registration may make room for it (see
// Room). It bounds what unauthenticated callers of the bootstrap API can
// make the gateway hold and health-check; the handler answers it with a 503
// and Retry-After, and sglang's encoder retries every 5 s, so it gets in
// once another encoder leaves or fails its health checks. The error itself
// is a *FullError, which says why.
var ErrFull = errors.New("bootstrap.max_encoders encoders are registered")

// FullError is a refusal at bootstrap.max_encoders: every registration is
// either passing its health checks or still within its grace (Room.Window)
// to pass them.
type FullError struct {
	Max int
	// Unchecked counts the registrations that have not passed a health
	// check yet and are still within their grace (the store's count; with
	// Redis, approximate while older replicas share the set).
	Unchecked int
	// Window is Room.Window; 0 when the registry makes no room.
	Window time.Duration
}

func (e *FullError) Error() string {
	switch {
	case e.Window <= 0:
		return fmt.Sprintf("%v (%d); one can register once another unregisters or expires", ErrFull, e.Max)
	case e.Unchecked == 0:
		return fmt.Sprintf("bootstrap.max_encoders %d registered encoders, all passing health checks; "+
			"one can register once another unregisters, or fails its health checks for %s", e.Max, e.Window)
	default:
		return fmt.Sprintf("bootstrap.max_encoders %d registered encoders: %d registered less than %s ago "+
			"and not yet through their health checks, the others passing them; retry", e.Max, e.Unchecked, e.Window)
	}
}

// Is makes errors.Is(err, ErrFull) true.
func (e *FullError) Is(target error) bool { return target == ErrFull }

// reason is the refusal's label on encgate_bootstrap_registrations_refused_total.
func (e *FullError) reason() string {
	switch {
	case e.Window <= 0:
		return "full"
	case e.Unchecked == 0:
		return "full_all_passing"
	default:
		return "full_unchecked"
	}
}

// ErrInvalidURL is matched (errors.Is) by every error ParseEncoderURL
// returns, so callers can tell a caller's mistake (a 400) from a store
// failure (a 503) without parsing messages.
var ErrInvalidURL = errors.New("invalid encoder url")

// maxEncoderURLLen bounds a registered URL. sglang registers
// scheme://host:port; anything this long is not a real encoder, and every
// byte is kept, logged and sent to Redis.
const maxEncoderURLLen = 2048

// maxQuotedURL bounds how much of a rejected URL an error quotes, so that a
// hostile registration cannot make error bodies and logs large.
const maxQuotedURL = 128

// encoderURLError is ParseEncoderURL's error: the (shortened) URL and the problem.
type encoderURLError struct {
	raw     string
	problem string
}

func (e *encoderURLError) Error() string { return fmt.Sprintf("url %q: %s", e.raw, e.problem) }

// Is makes errors.Is(err, ErrInvalidURL) true.
func (e *encoderURLError) Is(target error) bool { return target == ErrInvalidURL }

func badEncoderURL(raw, problem string) error {
	if len(raw) > maxQuotedURL {
		raw = raw[:maxQuotedURL] + "..."
	}
	return &encoderURLError{raw: raw, problem: problem}
}

// ParseEncoderURL checks a URL from a registration: http or https, a host
// and a numeric port (1..65535), no userinfo, query, fragment or path
// (trailing slashes are trimmed, so "http://h:1/" and "http://h:1" are one
// encoder). The host must be a DNS name or an IP address.
//
// It returns the normalised URL (scheme and host lowercased, the port
// without leading zeros, an IPv6 address in its canonical form) and the
// Member Name: host:port. A path is refused, as in a configured encoder's
// URL: the pool sends each route to host:port. Normalising makes the registry's
// dedupe a little wider than sglang's exact-string one, on purpose: two
// spellings of one encoder would otherwise be two rendezvous targets.
// Errors match ErrInvalidURL and are short sentences naming the problem,
// e.g. `url "ftp://x:1": scheme must be http or https`.
func ParseEncoderURL(raw string) (normalised, name string, err error) {
	if len(raw) > maxEncoderURLLen {
		return "", "", badEncoderURL(raw, "longer than "+strconv.Itoa(maxEncoderURLLen)+" bytes")
	}
	if meant, ok := urlhint.NoScheme(raw); ok {
		return "", "", badEncoderURL(raw, fmt.Sprintf("has no scheme; did you mean %q?", meant))
	}
	u, perr := url.Parse(raw)
	if perr != nil {
		var ue *url.Error
		msg := "not a URL"
		if errors.As(perr, &ue) {
			msg = "not a URL (" + ue.Err.Error() + ")"
		}
		return "", "", badEncoderURL(raw, msg)
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return "", "", badEncoderURL(raw, "scheme must be http or https")
	case u.Opaque != "" || u.Host == "":
		return "", "", badEncoderURL(raw, "must be scheme://host:port")
	case u.User != nil:
		return "", "", badEncoderURL(raw, "must not carry userinfo")
	case strings.IndexByte(raw, '#') >= 0:
		return "", "", badEncoderURL(raw, "must not have a fragment")
	case u.RawQuery != "" || u.ForceQuery:
		return "", "", badEncoderURL(raw, "must not have a query")
	}
	host, problem := normaliseEncoderHost(u)
	if problem != "" {
		return "", "", badEncoderURL(raw, problem)
	}
	portText := u.Port()
	if portText == "" {
		return "", "", badEncoderURL(raw, "must have a port (host:port)")
	}
	port, aerr := strconv.Atoi(portText)
	if aerr != nil || port < 1 || port > 65535 {
		return "", "", badEncoderURL(raw, "port must be 1..65535")
	}
	if strings.Trim(u.Path, "/") != "" {
		return "", "", badEncoderURL(raw, "must be a base URL without a path (the gateway sends each route to host:port, as to a configured encoder)")
	}
	hostPort := net.JoinHostPort(host, strconv.Itoa(port))
	return u.Scheme + "://" + hostPort, hostPort, nil
}

// normaliseEncoderHost returns u's host lowercased (an IPv6 literal in canonical
// form), or a problem. Only DNS names and IP addresses are accepted: the
// host becomes part of a metric label and a rendezvous identity, so the
// sub-delimiters and percent-escapes RFC 3986 also allows are refused.
func normaliseEncoderHost(u *url.URL) (host, problem string) {
	h := u.Hostname()
	if h == "" {
		return "", "must have a host"
	}
	if strings.HasPrefix(u.Host, "[") {
		addr, err := netip.ParseAddr(h)
		if err != nil || !addr.Is6() {
			return "", "host in brackets must be an IPv6 address"
		}
		if addr.Zone() != "" {
			return "", "host must not carry an IPv6 zone"
		}
		return addr.String(), ""
	}
	h = strings.ToLower(h)
	if len(h) > 253 {
		return "", "host is longer than 253 bytes"
	}
	for i := 0; i < len(h); i++ {
		c := h[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '.' || c == '_') {
			return "", "host must be a DNS name or an IP address"
		}
	}
	if h[0] == '.' || h[0] == '-' || strings.Contains(h, "..") {
		return "", "host must be a DNS name or an IP address"
	}
	return h, ""
}

// Store is where registrations live: in memory (one replica) or Redis
// (shared by replicas, so that they all see the same encoders). The store's
// own clock decides expiry, never the caller's: the memory store's injected
// clock, or Redis's (TIME, read inside its scripts), so that replicas whose
// clocks disagree still agree on what is registered. Times go in as TTLs
// and come out as time left.
//
// A URL is live (registered, until its expiry), unregistered (a tombstone,
// until its own expiry) or unknown. The tombstone is what lets a replica
// re-assert the registrations a store lost (a Redis restarted empty) without
// bringing back one that an encoder took back meanwhile on another replica.
//
// Beside its expiry a live URL has two health facts, on the store's clock:
// when it was registered (a registration of a URL that is live already
// leaves it as it was) and when it last passed a health check, which is
// when it was last refreshed: the gateway refreshes only registered
// encoders that pass their checks, so Refresh is the health signal, and
// with Redis whichever replica saw the encoder pass writes it. Add uses
// them to make room (Room).
type Store interface {
	// Add registers url for ttl, or moves its expiry to now+ttl when it is
	// live already, and clears its tombstone. A url that is not live while
	// room.Max URLs are live takes the place of the first victim in
	// room's order, which leaves as if unregistered (a tombstone for ttl,
	// bounded as Remove's); with no victim it is refused with a *FullError.
	// The check and the add are one step, so two replicas cannot both pass
	// the bound.
	Add(ctx context.Context, url string, ttl time.Duration, room Room) (AddResult, error)
	// Refresh moves the expiry of each of urls that is live to now+ttl
	// (RefreshExtended) and stores again, for ttl, each that the store
	// lacks (RefreshReasserted), unless it has a tombstone
	// (RefreshUnregistered) or max URLs are live (RefreshFull). Each URL is
	// checked and written in one step with the others, so a refresh racing
	// an unregistration on another replica cannot bring the URL back.
	// Every URL extended or stored again has passed a health check now.
	// It returns one outcome per url, in order.
	Refresh(ctx context.Context, urls []string, ttl time.Duration, max int) ([]RefreshOutcome, error)
	// Remove unregisters url: it is no longer live, and a tombstone keeps
	// it out of every Refresh for ttl, whether or not it was live (the
	// store may have lost it). At most max tombstones are kept: past that a
	// new one replaces the one that would expire first.
	Remove(ctx context.Context, url string, ttl time.Duration, max int) error
	// List returns the live URLs, each with its time left, and the URLs
	// with a tombstone.
	List(ctx context.Context) (Listing, error)
}

// Room is how Store.Add makes room at the bound: which live registration,
// if any, a new URL may take the place of. Victims, first to last:
//
//  1. registrations that have never passed a health check and were
//     registered at least Window ago, the oldest registration first;
//  2. registrations whose last passed check is at least Window old, the
//     oldest first (the one failing longest).
//
// Ties go to the smaller URL. A registration that passed a check less than
// Window ago is never a victim, and neither is one registered less than
// Window ago that has not passed one yet: that is its grace to pass its
// first checks, so a new registration cannot be pushed out by the next one
// before it had the chance to show it is alive. A URL that registers again
// while live keeps its registration time, so re-registering does not renew
// the grace; one that was evicted and registers again is new, and has to
// wait for a victim like any other.
type Room struct {
	Max    int           // the most live registrations
	Window time.Duration // the grace and the staleness above; <= 0: make no room, refuse
}

// AddResult is what Store.Add did besides storing the URL.
type AddResult struct {
	Evicted string      // the registration that made room; "" when none had to
	Reason  EvictReason // why it was the victim
}

// EvictReason says why a registration made room: Room's two kinds of victim.
type EvictReason uint8

const (
	// EvictNeverPassed: it never passed a health check within its grace.
	EvictNeverPassed EvictReason = iota + 1
	// EvictFailing: it had not passed a health check for Room.Window.
	EvictFailing
)

// String is the reason's label on encgate_bootstrap_evictions_total.
func (r EvictReason) String() string {
	switch r {
	case EvictNeverPassed:
		return "never_passed"
	case EvictFailing:
		return "failing"
	}
	return "none"
}

// RefreshOutcome is what Store.Refresh did with one URL.
type RefreshOutcome uint8

const (
	// RefreshExtended: the URL was live; its expiry is now+ttl.
	RefreshExtended RefreshOutcome = iota
	// RefreshReasserted: the store lacked the URL (never had it, lost it,
	// or it had expired); it is stored again for ttl.
	RefreshReasserted
	// RefreshUnregistered: the URL has a tombstone; it stays out.
	RefreshUnregistered
	// RefreshFull: the store lacked the URL and max URLs are live; it stays out.
	RefreshFull
)

// Listing is what Store.List returns.
type Listing struct {
	Live []Lease  // the live URLs, sorted by URL
	Gone []string // the URLs with a tombstone (unregistered), sorted
}

// Lease is one live registration: its URL and how long it has left by the
// store's clock.
type Lease struct {
	URL  string
	Left time.Duration
}

// NewMemoryStore returns a Store that keeps registrations in this process,
// for a gateway without replicas; clk decides expiry. A StateFile can keep
// them across restarts.
func NewMemoryStore(clk clock.Clock) Store {
	return &memoryStore{clk: clk, live: make(map[string]*memEntry), gone: make(map[string]time.Time),
		changed: make(chan struct{}, 1)}
}

// memoryStore is the in-process Store.
type memoryStore struct {
	clk  clock.Clock
	mu   sync.Mutex           // protects live and gone
	live map[string]*memEntry // url -> its registration
	gone map[string]time.Time // url -> its tombstone's expiry
	// changed is signalled (never blocking; capacity 1) after every write,
	// for a StateFile.
	changed chan struct{}
}

// memEntry is one live registration of the memory store.
type memEntry struct {
	exp        time.Time // its expiry
	registered time.Time // when it was registered (not moved by registering again)
	passed     time.Time // when it last passed a health check (was refreshed); zero: never
}

// signal notes a write, for a StateFile.
func (m *memoryStore) signal() {
	select {
	case m.changed <- struct{}{}:
	default:
	}
}

// sweep drops expired registrations and tombstones; m.mu is held.
func (m *memoryStore) sweep(now time.Time) {
	for u, e := range m.live {
		if !e.exp.After(now) {
			delete(m.live, u)
		}
	}
	for u, exp := range m.gone {
		if !exp.After(now) {
			delete(m.gone, u)
		}
	}
}

func (m *memoryStore) Add(_ context.Context, url string, ttl time.Duration, room Room) (AddResult, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.clk.Now()
	m.sweep(now)
	if e, ok := m.live[url]; ok {
		e.exp = now.Add(ttl)
		m.signal()
		return AddResult{}, nil
	}
	var res AddResult
	if len(m.live) >= room.Max {
		victim, reason, unchecked := m.victim(now, room)
		if victim == "" {
			return AddResult{}, &FullError{Max: room.Max, Unchecked: unchecked, Window: max(room.Window, 0)}
		}
		m.tomb(victim, now, ttl, room.Max)
		res = AddResult{Evicted: victim, Reason: reason}
	}
	delete(m.gone, url)
	m.live[url] = &memEntry{exp: now.Add(ttl), registered: now}
	m.signal()
	return res, nil
}

// victim returns the registration that makes room at now, by room's order,
// or "" and the number of registrations still in their grace; m.mu is
// held.
func (m *memoryStore) victim(now time.Time, room Room) (victim string, reason EvictReason, unchecked int) {
	if room.Window <= 0 {
		return "", 0, 0
	}
	cut := now.Add(-room.Window)
	var at time.Time // the victim's registration (never passed) or last pass
	for u, e := range m.live {
		r, t := EvictFailing, e.passed
		if e.passed.IsZero() {
			r, t = EvictNeverPassed, e.registered
		}
		if t.After(cut) {
			if r == EvictNeverPassed {
				unchecked++
			}
			continue
		}
		if victim == "" || r < reason || r == reason && (t.Before(at) || t.Equal(at) && u < victim) {
			victim, reason, at = u, r, t
		}
	}
	return victim, reason, unchecked
}

// tomb replaces url's registration, if any, by a tombstone until now+ttl,
// keeping at most max tombstones; m.mu is held.
func (m *memoryStore) tomb(url string, now time.Time, ttl time.Duration, max int) {
	delete(m.live, url)
	if _, ok := m.gone[url]; !ok && len(m.gone) >= max {
		first := ""
		for u, exp := range m.gone {
			if first == "" || exp.Before(m.gone[first]) {
				first = u
			}
		}
		delete(m.gone, first)
	}
	m.gone[url] = now.Add(ttl)
}

func (m *memoryStore) Refresh(_ context.Context, urls []string, ttl time.Duration, max int) ([]RefreshOutcome, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.clk.Now()
	m.sweep(now)
	exp := now.Add(ttl)
	out := make([]RefreshOutcome, len(urls))
	for i, u := range urls {
		if _, ok := m.gone[u]; ok {
			out[i] = RefreshUnregistered
			continue
		}
		if e, ok := m.live[u]; ok {
			if e.exp.Before(exp) {
				e.exp = exp
			}
			e.passed = now
			out[i] = RefreshExtended
			continue
		}
		if len(m.live) >= max {
			out[i] = RefreshFull
			continue
		}
		m.live[u] = &memEntry{exp: exp, registered: now, passed: now}
		out[i] = RefreshReasserted
	}
	for _, o := range out {
		if o == RefreshExtended || o == RefreshReasserted {
			m.signal()
			break
		}
	}
	return out, nil
}

func (m *memoryStore) Remove(_ context.Context, url string, ttl time.Duration, max int) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.clk.Now()
	m.sweep(now)
	m.tomb(url, now, ttl, max)
	m.signal()
	return nil
}

func (m *memoryStore) List(context.Context) (Listing, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.clk.Now()
	var l Listing
	for u, e := range m.live {
		if e.exp.After(now) {
			l.Live = append(l.Live, Lease{URL: u, Left: e.exp.Sub(now)})
		}
	}
	for u, exp := range m.gone {
		if exp.After(now) {
			l.Gone = append(l.Gone, u)
		}
	}
	sort.Slice(l.Live, func(i, j int) bool { return l.Live[i].URL < l.Live[j].URL })
	sort.Strings(l.Gone)
	return l, nil
}

// Registry is the set of encoder URLs registered through the bootstrap API,
// normalised (ParseEncoderURL) and bounded (bootstrap.max_encoders).
//
// A registration lives for bootstrap.ttl. sglang's encoder registers once
// at start (retrying until it gets in) and unregisters at exit, so nothing
// else would ever remove an encoder that crashes or is killed: the gateway
// therefore calls Refresh for the registered encoders that pass its health
// checks, and one that crashed without unregistering leaves the set TTL
// after it stopped answering them. The store's clock decides expiry.
//
// Since an encoder registers only once, the Registry does not trust the
// store to keep what it was told: it keeps its own view of the
// registrations it has seen, each with the end of its registration as last
// known, and Refresh re-asserts those of them that the store lacks (a Redis
// that restarted empty). A registration leaves the view when it is
// unregistered (on any replica: the store's tombstone says so), or when
// the store no longer holds it live and its last known end has passed.
// The end is kept on the Registry's clock as a duration from when the store
// said how long it had left, so only the clock's rate matters, not its
// reading.
type Registry struct {
	cfg   BootstrapConfig
	store Store
	clk   clock.Clock
	log   *zap.Logger
	// window is Room.Window: 0 (no WithRoom) makes no room at the bound.
	window time.Duration
	m      registryMetrics
	// changed is signalled (never blocking; capacity 1) after a local
	// Register or Unregister, or when Refresh learns of an unregistration,
	// so Run recomputes the set at once instead of at its next poll.
	changed chan struct{}
	// self, when set (SetSelfCheck), refuses URLs that are the gateway.
	self SelfCheck

	mu sync.Mutex // protects view
	// view is the registrations this replica serves: URL -> when it ends,
	// as last known, on clk; at most the store's bound plus those it lost.
	view map[string]time.Time
}

// NewRegistry returns a Registry over store. cfg supplies MaxEncoders and
// TTL (of registrations and of tombstones); clk measures how long a
// registration has left and times Run; log receives Run's and Refresh's
// store problems. Without WithRoom a full registry refuses every new URL.
func NewRegistry(cfg BootstrapConfig, store Store, clk clock.Clock, log *zap.Logger, opts ...RegistryOption) *Registry {
	r := &Registry{cfg: cfg, store: store, clk: clk, log: log,
		changed: make(chan struct{}, 1), view: make(map[string]time.Time)}
	for _, o := range opts {
		o(r)
	}
	return r
}

// RegistryOption configures NewRegistry.
type RegistryOption func(*Registry)

// WithRoom lets a full registry make room for a new registration (Room),
// with window as both the grace of a new registration and how long a
// registration that passed may go without passing again. The gateway
// derives it from its health checks: (health.up_after + 2) ×
// health.interval, time for a new encoder to pass its first checks and be
// refreshed, with an interval to spare.
func WithRoom(window time.Duration) RegistryOption {
	return func(r *Registry) { r.window = window }
}

// WithMetrics registers the registry's collectors on reg:
// encgate_bootstrap_evictions_total{reason} and
// encgate_bootstrap_registrations_refused_total{reason}.
func WithMetrics(reg prometheus.Registerer) RegistryOption {
	return func(r *Registry) { r.m = newRegistryMetrics(reg) }
}

// registryMetrics are the registry's collectors; nil ones count nothing.
type registryMetrics struct {
	evictions *prometheus.CounterVec
	refused   *prometheus.CounterVec
}

func newRegistryMetrics(reg prometheus.Registerer) registryMetrics {
	m := registryMetrics{
		evictions: registerOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_bootstrap_evictions_total",
			Help: "Registrations that made room at bootstrap.max_encoders for a new one, by reason: never_passed (no health check passed within its grace) or failing (none passed for the window).",
		}, []string{"reason"})),
		refused: registerOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_bootstrap_registrations_refused_total",
			Help: "Registrations of a new URL refused (503) at bootstrap.max_encoders, by reason: full_all_passing (every registered encoder passes its health checks) or full_unchecked (some are still within their grace to pass them).",
		}, []string{"reason"})),
	}
	for _, r := range []EvictReason{EvictNeverPassed, EvictFailing} {
		m.evictions.WithLabelValues(r.String())
	}
	for _, r := range []string{"full_all_passing", "full_unchecked"} {
		m.refused.WithLabelValues(r)
	}
	return m
}

// Register validates rawURL and stores its normalised form for TTL.
// Re-registering a URL that is stored already refreshes it and does not
// count against the bound. A new one at MaxEncoders takes the place of a
// registration that is not passing its health checks (Room, with
// WithRoom), which leaves as if unregistered; with none, it gets an error
// matching ErrFull (a *FullError). A URL that was unregistered can register
// again at once. An invalid URL gets an error matching ErrInvalidURL, and so
// does a URL the SelfCheck says is the gateway itself (matching ErrSelf too;
// nothing is stored); any other error is the store's.
func (r *Registry) Register(ctx context.Context, rawURL string) error {
	_, err := r.register(ctx, rawURL)
	return err
}

// register is Register that also returns the normalised URL, for logging.
func (r *Registry) register(ctx context.Context, rawURL string) (string, error) {
	u, _, err := ParseEncoderURL(rawURL)
	if err != nil {
		return "", err
	}
	if err := r.checkSelf(ctx, u); err != nil {
		return u, err
	}
	start := r.clk.Now()
	res, err := r.store.Add(ctx, u, r.cfg.TTL.D(), Room{Max: r.cfg.MaxEncoders, Window: r.window})
	if err != nil {
		var full *FullError
		if errors.As(err, &full) && r.m.refused != nil {
			r.m.refused.WithLabelValues(full.reason()).Inc()
		}
		return u, err
	}
	r.mu.Lock()
	r.view[u] = start.Add(r.cfg.TTL.D())
	if res.Evicted != "" {
		delete(r.view, res.Evicted)
	}
	r.mu.Unlock()
	if res.Evicted != "" {
		if r.m.evictions != nil {
			r.m.evictions.WithLabelValues(res.Reason.String()).Inc()
		}
		r.log.Info("registration evicted to make room at bootstrap.max_encoders", zap.String("evicted", res.Evicted),
			zap.String("reason", res.Reason.String()), zap.String("for", u), zap.Int("max_encoders", r.cfg.MaxEncoders))
	}
	r.signal()
	return u, nil
}

// Unregister removes rawURL (normalised as Register does) and leaves a
// tombstone for TTL, so that no replica re-asserts it meanwhile. A URL that
// is not registered is fine: sglang unregisters at exit whether or not it
// ever got in, and a second replica may have removed it already.
func (r *Registry) Unregister(ctx context.Context, rawURL string) error {
	_, err := r.unregister(ctx, rawURL)
	return err
}

// unregister is Unregister that also returns the normalised URL.
func (r *Registry) unregister(ctx context.Context, rawURL string) (string, error) {
	u, _, err := ParseEncoderURL(rawURL)
	if err != nil {
		return "", err
	}
	if err := r.store.Remove(ctx, u, r.cfg.TTL.D(), r.cfg.MaxEncoders); err != nil {
		return u, err
	}
	r.mu.Lock()
	delete(r.view, u)
	r.mu.Unlock()
	r.signal()
	return u, nil
}

// Refresh extends the registrations of those of urls that this replica
// serves: the ones in its view whose last known end has not passed. The
// gateway calls it with the Member URLs of registered encoders that pass
// health checks. One the store lacks (a Redis restarted empty) is stored
// again, unless it was unregistered meanwhile (its tombstone, checked in
// the same step), so a health check that passed just before an encoder
// unregistered cannot bring it back. URLs this replica never saw, or saw
// end, are skipped: a replica does not invent registrations.
//
// When the store cannot be reached the ends of urls move on as if the
// refresh had worked, so that an outage longer than the TTL does not drop
// healthy encoders; they are re-asserted once the store is back.
func (r *Registry) Refresh(ctx context.Context, urls []string) error {
	ttl := r.cfg.TTL.D()
	start := r.clk.Now()
	held := make([]string, 0, len(urls))
	seen := make(map[string]bool, len(urls))
	r.mu.Lock()
	for _, raw := range urls {
		u, _, err := ParseEncoderURL(raw)
		if err != nil || seen[u] {
			continue
		}
		seen[u] = true
		if end, ok := r.view[u]; ok && start.Before(end) {
			held = append(held, u)
		}
	}
	r.mu.Unlock()
	if len(held) == 0 {
		return nil
	}
	outs, err := r.store.Refresh(ctx, held, ttl, r.cfg.MaxEncoders)
	if err == nil && len(outs) != len(held) {
		err = fmt.Errorf("store answered %d outcomes for %d urls", len(outs), len(held))
	}
	end := start.Add(ttl)
	var back, full, gone []string
	r.mu.Lock()
	for i, u := range held {
		cur, ok := r.view[u]
		if !ok { // unregistered here meanwhile
			continue
		}
		switch {
		case err != nil:
			if cur.Before(end) {
				r.view[u] = end
			}
		case outs[i] == RefreshUnregistered:
			delete(r.view, u)
			gone = append(gone, u)
		case outs[i] == RefreshFull:
			full = append(full, u)
		default:
			if outs[i] == RefreshReasserted {
				back = append(back, u)
			}
			r.view[u] = end
		}
	}
	r.mu.Unlock()
	if err != nil {
		return err
	}
	if len(back) > 0 {
		r.log.Info("re-asserted registrations the store lacked", zap.Strings("urls", back))
	}
	if len(full) > 0 {
		r.log.Warn("cannot re-assert registrations the store lacks: bootstrap.max_encoders are registered",
			zap.Strings("urls", full), zap.Int("max_encoders", r.cfg.MaxEncoders))
	}
	if len(gone) > 0 {
		r.signal()
	}
	return nil
}

// Members reads the store and returns this replica's view of the
// registrations as Members with Source "registered", sorted by Name: the
// live ones, and those it saw that the store lacks but whose last known end
// has not passed (Refresh re-asserts them while they pass health checks).
// Unregistered ones leave at once. A stored URL that does not parse (only
// possible when something else wrote the Redis key) is left out.
func (r *Registry) Members(ctx context.Context) ([]Member, error) {
	urls, err := r.read(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]Member, 0, len(urls))
	for _, u := range urls {
		_, name, _ := ParseEncoderURL(u)
		out = append(out, Member{Name: name, URL: u, Source: SourceRegistered})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// read lists the store, merges it into the view and returns the view's
// URLs, sorted.
func (r *Registry) read(ctx context.Context) ([]string, error) {
	start := r.clk.Now()
	l, err := r.store.List(ctx)
	if err != nil {
		return nil, err
	}
	now := r.clk.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	live := make(map[string]bool, len(l.Live))
	for _, e := range l.Live {
		if u, _, err := ParseEncoderURL(e.URL); err != nil || u != e.URL {
			continue
		}
		live[e.URL] = true
		r.view[e.URL] = start.Add(e.Left)
	}
	for _, u := range l.Gone {
		delete(r.view, u)
	}
	urls := make([]string, 0, len(r.view))
	for u, end := range r.view {
		if !live[u] && !now.Before(end) {
			delete(r.view, u)
			continue
		}
		urls = append(urls, u)
	}
	sort.Strings(urls)
	return urls, nil
}

// listURLs returns the view's URLs, sorted, for /list_encoder_urls: the
// fleet this replica serves, as Members does.
func (r *Registry) listURLs(ctx context.Context) ([]string, error) {
	return r.read(ctx)
}

func (r *Registry) signal() {
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

// Run reads the members every interval and calls update with them whenever
// the set changed, and once when it first reads them, until ctx ends. Polling
// is what makes replicas sharing Redis converge on one set, and what makes
// expired registrations leave (at the first poll after they expire) and
// unregistrations on other replicas leave (at the first poll after). A
// local Register or Unregister, or an unregistration Refresh learns of,
// wakes Run at once (a channel signal, not polling), so these changes show
// without waiting for a poll.
//
// While the store cannot be read (Redis down) update is not called: the
// last set stands, rather than every registered encoder vanishing during a
// Redis blip. The failure is logged once, and so is the recovery. update is
// called from Run's goroutine, one call at a time, with a slice it may keep.
// Run one Run per Registry. A non-positive interval means one second.
func (r *Registry) Run(ctx context.Context, interval time.Duration, update func([]Member)) {
	if interval <= 0 {
		interval = time.Second
	}
	var last []Member
	called, failing := false, false
	for {
		ms, err := r.Members(ctx)
		switch {
		case err != nil && ctx.Err() != nil:
			return
		case err != nil:
			if !failing {
				r.log.Warn("cannot read encoder registrations; keeping the last set", zap.Error(err))
				failing = true
			}
		default:
			if failing {
				r.log.Info("encoder registrations readable again")
				failing = false
			}
			if !called || !sameMemberSet(ms, last) {
				called, last = true, ms
				update(append([]Member(nil), ms...))
			}
		}
		t := r.clk.NewTimer(interval)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C():
		case <-r.changed:
			t.Stop()
		}
	}
}

func sameMemberSet(a, b []Member) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
