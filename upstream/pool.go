// Package upstream is the encoder pool and the request path's exchange
// with it: the encoders and their connections, rendezvous selection, req_id
// affinity (pins), the attempt loop with its two strategies (ranked for
// /encode, pinned for follow-ups), one Verdict per exchange (Judge), the
// breakers it alone drives, active health, and retry policy and budget.
package upstream

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"net/url"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/bearer"
	"github.com/encgate/encgate/internal/sglang"
	"github.com/encgate/encgate/internal/tcpconn"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/poller"
)

// Encoder is one encoder of the fleet, the gateway's connections to it, its
// breaker (passive health) and its active health.
type Encoder struct {
	Name string
	URL  string

	hash   uint64               // of the name: the rendezvous identity
	id     uint64               // of name and URL: the pin identity
	self   hostClient           // the encoder's own connections
	probes *fasthttp.HostClient // health checks only
	agent  *hostClient          // the node's gpuagent for /send, nil when none

	Breaker *Breaker
	Health  *Health
	stop    context.CancelFunc // stops the health loop
	stopped chan struct{}

	inflight atomic.Int64
	requests atomic.Uint64
	forced   atomic.Int32 // tests and the demo: 0 normal, 1 forced usable, 2 forced unusable

	source   atomic.Pointer[string] // EncoderConfig.Source, as the fleet last said (changed in place)
	draining atomic.Bool            // EncoderConfig.Draining, likewise

	gen      atomic.Uint32         // Generation, as the config last said (a reload changes it in place)
	learned  learned               // what its answers taught (learn.go)
	outcomes [4]prometheus.Counter // encgate_breaker_outcomes_total by Mark; nil outside a pool
	latency  prometheus.Observer   // encgate_upstream_request_duration_seconds; nil outside a pool

	// polls counts the long polls among inflight: metadata pulls and
	// registrations of a part not known encoded (target.poll).
	polls atomic.Int64
	// limits are the pool's in-flight bounds (limits.max_inflight_per_encoder
	// and limits.poll_share), shared by every encoder so that a reload
	// changes them for all; nil: none.
	limits          *atomic.Pointer[inflightLimits]
	refusedInflight prometheus.Counter // nil outside a pool
	refusedPolls    prometheus.Counter // nil outside a pool
	pollsGauge      prometheus.Gauge   // encgate_upstream_polls_inflight; nil outside a pool
	refusedConns    prometheus.Counter
	// forgotten: the encoder left the fleet and poolMetrics.forget deleted
	// its name's series; nothing counted for it may create them again.
	forgotten atomic.Bool
}

// ID identifies e's name and URL; pins record it (PinTable.Set).
func (e *Encoder) ID() uint64 { return e.id }

// Source returns where e came from (SourceStatic, SourceRegistered,
// SourceDNS).
func (e *Encoder) Source() string {
	if s := e.source.Load(); s != nil {
		return *s
	}
	return SourceStatic
}

// Draining reports whether e left its source: no new work goes to it, and
// the pins it holds are still followed.
func (e *Encoder) Draining() bool { return e.draining.Load() }

func (e *Encoder) setMembership(ec EncoderConfig) {
	src := ec.Source
	if src == "" {
		src = SourceStatic
	}
	if cur := e.source.Load(); cur == nil || *cur != src {
		e.source.Store(&src)
	}
	e.draining.Store(ec.Draining)
}

// Inflight returns the number of exchanges in progress with e.
func (e *Encoder) Inflight() int64 { return e.inflight.Load() }

// Polls returns the number of long polls among e's exchanges in progress:
// metadata pulls and registrations of parts not known encoded, which
// limits.poll_share bounds.
func (e *Encoder) Polls() int64 { return e.polls.Load() }

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

// Generation returns encoders[].generation, the override of what is
// learned (GenAuto when unset).
func (e *Encoder) Generation() Generation { return generations[e.gen.Load()] }

// Down reports whether e is out of service by active health (or forced
// unusable): no exchange is tried with it, even for state it holds.
func (e *Encoder) Down() bool {
	switch e.forced.Load() {
	case 1:
		return false
	case 2:
		return true
	}
	return !e.Health.Up()
}

// hostClient is a client for one base URL.
type hostClient struct {
	host, scheme, url string
	client            *fasthttp.HostClient
	// auth is the Authorization value every request to this host carries
	// ("Bearer <token>"), nil for none. Only an agent's client has one (its
	// agent_token_file); a reload replaces it in place (setToken), so the
	// encoder keeps its connections and pins.
	auth atomic.Pointer[string]
}

// setToken makes every later request to hc carry "Authorization: Bearer
// token"; "" stops it.
func (hc *hostClient) setToken(token string) {
	if token == "" {
		hc.auth.Store(nil)
		return
	}
	v := "Bearer " + token
	hc.auth.Store(&v)
}

// HasAgent reports whether e's /sends go to a gpuagent.
func (e *Encoder) HasAgent() bool { return e.agent != nil }

// target is where one attempt goes: e itself, or for /send its node's
// agent, chosen when the attempt is picked.
type target struct {
	enc  *Encoder
	hc   *hostClient
	name Target
	// place, for an /encode being placed, pins the req_id here. It runs
	// once the breaker and the in-flight limit have admitted the attempt,
	// just before the request is written, so that follow-ups waiting for
	// the pin never go to an encoder the /encode then skips unsent. A
	// placement whose breaker admits nothing is refused unsent (the /encode
	// may go to the next encoder); other attempts carry state that cannot
	// move and go uncounted.
	// place reports false when another /encode pinned the req_id to a
	// different encoder first: nothing is sent then.
	place func() bool
	// poll marks a long poll: a metadata pull or registration of a part
	// whose pin, read as the attempt was picked, does not say encoded (no
	// pin, or pending). The encoder may hold it up to 180 s, so it is
	// admitted against the long polls' own bound as well as the total
	// (Encoder.acquire). Everything else (/encode, /send, a follow-up of a
	// part already encoded, answered at once) counts against the total
	// only, and so keeps the share of it long polls may never take.
	poll bool
	// failedReg, for a registration of a part whose /encode this encoder
	// failed, caps the try at affinity.failed_registration_wait: an
	// encoder that takes it answers at once (and pushes its error frame
	// to the rank); one that holds it is cut off there and the rank gets
	// the remembered failure (Pool.endFailedRegistration). Zero otherwise.
	failedReg time.Duration
}

// targetFor is e's target for route rt.
func (e *Encoder) targetFor(rt *sglang.Route, place func() bool) target {
	hc := &e.self
	if rt.Kind == sglang.KindSend && e.agent != nil {
		hc = e.agent
	}
	return target{enc: e, hc: hc, place: place, name: Target{Encoder: e.Name, URL: hc.url, Agent: hc != &e.self}}
}

// do sends req within timeout and reads the answer into resp. A connect
// failure is a *DialError; a timeout wraps fasthttp.ErrTimeout. A request
// that meets a pooled connection the encoder had already closed is sent on
// another connection: provably nothing of it was delivered. With
// limits.max_inflight_per_encoder exchanges already in flight to the
// encoder (its agent's included), or for a long poll (t.poll) with the long
// polls' bound already held, it sends nothing and returns an
// *InflightLimitError.
func (t *target) do(req *fasthttp.Request, resp *fasthttp.Response, timeout time.Duration) error {
	if err := t.enc.acquire(t.poll); err != nil {
		return err
	}
	defer t.enc.release(t.poll)
	if t.place != nil && !t.place() {
		return errPlacedElsewhere
	}
	if auth := t.hc.auth.Load(); auth != nil {
		// Set, not added: it replaces any Authorization req holds. The
		// request is built afresh for each attempt from the call's method,
		// path, content type and body, so none of the caller's headers
		// (its Authorization included) reach an encoder or an agent.
		req.Header.Set(fasthttp.HeaderAuthorization, *auth)
	}
	return t.enc.refusedByPool(do(t.hc.client, t.hc.host, t.hc.scheme, req, resp, timeout))
}

// send is do up to the wait for the answer (sendRequest), for an attempt
// that may park: the in-flight slot it takes is released by the caller
// once the answer is read (sentRequest.receive), or here when nothing
// could be sent. begun says the answer began within wait (sendRequest);
// the exchange is kept in dst.
func (t *target) send(dst *sentRequest, req *fasthttp.Request, resp *fasthttp.Response, timeout, wait time.Duration) (sent *sentRequest, begun bool, err error) {
	if err := t.enc.acquire(t.poll); err != nil {
		return nil, false, err
	}
	if t.place != nil && !t.place() {
		t.enc.release(t.poll)
		return nil, false, errPlacedElsewhere
	}
	if auth := t.hc.auth.Load(); auth != nil {
		req.Header.Set(fasthttp.HeaderAuthorization, *auth) // as do
	}
	sent, begun, err = sendRequest(dst, t.hc.client, t.hc.host, t.hc.scheme, req, resp, timeout, wait)
	if err != nil {
		t.enc.release(t.poll)
		return nil, false, t.enc.refusedByPool(err)
	}
	return sent, begun, nil
}

// inflightLimits are the bounds Encoder.acquire applies, swapped whole on
// reload so that an exchange reads one consistent pair.
type inflightLimits struct {
	total int64   // limits.max_inflight_per_encoder; <= 0: none
	polls int64   // long polls' own bound, below total; <= 0: none of their own
	share float64 // limits.poll_share, which polls was computed from
}

func newInflightLimits(total int, share float64) *inflightLimits {
	l := &inflightLimits{total: int64(total), share: share}
	if total > 0 && share > 0 {
		l.polls = int64(PollBound(total, share))
	}
	return l
}

// PollBound is how many long polls one encoder may hold under
// limits.max_inflight_per_encoder total and limits.poll_share share (in
// (0,1)): floor(share × total), at least 1. The rest of total is reserved
// for the calls that start or complete a part (/encode, /send, a follow-up
// of an encoded part), which held pulls can then never crowd out. With a
// total of 1 the long polls share its one slot.
func PollBound(total int, share float64) int {
	// The epsilon keeps a product that floating point puts a hair below an
	// integer (0.29 × 100 = 28.999…) on that integer.
	n := int(math.Floor(share*float64(total) + 1e-9))
	return max(1, min(n, total))
}

// acquire counts one more exchange in flight to e, or refuses it when the
// pool's in-flight limit is reached (the caller sends nothing then); a long
// poll (poll) is also counted against, and refused at, the long polls' own
// bound. Each acquire that returns nil is paired with release(poll).
func (e *Encoder) acquire(poll bool) error {
	var lim *inflightLimits
	if e.limits != nil {
		lim = e.limits.Load()
	}
	if poll {
		n := e.polls.Add(1)
		if lim != nil && lim.polls > 0 && n > lim.polls {
			e.polls.Add(-1)
			if e.refusedPolls != nil {
				e.refusedPolls.Inc()
			}
			return &InflightLimitError{Encoder: e.Name, Limit: lim.polls, Polls: true, Total: lim.total, Share: lim.share}
		}
	}
	n := e.inflight.Add(1)
	if lim != nil && lim.total > 0 && n > lim.total {
		e.inflight.Add(-1)
		if poll {
			e.polls.Add(-1)
		}
		if e.refusedInflight != nil {
			e.refusedInflight.Inc()
		}
		return &InflightLimitError{Encoder: e.Name, Limit: lim.total, Total: lim.total}
	}
	if poll && e.pollsGauge != nil {
		e.pollsGauge.Inc()
	}
	e.requests.Add(1)
	return nil
}

// release ends an exchange acquire admitted.
func (e *Encoder) release(poll bool) {
	if poll {
		e.polls.Add(-1)
		if e.pollsGauge != nil {
			e.pollsGauge.Dec()
		}
	}
	e.inflight.Add(-1)
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
	err := staleIfUnsent(c.DoTimeout(req, resp, timeout), resp)
	if err == nil || !isStale(err) {
		return err
	}
	// A stale connection is found before anything is written, right after
	// it is taken from the pool: the re-sends share what is left of the
	// timeout, counted from here (the clock is read only on this path).
	deadline := time.Now().Add(timeout)
	for attempt := 1; ; attempt++ {
		err = staleIfUnsent(c.DoDeadline(req, resp, deadline), resp)
		if err == nil || !isStale(err) || attempt == maxStaleRetries {
			return err
		}
	}
}

// staleIfUnsent makes a failed exchange whose request provably never left
// (unsentOn) a stale-connection error: not delivered, so the request may
// go again, here and in the verdict.
func staleIfUnsent(err error, resp *fasthttp.Response) error {
	if err != nil && !isStale(err) && unsentOn(resp) {
		return &StaleConnError{Err: err}
	}
	return err
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
	Retry    RetryConfig
	// MaxInflight bounds exchanges in flight to one encoder (the gateway's
	// limits.max_inflight_per_encoder); <= 0 means no bound. A reload
	// changes it for every encoder at once, rebuilding nothing.
	MaxInflight int
	// PollShare (the gateway's limits.poll_share, in (0,1)) bounds the long
	// polls among them (metadata pulls and registrations of parts not
	// known encoded) to PollBound(MaxInflight, PollShare), keeping the rest
	// for the calls that start or complete a part. 0 gives long polls no
	// bound of their own. A reload changes it as MaxInflight.
	PollShare float64
}

// fleet is an immutable snapshot of the encoders and the settings the
// request path reads, swapped on reload.
type fleet struct {
	list    []*Encoder
	byName  map[string]*Encoder
	set     Settings
	budgets map[string]*Budget // per retry route label
}

// Pool holds the fleet and the pin table, and runs calls' exchanges with
// them (Exchange). It is safe for concurrent use.
type Pool struct {
	log  *zap.Logger
	clk  clock.Clock
	rand func() float64
	aff  AffinityConfig
	pins *PinTable
	m    *poolMetrics
	meta *metaShare // affinity.metadata_cache; nil: off

	fleet    atomic.Pointer[fleet]
	reloadMu sync.Mutex                     // serialises Reload
	limits   atomic.Pointer[inflightLimits] // Settings.MaxInflight and PollShare, read by every encoder

	ejections *ejectionGate  // breaker.max_ejected_percent over the fleet
	parkAfter time.Duration  // Deps.ParkAfter, DefaultParkAfter when that is 0
	poller    *poller.Poller // parks long polls (ExchangeParked) when Deps.Park started it; nil: never
	sendGate  *sendGate      // parked calls going on after their pin wait (parkedRun.pinWaited)

	cancel context.CancelFunc
	done   chan struct{}
}

// Deps are what a Pool takes from its caller.
type Deps struct {
	Log      *zap.Logger
	Registry prometheus.Registerer
	Clock    clock.Clock    // nil means the wall clock
	Rand     func() float64 // uniform in [0,1) for backoff jitter; nil means math/rand/v2
	// Park starts a poller (internal/poller) that ExchangeParked parks
	// long polls on, and that the caller may watch its own sockets with
	// (Poller); Close stops it. Off, or where there is no poller (not
	// Linux), ExchangeParked is Exchange.
	Park bool
	// ParkAfter is how long a parkable attempt's answer may take to begin
	// on the caller's goroutine before the attempt parks: an answer that
	// comes at once is read where it is, without the poller's watch, timer
	// and wake-up goroutine, which cost a proxied request about as much
	// again as the rest of it (docs/development/performance.md). Zero means
	// DefaultParkAfter; a negative value parks every attempt at once.
	ParkAfter time.Duration
}

// DefaultParkAfter is Deps.ParkAfter's default: far longer than an
// encoder takes to answer a pull whose part is ready, far shorter than it
// holds one that waits (up to 180 s), so a held pull keeps its goroutine
// only that long.
const DefaultParkAfter = 50 * time.Millisecond

// NewPool builds the pool, starts its pin sweeper and every encoder's
// health loop; Close stops them.
func NewPool(set Settings, aff AffinityConfig, deps Deps) (*Pool, error) {
	tokens, err := agentTokens(set.Encoders)
	if err != nil {
		return nil, err
	}
	clk := deps.Clock
	if clk == nil {
		clk = clock.Real{}
	}
	p := &Pool{
		log:  deps.Log,
		clk:  clk,
		rand: deps.Rand,
		aff:  aff,
		pins: NewPinTable(aff.PinTTL.D(), aff.MaxPins, clk),
		m:    newPoolMetrics(deps.Registry),
		done: make(chan struct{}),
	}
	// As many as can dial at once to two encoders: the rest wait queued,
	// as functions, not goroutines.
	p.sendGate = newSendGate(2 * max(set.Client.MaxDialsPerEncoder, 1))
	if deps.Park {
		pl, err := poller.New()
		if err != nil {
			deps.Log.Warn("long polls will not park: no poller; each keeps a goroutine while its encoder holds it", zap.Error(err))
		} else {
			p.poller = pl
		}
	}
	p.parkAfter = deps.ParkAfter
	if p.parkAfter == 0 {
		p.parkAfter = DefaultParkAfter
	}
	p.ejections = &ejectionGate{p: p, ejected: map[*Breaker]bool{}}
	p.meta = newMetaShare(aff.MetadataCache, clk, p.m)
	if p.rand == nil {
		p.rand = rand.Float64
	}
	p.limits.Store(newInflightLimits(set.MaxInflight, set.PollShare))
	f := &fleet{byName: map[string]*Encoder{}, set: set, budgets: p.newBudgets(set.Retry.Budget)}
	for i, ec := range set.Encoders {
		e, err := p.newEncoder(ec, set, tokens[i])
		if err != nil {
			p.stopAll(f.list)
			if p.poller != nil {
				_ = p.poller.Close()
			}
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

func (p *Pool) newBudgets(cfg BudgetConfig) map[string]*Budget {
	b := map[string]*Budget{}
	for _, r := range sglang.RetryLabels {
		b[r] = NewBudget(cfg, p.clk)
	}
	return b
}

// agentTokens reads each encoder's agent_token_file (bearer.ReadFile): the
// bearer token its agent requires, "" for none. Errors name the encoder and
// the file, never a token.
func agentTokens(encs []EncoderConfig) ([]string, error) {
	tokens := make([]string, len(encs))
	for i, ec := range encs {
		if ec.Agent == "" || ec.AgentTokenFile == "" {
			continue
		}
		t, err := bearer.ReadFile(ec.AgentTokenFile)
		if err != nil {
			return nil, fmt.Errorf("encoder %s: agent_token_file: %w", ec.Name, err)
		}
		tokens[i] = t
	}
	return tokens, nil
}

// newEncoder builds ec's encoder; agentToken is the bearer token its agent
// requires ("" for none).
func (p *Pool) newEncoder(ec EncoderConfig, set Settings, agentToken string) (*Encoder, error) {
	u, err := url.Parse(ec.URL)
	if err != nil {
		return nil, err
	}
	e := &Encoder{Name: ec.Name, URL: ec.URL, hash: xxhash.Sum64String(ec.Name), id: encoderID(ec),
		limits: &p.limits}
	e.gen.Store(ec.Generation.index())
	e.setMembership(ec)
	e.refusedInflight, e.refusedConns = p.m.refusals(ec.Name)
	e.refusedPolls, e.pollsGauge = p.m.pollSeries(ec.Name)
	e.outcomes = p.m.outcomeCounters(ec.Name)
	e.latency = p.m.latency(ec.Name)
	e.self = hostClient{host: u.Host, scheme: u.Scheme, url: ec.URL, client: newClient(ec.Name, u, set.Client)}
	e.Breaker = NewBreaker(ec.Name, set.Breaker, p.clk, BreakerHooks{
		OnChange: func(_ string, from, to BreakerState) { p.breakerChanged(e, from, to) },
		OnTrip:   func(_ string, trip BreakerTrip) { p.breakerTripped(e, trip) },
		Gate:     p.ejections,
	})
	// Probes get their own small pool: an encoder whose traffic connections
	// are all busy must not fail its health check for want of one.
	probeClient := newClient(ec.Name, u, ClientConfig{ConnectTimeout: set.Client.ConnectTimeout,
		IdleConnTimeout: set.Client.IdleConnTimeout, MaxConnsPerEncoder: 2, MaxDialsPerEncoder: 2, MaxResponseBytes: 64 << 10})
	e.probes = probeClient
	if ec.Agent != "" {
		au, err := url.Parse(ec.Agent)
		if err != nil {
			return nil, err
		}
		e.agent = &hostClient{host: au.Host, scheme: au.Scheme, url: ec.Agent, client: newClient(ec.Name+" agent", au, set.Client)}
		e.agent.setToken(agentToken)
	}
	probe := HTTPProber(probeClient, u.Scheme, u.Host, set.Health.Path, set.Health.Timeout.D())
	// Probes mark the encoder down and up; they never drive its breaker:
	// an encoder that answers /health and fails every /encode (CUDA out of
	// memory) would otherwise be closed again by each passing probe.
	e.Health = NewHealth(ec.Name, set.Health, probe, p.clk, func(up bool) { p.healthChanged(e, up) }, nil, p.log)
	if ec.Joining {
		e.Health.startDown()
	}
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
// holding its staged embeddings. The agent's token is not part of it: a
// new token is applied in place (Reload) and the pins stay.
func encoderID(ec EncoderConfig) uint64 {
	return xxhash.Sum64String(ec.Name + "\x00" + ec.URL + "\x00" + ec.Agent)
}

func newClient(name string, u *url.URL, cc ClientConfig) *fasthttp.HostClient {
	dialer := newDialer(cc)
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
		Transport:                awaitTransport{},
		Dial: func(addr string) (net.Conn, error) {
			c, err := dialer.dial(addr)
			if err != nil {
				return nil, &DialError{Encoder: name, Err: err}
			}
			return c, nil
		},
	}
}

// dialer connects to one encoder. Each connect runs on a goroutine of its
// own, which also wraps the connection (TCP_NODELAY, tcpconn, the stale
// probe): the dial runs deep in the resolver and the socket calls, and done
// on the exchange's goroutine, near the bottom of a request's call chain,
// it would grow that goroutine's stack for as long as the request is held
// at the encoder (a pull, up to 180 s). At most max_dials_per_encoder run
// at once: a dial goroutine's stack grows to 8 KiB, and a burst of
// thousands of new connections (pulls arriving together) would otherwise
// leave that much per connection in freed stacks the runtime keeps
// resident. Waiting for a turn counts against connect_timeout, with the
// dial itself.
type dialer struct {
	net   net.Dialer
	turns chan struct{}
}

func newDialer(cc ClientConfig) *dialer {
	return &dialer{
		net:   net.Dialer{Timeout: cc.ConnectTimeout.D(), KeepAlive: 30 * time.Second},
		turns: make(chan struct{}, cc.MaxDialsPerEncoder),
	}
}

// errDialQueue is a dial that found every turn taken for the whole
// connect timeout.
var errDialQueue = errors.New("connect timeout passed waiting for one of the connects in progress to finish (upstream.max_dials_per_encoder)")

type dialQueueError struct{}

func (dialQueueError) Error() string   { return errDialQueue.Error() }
func (dialQueueError) Timeout() bool   { return true }
func (dialQueueError) Temporary() bool { return true }
func (dialQueueError) Unwrap() error   { return errDialQueue }

func (d *dialer) dial(addr string) (net.Conn, error) {
	nd := d.net
	select {
	case d.turns <- struct{}{}:
	default:
		start := time.Now()
		t := time.NewTimer(nd.Timeout)
		select {
		case d.turns <- struct{}{}:
			t.Stop()
			nd.Deadline = start.Add(nd.Timeout)
		case <-t.C:
			return nil, dialQueueError{}
		}
	}
	defer func() { <-d.turns }()
	type dialed struct {
		c   net.Conn
		err error
	}
	ch := make(chan dialed, 1)
	go func() {
		c, err := nd.Dial("tcp", addr)
		if err == nil {
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetNoDelay(true)
			}
			c = newProbedConn(tcpconn.Client(c))
		}
		ch <- dialed{c, err}
	}()
	r := <-ch
	return r.c, r.err
}

func (p *Pool) breakerChanged(e *Encoder, from, to BreakerState) {
	p.m.breakerChanged(e, from, to)
	// Warn: a state change means an encoder failing or coming back from
	// failing, which an operator filtering on warn wants to see.
	p.log.Warn("breaker state changed", zap.String("encoder", e.Name),
		zap.String("from", from.String()), zap.String("to", to.String()))
}

func (p *Pool) breakerTripped(e *Encoder, trip BreakerTrip) {
	p.m.breakerTripped(e, trip)
	if trip.Ejected {
		p.log.Warn("breaker tripped: encoder ejected", zap.String("encoder", e.Name), zap.String("reason", trip.Reason),
			zap.Duration("ejection", trip.Ejection), zap.Int("trips", trip.Trips))
		return
	}
	p.log.Warn("breaker tripped, but the encoder stays in service: ejecting it would pass breaker.max_ejected_percent of the fleet",
		zap.String("encoder", e.Name), zap.String("reason", trip.Reason))
}

func (p *Pool) healthChanged(e *Encoder, up bool) {
	p.m.healthChanged(e, up)
	s := e.Health.Snapshot()
	if up {
		p.log.Info("encoder is up (active health)", zap.String("encoder", e.Name))
	} else {
		p.log.Warn("encoder is down (active health)", zap.String("encoder", e.Name), zap.String("last_error", s.LastError))
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
	return p.RankedBy(xxhash.Sum64String(reqID), dst)
}

// RankedBy appends the usable encoders to dst in rendezvous order for the
// key hash h (Ranked's for a req_id's hash; content placement's for an
// /encode's media). Draining and unusable encoders are left out: they take
// no new work.
func (p *Pool) RankedBy(h uint64, dst []*Encoder) []*Encoder {
	var buf [16]*Encoder
	usable := buf[:0]
	for _, e := range p.Encoders() {
		if e.Usable() && !e.Draining() {
			usable = append(usable, e)
		}
	}
	return rankHash(h, usable, dst)
}

// ErrNoEncoder means no configured encoder is usable (Owner).
var ErrNoEncoder = errors.New("upstream: no usable encoder")

// Owner returns the first usable encoder in rendezvous order for reqID.
func (p *Pool) Owner(reqID string) (*Encoder, error) {
	var buf [16]*Encoder
	r := p.Ranked(reqID, buf[:0])
	if len(r) == 0 {
		return nil, ErrNoEncoder
	}
	return r[0], nil
}

// AnyUsable reports whether at least one encoder can take new work: usable
// and not draining.
func (p *Pool) AnyUsable() bool {
	for _, e := range p.Encoders() {
		if e.Usable() && !e.Draining() {
			return true
		}
	}
	return false
}

// lookupPinned returns the encoder a pin names, if it is still configured
// with the same name and URL.
func (p *Pool) lookupPinned(pin Pin) (*Encoder, bool) {
	e, ok := p.Lookup(pin.Encoder)
	return e, ok && e.id == pin.EncoderID
}

// Reload applies new settings: encoders that keep their name and URL keep
// their connections, breaker, health and pins; new ones start; removed ones
// (and names moved to another URL, whose staged state stays behind) stop
// their health loop and close idle connections, while requests in flight on
// them finish. A changed breaker, health or upstream (client) config
// rebuilds every encoder under its name (connections, breaker and health
// start afresh). A removed name's metric series are deleted; nothing else of
// a retired encoder is kept, so it and its HTTP clients are collected.
// Every agent_token_file is read again; an encoder that stays gets its
// agent's new token in place. A token file that cannot be read changes
// nothing.
func (p *Pool) Reload(set Settings) (added, removed []string, err error) {
	p.reloadMu.Lock()
	defer p.reloadMu.Unlock()
	tokens, err := agentTokens(set.Encoders)
	if err != nil {
		return nil, nil, err
	}
	old := p.fleet.Load()
	rebuild := !sameBreakerHealth(old.set, set) || old.set.Client != set.Client
	next := &fleet{byName: map[string]*Encoder{}, set: set, budgets: old.budgets}
	if set.Retry.Budget != old.set.Retry.Budget {
		next.budgets = p.newBudgets(set.Retry.Budget)
	}
	var fresh []*Encoder
	var kept []int // indexes in set.Encoders of the encoders that stay
	for i, ec := range set.Encoders {
		if e, ok := old.byName[ec.Name]; ok && e.id == encoderID(ec) && !rebuild {
			kept = append(kept, i)
			next.list = append(next.list, e)
			next.byName[e.Name] = e
			continue
		}
		e, err := p.newEncoder(ec, set, tokens[i])
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
	for _, i := range kept {
		ec, e := set.Encoders[i], next.byName[set.Encoders[i].Name]
		e.gen.Store(ec.Generation.index())
		e.setMembership(ec)
		if e.agent != nil { // the same agent URL: encoderID covers it
			e.agent.setToken(tokens[i])
		}
	}
	p.limits.Store(newInflightLimits(set.MaxInflight, set.PollShare))
	p.fleet.Store(next)
	p.stopAll(retired)
	// A retired encoder whose name stays (rebuilt, or moved to another URL)
	// keeps its name's series for its successor; a removed name's go. From
	// here nothing of the pool refers to a retired Encoder (the metrics are
	// keyed by name), so it and its HTTP clients are collected once the
	// requests still in flight on it finish.
	for _, e := range retired {
		if _, stays := next.byName[e.Name]; !stays {
			p.m.forget(e)
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
		e.self.client.CloseIdleConnections()
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
			p.pins.Sweep()
		}
	}
}

// Close stops the sweeper and every health loop, and closes idle connections.
func (p *Pool) Close() {
	p.cancel()
	<-p.done
	p.stopAll(p.Encoders())
	if p.poller != nil {
		_ = p.poller.Close()
	}
}

// Poller returns the poller parked attempts wait on (Deps.Park), for the
// caller's own sockets; nil when there is none.
func (p *Pool) Poller() *poller.Poller { return p.poller }

// Drained returns the draining encoders that no longer hold anything: no
// live pin needs them and no exchange is in flight with them. The fleet
// drops these at its next apply.
func (p *Pool) Drained() []string {
	ids := map[uint64]int{}
	var draining []*Encoder
	for _, e := range p.Encoders() {
		if e.Draining() {
			ids[e.id] = 0
			draining = append(draining, e)
		}
	}
	if len(draining) == 0 {
		return nil
	}
	p.pins.Holding(ids)
	var out []string
	for _, e := range draining {
		if ids[e.id] == 0 && e.Inflight() == 0 {
			out = append(out, e.Name)
		}
	}
	return out
}
