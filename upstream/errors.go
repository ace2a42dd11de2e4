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

// InflightLimitError means one of the gateway's own bounds on exchanges in
// flight to one encoder was reached, so nothing was sent: the total
// (limits.max_inflight_per_encoder), or for a long poll the long polls'
// share of it (limits.poll_share). It unwraps to fasthttp.ErrNoFreeConns,
// the same kind of refusal.
type InflightLimitError struct {
	Encoder string
	// Limit is the bound that refused: the total, or with Polls the long
	// polls' bound (PollBound of Total and Share).
	Limit int64
	Polls bool
	Total int64   // limits.max_inflight_per_encoder
	Share float64 // limits.poll_share, with Polls
}

func (e *InflightLimitError) Error() string { return "upstream: " + e.describe("encoder "+e.Encoder) }

// describe says what subject (the encoder, or its agent) holds and names
// the bound that refused.
func (e *InflightLimitError) describe(subject string) string {
	if e.Polls {
		return subject + " already holds " + strconv.FormatInt(e.Limit, 10) +
			" long polls (metadata pulls and registrations of parts not yet encoded; limits.poll_share " +
			strconv.FormatFloat(e.Share, 'g', -1, 64) + " of limits.max_inflight_per_encoder " +
			strconv.FormatInt(e.Total, 10) + ")"
	}
	return subject + " already has " + strconv.FormatInt(e.Limit, 10) +
		" requests in flight (limits.max_inflight_per_encoder)"
}

// Unwrap returns fasthttp.ErrNoFreeConns: see the type's comment.
func (e *InflightLimitError) Unwrap() error { return fasthttp.ErrNoFreeConns }

func itoa(i int) string     { return strconv.Itoa(i) }
func quote(s string) string { return strconv.Quote(s) }
