package upstream

import (
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
)

// BreakerConfig configures the circuit breaker every encoder has. Only
// instance faults count against an encoder, as the exchange's Verdict says
// (see Judge): never a 4xx (sglang #25811: a burst of client 400s opened
// every breaker of a fleet), a long-poll that ran out, or a 5xx caused by
// the request or by another request's failure.
//
// The defaults are for an encoder fleet, where an /encode takes hundreds of
// milliseconds and traffic may be one request every few seconds: nothing
// the breaker counts is forgotten with time (a time window empties between
// two requests and never trips), and an ejection is long enough to matter
// at that rate yet grows for an encoder that keeps failing its trials.
type BreakerConfig struct {
	// ConsecutiveFailures trips the breaker after this many faults in a
	// row, however far apart they came (default 5: at one /encode every
	// few seconds, five in a row is a broken encoder, not bad luck).
	ConsecutiveFailures int `yaml:"consecutive_failures"`
	// FailureRatio trips it when at least this share of the last
	// MinRequests counted outcomes are faults (default 0.5)...
	FailureRatio float64 `yaml:"failure_ratio"`
	// MinRequests ...once that many outcomes were counted: the ratio is
	// over the last MinRequests successes and faults (a ring, not a time
	// window), looked at after each fault (default 20, at most 65536: an
	// encoder that fails every other /encode trips after 20 of them, at
	// whatever rate they come).
	MinRequests int `yaml:"min_requests"`
	// BaseEjectionTime is how long the first trip ejects the encoder
	// (default 30s: several /encodes at low traffic, and past the usual
	// restart of an encoder's pod). The next trip of the same encoder
	// ejects it for twice that, then three times, and so on...
	BaseEjectionTime configfile.Duration `yaml:"base_ejection_time"`
	// MaxEjectionTime ...up to this (default 300s: an encoder that fails
	// every trial costs one request every five minutes, and one that
	// recovered is back within five).
	MaxEjectionTime configfile.Duration `yaml:"max_ejection_time"`
	// EjectionDecay: each full EjectionDecay a closed breaker goes without
	// a trip forgets one earlier trip, so that the next ejection is one
	// BaseEjectionTime shorter (default 60s: about twice the time five
	// faults take to come at one /encode every three seconds to half a
	// fleet, so an encoder that fails again soon after its trial keeps its
	// long ejection, and one healthy for a few minutes is back at base).
	EjectionDecay configfile.Duration `yaml:"ejection_decay"`
	// MaxEjectedPercent bounds the share of the fleet ejected at once, as
	// Envoy's max_ejection_percent does (default 50, 0 to 100): a trip
	// that would make more than floor(n × MaxEjectedPercent / 100) of the
	// fleet's n encoders ejected, or all of them, leaves the encoder in
	// service (its answers pass through) and counts
	// encgate_breaker_ejections_skipped_total. n counts the encoders that
	// are neither down by active health nor draining. 0 never ejects.
	MaxEjectedPercent int `yaml:"max_ejected_percent"`
	// HalfOpenRequests is how many real requests an ejected encoder gets
	// once its ejection ends (half-open); when that many succeed it is
	// back (closed), and one fault ejects it again, for longer (default
	// 1). Health probes never count.
	HalfOpenRequests int `yaml:"half_open_requests"`
	// Ignore lists further 5xx answers that are never counted, neither as
	// faults nor as successes, beyond the caller-side answers the gateway
	// knows from sglang (see Judge): an operator's additions. Only status
	// conditions belong here.
	Ignore []Condition `yaml:"ignore"`
	// Disabled turns the breaker off: every request is allowed.
	Disabled bool `yaml:"disabled"`

	// MovedInterval and MovedOpenTimeout are the keys of the breaker
	// in earlier versions (sony/gobreaker's Interval and Timeout); a config
	// that has them is refused with what replaced them.
	MovedInterval    configfile.Moved `yaml:"interval,omitempty"`
	MovedOpenTimeout configfile.Moved `yaml:"open_timeout,omitempty"`
}

// maxMinRequests bounds min_requests: the ring holds one bit per outcome.
const maxMinRequests = 1 << 16

// DefaultBreaker returns the breaker defaults. Ignore is empty: the
// encoder's caller-side answers are known to Judge already.
func DefaultBreaker() BreakerConfig {
	return BreakerConfig{
		ConsecutiveFailures: 5,
		FailureRatio:        0.5,
		MinRequests:         20,
		BaseEjectionTime:    configfile.Duration(30 * time.Second),
		MaxEjectionTime:     configfile.Duration(300 * time.Second),
		EjectionDecay:       configfile.Duration(60 * time.Second),
		MaxEjectedPercent:   50,
		HalfOpenRequests:    1,
		Ignore:              []Condition{},
	}
}

// Validate records c's problems in p; path is its field path ("breaker").
func (c BreakerConfig) Validate(p *configfile.Problems, path string) {
	count := func(name string, v, most int) {
		switch {
		case v < 1:
			p.Addf(path+"."+name, "must be >= 1, got %d", v)
		case v > most:
			p.Addf(path+"."+name, "must be <= %d, got %d", most, v)
		}
	}
	count("consecutive_failures", c.ConsecutiveFailures, math.MaxUint32)
	count("min_requests", c.MinRequests, maxMinRequests)
	count("half_open_requests", c.HalfOpenRequests, math.MaxUint32)
	if !(c.FailureRatio > 0 && c.FailureRatio <= 1) { // also refuses NaN
		p.Addf(path+".failure_ratio", "must be in (0, 1], got %v", c.FailureRatio)
	}
	p.Positive(path+".base_ejection_time", c.BaseEjectionTime)
	p.Positive(path+".ejection_decay", c.EjectionDecay)
	if c.MaxEjectionTime < c.BaseEjectionTime {
		p.Addf(path+".max_ejection_time", "must be >= base_ejection_time (%s), got %s", c.BaseEjectionTime, c.MaxEjectionTime)
	}
	if c.MaxEjectedPercent < 0 || c.MaxEjectedPercent > 100 {
		p.Addf(path+".max_ejected_percent", "must be between 0 and 100, got %d", c.MaxEjectedPercent)
	}
	if c.MovedInterval.Set() {
		p.Addf(path+".interval", "is gone: faults are no longer counted in a time window that forgets them; "+
			"the breaker trips on %s.consecutive_failures in a row, or on %s.failure_ratio over the last %s.min_requests outcomes",
			path, path, path)
	}
	if c.MovedOpenTimeout.Set() {
		p.Addf(path+".open_timeout", "is gone: an ejection lasts %s.base_ejection_time times the encoder's trips, "+
			"up to %s.max_ejection_time; %s.ejection_decay forgets one trip per period without one",
			path, path, path)
	}
	for i, cond := range c.Ignore {
		at := path + ".ignore[" + strconv.Itoa(i) + "]"
		switch cond.Kind {
		case OnStatus:
		case OnConnectFailure, OnTimeout:
			p.Addf(at, "%s cannot be ignored: a failed connect or an exchange that got no answer is exactly the instance fault the breaker exists for; only answers ({status: N, body_contains: \"...\"}) can be ignored", cond)
		default:
			p.Addf(at, "unknown condition kind %d", cond.Kind)
		}
	}
}

// ejectionFor is the ejection of a breaker's trips-th trip: base × trips,
// at most max.
func (c BreakerConfig) ejectionFor(trips int) time.Duration {
	base, most := c.BaseEjectionTime.D(), c.MaxEjectionTime.D()
	if trips < 1 {
		trips = 1
	}
	if base <= 0 || time.Duration(trips) > most/base {
		return most
	}
	return min(base*time.Duration(trips), most)
}

// BreakerState is a breaker's state. The values are those of the
// encgate_breaker_state gauge.
type BreakerState int

// Breaker states.
const (
	BreakerClosed   BreakerState = 0
	BreakerHalfOpen BreakerState = 1
	BreakerOpen     BreakerState = 2
)

// String returns "closed", "half_open" or "open".
func (s BreakerState) String() string {
	switch s {
	case BreakerClosed:
		return "closed"
	case BreakerHalfOpen:
		return "half_open"
	case BreakerOpen:
		return "open"
	}
	return "unknown(" + strconv.Itoa(int(s)) + ")"
}

// BreakerCounts are a breaker's counters since its state last changed
// (closed: since it closed or started, or since a trip max_ejected_percent
// kept in service; half-open: since it became half-open). Requests counts
// allowed requests, including those still in flight and ignored ones.
type BreakerCounts struct {
	Requests             uint32 `json:"requests"`
	TotalSuccesses       uint32 `json:"total_successes"`
	TotalFailures        uint32 `json:"total_failures"`
	TotalExclusions      uint32 `json:"total_exclusions"`
	ConsecutiveFailures  uint32 `json:"consecutive_failures"`
	ConsecutiveSuccesses uint32 `json:"consecutive_successes"`
}

// BreakerSnapshot is a breaker's whole state, for the admin API.
type BreakerSnapshot struct {
	State  BreakerState
	Counts BreakerCounts
	// RecentCounted and RecentFaults are the ring failure_ratio reads: the
	// last min_requests successes and faults (closed state).
	RecentCounted, RecentFaults int
	// Ejected: from a trip that ejected until the breaker closes again
	// (open and half-open).
	Ejected bool
	// Trips is how many trips the next ejection's length counts (this one
	// included while ejected), after decay.
	Trips int
	// Ejections counts the breaker's ejections (each trip that ejected,
	// a reopened half-open breaker's included); Skipped its trips that
	// max_ejected_percent kept in service.
	Ejections, Skipped uint64
	// Ejection is the length of the current (or last) ejection, EjectedAt
	// when it began and Until when it ends (zero when there was none).
	Ejection         time.Duration
	EjectedAt, Until time.Time
}

// BreakerTrip is one trip of a breaker, as BreakerHooks.OnTrip hears it.
type BreakerTrip struct {
	// Reason: "consecutive_failures", "failure_ratio" or "half_open_fault".
	Reason string
	// Ejected: the encoder was ejected, for Ejection; false when
	// max_ejected_percent kept it in service.
	Ejected  bool
	Ejection time.Duration
	// Trips is the ejection's multiplier (Ejection = base × Trips, capped).
	Trips int
}

// EjectionGate bounds the share of a fleet ejected at once
// (max_ejected_percent). A breaker about to eject asks Admit under its own
// lock; Admit must decide and record at once, so that two trips at the same
// time cannot both pass, and must not call into any breaker.
type EjectionGate interface {
	// Admit reports whether b may eject its encoder; when true, b counts as
	// ejected until Release(b).
	Admit(b *Breaker) bool
	// Release stops counting b as ejected (it closed, or was stopped).
	Release(b *Breaker)
}

// BreakerHooks are what a breaker tells and asks its owner. Every field
// may be nil. OnChange and OnTrip run under the breaker's lock, on the
// goroutine that caused the change (a request's Allow or done, State, or
// the breaker's own timer at the end of an ejection): they must be cheap
// (set a gauge, count, log a line) and must not call back into the breaker.
type BreakerHooks struct {
	// OnChange is called on every state change.
	OnChange func(name string, from, to BreakerState)
	// OnTrip is called on every trip, before OnChange when it ejects.
	OnTrip func(name string, trip BreakerTrip)
	// Gate decides whether a trip of a closed breaker ejects (nil: always).
	// A half-open breaker that reopens is ejected already and asks nothing.
	Gate EjectionGate
}

// Breaker is one encoder's circuit breaker, fed with the Marks of the
// exchanges' verdicts. It is safe for concurrent use.
//
// Closed, it trips on ConsecutiveFailures faults in a row, or when the last
// MinRequests counted outcomes hold FailureRatio faults; neither forgets
// with time. A trip ejects the encoder (open) for BaseEjectionTime × its
// trips, at most MaxEjectionTime, unless the Gate (max_ejected_percent)
// keeps it in service: then it stays closed and counts afresh. When the
// ejection ends the breaker is half-open: HalfOpenRequests real requests
// go, all of them must succeed to close it, and one fault ejects it again
// for longer. Only Marks from exchanges move it; health probes never do.
//
// Time is the injected clock's. The open -> half-open change is made
// lazily by whoever looks (Allow, State) and, so that it is visible on
// time in metrics and logs when no request comes, by a timer on the clock
// that one goroutine per ejection waits on.
type Breaker struct {
	name  string
	cfg   BreakerConfig
	clk   clock.Clock
	hooks BreakerHooks

	// st mirrors state and until mirrors the ejection's end (UnixNano), so
	// that State of a closed breaker reads one atomic.
	st    atomic.Int32
	until atomic.Int64

	mu      sync.Mutex // protects everything below
	state   BreakerState
	gen     uint64 // moves with every state change: older dones are ignored
	counts  BreakerCounts
	ring    []uint64 // one bit per counted outcome, 1 a fault
	ringPos int
	ringN   int // outcomes in the ring
	ringBad int // faults in the ring
	// half-open: trials admitted and not yet decided, and successes
	trialsOut, trialsOK int

	trips     int       // the multiplier of the last ejection (before decay)
	calmSince time.Time // closed: when decay started counting
	ejected   bool
	ejections uint64
	skipped   uint64
	ejection  time.Duration
	ejectedAt time.Time
	end       time.Time

	stopped bool
	stop    chan struct{}  // closed by Stop: ends the ejection timers
	timers  sync.WaitGroup // the goroutines waiting on them
}

// NewBreaker returns the breaker for the encoder called name, on clk (nil:
// the wall clock).
func NewBreaker(name string, cfg BreakerConfig, clk clock.Clock, hooks BreakerHooks) *Breaker {
	if clk == nil {
		clk = clock.Real{}
	}
	b := &Breaker{name: name, cfg: cfg, clk: clk, hooks: hooks, stop: make(chan struct{})}
	if cfg.Disabled {
		return b
	}
	n := min(max(cfg.MinRequests, 1), maxMinRequests)
	b.ring = make([]uint64, (n+63)/64)
	b.calmSince = clk.Now()
	return b
}

// Name returns the encoder name the breaker was made for.
func (b *Breaker) Name() string { return b.name }

// ringCap is how many outcomes the ring holds (min_requests).
func (b *Breaker) ringCap() int { return min(max(b.cfg.MinRequests, 1), maxMinRequests) }

// Allow asks to send one request. ok is false when the breaker is open, or
// half-open with its trials taken. When ok, done must be called exactly
// once with the exchange's Mark (further calls are ignored; MarkNone
// releases the slot as MarkIgnored does). A done that comes after the
// state changed is ignored: a request sent before a trip says nothing about
// the trial after it.
func (b *Breaker) Allow() (done func(Mark), ok bool) {
	if b.cfg.Disabled {
		return noopDone, true
	}
	t, ok := b.Admit(b.clk.Now())
	if !ok {
		return nil, false
	}
	var once atomic.Bool
	return func(m Mark) {
		if once.CompareAndSwap(false, true) {
			t.Report(m, b.clk.Now())
		}
	}, true
}

// Ticket is an exchange the breaker admitted (Admit): Report tells it
// the exchange's Mark.
type Ticket struct {
	b   *Breaker // nil: the breaker is disabled
	gen uint64
}

// Admit is Allow for a caller that reads the clock itself (now) and
// reports exactly once (Ticket.Report), so that no func value is made.
func (b *Breaker) Admit(now time.Time) (Ticket, bool) {
	if b.cfg.Disabled {
		return Ticket{}, true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refreshLocked(now)
	switch b.state {
	case BreakerOpen:
		return Ticket{}, false
	case BreakerHalfOpen:
		if b.trialsOut+b.trialsOK >= b.cfg.HalfOpenRequests {
			return Ticket{}, false
		}
		b.trialsOut++
	}
	b.counts.Requests = inc(b.counts.Requests)
	return Ticket{b: b, gen: b.gen}, true
}

// Report tells the breaker the admitted exchange's Mark, at now; call it
// exactly once.
func (t Ticket) Report(m Mark, now time.Time) {
	if t.b != nil {
		t.b.report(t.gen, m, now)
	}
}

func noopDone(Mark) {}

func inc(v uint32) uint32 {
	if v == math.MaxUint32 {
		return v
	}
	return v + 1
}

// report applies one admitted request's Mark.
func (b *Breaker) report(gen uint64, m Mark, now time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refreshLocked(now)
	if gen != b.gen {
		return
	}
	c := &b.counts
	switch m {
	case MarkSuccess:
		c.TotalSuccesses = inc(c.TotalSuccesses)
		c.ConsecutiveSuccesses = inc(c.ConsecutiveSuccesses)
		c.ConsecutiveFailures = 0
	case MarkFault:
		c.TotalFailures = inc(c.TotalFailures)
		c.ConsecutiveFailures = inc(c.ConsecutiveFailures)
		c.ConsecutiveSuccesses = 0
	default:
		c.TotalExclusions = inc(c.TotalExclusions)
	}
	switch b.state {
	case BreakerClosed:
		switch m {
		case MarkSuccess:
			b.push(false)
		case MarkFault:
			b.push(true)
			switch {
			case int(c.ConsecutiveFailures) >= b.cfg.ConsecutiveFailures:
				b.tripLocked(now, "consecutive_failures")
			case b.ringN == b.ringCap() && float64(b.ringBad) >= b.cfg.FailureRatio*float64(b.ringN):
				b.tripLocked(now, "failure_ratio")
			}
		}
	case BreakerHalfOpen:
		b.trialsOut--
		switch m {
		case MarkSuccess:
			b.trialsOK++
			if b.trialsOK >= b.cfg.HalfOpenRequests {
				b.closeLocked(now)
			}
		case MarkFault:
			b.reopenLocked(now)
		}
	}
}

// push records one counted outcome in the ring.
func (b *Breaker) push(fault bool) {
	word, bit := b.ringPos/64, uint(b.ringPos%64)
	if b.ringN == b.ringCap() {
		if b.ring[word]&(1<<bit) != 0 {
			b.ringBad--
		}
	} else {
		b.ringN++
	}
	if fault {
		b.ring[word] |= 1 << bit
		b.ringBad++
	} else {
		b.ring[word] &^= 1 << bit
	}
	b.ringPos++
	if b.ringPos == b.ringCap() {
		b.ringPos = 0
	}
}

// resetCounting starts the closed-state counting afresh.
func (b *Breaker) resetCounting() {
	clear(b.ring)
	b.ringPos, b.ringN, b.ringBad = 0, 0, 0
	b.counts = BreakerCounts{}
}

// decayedLocked is the trips remembered at now: a closed breaker forgets
// one per full EjectionDecay since calmSince. It moves calmSince by the
// periods used, so that calling it again forgets nothing twice.
func (b *Breaker) decayedLocked(now time.Time) int {
	if b.state != BreakerClosed || b.trips == 0 {
		return b.trips
	}
	period := b.cfg.EjectionDecay.D()
	if period <= 0 {
		return b.trips
	}
	n := int64(now.Sub(b.calmSince) / period)
	if n <= 0 {
		return b.trips
	}
	if n >= int64(b.trips) {
		b.trips = 0
		b.calmSince = now
	} else {
		b.trips -= int(n)
		b.calmSince = b.calmSince.Add(time.Duration(n) * period)
	}
	return b.trips
}

// tripLocked trips a closed breaker: it ejects the encoder when the gate
// admits it, else it counts the skip and counts afresh, in service.
func (b *Breaker) tripLocked(now time.Time, reason string) {
	trips := b.decayedLocked(now) + 1
	if b.hooks.Gate != nil && !b.hooks.Gate.Admit(b) {
		b.skipped++
		b.resetCounting()
		if b.hooks.OnTrip != nil && !b.stopped {
			b.hooks.OnTrip(b.name, BreakerTrip{Reason: reason, Trips: trips})
		}
		return
	}
	b.ejected = true
	b.ejectLocked(now, trips, reason)
}

// reopenLocked ejects a half-open breaker again, for its next ejection.
func (b *Breaker) reopenLocked(now time.Time) {
	b.ejectLocked(now, b.trips+1, "half_open_fault")
}

func (b *Breaker) ejectLocked(now time.Time, trips int, reason string) {
	d := b.cfg.ejectionFor(trips)
	b.trips = trips
	b.ejections++
	b.ejection, b.ejectedAt, b.end = d, now, now.Add(d)
	b.until.Store(b.end.UnixNano())
	if b.hooks.OnTrip != nil && !b.stopped {
		b.hooks.OnTrip(b.name, BreakerTrip{Reason: reason, Ejected: true, Ejection: d, Trips: trips})
	}
	b.setLocked(BreakerOpen)
	b.armLocked(d)
}

// closeLocked ends an ejection: the trials all succeeded.
func (b *Breaker) closeLocked(now time.Time) {
	b.releaseLocked()
	b.calmSince = now
	b.setLocked(BreakerClosed)
}

func (b *Breaker) releaseLocked() {
	if b.ejected {
		b.ejected = false
		if b.hooks.Gate != nil {
			b.hooks.Gate.Release(b)
		}
	}
}

// refreshLocked moves an open breaker whose ejection has ended to half-open.
func (b *Breaker) refreshLocked(now time.Time) {
	if b.state == BreakerOpen && !now.Before(b.end) {
		b.setLocked(BreakerHalfOpen)
	}
}

// setLocked changes the state: a new generation, fresh counts.
func (b *Breaker) setLocked(to BreakerState) {
	from := b.state
	b.state = to
	b.st.Store(int32(to))
	b.gen++
	b.trialsOut, b.trialsOK = 0, 0
	b.resetCounting()
	if b.hooks.OnChange != nil && !b.stopped {
		b.hooks.OnChange(b.name, from, to)
	}
}

// armLocked has the change to half-open made d from now even when nobody
// asks: one goroutine waits on the clock until then, or until Stop.
func (b *Breaker) armLocked(d time.Duration) {
	if b.stopped {
		return
	}
	t := b.clk.NewTimer(d)
	gen, stop := b.gen, b.stop
	b.timers.Add(1)
	go func() {
		defer b.timers.Done()
		select {
		case <-t.C():
			b.wake(gen)
		case <-stop:
			t.Stop()
		}
	}()
}

// wake is the ejection timer of generation gen firing.
func (b *Breaker) wake(gen uint64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gen != gen || b.state != BreakerOpen {
		return
	}
	now := b.clk.Now()
	b.refreshLocked(now)
	if b.state == BreakerOpen { // the clock says "not yet": look again then
		b.armLocked(b.end.Sub(now))
	}
}

// State returns the breaker's state (always closed when disabled). An open
// breaker whose ejection has ended becomes half-open here.
func (b *Breaker) State() BreakerState {
	s := BreakerState(b.st.Load())
	if s != BreakerOpen || b.clk.Now().UnixNano() < b.until.Load() {
		return s
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refreshLocked(b.clk.Now())
	return b.state
}

// Counts returns the counters since the state last changed (zero when
// disabled).
func (b *Breaker) Counts() BreakerCounts {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refreshLocked(b.clk.Now())
	return b.counts
}

// Snapshot returns the breaker's whole state.
func (b *Breaker) Snapshot() BreakerSnapshot {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.clk.Now()
	if !b.cfg.Disabled {
		b.refreshLocked(now)
	}
	return BreakerSnapshot{
		State: b.state, Counts: b.counts, RecentCounted: b.ringN, RecentFaults: b.ringBad,
		Ejected: b.ejected, Trips: b.decayedLocked(now), Ejections: b.ejections, Skipped: b.skipped,
		Ejection: b.ejection, EjectedAt: b.ejectedAt, Until: b.end,
	}
}

// Ejected reports whether the breaker holds its encoder ejected: from a
// trip that ejected until it closes again.
func (b *Breaker) Ejected() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.ejected
}

// Stop silences the hooks, ends the ejection timer (it returns once the
// goroutine waiting on it has) and gives back the breaker's place in the
// gate; the breaker keeps working otherwise (its later trips eject without
// asking the gate, and an ejection ends when the breaker is next asked).
// Call it when a breaker is discarded (a reload replaced it, its encoder
// was removed) so that it no longer touches metrics or holds a share of
// the fleet.
func (b *Breaker) Stop() {
	b.mu.Lock()
	if !b.stopped {
		b.stopped = true
		close(b.stop)
		b.releaseLocked()
		b.hooks.Gate = nil
	}
	b.mu.Unlock()
	b.timers.Wait()
}
