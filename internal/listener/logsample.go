package listener

import (
	"errors"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/encgate/encgate/internal/clock"
)

// Lines a client can make the gateway write at any rate (one per malformed
// request, one per answer the gateway makes itself) go through a sampled
// logger: at most LogSampleFirst lines per message in each LogSampleTick,
// the rest dropped. One client sending garbage as fast as it can would
// otherwise fill the disk (19,168 lines in 3 s were seen), and a line per
// request adds nothing a counter does not: encgate_requests_total counts
// every answer by route and status, sampled or not.
const (
	LogSampleTick  = time.Second
	LogSampleFirst = 10
)

// Sampled returns l with its lines sampled per message. The sampler reads
// each line's time from clk (zap's entry time), so a test with a fake clock
// sees the bound exactly.
func Sampled(l *zap.Logger, clk clock.Clock) *zap.Logger {
	return l.WithOptions(
		zap.WrapCore(func(c zapcore.Core) zapcore.Core {
			return zapcore.NewSamplerWithOptions(c, LogSampleTick, LogSampleFirst, 0)
		}),
		zap.WithClock(zapClock{clk}))
}

// zapClock is a clock.Clock as zap's clock.
type zapClock struct{ c clock.Clock }

func (z zapClock) Now() time.Time                         { return z.c.Now() }
func (z zapClock) NewTicker(d time.Duration) *time.Ticker { return time.NewTicker(d) }

// fasthttpLog routes fasthttp's own messages to a sampled zap logger,
// without the client's bytes. fasthttp formats them itself, and its errors
// for malformed requests quote the request (a header line, the target, or
// 200 bytes either side of the head), so the line's message is fasthttp's
// format string, which is the same for every line from one place in
// fasthttp and so is what the sampler counts by, and its arguments become
// fields only when they cannot carry request bytes: addresses and numbers
// as they are, an error as RequestErrorReason describes it.
type fasthttpLog struct{ l *zap.Logger }

// FasthttpLogger is fasthttpLog over l.
func FasthttpLogger(l *zap.Logger) fasthttp.Logger { return fasthttpLog{l} }

func (f fasthttpLog) Printf(format string, args ...any) {
	ce := f.l.Check(zapcore.WarnLevel, format)
	if ce == nil {
		return
	}
	fields := make([]zap.Field, 0, len(args))
	for i, a := range args {
		key := "arg" + strconv.Itoa(i)
		switch v := a.(type) {
		case net.Addr:
			fields = append(fields, zap.String(key, v.String()))
		case error:
			fields = append(fields, zap.String(key, RequestErrorReason(nil, v)))
		case int, int32, int64, uint, uint32, uint64, float64, time.Duration:
			fields = append(fields, zap.Any(key, v))
		default:
			// strings and byte slices may quote the request
			fields = append(fields, zap.String(key, "(left out)"))
		}
	}
	ce.Write(fields...)
}

// RequestErrorReason describes why a request could not be read, in words
// of the gateway's own and never with the client's bytes: fasthttp's error
// texts quote the request, so only errors whose text cannot (the
// connection's own errors) are given as they are. c, when given, is the
// request's connection: a framing violation recorded there is the reason
// (the poison byte the framer put in the stream may have made fasthttp
// report a different error).
func RequestErrorReason(c net.Conn, err error) string {
	if c != nil {
		if fe := framingViolation(c); fe != nil {
			return fe.reason
		}
	}
	var fe *framingError
	var broken fasthttp.ErrBrokenChunk
	var small *fasthttp.ErrSmallBuffer
	var oe *net.OpError
	switch {
	case errors.As(err, &fe):
		return fe.reason
	case errors.Is(err, fasthttp.ErrDuplicateContentLength):
		return "more than one Content-Length header"
	case errors.Is(err, fasthttp.ErrUnsupportedTransferEncoding):
		return "an unsupported Transfer-Encoding"
	case errors.Is(err, fasthttp.ErrBadTrailer):
		return "a forbidden trailer field"
	case errors.As(err, &broken):
		return "broken chunked body framing"
	case errors.As(err, &small):
		return "the request line and headers exceed limits.max_header_bytes"
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		return "the body exceeds limits.max_body_bytes"
	case errors.Is(err, fasthttp.ErrorInvalidURI), errors.Is(err, fasthttp.ErrEmptyRequestURI):
		return "an invalid request target"
	case errors.Is(err, fasthttp.ErrMissingRequestMethod), errors.Is(err, fasthttp.ErrUnsupportedRequestMethod):
		return "an invalid request method"
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "the connection ended inside a request"
	case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, fasthttp.ErrTimeout):
		return "the request was not read in time"
	case errors.As(err, &oe):
		return oe.Error() // the socket's error: addresses and an errno, no request bytes
	}
	// fasthttp's errors that have no sentinel (some only with
	// SecureErrorLogMessage), known by their fixed text.
	msg := err.Error()
	for _, k := range fasthttpErrorTexts {
		if strings.Contains(msg, k.text) {
			return k.reason
		}
	}
	return "the request line, a header or the body's framing is invalid"
}

var fasthttpErrorTexts = []struct{ text, reason string }{
	{"missing required host header", "an HTTP/1.1 request without Host"},
	{"too many host headers", "more than one Host header"},
	{"invalid request uri", "an invalid request target"},
	{"request uri cannot be empty", "an invalid request target"},
	{"unsupported http version", "an unsupported HTTP version"},
	{"invalid header key", "an invalid header name"},
	{"invalid header value", "an invalid header value"},
	{"malformed mime header", "a malformed header line"},
	{"headers cannot start with space or tab", "a header line starts with whitespace"},
}
