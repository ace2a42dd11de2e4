package upstream

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/encgate/encgate/internal/clock"
)

// holds reports whether t holds an entry for reqID, expired or not.
func holds(t *PinTable, reqID string) bool {
	s := t.shard(reqID)
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.m[reqID]
	return ok
}

// checkPinTable checks t's inner consistency while nothing writes: every
// entry is on its class's list once, in write order, the lists hold
// nothing else, and the count is the number of entries, within the bound.
func checkPinTable(tb testing.TB, t *PinTable) {
	tb.Helper()
	entries := 0
	for si := range t.shards {
		s := &t.shards[si]
		s.mu.Lock()
		onList := 0
		for c := range s.lists {
			prev, last := int32(-1), int64(0)
			for i := s.lists[c].head; i >= 0; i = s.e[i].next {
				e := &s.e[i]
				if e.class != pinClass(c) || classOf(e.pin.State) != pinClass(c) || e.prev != prev || s.m[e.key] != i {
					s.mu.Unlock()
					tb.Fatalf("shard %d class %d: entry %d (%s, %+v) is misplaced", si, c, i, e.key, e.pin)
				}
				if e.expires < last {
					s.mu.Unlock()
					tb.Fatalf("shard %d class %d: %s is out of write order", si, c, e.key)
				}
				prev, last = i, e.expires
				onList++
			}
			if s.lists[c].tail != prev {
				s.mu.Unlock()
				tb.Fatalf("shard %d class %d: tail %d, last entry %d", si, c, s.lists[c].tail, prev)
			}
			want := int64(noHead)
			if h := s.lists[c].head; h >= 0 {
				want = s.e[h].expires
			}
			if got := s.heads[c].Load(); got != want {
				s.mu.Unlock()
				tb.Fatalf("shard %d class %d: heads says %d, the head expires at %d", si, c, got, want)
			}
		}
		if onList != len(s.m) {
			s.mu.Unlock()
			tb.Fatalf("shard %d: %d entries on its lists, %d in its map", si, onList, len(s.m))
		}
		entries += len(s.m)
		s.mu.Unlock()
	}
	if n := t.Len(); n != entries || int64(n) > t.max {
		tb.Fatalf("Len %d, %d entries held, bound %d", n, entries, t.max)
	}
}

// At the bound a new pin takes, in this order: an expired pin (not counted
// as an eviction), the oldest failed pin, the oldest pending one, the
// oldest encoded one; and the table never holds more than the bound,
// globally, whatever shard each req_id hashes to.
func TestPinBoundEvictsFailedThenPendingThenEncoded(t *testing.T) {
	const bound, ttl = 6, 10 * time.Minute
	clk := clock.NewFake(t0)
	p := NewPinTable(ttl, bound, clk)
	tracked := []string{}
	tick := time.Second // each write is one second newer
	step := func(what string, do func()) {
		t.Helper()
		clk.Advance(tick)
		do()
		if p.Len() > bound {
			t.Fatalf("after %s: Len %d above the bound %d", what, p.Len(), bound)
		}
		checkPinTable(t, p)
	}
	// victimOf runs a write of a new req_id and returns the pin it took
	// the place of.
	victimOf := func(id string, do func()) string {
		t.Helper()
		before := []string{}
		for _, k := range tracked {
			if holds(p, k) {
				before = append(before, k)
			}
		}
		step(id, do)
		tracked = append(tracked, id)
		gone := []string{}
		for _, k := range before {
			if !holds(p, k) {
				gone = append(gone, k)
			}
		}
		if len(gone) != 1 || !holds(p, id) {
			t.Fatalf("%s: took the place of %v (held: %v)", id, gone, holds(p, id))
		}
		return gone[0]
	}
	encoded := func(id string) func() {
		return func() { p.Place(id, "enc-a", 1); p.Encoded(id, 1) }
	}
	pending := func(id string) func() { return func() { p.Place(id, "enc-a", 1) } }
	failed := func(id string) func() {
		return func() { p.Place(id, "enc-a", 1); p.Fail(id, Failure{Status: 500, Answered: true, Placed: true}) }
	}
	// Ages and classes interleaved: class decides before age.
	for _, w := range []struct {
		id string
		do func(string) func()
	}{{"e1", encoded}, {"p1", pending}, {"f1", failed}, {"e2", encoded}, {"p2", pending}, {"f2", failed}} {
		step(w.id, w.do(w.id))
		tracked = append(tracked, w.id)
	}
	if p.Len() != bound || p.Evictions() != 0 {
		t.Fatalf("filled: Len %d, evictions %d", p.Len(), p.Evictions())
	}
	var got []string
	for i := 1; i <= 7; i++ {
		id := fmt.Sprintf("n%d", i)
		got = append(got, victimOf(id, encoded(id)))
	}
	// A pending pin rewritten (moved) is newer than one left as it was.
	want := []string{"f1", "f2", "p1", "p2", "e1", "e2", "n1"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("victims %v, want %v", got, want)
	}
	if f, pe, e := p.EvictionsOf(PinFailed), p.EvictionsOf(PinPending), p.EvictionsOf(PinEncoded); f != 2 || pe != 2 || e != 3 {
		t.Fatalf("evictions failed %d, pending %d, encoded %d; want 2, 2, 3", f, pe, e)
	}

	// Expired pins go first, whatever their class, and are not evictions.
	// The table holds n2..n7 (encoded, written at 8..13 s); n2 and n3 are
	// released (Delete, as a part's last /send does), a failed and a
	// pending pin (14 s, 15 s) take their slots, then the clock moves to
	// 11 s + ttl: n4 and n5 have expired, n6 has not.
	p.Delete("n2")
	p.Delete("n3")
	step("x1", failed("x1"))
	step("y1", pending("y1"))
	tracked = append(tracked, "x1", "y1")
	clk.Advance(ttl - 4*time.Second)
	tick = 0
	for _, k := range []string{"n4", "n5"} {
		if _, ok := p.Local(k); ok {
			t.Fatalf("%s is still live", k)
		}
	}
	if _, ok := p.Local("n6"); !ok {
		t.Fatal("n6 expired")
	}
	evicted := p.Evictions()
	got = got[:0]
	for i := 1; i <= 4; i++ {
		id := fmt.Sprintf("z%d", i)
		got = append(got, victimOf(id, pending(id)))
	}
	want = []string{"n4", "n5", "x1", "y1"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("victims %v, want %v", got, want)
	}
	if d := p.Evictions() - evicted; d != 2 {
		t.Fatalf("%d evictions counted for two expired and two live pins, want 2", d)
	}
	t.Logf("victims in order: f1 f2 p1 p2 e1 e2 n1, then %v; evictions failed %d, pending %d, encoded %d",
		want, p.EvictionsOf(PinFailed), p.EvictionsOf(PinPending), p.EvictionsOf(PinEncoded))

	// Sweep still takes what expired.
	clk.Advance(ttl)
	if n := p.Sweep(); n != bound || p.Len() != 0 {
		t.Fatalf("Sweep removed %d, Len %d", n, p.Len())
	}
	checkPinTable(t, p)
}

// Concurrent writers of every kind, over far more req_ids than the bound,
// with the clock moving so that pins also expire: Len never exceeds the
// bound at any moment a watcher sees, and the table is consistent after.
func TestPinBoundHoldsUnderConcurrentWriters(t *testing.T) {
	const bound, writers, ops = 64, 8, 3000
	clk := clock.NewFake(t0)
	p := NewPinTable(time.Minute, bound, clk)
	var wg sync.WaitGroup
	var stop atomic.Bool
	var peak atomic.Int64
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for !stop.Load() {
			n := int64(p.Len())
			if n > peak.Load() {
				peak.Store(n)
			}
		}
	}()
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 1))
			for i := 0; i < ops; i++ {
				id := fmt.Sprintf("c%d", r.IntN(1000))
				switch r.IntN(8) {
				case 0:
					p.Set(id, "enc-a", 1)
				case 1, 2:
					p.Place(id, "enc-a", 1)
				case 3:
					p.Encoded(id, 1)
				case 4:
					p.Fail(id, Failure{Status: 500, Answered: true, Encoder: "enc-a", EncoderID: 1})
				case 5:
					p.Fail(id, Failure{Status: 503}) // never stores a new pin
				case 6:
					p.Delete(id)
				case 7:
					if w == 0 {
						clk.Advance(time.Second)
					}
					p.Get(id)
				}
				if n := p.Len(); n > bound {
					t.Errorf("Len %d above the bound %d", n, bound)
					return
				}
			}
		}()
	}
	wg.Wait()
	stop.Store(true)
	<-watched
	if peak.Load() > bound {
		t.Fatalf("the watcher saw Len %d, above the bound %d", peak.Load(), bound)
	}
	checkPinTable(t, p)
	if p.Evictions() == 0 {
		t.Fatal("no evictions: the bound was never reached")
	}
	t.Logf("peak Len %d (bound %d); evictions failed %d, pending %d, encoded %d",
		peak.Load(), bound, p.EvictionsOf(PinFailed), p.EvictionsOf(PinPending), p.EvictionsOf(PinEncoded))
}
