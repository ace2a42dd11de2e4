package gateway

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/redistest"
	"github.com/encgate/encgate/upstream"
)

// BenchmarkFlowRedis runs whole flows (an /encode, its metadata pull, one
// /send per receiver rank) through R gateway replicas (handlers in
// process) on one redis-server on loopback, each call on the next replica
// in turn as a round-robin Service would send it; conc flows at a time
// (conc=1: one call at a time; conc=16: 16 goroutines, so Redis serves
// many connections per event-loop turn, as under load). It reports, per
// flow, the round trips the replicas' clients made (redis-rtt/flow) and
// the CPU the redis-server process spent (redis-cpu-us/flow: used_cpu_user
// + used_cpu_sys from INFO cpu, so the work of every command, its network
// reads and writes, and the delivery of every PUBLISH to each subscribed
// replica), and from that the flows one Redis core carries
// (flows/s-per-core = 10^6 / redis-cpu-us/flow). bench/capacity.sh turns
// these into the capacity model.
func BenchmarkFlowRedis(b *testing.B) {
	for _, conc := range []int{1, 16} {
		for _, tp := range []int{2, 8} {
			for _, replicas := range []int{1, 2, 4} {
				b.Run(fmt.Sprintf("conc=%d/tp=%d/replicas=%d", conc, tp, replicas), func(b *testing.B) { benchFlows(b, conc, tp, replicas) })
			}
		}
	}
}

func benchFlows(b *testing.B, conc, tp, replicas int) {
	rd := redistest.Start(b)
	var urls []upstream.EncoderConfig
	for i := range 2 {
		enc := fakeencoder.New(fakeencoder.Options{Name: fmt.Sprintf("enc-%d", i), Mode: fakeencoder.ModeMooncake})
		if err := enc.Start("127.0.0.1:0"); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = enc.Close() })
		urls = append(urls, upstream.EncoderConfig{Name: fmt.Sprintf("enc-%d", i), URL: enc.URL()})
	}
	ops := make([]*redisOps, replicas)
	gws := make([]*Server, replicas)
	for i := range gws {
		cfg := DefaultConfig()
		cfg.Encoders = urls
		cfg.Health.Disabled = true
		cfg.Idempotency.Store = "redis"
		cfg.Redis.Addr = rd.Addr()
		ops[i] = &redisOps{}
		s, err := New(cfg, Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry(), RedisHook: ops[i]})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() {
			s.pool.Close()
			_ = s.closeStore()
		})
		gws[i] = s
	}
	rc := redis.NewClient(&redis.Options{Addr: rd.Addr()})
	defer rc.Close()
	ctx := context.Background()
	channel := DefaultConfig().Redis.KeyPrefix + "pins:placed"
	for {
		n, err := rc.PubSubNumSub(ctx, channel).Result()
		if err != nil {
			b.Fatal(err)
		}
		if n[channel] == int64(replicas) {
			break
		}
	}
	var next atomic.Int64
	call := func(route, body string) bool {
		ctx := handlerCtx(route, body)
		gws[int(next.Add(1))%replicas].handle(ctx)
		if ctx.Response.StatusCode() != 200 {
			b.Errorf("%s: %d %s", route, ctx.Response.StatusCode(), ctx.Response.Body())
			return false
		}
		return true
	}
	flow := func(id string) {
		if !call(routeEncode, encodeBody(id)) || !call(routeMetadata, metaBody(id)) {
			return
		}
		for rank := range tp {
			if !call(routeSend, tpSend(id, rank, tp)) {
				return
			}
		}
	}
	// Warm: the scripts loaded, and every replica's pool holds the
	// connections conc flows at a time need.
	var wg sync.WaitGroup
	for g := range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 2 * replicas {
				flow(fmt.Sprintf("warm%d-%d_local_part_0", g, i))
			}
		}()
	}
	wg.Wait()
	trips := func() int {
		n := 0
		for _, o := range ops {
			n += o.take().rtts()
		}
		return n
	}
	trips()
	cpu0 := redisCPU(b, rc)
	var ids atomic.Int64
	b.ResetTimer()
	if conc == 1 {
		for i := 0; i < b.N; i++ {
			flow(fmt.Sprintf("%032x_local_part_0", i))
		}
	} else {
		b.SetParallelism((conc + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				flow(fmt.Sprintf("%032x_local_part_0", ids.Add(1)))
			}
		})
	}
	b.StopTimer()
	cpu := redisCPU(b, rc) - cpu0
	n := float64(b.N)
	b.ReportMetric(float64(trips())/n, "redis-rtt/flow")
	b.ReportMetric(cpu*1e6/n, "redis-cpu-us/flow")
	b.ReportMetric(n/cpu, "flows/s-per-core")
}

// redisCPU is the CPU seconds the redis-server process has used (INFO
// cpu: used_cpu_user + used_cpu_sys).
func redisCPU(b *testing.B, rc *redis.Client) float64 {
	info, err := rc.Info(context.Background(), "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	var sum float64
	for _, line := range strings.Split(info, "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (k == "used_cpu_user" || k == "used_cpu_sys") {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				b.Fatalf("INFO cpu: %s: %v", line, err)
			}
			sum += f
		}
	}
	return sum
}
