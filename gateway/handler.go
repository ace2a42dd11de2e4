package gateway

import (
	"bytes"
	"errors"
	"sort"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/encgate/encgate/internal/jsonfield"
	"github.com/encgate/encgate/upstream"
)

// call is one caller request on its way through the gateway. Later steps
// (dedupe, retries, breakers) read and extend it rather than re-parsing.
type call struct {
	ctx   *fasthttp.RequestCtx
	route *route
	reqID string
	enc   *upstream.Encoder // chosen encoder, nil until routed
}

// handle is the fasthttp handler for the encoder-facing listener.
func (s *Server) handle(ctx *fasthttp.RequestCtx) {
	start := s.clk.Now()
	rt := lookupRoute(ctx.Path())
	s.serve(ctx, rt)
	s.metrics.observe(rt, ctx.Response.StatusCode(), s.clk.Now().Sub(start))
}

func (s *Server) serve(ctx *fasthttp.RequestCtx, rt *route) {
	if rt == unknownRoute {
		writeEnvelope(ctx, fasthttp.StatusNotFound, "encgate: no route "+string(ctx.Method())+" "+string(ctx.Path()), nil)
		return
	}
	if !(ctx.IsGet() && rt.get || ctx.IsPost() && rt.post || ctx.IsHead() && rt.get) {
		ctx.Response.Header.Set("Allow", allowHeader(rt))
		writeEnvelope(ctx, fasthttp.StatusMethodNotAllowed, "encgate: method "+string(ctx.Method())+" not allowed on "+rt.path, nil)
		return
	}
	switch rt.kind {
	case kindHealth:
		s.serveHealth(ctx)
	case kindBroadcast:
		s.serveBroadcast(ctx, rt)
	case kindSend:
		s.serveSend(ctx, rt)
	default:
		c, err := s.newCall(ctx, rt)
		if err != nil {
			writeEnvelope(ctx, statusFor(err), messageFor(err, nil), nil)
			return
		}
		if rt.kind == kindEncode {
			s.serveEncode(c)
		} else {
			s.serveFollowUp(c)
		}
	}
}

func allowHeader(rt *route) string {
	switch {
	case rt.get && rt.post:
		return "GET, HEAD, POST"
	case rt.get:
		return "GET, HEAD"
	default:
		return "POST"
	}
}

var reqIDKey = []string{"req_id"}

// newCall reads the req_id from the body without copying or decoding it.
func (s *Server) newCall(ctx *fasthttp.RequestCtx, rt *route) (*call, error) {
	var raw [1][]byte
	if err := jsonfield.Lookup(ctx.PostBody(), reqIDKey, raw[:]); err != nil {
		if errors.Is(err, jsonfield.ErrNotObject) {
			return nil, &requestError{"encgate: request body must be a JSON object"}
		}
		return nil, &requestError{"encgate: request body is not valid JSON: " + err.Error()}
	}
	reqID, ok := jsonfield.String(raw[0])
	if !ok || reqID == "" {
		return nil, &requestError{"missing or invalid req_id"}
	}
	return &call{ctx: ctx, route: rt, reqID: reqID}, nil
}

// serveEncode routes /encode to the req_id's rendezvous owner and pins it.
// A retry (only where nothing was delivered, or the encoder refused before
// dispatch) goes to the next encoder in rendezvous order and re-pins. A
// final non-200 is remembered so that follow-ups fail fast.
func (s *Server) serveEncode(c *call) {
	var buf [16]*upstream.Encoder
	if ranked := s.pool.Ranked(c.reqID, buf[:0]); len(ranked) == 0 {
		s.failCall(c, upstream.ErrNoEncoder)
	} else {
		s.attempt(c, func(n int) *upstream.Encoder {
			if n > len(ranked) {
				return nil
			}
			s.pool.Pins.Set(c.reqID, ranked[n-1].Name, ranked[n-1].ID())
			return ranked[n-1]
		}, 0)
	}
	if code := c.ctx.Response.StatusCode(); code != fasthttp.StatusOK {
		s.pool.Pins.Fail(c.reqID, code, upstreamMessage(c.ctx.Response.Body()))
	}
}

// serveFollowUp sends a follow-up to the encoder that holds the req_id.
func (s *Server) serveFollowUp(c *call) {
	s.followUp(c, 0)
}

// followUp routes c to its encoder and runs its attempts there (the
// req_id's state lives on that encoder), within limit when positive. It
// reports whether the request may have reached the encoder: false when the
// gateway answered itself (remembered failure, no usable encoder, connect
// failure).
func (s *Server) followUp(c *call, limit time.Duration) (delivered bool) {
	enc, pin, err := s.pool.Route(c.reqID, c.ctx.Done())
	if err != nil {
		s.failCall(c, err)
		return false
	}
	if pin.Failed {
		s.answerFailedPin(c, pin)
		return false
	}
	var failed upstream.Pin
	delivered = s.attempt(c, func(n int) *upstream.Encoder {
		// Between attempts, the part's /encode may have failed: then the
		// remembered failure is the answer, not another pull.
		if p, ok := s.pool.Pins.Get(c.reqID); n > 1 && ok && p.Failed {
			failed = p
			return nil
		}
		return enc
	}, limit)
	if failed.Failed {
		s.answerFailedPin(c, failed)
	}
	return delivered
}

// answerFailedPin answers a follow-up with its /encode's remembered failure.
func (s *Server) answerFailedPin(c *call, pin upstream.Pin) {
	c.ctx.Response.Header.Set("X-Encgate-Encoder", pin.Encoder)
	writeEnvelope(c.ctx, pin.Status, pin.Message, &c.reqID)
}

// failCall answers with the gateway's own envelope for err.
func (s *Server) failCall(c *call, err error) {
	status, msg := statusFor(err), messageFor(err, c.enc)
	if c.enc != nil {
		c.ctx.Response.Header.Set("X-Encgate-Encoder", c.enc.Name)
	}
	if ce := s.log.Check(zapcore.WarnLevel, "request failed in the gateway"); ce != nil {
		name := ""
		if c.enc != nil {
			name = c.enc.Name
		}
		ce.Write(zap.String("route", c.route.path), zap.String("req_id", c.reqID),
			zap.String("encoder", name), zap.Int("status", status), zap.Error(err))
	}
	writeEnvelope(c.ctx, status, msg, &c.reqID)
}

// forward performs one exchange with c.enc within timeout and, when an
// answer came, copies it into the caller's response unchanged: status,
// content type (or none) and body bytes. An error means no answer came.
func (s *Server) forward(c *call, timeout time.Duration) error {
	req := fasthttp.AcquireRequest()
	resp := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	s.buildRequest(c.ctx, c.route, req)
	var err error
	if c.route.kind == kindSend {
		err = c.enc.DoSend(req, resp, timeout)
	} else {
		err = c.enc.Do(req, resp, timeout)
	}
	s.metrics.observeUpstream(c.enc, c.route, resp.StatusCode(), err)
	if err != nil {
		return err
	}
	copyResponse(c.ctx, resp)
	c.ctx.Response.Header.Set("X-Encgate-Encoder", c.enc.Name)
	return nil
}

// buildRequest prepares the upstream request; the body is shared, not copied.
func (s *Server) buildRequest(ctx *fasthttp.RequestCtx, rt *route, req *fasthttp.Request) {
	req.Header.SetMethodBytes(ctx.Method())
	req.SetRequestURI(rt.path)
	if ct := ctx.Request.Header.ContentType(); len(ct) > 0 {
		req.Header.SetContentTypeBytes(ct)
	}
	req.SetBodyRaw(ctx.PostBody())
}

// copyResponse moves resp into the caller's response: the body buffer is
// swapped, not copied.
func copyResponse(ctx *fasthttp.RequestCtx, resp *fasthttp.Response) {
	ctx.SetStatusCode(resp.StatusCode())
	if ct := resp.Header.ContentType(); len(ct) > 0 {
		ctx.Response.Header.SetContentTypeBytes(ct)
	}
	if ra := resp.Header.Peek(fasthttp.HeaderRetryAfter); len(ra) > 0 {
		ctx.Response.Header.SetBytesV(fasthttp.HeaderRetryAfter, ra)
	}
	resp.SwapBody(ctx.Response.SwapBody(resp.Body()))
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

// profileAnswer is one encoder's part of a broadcast.
type profileAnswer struct {
	name   string
	status int
	text   string
}

// serveBroadcast sends a profile request to every encoder and joins the
// answers like sglang's DP mode: one line per encoder, status 200 when all
// succeeded, else the highest error status.
func (s *Server) serveBroadcast(ctx *fasthttp.RequestCtx, rt *route) {
	encs := s.pool.Encoders()
	answers := make([]profileAnswer, len(encs))
	var wg sync.WaitGroup
	for i, enc := range encs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			answers[i] = s.profileOne(ctx, rt, enc)
		}()
	}
	wg.Wait()
	sort.SliceStable(answers, func(i, j int) bool { return answers[i].name < answers[j].name })
	status := fasthttp.StatusOK
	var body bytes.Buffer
	for i, a := range answers {
		if a.status != fasthttp.StatusOK && (status == fasthttp.StatusOK || a.status > status) {
			status = a.status
		}
		if i > 0 {
			body.WriteByte('\n')
		}
		body.WriteString(a.name + ": " + a.text)
	}
	body.WriteByte('\n')
	ctx.SetStatusCode(status)
	ctx.SetContentType("text/plain; charset=utf-8")
	ctx.SetBody(body.Bytes())
}

func (s *Server) profileOne(ctx *fasthttp.RequestCtx, rt *route, enc *upstream.Encoder) profileAnswer {
	req := fasthttp.AcquireRequest()
	resp := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	s.buildRequest(ctx, rt, req)
	err := enc.Do(req, resp, s.conf().Upstream.Timeout.D())
	s.metrics.observeUpstream(enc, rt, resp.StatusCode(), err)
	if err != nil {
		return profileAnswer{name: enc.Name, status: statusFor(err), text: messageFor(err, enc)}
	}
	return profileAnswer{name: enc.Name, status: resp.StatusCode(), text: string(bytes.TrimRight(resp.Body(), "\n"))}
}

// handleProtocolError answers requests fasthttp could not read, in the
// encoder's envelope.
func (s *Server) handleProtocolError(ctx *fasthttp.RequestCtx, err error) {
	if errors.Is(err, fasthttp.ErrBodyTooLarge) {
		writeEnvelope(ctx, fasthttp.StatusRequestEntityTooLarge,
			"encgate: request body exceeds limits.max_body_bytes ("+s.conf().Limits.MaxBodyBytes.String()+")", nil)
	} else if upstream.IsTimeout(err) {
		writeEnvelope(ctx, fasthttp.StatusRequestTimeout, "encgate: request not read in time", nil)
	} else {
		writeEnvelope(ctx, fasthttp.StatusBadRequest, "encgate: malformed HTTP request: "+err.Error(), nil)
	}
	s.metrics.observe(unknownRoute, ctx.Response.StatusCode(), 0)
}
