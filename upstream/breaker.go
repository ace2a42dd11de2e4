package upstream

import (
	"errors"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sony/gobreaker/v2"

	"github.com/encgate/encgate/internal/configfile"
)

// BreakerConfig configures the circuit breaker every encoder has. Only
// instance faults count against an encoder, as the exchange's Verdict says
// (see Judge): never a 4xx (sglang #25811: a burst of client 400s opened
// every breaker of a fleet), a long-poll that ran out, or a 5xx caused by
// the request or by another request's failure.
type BreakerConfig struct {
	// ConsecutiveFailures trips the breaker after this many faults in a row
	// (default 5).
	ConsecutiveFailures int `yaml:"consecutive_failures"`
	// FailureRatio trips it when at least this share of the counted
	// outcomes in the window are faults (default 0.5)...
	FailureRatio float64 `yaml:"failure_ratio"`
	// MinRequests ...once at least this many outcomes were counted in the
	// window (default 20).
	MinRequests int `yaml:"min_requests"`
	// Interval is the closed-state counting window: counts are cleared
	// every Interval (default 10s).
	Interval configfile.Duration `yaml:"interval"`
	// OpenTimeout is how long an open breaker refuses work before it lets
	// probes through (half-open) (default 30s).
	OpenTimeout configfile.Duration `yaml:"open_timeout"`
	// HalfOpenRequests is how many requests a half-open breaker lets
	// through; that many successes in a row close it, one fault reopens it
	// (default 1).
	HalfOpenRequests int `yaml:"half_open_requests"`
	// Ignore lists further 5xx answers that are never counted, neither as
	// faults nor as successes, beyond the caller-side answers the gateway
	// knows from sglang (see Judge): an operator's additions. Only status
	// conditions belong here.
	Ignore []Condition `yaml:"ignore"`
	// Disabled turns the breaker off: every request is allowed.
	Disabled bool `yaml:"disabled"`
}

// DefaultBreaker returns the breaker defaults. Ignore is empty: the
// encoder's caller-side answers are known to Judge already.
func DefaultBreaker() BreakerConfig {
	return BreakerConfig{
		ConsecutiveFailures: 5,
		FailureRatio:        0.5,
		MinRequests:         20,
		Interval:            configfile.Duration(10 * time.Second),
		OpenTimeout:         configfile.Duration(30 * time.Second),
		HalfOpenRequests:    1,
		Ignore:              []Condition{},
	}
}

// Validate records c's problems in p; path is its field path ("breaker").
func (c BreakerConfig) Validate(p *configfile.Problems, path string) {
	count := func(name string, v int) {
		switch {
		case v < 1:
			p.Addf(path+"."+name, "must be >= 1, got %d", v)
		case v > math.MaxUint32:
			p.Addf(path+"."+name, "must be <= %d, got %d", uint32(math.MaxUint32), v)
		}
	}
	count("consecutive_failures", c.ConsecutiveFailures)
	count("min_requests", c.MinRequests)
	count("half_open_requests", c.HalfOpenRequests)
	if !(c.FailureRatio > 0 && c.FailureRatio <= 1) { // also refuses NaN
		p.Addf(path+".failure_ratio", "must be in (0, 1], got %v", c.FailureRatio)
	}
	p.Positive(path+".interval", c.Interval)
	p.Positive(path+".open_timeout", c.OpenTimeout)
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

func fromGobreaker(s gobreaker.State) BreakerState {
	switch s {
	case gobreaker.StateHalfOpen:
		return BreakerHalfOpen
	case gobreaker.StateOpen:
		return BreakerOpen
	}
	return BreakerClosed
}

// BreakerCounts are a breaker's counters for its current window (closed:
// the current Interval; half-open: since it became half-open). Requests
// counts allowed requests, including those still in flight and ignored ones.
type BreakerCounts struct {
	Requests             uint32 `json:"requests"`
	TotalSuccesses       uint32 `json:"total_successes"`
	TotalFailures        uint32 `json:"total_failures"`
	TotalExclusions      uint32 `json:"total_exclusions"`
	ConsecutiveFailures  uint32 `json:"consecutive_failures"`
	ConsecutiveSuccesses uint32 `json:"consecutive_successes"`
}

// errFault and errIgnored carry a verdict's Mark into gobreaker.
var (
	errFault   = errors.New("upstream: encoder fault")
	errIgnored = errors.New("upstream: outcome ignored by the breaker")
)

// halfOpenSlack is added to OpenTimeout before the breaker looks again, so
// that the look lands strictly after gobreaker's expiry.
const halfOpenSlack = time.Millisecond

// Breaker is one encoder's circuit breaker: a sony/gobreaker v2
// TwoStepCircuitBreaker fed with the Marks of the exchanges' verdicts. It is safe for
// concurrent use.
//
// gobreaker reads time.Now itself; it takes no clock, so a Breaker runs on
// the wall clock (tests use a short OpenTimeout and wait on onChange).
// gobreaker moves open -> half-open lazily, when it is next asked; a Breaker
// also asks it OpenTimeout after opening, so the change (and its onChange,
// its gauge and its log line) happens on time even when no request comes.
type Breaker struct {
	name     string
	cfg      BreakerConfig
	cb       *gobreaker.TwoStepCircuitBreaker[struct{}]
	onChange func(name string, from, to BreakerState)

	stopped atomic.Bool
	mu      sync.Mutex // protects timer
	timer   *time.Timer
}

// NewBreaker returns the breaker for the encoder called name.
//
// onChange (may be nil) is called on every state change. It runs under
// gobreaker's lock, on whatever goroutine caused the change (a request's
// Allow or done, State, or the breaker's own half-open timer): it must be
// cheap (set a gauge, count, log a line) and must not call back into this
// Breaker (Allow, done, State, Counts would deadlock).
func NewBreaker(name string, cfg BreakerConfig, onChange func(name string, from, to BreakerState)) *Breaker {
	b := &Breaker{name: name, cfg: cfg, onChange: onChange}
	if cfg.Disabled {
		return b
	}
	consecutive := clampUint32(cfg.ConsecutiveFailures)
	minRequests := clampUint32(cfg.MinRequests)
	ratio := cfg.FailureRatio
	b.cb = gobreaker.NewTwoStepCircuitBreaker[struct{}](gobreaker.Settings{
		Name:        name,
		MaxRequests: clampUint32(cfg.HalfOpenRequests),
		Interval:    cfg.Interval.D(),
		Timeout:     cfg.OpenTimeout.D(),
		ReadyToTrip: func(c gobreaker.Counts) bool {
			if c.ConsecutiveFailures >= consecutive {
				return true
			}
			// The ratio is over counted outcomes: requests still in
			// flight and ignored answers neither dilute nor inflate it.
			counted := c.TotalSuccesses + c.TotalFailures
			return counted >= minRequests && counted > 0 &&
				float64(c.TotalFailures)/float64(counted) >= ratio
		},
		IsSuccessful:  func(err error) bool { return err == nil },
		IsExcluded:    func(err error) bool { return err == errIgnored },
		OnStateChange: b.stateChanged,
	})
	return b
}

func clampUint32(v int) uint32 {
	switch {
	case v < 1:
		return 1
	case v > math.MaxUint32:
		return math.MaxUint32
	}
	return uint32(v)
}

// stateChanged runs under gobreaker's lock.
func (b *Breaker) stateChanged(_ string, from, to gobreaker.State) {
	if b.stopped.Load() {
		return
	}
	if to == gobreaker.StateOpen {
		b.arm(b.cfg.OpenTimeout.D() + halfOpenSlack)
	}
	if b.onChange != nil {
		b.onChange(b.name, fromGobreaker(from), fromGobreaker(to))
	}
}

// arm schedules a look at the state after d. Lock order: gobreaker's lock,
// then b.mu; nothing holding b.mu calls into gobreaker.
func (b *Breaker) arm(d time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stopped.Load() {
		return
	}
	if b.timer != nil {
		b.timer.Stop()
	}
	b.timer = time.AfterFunc(d, b.wake)
}

// wake asks gobreaker for its state, which moves an expired open breaker to
// half-open (and calls onChange). Should the clock still read "not yet",
// it looks again shortly.
func (b *Breaker) wake() {
	if b.stopped.Load() {
		return
	}
	if b.cb.State() == gobreaker.StateOpen {
		b.arm(halfOpenSlack)
	}
}

// Name returns the encoder name the breaker was made for.
func (b *Breaker) Name() string { return b.name }

// Allow asks to send one request. ok is false when the breaker is open, or
// half-open with its probe quota taken. When ok, done must be called exactly
// once with the exchange's Mark (further calls are ignored; MarkNone
// releases the slot as MarkIgnored does).
func (b *Breaker) Allow() (done func(Mark), ok bool) {
	if b.cb == nil {
		return noopDone, true
	}
	report, err := b.cb.Allow()
	if err != nil {
		return nil, false
	}
	var once atomic.Bool
	return func(m Mark) {
		if !once.CompareAndSwap(false, true) {
			return
		}
		switch m {
		case MarkFault:
			report(errFault)
		case MarkSuccess:
			report(nil)
		default:
			report(errIgnored)
		}
	}, true
}

func noopDone(Mark) {}

// State returns the breaker's state (always closed when disabled).
func (b *Breaker) State() BreakerState {
	if b.cb == nil {
		return BreakerClosed
	}
	return fromGobreaker(b.cb.State())
}

// Counts returns the counters of the current window (zero when disabled).
func (b *Breaker) Counts() BreakerCounts {
	if b.cb == nil {
		return BreakerCounts{}
	}
	c := b.cb.Counts()
	return BreakerCounts{
		Requests:             c.Requests,
		TotalSuccesses:       c.TotalSuccesses,
		TotalFailures:        c.TotalFailures,
		TotalExclusions:      c.TotalExclusions,
		ConsecutiveFailures:  c.ConsecutiveFailures,
		ConsecutiveSuccesses: c.ConsecutiveSuccesses,
	}
}

// Stop silences onChange and stops the half-open timer; the breaker keeps
// working otherwise. Call it when a breaker is discarded (a reload replaced
// it, its encoder was removed) so that it no longer touches metrics.
func (b *Breaker) Stop() {
	b.stopped.Store(true)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.timer != nil {
		b.timer.Stop()
		b.timer = nil
	}
}
