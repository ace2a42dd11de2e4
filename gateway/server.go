package gateway

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/encgate/encgate/fleet"
	"github.com/encgate/encgate/idempotency"
	"github.com/encgate/encgate/internal/admin"
	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/fdlimit"
	"github.com/encgate/encgate/internal/listener"
	"github.com/encgate/encgate/internal/loopguard"
	"github.com/encgate/encgate/internal/poller"
	"github.com/encgate/encgate/internal/redisclient"
	"github.com/encgate/encgate/internal/tcpconn"
	"github.com/encgate/encgate/upstream"
)

// Server is a running gateway: the encoder-facing listener and the admin
// listener. Build it with New, then Start; stop it with Shutdown.
type Server struct {
	// snap is the config in force: restart-only sections keep the values
	// the server started with (see Reload); the request path reads it with
	// conf().
	snap     atomic.Pointer[Config]
	level    *zap.AtomicLevel
	log      *zap.Logger
	quiet    *zap.Logger // log, sampled: lines a client can cause at any rate (logsample.go)
	clk      clock.Clock
	pool     *upstream.Pool
	store    *idempotency.Opened
	kv       redis.UniversalClient // the one Redis client (redis:), nil without Redis
	stopPins func()                // ends the shared pins' subscription; nil without Redis
	sends    *idempotency.Sends
	metrics  *metrics
	reg      Registry

	srv     *fasthttp.Server
	admin   *http.Server
	ln      net.Listener
	conns   *listener.Limiter // ln, bounded at limits.max_conns
	adln    net.Listener
	adconns *listener.Limiter // adln, bounded at admin.max_conns
	fds     fdlimit.Limits    // RLIMIT_NOFILE, checked again on every reload
	ready   atomic.Bool
	done    chan error

	fleet   *fleet.Fleet     // the encoders of every source, fed to pool
	loop    *loopguard.Guard // the hop mark on what the gateway forwards (internal/loopguard)
	recent  admin.Recent     // the gateway's own latest failure answers, for the status page
	started time.Time

	poller *poller.Poller // watches parked exchanges' sockets (park.go); nil: none park
	parked sync.WaitGroup // parked exchanges not yet answered, waited for by Shutdown
	// stopping ends when Shutdown stops the server, as its requests'
	// Done does: the Call.Stop of parked exchanges, whose backoffs end
	// early then.
	stopping context.Context
	stop     context.CancelFunc
	version  string
	rates    statusSampler // the status page's rates (status.go)
}

// Registry is where a gateway registers its metrics and what its /metrics
// serves (admin.Registry).
type Registry = admin.Registry

// Deps are what a Server takes from its caller.
type Deps struct {
	Log      *zap.Logger
	Registry Registry
	Clock    clock.Clock      // nil means the wall clock
	Rand     func() float64   // uniform in [0,1) for backoff jitter; nil means math/rand/v2
	Level    *zap.AtomicLevel // when set, a reload applies log.level to it
	// Descriptors is the RLIMIT_NOFILE that New fits the config into; nil
	// means this process's.
	Descriptors fdlimit.Limits
	// RedisHook, when set, is added to the gateway's one Redis client
	// (redis:) before anything uses it, so it sees every command, pipeline
	// and dial of the /send store, the shared pins and the registry. It is
	// for measuring what a flow costs in Redis (gateway/capacity_test.go,
	// bench/capacity.sh); nil in production. Unused without Redis.
	RedisHook redis.Hook
	// Resolver looks up host names: encoders' for the self check
	// (fleet/selfguard.go), and those of URLs registered on the bootstrap API for
	// bootstrap.allow_networks (each bounded by its own timeout); nil means
	// net.DefaultResolver.
	Resolver fleet.Resolver
	// InterfaceAddrs lists this host's addresses, which a listener on
	// 0.0.0.0 or :: takes; nil means net.InterfaceAddrs.
	InterfaceAddrs func() ([]net.Addr, error)
	// Entropy is where the instance id of the hop mark (internal/loopguard) is drawn
	// from; nil means crypto/rand.
	Entropy io.Reader
	// Version is what the status page names the build ("" means the
	// module version or VCS commit the go command stamped).
	Version string
}

// New builds a gateway from a validated config. First it makes sure that
// what the config can hold open fits RLIMIT_NOFILE, raising the soft limit
// where that makes it fit (Descriptors): a config that cannot fit is a
// *DescriptorError, before anything is built. Descriptors that run out all
// the same (the limit lowered later, files opened by other code) are
// waited out by the listeners, which never stop on them.
func New(cfg Config, deps Deps) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := cfg.Admin.ReadToken("admin"); err != nil {
		return nil, err
	}
	clk := deps.Clock
	if clk == nil {
		clk = clock.Real{}
	}
	log := deps.Log.Named("gateway")
	fds, err := Descriptors(cfg, deps.Descriptors, true)
	if err != nil {
		return nil, err
	}
	listener.LogDescriptors(log, fds)
	// Long polls park on the pool's poller (park.go).
	pool, err := upstream.NewPool(poolSettings(cfg), cfg.Affinity, upstream.Deps{
		Log: deps.Log.Named("upstream"), Registry: deps.Registry, Clock: clk, Rand: deps.Rand, Park: true})
	if err != nil {
		return nil, err
	}
	var kv redis.UniversalClient
	if cfg.usesRedis() {
		if kv, err = redisclient.New(cfg.Redis); err != nil {
			pool.Close()
			return nil, err
		}
		if deps.RedisHook != nil {
			kv.AddHook(deps.RedisHook)
		}
	}
	store, err := idempotency.Open(cfg.Idempotency, kv, cfg.Redis, clk, deps.Log.Named("idempotency"))
	if err != nil {
		pool.Close()
		closeKV(kv)
		return nil, err
	}
	var stopPins func()
	if kv != nil {
		// Pins live in Redis too, so that a follow-up reaching any replica
		// finds its /encode's encoder.
		ctx, cancel := context.WithCancel(context.Background())
		done := pool.SharePins(ctx, upstream.NewRedisPins(kv, cfg.Redis.KeyPrefix, cfg.Affinity.PinTTL.D(),
			cfg.Redis.DialTimeout.D()+cfg.Redis.Timeout.D(), cfg.Redis.PollInterval.D(), deps.Log.Named("pins"), deps.Registry),
			listener.Sampled(deps.Log.Named("pins"), clk)) // a Redis outage fails every call: a few lines a second
		stopPins = func() { cancel(); <-done }
	}
	s := &Server{poller: pool.Poller(), kv: kv, stopPins: stopPins, fds: deps.Descriptors, log: log, quiet: listener.Sampled(log, clk), clk: clk, pool: pool, store: store, reg: deps.Registry, done: make(chan error, 2), level: deps.Level}
	s.stopping, s.stop = context.WithCancel(context.Background())
	s.snap.Store(&cfg)
	s.started, s.version = clk.Now(), deps.Version
	if s.loop, err = loopguard.New(deps.Entropy, deps.Registry); err != nil {
		pool.Close()
		_ = s.closeStore()
		return nil, err
	}
	// The registry shares the one Redis client, so that every replica
	// serves the same fleet.
	if s.fleet, err = fleet.New(cfg.fleetConfig(), fleet.Deps{Log: log, Registry: deps.Registry, Clock: clk, Pool: pool,
		Resolver: deps.Resolver, InterfaceAddrs: deps.InterfaceAddrs, Redis: kv, RedisKeyPrefix: cfg.Redis.KeyPrefix}); err != nil {
		pool.Close()
		_ = s.closeStore()
		return nil, err
	}
	acceptErrors := listener.NewAcceptErrors(deps.Registry)
	s.conns = listener.NewLimiter(listener.Options{Name: "main", Max: cfg.Limits.MaxConns, Linger: listener.MaxLingering,
		Key: "limits.max_conns", What: "connections", One: "connection", Counter: "encgate_connections_rejected_total"}, clk, log, acceptErrors)
	s.adconns = listener.NewLimiter(listener.Options{Name: "admin", Max: cfg.Admin.MaxConns, Linger: listener.AdminMaxLingering,
		Key: "admin.max_conns", What: "admin connections", One: "admin connection", Counter: "encgate_admin_connections_rejected_total"}, clk, log, acceptErrors)
	listener.RegisterAdminConnMetrics(deps.Registry, s.adconns)
	s.metrics = newMetrics(deps.Registry, pool, s.conns, store.Store)
	s.sends = idempotency.NewSends(store.Store, cfg.Idempotency, clk, deps.Log.Named("idempotency"),
		idempotency.NewMetrics(deps.Registry, store.Memory))
	s.srv = &fasthttp.Server{
		Handler:               s.serveClient,
		ErrorHandler:          s.handleReadError,
		NoDefaultServerHeader: true,
		LazyRequestTime:       true, // the handler reads its own clock; saves a clock read per request
		NoDefaultContentType:  true,
		MaxRequestBodySize:    int(cfg.Limits.MaxBodyBytes),
		// Bodies pass byte for byte: a multipart body is not parsed into a
		// form (which would leave PostBody empty and write temporary files).
		DisablePreParseMultipartForm: true,
		// fasthttp's errors then leave out the buffer around a bad head;
		// fasthttpLog drops the rest of what they quote.
		SecureErrorLogMessage: true,
		// The read buffer bounds the request line and headers.
		ReadBufferSize: int(cfg.Limits.MaxHeaderBytes),
		// A connection holds its read buffer only while a request is being
		// read, and its write buffer only while an answer is written: one
		// waiting on the encoder (a held pull) or idle between requests
		// holds neither (bench/held.sh).
		ReduceMemoryUsage: true,
		// fasthttp's ReadTimeout runs from a connection's opening (first
		// request) or a request's first byte (later ones) until the body is
		// read. It is set to read_header_timeout, and once the headers are in,
		// readConfig gives the body read_timeout of its own, as net/http's
		// ReadHeaderTimeout does: a slow header is cut, a slow large body is not.
		ReadTimeout:    cfg.Limits.ReadHeaderTimeout.D(),
		HeaderReceived: s.readConfig,
		WriteTimeout:   cfg.Limits.WriteTimeout.D(),
		IdleTimeout:    cfg.Limits.IdleTimeout.D(),
		// The listener (connLimiter) bounds connections at max_conns and
		// answers the one too many itself; fasthttp's own worker bound
		// (one worker per connection) is only a backstop, as a worker is
		// released just after its connection is counted closed.
		Concurrency:     2 * cfg.Limits.MaxConns,
		ConnState:       s.conns.ConnState,
		CloseOnShutdown: true,
		// A parked exchange's connection is taken over by a hijack and
		// given back with ServeConn (park.go).
		KeepHijackedConns: true,
		// A worker whose connection parked goes back to fasthttp's pool
		// with the stack the request grew (8 KiB); kept idle for the
		// default 10 s, thousands parking together would keep thousands
		// of them. Workers idle for a second exit: a new connection then
		// starts one afresh (a goroutine start, about a microsecond).
		MaxIdleWorkerDuration: time.Second,
		Logger:                listener.FasthttpLogger(listener.Sampled(deps.Log.Named("fasthttp"), clk)),
	}
	s.admin = admin.NewServer(cfg.Admin, s.adminMux(), s.adconns, deps.Log.Named("admin"))
	return s, nil
}

// serveClient is the encoder-facing handler. While the gateway drains, every
// answer closes its connection, so that keep-alive clients reconnect (to
// another replica) instead of being cut when the listener closes.
func (s *Server) serveClient(ctx *fasthttp.RequestCtx) {
	s.handle(ctx)
	if !s.ready.Load() {
		ctx.SetConnectionClose()
	}
}

// Pool returns the encoder pool (for the demo and tests).
func (s *Server) Pool() *upstream.Pool { return s.pool }

// conf is the config in force.
func (s *Server) conf() *Config { return s.snap.Load() }

func poolSettings(c Config) upstream.Settings {
	return upstream.Settings{Encoders: c.Encoders, Client: c.Upstream, Breaker: c.Breaker, Health: c.Health,
		Retry: c.Retry, MaxInflight: c.Limits.MaxInflightPerEncoder, PollShare: c.Limits.PollShare}
}

// Start listens on both addresses and serves in the background.
func (s *Server) Start() error {
	cfg := s.conf()
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	adln, err := net.Listen("tcp", cfg.AdminListen)
	if err != nil {
		ln.Close()
		return fmt.Errorf("admin_listen: %w", err)
	}
	s.ln, s.adln = ln, adln
	if err := s.fleet.Start(ln.Addr(), adln.Addr()); err != nil {
		ln.Close()
		adln.Close()
		return err
	}
	s.conns.Listener, s.adconns.Listener = ln, adln
	s.startStatusSampler() // before the admin listener serves the page
	go func() { s.done <- s.srv.Serve(listener.Framing{Listener: tcpconn.Listener{Listener: s.conns}}) }()
	go func() {
		if err := s.admin.Serve(s.adconns); !errors.Is(err, http.ErrServerClosed) {
			s.done <- err
		}
	}()
	s.ready.Store(true)
	s.log.Info("gateway listening", zap.String("listen", ln.Addr().String()),
		zap.String("admin_listen", adln.Addr().String()), zap.String("bootstrap_listen", s.BootstrapAddr()),
		zap.Int("encoders", len(cfg.Encoders)), zap.String("via", string(s.loop.Entry())))
	return nil
}

// BootstrapAddr returns the bootstrap listener's address ("" when off).
func (s *Server) BootstrapAddr() string { return s.fleet.BootstrapAddr() }

// Addr is the encoder-facing address actually bound.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// AdminAddr is the admin address actually bound.
func (s *Server) AdminAddr() string { return s.adln.Addr().String() }

// Done reports a listener that stopped on its own.
func (s *Server) Done() <-chan error { return s.done }

// closeStore closes the /send store, then the Redis client every Redis
// user shared (the sources have stopped by then).
func (s *Server) closeStore() error {
	err := s.store.Close()
	if s.stopPins != nil {
		s.stopPins()
	}
	closeKV(s.kv)
	return err
}

func closeKV(kv redis.UniversalClient) {
	if kv != nil {
		_ = kv.Close()
	}
}

// Shutdown drains the gateway, in this order: /readyz answers 503 (and
// every answer closes its connection); after shutdown.delay the
// encoder-facing listener closes, so new connections are refused, and idle
// connections are closed; requests in flight finish until ctx ends; then the
// admin listener, the encoder pool and the store close. It returns ctx's
// error when requests were still in flight as ctx ended.
func (s *Server) Shutdown(ctx context.Context) error {
	s.ready.Store(false)
	s.fleet.Unregister(ctx)
	delay := s.conf().Shutdown.Delay.D()
	s.log.Info("draining: not ready", zap.Duration("delay", delay))
	if delay > 0 {
		t := s.clk.NewTimer(delay)
		select {
		case <-t.C():
		case <-ctx.Done():
			t.Stop()
		}
	}
	s.log.Info("draining: listener closed, finishing requests in flight",
		zap.Int64("open_connections", s.conns.Open()))
	s.stop() // with the server's own: a parked backoff ends as a slept one
	err := s.srv.ShutdownWithContext(ctx)
	// Parked exchanges are not fasthttp's: their answers (which close
	// their connections now) are waited for here.
	err = errors.Join(err, waitGroup(ctx, &s.parked))
	s.conns.Wait()
	aerr := s.admin.Shutdown(ctx)
	s.adconns.Wait()
	s.rates.stop()
	berr := s.fleet.Stop(ctx)
	s.pool.Close()
	serr := s.closeStore()
	err = errors.Join(err, aerr, berr, serr)
	s.log.Info("stopped", zap.Error(err))
	return err
}

// waitGroup waits for wg until ctx ends (then ctx's error; the waiting
// goroutine ends with wg).
func waitGroup(ctx context.Context, wg *sync.WaitGroup) error {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
