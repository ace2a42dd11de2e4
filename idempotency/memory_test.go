package idempotency

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/encgate/encgate/internal/clock"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
var bg = context.Background()

func okRec(fp Fingerprint) *Record {
	return &Record{Status: 200, ContentType: "application/json", Body: []byte("null"), FP: fp}
}

func TestMemoryRefcountRelease(t *testing.T) {
	m := NewMemory(1000, 1024, time.Minute, clock.NewFake(t0))
	for i := 0; i < 4; i++ {
		k := Key{"r", fmt.Sprintf("10.0.0.1:%d", 40000+i)}
		if c, _ := m.Claim(bg, k, Fingerprint{}); c.State != StateClaimed {
			t.Fatalf("dest %d: claim state %v", i, c.State)
		}
		released, _ := m.Complete(bg, k, okRec(Fingerprint{}), 4)
		if released != (i == 3) {
			t.Fatalf("after dest %d released=%v", i, released)
		}
		// a repeat of a done destination does not advance the count
		if released, _ := m.Complete(bg, Key{"r", "10.0.0.1:40000"}, okRec(Fingerprint{}), 4); released != (i == 3) {
			t.Fatalf("repeat advanced the count at %d", i)
		}
	}
	if c, _ := m.Claim(bg, Key{"r", "10.0.0.9:1"}, Fingerprint{}); c.State != StateReleased {
		t.Fatalf("new destination after release: %v", c.State)
	}
	if c, _ := m.Claim(bg, Key{"r", "10.0.0.1:40002"}, Fingerprint{}); c.State != StateRecorded || c.Record.Status != 200 {
		t.Fatalf("done destination after release: %+v", c)
	}
	v, _ := m.Inspect(bg, "r")
	if !v.Released || v.Done != 4 || v.ReceiveCount != 4 || len(v.Destinations) != 4 {
		t.Fatalf("Inspect = %+v", v)
	}
}

func TestMemoryWithoutReceiveCountNeverReleases(t *testing.T) {
	m := NewMemory(1000, 1024, time.Minute, clock.NewFake(t0))
	for i := 0; i < 10; i++ {
		if rel, _ := m.Complete(bg, Key{"r", fmt.Sprint(i)}, okRec(Fingerprint{}), 0); rel {
			t.Fatal("released without receive_count")
		}
	}
}

func TestMemoryTTL(t *testing.T) {
	clk := clock.NewFake(t0)
	m := NewMemory(1000, 1024, time.Minute, clk)
	k := Key{"r", "h:1"}
	m.Complete(bg, k, okRec(Fingerprint{}), 1)
	clk.Advance(59 * time.Second)
	if rec, _, _ := lookup(m, bg, k); rec == nil {
		t.Fatal("record expired early")
	}
	clk.Advance(time.Second)
	if rec, rel, _ := lookup(m, bg, k); rec != nil || rel {
		t.Fatal("record outlived its TTL")
	}
	m.Complete(bg, Key{"s", "h:1"}, okRec(Fingerprint{}), 0)
	clk.Advance(time.Minute)
	if n := m.Sweep(); n != 1 || m.Records() != 0 {
		t.Fatalf("Sweep removed %d, %d left", n, m.Records())
	}
}

func TestMemoryBound(t *testing.T) {
	clk := clock.NewFake(t0)
	m := NewMemory(640, 1024, time.Hour, clk) // 11 per shard
	for i := 0; i < 5000; i++ {
		m.Complete(bg, Key{fmt.Sprintf("r%d", i), "h:1"}, okRec(Fingerprint{}), 0)
		clk.Advance(time.Millisecond)
	}
	if got := m.Records(); got > 64*11 {
		t.Fatalf("%d records held, bound is %d", got, 64*11)
	}
	if m.Evictions() == 0 {
		t.Fatal("evictions not counted")
	}
	if rec, _, _ := lookup(m, bg, Key{"r4999", "h:1"}); rec == nil {
		t.Fatal("newest record was evicted")
	}
}

func TestMemoryRecordRoundTrip(t *testing.T) {
	m := NewMemory(1000, 1024, time.Hour, clock.NewFake(t0))
	m.Complete(bg, Key{"a", "h:1"}, okRec(Fingerprint{}), 0)
	m.Complete(bg, Key{"b", "h:1"}, okRec(Fingerprint{}), 0)
	a, _, _ := lookup(m, bg, Key{"a", "h:1"})
	b, _, _ := lookup(m, bg, Key{"b", "h:1"})
	if string(a.Body) != "null" || string(b.Body) != "null" || a.ContentType != "application/json" {
		t.Errorf("records %+v %+v", a, b)
	}
}
