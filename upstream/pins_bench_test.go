package upstream

import (
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/encgate/encgate/internal/clock"
)

// benchIDs returns n distinct req_ids shaped like sglang's.
func benchIDs(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = "bench-" + strconv.Itoa(i) + "_local_part_0"
	}
	return ids
}

// BenchmarkPinFlow is one part's life in the table below the bound, as the
// request path drives it: the /encode places its pin and marks it
// encoded, two follow-ups read it, the last /send forgets it. The table
// holds 10,000 other live pins meanwhile.
func BenchmarkPinFlow(b *testing.B) {
	t := NewPinTable(240*time.Second, 1_000_000, clock.Real{})
	for _, id := range benchIDs(10_000) {
		t.Set("held-"+id, "enc-a", 1)
	}
	ids := benchIDs(4096)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		id := ids[i&4095]
		t.Place(id, "enc-a", 1)
		t.Encoded(id, 1)
		t.Get(id)
		t.Get(id)
		t.Delete(id)
	}
}

// BenchmarkPinFlowParallel is BenchmarkPinFlow on every core at once, each
// goroutine with req_ids of its own: the shards' locks and the table's
// shared count under contention.
func BenchmarkPinFlowParallel(b *testing.B) {
	t := NewPinTable(240*time.Second, 1_000_000, clock.Real{})
	for _, id := range benchIDs(10_000) {
		t.Set("held-"+id, "enc-a", 1)
	}
	var next atomic.Int64
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		g := strconv.FormatInt(next.Add(1), 10)
		ids := benchIDs(1024)
		for i := range ids {
			ids[i] = g + "-" + ids[i]
		}
		for i := 0; pb.Next(); i++ {
			id := ids[i&1023]
			t.Place(id, "enc-a", 1)
			t.Encoded(id, 1)
			t.Get(id)
			t.Get(id)
			t.Delete(id)
		}
	})
}

// BenchmarkPinGet is a follow-up's read of a live pin.
func BenchmarkPinGet(b *testing.B) {
	t := NewPinTable(240*time.Second, 1_000_000, clock.Real{})
	ids := benchIDs(4096)
	for _, id := range ids {
		t.Set(id, "enc-a", 1)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t.Get(ids[i&4095])
	}
}

// BenchmarkPinAtBound places a new req_id into a full table of 4,096 live
// pins on every iteration: each placement evicts one.
func BenchmarkPinAtBound(b *testing.B) {
	const max = 4096
	t := NewPinTable(240*time.Second, max, clock.Real{})
	ids := benchIDs(1 << 16)
	for _, id := range ids[:2*max] {
		t.Set(id, "enc-a", 1)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t.Place(ids[i&(1<<16-1)], "enc-a", 1)
	}
}
