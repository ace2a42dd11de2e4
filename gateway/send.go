package gateway

import (
	"context"
	"fmt"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/idempotency"
	"github.com/encgate/encgate/internal/sglang"
	"github.com/encgate/encgate/upstream"
)

// headerReplayed marks a /send answer that is another call's answer: one
// replayed from the store, or shared by an identical call in flight. The
// answers the gateway makes itself (a conflict, a wait past the deadline,
// the store down, a destination after release) are this call's own, and
// are not marked.
const headerReplayed = "X-Encgate-Replayed"

// notForwardedMayRetry ends the message of a /send refused before it was
// forwarded: the store could not be reached (503), or an identical /send
// was still in flight at this call's deadline (504). Nothing reached an
// encoder for this call, and a retry is deduplicated as any call is (it gets
// the identical /send's answer, or is forwarded once), so the caller may
// retry it.
const notForwardedMayRetry = "this call forwarded nothing, so the caller may retry it"

// serveSend is the dedupe step of /send: exactly one call per (req_id,
// destination) reaches the encoder; every caller gets that one answer. A
// replay allocates only its key.
//
// Every answer names an encoder it concerns (X-Encgate-Encoder): a
// replayed or shared answer the encoder that gave it (the store keeps its
// name); this call's own exchange the encoder it reached; a conflict, a
// wait or a refusal the encoder holding the req_id. The pin is read only
// for those last answers, after the store decided, so that a /send costs
// the shared pins nothing unless its exchange needs the pin: a replay on a
// replica that does not hold the pin (or dropped it on release) reads no
// pin from Redis.
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
		r := s.exchange(ctx, rt, req.Key.ReqID, false, timeout, resp)
		s.answer(ctx, rt, req.Key.ReqID, r, resp)
		return s.snapshot(ctx, r), r.Delivered
	})
	s.writeSendResult(ctx, req, res)
}

// pinnedEncoder names the encoder holding reqID in X-Encgate-Encoder, for
// an answer that names none itself. local reads this replica's table
// alone: the exchange has read the pin into it, or Redis is known down.
func (s *Server) pinnedEncoder(ctx *fasthttp.RequestCtx, reqID string, local bool) {
	if len(ctx.Response.Header.Peek(headerEncoder)) != 0 {
		return
	}
	if enc := s.pool.PinnedEncoder(reqID, local); enc != "" {
		ctx.Response.Header.Set(headerEncoder, enc)
	}
}

func (s *Server) writeSendResult(ctx *fasthttp.RequestCtx, req idempotency.Send, res idempotency.Result) {
	reqID := req.Key.ReqID
	id := func() *string { c := reqID; return &c } // only error branches pay for it
	switch res.Outcome {
	case idempotency.Forwarded, idempotency.FailedOpen:
		// The caller's own call: its answer is already in the response.
		s.pinnedEncoder(ctx, reqID, true)
		if res.Released {
			s.pool.Unpin(reqID)
		}
		return
	case idempotency.Failed:
		// The gateway's own answer, nothing replayed: a destination past the
		// req_id's bound (400, naming it), or a forward that failed inside
		// the gateway (500).
		writeEnvelope(ctx, res.Status, "encgate: "+res.Err.Error(), id())
		s.pinnedEncoder(ctx, reqID, false)
		return
	case idempotency.Inflight, idempotency.Replayed:
		writeAnswer(ctx, res.Answer)
		ctx.Response.Header.Set(headerReplayed, "true")
		if res.Answer.Encoder == "" { // a record stored before records named it
			s.pinnedEncoder(ctx, reqID, false)
		}
		return
	case idempotency.Released:
		writeEnvelope(ctx, fasthttp.StatusInternalServerError, sglang.AlreadyReleasedMessage(reqID), id())
	case idempotency.Conflict:
		writeEnvelope(ctx, fasthttp.StatusUnprocessableEntity, fmt.Sprintf(
			"encgate: /send for req_id=%s to %s was already made with a different %s", reqID, req.Key.Dest, res.Field), id())
	case idempotency.Unavailable:
		// Nothing was forwarded for this call (the store answers before the
		// encoder is called), and a retry is deduplicated like any call.
		writeEnvelope(ctx, fasthttp.StatusServiceUnavailable,
			"encgate: "+res.Err.Error()+"; "+notForwardedMayRetry, id())
		s.pinnedEncoder(ctx, reqID, true)
		return
	case idempotency.WaitTimeout:
		writeEnvelope(ctx, fasthttp.StatusGatewayTimeout, fmt.Sprintf(
			"encgate: an identical /send for req_id=%s to %s is still in flight past this call's deadline; %s",
			reqID, req.Key.Dest, notForwardedMayRetry), id())
	}
	s.pinnedEncoder(ctx, reqID, false)
}

// snapshot copies the caller's response into an Answer the store and other
// waiters may keep after this request is done, with the encoder that
// answered (the name the exchange set, from the pool's own strings).
func (s *Server) snapshot(ctx *fasthttp.RequestCtx, r upstream.Result) idempotency.Answer {
	return idempotency.Answer{
		Status:      ctx.Response.StatusCode(),
		ContentType: string(ctx.Response.Header.ContentType()),
		Body:        append([]byte(nil), ctx.Response.Body()...),
		Encoder:     r.Verdict.Encoder,
	}
}

// writeAnswer writes a stored or shared answer, naming the encoder that
// gave it.
func writeAnswer(ctx *fasthttp.RequestCtx, a idempotency.Answer) {
	ctx.SetStatusCode(a.Status)
	if a.ContentType != "" {
		ctx.Response.Header.SetContentType(a.ContentType)
	}
	if a.Encoder != "" {
		ctx.Response.Header.Set(headerEncoder, a.Encoder)
	}
	ctx.SetBody(a.Body)
}
