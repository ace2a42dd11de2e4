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
// (shared by replicas, so that they all see the same encoders). Every
// method takes the time from its caller, the Registry's clock, so that one
// clock decides expiry in both stores; a URL is unexpired while its expiry
// is after now.
type Store interface {
	// Add stores url until expires, or moves its expiry to expires when it
	// is stored already. It first drops expired URLs, then returns ErrFull
	// when url is new and max unexpired URLs are stored. The check and the
	// add are one step, so two replicas cannot both pass the bound.
	Add(ctx context.Context, url string, now, expires time.Time, max int) error
	// Extend moves the expiry of those urls that are stored and unexpired
	// at now to expires, and leaves the others alone, so that a refresh
	// racing an unregistration (perhaps on another replica) does not bring
	// the URL back.
	Extend(ctx context.Context, urls []string, now, expires time.Time) error
	// Remove forgets url; an unknown url is not an error.
	Remove(ctx context.Context, url string) error
	// List returns the URLs unexpired at now, sorted.
	List(ctx context.Context, now time.Time) ([]string, error)
}

// NewMemoryStore returns a Store that keeps registrations in this process,
// for a gateway without replicas.
func NewMemoryStore() Store { return &memoryStore{urls: make(map[string]time.Time)} }

// memoryStore is the in-process Store.
type memoryStore struct {
	mu   sync.Mutex           // protects urls
	urls map[string]time.Time // url -> expiry
}

func (m *memoryStore) Add(_ context.Context, url string, now, expires time.Time, max int) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	for u, exp := range m.urls {
		if !exp.After(now) {
			delete(m.urls, u)
		}
	}
	if _, ok := m.urls[url]; !ok && len(m.urls) >= max {
		return ErrFull
	}
	m.urls[url] = expires
	return nil
}

func (m *memoryStore) Extend(_ context.Context, urls []string, now, expires time.Time) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, u := range urls {
		if exp, ok := m.urls[u]; ok && exp.After(now) && expires.After(exp) {
			m.urls[u] = expires
		}
	}
	return nil
}

func (m *memoryStore) Remove(_ context.Context, url string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.urls, url)
	return nil
}

func (m *memoryStore) List(_ context.Context, now time.Time) ([]string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]string, 0, len(m.urls))
	for u, exp := range m.urls {
		if exp.After(now) {
			out = append(out, u)
		}
	}
	sort.Strings(out)
	return out, nil
}

// Registry is the set of encoder URLs registered through the bootstrap API,
// normalised (ParseEncoderURL) and bounded (bootstrap.max_encoders).
//
// A registration lives for bootstrap.ttl. sglang's encoder registers once
// at start (retrying until it gets in) and unregisters at exit, so nothing
// else would ever remove an encoder that crashes or is killed: the gateway
// therefore calls Refresh for the registered encoders that pass its health
// checks, and one that crashed without unregistering leaves the set TTL
// after it stopped answering them. Both stores apply the TTL
// (expires = now + TTL).
type Registry struct {
	cfg   BootstrapConfig
	store Store
	clk   clock.Clock
	log   *zap.Logger
	// changed is signalled (never blocking; capacity 1) after a local
	// Register or Unregister, so Run recomputes the set at once instead
	// of at its next poll.
	changed chan struct{}
}

// NewRegistry returns a Registry over store. cfg supplies MaxEncoders and
// TTL; clk decides expiry; log receives Run's store problems.
func NewRegistry(cfg BootstrapConfig, store Store, clk clock.Clock, log *zap.Logger) *Registry {
	return &Registry{cfg: cfg, store: store, clk: clk, log: log, changed: make(chan struct{}, 1)}
}

// Register validates rawURL and stores its normalised form for TTL.
// Re-registering a URL that is stored already refreshes it and does not
// count against the bound; a new one beyond MaxEncoders gets ErrFull. An
// invalid URL gets an error matching ErrInvalidURL; any other error is the
// store's.
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
	now := r.clk.Now()
	if err := r.store.Add(ctx, u, now, now.Add(r.cfg.TTL.D()), r.cfg.MaxEncoders); err != nil {
		if errors.Is(err, ErrFull) {
			return u, fmt.Errorf("%w (%d); one can register once another unregisters or expires", ErrFull, r.cfg.MaxEncoders)
		}
		return u, err
	}
	r.signal()
	return u, nil
}

// Unregister removes rawURL (normalised as Register does). A URL that is not
// registered is fine: sglang unregisters at exit whether or not it ever got
// in, and a second replica may have removed it already.
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
	if err := r.store.Remove(ctx, u); err != nil {
		return u, err
	}
	r.signal()
	return u, nil
}

// Refresh extends the TTL of those of urls that are registered and
// unexpired; the others (never registered, unregistered meanwhile, or
// invalid) are skipped, so a health check that passed just before an
// encoder unregistered cannot bring it back. The gateway calls it with the
// Member URLs of registered encoders that pass health checks.
func (r *Registry) Refresh(ctx context.Context, urls []string) error {
	norm := make([]string, 0, len(urls))
	for _, raw := range urls {
		if u, _, err := ParseEncoderURL(raw); err == nil {
			norm = append(norm, u)
		}
	}
	if len(norm) == 0 {
		return nil
	}
	now := r.clk.Now()
	return r.store.Extend(ctx, norm, now, now.Add(r.cfg.TTL.D()))
}

// Members returns the unexpired registrations as Members with Source
// "registered", sorted by Name. A stored URL that does not parse (only
// possible when something else wrote the Redis key) is left out.
func (r *Registry) Members(ctx context.Context) ([]Member, error) {
	urls, err := r.store.List(ctx, r.clk.Now())
	if err != nil {
		return nil, err
	}
	out := make([]Member, 0, len(urls))
	for _, raw := range urls {
		u, name, err := ParseEncoderURL(raw)
		if err != nil || u != raw {
			continue
		}
		out = append(out, Member{Name: name, URL: u, Source: SourceRegistered})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// listURLs returns the unexpired registered URLs, sorted, for
// /list_encoder_urls.
func (r *Registry) listURLs(ctx context.Context) ([]string, error) {
	return r.store.List(ctx, r.clk.Now())
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
// expired registrations leave (at the first poll after they expire). A
// local Register or Unregister wakes Run at once (a channel signal, not
// polling), so this replica's own changes show without waiting for a poll.
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
