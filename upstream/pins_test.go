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
	p.Fail("r", 400, "bad media", true, false)
	pin, ok := p.Get("r")
	if !ok || !pin.Failed() || pin.Status != 400 || pin.Message != "bad media" || pin.Encoder != "enc-b" {
		t.Fatalf("Get = %+v", pin)
	}
	p.Fail("never-pinned", 503, "no usable encoder", false, false)
	if pin, _ := p.Get("never-pinned"); !pin.Failed() || pin.Encoder != "" {
		t.Fatalf("failure without pin = %+v", pin)
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
	p := NewPinTable(time.Minute, 640, clk) // 11 per shard
	for i := 0; i < 5000; i++ {
		p.Set(fmt.Sprintf("r%d", i), "e", 1)
		clk.Advance(time.Millisecond)
	}
	if p.Len() > 64*11 {
		t.Fatalf("Len %d exceeds the bound", p.Len())
	}
	if p.Evictions() == 0 {
		t.Fatal("no evictions counted")
	}
	// The newest pin survives; eviction takes the soonest to expire.
	if _, ok := p.Get("r4999"); !ok {
		t.Fatal("newest pin evicted")
	}
}

func TestCountByEncoder(t *testing.T) {
	p := NewPinTable(time.Minute, 100, clock.NewFake(t0))
	p.Set("a", "x", 1)
	p.Set("b", "x", 1)
	p.Set("c", "y", 1)
	p.Fail("d", 503, "none", false, false)
	got := p.CountByEncoder()
	if got["x"] != 2 || got["y"] != 1 || len(got) != 2 {
		t.Fatalf("CountByEncoder = %v", got)
	}
}
