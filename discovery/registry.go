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

	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
)

// SourceRegistered is the Member.Source of encoders that registered through
// the bootstrap API.
const SourceRegistered = "registered"

// ErrFull is returned by Register (and Store.Add) when a new URL would take
// the registry past bootstrap.max_encoders. It bounds what unauthenticated
// callers of the bootstrap API can make the gateway hold and health-check;
// the handler answers it with a 503 and Retry-After, and sglang's encoder
// retries every 5 s, so it gets in once another encoder leaves.
var ErrFull = errors.New("bootstrap.max_encoders encoders are registered")

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
type Store interface {
	// Add registers url for ttl, or moves its expiry to now+ttl when it is
	// live already, and clears its tombstone. A url that is not live is
	// refused with ErrFull while max URLs are live. The check and the add
	// are one step, so two replicas cannot both pass the bound.
	Add(ctx context.Context, url string, ttl time.Duration, max int) error
	// Refresh moves the expiry of each of urls that is live to now+ttl
	// (RefreshExtended) and stores again, for ttl, each that the store
	// lacks (RefreshReasserted), unless it has a tombstone
	// (RefreshUnregistered) or max URLs are live (RefreshFull). Each URL is
	// checked and written in one step with the others, so a refresh racing
	// an unregistration on another replica cannot bring the URL back.
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
// for a gateway without replicas; clk decides expiry.
func NewMemoryStore(clk clock.Clock) Store {
	return &memoryStore{clk: clk, live: make(map[string]time.Time), gone: make(map[string]time.Time)}
}

// memoryStore is the in-process Store.
type memoryStore struct {
	clk  clock.Clock
	mu   sync.Mutex           // protects live and gone
	live map[string]time.Time // url -> expiry
	gone map[string]time.Time // url -> its tombstone's expiry
}

// sweep drops expired registrations and tombstones; m.mu is held.
func (m *memoryStore) sweep(now time.Time) {
	for u, exp := range m.live {
		if !exp.After(now) {
			delete(m.live, u)
		}
	}
	for u, exp := range m.gone {
		if !exp.After(now) {
			delete(m.gone, u)
		}
	}
}

func (m *memoryStore) Add(_ context.Context, url string, ttl time.Duration, max int) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.clk.Now()
	m.sweep(now)
	if _, ok := m.live[url]; !ok && len(m.live) >= max {
		return ErrFull
	}
	delete(m.gone, url)
	m.live[url] = now.Add(ttl)
	return nil
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
		if cur, ok := m.live[u]; ok {
			if cur.Before(exp) {
				m.live[u] = exp
			}
			out[i] = RefreshExtended
			continue
		}
		if len(m.live) >= max {
			out[i] = RefreshFull
			continue
		}
		m.live[u] = exp
		out[i] = RefreshReasserted
	}
	return out, nil
}

func (m *memoryStore) Remove(_ context.Context, url string, ttl time.Duration, max int) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.clk.Now()
	m.sweep(now)
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
	return nil
}

func (m *memoryStore) List(context.Context) (Listing, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.clk.Now()
	var l Listing
	for u, exp := range m.live {
		if exp.After(now) {
			l.Live = append(l.Live, Lease{URL: u, Left: exp.Sub(now)})
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
// store problems.
func NewRegistry(cfg BootstrapConfig, store Store, clk clock.Clock, log *zap.Logger) *Registry {
	return &Registry{cfg: cfg, store: store, clk: clk, log: log,
		changed: make(chan struct{}, 1), view: make(map[string]time.Time)}
}

// Register validates rawURL and stores its normalised form for TTL.
// Re-registering a URL that is stored already refreshes it and does not
// count against the bound; a new one beyond MaxEncoders gets ErrFull. A
// URL that was unregistered can register again at once. An invalid URL gets
// an error matching ErrInvalidURL, and so does a URL the SelfCheck says is
// the gateway itself (matching ErrSelf too; nothing is stored); any other
// error is the store's.
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
	if err := r.store.Add(ctx, u, r.cfg.TTL.D(), r.cfg.MaxEncoders); err != nil {
		if errors.Is(err, ErrFull) {
			return u, fmt.Errorf("%w (%d); one can register once another unregisters or expires", ErrFull, r.cfg.MaxEncoders)
		}
		return u, err
	}
	r.mu.Lock()
	r.view[u] = start.Add(r.cfg.TTL.D())
	r.mu.Unlock()
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
