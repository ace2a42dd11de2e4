package gateway

import (
	"context"
	"fmt"
	"strconv"
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

// serveSend is /send after its parse: dedupe decides the call (replay a
// stored answer, join an identical call in flight, forward it, or refuse
// it); a forwarded call runs its exchange, whose result is what the store
// records and what every caller of the key is given; one writer writes the
// answer. Exactly one call per (req_id, destination) reaches the encoder. A
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
	var own sendExchange // this call's exchange, when dedupe forwards it
	res, ok := s.sends.Replay(context.Background(), req)
	if !ok {
		deadline := s.clk.Now().Add(s.conf().Retry.Send.Deadline.D())
		res = s.sends.Do(context.Background(), req, deadline, func(timeout time.Duration) (idempotency.Answer, bool) {
			own = s.exchangeSend(ctx, rt, req.Key.ReqID, timeout)
			return own.answer, own.delivered
		})
	}
	s.writeSendResult(ctx, req, res, &own)
}

// sendExchange is a forwarded /send's exchange: the answer the caller gets
// and the store keeps, and what only this caller's response carries.
type sendExchange struct {
	answer     idempotency.Answer
	delivered  bool   // it reached the encoder: the store keeps it
	retryAfter []byte // the encoder's Retry-After, if any
	attempts   int
}

// exchangeSend runs a /send's exchange and makes its result an answer: the
// encoder's (status, content type, body, copied once out of the pooled
// response) or the gateway's own envelope for the verdict.
func (s *Server) exchangeSend(ctx *fasthttp.RequestCtx, rt *sglang.Route, reqID string, timeout time.Duration) sendExchange {
	resp := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseResponse(resp)
	r := s.exchange(ctx, rt, reqID, false, timeout, resp)
	v := &r.Verdict
	ex := sendExchange{delivered: r.Delivered, attempts: r.Attempts}
	if v.Kind == upstream.KindAnswered {
		ex.answer = idempotency.Answer{Status: resp.StatusCode(), ContentType: string(resp.Header.ContentType()),
			Body: append([]byte(nil), resp.Body()...), Encoder: v.Encoder}
		if ra := resp.Header.Peek(fasthttp.HeaderRetryAfter); len(ra) > 0 {
			ex.retryAfter = append([]byte(nil), ra...)
		}
		return ex
	}
	s.noteOwnAnswer(rt, reqID, v)
	ex.answer = idempotency.Answer{Status: v.Status, ContentType: contentTypeJSON,
		Body: sglang.AppendEnvelope(nil, v.Message, &reqID), Encoder: v.Encoder}
	return ex
}

// writeSendResult is the one writer of a /send's answer, whatever dedupe
// decided: this call's own exchange (own), another call's answer (replayed
// or shared), or the gateway's envelope for a refusal.
func (s *Server) writeSendResult(ctx *fasthttp.RequestCtx, req idempotency.Send, res idempotency.Result, own *sendExchange) {
	reqID := req.Key.ReqID
	id := func() *string { c := reqID; return &c } // only error branches pay for it
	switch res.Outcome {
	case idempotency.Forwarded, idempotency.FailedOpen:
		// The caller's own call.
		writeAnswer(ctx, res.Answer)
		if len(own.retryAfter) > 0 {
			ctx.Response.Header.SetBytesV(fasthttp.HeaderRetryAfter, own.retryAfter)
		}
		if own.attempts > 0 {
			ctx.Response.Header.Set(headerAttempts, strconv.Itoa(own.attempts))
		}
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
	ctx.Response.SetBodyRaw(a.Body) // the answer is never written to again: no copy
}
