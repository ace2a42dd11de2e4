package upstream

import (
	"testing"
	"time"

	"github.com/encgate/encgate/internal/clock"
)

// WaitFunc: its function runs exactly once, when the pin comes or the wait
// passes on the injected clock, whichever is first, and leaves no waiter.
func TestPinWaitFuncRunsOnceOnThePinOrTheDeadline(t *testing.T) {
	clk := clock.NewFake(time.Unix(1000, 0))
	tab := NewPinTable(time.Hour, 100, clk)

	if !tab.WaitFunc("a", 0, func() { t.Error("ran") }) {
		t.Fatal("a wait of 0 registered")
	}
	tab.Place("pinned", "enc-0", 1)
	if !tab.WaitFunc("pinned", time.Second, func() { t.Error("ran") }) {
		t.Fatal("a req_id already pinned registered a wait")
	}

	// The pin comes first.
	ran := make(chan string, 4)
	if tab.WaitFunc("b", time.Second, func() { ran <- "b" }) {
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
	if tab.WaitFunc("c", time.Second, func() { ran <- "c" }) {
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
	if !tab.WaitFunc("d", time.Second, func() {}) {
		t.Fatal("registered for a pinned req_id")
	}
	select {
	case got := <-ran:
		t.Fatalf("%s ran twice", got)
	default:
	}
}
