package gateway

import (
	"bytes"
	"sort"
	"strconv"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/encgate/encgate/internal/admin"
	"github.com/encgate/encgate/internal/loopguard"
	"github.com/encgate/encgate/internal/sglang"
	"github.com/encgate/encgate/upstream"
)

// Headers on answers that went upstream.
const (
	// headerEncoder names the encoder that holds the req_id.
	headerEncoder = "X-Encgate-Encoder"
	// headerAttempts is how many exchanges with encoders the answer took.
	headerAttempts = "X-Encgate-Attempts"
)

// handle is the fasthttp handler for the encoder-facing listener.
func (s *Server) handle(ctx *fasthttp.RequestCtx) {
	start := s.clk.Now()
	rt := sglang.Lookup(sglang.StripFanout(ctx.Path()))
	s.serve(ctx, rt, start)
	if !ctx.Hijacked() { // a parked exchange is counted when it is answered (park.go)
		s.metrics.observe(rt, ctx.Response.StatusCode(), s.clk.Now().Sub(start))
	}
}

// serve is the request path: route → loop check → parse → dedupe → exchange
// → envelope. start is when handle read the clock for the request: the
// exchange counts its deadline from it instead of reading the clock again.
func (s *Server) serve(ctx *fasthttp.RequestCtx, rt *sglang.Route, start time.Time) {
	// Route.
	if rt == sglang.RouteUnknown {
		writeEnvelope(ctx, fasthttp.StatusNotFound, "encgate: no route "+string(ctx.Method())+" "+string(ctx.Path()), nil)
		return
	}
	if !(ctx.IsGet() && rt.GET || ctx.IsPost() && rt.POST || ctx.IsHead() && rt.GET) {
		ctx.Response.Header.Set("Allow", rt.Allow())
		writeEnvelope(ctx, fasthttp.StatusMethodNotAllowed, "encgate: method "+string(ctx.Method())+" not allowed on "+rt.Path, nil)
		return
	}
	// Loop: a request that has been through this gateway already (or
	// through more proxies than self_guard.max_hops) is never forwarded.
	if rt.Kind != sglang.KindHealth && s.looped(ctx, rt) {
		return
	}
	switch rt.Kind {
	case sglang.KindHealth:
		s.serveHealth(ctx)
		return
	case sglang.KindBroadcast:
		s.serveBroadcast(ctx, rt)
		return
	}
	// Parse: what the encoder would index is checked before anything is
	// forwarded.
	req, ferr := rt.Parse(ctx.PostBody(), sglang.Limits{MaxFieldBytes: int(s.conf().Limits.MaxFieldBytes)})
	if ferr != nil {
		s.refuse(ctx, ferr)
		return
	}
	// Dedupe: /send goes through the idempotency store, which exchanges.
	if rt.Kind == sglang.KindSend {
		s.serveSend(ctx, rt, req.Send)
		return
	}
	// Exchange, then the envelope; a long poll may park (park.go).
	if s.parkable(ctx, rt) {
		s.exchangeParkable(ctx, rt, &req, start)
		return
	}
	resp := fasthttp.AcquireResponse()
	res := s.exchangePlaced(ctx, rt, req.ReqID, req.Rank, req.MMItems, 0, start, resp)
	s.answer(ctx, rt, req.ReqID, res, resp)
	fasthttp.ReleaseResponse(resp)
}

// refuse answers a body the encoder must not see with 400. Nothing of it
// is remembered, not even for an /encode: nothing reached an encoder, and
// a refusal a client can repeat at any rate must never take or evict a
// pin (affinity.max_pins). The part's follow-ups find no pin for it.
func (s *Server) refuse(ctx *fasthttp.RequestCtx, ferr *sglang.FieldError) {
	var id *string
	if ferr.ReqID != "" {
		id = &ferr.ReqID
	}
	writeEnvelope(ctx, fasthttp.StatusBadRequest, ferr.Message, id)
}

// exchange runs the call's attempts with the encoders (upstream.Exchange):
// resp receives the encoder's last answer.
func (s *Server) exchange(ctx *fasthttp.RequestCtx, rt *sglang.Route, reqID string, rank bool, limit time.Duration, resp *fasthttp.Response) upstream.Result {
	return s.exchangePlaced(ctx, rt, reqID, rank, nil, limit, time.Time{}, resp)
}

// exchangePlaced is exchange with an /encode's mm_items (a view of the
// body; nil for other routes) as its placement key: the pool places by it
// when affinity.encode_by is content, and by req_id otherwise. start is
// the request's clock read (zero: the exchange reads the clock).
func (s *Server) exchangePlaced(ctx *fasthttp.RequestCtx, rt *sglang.Route, reqID string, rank bool, mmItems []byte, limit time.Duration, start time.Time, resp *fasthttp.Response) upstream.Result {
	return s.pool.Exchange(&upstream.Call{
		Route: rt, ReqID: reqID, Rank: rank,
		Method: ctx.Method(), ContentType: ctx.Request.Header.ContentType(), Body: ctx.PostBody(),
		PlaceKey: mmItems, Limit: limit, Start: start, Done: ctx.Done(), Resp: resp, Via: s.loop.Via(&ctx.Request.Header),
	})
}

// answer writes a call's result: the encoder's answer as it came (status,
// content type or none, Retry-After, body bytes), or the gateway's own
// envelope with the verdict's status and message.
func (s *Server) answer(ctx *fasthttp.RequestCtx, rt *sglang.Route, reqID string, res upstream.Result, resp *fasthttp.Response) {
	s.answerTo(&ctx.Response, rt, reqID, res, resp)
}

// answerTo is answer into out: a request's own response, or a parked
// exchange's (park.go).
func (s *Server) answerTo(out *fasthttp.Response, rt *sglang.Route, reqID string, res upstream.Result, resp *fasthttp.Response) {
	v := &res.Verdict
	if v.Kind == upstream.KindAnswered {
		out.SetStatusCode(resp.StatusCode())
		if ct := resp.Header.ContentType(); len(ct) > 0 {
			out.Header.SetContentTypeBytes(ct)
		}
		if ra := resp.Header.Peek(fasthttp.HeaderRetryAfter); len(ra) > 0 {
			out.Header.SetBytesV(fasthttp.HeaderRetryAfter, ra)
		}
		resp.SwapBody(out.SwapBody(resp.Body()))
	} else {
		s.noteOwnAnswer(rt, reqID, v)
		envelopeTo(out, v.Status, v.Message, &reqID)
	}
	if v.Encoder != "" {
		out.Header.Set(headerEncoder, v.Encoder)
	}
	if res.Attempts > 0 {
		out.Header.Set(headerAttempts, strconv.Itoa(res.Attempts))
	}
}

// noteOwnAnswer logs and keeps (the status page's recent answers) a
// verdict the gateway answers itself instead of an encoder. A remembered
// failure is the encoder's answer again: logged when it was first given,
// not for each follow-up. The line is sampled (s.quiet): a client can make
// the gateway answer itself at any rate, and encgate_requests_total counts
// every answer.
func (s *Server) noteOwnAnswer(rt *sglang.Route, reqID string, v *upstream.Verdict) {
	if ce := s.quiet.Check(zapcore.WarnLevel, "request answered by the gateway"); ce != nil && v.Kind != upstream.KindRemembered {
		ce.Write(zap.String("route", rt.Path), zap.String("req_id", reqID), zap.String("encoder", v.Encoder),
			zap.Int("status", v.Status), zap.Stringer("kind", v.Kind), zap.String("message", v.Message))
	}
	s.recent.Add(admin.Failure{At: s.clk.Now(), Route: rt.Path, ReqID: reqID, Encoder: v.Encoder,
		Status: v.Status, Kind: v.Kind.String(), Message: v.Message})
}

// serveHealth answers /health and /health_generate for the fleet: 200 while
// at least one encoder is usable, else 503; empty body, as the encoder.
func (s *Server) serveHealth(ctx *fasthttp.RequestCtx) {
	if s.pool.AnyUsable() {
		ctx.SetStatusCode(fasthttp.StatusOK)
		return
	}
	ctx.SetStatusCode(fasthttp.StatusServiceUnavailable)
}

// serveBroadcast sends a profile request to every encoder and joins the
// answers like sglang's DP mode: one line per encoder, status 200 when all
// succeeded, else the highest error status.
func (s *Server) serveBroadcast(ctx *fasthttp.RequestCtx, rt *sglang.Route) {
	answers := s.pool.Broadcast(&upstream.Call{Route: rt, Method: ctx.Method(),
		ContentType: ctx.Request.Header.ContentType(), Body: ctx.PostBody(), Via: s.loop.Via(&ctx.Request.Header)},
		s.conf().Upstream.Timeout.D())
	sort.SliceStable(answers, func(i, j int) bool { return answers[i].Encoder < answers[j].Encoder })
	status := fasthttp.StatusOK
	var body bytes.Buffer
	for i, a := range answers {
		if a.Status != fasthttp.StatusOK && (status == fasthttp.StatusOK || a.Status > status) {
			status = a.Status
		}
		if i > 0 {
			body.WriteByte('\n')
		}
		body.WriteString(a.Encoder + ": " + a.Text)
	}
	body.WriteByte('\n')
	ctx.SetStatusCode(status)
	ctx.SetContentType("text/plain; charset=utf-8")
	ctx.SetBody(body.Bytes())
}

// looped answers 508 and reports true when the request has looped back to
// this gateway or passed more than self_guard.max_hops proxies; such a
// request is never forwarded. rt is a route that forwards.
func (s *Server) looped(ctx *fasthttp.RequestCtx, rt *sglang.Route) bool {
	hops, own := s.loop.Read(&ctx.Request.Header)
	max := s.conf().SelfGuard.MaxHops
	if !own && hops <= max {
		return false
	}
	reason, msg := loopguard.OwnMark, "encgate: loop detected: this request has passed through this gateway ("+
		s.loop.Mark()+") already, so an encoder in its path leads back to it; nothing was forwarded"
	if !own {
		reason, msg = loopguard.MaxHops, "encgate: loop detected: this request has passed "+strconv.Itoa(hops)+
			" proxies (its Via), more than self_guard.max_hops ("+strconv.Itoa(max)+"); nothing was forwarded"
	}
	s.loop.Detected(reason)
	// Sampled: whoever reaches the listener can send such requests.
	if ce := s.quiet.Check(zapcore.WarnLevel, "request refused: loop detected"); ce != nil {
		ce.Write(zap.String("route", rt.Path), zap.String("reason", reason), zap.Int("hops", hops),
			zap.Int("max_hops", max), zap.Stringer("remote", ctx.RemoteAddr()))
	}
	writeEnvelope(ctx, fasthttp.StatusLoopDetected, msg, nil)
	return true
}
