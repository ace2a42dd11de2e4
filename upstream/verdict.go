package upstream

import (
	"bytes"
	"context"
	"errors"
	"net"
	"strconv"
	"syscall"

	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/sglang"
)

// Kind says what one exchange came to, or, for the routing kinds, why the
// call ended without one.
type Kind uint8

// Verdict kinds.
const (
	// KindAnswered: the encoder answered, with any status.
	KindAnswered Kind = iota
	// KindDialFailed: no connection could be made; nothing was sent.
	KindDialFailed
	// KindStale: every pooled connection tried had been closed by the
	// encoder before the request was written; nothing was sent.
	KindStale
	// KindRefused: the gateway's own limit (limits.max_inflight_per_encoder,
	// upstream.max_conns_per_encoder) refused it; nothing was sent.
	KindRefused
	// KindBreakerBusy: the encoder's breaker admits nothing now (open, or
	// half-open with its probes taken) and the call is a new placement;
	// nothing was sent.
	KindBreakerBusy
	// KindNoTime: the route's deadline left no time for a try; nothing was
	// sent.
	KindNoTime
	// KindTimeout: no answer within the try's time; the request may have
	// reached the encoder.
	KindTimeout
	// KindBroken: the exchange broke (a reset, an answer cut short or over
	// upstream.max_response_bytes); the request may have reached the encoder.
	KindBroken
	// KindCanceled: the gateway stopped waiting (it is shutting down).
	KindCanceled
	// KindNoEncoder: routing found no usable encoder.
	KindNoEncoder
	// KindUnusable: the encoder holding the req_id is down or open; its
	// staged state cannot move, so the call fails fast.
	KindUnusable
	// KindGone: the encoder holding the req_id is no longer configured.
	KindGone
	// KindRemembered: the req_id's /encode failed; its answer is the answer.
	KindRemembered
)

var kindNames = [...]string{"answered", "dial_failed", "stale", "refused", "breaker_busy", "no_time", "timeout",
	"broken", "canceled", "no_encoder", "unusable", "gone", "remembered"}

func (k Kind) String() string { return enumName(kindNames[:], int(k), "kind") }

// enumName is names[i], or type(i) for a value without a name.
func enumName(names []string, i int, typ string) string {
	if i < len(names) {
		return names[i]
	}
	return typ + "(" + strconv.Itoa(i) + ")"
}

// Delivery says whether a request may have reached an encoder.
type Delivery uint8

// Deliveries.
const (
	// NotSent: provably no byte reached the encoder, so the request may go
	// again (to the next encoder, for /encode) without being duplicated.
	NotSent Delivery = iota
	// MaybeSent: bytes may have reached the encoder; no answer came.
	MaybeSent
	// Delivered: the encoder answered.
	Delivered
)

// Cause says whose doing an outcome is.
type Cause uint8

// Causes.
const (
	// CauseNone: a success, or no exchange was made.
	CauseNone Cause = iota
	// CauseEncoder: the encoder's own fault (it could not be reached, it
	// broke the exchange, an /encode outlived its try, a 5xx it raises
	// about itself): counted against its breaker.
	CauseEncoder
	// CauseRequest: the request itself (a 4xx; a KeyError on an unknown
	// req_id; a destination the transfer could not reach).
	CauseRequest
	// CauseOtherRequest: another request's failure (the part's /encode,
	// a sibling rank's /send).
	CauseOtherRequest
	// CauseExpired: a long-poll that ran out, as it may by design.
	CauseExpired
	// CauseOperator: an answer listed in breaker.ignore.
	CauseOperator
	// CauseGateway: the gateway's own limits or shutdown.
	CauseGateway
)

var causeNames = [...]string{"none", "encoder", "request", "other_request", "expired", "operator", "gateway"}

func (c Cause) String() string { return enumName(causeNames[:], int(c), "cause") }

// Mark is how an encoder's breaker counts an exchange.
type Mark uint8

// Marks.
const (
	// MarkNone: the breaker is not told (no exchange was admitted).
	MarkNone Mark = iota
	// MarkSuccess: the encoder answered for itself.
	MarkSuccess
	// MarkFault: an instance fault.
	MarkFault
	// MarkIgnored: counted neither way; a half-open trial's slot is freed.
	MarkIgnored
)

var markNames = [...]string{"none", "success", "fault", "ignored"}

func (m Mark) String() string { return enumName(markNames[:], int(m), "mark") }

// Retry reasons (encgate_retries_total{reason}); an answer's is
// "status_<code>".
const (
	ReasonConnectFailure = "connect_failure"
	ReasonTimeout        = "timeout"
)

// Verdict is the one judgement of one exchange with an encoder (or of the
// routing decision that made none). The caller's status and message, the
// metrics, the breaker and the retry loop all read it; nothing else
// classifies an outcome.
type Verdict struct {
	Kind     Kind
	Delivery Delivery
	Cause    Cause
	// Status is the encoder's status when Kind is KindAnswered, else the
	// status of the gateway's own envelope.
	Status int
	// Message is the gateway's envelope message when Kind is not
	// KindAnswered.
	Message string
	// Breaker is how the encoder's breaker counts the exchange.
	Breaker Mark
	// Reason is the retry reason ("" for an outcome never retried).
	Reason string
	// Retry says the route's policy allows another attempt.
	Retry bool
	// Label is the code label of encgate_upstream_requests_total: the
	// status, or dial_error, stale, timeout, error, refused; "" when no
	// exchange was made.
	Label string
	// Encoder names the encoder the outcome concerns ("" when none).
	Encoder string
	// Shared: the answer is another call's exchange (a metadata pull of
	// the same part, metashare.go); this call sent nothing itself.
	Shared bool
}

// Target is where an exchange goes: an encoder, or its node's agent.
type Target struct {
	Encoder string
	URL     string
	Agent   bool
}

func (t Target) subject() string {
	if t.Agent {
		return "encoder " + t.Encoder + "'s agent"
	}
	return "encoder " + t.Encoder
}

// Observation is what one exchange produced: an answer (Err nil) or a
// failure with none.
type Observation struct {
	Err    error
	Status int
	Body   []byte
}

// Judge gives the verdict of one exchange of route rt with t under policy
// pol (nil: never retried), with the operator's breaker.ignore list. It is
// the only place an outcome is classified (the table in docs/concepts/architecture.md).
func Judge(rt *sglang.Route, pol *RetryPolicy, ignore []Condition, t Target, o Observation) Verdict {
	v := judgeOutcome(rt, ignore, t, o)
	v.Encoder = t.Encoder
	if pol != nil {
		for _, c := range pol.RetryOn {
			if c.matches(&v, o.Body) {
				v.Retry = true
				break
			}
		}
	}
	return v
}

func judgeOutcome(rt *sglang.Route, ignore []Condition, t Target, o Observation) Verdict {
	if o.Err == nil {
		return judgeAnswer(rt, ignore, o.Status, o.Body)
	}
	err := o.Err
	var dial *DialError
	var limit *InflightLimitError
	var busy *breakerBusyError
	switch {
	case errors.As(err, &busy):
		return Verdict{Kind: KindBreakerBusy, Cause: CauseGateway, Status: fasthttp.StatusServiceUnavailable,
			Reason: ReasonConnectFailure, Label: "refused",
			Message: "encgate: upstream: " + t.subject() + "'s breaker is " + busy.state + " and admits no more requests now; nothing was sent"}
	case errors.Is(err, errPlacedElsewhere):
		return Verdict{Kind: KindRefused, Cause: CauseOtherRequest, Status: fasthttp.StatusServiceUnavailable, Breaker: MarkIgnored,
			Reason: ReasonConnectFailure, Label: "refused", Message: "encgate: " + err.Error()}
	case errors.As(err, &limit):
		return Verdict{Kind: KindRefused, Cause: CauseGateway, Status: fasthttp.StatusServiceUnavailable, Breaker: MarkIgnored,
			Reason: ReasonConnectFailure, Label: "refused",
			Message: "encgate: " + limit.describe(t.subject()) + "; try again later"}
	case errors.Is(err, fasthttp.ErrNoFreeConns):
		return Verdict{Kind: KindRefused, Cause: CauseGateway, Status: fasthttp.StatusServiceUnavailable, Breaker: MarkIgnored,
			Reason: ReasonConnectFailure, Label: "refused",
			Message: "encgate: " + t.subject() + " has no free connection (upstream.max_conns_per_encoder)"}
	case errors.As(err, &dial) && LocalShortage(dial.Err):
		// The gateway could not open a socket (out of descriptors or
		// buffers): its own shortage, which says nothing about the encoder.
		return Verdict{Kind: KindRefused, Cause: CauseGateway, Status: fasthttp.StatusServiceUnavailable, Breaker: MarkIgnored,
			Reason: ReasonConnectFailure, Label: "refused",
			Message: "encgate: the gateway cannot open a connection to " + t.subject() + " now: " + dial.Err.Error() + "; nothing was sent"}
	case errors.As(err, &dial):
		return Verdict{Kind: KindDialFailed, Cause: CauseEncoder, Status: fasthttp.StatusBadGateway, Breaker: MarkFault,
			Reason: ReasonConnectFailure, Label: "dial_error",
			Message: "encgate: cannot connect to " + t.subject() + " (" + t.URL + "): " + dial.Err.Error()}
	case errors.Is(err, errStaleConn):
		return Verdict{Kind: KindStale, Cause: CauseEncoder, Status: fasthttp.StatusBadGateway, Breaker: MarkFault,
			Reason: ReasonConnectFailure, Label: "stale",
			Message: "encgate: " + t.subject() + " had closed every connection tried (pooled, or reset before the first byte left) before the request was written; nothing was sent"}
	case errors.Is(err, context.Canceled):
		return Verdict{Kind: KindCanceled, Delivery: MaybeSent, Cause: CauseGateway, Status: fasthttp.StatusServiceUnavailable,
			Breaker: MarkIgnored, Label: "error",
			Message: "encgate: the gateway stopped waiting for " + t.subject() + ": " + err.Error()}
	case isTimeout(err):
		v := Verdict{Kind: KindTimeout, Delivery: MaybeSent, Cause: CauseEncoder, Status: fasthttp.StatusGatewayTimeout,
			Breaker: MarkFault, Reason: ReasonTimeout, Label: "timeout",
			Message: "encgate: " + t.subject() + " did not answer in time: " + err.Error()}
		if rt.LongPoll { // held by design: a try that runs out says nothing about the encoder
			v.Cause, v.Breaker = CauseExpired, MarkIgnored
		}
		return v
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		return Verdict{Kind: KindBroken, Delivery: MaybeSent, Cause: CauseEncoder, Status: fasthttp.StatusBadGateway,
			Breaker: MarkFault, Label: "error",
			Message: "encgate: " + t.subject() + " answered with a body over upstream.max_response_bytes"}
	}
	return Verdict{Kind: KindBroken, Delivery: MaybeSent, Cause: CauseEncoder, Status: fasthttp.StatusBadGateway,
		Breaker: MarkFault, Label: "error",
		Message: "encgate: exchange with " + t.subject() + " failed: " + err.Error()}
}

// judgeAnswer classifies an encoder's answer by its status and message.
func judgeAnswer(rt *sglang.Route, ignore []Condition, status int, body []byte) Verdict {
	v := Verdict{Kind: KindAnswered, Delivery: Delivered, Status: status, Label: CodeLabel(status),
		Reason: statusReason(status), Breaker: MarkSuccess}
	switch {
	case status < 400:
		return v
	case status < 500:
		v.Cause = CauseRequest
		return v
	}
	v.Cause, v.Breaker = answerCause(rt, status, body), MarkIgnored
	if v.Cause == CauseEncoder {
		for _, c := range ignore {
			if c.matches(&v, body) {
				v.Cause = CauseOperator
				break
			}
		}
	}
	if v.Cause == CauseEncoder {
		v.Breaker = MarkFault
	}
	return v
}

// answerCause says whose doing an encoder's 5xx answer is (protocol
// reference §3, §4, §11). An answer not listed is the encoder's.
func answerCause(rt *sglang.Route, status int, body []byte) Cause {
	has := func(s string) bool { return bytes.Contains(body, []byte(s)) }
	switch {
	case status == fasthttp.StatusLoopDetected:
		// A gateway in the path saw the request come back to it (its Via):
		// the fleet's wiring loops, which says nothing about this encoder's
		// health, and every attempt would loop alike.
		return CauseRequest
	case status == fasthttp.StatusGatewayTimeout && (rt.LongPoll || has(sglang.MetadataNotReady)):
		// A metadata pull, registration or /send that waited as long as the
		// encoder waits (or a DP rank's wait for it) and gave up.
		return CauseExpired
	case has(sglang.EncodeFailedFirst), has(sglang.AlreadyReleased), has(sglang.RequestReleased),
		has(sglang.NoEmbedding), has(sglang.RequestNotStarted), has(sglang.UnknownReqID):
		return CauseOtherRequest
	case has(sglang.TransferFailed), has(sglang.ReceiverNotTold):
		// The RDMA write or the agent's ack to the receiver failed: the
		// destination fails every encoder alike.
		return CauseRequest
	case rt.Kind == sglang.KindEncode && (has(sglang.PreprocessFailed) || has(sglang.NotImplemented)):
		// The request's media broke preprocessing: any encoder fails it.
		return CauseRequest
	case rt.Kind != sglang.KindEncode && string(bytes.TrimSpace(body)) == sglang.InternalServerError:
		// Starlette's answer to a KeyError on the req_id (GEN0's unknown
		// /send, a sibling's released state) or GEN0's failed assert on a
		// changed receive_count. The fields the encoder indexes were checked
		// before forwarding, so what is left is about the req_id.
		return CauseRequest
	case rt == sglang.RouteMetadata && status == fasthttp.StatusInternalServerError:
		// A pull's 500 is the part's encode failure as the encoder published
		// it (§5: the error text, or "encode metadata missing"): the
		// /encode's own verdict judged that failure, once, and every rank
		// of the part pulls it again.
		return CauseOtherRequest
	}
	return CauseEncoder
}

// statusReasons holds "status_<code>" for every HTTP status, so a verdict
// does not allocate its reason.
var statusReasons = func() (r [600]string) {
	for i := 100; i < len(r); i++ {
		r[i] = "status_" + strconv.Itoa(i)
	}
	return r
}()

func statusReason(status int) string {
	if status >= 100 && status < len(statusReasons) {
		return statusReasons[status]
	}
	return "status_other"
}

// codeLabels avoids formatting a status code for every exchange.
var codeLabels = func() (t [600]string) {
	for i := range t {
		t[i] = strconv.Itoa(i)
	}
	return t
}()

// CodeLabel is a status code as a metric label value, formatted once.
func CodeLabel(code int) string {
	if code >= 0 && code < len(codeLabels) {
		return codeLabels[code]
	}
	return strconv.Itoa(code)
}

// Routing verdicts: the call ended before any exchange.

func noEncoderVerdict() Verdict {
	return Verdict{Kind: KindNoEncoder, Status: fasthttp.StatusServiceUnavailable, Message: "encgate: no usable encoder"}
}

func unusableVerdict(e *Encoder) Verdict {
	return Verdict{Kind: KindUnusable, Status: fasthttp.StatusServiceUnavailable, Encoder: e.Name,
		Message: "encgate: upstream: encoder " + e.Name + " holding this req_id is " + e.State() +
			"; its staged state cannot move to another encoder"}
}

func goneVerdict(name string) Verdict {
	return Verdict{Kind: KindGone, Status: fasthttp.StatusServiceUnavailable, Encoder: name,
		Message: "encgate: upstream: encoder " + strconv.Quote(name) + " holding this req_id is no longer configured"}
}

func rememberedVerdict(p Pin) Verdict {
	return Verdict{Kind: KindRemembered, Status: p.Status, Message: p.Message, Encoder: p.Encoder}
}

func noTimeVerdict(rt *sglang.Route, t Target) Verdict {
	return Verdict{Kind: KindNoTime, Status: fasthttp.StatusGatewayTimeout, Encoder: t.Encoder,
		Message: "encgate: no time was left within retry." + rt.Label + ".deadline to ask " + t.subject()}
}

// LocalShortage reports whether err is this process running out of a
// resource to open a socket with (descriptors, kernel buffers, memory):
// not the peer's fault.
func LocalShortage(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
		errors.Is(err, syscall.ENOBUFS) || errors.Is(err, syscall.ENOMEM)
}

// isTimeout reports whether err is a timeout of an exchange.
func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, fasthttp.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) ||
		(errors.As(err, &ne) && ne.Timeout())
}
