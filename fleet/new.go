package fleet

import (
	"net"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/encgate/encgate/discovery"
	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/listener"
	"github.com/encgate/encgate/upstream"
)

// Fleet is the gateway's encoders from every source, fed to its pool.
// Build it with New, then Start; Apply puts a reloaded config in force;
// Unregister (on SIGTERM) takes the gateway's own registrations back, and
// Stop ends every source.
type Fleet struct {
	snap      atomic.Pointer[Config] // the config in force
	log       *zap.Logger
	quiet     *zap.Logger // log, sampled: lines a caller can cause at any rate
	clk       clock.Clock
	pool      Pool
	reg       prometheus.Registerer
	kv        redis.UniversalClient // the registry's Redis; nil: memory (or the state file)
	keyPrefix string                // the registry's keys in Redis start with it
	ln, adln  net.Addr              // the gateway's listeners, as bound (Start)

	members *members   // the encoders of every source (fleet.go)
	guard   *selfGuard // the gateway's own addresses, kept out of the fleet (selfguard.go)
	sources *sources   // bootstrap, DNS, self-registration, drain checks (sources.go)
}

// Pool is what the fleet needs of the pool it feeds; *upstream.Pool is one.
type Pool interface {
	// Reload puts set in force, its encoders the fleet's merged list.
	Reload(set upstream.Settings) (added, removed []string, err error)
	// Drained names the draining encoders that no longer hold anything.
	Drained() []string
	// Encoders is the pool's list, in fleet order.
	Encoders() []*upstream.Encoder
}

// Deps are what a Fleet takes from its caller.
type Deps struct {
	// Log takes the fleet's lines; the bootstrap API's, the registrar's
	// and DNS discovery's go to its children bootstrap, registrar and
	// discovery.
	Log      *zap.Logger
	Registry prometheus.Registerer
	Clock    clock.Clock // nil means the wall clock
	// Pool is fed every change of the fleet.
	Pool Pool
	// Resolver looks up host names: encoders' for the self check
	// (selfguard.go), and those of URLs registered on the bootstrap API for
	// bootstrap.allow_networks; nil means net.DefaultResolver.
	Resolver Resolver
	// InterfaceAddrs lists this host's addresses, which a listener on
	// 0.0.0.0 or :: takes; nil means net.InterfaceAddrs.
	InterfaceAddrs func() ([]net.Addr, error)
	// Redis, when set, holds the bootstrap registry, so that every replica
	// on it serves the same fleet; its keys start with RedisKeyPrefix. Nil
	// keeps the registrations in memory (and bootstrap.state_file).
	Redis          redis.UniversalClient
	RedisKeyPrefix string
}

// New builds the fleet of cfg and feeds it to deps.Pool once. Nothing runs
// until Start; the error is the pool refusing the fleet, a
// bootstrap.token_file or a state file that cannot be read.
func New(cfg Config, deps Deps) (*Fleet, error) {
	clk := deps.Clock
	if clk == nil {
		clk = clock.Real{}
	}
	resolver := deps.Resolver
	if resolver == nil {
		resolver = net.DefaultResolver
	}
	f := &Fleet{log: deps.Log, quiet: listener.Sampled(deps.Log, clk), clk: clk, pool: deps.Pool, reg: deps.Registry,
		kv: deps.Redis, keyPrefix: deps.RedisKeyPrefix}
	f.snap.Store(&cfg)
	f.guard = newSelfGuard(cfg, resolver, deps.InterfaceAddrs, clk)
	f.members = newMembers(deps.Registry)
	if _, err := f.apply(&cfg, nil); err != nil {
		return nil, err
	}
	var err error
	if f.sources, err = f.newSources(cfg, resolver); err != nil {
		return nil, err
	}
	return f, nil
}

// conf is the config in force.
func (f *Fleet) conf() *Config { return f.snap.Load() }

// Start listens on bootstrap.listen and starts every source. listen and
// adminListen are the gateway's other listeners, as bound.
func (f *Fleet) Start(listen, adminListen net.Addr) error {
	f.ln, f.adln = listen, adminListen
	return f.start(*f.conf())
}

// Apply puts next in force: its static encoders and settings, with the
// discovered members, reach the pool. bootstrap.token_file is read again
// (a rotated token applies with the rest). commit, when set, runs on
// success before any other change of the fleet can apply. An error
// changes nothing.
func (f *Fleet) Apply(next Config, commit func()) (Change, error) {
	bootToken, err := f.sources.bootstrapToken(next.Bootstrap)
	if err != nil {
		return Change{}, err
	}
	return f.apply(&next, func() {
		f.snap.Store(&next)
		if bootToken != nil {
			f.sources.bootToken.Store(bootToken)
		}
		if commit != nil {
			commit()
		}
	})
}

// Registrations is where the gateway's own registrations with sglang
// bootstrap servers stand (register_with); empty without it.
func (f *Fleet) Registrations() []discovery.RegistrationStatus {
	out := []discovery.RegistrationStatus{}
	if r := f.sources.registrar; r != nil {
		out = append(out, r.Status()...)
	}
	return out
}
