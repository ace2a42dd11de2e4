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

// BenchmarkSendReplayHTTP and BenchmarkSendProxiedHTTP are BenchmarkSendReplay
// and BenchmarkSendProxiedTP2 with a client in front: the gateway listens on
// loopback and one keep-alive fasthttp client posts each /send, so both
// include the client's round trip to the gateway, as a receiver rank sees it.

// benchListeningGateway starts a gateway on loopback in front of one fake
// encoder and returns it with a keep-alive client to it.
func benchListeningGateway(b *testing.B) (*Server, *fasthttp.HostClient) {
	b.Helper()
	enc := fakeencoder.New(fakeencoder.Options{Name: "enc-0", Mode: fakeencoder.ModeMooncake})
	if err := enc.Start("127.0.0.1:0"); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = enc.Close() })
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Encoders = []upstream.EncoderConfig{{Name: "enc-0", URL: enc.URL()}}
	s, err := New(cfg, Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry()})
	if err != nil {
		b.Fatal(err)
	}
	if err := s.Start(); err != nil {
		b.Fatal(err)
	}
	// Its own dialer: fasthttp's default one starts a process-wide goroutine
	// that never ends (and goleak in TestMain would report it).
	hc := &fasthttp.HostClient{Addr: s.Addr(), MaxConns: 1,
		Dial: func(addr string) (net.Conn, error) { return net.Dial("tcp", addr) }}
	b.Cleanup(func() {
		hc.CloseIdleConnections()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.Shutdown(ctx)
	})
	return s, hc
}

// benchDo posts body to path and returns the status; resp keeps the answer.
func benchDo(b *testing.B, hc *fasthttp.HostClient, req *fasthttp.Request, resp *fasthttp.Response, path, body string) int {
	req.Reset()
	req.Header.SetMethod("POST")
	req.SetRequestURI("http://" + hc.Addr + path)
	req.Header.SetContentType("application/json")
	req.SetBodyString(body)
	resp.Reset()
	if err := hc.Do(req, resp); err != nil {
		b.Fatalf("POST %s: %v", path, err)
	}
	return resp.StatusCode()
}

func BenchmarkSendReplayHTTP(b *testing.B) {
	_, hc := benchListeningGateway(b)
	var req fasthttp.Request
	var resp fasthttp.Response
	id := "bench_local_part_0"
	if st := benchDo(b, hc, &req, &resp, "/encode", encodeBody(id)); st != 200 {
		b.Fatalf("/encode: %d %s", st, resp.Body())
	}
	body := tpSend(id, 0, 2)
	if st := benchDo(b, hc, &req, &resp, "/send", body); st != 200 {
		b.Fatalf("first /send: %d %s", st, resp.Body())
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if st := benchDo(b, hc, &req, &resp, "/send", body); st != 200 {
			b.Fatalf("/send: %d %s", st, resp.Body())
		}
	}
	b.StopTimer()
	if string(resp.Header.Peek(headerReplayed)) != "true" || string(resp.Body()) != "null" {
		b.Fatalf("not a replay: %s", resp.String())
	}
}

// BenchmarkSendProxiedTP2 is BenchmarkSendProxied (handler in process) with
// sglang's shape: each req_id is encoded before the timer starts and gets the
// two /sends of a TP=2 receiver (receive_count 2), so no req_id piles up
// thousands of destinations as BenchmarkSendProxied's single req_id does.
func BenchmarkSendProxiedTP2(b *testing.B) {
	s := benchGateway(b)
	ids := make([]string, (b.N+1)/2)
	for j := range ids {
		ids[j] = fmt.Sprintf("%032x_local_part_0", j)
		ctx := handlerCtx("/encode", encodeBody(ids[j]))
		s.handle(ctx)
		if ctx.Response.StatusCode() != 200 {
			b.Fatalf("/encode: %d %s", ctx.Response.StatusCode(), ctx.Response.Body())
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		ctx := handlerCtx("/send", tpSend(ids[i/2], i%2, 2))
		s.handle(ctx)
		if ctx.Response.StatusCode() != 200 || len(ctx.Response.Header.Peek(headerReplayed)) != 0 {
			b.Fatalf("/send: %d %s", ctx.Response.StatusCode(), ctx.Response.Body())
		}
	}
}

// BenchmarkSendProxiedHTTP is BenchmarkSendProxiedTP2 posted by a client.
func BenchmarkSendProxiedHTTP(b *testing.B) {
	_, hc := benchListeningGateway(b)
	var req fasthttp.Request
	var resp fasthttp.Response
	ids := make([]string, (b.N+1)/2)
	for j := range ids {
		ids[j] = fmt.Sprintf("%032x_local_part_0", j)
		if st := benchDo(b, hc, &req, &resp, "/encode", encodeBody(ids[j])); st != 200 {
			b.Fatalf("/encode: %d %s", st, resp.Body())
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if st := benchDo(b, hc, &req, &resp, "/send", tpSend(ids[i/2], i%2, 2)); st != 200 {
			b.Fatalf("/send: %d %s", st, resp.Body())
		}
		if len(resp.Header.Peek(headerReplayed)) != 0 {
			b.Fatalf("/send %d was not forwarded", i)
		}
	}
}
