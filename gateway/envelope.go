package gateway

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/jsonfield"
	"github.com/encgate/encgate/upstream"
)

// envelope is the sglang encoder's error shape. Keys keep the encoder's order.
type envelope struct {
	Status  string  `json:"status"`
	Message string  `json:"message"`
	ReqID   *string `json:"req_id"` // null when the request had none
}

// writeEnvelope answers with the encoder's error envelope.
func writeEnvelope(ctx *fasthttp.RequestCtx, status int, message string, reqID *string) {
	body, err := json.Marshal(envelope{Status: "error", Message: message, ReqID: reqID})
	if err != nil { // cannot happen for strings; keep the caller informed anyway
		body = []byte(`{"status":"error","message":"encgate: internal error","req_id":null}`)
	}
	ctx.Response.ResetBody()
	ctx.SetStatusCode(status)
	ctx.SetContentType("application/json")
	ctx.SetBody(body)
}

// requestError is a caller mistake detected by the gateway (400).
type requestError struct{ msg string }

func (e *requestError) Error() string { return e.msg }

// errRequestTooLarge is a body over limits.max_body_bytes (413).
var errRequestTooLarge = errors.New("request body too large")

// statusFor maps an error the gateway itself hit to the status it answers
// with. It is the only place that makes this decision.
func statusFor(err error) int {
	var dial *upstream.DialError
	var unknown *upstream.UnknownEncoderError
	var unusable *upstream.UnusableEncoderError
	var limit *upstream.InflightLimitError
	var busy *upstream.BreakerBusyError
	var bad *requestError
	switch {
	case errors.As(err, &bad):
		return fasthttp.StatusBadRequest
	case errors.Is(err, errRequestTooLarge):
		return fasthttp.StatusRequestEntityTooLarge
	case errors.Is(err, upstream.ErrNoEncoder), errors.As(err, &unknown), errors.As(err, &unusable),
		errors.As(err, &limit), errors.As(err, &busy), errors.Is(err, fasthttp.ErrNoFreeConns):
		return fasthttp.StatusServiceUnavailable
	case errors.As(err, &dial):
		return fasthttp.StatusBadGateway
	case upstream.IsTimeout(err):
		return fasthttp.StatusGatewayTimeout
	default:
		return fasthttp.StatusBadGateway
	}
}

// messageFor is the envelope message for an error the gateway hit talking
// to enc (nil when no encoder was chosen).
func messageFor(err error, enc *upstream.Encoder) string {
	var bad *requestError
	var limit *upstream.InflightLimitError
	switch {
	case errors.As(err, &bad):
		return bad.msg
	case errors.Is(err, upstream.ErrNoEncoder):
		return "encgate: no usable encoder"
	case errors.As(err, &limit):
		return fmt.Sprintf("encgate: encoder %s already has %d requests in flight (limits.max_inflight_per_encoder); try again later",
			limit.Encoder, limit.Limit)
	case enc == nil || isUnusable(err):
		return "encgate: " + err.Error()
	case errors.Is(err, fasthttp.ErrNoFreeConns):
		return fmt.Sprintf("encgate: encoder %s has no free connection (upstream.max_conns_per_encoder)", enc.Name)
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		return fmt.Sprintf("encgate: encoder %s answered with a body over upstream.max_response_bytes", enc.Name)
	case upstream.IsTimeout(err) && !isDial(err):
		return fmt.Sprintf("encgate: encoder %s did not answer in time: %v", enc.Name, err)
	case isDial(err):
		return fmt.Sprintf("encgate: cannot connect to encoder %s (%s): %v", enc.Name, enc.URL, errors.Unwrap(err))
	default:
		return fmt.Sprintf("encgate: exchange with encoder %s failed: %v", enc.Name, err)
	}
}

func isUnusable(err error) bool {
	var u *upstream.UnusableEncoderError
	var busy *upstream.BreakerBusyError
	return errors.As(err, &u) || errors.As(err, &busy)
}

func isDial(err error) bool {
	var dial *upstream.DialError
	return errors.As(err, &dial)
}

var messageKey = []string{"message"}

// upstreamMessage extracts the message of an encoder's error answer as
// sglang's receivers do: the envelope's "message", else the raw text.
func upstreamMessage(body []byte) string {
	var raw [1][]byte
	if jsonfield.Lookup(body, messageKey, raw[:]) == nil {
		if m, ok := jsonfield.String(raw[0]); ok {
			return m
		}
	}
	return strings.TrimSpace(string(body))
}
