package gateway

import (
	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/sglang"
)

// contentTypeJSON is the envelope's content type, as the encoder's.
const contentTypeJSON = "application/json"

// writeEnvelope answers with the encoder's error envelope (reqID nil: null).
func writeEnvelope(ctx *fasthttp.RequestCtx, status int, message string, reqID *string) {
	envelopeTo(&ctx.Response, status, message, reqID)
}

// envelopeTo is writeEnvelope into a response of the caller's.
func envelopeTo(out *fasthttp.Response, status int, message string, reqID *string) {
	out.SetStatusCode(status)
	out.Header.SetContentType(contentTypeJSON)
	out.SetBody(sglang.AppendEnvelope(nil, message, reqID))
}
