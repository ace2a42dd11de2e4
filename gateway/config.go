// Package gateway is encgate's encoder-facing front end: a fasthttp server
// that serves the sglang encoder's own routes, keeps every call for a req_id
// on the encoder that holds it, and answers with the encoder's envelopes; plus
// the admin listener with metrics, health and state.
package gateway

import (
	"errors"
	"fmt"
	"net"
	"strings"

	"github.com/encgate/encgate/discovery"
	"github.com/encgate/encgate/fleet"
	"github.com/encgate/encgate/idempotency"
	"github.com/encgate/encgate/internal/admin"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/redisclient"
	"github.com/encgate/encgate/internal/sglang"
	"github.com/encgate/encgate/upstream"
)

// Config is the gateway's YAML file. DefaultConfig holds every default.
// Each section says whether a reload applies it (reload:"live") or it
// needs a restart (reload:"restart"); an untagged struct says so field by
// field (Limits, Admin).
type Config struct {
	// Listen is the encoder-facing address (default 127.0.0.1:8080).
	Listen string `yaml:"listen" reload:"restart"`
	// AdminListen serves /metrics, /healthz, /readyz and /admin/... (default
	// 127.0.0.1:9090). It must differ from Listen.
	AdminListen string `yaml:"admin_listen" reload:"restart"`
	// Encoders is the static fleet: at least one, unless bootstrap or
	// discovery can find encoders. Encoders found those ways join it.
	Encoders []upstream.EncoderConfig `yaml:"encoders" reload:"live"`
	// Bootstrap serves sglang's encoder bootstrap API (encoders started
	// with --encoder-register-urls register there) on a listener of its
	// own; off by default. Its routes sit under /t/<token>/ with
	// token_file, and allow_networks bounds who calls and what registers;
	// one of the two is required, or insecure: true. A reload reads
	// token_file's token again (the path and the rest need a restart).
	Bootstrap discovery.BootstrapConfig `yaml:"bootstrap" reload:"restart"`
	// Discovery finds encoders in DNS (a Kubernetes headless Service).
	Discovery fleet.DiscoveryConfig `yaml:"discovery" reload:"restart"`
	// RegisterWith lists sglang bootstrap servers (the language server's
	// --encoder-bootstrap-port) the gateway registers itself with, as
	// AdvertiseURL/p/0 … /p/<Fanout-1>, so that the language server
	// sends it Fanout parts per modality; empty = off.
	RegisterWith []string `yaml:"register_with" reload:"restart"`
	// AdvertiseURL is the URL the encoders' clients reach this gateway at.
	AdvertiseURL string `yaml:"advertise_url" reload:"restart"`
	// Fanout is how many URLs the gateway registers (default 1, at most 1024).
	Fanout int `yaml:"fanout" reload:"restart"`
	// SelfGuard keeps the gateway out of its own fleet and ends requests
	// that loop back to it (fleet/selfguard.go, internal/loopguard).
	SelfGuard fleet.SelfGuardConfig `yaml:"self_guard" reload:"live"`
	// Affinity controls req_id pinning.
	Affinity upstream.AffinityConfig `yaml:"affinity" reload:"restart"`
	// Upstream controls connections to encoders.
	Upstream upstream.ClientConfig `yaml:"upstream" reload:"live"`
	// Retry is the per-route retry policy and the retry budget.
	Retry upstream.RetryConfig `yaml:"retry" reload:"live"`
	// Breaker is the per-encoder circuit breaker.
	Breaker upstream.BreakerConfig `yaml:"breaker" reload:"live"`
	// Health is the active health check of every encoder.
	Health upstream.HealthConfig `yaml:"health" reload:"live"`
	// Idempotency controls /send deduplication.
	Idempotency idempotency.Config `yaml:"idempotency" reload:"restart"`
	// Redis is how the replicas reach the Redis they share (standalone,
	// Sentinel or Cluster, over TLS where set). Read when
	// idempotency.store is redis: then /send records, bootstrap
	// registrations and pins all live there.
	Redis redisclient.Config `yaml:"redis" reload:"restart"`
	// Limits bounds what a caller can make the gateway hold.
	Limits LimitsConfig `yaml:"limits"`
	// Shutdown controls draining on SIGINT/SIGTERM.
	Shutdown ShutdownConfig `yaml:"shutdown" reload:"restart"`
	// Admin protects and bounds the admin listener.
	Admin admin.Config `yaml:"admin"`
	// Log controls the zap logger.
	Log configfile.Log `yaml:"log" reload:"live"`
}

// ShutdownConfig is the gateway's shutdown section: the grace every role
// has, plus the delay between going not-ready and closing the listener.
type ShutdownConfig struct {
	configfile.Shutdown `yaml:",inline"`
	// Delay keeps the encoder-facing listener open this long after /readyz
	// turns 503, so that load balancers polling it stop sending new
	// connections before the gateway refuses them (default 0s). Responses
	// in this window carry Connection: close. Grace starts after it.
	Delay configfile.Duration `yaml:"delay"`
}

// LimitsConfig bounds caller input and connections. Only
// MaxInflightPerEncoder and PollShare change on a reload; the others need a
// restart.
type LimitsConfig struct {
	// MaxBodyBytes bounds a request body (default 8MiB); larger gets 413.
	MaxBodyBytes configfile.ByteSize `yaml:"max_body_bytes" reload:"restart"`
	// MaxHeaderBytes bounds the request line and headers together (default
	// 64KiB); larger gets 431. It is also the size of each connection's read
	// buffer (fasthttp's ReadBufferSize).
	MaxHeaderBytes configfile.ByteSize `yaml:"max_header_bytes" reload:"restart"`
	// ReadHeaderTimeout bounds reading the request line and headers,
	// counted from the connection's opening for its first request and from
	// the first byte for later ones (default 10s). A client that trickles
	// its headers is answered 408 and cut off then.
	ReadHeaderTimeout configfile.Duration `yaml:"read_header_timeout" reload:"restart"`
	// ReadTimeout bounds reading the body, counted from the end of the
	// headers (default 60s).
	ReadTimeout configfile.Duration `yaml:"read_timeout" reload:"restart"`
	// WriteTimeout bounds writing one response (default 60s).
	WriteTimeout configfile.Duration `yaml:"write_timeout" reload:"restart"`
	// IdleTimeout closes keep-alive connections idle this long (default 120s).
	IdleTimeout configfile.Duration `yaml:"idle_timeout" reload:"restart"`
	// MaxFieldBytes bounds each string a request is keyed or routed by
	// (req_id, prefill_host, session_id, receive_url), decoded (default
	// 512 bytes; 64 to 64KiB). Longer is answered 400: a part id is ~50
	// bytes and a host at most 255, so only a hostile or broken client
	// sends more, and every byte of a key is held by the pin and /send
	// tables.
	MaxFieldBytes configfile.ByteSize `yaml:"max_field_bytes" reload:"restart"`
	// MaxConns bounds open client connections (default 10000). One more is
	// answered with a 503 envelope and closed.
	MaxConns int `yaml:"max_conns" reload:"restart"`
	// MaxInflightPerEncoder bounds the exchanges in flight to one encoder,
	// its agent's /sends included (default 1024). One more is not sent: it
	// gets a 503 envelope at once (or, where its route's retry policy
	// retries connect_failure, is retried: /encode on the next encoder).
	MaxInflightPerEncoder int `yaml:"max_inflight_per_encoder" reload:"live"`
	// PollShare is the share of MaxInflightPerEncoder that long polls may
	// hold at one encoder (default 0.75; above 0, below 1): metadata pulls
	// and registrations of a part not known encoded (no /encode of it
	// seen, or one still running), which the encoder holds up to 180 s
	// waiting for the part. They may hold at most floor(PollShare ×
	// MaxInflightPerEncoder), at least 1; one more gets a 503 envelope
	// naming this bound. The rest is reserved for what starts or completes
	// a part (/encode, /send, a pull or registration of a part already
	// encoded, answered at once), so pulls held for req_ids never encoded
	// (a confused or restarted rank) cannot starve them.
	PollShare float64 `yaml:"poll_share" reload:"live"`
	// ParkLongPolls parks long polls, and /encodes, while their encoder
	// holds them (default true, on Linux): once a metadata pull's,
	// registration's or /encode's request is out and its answer has not begun within 50 ms, no
	// goroutine, request context or buffer waits for it (an answer that
	// begins within those 50 ms, as a pull whose part is ready gets, is
	// read at once where it is: parking costs more CPU than the rest of a
	// proxied request); one poller watches both connections. Off, each
	// keeps a goroutine for as long as the encoder holds it (up to 180 s).
	// Every verdict, deadline and limit is the same either way.
	ParkLongPolls bool `yaml:"park_long_polls" reload:"live"`
}

// Bounds of limits.max_header_bytes: a request line must fit, and every open
// connection holds a read buffer this large.
const (
	minHeaderBytes = 1 << 10
	maxHeaderBytes = 1 << 20
)

// DefaultConfig returns a Config with every default set and no encoders.
func DefaultConfig() Config {
	return Config{
		Listen:      "127.0.0.1:8080",
		AdminListen: "127.0.0.1:9090",
		Affinity:    upstream.DefaultAffinity(),
		Upstream:    upstream.DefaultClient(),
		Retry:       upstream.DefaultRetry(),
		Breaker:     upstream.DefaultBreaker(),
		Health:      upstream.DefaultHealth(),
		Idempotency: idempotency.DefaultConfig(),
		Redis:       redisclient.Default(),
		Bootstrap:   discovery.DefaultBootstrap(),
		// Empty, not nil: what `dns: []` and `register_with: []` decode to,
		// so the example file equals the defaults.
		Discovery:    fleet.DiscoveryConfig{DNS: []discovery.DNSConfig{}},
		RegisterWith: []string{},
		Fanout:       1,
		SelfGuard:    fleet.DefaultSelfGuard(),
		Limits: LimitsConfig{
			MaxBodyBytes:          8 << 20,
			MaxHeaderBytes:        64 << 10,
			MaxFieldBytes:         sglang.DefaultMaxFieldBytes,
			ReadHeaderTimeout:     configfile.Duration(10e9),
			ReadTimeout:           configfile.Duration(60e9),
			WriteTimeout:          configfile.Duration(60e9),
			IdleTimeout:           configfile.Duration(120e9),
			MaxConns:              10000,
			MaxInflightPerEncoder: 1024,
			PollShare:             0.75,
			ParkLongPolls:         true,
		},
		Admin: admin.Config{
			MaxConns:    admin.DefaultMaxConns,
			ReadTimeout: configfile.Duration(10e9),
			IdleTimeout: configfile.Duration(120e9),
			SessionTTL:  configfile.Duration(admin.DefaultSessionTTL),
		},
		Shutdown: ShutdownConfig{Shutdown: configfile.Shutdown{Grace: configfile.Duration(30e9)}},
		Log:      configfile.Log{Level: "info"},
	}
}

// LoadConfig reads path over the defaults and validates the result. It
// reports every problem at once: keys that could not be decoded and values
// that are out of range, each with its field path.
func LoadConfig(path string) (Config, error) {
	cfg := DefaultConfig()
	err := configfile.Load(path, &cfg)
	var partial *configfile.DecodeError
	if err != nil && !errors.As(err, &partial) {
		return cfg, err
	}
	cfg.Discovery.FillDefaults()
	return cfg, errors.Join(err, cfg.Validate())
}

// fleetConfig is the fleet's part of c.
func (c Config) fleetConfig() fleet.Config {
	pool := poolSettings(c)
	pool.Encoders = nil // the fleet's merged list, on every apply
	return fleet.Config{Listen: c.Listen, AdminListen: c.AdminListen, Encoders: c.Encoders, Bootstrap: c.Bootstrap,
		Discovery: c.Discovery, RegisterWith: c.RegisterWith, AdvertiseURL: c.AdvertiseURL, Fanout: c.Fanout,
		SelfGuard: c.SelfGuard, Pool: pool,
		Limits: fleet.Limits{ReadHeaderTimeout: c.Limits.ReadHeaderTimeout, WriteTimeout: c.Limits.WriteTimeout, IdleTimeout: c.Limits.IdleTimeout}}
}

// usesRedis reports whether the replicas share state through Redis
// (idempotency.store: redis), so the redis: section is read.
func (c Config) usesRedis() bool { return c.Idempotency.Store == "redis" }

// Validate reports every problem, each with its field path.
func (c Config) Validate() error {
	var p configfile.Problems
	checkAddr(&p, "listen", c.Listen)
	checkAddr(&p, "admin_listen", c.AdminListen)
	if c.Listen != "" && c.Listen == c.AdminListen && !strings.HasSuffix(c.Listen, ":0") {
		p.Addf("admin_listen", "must differ from listen (%s)", c.Listen)
	}
	c.fleetConfig().Validate(&p)
	c.Affinity.Validate(&p, "affinity")
	c.Upstream.Validate(&p, "upstream")
	c.Retry.Validate(&p, "retry")
	c.Breaker.Validate(&p, "breaker")
	c.Health.Validate(&p, "health")
	c.Idempotency.Validate(&p, "idempotency")
	if c.usesRedis() {
		c.Redis.Validate(&p, "redis")
		if c.Bootstrap.StateFile != "" {
			p.Addf("bootstrap.state_file", "is for the memory store: with idempotency.store: redis the registrations live in Redis, which keeps them across gateway restarts")
		}
	}
	if c.Limits.MaxBodyBytes < 1024 {
		p.Addf("limits.max_body_bytes", "must be >= 1KiB, got %s", c.Limits.MaxBodyBytes)
	}
	if h := c.Limits.MaxHeaderBytes; h < minHeaderBytes || h > maxHeaderBytes {
		p.Addf("limits.max_header_bytes", "must be between %s and %s (every open connection holds a read buffer this large), got %s",
			configfile.ByteSize(minHeaderBytes), configfile.ByteSize(maxHeaderBytes), h)
	}
	if f := c.Limits.MaxFieldBytes; f < 64 || f > 64<<10 {
		p.Addf("limits.max_field_bytes", "must be between 64B and 64KiB, got %s", f)
	}
	p.Positive("limits.read_header_timeout", c.Limits.ReadHeaderTimeout)
	p.Positive("limits.read_timeout", c.Limits.ReadTimeout)
	p.Positive("limits.write_timeout", c.Limits.WriteTimeout)
	p.Positive("limits.idle_timeout", c.Limits.IdleTimeout)
	if c.Limits.MaxConns < 1 || c.Limits.MaxConns > maxConns {
		p.Addf("limits.max_conns", "must be between 1 and %d, got %d", maxConns, c.Limits.MaxConns)
	}
	if c.Limits.MaxInflightPerEncoder < 1 {
		p.Addf("limits.max_inflight_per_encoder", "must be >= 1, got %d", c.Limits.MaxInflightPerEncoder)
	}
	if s := c.Limits.PollShare; !(s > 0 && s < 1) {
		p.Addf("limits.poll_share", "must be above 0 and below 1 (the share of limits.max_inflight_per_encoder long polls may hold), got %g", s)
	}
	c.Shutdown.Validate(&p, "shutdown")
	if c.Shutdown.Delay < 0 {
		p.Addf("shutdown.delay", "must be >= 0, got %s", c.Shutdown.Delay)
	}
	c.Admin.Validate(&p, "admin")
	c.Log.Validate(&p, "log")
	return p.Err()
}

// maxConns bounds limits.max_conns (fasthttp's worker pool is sized twice it).
const maxConns = 1 << 24

func checkAddr(p *configfile.Problems, path, addr string) {
	if _, _, err := net.SplitHostPort(addr); err != nil {
		p.Addf(path, "%s", fmt.Sprintf("must be host:port, got %q", addr))
	}
}
