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

	"github.com/encgate/encgate/idempotency"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/upstream"
)

// Config is the gateway's YAML file. DefaultConfig holds every default.
type Config struct {
	// Listen is the encoder-facing address (default 127.0.0.1:8080).
	Listen string `yaml:"listen"`
	// AdminListen serves /metrics, /healthz, /readyz and /admin/... (default
	// 127.0.0.1:9090). It must differ from Listen.
	AdminListen string `yaml:"admin_listen"`
	// Encoders is the fleet; at least one.
	Encoders []upstream.EncoderConfig `yaml:"encoders"`
	// Affinity controls req_id pinning.
	Affinity upstream.AffinityConfig `yaml:"affinity"`
	// Upstream controls connections to encoders.
	Upstream upstream.ClientConfig `yaml:"upstream"`
	// Retry is the per-route retry policy and the retry budget.
	Retry upstream.RetryConfig `yaml:"retry"`
	// Breaker is the per-encoder circuit breaker.
	Breaker upstream.BreakerConfig `yaml:"breaker"`
	// Health is the active health check of every encoder.
	Health upstream.HealthConfig `yaml:"health"`
	// Idempotency controls /send deduplication.
	Idempotency idempotency.Config `yaml:"idempotency"`
	// Limits bounds what a caller can make the gateway hold.
	Limits LimitsConfig `yaml:"limits"`
	// Shutdown controls draining on SIGINT/SIGTERM.
	Shutdown configfile.Shutdown `yaml:"shutdown"`
	// Log controls the zap logger.
	Log configfile.Log `yaml:"log"`
}

// LimitsConfig bounds caller input and connections.
type LimitsConfig struct {
	// MaxBodyBytes bounds a request body (default 8MiB); larger gets 413.
	MaxBodyBytes configfile.ByteSize `yaml:"max_body_bytes"`
	// ReadTimeout bounds reading one whole request (default 60s).
	ReadTimeout configfile.Duration `yaml:"read_timeout"`
	// WriteTimeout bounds writing one response (default 60s).
	WriteTimeout configfile.Duration `yaml:"write_timeout"`
	// IdleTimeout closes keep-alive connections idle this long (default 120s).
	IdleTimeout configfile.Duration `yaml:"idle_timeout"`
	// MaxConns bounds concurrent client connections (default 10000).
	MaxConns int `yaml:"max_conns"`
}

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
		Limits: LimitsConfig{
			MaxBodyBytes: 8 << 20,
			ReadTimeout:  configfile.Duration(60e9),
			WriteTimeout: configfile.Duration(60e9),
			IdleTimeout:  configfile.Duration(120e9),
			MaxConns:     10000,
		},
		Shutdown: configfile.Shutdown{Grace: configfile.Duration(30e9)},
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
	return cfg, errors.Join(err, cfg.Validate())
}

// Validate reports every problem, each with its field path.
func (c Config) Validate() error {
	var p configfile.Problems
	checkAddr(&p, "listen", c.Listen)
	checkAddr(&p, "admin_listen", c.AdminListen)
	if c.Listen != "" && c.Listen == c.AdminListen && !strings.HasSuffix(c.Listen, ":0") {
		p.Addf("admin_listen", "must differ from listen (%s)", c.Listen)
	}
	upstream.ValidateEncoders(&p, "encoders", c.Encoders)
	c.Affinity.Validate(&p, "affinity")
	c.Upstream.Validate(&p, "upstream")
	c.Retry.Validate(&p, "retry")
	c.Breaker.Validate(&p, "breaker")
	c.Health.Validate(&p, "health")
	c.Idempotency.Validate(&p, "idempotency")
	if c.Limits.MaxBodyBytes < 1024 {
		p.Addf("limits.max_body_bytes", "must be >= 1KiB, got %s", c.Limits.MaxBodyBytes)
	}
	p.Positive("limits.read_timeout", c.Limits.ReadTimeout)
	p.Positive("limits.write_timeout", c.Limits.WriteTimeout)
	p.Positive("limits.idle_timeout", c.Limits.IdleTimeout)
	if c.Limits.MaxConns < 1 {
		p.Addf("limits.max_conns", "must be >= 1, got %d", c.Limits.MaxConns)
	}
	c.Shutdown.Validate(&p, "shutdown")
	c.Log.Validate(&p, "log")
	return p.Err()
}

func checkAddr(p *configfile.Problems, path, addr string) {
	if _, _, err := net.SplitHostPort(addr); err != nil {
		p.Addf(path, "%s", fmt.Sprintf("must be host:port, got %q", addr))
	}
}
