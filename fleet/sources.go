package fleet

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/encgate/encgate/discovery"
	"github.com/encgate/encgate/internal/listener"
	"github.com/encgate/encgate/upstream"
)

// sources runs what makes the fleet dynamic, each on a goroutine of its own
// until Stop: sglang's bootstrap API and its registry, DNS discovery, the
// gateway's own registration with sglang bootstrap servers, and the drain
// checks.
type sources struct {
	registry  *discovery.Registry    // nil unless bootstrap.listen is set
	state     *discovery.StateFile   // nil unless bootstrap.state_file is set
	boot      *fasthttp.Server       // serves the registry's API
	bootln    net.Listener           // bootstrap.listen
	bootToken atomic.Pointer[string] // bootstrap.token_file's token as last read; nil without one
	registrar *discovery.Registrar   // nil unless register_with is set
	regStop   context.CancelFunc     // stops the registrar's Run
	regDone   chan struct{}          // closed when it has returned

	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// newSources builds the registry (shared through Redis when Deps.Redis is
// set, so that every replica serves the same fleet), the DNS source and
// the registrar, and reads bootstrap.state_file into the memory store.
// Nothing runs until start; the error is a bootstrap.token_file or a state
// file that cannot be read.
func (f *Fleet) newSources(cfg Config, resolver Resolver) (*sources, error) {
	src := &sources{}
	if cfg.Bootstrap.Listen != "" {
		if err := src.readBootstrapToken(cfg.Bootstrap); err != nil {
			return nil, err
		}
		store := discovery.NewMemoryStore(f.clk)
		if f.kv != nil {
			store = discovery.NewRedisStore(f.kv, f.keyPrefix)
		} else if cfg.Bootstrap.StateFile != "" {
			st, err := discovery.OpenStateFile(cfg.Bootstrap, store, f.clk, f.log.Named("bootstrap"), f.reg)
			if err != nil {
				return nil, err
			}
			src.state = st
		}
		log := f.log.Named("bootstrap")
		src.registry = discovery.NewRegistry(cfg.Bootstrap, store, f.clk, log,
			discovery.WithRoom(RoomWindow(cfg.Pool.Health)), discovery.WithMetrics(f.reg))
		src.registry.SetSelfCheck(f.registrationSelfCheck)
		access := discovery.BootstrapAccess{
			Networks: cfg.Bootstrap.Networks(),
			Resolve: func(ctx context.Context, host string) ([]netip.Addr, error) {
				return resolver.LookupNetIP(ctx, "ip", host)
			},
			ResolveTimeout: cfg.Bootstrap.ResolveTimeout.D(),
			Quiet:          listener.Sampled(log, f.clk), // any caller can be refused at any rate
			Registry:       f.reg,
		}
		if cfg.Bootstrap.TokenFile != "" {
			access.Token = func() string { return *src.bootToken.Load() }
		}
		src.boot = &fasthttp.Server{
			Handler:               src.registry.Handler(log, access),
			Name:                  "encgate-bootstrap",
			NoDefaultServerHeader: true,
			MaxRequestBodySize:    int(cfg.Bootstrap.MaxBodyBytes),
			ReadTimeout:           cfg.Limits.ReadHeaderTimeout.D(),
			WriteTimeout:          cfg.Limits.WriteTimeout.D(),
			IdleTimeout:           cfg.Limits.IdleTimeout.D(),
			ReadBufferSize:        4096,
			Concurrency:           1024,
			CloseOnShutdown:       true,
			Logger:                listener.FasthttpLogger(listener.Sampled(f.log.Named("bootstrap"), f.clk)),
		}
	}
	if len(cfg.RegisterWith) > 0 {
		src.registrar = discovery.NewRegistrar(cfg.registrar(), discovery.RegistrarDeps{
			Log: f.log.Named("registrar"), Registry: f.reg, Clock: f.clk})
	}
	return src, nil
}

// readBootstrapToken reads b.TokenFile into bootToken (nothing without
// one). Its error names the field path.
func (src *sources) readBootstrapToken(b discovery.BootstrapConfig) error {
	t, err := src.bootstrapToken(b)
	if err == nil && t != nil {
		src.bootToken.Store(t)
	}
	return err
}

// bootstrapToken reads b.TokenFile; nil without one or without a bootstrap
// listener.
func (src *sources) bootstrapToken(b discovery.BootstrapConfig) (*string, error) {
	if b.Listen == "" || b.TokenFile == "" {
		return nil, nil
	}
	t, err := discovery.ReadBootstrapToken(b.TokenFile)
	if err != nil {
		return nil, fmt.Errorf("bootstrap.token_file: %w", err)
	}
	return &t, nil
}

// RoomWindow is how long a registered encoder has to pass its first health
// checks before a full registry may give its place to a new registration,
// and how long one that passed may go without passing again: up_after
// probes one interval apart (the first at once), one interval for the
// refresh that records the pass (refreshRegistrations), and one to spare.
func RoomWindow(h upstream.HealthConfig) time.Duration {
	return time.Duration(h.UpAfter+2) * h.Interval.D()
}

// start listens on bootstrap.listen and starts every source.
func (f *Fleet) start(cfg Config) error {
	src := f.sources
	if src.boot != nil {
		ln, err := net.Listen("tcp", cfg.Bootstrap.Listen)
		if err != nil {
			return fmt.Errorf("bootstrap.listen: %w", err)
		}
		src.bootln = ln
		b := cfg.Bootstrap
		f.log.Info("bootstrap listening", zap.String("bootstrap_listen", ln.Addr().String()),
			zap.Bool("token", b.TokenFile != ""), zap.Strings("allow_networks", b.AllowNetworks))
		if b.Insecure {
			f.log.Warn("bootstrap.insecure is true: anyone who can reach bootstrap.listen may register an encoder and so receive users' images",
				zap.String("bootstrap_listen", ln.Addr().String()))
		}
	}
	// Every listener is bound: the self check learns their ports before
	// any source can add an encoder.
	f.bindSelf(src.bootln)
	ctx, cancel := context.WithCancel(context.Background())
	src.cancel = cancel
	run := func(name string, fn func()) {
		src.wg.Add(1)
		go func() {
			defer src.wg.Done()
			defer func() {
				if r := recover(); r != nil {
					f.log.Error(name+" panicked", zap.Any("panic", r), zap.Stack("stack"))
				}
			}()
			fn()
		}()
	}
	if src.boot != nil {
		run("bootstrap listener", func() {
			if err := src.boot.Serve(src.bootln); err != nil {
				f.log.Error("bootstrap listener stopped", zap.Error(err))
			}
		})
		// Registrations converge across replicas within one health interval,
		// and a registered encoder's TTL is refreshed while it passes checks.
		every := cfg.Pool.Health.Interval.D()
		run("bootstrap registry", func() {
			src.registry.Run(ctx, every, func(ms []discovery.Member) { f.setDiscovered(upstream.SourceRegistered, ms) })
		})
		run("registration refresh", func() { f.refreshRegistrations(ctx, every) })
		if src.state != nil {
			run("bootstrap state file", func() { src.state.Run(ctx) })
		}
	}
	if len(cfg.Discovery.DNS) > 0 {
		d := discovery.NewDNS(cfg.Discovery.DNS, discovery.DNSDeps{Log: f.log.Named("discovery"), Registry: f.reg, Clock: f.clk})
		run("dns discovery", func() {
			d.Run(ctx, func(ms []discovery.Member) { f.setDiscovered(upstream.SourceDNS, ms) })
		})
	}
	if src.registrar != nil {
		// Its own context: Unregister must follow the end of Run, at the
		// start of a drain, while the other sources still run.
		rctx, rstop := context.WithCancel(ctx)
		src.regStop, src.regDone = rstop, make(chan struct{})
		run("registrar", func() {
			defer close(src.regDone)
			src.registrar.Run(rctx)
		})
	}
	run("drain checks", func() { f.runDrainChecks(ctx) })
	run("self rechecks", func() { f.runSelfRechecks(ctx) })
	return nil
}

// refreshRegistrations extends, every interval, the registrations of the
// registered encoders that pass their health checks: one that crashed
// without unregistering leaves once bootstrap.ttl passes without a refresh.
// The refresh is also how the registry learns which of them pass (the
// store records it, shared by every replica with Redis): a full registry
// makes room by evicting one that has not passed for RoomWindow.
func (f *Fleet) refreshRegistrations(ctx context.Context, every time.Duration) {
	for {
		t := f.clk.NewTimer(every)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C():
		}
		var urls []string
		for _, e := range f.pool.Encoders() {
			if e.Source() == upstream.SourceRegistered && !e.Draining() && !e.Down() {
				urls = append(urls, e.URL)
			}
		}
		if len(urls) == 0 {
			continue
		}
		if err := f.sources.registry.Refresh(ctx, urls); err != nil && ctx.Err() == nil {
			f.quiet.Warn("refreshing registrations failed", zap.Int("encoders", len(urls)), zap.Error(err))
		}
	}
}

// Unregister takes the gateway's own registrations back (SIGTERM,
// before draining), so the language servers stop sending it parts.
func (f *Fleet) Unregister(ctx context.Context) {
	r := f.sources.registrar
	if r == nil || f.sources.regStop == nil {
		return
	}
	f.sources.regStop()
	<-f.sources.regDone
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := r.Unregister(ctx); err != nil {
		f.log.Warn("unregistering from bootstrap servers failed", zap.Error(err))
		return
	}
	f.log.Info("unregistered from bootstrap servers", zap.Strings("bootstrap", f.conf().RegisterWith))
}

// Stop stops every source and the bootstrap listener, then writes
// bootstrap.state_file a last time, after the registry's last change.
func (f *Fleet) Stop(ctx context.Context) error {
	src := f.sources
	if src.cancel != nil {
		src.cancel()
	}
	var err error
	if src.boot != nil && src.bootln != nil {
		err = src.boot.ShutdownWithContext(ctx)
	}
	src.wg.Wait()
	if src.state != nil {
		if serr := src.state.Save(); serr != nil {
			f.log.Error("writing the registrations at shutdown failed", zap.Error(serr))
			err = errors.Join(err, serr)
		} else {
			f.log.Info("registrations written to bootstrap.state_file", zap.String("state_file", f.conf().Bootstrap.StateFile))
		}
	}
	return err
}

// BootstrapAddr returns the bootstrap listener's address ("" when off).
func (f *Fleet) BootstrapAddr() string {
	if f.sources.bootln == nil {
		return ""
	}
	return f.sources.bootln.Addr().String()
}
