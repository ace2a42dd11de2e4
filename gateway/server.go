package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/encgate/encgate/idempotency"
	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/upstream"
)

// Server is a running gateway: the encoder-facing listener and the admin
// listener. Build it with New, then Start; stop it with Shutdown.
type Server struct {
	cfg     Config
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
	Clock    clock.Clock // nil means the wall clock
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
	pool, err := upstream.NewPool(cfg.Encoders, cfg.Affinity, cfg.Upstream, clk, deps.Log.Named("upstream"))
	if err != nil {
		return nil, err
	}
	store, err := idempotency.Open(cfg.Idempotency, clk, deps.Log.Named("idempotency"))
	if err != nil {
		pool.Close()
		return nil, err
	}
	s := &Server{cfg: cfg, log: log, clk: clk, pool: pool, store: store, reg: deps.Registry, done: make(chan error, 2)}
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
	go func() { s.done <- s.srv.Serve(ln) }()
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
	Name     string `json:"name"`
	URL      string `json:"url"`
	Usable   bool   `json:"usable"`
	Inflight int64  `json:"inflight"`
	Requests uint64 `json:"requests"`
	Pins     int    `json:"pins"`
}

func (s *Server) serveUpstreams(w http.ResponseWriter, _ *http.Request) {
	pins := s.pool.Pins.CountByEncoder()
	var out []UpstreamState
	for _, e := range s.pool.Encoders() {
		out = append(out, UpstreamState{
			Name: e.Name, URL: e.URL, Usable: e.Usable(),
			Inflight: e.Inflight(), Requests: e.Requests(), Pins: pins[e.Name],
		})
	}
	writeJSON(w, out)
}

// fasthttpLogger routes fasthttp's own messages to zap.
type fasthttpLogger struct{ l *zap.Logger }

func (f fasthttpLogger) Printf(format string, args ...any) {
	f.l.Warn(fmt.Sprintf(format, args...))
}
