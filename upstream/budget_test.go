package upstream

import (
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/encgate/encgate/internal/clock"
)

var budgetStart = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// drainBudget withdraws until the budget refuses and returns how many it gave.
func drainBudget(b *Budget) int {
	n := 0
	for b.Retry() {
		n++
		if n > 1e6 {
			panic("budget never runs out")
		}
	}
	return n
}

func TestBudgetCounts(t *testing.T) {
	tests := []struct {
		name     string
		cfg      BudgetConfig
		requests int
		want     int
	}{
		{"floor only", BudgetConfig{Ratio: 0.2, MinPerSecond: 10, Window: retryDur(10 * time.Second)}, 0, 100},
		{"ratio only", BudgetConfig{Ratio: 0.2, MinPerSecond: 0, Window: retryDur(10 * time.Second)}, 100, 20},
		{"ratio plus floor", BudgetConfig{Ratio: 0.2, MinPerSecond: 10, Window: retryDur(10 * time.Second)}, 100, 120},
		{"fractional deposits round down", BudgetConfig{Ratio: 0.2, Window: retryDur(10 * time.Second)}, 14, 2},
		{"ratio 0.1", BudgetConfig{Ratio: 0.1, Window: retryDur(time.Second)}, 1000, 100},
		{"nothing", BudgetConfig{Window: retryDur(10 * time.Second)}, 0, 0},
		{"nothing, many requests", BudgetConfig{Window: retryDur(10 * time.Second)}, 1000, 0},
		{"fractional floor", BudgetConfig{MinPerSecond: 0.5, Window: retryDur(5 * time.Second)}, 0, 2},
		{"ratio above 1", BudgetConfig{Ratio: 3, Window: retryDur(10 * time.Second)}, 10, 30},
	}
	for _, tc := range tests {
		b := NewBudget(tc.cfg, clock.NewFake(budgetStart))
		for range tc.requests {
			b.Request()
		}
		if got := b.Available(); got != tc.want {
			t.Errorf("%s: Available = %d, want %d", tc.name, got, tc.want)
		}
		if got := drainBudget(b); got != tc.want {
			t.Errorf("%s: %d retries allowed, want %d", tc.name, got, tc.want)
		}
		if got := b.Available(); got != 0 {
			t.Errorf("%s: Available after draining = %d", tc.name, got)
		}
	}
}

func TestBudgetRatioInterleaved(t *testing.T) {
	// One retry per five requests, as requests keep coming.
	b := NewBudget(BudgetConfig{Ratio: 0.2, Window: retryDur(10 * time.Second)}, clock.NewFake(budgetStart))
	got := 0
	for range 100 {
		b.Request()
		if b.Retry() {
			got++
		}
	}
	if got != 20 {
		t.Errorf("%d retries over 100 requests, want 20", got)
	}
}

func TestBudgetExpiry(t *testing.T) {
	clk := clock.NewFake(budgetStart)
	b := NewBudget(BudgetConfig{Ratio: 0.2, Window: retryDur(10 * time.Second)}, clk)
	for range 100 {
		b.Request() // t = 0: deposits 20
	}
	clk.Advance(5 * time.Second)
	for range 10 {
		if !b.Retry() { // t = 5s: withdraws 10
			t.Fatal("retry refused with deposits left")
		}
	}
	steps := []struct {
		advance time.Duration
		want    int
	}{
		{0, 10},
		{4*time.Second + 999*time.Millisecond, 10}, // t = 9.999s: the requests still count
		{time.Millisecond, 0},                      // t = 10s: the requests expired; the 10 retries still count
		{4 * time.Second, 0},                       // t = 14s
		{time.Second, 0},                           // t = 15s: everything expired, nothing deposited
	}
	for i, s := range steps {
		clk.Advance(s.advance)
		if got := b.Available(); got != s.want {
			t.Errorf("step %d (t=%v): Available = %d, want %d", i, clk.Now().Sub(budgetStart), got, s.want)
		}
	}
	// The withdrawn retries expired too: new requests deposit into a clean
	// window.
	for range 50 {
		b.Request()
	}
	if got := drainBudget(b); got != 10 {
		t.Errorf("after expiry: %d retries, want 10", got)
	}

	// The floor comes back once the retries that spent it expire.
	clk2 := clock.NewFake(budgetStart)
	f := NewBudget(BudgetConfig{Ratio: 0.2, MinPerSecond: 10, Window: retryDur(10 * time.Second)}, clk2)
	if got := drainBudget(f); got != 100 {
		t.Fatalf("floor: %d retries, want 100", got)
	}
	clk2.Advance(9 * time.Second)
	if f.Retry() {
		t.Error("t=9s: retry allowed before the spent floor expired")
	}
	clk2.Advance(time.Second)
	if got := drainBudget(f); got != 100 {
		t.Errorf("t=10s: %d retries, want the full floor of 100", got)
	}
	// A jump far past the window clears everything at once.
	clk2.Advance(time.Hour)
	if got := f.Available(); got != 100 {
		t.Errorf("after an hour: Available = %d, want 100", got)
	}
}

func TestBudgetSlidingBuckets(t *testing.T) {
	// Requests spread over time expire second by second.
	clk := clock.NewFake(budgetStart)
	b := NewBudget(BudgetConfig{Ratio: 1, Window: retryDur(3 * time.Second)}, clk)
	for range 3 {
		b.Request()
		clk.Advance(time.Second)
	} // requests at t = 0, 1, 2; now t = 3
	for i, want := range []int{2, 1, 0} {
		if got := b.Available(); got != want {
			t.Errorf("t=%ds: Available = %d, want %d", 3+i, got, want)
		}
		clk.Advance(time.Second)
	}
}

func TestBudgetWindowRounding(t *testing.T) {
	// 1.5s is counted in two one-second buckets; the floor uses 1.5s.
	clk := clock.NewFake(budgetStart)
	b := NewBudget(BudgetConfig{MinPerSecond: 10, Window: retryDur(1500 * time.Millisecond)}, clk)
	if got := drainBudget(b); got != 15 {
		t.Errorf("floor of a 1.5s window: %d retries, want 15", got)
	}
	clk.Advance(time.Second)
	if got := b.Available(); got != 0 {
		t.Errorf("t=1s: Available = %d, want 0", got)
	}
	clk.Advance(time.Second)
	if got := b.Available(); got != 15 {
		t.Errorf("t=2s: Available = %d, want 15", got)
	}
}

type backwardsClock struct {
	clock.Clock
	now time.Time
}

func (c *backwardsClock) Now() time.Time { return c.now }

func TestBudgetClockGoingBack(t *testing.T) {
	clk := &backwardsClock{Clock: clock.NewFake(budgetStart), now: budgetStart.Add(time.Hour)}
	b := NewBudget(BudgetConfig{Ratio: 1, Window: retryDur(10 * time.Second)}, clk)
	b.Request()
	clk.now = budgetStart // an hour back: stands still, nothing expires
	if got := b.Available(); got != 1 {
		t.Errorf("Available = %d, want 1", got)
	}
}

func TestBudgetNil(t *testing.T) {
	var b *Budget
	b.Request()
	if !b.Retry() || b.Available() != math.MaxInt {
		t.Error("a nil budget must allow every retry")
	}
}

func TestBudgetConcurrent(t *testing.T) {
	clk := clock.NewFake(budgetStart)
	b := NewBudget(BudgetConfig{Ratio: 0.2, MinPerSecond: 10, Window: retryDur(10 * time.Second)}, clk)
	const workers, perWorker = 8, 1000
	var granted atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range perWorker {
				b.Request()
				if i%3 == 0 && b.Retry() {
					granted.Add(1)
				}
				if w == 0 && i%250 == 0 {
					clk.Advance(time.Second / 2)
				}
			}
		})
	}
	wg.Wait()
	// 8000 requests and 2 simulated seconds, inside one window: 1600 + 100
	// retries allowed in all; 2672 were asked for.
	if got := granted.Load() + int64(b.Available()); got != 1700 {
		t.Errorf("granted %d + available %d = %d, want 1700", granted.Load(), b.Available(), got)
	}
	if granted.Load() > 1700 {
		t.Errorf("granted %d > 1700", granted.Load())
	}
}

// A request's own clock read (RequestAt) that is older than the window's
// last second, as one read before a concurrent request advanced the
// window, counts in that second: it never rolls the window back nor lands
// in a bucket that has already expired.
func TestBudgetRequestAtAnEarlierTime(t *testing.T) {
	clk := clock.NewFake(budgetStart)
	b := NewBudget(BudgetConfig{Ratio: 0.2, Window: retryDur(10 * time.Second)}, clk)
	clk.Advance(5 * time.Second)
	b.Request() // the window's last second is now 5
	for range 99 {
		b.RequestAt(budgetStart.Add(2 * time.Second)) // read at t = 2s, counted at 5s
	}
	if got := b.Available(); got != 20 {
		t.Fatalf("Available = %d after 100 requests, want 20", got)
	}
	clk.Advance(9*time.Second + 999*time.Millisecond) // t = 14.999s: second 5 still counts
	if got := b.Available(); got != 20 {
		t.Fatalf("Available = %d at 14.999s, want 20 (the requests counted at second 5)", got)
	}
	clk.Advance(time.Millisecond) // t = 15s: second 5 expires
	if got := b.Available(); got != 0 {
		t.Fatalf("Available = %d at 15s, want 0", got)
	}
}
