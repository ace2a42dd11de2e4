package gpuagent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/gpuagent/mooncake"
	"github.com/encgate/encgate/gpuagent/pipeline"
	"github.com/encgate/encgate/internal/admin"
	"github.com/encgate/encgate/internal/bearer"
	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/sglang"
)

// Agent is a running gpuagent: the control API (staging, /send,
// /v1/receiver), the admin listener, the TTL sweeper and, when configured, a
// Mooncake TCP receiver. Build it with New, then Start; stop it with
// Shutdown.
type Agent struct {
	cfg      Config
	log      *zap.Logger
	clk      clock.Clock
	reg      Registry
	metrics  *metrics
	store    *store
	allow    []netip.Prefix
	init     *mooncake.Initiator
	recv     *mooncake.Receiver // nil when receiver is off
	notifier Notifier
	pipe     pipeline.Config // how transfers are chunked
	// gpus is the CUDA state for stages by handle. Device contexts and
	// lanes live as long as the process: a /send cut off by Shutdown may
	// still be reading one.
	gpus *gpus

	// pin and unpin register and deregister a staged region (mlock and
	// munlock); tests replace them to take the per-send fallback.
	pin, unpin func([]byte) error
	// reserved, when set (tests), is told of every reservation attempt, made
	// or refused, once the store has answered.
	reserved func(id string)
	// lookupIP resolves a destination that is not an IP literal.
	lookupIP func(ctx context.Context, host string) ([]netip.Addr, error)

	token  string        // control's bearer token; "" closes the TCP door (unless insecure)
	stages chan struct{} // one slot per stage in progress (staging.max_concurrent)

	srv     *http.Server // the TCP door
	sock    *http.Server // the Unix socket
	admin   *http.Server
	ln      net.Listener
	sockln  *unixListener
	adln    net.Listener
	started atomic.Bool
	ready   atomic.Bool
	sending atomic.Int64   // /sends being served
	sends   sync.WaitGroup // the same, to wait for (tests)
	done    chan error
	stop    chan struct{} // closed by Shutdown: ends the sweeper
	swept   chan struct{} // closed when the sweeper has ended
}

// Registry is where an agent registers its metrics and what its /metrics
// serves (admin.Registry).
type Registry = admin.Registry

// Deps are what an Agent takes from its caller.
type Deps struct {
	Log      *zap.Logger // nil means no logging
	Registry Registry    // nil means a private registry
	Clock    clock.Clock // nil means the wall clock; drives the TTL sweep and ages
	// Notifier, when set, replaces the one notify.http_url chooses.
	Notifier Notifier
}

// New builds an agent from a config; it validates the config and listens on
// nothing until Start.
func New(cfg Config, deps Deps) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	a := &Agent{
		cfg: cfg, log: deps.Log, clk: deps.Clock, reg: deps.Registry, notifier: deps.Notifier,
		allow: cfg.Transfer.allowList(), pin: syscall.Mlock, unpin: syscall.Munlock,
		done: make(chan error, 3), stop: make(chan struct{}), swept: make(chan struct{}),
		stages: make(chan struct{}, cfg.Staging.MaxConcurrent),
	}
	token, err := cfg.Control.token()
	if err != nil {
		return nil, fmt.Errorf("control.token_file: %w", err)
	}
	a.token = token
	if a.log == nil {
		a.log = zap.NewNop()
	}
	a.log = a.log.Named("gpuagent")
	if a.clk == nil {
		a.clk = clock.Real{}
	}
	if a.reg == nil {
		a.reg = prometheus.NewRegistry()
	}
	if a.notifier == nil {
		a.notifier = NopNotifier{}
		if cfg.Notify.HTTPURL != "" {
			a.notifier = &HTTPNotifier{URL: cfg.Notify.HTTPURL, Client: &http.Client{
				Timeout:   cfg.Transfer.Timeout.D(),
				Transport: http.DefaultTransport.(*http.Transport).Clone(),
			}}
		}
	}
	a.lookupIP = func(ctx context.Context, host string) ([]netip.Addr, error) {
		return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	}
	if r := cfg.Receiver; r != nil {
		bufs := make([]int, len(r.Buffers))
		for i, b := range r.Buffers {
			bufs[i] = int(b)
		}
		recv, err := mooncake.NewReceiver(mooncake.ReceiverConfig{
			HandshakeListen: r.HandshakeListen, DataListen: r.DataListen, AdvertiseHost: r.AdvertiseHost,
			Buffers: bufs, ProtoVersion: 2,
		}, a.log.Named("receiver"))
		if err != nil {
			return nil, fmt.Errorf("receiver: %w", err)
		}
		a.recv = recv
	}
	a.metrics = newMetrics(a.reg)
	a.pipe = pipeline.Config{ChunkBytes: int(cfg.Transfer.ChunkBytes), Depth: cfg.Transfer.Buffers}
	if a.gpus, err = openGPUs(cfg.CUDA, a.pipe, a.log.Named("cuda"), a.metrics); err != nil {
		return nil, err
	}
	a.store = newStore(int64(cfg.Staging.CapacityBytes), a.metrics, func(b []byte) error { return a.unpin(b) })
	a.init = mooncake.NewInitiator(mooncake.InitiatorConfig{
		ConnectTimeout: cfg.Transfer.ConnectTimeout.D(),
		Timeout:        cfg.Transfer.Timeout.D(),
		Dial:           a.dial,
	})
	hdr := cfg.Control.ReadHeaderTimeout.D()
	a.srv = &http.Server{Handler: a.tcpMux(), ReadHeaderTimeout: hdr, IdleTimeout: 120 * time.Second,
		MaxHeaderBytes: maxHeaderBytes, ErrorLog: zap.NewStdLog(a.log.Named("http"))}
	a.sock = &http.Server{Handler: a.socketMux(), ReadHeaderTimeout: hdr, IdleTimeout: 120 * time.Second,
		MaxHeaderBytes: maxHeaderBytes, ConnContext: connContext, ErrorLog: zap.NewStdLog(a.log.Named("socket"))}
	a.admin = &http.Server{Handler: a.adminMux(), ReadHeaderTimeout: hdr, MaxHeaderBytes: maxHeaderBytes,
		ErrorLog: zap.NewStdLog(a.log.Named("admin"))}
	// Shutdown runs this once the control listener is closed.
	a.srv.RegisterOnShutdown(func() {
		a.log.Info("stopped accepting; finishing in-flight requests", zap.Int64("sends_in_flight", a.sending.Load()))
	})
	return a, nil
}

// maxHeaderBytes bounds a request's headers on every listener.
const maxHeaderBytes = 64 << 10

// Receiver returns the Mooncake receiver, or nil when receiver is off.
func (a *Agent) Receiver() *mooncake.Receiver { return a.recv }

// Start listens on the Unix socket and both TCP addresses, starts the
// receiver when configured and the TTL sweeper, and serves in the
// background.
func (a *Agent) Start() error {
	sockln, err := listenUnix(a.cfg.Control)
	if err != nil {
		return fmt.Errorf("control.socket: %w", err)
	}
	ln, err := net.Listen("tcp", a.cfg.Listen)
	if err != nil {
		sockln.Close()
		return fmt.Errorf("listen: %w", err)
	}
	adln, err := net.Listen("tcp", a.cfg.AdminListen)
	if err != nil {
		sockln.Close()
		ln.Close()
		return fmt.Errorf("admin_listen: %w", err)
	}
	if a.recv != nil {
		if err := a.recv.Start(); err != nil {
			sockln.Close()
			ln.Close()
			adln.Close()
			return fmt.Errorf("receiver: %w", err)
		}
	}
	a.ln, a.adln, a.sockln = ln, adln, sockln
	a.started.Store(true)
	go a.serve(a.srv, ln)
	go a.serve(a.sock, sockln)
	go a.serve(a.admin, adln)
	go a.sweepLoop()
	a.ready.Store(true)
	fields := []zap.Field{zap.String("socket", sockln.path), zap.String("socket_mode", a.cfg.Control.SocketMode),
		zap.String("listen", ln.Addr().String()), zap.String("admin_listen", adln.Addr().String())}
	if a.recv != nil {
		fields = append(fields, zap.String("receiver_session_id", a.recv.SessionID()))
	}
	a.log.Info("agent listening", fields...)
	switch {
	case a.cfg.Control.Insecure:
		a.log.Warn("control.insecure is true: anyone who can reach listen may /send and read the receiver, without a token",
			zap.String("listen", ln.Addr().String()))
	case a.token == "":
		a.log.Warn("no control.token_file (or control.token) is configured: every request on listen gets 401, so the gateway cannot /send here",
			zap.String("listen", ln.Addr().String()))
	}
	return nil
}

func (a *Agent) serve(srv *http.Server, ln net.Listener) {
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		a.done <- err
	}
}

// SocketPath is the Unix socket the node's encoder stages over.
func (a *Agent) SocketPath() string { return a.cfg.Control.Socket }

// Addr is the TCP door's address actually bound.
func (a *Agent) Addr() string { return a.ln.Addr().String() }

// AdminAddr is the admin address actually bound.
func (a *Agent) AdminAddr() string { return a.adln.Addr().String() }

// Done reports a listener that stopped on its own.
func (a *Agent) Done() <-chan error { return a.done }

// Shutdown drains: it goes not-ready first (/readyz answers 503, and the
// admin listener stays up until the end), stops accepting on the control
// listener, lets in-flight requests (a /send with its transfer and ack)
// finish until ctx ends (then closes their connections), and stops the
// sweeper, the initiator's connections and the receiver. Every staged
// embedding is freed (those still used by a /send cut off by ctx once it
// returns).
func (a *Agent) Shutdown(ctx context.Context) error {
	a.ready.Store(false)
	a.log.Info("draining")
	var err error
	if a.started.Swap(false) {
		var sockErr error
		stopped := make(chan struct{})
		go func() { // stages and /sends drain side by side
			defer close(stopped)
			if sockErr = a.sock.Shutdown(ctx); sockErr != nil {
				sockErr = errors.Join(sockErr, a.sock.Close())
			}
		}()
		err = a.srv.Shutdown(ctx)
		if err != nil {
			err = errors.Join(err, a.srv.Close())
		}
		<-stopped
		err = errors.Join(err, sockErr)
		if aerr := a.admin.Shutdown(ctx); aerr != nil {
			err = errors.Join(err, aerr, a.admin.Close())
		}
		close(a.stop)
		<-a.swept
	}
	err = errors.Join(err, a.init.Close())
	if c, ok := a.notifier.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
	if a.recv != nil {
		err = errors.Join(err, a.recv.Close())
	}
	n, acks := a.store.releaseAll()
	a.log.Info("stopped", zap.Int("released", n), zap.Int("ack_frames_without_embedding", acks), zap.Error(err))
	return err
}

// sweepLoop releases entries older than staging.ttl, checking every
// max(ttl/4, 10ms) as sglang's sweeper does.
func (a *Agent) sweepLoop() {
	defer close(a.swept)
	ttl := a.cfg.Staging.TTL.D()
	every := max(ttl/4, 10*time.Millisecond)
	for {
		t := a.clk.NewTimer(every)
		select {
		case <-a.stop:
			t.Stop()
			return
		case <-t.C():
			if n, acks := a.store.sweep(a.clk.Now(), ttl); n > 0 || acks > 0 {
				a.log.Info("swept staged embeddings never fully sent", zap.Int("released", n),
					zap.Int("ack_frames_without_embedding", acks), zap.Duration("ttl", ttl))
			}
		}
	}
}

// NotAllowedError is a destination outside transfer.allow_networks, or one
// whose name could not be resolved to check it.
type NotAllowedError struct {
	Host string     // as the caller named it
	Addr netip.Addr // the address outside allow_networks, when known
	Err  error      // why the name could not be checked, when it could not
}

func (e *NotAllowedError) Error() string {
	switch {
	case e.Err != nil:
		return fmt.Sprintf("destination %s cannot be checked against transfer.allow_networks: %v", e.Host, e.Err)
	case e.Addr.IsValid() && e.Addr.String() != e.Host:
		return fmt.Sprintf("destination %s (%s) is not in transfer.allow_networks", e.Host, e.Addr)
	}
	return fmt.Sprintf("destination %s is not in transfer.allow_networks", e.Host)
}

// Unwrap returns the resolution error, if any.
func (e *NotAllowedError) Unwrap() error { return e.Err }

func (a *Agent) allowed(ip netip.Addr) bool {
	ip = ip.Unmap().WithZone("")
	for _, p := range a.allow {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

// checkHost refuses a host outside allow_networks: an IP literal directly, a
// name when any of its addresses is outside (or it resolves to none).
func (a *Agent) checkHost(ctx context.Context, host string) error {
	if ip, err := netip.ParseAddr(host); err == nil {
		if !a.allowed(ip) {
			return &NotAllowedError{Host: host, Addr: ip}
		}
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, a.cfg.Transfer.ConnectTimeout.D())
	defer cancel()
	ips, err := a.lookupIP(ctx, host)
	if err != nil {
		return &NotAllowedError{Host: host, Err: err}
	}
	if len(ips) == 0 {
		return &NotAllowedError{Host: host, Err: errors.New("no addresses")}
	}
	for _, ip := range ips {
		if !a.allowed(ip) {
			return &NotAllowedError{Host: host, Addr: ip}
		}
	}
	return nil
}

// dial is the initiator's dialer: every connection it opens is checked
// against allow_networks at the address actually connected to.
func (a *Agent) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	return a.dialer(a.cfg.Transfer.ConnectTimeout.D()).DialContext(ctx, network, addr)
}

// dialer connects within timeout to addresses inside allow_networks only,
// checked at the address actually connected to.
func (a *Agent) dialer(timeout time.Duration) *net.Dialer {
	return &net.Dialer{
		Timeout: timeout,
		Control: func(_, address string, _ syscall.RawConn) error {
			ap, err := netip.ParseAddrPort(address)
			if err != nil {
				return err
			}
			if !a.allowed(ap.Addr()) {
				return &NotAllowedError{Host: ap.Addr().String(), Addr: ap.Addr()}
			}
			return nil
		},
	}
}

// adminMux serves the agent's admin listener: the routes every admin
// listener has (internal/admin), and the agent's own behind admin.token.
func (a *Agent) adminMux() *http.ServeMux {
	mux, protected, page := admin.NewMux(admin.Options{
		Registry: a.reg,
		Ready:    a.ready.Load,
		Token:    func() string { return a.cfg.Admin.Token },
		Realm:    "encgate agent admin",
		Refused: func(r *http.Request, o bearer.Outcome) {
			a.metrics.unauthorized.WithLabelValues("admin").Inc()
			if c := a.log.Check(zap.DebugLevel, "refused an unauthenticated request"); c != nil {
				c.Write(zap.String("door", "admin"), zap.String("path", r.URL.Path), zap.String("remote", r.RemoteAddr))
			}
		},
		Clock:  a.clk,
		Cookie: "encgate_agent_admin",
		Title:  "encgate agent",
	})
	page("GET /{$}", a.serveStatus) // the status page (status.go)
	protected("GET /admin/staged", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, a.store.snapshot(a.clk.Now()))
	})
	return mux
}

// routeLabels maps the control API's patterns to the route label of
// encgate_agent_requests_total; anything else is "other".
var routeLabels = map[string]string{
	"POST /v1/stage":         "stage",
	"POST /v1/ack":           "ack",
	"POST /send":             "send",
	"GET /v1/receiver":       "receiver",
	"GET /v1/receiver/bytes": "receiver_bytes",
}

// counted serves mux and counts each answer by route and code; after, when
// set, runs once the handler has returned.
func (a *Agent) counted(mux *http.ServeMux, after func(*http.Request)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := &statusRecorder{ResponseWriter: w, code: http.StatusOK}
		mux.ServeHTTP(rec, r)
		if after != nil {
			after(r)
		}
		route, ok := routeLabels[r.Pattern]
		if !ok {
			route = "other"
		}
		a.metrics.request(route, rec.code)
	})
}

// statusRecorder remembers the status a handler wrote.
type statusRecorder struct {
	http.ResponseWriter
	code int
}

func (s *statusRecorder) WriteHeader(code int) {
	s.code = code
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusRecorder) Unwrap() http.ResponseWriter { return s.ResponseWriter }

// writeEnvelope answers with the encoder's error envelope; reqID "" is null.
func writeEnvelope(w http.ResponseWriter, status int, message, reqID string) {
	var id *string
	if reqID != "" {
		id = &reqID
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(sglang.AppendEnvelope(nil, message, id))
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil { // cannot happen for these types; keep the caller informed anyway
		status, body = http.StatusInternalServerError, []byte(`{"status":"error","message":"encgate: internal error","req_id":null}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
