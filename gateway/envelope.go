package gateway

import (
	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/sglang"
)

// contentTypeJSON is the envelope's content type, as the encoder's.
const contentTypeJSON = "application/json"

// writeEnvelope answers with the encoder's error envelope (reqID nil: null).
func writeEnvelope(ctx *fasthttp.RequestCtx, status int, message string, reqID *string) {
	ctx.SetStatusCode(status)
	ctx.SetContentType(contentTypeJSON)
	ctx.SetBody(sglang.AppendEnvelope(nil, message, reqID))
}
