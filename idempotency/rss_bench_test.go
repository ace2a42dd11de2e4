package idempotency

import (
	"context"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/sglang"
)

// BenchmarkMemoryRSS fills a memory store the way the gateway's /send path
// does (sglang.ParseSend on a realistic body, then Sends.Do with a forward that
// answers 200 null as the encoder does) and reports the resident bytes
// (RSS from /proc/self/statm) and the heap in use per record, each measured
// after runtime.GC and debug.FreeOSMemory, before and after the fill.
//
// Keys are sglang's: a 32-hex rid + "_local_part_N" (4 parts per rid), a
// destination "10.a.b.c:4xxxx" per receiver TP rank (same host, one port per
// rank), receive_count = TP. The store's capacity is the default (10^6)
// or 2x the records when larger, since the bound is per shard (capacity/64)
// and a full store evicts; the evictions are reported and should be 0.
//
// RSS is per process, so run one sub-benchmark per process for clean
// numbers (bench/memory.sh does), e.g.
//
//	go test -run '^$' -bench 'MemoryRSS/tp=2/records=1000000$' -benchtime 1x ./idempotency
func BenchmarkMemoryRSS(b *testing.B) {
	for _, tp := range []int{1, 2} {
		for _, records := range []int{100_000, 1_000_000} {
			b.Run(fmt.Sprintf("tp=%d/records=%d", tp, records), func(b *testing.B) {
				var r rssResult
				for i := 0; i < b.N; i++ {
					r = fillRSS(b, records, tp)
				}
				b.ReportMetric(r.rss, "rss-B/record")
				b.ReportMetric(r.heap, "heap-B/record")
				b.ReportMetric(float64(r.evictions), "evictions")
			})
		}
	}
}

type rssResult struct {
	rss, heap float64
	evictions int64
}

// residentBytes is the process's RSS after a full collection with every
// free page given back to the OS.
func residentBytes(b *testing.B) (rss, heapInuse uint64) {
	runtime.GC()
	debug.FreeOSMemory()
	statm, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		b.Skipf("no /proc/self/statm: %v", err)
	}
	f := strings.Fields(string(statm))
	if len(f) < 2 {
		b.Fatalf("/proc/self/statm: %q", statm)
	}
	pages, err := strconv.ParseUint(f[1], 10, 64)
	if err != nil {
		b.Fatal(err)
	}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return pages * uint64(os.Getpagesize()), ms.HeapInuse
}

func fillRSS(b *testing.B, records, tp int) rssResult {
	b.StopTimer()
	ctx := context.Background()
	body := make([]byte, 0, 512)
	rng := rand.New(rand.NewPCG(1, uint64(records*tp)))
	var rid [16]byte
	ridHex := make([]byte, 32)
	forward := func(time.Duration) (Answer, bool) {
		// As the gateway's snapshot: a fresh copy of the encoder's answer.
		return Answer{Status: 200, ContentType: "application/json", Body: append([]byte(nil), "null"...)}, true
	}

	rssBefore, heapBefore := residentBytes(b)
	b.StartTimer()
	clk := clock.NewFake(t0)
	cfg := DefaultConfig()
	capacity := max(cfg.Capacity, 2*records)
	m := NewMemory(capacity, cfg.MaxDestinationsPerReqID, cfg.TTL.D(), clk)
	sends := NewSends(m, cfg, clk, zap.NewNop(), NewMetrics(prometheus.NewRegistry(), m))
	deadline := clk.Now().Add(time.Minute)
	for i := 0; i < records/tp; i++ {
		part := i % 4
		if part == 0 {
			for j := range rid {
				rid[j] = byte(rng.Uint32())
			}
			hex.Encode(ridHex, rid[:])
		}
		host := fmt.Sprintf("10.%d.%d.%d", rid[0], rid[1], rid[2]|1)
		port := 40000 + int(rid[3])*8
		for r := 0; r < tp; r++ {
			body = body[:0]
			body = fmt.Appendf(body, `{"req_id":"%s_local_part_%d","part_idx":%d,"embedding_size":0,"embedding_len":0,"embedding_dim":0,`+
				`"prefill_host":%q,"embedding_port":%d,"session_id":"%s:%d","buffer_address":%d,"receive_count":%d}`,
				ridHex, part, part, host, port+r, host, 17000+r, 140000000000000+uint64(i)*1<<20, tp)
			parsed, err := sglang.ParseSend(body, sglang.Limits{})
			if err != nil {
				b.Fatalf("%s: %v", body, err)
			}
			if res := sends.Do(ctx, NewSend(parsed), deadline, forward); res.Outcome != Forwarded {
				b.Fatalf("%s: outcome %d", body, res.Outcome)
			}
		}
	}
	b.StopTimer()
	rssAfter, heapAfter := residentBytes(b)
	held := m.Records()
	runtime.KeepAlive(sends)
	runtime.KeepAlive(m)
	if want := int64(records / tp * tp); held+m.Evictions() != want {
		b.Fatalf("held %d records and evicted %d, want %d in all", held, m.Evictions(), want)
	}
	return rssResult{
		rss:       (float64(rssAfter) - float64(rssBefore)) / float64(held),
		heap:      (float64(heapAfter) - float64(heapBefore)) / float64(held),
		evictions: m.Evictions(),
	}
}
