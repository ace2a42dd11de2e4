package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"sync/atomic"
	"time"

	"math/rand/v2"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/valyala/fasthttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/encgate/encgate/idempotency"
	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/tcpconn"
	"github.com/encgate/encgate/upstream"
)

// Server is a running gateway: the encoder-facing listener and the admin
// listener. Build it with New, then Start; stop it with Shutdown.
type Server struct {
	cfg     Config                 // as started: listeners and other restart-only settings
	live    atomic.Pointer[Config] // as last (re)loaded: read on the request path via conf()
	retry   atomic.Pointer[upstream.RetryConfig]
	budgets atomic.Pointer[budgets]
	rand    func() float64
	level   *zap.AtomicLevel
	log     *zap.Logger
	clk     clock.Clock
	pool    *upstream.Pool
	store   *idempotency.Opened
	sends   *idempotency.Sends
	metrics *metrics
	reg     *prometheus.Registry

	srv   *fasthttp.Server
	admin *http.Server
	ln    net.Listener
	adln  net.Listener
	ready atomic.Bool
	done  chan error
}

// Deps are what a Server takes from its caller.
type Deps struct {
	Log      *zap.Logger
	Registry *prometheus.Registry
	Clock    clock.Clock      // nil means the wall clock
	Rand     func() float64   // uniform in [0,1) for backoff jitter; nil means math/rand/v2
	Level    *zap.AtomicLevel // when set, a reload applies log.level to it
}

// New builds a gateway from a validated config.
func New(cfg Config, deps Deps) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	clk := deps.Clock
	if clk == nil {
		clk = clock.Real{}
	}
	log := deps.Log.Named("gateway")
	pool, err := upstream.NewPool(poolSettings(cfg), cfg.Affinity, clk, deps.Log.Named("upstream"), deps.Registry)
	if err != nil {
		return nil, err
	}
	store, err := idempotency.Open(cfg.Idempotency, clk, deps.Log.Named("idempotency"))
	if err != nil {
		pool.Close()
		return nil, err
	}
	s := &Server{cfg: cfg, log: log, clk: clk, pool: pool, store: store, reg: deps.Registry, done: make(chan error, 2),
		rand: deps.Rand, level: deps.Level}
	if s.rand == nil {
		s.rand = rand.Float64
	}
	s.live.Store(&cfg)
	s.retry.Store(&cfg.Retry)
	s.budgets.Store(s.newBudgets(cfg.Retry.Budget))
	s.metrics = newMetrics(deps.Registry, pool)
	s.sends = idempotency.NewSends(store.Store, cfg.Idempotency, clk, deps.Log.Named("idempotency"),
		idempotency.NewMetrics(deps.Registry, store.Memory))
	s.srv = &fasthttp.Server{
		Handler:               s.handle,
		ErrorHandler:          s.handleProtocolError,
		NoDefaultServerHeader: true,
		NoDefaultContentType:  true,
		MaxRequestBodySize:    int(cfg.Limits.MaxBodyBytes),
		ReadTimeout:           cfg.Limits.ReadTimeout.D(),
		WriteTimeout:          cfg.Limits.WriteTimeout.D(),
		IdleTimeout:           cfg.Limits.IdleTimeout.D(),
		Concurrency:           cfg.Limits.MaxConns,
		CloseOnShutdown:       true,
		Logger:                fasthttpLogger{deps.Log.Named("fasthttp")},
	}
	s.admin = &http.Server{Handler: s.adminMux(), ReadHeaderTimeout: 10 * time.Second}
	return s, nil
}

// Pool returns the encoder pool (for the demo and tests).
func (s *Server) Pool() *upstream.Pool { return s.pool }

// conf is the live config.
func (s *Server) conf() *Config { return s.live.Load() }

func poolSettings(c Config) upstream.Settings {
	return upstream.Settings{Encoders: c.Encoders, Client: c.Upstream, Breaker: c.Breaker, Health: c.Health}
}

// RefuseReload counts a reload whose file could not be read or parsed.
func (s *Server) RefuseReload() { s.metrics.reloads.WithLabelValues("refused").Inc() }

// Reload applies a new config without dropping requests in flight or the
// pins of encoders that stay: encoders, upstream client settings, retry
// policy and budget, breaker, health and log level change at once; settings
// that need a restart (listen addresses, limits, affinity, idempotency,
// shutdown) keep their running values and are named in the log. An invalid
// config changes nothing.
func (s *Server) Reload(next Config) error {
	if err := next.Validate(); err != nil {
		s.metrics.reloads.WithLabelValues("refused").Inc()
		return err
	}
	cur := s.conf()
	merged := next
	var restart []string
	keep := func(name string, changed bool, restore func()) {
		if changed {
			restart = append(restart, name)
			restore()
		}
	}
	keep("listen", next.Listen != cur.Listen, func() { merged.Listen = cur.Listen })
	keep("admin_listen", next.AdminListen != cur.AdminListen, func() { merged.AdminListen = cur.AdminListen })
	keep("limits", next.Limits != cur.Limits, func() { merged.Limits = cur.Limits })
	keep("affinity", next.Affinity != cur.Affinity, func() { merged.Affinity = cur.Affinity })
	keep("idempotency", next.Idempotency != cur.Idempotency, func() { merged.Idempotency = cur.Idempotency })
	keep("shutdown", next.Shutdown != cur.Shutdown, func() { merged.Shutdown = cur.Shutdown })
	added, removed, err := s.pool.Reload(poolSettings(merged))
	if err != nil {
		s.metrics.reloads.WithLabelValues("refused").Inc()
		return err
	}
	if merged.Retry.Budget != cur.Retry.Budget {
		s.budgets.Store(s.newBudgets(merged.Retry.Budget))
	}
	s.retry.Store(&merged.Retry)
	if s.level != nil {
		if lvl, err := zapcore.ParseLevel(merged.Log.Level); err == nil {
			s.level.SetLevel(lvl)
		}
	}
	s.live.Store(&merged)
	s.metrics.reloads.WithLabelValues("applied").Inc()
	s.log.Info("config reloaded", zap.Strings("encoders_added", added), zap.Strings("encoders_removed", removed),
		zap.Int("encoders", len(merged.Encoders)), zap.Strings("unchanged_until_restart", restart))
	return nil
}

// Start listens on both addresses and serves in the background.
func (s *Server) Start() error {
	ln, err := net.Listen("tcp", s.cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	adln, err := net.Listen("tcp", s.cfg.AdminListen)
	if err != nil {
		ln.Close()
		return fmt.Errorf("admin_listen: %w", err)
	}
	s.ln, s.adln = ln, adln
	go func() { s.done <- s.srv.Serve(tcpconn.Listener{Listener: ln}) }()
	go func() {
		if err := s.admin.Serve(adln); !errors.Is(err, http.ErrServerClosed) {
			s.done <- err
		}
	}()
	s.ready.Store(true)
	s.log.Info("gateway listening", zap.String("listen", ln.Addr().String()),
		zap.String("admin_listen", adln.Addr().String()), zap.Int("encoders", len(s.cfg.Encoders)))
	return nil
}

// Addr is the encoder-facing address actually bound.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// AdminAddr is the admin address actually bound.
func (s *Server) AdminAddr() string { return s.adln.Addr().String() }

// Done reports a listener that stopped on its own.
func (s *Server) Done() <-chan error { return s.done }

// Shutdown goes not-ready, stops accepting, lets in-flight requests finish
// until ctx ends, then closes everything.
func (s *Server) Shutdown(ctx context.Context) error {
	s.ready.Store(false)
	s.log.Info("draining")
	err := s.srv.ShutdownWithContext(ctx)
	aerr := s.admin.Shutdown(ctx)
	s.pool.Close()
	serr := s.store.Close()
	err = errors.Join(err, aerr, serr)
	s.log.Info("stopped", zap.Error(err))
	return err
}

func (s *Server) adminMux() *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{Registry: s.reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !s.ready.Load() {
			http.Error(w, "not ready", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
	mux.HandleFunc("GET /admin/upstreams", s.serveUpstreams)
	mux.HandleFunc("GET /admin/sends/{req_id}", s.serveSendRecord)
	// Go's profiler, on the admin listener only (never the encoder-facing one).
	mux.HandleFunc("GET /debug/pprof/", pprof.Index)
	mux.HandleFunc("GET /debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("GET /debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("GET /debug/pprof/trace", pprof.Trace)
	return mux
}

// serveSendRecord shows one req_id's /send destinations: done (with the
// stored status) or in flight, the receive count and whether it is released.
func (s *Server) serveSendRecord(w http.ResponseWriter, r *http.Request) {
	reqID := r.PathValue("req_id")
	view, err := s.sends.Store().Inspect(r.Context(), reqID)
	if err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	known := map[string]bool{}
	for _, d := range view.Destinations {
		known[d.Dest] = true
	}
	for _, dest := range s.sends.Inflight(reqID) {
		if !known[dest] {
			view.Destinations = append(view.Destinations, idempotency.DestView{Dest: dest, State: "in_flight"})
		}
	}
	if view.Destinations == nil {
		view.Destinations = []idempotency.DestView{}
	}
	writeJSON(w, view)
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// UpstreamState is one row of GET /admin/upstreams.
type UpstreamState struct {
	Name     string                  `json:"name"`
	URL      string                  `json:"url"`
	Usable   bool                    `json:"usable"`
	State    string                  `json:"state"`
	Inflight int64                   `json:"inflight"`
	Requests uint64                  `json:"requests"`
	Pins     int                     `json:"pins"`
	Breaker  BreakerView             `json:"breaker"`
	Health   upstream.HealthSnapshot `json:"health"`
}

// BreakerView is the passive (breaker) state of an encoder.
type BreakerView struct {
	State                string `json:"state"`
	Requests             uint32 `json:"requests"`
	TotalFailures        uint32 `json:"total_failures"`
	ConsecutiveFailures  uint32 `json:"consecutive_failures"`
	ConsecutiveSuccesses uint32 `json:"consecutive_successes"`
}

func (s *Server) serveUpstreams(w http.ResponseWriter, _ *http.Request) {
	pins := s.pool.Pins.CountByEncoder()
	var out []UpstreamState
	for _, e := range s.pool.Encoders() {
		bc := e.Breaker.Counts()
		out = append(out, UpstreamState{
			Name: e.Name, URL: e.URL, Usable: e.Usable(), State: e.State(),
			Inflight: e.Inflight(), Requests: e.Requests(), Pins: pins[e.Name],
			Breaker: BreakerView{State: e.Breaker.State().String(), Requests: bc.Requests, TotalFailures: bc.TotalFailures,
				ConsecutiveFailures: bc.ConsecutiveFailures, ConsecutiveSuccesses: bc.ConsecutiveSuccesses},
			Health: e.Health.Snapshot(),
		})
	}
	writeJSON(w, out)
}

// fasthttpLogger routes fasthttp's own messages to zap.
type fasthttpLogger struct{ l *zap.Logger }

func (f fasthttpLogger) Printf(format string, args ...any) {
	f.l.Warn(fmt.Sprintf(format, args...))
}
