package fleet

import (
	"fmt"
	"strings"
	"time"

	"github.com/encgate/encgate/discovery"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/upstream"
)

// Config is what the fleet reads of the gateway's config: its sources (the
// static encoders, bootstrap, discovery, register_with), the gateway's own
// addresses (self_guard), and the settings of the pool it feeds. The
// gateway's YAML keys are named at each field.
type Config struct {
	// Listen and AdminListen are the gateway's own listeners as configured
	// (listen, admin_listen): the self check keeps them out of the fleet.
	Listen, AdminListen string
	// Encoders is the static fleet (encoders).
	Encoders []upstream.EncoderConfig
	// Bootstrap is sglang's encoder bootstrap API (bootstrap).
	Bootstrap discovery.BootstrapConfig
	// Discovery finds encoders in DNS (discovery).
	Discovery DiscoveryConfig
	// RegisterWith, AdvertiseURL and Fanout are the gateway's own
	// registration with sglang bootstrap servers (register_with,
	// advertise_url, fanout).
	RegisterWith []string
	AdvertiseURL string
	Fanout       int
	// SelfGuard is how the gateway tells that an encoder is itself
	// (self_guard).
	SelfGuard SelfGuardConfig
	// Pool is the settings of the pool the fleet feeds, but for its
	// encoders: every apply sets them to the merged list. Its health
	// interval also paces the registry's poll and the refresh of
	// registrations.
	Pool upstream.Settings
	// Limits are the bootstrap listener's timeouts (the gateway's
	// limits.read_header_timeout, write_timeout, idle_timeout).
	Limits Limits
}

// Limits are the timeouts the bootstrap listener shares with the gateway's
// encoder-facing one.
type Limits struct {
	ReadHeaderTimeout, WriteTimeout, IdleTimeout configfile.Duration
}

// DiscoveryConfig is the gateway's discovery section.
type DiscoveryConfig struct {
	// DNS names whose A/AAAA records are encoders, each at its port.
	DNS []discovery.DNSConfig `yaml:"dns"`
}

// registrar is the self-registration part of c.
func (c Config) registrar() discovery.RegistrarConfig {
	r := discovery.DefaultRegistrar()
	r.RegisterWith, r.AdvertiseURL, r.Fanout = c.RegisterWith, c.AdvertiseURL, c.Fanout
	return r
}

// dynamic reports whether encoders can join beyond the static list.
func (c Config) dynamic() bool { return c.Bootstrap.Listen != "" || len(c.Discovery.DNS) > 0 }

// SelfGuardConfig is the self_guard section: how the gateway tells that an
// encoder is itself, and how many proxies a forwarded request may have
// passed. Every key applies on a reload.
type SelfGuardConfig struct {
	// ResolveTimeout bounds one lookup of an encoder's host name when the
	// gateway checks whether the name leads to one of its own listeners
	// (default 2s; 10ms to 30s). Only names whose port is one of the
	// gateway's own are looked up. A lookup that fails or runs out refuses
	// nothing: the encoder stays, and is checked again every
	// RecheckInterval.
	ResolveTimeout configfile.Duration `yaml:"resolve_timeout"`
	// RecheckInterval is how often encoders named by host (not by address)
	// are looked up again, so that a name which starts to resolve to the
	// gateway, or which failed to resolve, is checked again (default 30s;
	// at least 1s). Nothing runs while no such encoder is in the fleet.
	RecheckInterval configfile.Duration `yaml:"recheck_interval"`
	// MaxHops refuses, with 508 Loop Detected, a request whose Via header
	// lists more than this many proxies (default 16; 1 to 255): a loop
	// through gateways that do not see each other's marks ends there too.
	MaxHops int `yaml:"max_hops"`
}

// Bounds of the self_guard section.
const (
	minResolveTimeout  = 10 * time.Millisecond
	maxResolveTimeout  = 30 * time.Second
	minRecheckInterval = time.Second
	maxHopsBound       = 255
)

// DefaultSelfGuard returns the self_guard defaults.
func DefaultSelfGuard() SelfGuardConfig {
	return SelfGuardConfig{
		ResolveTimeout:  configfile.Duration(2 * time.Second),
		RecheckInterval: configfile.Duration(30 * time.Second),
		MaxHops:         16,
	}
}

// Validate checks the section; path is its field path.
func (c SelfGuardConfig) Validate(p *configfile.Problems, path string) {
	if d := c.ResolveTimeout.D(); d < minResolveTimeout || d > maxResolveTimeout {
		p.Addf(path+".resolve_timeout", "must be between %s and %s, got %s", minResolveTimeout, maxResolveTimeout, c.ResolveTimeout)
	}
	if c.RecheckInterval.D() < minRecheckInterval {
		p.Addf(path+".recheck_interval", "must be >= %s, got %s", minRecheckInterval, c.RecheckInterval)
	}
	if c.MaxHops < 1 || c.MaxHops > maxHopsBound {
		p.Addf(path+".max_hops", "must be between 1 and %d, got %d", maxHopsBound, c.MaxHops)
	}
}

// FillDefaults gives every discovery.dns entry the defaults of the keys it
// leaves out (a list's entries start empty when the file is decoded).
func (d *DiscoveryConfig) FillDefaults() {
	def := discovery.DefaultDNS()
	for i := range d.DNS {
		if d.DNS[i].Scheme == "" {
			d.DNS[i].Scheme = def.Scheme
		}
		if d.DNS[i].Interval == 0 {
			d.DNS[i].Interval = def.Interval
		}
	}
}

// Validate records every problem of the fleet's part of the gateway's
// config, each with its field path as the gateway's file names it.
func (c Config) Validate(p *configfile.Problems) {
	if len(c.Encoders) == 0 && !c.dynamic() {
		p.Addf("encoders", "at least one encoder is required (or bootstrap.listen, or discovery.dns, to find them)")
	}
	upstream.ValidateEncoders(p, "encoders", c.Encoders)
	c.Bootstrap.Validate(p, "bootstrap")
	if c.Bootstrap.Listen != "" && (c.Bootstrap.Listen == c.Listen || c.Bootstrap.Listen == c.AdminListen) && !strings.HasSuffix(c.Bootstrap.Listen, ":0") {
		p.Addf("bootstrap.listen", "must differ from listen and admin_listen (%s)", c.Bootstrap.Listen)
	}
	for i, d := range c.Discovery.DNS {
		d.Validate(p, fmt.Sprintf("discovery.dns[%d]", i))
	}
	c.registrar().Validate(p, "")
	c.SelfGuard.Validate(p, "self_guard")
	checkSelfEncoders(p, c)
}
