package upstream

import (
	"errors"
	"strconv"

	"github.com/valyala/fasthttp"
)

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

// errPlacedElsewhere: an /encode about to be placed found its req_id
// pinned to another encoder by a concurrent /encode; nothing was sent.
var errPlacedElsewhere = errors.New("another /encode of this req_id was placed on another encoder first; nothing was sent")

// breakerBusyError is an exchange the breaker refused to admit.
type breakerBusyError struct{ state string }

func (e *breakerBusyError) Error() string { return "breaker is " + e.state }

// InflightLimitError means the gateway's own bound on exchanges in flight to
// one encoder (limits.max_inflight_per_encoder) was reached, so nothing was
// sent. It unwraps to fasthttp.ErrNoFreeConns, the same kind of refusal.
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

func itoa(i int) string     { return strconv.Itoa(i) }
func quote(s string) string { return strconv.Quote(s) }
