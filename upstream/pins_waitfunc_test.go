package upstream

import (
	"context"
	"testing"
	"time"

	"github.com/encgate/encgate/internal/clock"
)

// WaitFunc: its function runs exactly once, when the pin comes or the wait
// passes on the injected clock, whichever is first, and leaves no waiter.
func TestPinWaitFuncRunsOnceOnThePinOrTheDeadline(t *testing.T) {
	clk := clock.NewFake(time.Unix(1000, 0))
	tab := NewPinTable(time.Hour, 100, clk)

	if !tab.WaitFunc("a", 0, nil, func() { t.Error("ran") }) {
		t.Fatal("a wait of 0 registered")
	}
	tab.Place("pinned", "enc-0", 1)
	if !tab.WaitFunc("pinned", time.Second, nil, func() { t.Error("ran") }) {
		t.Fatal("a req_id already pinned registered a wait")
	}

	// The pin comes first.
	ran := make(chan string, 4)
	if tab.WaitFunc("b", time.Second, nil, func() { ran <- "b" }) {
		t.Fatal("no wait registered for an unpinned req_id")
	}
	if n := tab.Waiting(); n != 1 {
		t.Fatalf("waiting %d, want 1", n)
	}
	tab.Place("b", "enc-0", 1)
	if got := <-ran; got != "b" {
		t.Fatal(got)
	}
	clk.Advance(2 * time.Second) // its timer was stopped: nothing more runs
	if n := clk.Pending(); n != 0 {
		t.Fatalf("%d timers pending after the pin came", n)
	}

	// The deadline comes first; the pin after it wakes nothing.
	if tab.WaitFunc("c", time.Second, nil, func() { ran <- "c" }) {
		t.Fatal("no wait registered")
	}
	clk.Advance(time.Second)
	if got := <-ran; got != "c" {
		t.Fatal(got)
	}
	if n := tab.Waiting(); n != 0 {
		t.Fatalf("waiting %d after the deadline, want 0", n)
	}
	tab.Place("c", "enc-0", 1)
	// A function still on its way would show here: b's and c's ran once.
	tab.Place("d", "enc-0", 1)
	if !tab.WaitFunc("d", time.Second, nil, func() {}) {
		t.Fatal("registered for a pinned req_id")
	}
	select {
	case got := <-ran:
		t.Fatalf("%s ran twice", got)
	default:
	}
}

// polledShare is a gatedShare whose placements are polled every poll.
type polledShare struct {
	*gatedShare
	poll time.Duration
}

func (p polledShare) Poll() time.Duration { return p.poll }

// With pins shared, WaitFunc waits as Wait does but with no goroutine of
// its own: it returns once the share has been read, and its function runs
// once, when that read finds the pin, a placement message's read does, a
// poll's does, or the deadline passes; after it, no timer is left.
func TestPinWaitFuncWithASharedTable(t *testing.T) {
	clk := clock.NewFake(time.Unix(1000, 0))
	g := &gatedShare{gets: make(chan struct{}, 64), gate: make(chan bool), placed: make(chan func(string), 1),
		pin: Pin{Encoder: "enc-1", EncoderID: 1, State: PinEncoded}}
	tab := NewPinTable(time.Hour, 100, clk)
	ctx, cancel := context.WithCancel(context.Background())
	done := tab.Share(ctx, polledShare{g, time.Second}, nil)
	t.Cleanup(func() { cancel(); <-done })
	placed := <-g.placed
	ran := make(chan string, 4)
	registered := func(id string, d time.Duration, stop context.Context, found bool) {
		t.Helper()
		ret := make(chan bool, 1)
		go func() { ret <- tab.WaitFunc(id, d, stop, func() { ran <- id }) }()
		select {
		case <-g.gets: // the read at registration, on WaitFunc's caller
		case now := <-ret:
			t.Fatalf("%s: WaitFunc returned %v without reading the share", id, now)
		}
		g.gate <- found
		if now := <-ret; now {
			t.Fatalf("%s: WaitFunc went on at once (registered nothing)", id)
		}
	}
	timersLeft := func(id string) {
		t.Helper()
		if n := tab.Waiting(); n != 0 {
			t.Fatalf("%s: %d waiting after its function ran", id, n)
		}
		if n := clk.Pending(); n != 0 {
			t.Fatalf("%s: %d timers left after its function ran", id, n)
		}
	}

	// The read at registration finds the pin.
	registered("a", 10*time.Second, nil, true)
	if got := <-ran; got != "a" {
		t.Fatal(got)
	}
	timersLeft("a")

	// A placement message: its read finds the pin.
	registered("b", 10*time.Second, nil, false)
	if n := tab.Waiting(); n != 1 {
		t.Fatalf("b: waiting %d, want 1", n)
	}
	go placed("b")
	<-g.gets
	g.gate <- true
	if got := <-ran; got != "b" {
		t.Fatal(got)
	}
	timersLeft("b")

	// No message (lost to a reconnect): the poll finds it.
	registered("c", 10*time.Second, nil, false)
	clk.Advance(time.Second)
	<-g.gets
	g.gate <- true
	if got := <-ran; got != "c" {
		t.Fatal(got)
	}
	timersLeft("c")

	// Nothing comes: a poll finds nothing and the next is armed; the
	// deadline ends the wait, and the poll armed then is stopped.
	registered("d", 1500*time.Millisecond, nil, false)
	clk.Advance(time.Second)
	<-g.gets
	g.gate <- false
	for { // until the next poll is armed, by the one that found nothing
		created := clk.TimerCreated()
		if clk.Pending() == 2 {
			break
		}
		<-created
	}
	clk.Advance(500 * time.Millisecond)
	if got := <-ran; got != "d" {
		t.Fatal(got)
	}
	timersLeft("d")

	// The caller stops (the server's shutdown): the wait ends at once,
	// its deadline and poll stopped, as Wait's done ends it.
	ctx, stop := context.WithCancel(context.Background())
	registered("e", time.Hour, ctx, false)
	stop()
	if got := <-ran; got != "e" {
		t.Fatal(got)
	}
	timersLeft("e")
	select {
	case got := <-ran:
		t.Fatalf("%s ran twice", got)
	default:
	}
}

// A wait without a share ends on its caller's stop too, once, and leaves
// no waiter or timer; the pin coming after it wakes nothing.
func TestPinWaitFuncEndsOnStop(t *testing.T) {
	clk := clock.NewFake(time.Unix(1000, 0))
	tab := NewPinTable(time.Hour, 100, clk)
	ctx, stop := context.WithCancel(context.Background())
	ran := make(chan struct{}, 2)
	if tab.WaitFunc("s", time.Hour, ctx, func() { ran <- struct{}{} }) {
		t.Fatal("no wait registered")
	}
	stop()
	<-ran
	if n := tab.Waiting(); n != 0 {
		t.Fatalf("waiting %d after the stop, want 0", n)
	}
	if n := clk.Pending(); n != 0 {
		t.Fatalf("%d timers left after the stop", n)
	}
	tab.Place("s", "enc-0", 1)
	tab.Place("t", "enc-0", 1) // a function still on its way would show by now
	select {
	case <-ran:
		t.Fatal("ran twice")
	default:
	}
}

// The waiters of one req_id, parked (WaitFunc) and on goroutines (Wait),
// share one poll of the share: one timer and one read per Poll, not one
// per waiter (thousands of pulls wait in a 504 storm, TP ranks' pulls of
// one part among them). The read that finds the pin wakes them all, and
// nothing is left armed.
func TestWaitersOfOneReqIDShareOnePoll(t *testing.T) {
	clk := clock.NewFake(time.Unix(1000, 0))
	g := &gatedShare{gets: make(chan struct{}, 64), gate: make(chan bool), placed: make(chan func(string), 1),
		pin: Pin{Encoder: "enc-1", EncoderID: 1, State: PinEncoded}}
	tab := NewPinTable(time.Hour, 100, clk)
	ctx, cancel := context.WithCancel(context.Background())
	done := tab.Share(ctx, polledShare{g, time.Second}, nil)
	t.Cleanup(func() { cancel(); <-done })
	<-g.placed
	pendingReaches := func(n int) {
		t.Helper()
		for {
			created := clk.TimerCreated()
			if got := clk.Pending(); got == n {
				return
			} else if got > n {
				t.Fatalf("%d timers armed, want %d: a poll per waiter?", got, n)
			}
			<-created
		}
	}
	const parked, goroutines = 8, 2
	woken := make(chan string, parked+goroutines)
	for i := range parked {
		ret := make(chan bool, 1)
		go func() { ret <- tab.WaitFunc("p", time.Minute, nil, func() { woken <- "parked" }) }()
		<-g.gets // each arrival's read at registration
		g.gate <- false
		if now := <-ret; now {
			t.Fatalf("parked waiter %d went on at once", i)
		}
	}
	for i := range goroutines {
		go func() {
			if p, ok := tab.Wait("p", time.Minute, nil); ok && p.Encoder == "enc-1" {
				woken <- "goroutine"
			} else {
				woken <- "goroutine without the pin"
			}
		}()
		<-g.gets
		g.gate <- false
		// Its deadline is armed once its read is over: the next waiter
		// cannot share that read.
		pendingReaches(parked + i + 1 + 1)
	}
	// A deadline for each waiter, and one poll for the req_id.
	pendingReaches(parked + goroutines + 1)

	// A poll that finds nothing reads once, and arms the next.
	clk.Advance(time.Second)
	<-g.gets
	g.gate <- false
	pendingReaches(parked + goroutines + 1)
	select {
	case <-g.gets:
		t.Fatal("a second read in one poll")
	default:
	}

	// The next finds the pin: every waiter is woken by its one read.
	clk.Advance(time.Second)
	<-g.gets
	g.gate <- true
	for range parked + goroutines {
		if w := <-woken; w == "goroutine without the pin" {
			t.Fatal(w)
		}
	}
	if n := tab.Waiting(); n != 0 {
		t.Fatalf("%d waiting after the pin came", n)
	}
	if n := clk.Pending(); n != 0 {
		t.Fatalf("%d timers left after the pin came", n)
	}
	select {
	case <-g.gets:
		t.Fatal("the share was read again after the pin came")
	default:
	}
}
