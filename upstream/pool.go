// Package upstream is the encoder pool: the encoders and their connections,
// rendezvous selection, req_id affinity (pins), breakers and active health,
// retry policy and budget, and the classification of upstream failures.
package upstream

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/url"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/tcpconn"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
)

// Encoder is one encoder of the fleet, the gateway's connections to it, its
// breaker (passive health) and its active health.
type Encoder struct {
	Name string
	URL  string

	hash   uint64 // of the name: the rendezvous identity
	id     uint64 // of name and URL: the pin identity
	host   string // Host header and address, host:port
	scheme string // http or https
	client *fasthttp.HostClient
	probes *fasthttp.HostClient // health checks only
	agent  *hostClient          // the node's gpuagent for /send, nil when none

	Breaker *Breaker
	Health  *Health
	stop    context.CancelFunc // stops the health loop
	stopped chan struct{}

	inflight atomic.Int64
	requests atomic.Uint64
	forced   atomic.Int32 // tests and the demo: 0 normal, 1 forced usable, 2 forced unusable

	// maxInflight is the pool's limits.max_inflight_per_encoder (<= 0: no
	// limit), shared by every encoder so that a reload changes it for all.
	maxInflight     *atomic.Int64
	refusedInflight prometheus.Counter // nil outside a pool
	refusedConns    prometheus.Counter
}

// ID identifies e's name and URL; pins record it (PinTable.Set).
func (e *Encoder) ID() uint64 { return e.id }

// Inflight returns the number of exchanges in progress with e.
func (e *Encoder) Inflight() int64 { return e.inflight.Load() }

// Requests returns the number of exchanges started with e.
func (e *Encoder) Requests() uint64 { return e.requests.Load() }

// Usable reports whether e may receive new work: actively healthy and its
// breaker not open.
func (e *Encoder) Usable() bool {
	switch e.forced.Load() {
	case 1:
		return true
	case 2:
		return false
	}
	return e.Health.Up() && e.Breaker.State() != BreakerOpen
}

// SetUsable overrides health and breaker (tests, maintenance); Unforce ends it.
func (e *Encoder) SetUsable(ok bool) {
	if ok {
		e.forced.Store(1)
	} else {
		e.forced.Store(2)
	}
}

// Unforce returns e to health- and breaker-driven usability.
func (e *Encoder) Unforce() { e.forced.Store(0) }

// State describes why e is or is not usable, for envelopes and admin.
func (e *Encoder) State() string {
	switch {
	case e.forced.Load() == 2:
		return "disabled"
	case !e.Health.Up():
		return "down (active health)"
	case e.Breaker.State() == BreakerOpen:
		return "open (circuit breaker)"
	case e.Breaker.State() == BreakerHalfOpen:
		return "half_open (circuit breaker)"
	}
	return "up"
}

// hostClient is a client for one base URL.
type hostClient struct {
	host, scheme string
	client       *fasthttp.HostClient
}

// HasAgent reports whether e's /sends go to a gpuagent.
func (e *Encoder) HasAgent() bool { return e.agent != nil }

// DoSend is Do for /send: to the node's gpuagent when e has one.
func (e *Encoder) DoSend(req *fasthttp.Request, resp *fasthttp.Response, timeout time.Duration) error {
	if e.agent == nil {
		return e.Do(req, resp, timeout)
	}
	if err := e.acquire(); err != nil {
		return err
	}
	defer e.inflight.Add(-1)
	return e.refusedByPool(do(e.agent.client, e.agent.host, e.agent.scheme, req, resp, timeout))
}

// Do sends req to e and reads the answer into resp within timeout. The
// caller sets method, path, headers and body; Do sets the host. A connect
// failure is a *DialError; a timeout wraps fasthttp.ErrTimeout. A request
// that meets a pooled connection the encoder had already closed is sent on
// another connection: provably nothing of it was delivered. With
// limits.max_inflight_per_encoder exchanges already in flight to e, Do sends
// nothing and returns an *InflightLimitError.
func (e *Encoder) Do(req *fasthttp.Request, resp *fasthttp.Response, timeout time.Duration) error {
	if err := e.acquire(); err != nil {
		return err
	}
	defer e.inflight.Add(-1)
	return e.refusedByPool(do(e.client, e.host, e.scheme, req, resp, timeout))
}

// acquire counts one more exchange in flight to e, or refuses it when the
// pool's in-flight limit is reached (the caller sends nothing then). Its
// /sends to an agent count against the same limit: one entry, one budget.
func (e *Encoder) acquire() error {
	n := e.inflight.Add(1)
	if e.maxInflight != nil {
		if limit := e.maxInflight.Load(); limit > 0 && n > limit {
			e.inflight.Add(-1)
			if e.refusedInflight != nil {
				e.refusedInflight.Inc()
			}
			return &InflightLimitError{Encoder: e.Name, Limit: limit}
		}
	}
	e.requests.Add(1)
	return nil
}

// refusedByPool counts an exchange refused for want of a free connection.
func (e *Encoder) refusedByPool(err error) error {
	if err != nil && e.refusedConns != nil && errors.Is(err, fasthttp.ErrNoFreeConns) {
		e.refusedConns.Inc()
	}
	return err
}

func do(c *fasthttp.HostClient, host, scheme string, req *fasthttp.Request, resp *fasthttp.Response, timeout time.Duration) error {
	req.Header.SetHost(host)
	req.URI().SetScheme(scheme)
	resp.Header.SetNoDefaultContentType(true)
	err := c.DoTimeout(req, resp, timeout)
	if err == nil || !IsStale(err) {
		return err
	}
	// A stale connection is found before anything is written, right after
	// it is taken from the pool: the re-sends share what is left of the
	// timeout, counted from here (the clock is read only on this path).
	deadline := time.Now().Add(timeout)
	for attempt := 1; ; attempt++ {
		err = c.DoDeadline(req, resp, deadline)
		if err == nil || !IsStale(err) || attempt == maxStaleRetries {
			return err
		}
	}
}

// maxStaleRetries bounds re-sends after stale pooled connections; each
// closes the stale connection, so the pool drains quickly.
const maxStaleRetries = 8

// Settings are the parts of the config the pool applies, at start and on
// every reload.
type Settings struct {
	Encoders []EncoderConfig
	Client   ClientConfig
	Breaker  BreakerConfig
	Health   HealthConfig
	// MaxInflight bounds exchanges in flight to one encoder (the gateway's
	// limits.max_inflight_per_encoder); <= 0 means no bound. A reload
	// changes it for every encoder at once, rebuilding nothing.
	MaxInflight int
}

// fleet is an immutable snapshot of the encoders, swapped on reload.
type fleet struct {
	list   []*Encoder
	byName map[string]*Encoder
	set    Settings
}

// Pool holds the fleet and the pin table. It is safe for concurrent use.
type Pool struct {
	log  *zap.Logger
	clk  clock.Clock
	aff  AffinityConfig
	Pins *PinTable
	m    *poolMetrics

	fleet       atomic.Pointer[fleet]
	reloadMu    sync.Mutex   // serialises Reload
	maxInflight atomic.Int64 // Settings.MaxInflight, read by every encoder

	cancel context.CancelFunc
	done   chan struct{}
}

// NewPool builds the pool, starts its pin sweeper and every encoder's
// health loop; Close stops them.
func NewPool(set Settings, aff AffinityConfig, clk clock.Clock, log *zap.Logger, reg prometheus.Registerer) (*Pool, error) {
	p := &Pool{
		log:  log,
		clk:  clk,
		aff:  aff,
		Pins: NewPinTable(aff.PinTTL.D(), aff.MaxPins, clk),
		m:    newPoolMetrics(reg),
		done: make(chan struct{}),
	}
	p.maxInflight.Store(int64(set.MaxInflight))
	f := &fleet{byName: map[string]*Encoder{}, set: set}
	for _, ec := range set.Encoders {
		e, err := p.newEncoder(ec, set)
		if err != nil {
			p.stopAll(f.list)
			return nil, err
		}
		f.list = append(f.list, e)
		f.byName[e.Name] = e
	}
	p.fleet.Store(f)
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	go p.sweep(ctx)
	return p, nil
}

func (p *Pool) newEncoder(ec EncoderConfig, set Settings) (*Encoder, error) {
	u, err := url.Parse(ec.URL)
	if err != nil {
		return nil, err
	}
	e := &Encoder{Name: ec.Name, URL: ec.URL, hash: xxhash.Sum64String(ec.Name), id: encoderID(ec),
		host: u.Host, scheme: u.Scheme, maxInflight: &p.maxInflight}
	e.refusedInflight, e.refusedConns = p.m.refusals(ec.Name)
	e.client = newClient(ec.Name, u, set.Client)
	e.Breaker = NewBreaker(ec.Name, set.Breaker, p.breakerChanged)
	// Probes get their own small pool: an encoder whose traffic connections
	// are all busy must not fail its health check for want of one.
	probeClient := newClient(ec.Name, u, ClientConfig{ConnectTimeout: set.Client.ConnectTimeout,
		IdleConnTimeout: set.Client.IdleConnTimeout, MaxConnsPerEncoder: 2, MaxResponseBytes: 64 << 10})
	e.probes = probeClient
	if ec.Agent != "" {
		au, err := url.Parse(ec.Agent)
		if err != nil {
			return nil, err
		}
		e.agent = &hostClient{host: au.Host, scheme: au.Scheme, client: newClient(ec.Name+" agent", au, set.Client)}
	}
	probe := HTTPProber(probeClient, u.Scheme, u.Host, set.Health.Path, set.Health.Timeout.D())
	e.Health = NewHealth(ec.Name, set.Health, probe, p.clk, func(up bool) { p.healthChanged(e, up) },
		func(err error) { p.probeResult(e, err) }, p.log)
	p.m.track(e)
	ctx, cancel := context.WithCancel(context.Background())
	e.stop, e.stopped = cancel, make(chan struct{})
	go func() {
		defer close(e.stopped)
		defer func() {
			if r := recover(); r != nil {
				p.log.Error("health loop panicked", zap.String("encoder", e.Name), zap.Any("panic", r), zap.Stack("stack"))
			}
		}()
		e.Health.Run(ctx)
	}()
	return e, nil
}

// encoderID covers what holds a req_id's state: the encoder, and the agent
// holding its staged embeddings.
func encoderID(ec EncoderConfig) uint64 {
	return xxhash.Sum64String(ec.Name + "\x00" + ec.URL + "\x00" + ec.Agent)
}

func newClient(name string, u *url.URL, cc ClientConfig) *fasthttp.HostClient {
	dialer := &net.Dialer{Timeout: cc.ConnectTimeout.D(), KeepAlive: 30 * time.Second}
	return &fasthttp.HostClient{
		Addr:                      u.Host,
		IsTLS:                     u.Scheme == "https",
		TLSConfig:                 &tls.Config{MinVersion: tls.VersionTLS12},
		MaxConns:                  cc.MaxConnsPerEncoder,
		MaxIdleConnDuration:       cc.IdleConnTimeout.D(),
		MaxResponseBodySize:       int(cc.MaxResponseBytes),
		MaxIdemponentCallAttempts: 1,
		// Never let the client retry on its own: whether a request may be
		// sent again is the gateway's decision (see DESIGN.md).
		RetryIfErr:               func(*fasthttp.Request, int, error) (bool, bool) { return false, false },
		NoDefaultUserAgentHeader: true,
		DisablePathNormalizing:   true,
		Dial: func(addr string) (net.Conn, error) {
			c, err := dialer.Dial("tcp", addr)
			if err != nil {
				return nil, &DialError{Encoder: name, Err: err}
			}
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetNoDelay(true)
			}
			return newProbedConn(tcpconn.Client(c)), nil
		},
	}
}

func (p *Pool) breakerChanged(name string, from, to BreakerState) {
	p.m.breakerChanged(name, from, to)
	p.log.Info("breaker state changed", zap.String("encoder", name),
		zap.String("from", from.String()), zap.String("to", to.String()))
}

func (p *Pool) healthChanged(e *Encoder, up bool) {
	p.m.healthChanged(e.Name, up)
	s := e.Health.Snapshot()
	if up {
		p.log.Info("encoder is up (active health)", zap.String("encoder", e.Name))
	} else {
		p.log.Warn("encoder is down (active health)", zap.String("encoder", e.Name), zap.String("last_error", s.LastError))
	}
}

// probeResult lets a half-open breaker use an active probe as its trial.
func (p *Pool) probeResult(e *Encoder, err error) {
	if e.Breaker.State() != BreakerHalfOpen {
		return
	}
	if done, ok := e.Breaker.Allow(); ok {
		done(Outcome{Status: 200, Err: err})
	}
}

// Encoders returns the fleet in configuration order.
func (p *Pool) Encoders() []*Encoder { return p.fleet.Load().list }

// Lookup returns the encoder called name.
func (p *Pool) Lookup(name string) (*Encoder, bool) {
	e, ok := p.fleet.Load().byName[name]
	return e, ok
}

// Ranked appends the usable encoders to dst in rendezvous order for reqID.
func (p *Pool) Ranked(reqID string, dst []*Encoder) []*Encoder {
	var buf [16]*Encoder
	usable := buf[:0]
	for _, e := range p.Encoders() {
		if e.Usable() {
			usable = append(usable, e)
		}
	}
	return rank(reqID, usable, dst)
}

// Owner returns the first usable encoder in rendezvous order for reqID.
func (p *Pool) Owner(reqID string) (*Encoder, error) {
	var buf [16]*Encoder
	r := p.Ranked(reqID, buf[:0])
	if len(r) == 0 {
		return nil, ErrNoEncoder
	}
	return r[0], nil
}

// AnyUsable reports whether at least one encoder is usable.
func (p *Pool) AnyUsable() bool {
	for _, e := range p.Encoders() {
		if e.Usable() {
			return true
		}
	}
	return false
}

// Route returns the encoder that holds reqID: its pin, waiting up to
// affinity.unknown_wait for one, else the rendezvous owner. A pin that
// records a failed /encode is returned with a nil encoder and pin.Failed.
// A pinned encoder that is down or open is an *UnusableEncoderError: its
// staged state cannot move, so the caller fails fast.
func (p *Pool) Route(reqID string, done <-chan struct{}) (*Encoder, Pin, error) {
	pin, ok := p.Pins.Wait(reqID, p.aff.UnknownWait.D(), done)
	if !ok {
		e, err := p.Owner(reqID)
		return e, Pin{}, err
	}
	if pin.Failed {
		return nil, pin, nil
	}
	e, found := p.Lookup(pin.Encoder)
	if !found || e.id != pin.EncoderID {
		return nil, pin, &UnknownEncoderError{Name: pin.Encoder}
	}
	if !e.Usable() {
		return e, pin, &UnusableEncoderError{Name: e.Name, State: e.State()}
	}
	return e, pin, nil
}

// Reload applies new settings: encoders that keep their name and URL keep
// their connections, breaker, health and pins; new ones start; removed ones
// (and names moved to another URL, whose staged state stays behind) stop
// their health loop and close idle connections, while requests in flight on
// them finish. A changed breaker or health config rebuilds those
// for every encoder (their state starts afresh).
func (p *Pool) Reload(set Settings) (added, removed []string, err error) {
	p.reloadMu.Lock()
	defer p.reloadMu.Unlock()
	old := p.fleet.Load()
	rebuild := !sameBreakerHealth(old.set, set) || old.set.Client != set.Client
	next := &fleet{byName: map[string]*Encoder{}, set: set}
	var fresh []*Encoder
	for _, ec := range set.Encoders {
		if e, ok := old.byName[ec.Name]; ok && e.id == encoderID(ec) && !rebuild {
			next.list = append(next.list, e)
			next.byName[e.Name] = e
			continue
		}
		e, err := p.newEncoder(ec, set)
		if err != nil {
			p.stopAll(fresh)
			return nil, nil, err
		}
		fresh = append(fresh, e)
		next.list = append(next.list, e)
		next.byName[e.Name] = e
		if prev, existed := old.byName[ec.Name]; !existed || prev.id != e.id {
			added = append(added, e.Name) // a moved name counts as removed and added
		}
	}
	var retired []*Encoder
	for _, e := range old.list {
		if next.byName[e.Name] != e {
			retired = append(retired, e)
			if n, stays := next.byName[e.Name]; !stays || n.id != e.id {
				removed = append(removed, e.Name)
			}
		}
	}
	p.maxInflight.Store(int64(set.MaxInflight))
	p.fleet.Store(next)
	p.stopAll(retired)
	for _, e := range retired {
		if _, stays := next.byName[e.Name]; !stays {
			p.m.forget(e.Name)
		}
	}
	// Pins of a moved name now fail fast with "no longer configured"
	// (their EncoderID no longer matches).
	for _, e := range fresh {
		p.m.track(e)
	}
	return added, removed, nil
}

func sameBreakerHealth(a, b Settings) bool {
	return reflect.DeepEqual(a.Breaker, b.Breaker) && a.Health == b.Health
}

// stopAll stops the health loops and breaker timers of encs and closes
// their idle connections; requests in flight on them finish.
func (p *Pool) stopAll(encs []*Encoder) {
	for _, e := range encs {
		e.stop()
		<-e.stopped
		e.Breaker.Stop()
		e.client.CloseIdleConnections()
		e.probes.CloseIdleConnections()
		if e.agent != nil {
			e.agent.client.CloseIdleConnections()
		}
	}
}

func (p *Pool) sweep(ctx context.Context) {
	defer close(p.done)
	defer func() {
		if r := recover(); r != nil {
			p.log.Error("pin sweeper panicked", zap.Any("panic", r), zap.Stack("stack"))
		}
	}()
	every := p.aff.PinTTL.D() / 8
	for {
		t := p.clk.NewTimer(every)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C():
			p.Pins.Sweep()
		}
	}
}

// Close stops the sweeper and every health loop, and closes idle connections.
func (p *Pool) Close() {
	p.cancel()
	<-p.done
	p.stopAll(p.Encoders())
}

// IsTimeout reports whether err is an upstream timeout.
func IsTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, fasthttp.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) ||
		(errors.As(err, &ne) && ne.Timeout())
}
