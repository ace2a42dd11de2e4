package gateway

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/redisclient"
	"github.com/encgate/encgate/internal/redistest"
	"github.com/encgate/encgate/upstream"
)

// benchGateway builds a gateway (not listening: requests go straight to its
// handler) in front of one fake encoder.
func benchGateway(b *testing.B) *Server {
	b.Helper()
	enc := fakeencoder.New(fakeencoder.Options{Name: "enc-0", Mode: fakeencoder.ModeMooncake})
	if err := enc.Start("127.0.0.1:0"); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = enc.Close() })
	cfg := DefaultConfig()
	cfg.Encoders = []upstream.EncoderConfig{{Name: "enc-0", URL: enc.URL()}}
	s, err := New(cfg, Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry()})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s.pool.Close()
		_ = s.store.Close()
		_ = ctx
	})
	return s
}

func handlerCtx(path, body string) *fasthttp.RequestCtx {
	var req fasthttp.Request
	req.Header.SetMethod("POST")
	req.SetRequestURI(path)
	req.Header.SetContentType("application/json")
	req.SetBodyString(body)
	ctx := &fasthttp.RequestCtx{}
	ctx.Init(&req, &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 40000}, nil)
	return ctx
}

// BenchmarkSendReplay is a duplicate /send answered from the memory store:
// parse, look up, write the stored answer with X-Encgate-Replayed.
func BenchmarkSendReplay(b *testing.B) {
	s := benchGateway(b)
	id := "bench_local_part_0"
	s.handle(handlerCtx("/encode", encodeBody(id)))
	ctx := handlerCtx("/send", tpSend(id, 0, 2))
	s.handle(ctx)
	if ctx.Response.StatusCode() != 200 {
		b.Fatalf("first /send: %d %s", ctx.Response.StatusCode(), ctx.Response.Body())
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		ctx.Response.Reset()
		s.handle(ctx)
	}
	b.StopTimer()
	if string(ctx.Response.Header.Peek(headerReplayed)) != "true" || string(ctx.Response.Body()) != "null" {
		b.Fatalf("not a replay: %s", ctx.Response.String())
	}
}

// BenchmarkSendProxied is a first /send: parsed, claimed, forwarded to the
// encoder over loopback, stored. Every iteration uses a new destination;
// each req_id takes 1,000 of them (below idempotency.max_destinations_per_req_id),
// then the next req_id is encoded, untimed.
func BenchmarkSendProxied(b *testing.B) {
	s := benchGateway(b)
	const perReqID = 1000
	id := ""
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if i%perReqID == 0 {
			b.StopTimer()
			id = fmt.Sprintf("bench%d_local_part_0", i/perReqID)
			s.handle(handlerCtx("/encode", encodeBody(id)))
			b.StartTimer()
		}
		body := fmt.Sprintf(`{"req_id":%q,"part_idx":0,"prefill_host":"10.0.0.1","embedding_port":%d,"session_id":"10.0.0.1:17000","buffer_address":%d}`,
			id, 1+i%perReqID, i)
		ctx := handlerCtx("/send", body)
		s.handle(ctx)
		if ctx.Response.StatusCode() != 200 {
			b.Fatalf("/send: %d %s", ctx.Response.StatusCode(), ctx.Response.Body())
		}
	}
}

// The /send store's cost on the request path: BenchmarkSendFirstTime and
// BenchmarkSendReplayed run the same calls as BenchmarkSendProxiedTP2 and
// BenchmarkSendReplay (handler in process, one fake encoder over loopback)
// with each store side by side, memory and redis (a redis-server on
// loopback, started for the benchmark). Each reports redis-rtt/op, the
// round trips the gateway's Redis client made per /send (a redis.Hook:
// commands and pipelines), so the figures say what they paid for.
// bench/capacity.sh prints their ratios.

// benchStores are the stores the store benchmarks compare.
var benchStores = []string{"memory", "redis"}

// benchStoreGateway is benchGateway with the given /send store; for redis,
// its client counts round trips in ops.
func benchStoreGateway(b *testing.B, store string, ops *redisOps) *Server {
	b.Helper()
	enc := fakeencoder.New(fakeencoder.Options{Name: "enc-0", Mode: fakeencoder.ModeMooncake})
	if err := enc.Start("127.0.0.1:0"); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = enc.Close() })
	cfg := DefaultConfig()
	cfg.Encoders = []upstream.EncoderConfig{{Name: "enc-0", URL: enc.URL()}}
	cfg.Health.Disabled = true
	cfg.Idempotency.Store = store
	if store == "redis" {
		cfg.Redis.Addr = redistest.Start(b).Addr()
	}
	s, err := New(cfg, Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry(), RedisHook: ops})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		s.pool.Close()
		_ = s.closeStore()
	})
	return s
}

// reportTrips reports the round trips per op since ops was last taken.
func reportTrips(b *testing.B, ops *redisOps) {
	b.ReportMetric(float64(ops.take().rtts())/float64(b.N), "redis-rtt/op")
}

// BenchmarkSendFirstTime is a first /send (claimed, forwarded to the fake
// encoder, its answer stored), two per req_id (TP=2); the req_ids are
// encoded before the timer starts.
func BenchmarkSendFirstTime(b *testing.B) {
	for _, store := range benchStores {
		b.Run(store, func(b *testing.B) {
			ops := &redisOps{}
			s := benchStoreGateway(b, store, ops)
			// One /send first, untimed: Redis gets the scripts (EVALSHA
			// answered NOSCRIPT, then EVAL) and the pool its connection.
			warm := "warm_local_part_0"
			s.handle(handlerCtx("/encode", encodeBody(warm)))
			s.handle(handlerCtx("/send", tpSend(warm, 0, 1)))
			ids := make([]string, (b.N+1)/2)
			for j := range ids {
				ids[j] = fmt.Sprintf("%032x_local_part_0", j)
				ctx := handlerCtx("/encode", encodeBody(ids[j]))
				s.handle(ctx)
				if ctx.Response.StatusCode() != 200 {
					b.Fatalf("/encode: %d %s", ctx.Response.StatusCode(), ctx.Response.Body())
				}
			}
			ops.take()
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				ctx := handlerCtx("/send", tpSend(ids[i/2], i%2, 2))
				s.handle(ctx)
				if ctx.Response.StatusCode() != 200 || len(ctx.Response.Header.Peek(headerReplayed)) != 0 {
					b.Fatalf("/send: %d %s", ctx.Response.StatusCode(), ctx.Response.Body())
				}
			}
			b.StopTimer()
			reportTrips(b, ops)
		})
	}
}

// BenchmarkSendReplayed is a duplicate /send answered from the store.
func BenchmarkSendReplayed(b *testing.B) {
	for _, store := range benchStores {
		b.Run(store, func(b *testing.B) {
			ops := &redisOps{}
			s := benchStoreGateway(b, store, ops)
			id := "bench_local_part_0"
			s.handle(handlerCtx("/encode", encodeBody(id)))
			ctx := handlerCtx("/send", tpSend(id, 0, 2))
			s.handle(ctx)
			if ctx.Response.StatusCode() != 200 {
				b.Fatalf("first /send: %d %s", ctx.Response.StatusCode(), ctx.Response.Body())
			}
			ops.take()
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				ctx.Response.Reset()
				s.handle(ctx)
			}
			b.StopTimer()
			reportTrips(b, ops)
			if string(ctx.Response.Header.Peek(headerReplayed)) != "true" || string(ctx.Response.Body()) != "null" {
				b.Fatalf("not a replay: %s", ctx.Response.String())
			}
		})
	}
}

// BenchmarkRedisPing is one PING through a client built as the gateway's
// (redisclient, defaults) to a redis-server on loopback: the round trip
// that the redis store's figures above pay per redis-rtt/op, for scale.
func BenchmarkRedisPing(b *testing.B) {
	cfg := redisclient.Default()
	cfg.Addr = redistest.Start(b).Addr()
	c, err := redisclient.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	if err := c.Ping(ctx).Err(); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := c.Ping(ctx).Err(); err != nil {
			b.Fatal(err)
		}
	}
}
