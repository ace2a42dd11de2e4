package upstream

import (
	"errors"
	"strconv"

	"github.com/valyala/fasthttp"
)

// ErrNoEncoder means no configured encoder is usable for the request.
var ErrNoEncoder = errors.New("upstream: no usable encoder")

// DialError is a failure to connect to an encoder: nothing of the request was
// written, so the request can safely go elsewhere or be retried.
type DialError struct {
	Encoder string
	Err     error
}

func (e *DialError) Error() string {
	return "dial encoder " + e.Encoder + ": " + e.Err.Error()
}

// Unwrap returns the cause.
func (e *DialError) Unwrap() error { return e.Err }

// UnknownEncoderError means a pin names an encoder that is no longer
// configured (removed by a reload): its staged state cannot be reached.
type UnknownEncoderError struct{ Name string }

func (e *UnknownEncoderError) Error() string {
	return "upstream: encoder " + strconv.Quote(e.Name) + " holding this req_id is no longer configured"
}

func itoa(i int) string     { return strconv.Itoa(i) }
func quote(s string) string { return strconv.Quote(s) }

// UnusableEncoderError means the encoder holding a req_id is down or its
// breaker is open: its staged state cannot move to another encoder, so the
// follow-up fails fast rather than waiting.
type UnusableEncoderError struct{ Name, State string }

func (e *UnusableEncoderError) Error() string {
	return "upstream: encoder " + e.Name + " holding this req_id is " + e.State + "; its staged state cannot move to another encoder"
}

// BreakerBusyError means an encoder's breaker admitted no more requests
// (open, or half-open with its probe quota taken) when an /encode was about
// to go to it. Nothing was sent, so the /encode may go to the next encoder
// in rendezvous order (a retry policy's connect_failure).
type BreakerBusyError struct{ Encoder, State string }

func (e *BreakerBusyError) Error() string {
	return "upstream: encoder " + e.Encoder + "'s breaker is " + e.State + " and admits no more requests now; nothing was sent"
}

// InflightLimitError means the gateway's own bound on exchanges in flight to
// one encoder (limits.max_inflight_per_encoder) was reached, so nothing was
// sent. It is the same kind of refusal as running out of connections to the
// encoder, and it unwraps to fasthttp.ErrNoFreeConns so that it is classified
// alike: NotDelivered (a retry policy's connect_failure may send the request
// again, to the next encoder for /encode), and never a breaker fault (the
// encoder did nothing wrong). The gateway answers it with a 503 envelope.
type InflightLimitError struct {
	Encoder string
	Limit   int64
}

func (e *InflightLimitError) Error() string {
	return "upstream: encoder " + e.Encoder + " already has " + strconv.FormatInt(e.Limit, 10) +
		" requests in flight (limits.max_inflight_per_encoder)"
}

// Unwrap returns fasthttp.ErrNoFreeConns: see the type's comment.
func (e *InflightLimitError) Unwrap() error { return fasthttp.ErrNoFreeConns }
