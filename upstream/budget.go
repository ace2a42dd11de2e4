package upstream

import (
	"math"
	"sync"
	"time"

	"github.com/encgate/encgate/internal/clock"
)

// Budget is a retry budget in the style of Finagle's RetryBudget and Envoy's
// retry_budget: it keeps retries to a fraction of the traffic, so an encoder
// that starts failing gets at most Ratio more load from retries instead of
// MaxAttempts times as much. At any moment
//
//	available = Ratio × (requests in the last Window)
//	          + MinPerSecond × Window
//	          - (retries in the last Window)
//
// and a retry is allowed while available >= 1.
//
// Approximation: requests and retries are counted in a ring of one-second
// buckets covering Window (rounded up to whole seconds). A bucket leaves the
// window all at once, so an event stops counting between Window-1s and
// Window after it happened, never later; the floor MinPerSecond × Window is
// taken from the configured Window. Time that goes backwards (a wall clock
// without a monotonic reading) counts as standing still.
//
// A Budget is safe for concurrent use; each call takes a short mutex and
// reads the clock once. It runs no goroutine. A nil *Budget allows every
// retry.
type Budget struct {
	ratio float64
	floor float64 // MinPerSecond × Window
	clk   clock.Clock
	start time.Time

	mu       sync.Mutex // protects everything below
	last     int64      // the newest second (since start) seen
	requests int64      // sum of ring[].requests
	retries  int64      // sum of ring[].retries
	ring     []budgetBucket
}

type budgetBucket struct {
	sec      int64 // the second (since start) this bucket counts
	requests int64
	retries  int64
}

// epsilon absorbs float error in Ratio × requests (0.2 × 100 must allow 20).
const budgetEpsilon = 1e-9

// NewBudget returns a budget for cfg on clk. A Window under one second
// counts as one second.
func NewBudget(cfg BudgetConfig, clk clock.Clock) *Budget {
	n := int((cfg.Window.D() + time.Second - 1) / time.Second)
	if n < 1 {
		n = 1
	}
	return &Budget{
		ratio: math.Max(cfg.Ratio, 0),
		floor: math.Max(cfg.MinPerSecond, 0) * cfg.Window.D().Seconds(),
		clk:   clk,
		start: clk.Now(),
		ring:  make([]budgetBucket, n),
	}
}

// advance moves the window to now and returns the current bucket. b.mu must
// be held.
func (b *Budget) advance(now time.Time) *budgetBucket {
	sec := int64(now.Sub(b.start) / time.Second)
	if sec > b.last {
		n := int64(len(b.ring))
		from := b.last + 1
		if sec-from >= n {
			from = sec - n + 1 // every bucket expires; visit each once
		}
		for s := from; s <= sec; s++ {
			bk := &b.ring[s%n]
			b.requests -= bk.requests
			b.retries -= bk.retries
			*bk = budgetBucket{sec: s}
		}
		b.last = sec
	}
	return &b.ring[b.last%int64(len(b.ring))]
}

// Request records a first attempt: it deposits Ratio retries.
func (b *Budget) Request() {
	if b == nil {
		return
	}
	b.RequestAt(b.clk.Now())
}

// RequestAt is Request for a call that arrived at now (read once per
// request by the caller, so that the window costs no clock read of its
// own; an earlier now than the window's last second counts in that
// second).
func (b *Budget) RequestAt(now time.Time) {
	if b == nil {
		return
	}
	b.mu.Lock()
	bk := b.advance(now)
	bk.requests++
	b.requests++
	b.mu.Unlock()
}

// Retry withdraws one retry and reports true, or reports false when the
// budget is exhausted.
func (b *Budget) Retry() bool {
	if b == nil {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	bk := b.advance(b.clk.Now())
	if b.balance() < 1-budgetEpsilon {
		return false
	}
	bk.retries++
	b.retries++
	return true
}

// Available returns how many retries the budget allows now (for metrics and
// the admin API); math.MaxInt for a nil budget.
func (b *Budget) Available() int {
	if b == nil {
		return math.MaxInt
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.advance(b.clk.Now())
	v := math.Floor(b.balance() + budgetEpsilon)
	if v < 0 {
		return 0
	}
	return int(v)
}

func (b *Budget) balance() float64 {
	return b.ratio*float64(b.requests) + b.floor - float64(b.retries)
}
