package gateway

import (
	"context"
	"fmt"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/idempotency"
	"github.com/encgate/encgate/internal/sglang"
)

// headerReplayed marks every /send answer that was not this caller's own
// forwarded call: coalesced, replayed, or answered from release state.
const headerReplayed = "X-Encgate-Replayed"

// serveSend is the dedupe step of /send: exactly one call per (req_id,
// destination) reaches the encoder; every caller gets that one answer. A
// replay allocates only its key.
func (s *Server) serveSend(ctx *fasthttp.RequestCtx, rt *sglang.Route, body sglang.Send) {
	req := idempotency.NewSend(body)
	if res, ok := s.sends.Replay(context.Background(), req); ok {
		s.writeSendResult(ctx, req, res)
		return
	}
	deadline := s.clk.Now().Add(s.conf().Retry.Send.Deadline.D())
	res := s.sends.Do(context.Background(), req, deadline, func(timeout time.Duration) (idempotency.Answer, bool) {
		resp := fasthttp.AcquireResponse()
		defer fasthttp.ReleaseResponse(resp)
		r := s.exchange(ctx, rt, sglang.Request{ReqID: req.Key.ReqID}, timeout, resp)
		s.answer(ctx, rt, req.Key.ReqID, r, resp)
		return snapshot(ctx), r.Delivered
	})
	s.writeSendResult(ctx, req, res)
}

func (s *Server) writeSendResult(ctx *fasthttp.RequestCtx, req idempotency.Send, res idempotency.Result) {
	reqID := req.Key.ReqID
	id := func() *string { c := reqID; return &c } // only error branches pay for it
	switch res.Outcome {
	case idempotency.Forwarded, idempotency.FailedOpen:
		// The caller's own call: its answer is already in the response.
		if res.Released {
			s.pool.Pins.Delete(reqID)
		}
		return
	case idempotency.Inflight, idempotency.Replayed:
		writeAnswer(ctx, res.Answer)
	case idempotency.Released:
		writeEnvelope(ctx, fasthttp.StatusInternalServerError, sglang.AlreadyReleasedMessage(reqID), id())
	case idempotency.Conflict:
		writeEnvelope(ctx, fasthttp.StatusUnprocessableEntity, fmt.Sprintf(
			"encgate: /send for req_id=%s to %s was already made with a different %s", reqID, req.Key.Dest, res.Field), id())
	case idempotency.Unavailable:
		writeEnvelope(ctx, fasthttp.StatusServiceUnavailable, "encgate: "+res.Err.Error(), id())
	case idempotency.WaitTimeout:
		writeEnvelope(ctx, fasthttp.StatusGatewayTimeout, fmt.Sprintf(
			"encgate: an identical /send for req_id=%s to %s is still in flight past this call's deadline", reqID, req.Key.Dest), id())
	}
	ctx.Response.Header.Set(headerReplayed, "true")
}

// snapshot copies the caller's response into an Answer the store and other
// waiters may keep after this request is done.
func snapshot(ctx *fasthttp.RequestCtx) idempotency.Answer {
	return idempotency.Answer{
		Status:      ctx.Response.StatusCode(),
		ContentType: string(ctx.Response.Header.ContentType()),
		Body:        append([]byte(nil), ctx.Response.Body()...),
	}
}

// writeAnswer writes a stored or shared answer.
func writeAnswer(ctx *fasthttp.RequestCtx, a idempotency.Answer) {
	ctx.SetStatusCode(a.Status)
	if a.ContentType != "" {
		ctx.Response.Header.SetContentType(a.ContentType)
	}
	ctx.SetBody(a.Body)
}
