package gateway

import (
	"bufio"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/pprof"
	"strings"
	"sync"
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
	conns *connLimiter // ln, bounded at limits.max_conns
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
	s.conns = newConnLimiter(cfg.Limits.MaxConns, log)
	s.metrics = newMetrics(deps.Registry, pool, s.conns)
	s.sends = idempotency.NewSends(store.Store, cfg.Idempotency, clk, deps.Log.Named("idempotency"),
		idempotency.NewMetrics(deps.Registry, store.Memory))
	s.srv = &fasthttp.Server{
		Handler:               s.serveClient,
		ErrorHandler:          s.handleReadError,
		NoDefaultServerHeader: true,
		LazyRequestTime:       true, // the handler reads its own clock; saves a clock read per request
		NoDefaultContentType:  true,
		MaxRequestBodySize:    int(cfg.Limits.MaxBodyBytes),
		// The read buffer bounds the request line and headers.
		ReadBufferSize: int(cfg.Limits.MaxHeaderBytes),
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
		ConnState:       s.conns.connState,
		CloseOnShutdown: true,
		Logger:          fasthttpLogger{deps.Log.Named("fasthttp")},
	}
	s.admin = &http.Server{Handler: s.adminMux(), ReadHeaderTimeout: 10 * time.Second}
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

// readConfig gives a request's body limits.read_timeout from the end of its
// headers (fasthttp's HeaderReceived hook); a request without a body keeps
// the header deadline, which no read meets any more.
func (s *Server) readConfig(h *fasthttp.RequestHeader) fasthttp.RequestConfig {
	if h.ContentLength() == 0 {
		return fasthttp.RequestConfig{}
	}
	return fasthttp.RequestConfig{ReadTimeout: s.cfg.Limits.ReadTimeout.D()}
}

// handleReadError answers a request fasthttp could not read: headers over
// limits.max_header_bytes get 431, a read past its deadline 408, each
// naming the limit; everything else goes to handleProtocolError. The
// answer is then sent at once and the connection closed gently
// (answerAndLinger).
func (s *Server) handleReadError(ctx *fasthttp.RequestCtx, err error) {
	var small *fasthttp.ErrSmallBuffer
	switch {
	case errors.As(err, &small):
		writeEnvelope(ctx, fasthttp.StatusRequestHeaderFieldsTooLarge,
			"encgate: request line and headers exceed limits.max_header_bytes ("+s.cfg.Limits.MaxHeaderBytes.String()+")", nil)
		s.metrics.observe(unknownRoute, ctx.Response.StatusCode(), 0)
	case upstream.IsTimeout(err):
		writeEnvelope(ctx, fasthttp.StatusRequestTimeout, "encgate: request not read in time (limits.read_header_timeout "+
			s.cfg.Limits.ReadHeaderTimeout.String()+" for the headers, limits.read_timeout "+s.cfg.Limits.ReadTimeout.String()+" for the body)", nil)
		s.metrics.observe(unknownRoute, ctx.Response.StatusCode(), 0)
	default:
		s.handleProtocolError(ctx, err)
	}
	s.answerAndLinger(ctx)
}

// answerAndLinger sends the error answer in ctx now, half-closes the
// connection and discards what the client still sends for a moment (up to
// lingerTimeout and lingerBytes), as net/http does after an answer it cut
// short. fasthttp would write the answer and close at once, and closing a
// socket with unread input resets the connection: a client still sending
// an oversized body or header would then see the reset instead of the 413
// or 431. fasthttp's own write of the answer afterwards meets the
// half-closed socket and is dropped (it ignores that error); its close is
// then clean.
func (s *Server) answerAndLinger(ctx *fasthttp.RequestCtx) {
	c := ctx.Conn()
	ctx.SetConnectionClose()
	_ = c.SetWriteDeadline(time.Now().Add(s.cfg.Limits.WriteTimeout.D()))
	bw := bufio.NewWriterSize(c, 512)
	if ctx.Response.Write(bw) != nil || bw.Flush() != nil {
		return
	}
	lingerClose(c, false)
}

// Pool returns the encoder pool (for the demo and tests).
func (s *Server) Pool() *upstream.Pool { return s.pool }

// conf is the live config.
func (s *Server) conf() *Config { return s.live.Load() }

func poolSettings(c Config) upstream.Settings {
	return upstream.Settings{Encoders: c.Encoders, Client: c.Upstream, Breaker: c.Breaker, Health: c.Health,
		MaxInflight: c.Limits.MaxInflightPerEncoder}
}

// RefuseReload counts a reload whose file could not be read or parsed.
func (s *Server) RefuseReload() { s.metrics.reloads.WithLabelValues("refused").Inc() }

// Reload applies a new config without dropping requests in flight or the
// pins of encoders that stay: encoders, upstream client settings, retry
// policy and budget, breaker, health, limits.max_inflight_per_encoder,
// admin.token and log level change at once; settings that need a restart
// (listen addresses, the other limits, affinity, idempotency, shutdown) keep
// their running values and are named in the log. An invalid config changes
// nothing.
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
	inflight := next.Limits.MaxInflightPerEncoder // applies at once
	keep("limits", restartLimits(next.Limits) != restartLimits(cur.Limits), func() {
		merged.Limits = cur.Limits
		merged.Limits.MaxInflightPerEncoder = inflight
	})
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

// restartLimits is l without the keys a reload applies.
func restartLimits(l LimitsConfig) LimitsConfig {
	l.MaxInflightPerEncoder = 0
	return l
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
	s.conns.Listener = ln
	go func() { s.done <- s.srv.Serve(tcpconn.Listener{Listener: s.conns}) }()
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

// Shutdown drains the gateway, in this order: /readyz answers 503 (and
// every answer closes its connection); after shutdown.delay the
// encoder-facing listener closes, so new connections are refused, and idle
// connections are closed; requests in flight finish until ctx ends; then the
// admin listener, the encoder pool and the store close. It returns ctx's
// error when requests were still in flight as ctx ended.
func (s *Server) Shutdown(ctx context.Context) error {
	s.ready.Store(false)
	delay := s.cfg.Shutdown.Delay.D()
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
		zap.Int64("open_connections", s.conns.open.Load()))
	err := s.srv.ShutdownWithContext(ctx)
	s.conns.wait()
	aerr := s.admin.Shutdown(ctx)
	s.pool.Close()
	serr := s.store.Close()
	err = errors.Join(err, aerr, serr)
	s.log.Info("stopped", zap.Error(err))
	return err
}

// adminMux serves the admin listener. With admin.token set, /admin/... and
// /debug/pprof/... (heap, goroutine stacks and the command line are in
// there) need the bearer token; /healthz and /readyz stay open for probes,
// and /metrics for scrapers (its labels are bounded: route, code, encoder
// name; never a req_id or a URL).
func (s *Server) adminMux() *http.ServeMux {
	mux := http.NewServeMux()
	protected := func(pattern string, h http.HandlerFunc) { mux.Handle(pattern, s.requireToken(h)) }
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
	protected("GET /admin/upstreams", s.serveUpstreams)
	protected("GET /admin/sends/{req_id}", s.serveSendRecord)
	// Go's profiler, on the admin listener only (never the encoder-facing one).
	protected("GET /debug/pprof/", pprof.Index)
	protected("GET /debug/pprof/cmdline", pprof.Cmdline)
	protected("GET /debug/pprof/profile", pprof.Profile)
	protected("GET /debug/pprof/symbol", pprof.Symbol)
	protected("GET /debug/pprof/trace", pprof.Trace)
	return mux
}

// bearerRealm is the challenge of a 401 on the admin listener.
const bearerRealm = `Bearer realm="encgate admin"`

// requireToken lets a request through to h when admin.token is unset or the
// request carries "Authorization: Bearer <token>" (the scheme in any case,
// RFC 7235); otherwise it answers 401 with a Bearer challenge (RFC 6750).
// The live config is read per request, so a reload changes the token at
// once. Tokens are compared in constant time, as SHA-256 digests so that
// not even the length leaks.
func (s *Server) requireToken(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		want := s.conf().Admin.Token
		if want == "" {
			h.ServeHTTP(w, r)
			return
		}
		got, ok := bearerToken(r.Header.Get("Authorization"))
		switch {
		case !ok:
			s.metrics.adminUnauthorized.Inc()
			w.Header().Set("WWW-Authenticate", bearerRealm)
			writeAdminError(w, http.StatusUnauthorized, `encgate: this admin route needs "Authorization: Bearer <admin.token>"`)
		case !tokensEqual(got, want):
			s.metrics.adminUnauthorized.Inc()
			w.Header().Set("WWW-Authenticate", bearerRealm+`, error="invalid_token"`)
			writeAdminError(w, http.StatusUnauthorized, "encgate: the bearer token is not admin.token")
		default:
			h.ServeHTTP(w, r)
		}
	})
}

// bearerToken returns the token of an "Authorization: Bearer <token>" value.
func bearerToken(header string) (string, bool) {
	scheme, token, ok := strings.Cut(header, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	token = strings.TrimLeft(token, " ")
	return token, token != ""
}

func tokensEqual(got, want string) bool {
	g, w := sha256.Sum256([]byte(got)), sha256.Sum256([]byte(want))
	return subtle.ConstantTimeCompare(g[:], w[:]) == 1
}

// writeAdminError answers an admin request with the gateway's envelope.
func writeAdminError(w http.ResponseWriter, status int, msg string) {
	body, _ := json.Marshal(envelope{Status: "error", Message: msg})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// connLimiter bounds the encoder-facing listener at limits.max_conns open
// connections. It returns accepted connections unwrapped, and fasthttp's
// ConnState hook tells it when one closes. The connection one too many is
// answered with a 503 envelope and closed.
type connLimiter struct {
	net.Listener
	max      int64
	open     atomic.Int64
	accepted atomic.Uint64
	rejected atomic.Uint64
	refusal  []byte // the whole 503 response
	log      *zap.Logger
	lastLog  atomic.Int64 // unix second of the last refusal logged

	lingering chan struct{} // bounds refused connections being closed
	wg        sync.WaitGroup
}

// For a refused connection: how long the 503 may take to write, and how long
// (and how much of) the client's unread request is drained before the close,
// so that the close does not reset the connection before the client has read
// the answer (net/http does the same after an answer it cut short).
const (
	refuseWriteTimeout = time.Second
	lingerTimeout      = 500 * time.Millisecond
	lingerBytes        = 256 << 10
	maxLingering       = 128
)

func newConnLimiter(max int, log *zap.Logger) *connLimiter {
	msg := fmt.Sprintf("encgate: too many connections (limits.max_conns is %d); try again later", max)
	body, _ := json.Marshal(envelope{Status: "error", Message: msg})
	head := fmt.Sprintf("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"+
		"Retry-After: 1\r\nConnection: close\r\n\r\n", len(body))
	return &connLimiter{max: int64(max), refusal: append([]byte(head), body...), log: log,
		lingering: make(chan struct{}, maxLingering)}
}

// Accept returns the next connection within the limit, refusing the others.
func (l *connLimiter) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.open.Add(1) <= l.max {
			l.accepted.Add(1)
			return c, nil
		}
		l.open.Add(-1)
		l.rejected.Add(1)
		l.refuse(c)
	}
}

// connState counts a connection fasthttp is done with (its ConnState hook:
// every connection Accept returned ends in StateClosed or StateHijacked).
func (l *connLimiter) connState(_ net.Conn, st fasthttp.ConnState) {
	if st == fasthttp.StateClosed || st == fasthttp.StateHijacked {
		l.open.Add(-1)
	}
}

func (l *connLimiter) refuse(c net.Conn) {
	if now := time.Now().Unix(); l.lastLog.Load() < now-60 {
		l.lastLog.Store(now)
		l.log.Warn("connection refused: limits.max_conns reached (logged at most once a minute; encgate_connections_rejected_total counts them)",
			zap.Int64("max_conns", l.max), zap.Stringer("remote", c.RemoteAddr()))
	}
	_ = c.SetWriteDeadline(time.Now().Add(refuseWriteTimeout))
	if _, err := c.Write(l.refusal); err != nil {
		_ = c.Close()
		return
	}
	select {
	case l.lingering <- struct{}{}:
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			defer func() { <-l.lingering }()
			lingerClose(c, true)
		}()
	default:
		_ = c.Close()
	}
}

// lingerClose half-closes c and discards what the client still sends for
// a moment, then closes c when close is set.
func lingerClose(c net.Conn, close bool) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	_ = c.SetReadDeadline(time.Now().Add(lingerTimeout))
	_, _ = io.CopyN(io.Discard, c, lingerBytes)
	if close {
		_ = c.Close()
	}
}

// wait returns once every refused connection is closed.
func (l *connLimiter) wait() { l.wg.Wait() }

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
