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
