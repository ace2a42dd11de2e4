package gateway

import "testing"

// BenchmarkFollowUpProxied is the proxy comparison's request through the
// handler: a metadata pull for a pinned req_id, forwarded to a fake encoder
// over loopback and copied back. allocs/op is the gateway's own cost per
// proxied request (the listener's parse and write are fasthttp's).
func BenchmarkFollowUpProxied(b *testing.B) {
	s := benchGateway(b)
	id := "bench_proxy_part_0"
	s.handle(handlerCtx("/encode", encodeBody(id)))
	ctx := handlerCtx("/scheduler_receive_meta_data", `{"req_id":"`+id+`","part_idx":0}`)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		ctx.Response.Reset()
		s.handle(ctx)
	}
	b.StopTimer()
	if ctx.Response.StatusCode() != 200 {
		b.Fatalf("metadata: %d %s", ctx.Response.StatusCode(), ctx.Response.Body())
	}
}
