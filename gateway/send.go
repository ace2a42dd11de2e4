package gateway

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/idempotency"
	"github.com/encgate/encgate/internal/jsonfield"
)

// headerReplayed marks every /send answer that was not this caller's own
// forwarded call: coalesced, replayed, or answered from release state.
const headerReplayed = "X-Encgate-Replayed"

// serveSend is the /send path: exactly one call per (req_id, destination)
// reaches the encoder; every caller gets that one answer. A replay parses
// the body once and allocates only its key.
func (s *Server) serveSend(ctx *fasthttp.RequestCtx, rt *route) {
	req, err := idempotency.ParseSend(ctx.PostBody())
	if err != nil {
		writeEnvelope(ctx, fasthttp.StatusBadRequest, sendParseMessage(err), reqIDOf(ctx.PostBody()))
		return
	}
	if res, ok := s.sends.Replay(context.Background(), req); ok {
		s.writeSendResult(ctx, req, res)
		return
	}
	c := &call{ctx: ctx, route: rt, reqID: req.Key.ReqID}
	deadline := s.clk.Now().Add(s.retry.Load().Send.Deadline.D())
	res := s.sends.Do(context.Background(), req, deadline, func(timeout time.Duration) (idempotency.Answer, bool) {
		delivered := s.followUp(c, timeout)
		return snapshot(ctx), delivered
	})
	s.writeSendResult(ctx, req, res)
}

// reqIDOf returns the body's req_id for an error envelope, or nil.
func reqIDOf(body []byte) *string {
	var raw [1][]byte
	if jsonfield.Lookup(body, reqIDKey, raw[:]) != nil {
		return nil
	}
	if id, ok := jsonfield.String(raw[0]); ok && id != "" {
		return &id
	}
	return nil
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
		writeEnvelope(ctx, fasthttp.StatusInternalServerError,
			fmt.Sprintf("no staged embedding for req_id=%s (already released)", reqID), id())
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

func sendParseMessage(err error) string {
	var syn *jsonfield.SyntaxError
	switch {
	case errors.Is(err, jsonfield.ErrNotObject):
		return "encgate: request body must be a JSON object"
	case errors.As(err, &syn), errors.Is(err, jsonfield.ErrTooDeep):
		return "encgate: request body is not valid JSON: " + err.Error()
	default:
		return err.Error()
	}
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
