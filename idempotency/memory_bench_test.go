package idempotency

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/encgate/encgate/internal/clock"
)

// BenchmarkMemoryBytesPerRecord fills a store with 1,000,000 /send records
// as sglang makes them (receiver TP ranks send the same req_id to TP
// destinations) and reports the heap in use per record.
func BenchmarkMemoryBytesPerRecord(b *testing.B) {
	for _, tp := range []int{1, 2, 4, 8} {
		b.Run(fmt.Sprintf("tp=%d", tp), func(b *testing.B) {
			const records = 1_000_000
			var perRecord float64
			for i := 0; i < b.N; i++ {
				perRecord = fillAndMeasure(records, tp)
			}
			b.ReportMetric(perRecord, "B/record")
		})
	}
}

func fillAndMeasure(records, tp int) float64 {
	clk := clock.NewFake(t0)
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	m := NewMemory(2*records, 1024, time.Hour, clk) // the bound is per shard: leave headroom
	rec := &Record{Status: 200, ContentType: "application/json", Body: []byte("null")}
	for i := 0; i < records/tp; i++ {
		reqID := fmt.Sprintf("9f1c2d3e4b5a69788796a5b4c3d2e1f0_local_part_%d", i%8)
		reqID = fmt.Sprintf("%s%d", reqID[:32], i) + reqID[32:]
		for r := 0; r < tp; r++ {
			k := NewKey(reqID, fmt.Sprintf("10.1.%d.%d", r, i%250), 40000+r) // as NewSend builds it
			rec.FP = Fingerprint{uint64(i), uint64(r)}
			m.Complete(bg, k, rec, tp)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	runtime.KeepAlive(m)
	if got := m.Records(); got != int64(records/tp*tp) {
		panic(fmt.Sprintf("held %d records", got))
	}
	return float64(after.HeapInuse-before.HeapInuse) / float64(m.Records())
}
