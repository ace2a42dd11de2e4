package upstream

import (
	"fmt"
	"testing"
	"time"

	"github.com/encgate/encgate/internal/clock"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func TestPinTTL(t *testing.T) {
	clk := clock.NewFake(t0)
	p := NewPinTable(240*time.Second, 100, clk)
	p.Set("r1", "enc-a", 1)
	if pin, ok := p.Get("r1"); !ok || pin.Encoder != "enc-a" || pin.Failed() {
		t.Fatalf("Get = %+v %v", pin, ok)
	}
	clk.Advance(239 * time.Second)
	if _, ok := p.Get("r1"); !ok {
		t.Fatal("pin expired early")
	}
	clk.Advance(time.Second)
	if _, ok := p.Get("r1"); ok {
		t.Fatal("pin outlived its TTL")
	}
	if n := p.Sweep(); n != 1 || p.Len() != 0 {
		t.Fatalf("Sweep removed %d, Len %d", n, p.Len())
	}
}

func TestPinFailKeepsEncoder(t *testing.T) {
	p := NewPinTable(time.Minute, 100, clock.NewFake(t0))
	p.Set("r", "enc-b", 1)
	p.Fail("r", Failure{Status: 400, Message: "bad media", Answered: true, Placed: true})
	pin, ok := p.Get("r")
	if !ok || !pin.Failed() || pin.Status != 400 || pin.Message != "bad media" || pin.Encoder != "enc-b" {
		t.Fatalf("Get = %+v", pin)
	}
	// The gateway's own failure of an /encode that holds no pin (refused
	// before an encoder was chosen) stores nothing.
	p.Fail("never-pinned", Failure{Status: 503, Message: "no usable encoder"})
	if pin, ok := p.Get("never-pinned"); ok {
		t.Fatalf("a gateway failure without pin stored %+v", pin)
	}
	// The encoder's own answer for a req_id whose pin is gone is kept, on
	// the encoder that answered.
	p.Fail("dropped", Failure{Status: 500, Message: "boom", Answered: true, Encoder: "enc-c", EncoderID: 3})
	if pin, _ := p.Get("dropped"); !pin.Failed() || pin.Encoder != "enc-c" || pin.EncoderID != 3 || pin.Status != 500 {
		t.Fatalf("an answered failure without pin = %+v", pin)
	}
	if p.Len() != 2 {
		t.Fatalf("Len = %d", p.Len())
	}
}

func TestPinWaitWakesOnSet(t *testing.T) {
	clk := clock.NewFake(t0)
	p := NewPinTable(time.Minute, 100, clk)
	created := clk.TimerCreated()
	got := make(chan Pin)
	go func() {
		pin, _ := p.Wait("r", 5*time.Second, nil)
		got <- pin
	}()
	<-created // the waiter is parked on its timer
	if p.Waiting() != 1 {
		t.Fatalf("Waiting = %d", p.Waiting())
	}
	p.Set("r", "enc-c", 1)
	if pin := <-got; pin.Encoder != "enc-c" {
		t.Fatalf("woke with %+v", pin)
	}
	if p.Waiting() != 0 {
		t.Fatalf("waiter not cleaned up: %d", p.Waiting())
	}
}

func TestPinWaitTimesOut(t *testing.T) {
	clk := clock.NewFake(t0)
	p := NewPinTable(time.Minute, 100, clk)
	created := clk.TimerCreated()
	done := make(chan bool)
	go func() {
		_, ok := p.Wait("r", 5*time.Second, nil)
		done <- ok
	}()
	<-created
	clk.Advance(5 * time.Second)
	if ok := <-done; ok {
		t.Fatal("Wait reported a pin that was never set")
	}
	if p.Waiting() != 0 {
		t.Fatalf("waiter not cleaned up")
	}
}

func TestPinWaitAbort(t *testing.T) {
	clk := clock.NewFake(t0)
	p := NewPinTable(time.Minute, 100, clk)
	abort := make(chan struct{})
	created := clk.TimerCreated()
	done := make(chan bool)
	go func() {
		_, ok := p.Wait("r", time.Hour, abort)
		done <- ok
	}()
	<-created
	close(abort)
	if <-done {
		t.Fatal("aborted Wait reported a pin")
	}
}

func TestPinBound(t *testing.T) {
	clk := clock.NewFake(t0)
	p := NewPinTable(time.Minute, 640, clk)
	for i := 0; i < 5000; i++ {
		p.Set(fmt.Sprintf("r%d", i), "e", 1)
		clk.Advance(time.Millisecond)
	}
	if p.Len() != 640 {
		t.Fatalf("Len %d exceeds the bound", p.Len())
	}
	if p.Evictions() == 0 {
		t.Fatal("no evictions counted")
	}
	// The newest pin survives; eviction takes the oldest.
	if _, ok := p.Get("r4999"); !ok {
		t.Fatal("newest pin evicted")
	}
}

func TestCountByEncoder(t *testing.T) {
	p := NewPinTable(time.Minute, 100, clock.NewFake(t0))
	p.Set("a", "x", 1)
	p.Set("b", "x", 1)
	p.Set("c", "y", 1)
	p.Fail("d", Failure{Status: 503, Message: "none"})
	got := p.CountByEncoder()
	if got["x"] != 2 || got["y"] != 1 || len(got) != 2 {
		t.Fatalf("CountByEncoder = %v", got)
	}
}

// A pin moves through pending → encoded or failed. A success is never
// overwritten by a later failure (the encoder still holds the part); a
// failure is replaced by a new placement; a consequence of a failure never
// hides its cause.
func TestPinStates(t *testing.T) {
	p := NewPinTable(time.Minute, 100, clock.NewFake(t0))
	if pin, placed := p.Place("r", "enc-a", 1); !placed || pin.State != PinPending || pin.Encoder != "enc-a" {
		t.Fatalf("Place = %+v %v", pin, placed)
	}
	// A sibling's /encode finds the pin and follows it.
	if pin, placed := p.Place("r", "enc-b", 2); placed || pin.Encoder != "enc-a" {
		t.Fatalf("second Place = %+v %v", pin, placed)
	}
	// Nothing reached enc-a: the /encode moves on, and only from where it was.
	if p.Move("r", 2, "enc-c", 3) {
		t.Fatal("Move from an encoder the pin is not on")
	}
	if !p.Move("r", 1, "enc-b", 2) {
		t.Fatal("Move of a pending pin")
	}
	p.Encoded("r", 1) // a stale report from enc-a changes nothing
	if pin, _ := p.Get("r"); pin.State != PinPending || pin.Encoder != "enc-b" {
		t.Fatalf("after a stale Encoded: %+v", pin)
	}
	p.Encoded("r", 2)
	if pin, _ := p.Get("r"); pin.State != PinEncoded || pin.EncoderID != 2 {
		t.Fatalf("after Encoded: %+v", pin)
	}
	if p.Move("r", 2, "enc-c", 3) {
		t.Fatal("an encoded pin moved")
	}
	p.Fail("r", Failure{Status: 400, Message: "a later bad /encode", Answered: true})
	if pin, _ := p.Get("r"); pin.State != PinEncoded {
		t.Fatalf("a failure overwrote a success: %+v", pin)
	}
	if _, placed := p.Place("r", "enc-c", 3); placed {
		t.Fatal("an encoded pin was replaced")
	}

	p.Place("f", "enc-a", 1)
	p.Fail("f", Failure{Status: 400, Message: "Error while loading data x", Answered: true, Placed: true})
	p.Fail("f", Failure{Status: 500, Message: "Encode failed on the first request", Answered: true, Consequence: true})
	if pin, _ := p.Get("f"); !pin.Failed() || pin.Status != 400 || !pin.Answered || pin.Encoder != "enc-a" {
		t.Fatalf("a consequence hid the cause: %+v", pin)
	}
	p.Fail("f", Failure{Status: 503, Message: "encgate: no usable encoder"})
	if pin, _ := p.Get("f"); pin.Status != 503 || pin.Answered {
		t.Fatalf("a later failure of its own: %+v", pin)
	}
	if pin, placed := p.Place("f", "enc-b", 2); !placed || pin.State != PinPending || pin.Encoder != "enc-b" {
		t.Fatalf("a failed part placed anew: %+v %v", pin, placed)
	}
}

// Place wakes the follow-ups waiting for the pin.
func TestPinPlaceWakesWaiters(t *testing.T) {
	clk := clock.NewFake(t0)
	p := NewPinTable(time.Minute, 100, clk)
	created := clk.TimerCreated()
	got := make(chan Pin)
	go func() {
		pin, _ := p.Wait("r", 5*time.Second, nil)
		got <- pin
	}()
	<-created
	p.Place("r", "enc-a", 1)
	if pin := <-got; pin.Encoder != "enc-a" || pin.State != PinPending {
		t.Fatalf("woke with %+v", pin)
	}
}

// A gateway-made failure of an /encode that followed another's pending pin
// (a sibling rank refused at the gateway) leaves that pin alone: the first
// rank's encode is still going.
func TestPinFailOfAFollowerLeavesAPendingPin(t *testing.T) {
	p := NewPinTable(time.Minute, 100, clock.NewFake(t0))
	p.Place("r", "enc-a", 1)
	p.Fail("r", Failure{Status: 503, Message: "encgate: encoder enc-a is down"})
	if pin, _ := p.Get("r"); pin.State != PinPending {
		t.Fatalf("a follower's own failure failed the pin: %+v", pin)
	}
	p.Fail("r", Failure{Status: 400, Message: "bad media", Answered: true})
	if pin, _ := p.Get("r"); !pin.Failed() || pin.Status != 400 {
		t.Fatalf("the encoder's answer: %+v", pin)
	}
	p.Place("q", "enc-a", 1)
	p.Fail("q", Failure{Status: 503, Message: "encgate: no time left", Placed: true})
	if pin, _ := p.Get("q"); !pin.Failed() {
		t.Fatalf("the placing call's failure: %+v", pin)
	}
}
