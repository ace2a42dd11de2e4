package gateway

import (
	"errors"

	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/listener"
	"github.com/encgate/encgate/internal/sglang"
)

// What the gateway answers for requests it could not read: their limits,
// their framing, and the gentle close after the answer.

// readConfig gives a request's body limits.read_timeout from the end of its
// headers (fasthttp's HeaderReceived hook); a request without a body keeps
// the header deadline, which no read meets any more.
func (s *Server) readConfig(h *fasthttp.RequestHeader) fasthttp.RequestConfig {
	if h.ContentLength() == 0 {
		return fasthttp.RequestConfig{}
	}
	return fasthttp.RequestConfig{ReadTimeout: s.conf().Limits.ReadTimeout.D()}
}

// handleReadError answers a request fasthttp could not read: headers over
// limits.max_header_bytes get 431, a read past its deadline 408, each
// naming the limit; everything else goes to handleProtocolError. The
// answer is then sent at once and the connection closed gently
// (listener.LastAnswer). A request refused by the framing check (framing.go)
// arrives here too, as whatever error fasthttp made of the check's refusal.
func (s *Server) handleReadError(ctx *fasthttp.RequestCtx, err error) {
	var small *fasthttp.ErrSmallBuffer
	switch {
	case errors.As(err, &small):
		writeEnvelope(ctx, fasthttp.StatusRequestHeaderFieldsTooLarge,
			"encgate: request line and headers exceed limits.max_header_bytes ("+s.conf().Limits.MaxHeaderBytes.String()+")", nil)
		s.metrics.observe(sglang.RouteUnknown, ctx.Response.StatusCode(), 0)
	case listener.IsReadTimeout(err):
		writeEnvelope(ctx, fasthttp.StatusRequestTimeout, "encgate: request not read in time (limits.read_header_timeout "+
			s.conf().Limits.ReadHeaderTimeout.String()+" for the headers, limits.read_timeout "+s.conf().Limits.ReadTimeout.String()+" for the body)", nil)
		s.metrics.observe(sglang.RouteUnknown, ctx.Response.StatusCode(), 0)
	default:
		s.handleProtocolError(ctx, err)
	}
	listener.LastAnswer(ctx, s.conf().Limits.WriteTimeout.D())
}

// handleProtocolError answers requests fasthttp could not read, in the
// encoder's envelope. A malformed request's 400 says why in the gateway's
// own words (requestErrorReason): fasthttp's error texts quote the
// request's bytes, and an answer must not echo them.
func (s *Server) handleProtocolError(ctx *fasthttp.RequestCtx, err error) {
	if errors.Is(err, fasthttp.ErrBodyTooLarge) {
		writeEnvelope(ctx, fasthttp.StatusRequestEntityTooLarge,
			"encgate: request body exceeds limits.max_body_bytes ("+s.conf().Limits.MaxBodyBytes.String()+")", nil)
	} else if listener.IsReadTimeout(err) {
		writeEnvelope(ctx, fasthttp.StatusRequestTimeout, "encgate: request not read in time", nil)
	} else {
		writeEnvelope(ctx, fasthttp.StatusBadRequest, "encgate: malformed HTTP request: "+listener.RequestErrorReason(ctx.Conn(), err), nil)
	}
	s.metrics.observe(sglang.RouteUnknown, ctx.Response.StatusCode(), 0)
}
