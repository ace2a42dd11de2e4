// Package clock provides the time source that encgate's time-dependent code
// (pin TTLs, waits, backoff, breakers) takes as a dependency, so tests can
// drive time by hand instead of sleeping.
package clock

import (
	"sort"
	"sync"
	"time"
)

// Clock tells the time and makes timers.
type Clock interface {
	Now() time.Time
	// NewTimer returns a timer that fires once after d.
	NewTimer(d time.Duration) Timer
	// AfterFunc runs f on a goroutine of its own once d has passed,
	// unless the timer is stopped first; nothing waits meanwhile. The
	// timer's C is nil.
	AfterFunc(d time.Duration, f func()) Timer
}

// Timer is the part of *time.Timer that encgate uses.
type Timer interface {
	C() <-chan time.Time
	// Stop prevents the timer from firing; it reports whether it was active.
	Stop() bool
}

// Real is the wall clock.
type Real struct{}

// Now returns time.Now().
func (Real) Now() time.Time { return time.Now() }

// NewTimer wraps time.NewTimer.
func (Real) NewTimer(d time.Duration) Timer { return realTimer{time.NewTimer(d)} }

// AfterFunc wraps time.AfterFunc.
func (Real) AfterFunc(d time.Duration, f func()) Timer { return realTimer{time.AfterFunc(d, f)} }

type realTimer struct{ t *time.Timer }

func (r realTimer) C() <-chan time.Time { return r.t.C }
func (r realTimer) Stop() bool          { return r.t.Stop() }

// Fake is a manual clock for tests. Time moves only through Advance. The
// zero value is not usable; use NewFake.
type Fake struct {
	mu     sync.Mutex // protects now, timers and waiters
	now    time.Time
	timers []*fakeTimer
	// waiters are signalled whenever a timer is created, so a test can wait
	// until the code under test is blocked on the clock.
	waiters []chan struct{}
}

// NewFake returns a fake clock set to start.
func NewFake(start time.Time) *Fake { return &Fake{now: start} }

// Now returns the fake time.
func (f *Fake) Now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.now
}

// NewTimer returns a timer that fires when Advance reaches now+d.
func (f *Fake) NewTimer(d time.Duration) Timer {
	f.mu.Lock()
	defer f.mu.Unlock()
	t := &fakeTimer{f: f, at: f.now.Add(d), c: make(chan time.Time, 1)}
	if d <= 0 {
		t.c <- f.now
	} else {
		f.timers = append(f.timers, t)
	}
	for _, w := range f.waiters {
		close(w)
	}
	f.waiters = nil
	return t
}

// AfterFunc returns a timer that runs f, on a goroutine of its own, when
// Advance reaches now+d (at once for d <= 0).
func (f *Fake) AfterFunc(d time.Duration, fn func()) Timer {
	f.mu.Lock()
	defer f.mu.Unlock()
	t := &fakeTimer{f: f, at: f.now.Add(d), fn: fn}
	if d <= 0 {
		go fn()
	} else {
		f.timers = append(f.timers, t)
	}
	for _, w := range f.waiters {
		close(w)
	}
	f.waiters = nil
	return t
}

// TimerCreated returns a channel closed the next time a timer is created.
func (f *Fake) TimerCreated() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	c := make(chan struct{})
	f.waiters = append(f.waiters, c)
	return c
}

// Pending reports how many timers are waiting to fire.
func (f *Fake) Pending() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.timers)
}

// Advance moves time forward by d and fires every timer that is due, in order.
func (f *Fake) Advance(d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now = f.now.Add(d)
	sort.Slice(f.timers, func(i, j int) bool { return f.timers[i].at.Before(f.timers[j].at) })
	kept := f.timers[:0]
	for _, t := range f.timers {
		if t.at.After(f.now) {
			kept = append(kept, t)
			continue
		}
		if t.fn != nil {
			go t.fn()
			continue
		}
		t.c <- t.at
	}
	f.timers = kept
}

type fakeTimer struct {
	f  *Fake
	at time.Time
	c  chan time.Time
	fn func() // AfterFunc's, run instead of sending on c
}

func (t *fakeTimer) C() <-chan time.Time { return t.c }

func (t *fakeTimer) Stop() bool {
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	for i, x := range t.f.timers {
		if x == t {
			t.f.timers = append(t.f.timers[:i], t.f.timers[i+1:]...)
			return true
		}
	}
	return false
}
