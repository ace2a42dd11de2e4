package admin

import (
	"fmt"
	"net/http"
	"time"

	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/bearer"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/listener"
)

// Config protects and bounds the admin listener. Only the token
// (Token or TokenFile) changes on a reload; the bounds need a restart, as
// the listeners' do.
type Config struct {
	// Token, when set, is required as "Authorization: Bearer <token>" on
	// /admin/... and /debug/pprof/...; /healthz, /readyz and /metrics stay
	// open. At least 16 characters of RFC 6750's token alphabet. Default
	// empty: no token. A reload applies a new token at once. Prefer
	// TokenFile where the config itself is not secret (a ConfigMap).
	Token string `yaml:"token" reload:"live"`
	// TokenFile holds the token instead (bearer.ReadFile: one line, mode
	// 0600 or 0640, the rules of Token). Set at most one of Token and
	// TokenFile. It is read at start and again on every reload, so that
	// rewriting it (a rotated Kubernetes Secret) and reloading applies the
	// new token; a file that cannot be read refuses the reload.
	TokenFile string `yaml:"token_file" reload:"live"`
	// SessionTTL is how long a sign-in to the status page lasts (default
	// 12h; at most 720h): a browser cannot send a bearer header, so the
	// page's form takes the token and sets a session cookie that expires
	// after this long, or at once when the token changes. A reload applies
	// it to the sign-ins that follow.
	SessionTTL configfile.Duration `yaml:"session_ttl" reload:"live"`
	// MaxConns bounds open connections to the admin listener (default 64;
	// 1 to 65536): a few scrapers, the probes and an operator need far
	// fewer, and without a bound idle admin connections can take every
	// descriptor the process has. One more is answered 503 and closed at
	// once.
	MaxConns int `yaml:"max_conns" reload:"restart"`
	// ReadTimeout bounds reading one admin request, headers and body,
	// counted from the connection's opening for its first request and from
	// its first byte for later ones (default 10s). A request not read by
	// then is cut: the connection is closed. Handlers that run long (a
	// 30-second CPU profile) are not bound by it.
	ReadTimeout configfile.Duration `yaml:"read_timeout" reload:"restart"`
	// IdleTimeout closes a keep-alive admin connection idle this long
	// (default 120s: above Prometheus's 1-minute default scrape interval,
	// so a scraper keeps its connection between scrapes).
	IdleTimeout configfile.Duration `yaml:"idle_timeout" reload:"restart"`

	// fileToken is TokenFile's token as New or Reload last read it; no key
	// of the file. The request path reads Required(), never the file.
	fileToken string `reload:"live"`
}

// Required is the token the admin routes require, "" for none: TokenFile's
// as read by ReadToken, or Token. A TokenFile never read (a config that
// did not come through New or Reload) fails closed: its token is a NUL,
// which net/http refuses in a header, so no request carries it.
func (a Config) Required() string {
	switch {
	case a.TokenFile == "":
		return a.Token
	case a.fileToken == "":
		return "\x00"
	}
	return a.fileToken
}

// ReadToken reads TokenFile into the config that New or Reload puts in
// force (nothing to read without one). Its error names the field path.
func (a *Config) ReadToken(path string) error {
	if a.TokenFile == "" {
		a.fileToken = ""
		return nil
	}
	t, err := bearer.ReadFile(a.TokenFile)
	if err != nil {
		return fmt.Errorf("%s.token_file: %w", path, err)
	}
	a.fileToken = t
	return nil
}

// Defaults and bounds of the admin section's connection limits.
const (
	DefaultMaxConns = 64
	maxConns        = 1 << 16
)

// Validate checks the admin section; path is its field path. Problems never
// quote the token.
func (a Config) Validate(p *configfile.Problems, path string) {
	if a.MaxConns < 1 || a.MaxConns > maxConns {
		p.Addf(path+".max_conns", "must be between 1 and %d, got %d", maxConns, a.MaxConns)
	}
	p.Positive(path+".read_timeout", a.ReadTimeout)
	p.Positive(path+".idle_timeout", a.IdleTimeout)
	if d := a.SessionTTL.D(); d < time.Minute || d > MaxSessionTTL {
		p.Addf(path+".session_ttl", "must be between 1m and %s, got %s", MaxSessionTTL, d)
	}
	switch {
	case a.Token != "" && a.TokenFile != "":
		p.Addf(path+".token_file", "set at most one of token and token_file")
	case a.TokenFile != "":
		if _, err := bearer.ReadFile(a.TokenFile); err != nil {
			p.Addf(path+".token_file", "%v", err)
		}
	default:
		bearer.Check(p, path+".token", a.Token)
	}
}

// NewServer is the admin listener's server: h behind the section's
// read and idle timeouts, its connections counted by conns.
func NewServer(cfg Config, h http.Handler, conns *listener.Limiter, log *zap.Logger) *http.Server {
	return &http.Server{
		Handler: h,
		// ReadTimeout bounds reading the whole request (ReadHeaderTimeout,
		// unset, takes its value): from the connection's opening for the
		// first, from the first byte for keep-alive ones (net/http waits
		// for it under IdleTimeout). It does not bound the handler: net/http
		// lifts the deadline once the request is read (its background read
		// starts without one). No WriteTimeout: pprof's profile and trace
		// write after ?seconds=N, 30 by default.
		ReadTimeout: cfg.ReadTimeout.D(),
		IdleTimeout: cfg.IdleTimeout.D(),
		ConnState:   conns.HTTPConnState,
		// net/http logs through the standard logger unless told; its
		// messages (TLS handshakes, panics in handlers) go to zap.
		ErrorLog: zap.NewStdLog(log),
	}
}

// serveClient is the encoder-facing handler. While the gateway drains, every
// answer closes its connection, so that keep-alive clients reconnect (to
// another replica) instead of being cut when the listener closes.
