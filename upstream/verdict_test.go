package upstream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/sglang"
)

// One row per outcome class: the verdict every consumer reads (the status
// and message the caller gets, the breaker's mark, the retry reason and
// whether the default policy retries it, the metric label). This table is
// the one in docs/concepts/architecture.md.
func TestVerdictTable(t *testing.T) {
	retry := DefaultRetry()
	enc, meta, reg, send := sglang.RouteEncode, sglang.RouteMetadata, sglang.RouteReceiveURL, sglang.RouteSend
	tgt := Target{Encoder: "enc-3", URL: "http://10.0.0.3:30000"}
	agent := Target{Encoder: "enc-3", URL: "http://10.0.0.3:7401", Agent: true}
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connect: connection refused")}
	answer := func(status int, body string) Observation { return Observation{Status: status, Body: []byte(body)} }
	env := func(msg string) string { return `{"status":"error","message":"` + msg + `","req_id":"r"}` }
	failed := func(err error) Observation { return Observation{Err: err} }
	rows := []struct {
		name     string
		route    *sglang.Route
		t        Target
		o        Observation
		kind     Kind
		delivery Delivery
		cause    Cause
		status   int
		mark     Mark
		reason   string
		retry    bool
		label    string
		msg      string // the envelope message (answers: "")
	}{
		// Answers the encoder gives for itself.
		{"200", enc, tgt, answer(200, "null"), KindAnswered, Delivered, CauseNone, 200, MarkSuccess, "status_200", false, "200", ""},
		{"204", meta, tgt, answer(204, ""), KindAnswered, Delivered, CauseNone, 204, MarkSuccess, "status_204", false, "204", ""},
		{"CUDA out of memory", enc, tgt, answer(500, env("Internal encoding error: CUDA out of memory")), KindAnswered, Delivered, CauseEncoder, 500, MarkFault, "status_500", false, "500", ""},
		{"DP workers dead: next encoder", enc, tgt, answer(503, env(sglang.DPWorkersDead)), KindAnswered, Delivered, CauseEncoder, 503, MarkFault, "status_503", true, "503", ""},
		{"DP worker died", meta, tgt, answer(503, env("DP worker rank=1 died (exit code -9)")), KindAnswered, Delivered, CauseEncoder, 503, MarkFault, "status_503", false, "503", ""},
		{"encode batch watchdog", enc, tgt, answer(504, env(sglang.BatchTimedOut)), KindAnswered, Delivered, CauseEncoder, 504, MarkFault, "status_504", false, "504", ""},
		{"an /encode text 500", enc, tgt, answer(500, "Internal Server Error"), KindAnswered, Delivered, CauseEncoder, 500, MarkFault, "status_500", false, "500", ""},
		{"502 from a proxy in front", send, tgt, answer(502, "bad gateway"), KindAnswered, Delivered, CauseEncoder, 502, MarkFault, "status_502", false, "502", ""},
		// The request's own doing: never a fault.
		{"400 validation", enc, tgt, answer(400, env("missing or empty mm_items")), KindAnswered, Delivered, CauseRequest, 400, MarkSuccess, "status_400", false, "400", ""},
		{"400 bad media", meta, tgt, answer(400, env("Error while loading data x")), KindAnswered, Delivered, CauseRequest, 400, MarkSuccess, "status_400", false, "400", ""},
		{"404 DP unknown req_id", reg, tgt, answer(404, env("Unknown req_id: r")), KindAnswered, Delivered, CauseRequest, 404, MarkSuccess, "status_404", false, "404", ""},
		{"422 not a dict", enc, tgt, answer(422, `{"detail":[]}`), KindAnswered, Delivered, CauseRequest, 422, MarkSuccess, "status_422", false, "422", ""},
		{"429", enc, tgt, answer(429, ""), KindAnswered, Delivered, CauseRequest, 429, MarkSuccess, "status_429", false, "429", ""},
		{"media that breaks preprocessing", enc, tgt, answer(500, env("Failed to process mm items: cannot identify image file")), KindAnswered, Delivered, CauseRequest, 500, MarkIgnored, "status_500", false, "500", ""},
		{"a modality the model cannot do", enc, tgt, answer(500, env("Not implemented error: video")), KindAnswered, Delivered, CauseRequest, 500, MarkIgnored, "status_500", false, "500", ""},
		{"KeyError text on /send (GEN0 unknown req_id)", send, tgt, answer(500, "Internal Server Error"), KindAnswered, Delivered, CauseRequest, 500, MarkIgnored, "status_500", false, "500", ""},
		{"AssertionError text on a registration (GEN0)", reg, tgt, answer(500, "Internal Server Error\n"), KindAnswered, Delivered, CauseRequest, 500, MarkIgnored, "status_500", false, "500", ""},
		{"KeyError text on a metadata pull", meta, tgt, answer(500, "Internal Server Error"), KindAnswered, Delivered, CauseRequest, 500, MarkIgnored, "status_500", false, "500", ""},
		{"RDMA write failed", send, tgt, answer(500, env("Mooncake transfer_sync failed for r (session=s, nbytes=8, ret=-1)")), KindAnswered, Delivered, CauseRequest, 500, MarkIgnored, "status_500", false, "500", ""},
		{"508: a gateway in the path saw the request loop", enc, tgt, answer(508, env("encgate: loop detected: this request has passed through this gateway (encgate-0102030405060708) already")), KindAnswered, Delivered, CauseRequest, 508, MarkIgnored, "status_508", false, "508", ""},
		{"508 on a registration: not retried", reg, tgt, answer(508, env("encgate: loop detected")), KindAnswered, Delivered, CauseRequest, 508, MarkIgnored, "status_508", false, "508", ""},
		{"agent ack undeliverable", send, agent, answer(500, env("encgate: 8 bytes for r reached session=s, but the ack to tcp://h:1 (prefill_host:embedding_port) failed, so the receiver will not know: refused")), KindAnswered, Delivered, CauseRequest, 500, MarkIgnored, "status_500", false, "500", ""},
		// Another request's failure.
		{"GEN0 sibling of a failed encode", enc, tgt, answer(500, env(sglang.EncodeFailedFirst)), KindAnswered, Delivered, CauseOtherRequest, 500, MarkIgnored, "status_500", false, "500", ""},
		{"already released", send, tgt, answer(500, env("no staged embedding for req_id=r (already released)")), KindAnswered, Delivered, CauseOtherRequest, 500, MarkIgnored, "status_500", false, "500", ""},
		{"DP already released (text)", send, tgt, answer(500, "Encoder DP worker send error: no staged embedding for /send req_id=r (already released)"), KindAnswered, Delivered, CauseOtherRequest, 500, MarkIgnored, "status_500", false, "500", ""},
		{"DP unknown req_id on /send (text)", send, tgt, answer(500, "Encoder DP worker send error: Unknown req_id: r"), KindAnswered, Delivered, CauseOtherRequest, 500, MarkIgnored, "status_500", false, "500", ""},
		{"request was released", send, tgt, answer(500, env("Encoder request was released: r")), KindAnswered, Delivered, CauseOtherRequest, 500, MarkIgnored, "status_500", false, "500", ""},
		{"no embedding after a failed encode", send, tgt, answer(500, env("No embedding available for Mooncake GPU-direct transfer: r")), KindAnswered, Delivered, CauseOtherRequest, 500, MarkIgnored, "status_500", false, "500", ""},
		{"a failed part's error record, pulled by each rank", meta, tgt, answer(500, env("Error while loading data x")), KindAnswered, Delivered, CauseOtherRequest, 500, MarkIgnored, "status_500", false, "500", ""},
		{"an encoder fault's error record: counted on its /encode", meta, tgt, answer(500, env("Internal encoding error: CUDA out of memory")), KindAnswered, Delivered, CauseOtherRequest, 500, MarkIgnored, "status_500", false, "500", ""},
		// Long-polls that ran out.
		{"metadata not ready: retried", meta, tgt, answer(504, env(sglang.MetadataNotReady)), KindAnswered, Delivered, CauseExpired, 504, MarkIgnored, "status_504", true, "504", ""},
		{"registration before /encode timed out", reg, tgt, answer(504, env("Timed out waiting for encoder request to start: r")), KindAnswered, Delivered, CauseExpired, 504, MarkIgnored, "status_504", true, "504", ""},
		{"DP rank wait timed out", meta, tgt, answer(504, env("Encoder DP rank=0 wait_metadata timed out after 180.0s")), KindAnswered, Delivered, CauseExpired, 504, MarkIgnored, "status_504", false, "504", ""},
		{"registration 503: retried", reg, tgt, answer(503, env("encoder not ready")), KindAnswered, Delivered, CauseEncoder, 503, MarkFault, "status_503", true, "503", ""},
		// No answer.
		{"dial refused", enc, tgt, failed(&DialError{Encoder: "enc-3", Err: refused}), KindDialFailed, NotSent, CauseEncoder, 502, MarkFault, ReasonConnectFailure, true, "dial_error", "encgate: cannot connect to encoder enc-3 (http://10.0.0.3:30000): dial tcp: connect: connection refused"},
		{"dial timeout is a dial failure", meta, tgt, failed(&DialError{Encoder: "enc-3", Err: &net.OpError{Op: "dial", Net: "tcp", Err: os.ErrDeadlineExceeded}}), KindDialFailed, NotSent, CauseEncoder, 502, MarkFault, ReasonConnectFailure, true, "dial_error", "encgate: cannot connect to encoder enc-3"},
		{"agent dial refused", send, agent, failed(&DialError{Encoder: "enc-3 agent", Err: refused}), KindDialFailed, NotSent, CauseEncoder, 502, MarkFault, ReasonConnectFailure, true, "dial_error", "encgate: cannot connect to encoder enc-3's agent (http://10.0.0.3:7401)"},
		{"the gateway out of descriptors", enc, tgt, failed(&DialError{Encoder: "enc-3", Err: &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("socket", syscall.EMFILE)}}), KindRefused, NotSent, CauseGateway, 503, MarkIgnored, ReasonConnectFailure, true, "refused", "encgate: the gateway cannot open a connection to encoder enc-3 now"},
		{"stale pooled connections", send, tgt, failed(&StaleConnError{Err: io.EOF}), KindStale, NotSent, CauseEncoder, 502, MarkFault, ReasonConnectFailure, true, "stale", "nothing was sent"},
		{"max_inflight_per_encoder", enc, tgt, failed(&InflightLimitError{Encoder: "enc-3", Limit: 8}), KindRefused, NotSent, CauseGateway, 503, MarkIgnored, ReasonConnectFailure, true, "refused", "encgate: encoder enc-3 already has 8 requests in flight (limits.max_inflight_per_encoder); try again later"},
		{"poll_share", meta, tgt, failed(&InflightLimitError{Encoder: "enc-3", Limit: 6, Polls: true, Total: 8, Share: 0.75}), KindRefused, NotSent, CauseGateway, 503, MarkIgnored, ReasonConnectFailure, true, "refused", "encgate: encoder enc-3 already holds 6 long polls (metadata pulls and registrations of parts not yet encoded; limits.poll_share 0.75 of limits.max_inflight_per_encoder 8); try again later"},
		{"max_conns_per_encoder", meta, tgt, failed(fasthttp.ErrNoFreeConns), KindRefused, NotSent, CauseGateway, 503, MarkIgnored, ReasonConnectFailure, true, "refused", "encgate: encoder enc-3 has no free connection (upstream.max_conns_per_encoder)"},
		{"breaker busy: next encoder", enc, tgt, failed(&breakerBusyError{state: "open"}), KindBreakerBusy, NotSent, CauseGateway, 503, MarkNone, ReasonConnectFailure, true, "refused", "encgate: upstream: encoder enc-3's breaker is open and admits no more requests now; nothing was sent"},
		{"an /encode timed out", enc, tgt, failed(fasthttp.ErrTimeout), KindTimeout, MaybeSent, CauseEncoder, 504, MarkFault, ReasonTimeout, false, "timeout", "encgate: encoder enc-3 did not answer in time: " + fasthttp.ErrTimeout.Error()},
		{"a pull held past its try", meta, tgt, failed(fasthttp.ErrTimeout), KindTimeout, MaybeSent, CauseExpired, 504, MarkIgnored, ReasonTimeout, true, "timeout", "did not answer in time"},
		{"a registration held past its try", reg, tgt, failed(&net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}), KindTimeout, MaybeSent, CauseExpired, 504, MarkIgnored, ReasonTimeout, false, "timeout", "did not answer in time"},
		{"a /send held past its try: never re-sent", send, tgt, failed(context.DeadlineExceeded), KindTimeout, MaybeSent, CauseExpired, 504, MarkIgnored, ReasonTimeout, false, "timeout", "did not answer in time"},
		{"reset", enc, tgt, failed(errors.New("read: connection reset by peer")), KindBroken, MaybeSent, CauseEncoder, 502, MarkFault, "", false, "error", "encgate: exchange with encoder enc-3 failed: read: connection reset by peer"},
		{"truncated answer", send, tgt, failed(io.ErrUnexpectedEOF), KindBroken, MaybeSent, CauseEncoder, 502, MarkFault, "", false, "error", "failed: unexpected EOF"},
		{"answer over max_response_bytes", meta, tgt, failed(fasthttp.ErrBodyTooLarge), KindBroken, MaybeSent, CauseEncoder, 502, MarkFault, "", false, "error", "encgate: encoder enc-3 answered with a body over upstream.max_response_bytes"},
		{"shutdown", meta, tgt, failed(fmt.Errorf("wait: %w", context.Canceled)), KindCanceled, MaybeSent, CauseGateway, 503, MarkIgnored, "", false, "error", "encgate: the gateway stopped waiting for encoder enc-3"},
	}
	for _, r := range rows {
		v := Judge(r.route, retry.Policy(r.route.Label), nil, r.t, r.o)
		got := fmt.Sprintf("%s %d %s %d %s %q %v %q", v.Kind, v.Delivery, v.Cause, v.Status, v.Breaker, v.Reason, v.Retry, v.Label)
		want := fmt.Sprintf("%s %d %s %d %s %q %v %q", r.kind, r.delivery, r.cause, r.status, r.mark, r.reason, r.retry, r.label)
		if got != want {
			t.Errorf("%s (%s):\n got %s\nwant %s", r.name, r.route.Path, got, want)
		}
		if (r.msg == "") != (v.Message == "") || !strings.Contains(v.Message, r.msg) || v.Encoder != "enc-3" {
			t.Errorf("%s: message %q (encoder %q), want one with %q", r.name, v.Message, v.Encoder, r.msg)
		}
		// Wrapping an error changes nothing.
		if r.o.Err != nil {
			if w := Judge(r.route, retry.Policy(r.route.Label), nil, r.t, failed(fmt.Errorf("attempt 2: %w", r.o.Err))); w.Kind != v.Kind || w.Breaker != v.Breaker {
				t.Errorf("%s: wrapped, %s/%s", r.name, w.Kind, w.Breaker)
			}
		}
	}
}

// breaker.ignore adds to what is never counted; it never takes away.
func TestVerdictOperatorIgnore(t *testing.T) {
	ignore := []Condition{{Kind: OnStatus, Status: 500, BodyContains: "flaky plugin"}, {Kind: OnStatus, Status: 502}}
	tgt := Target{Encoder: "e"}
	for _, tc := range []struct {
		o    Observation
		mark Mark
	}{
		{Observation{Status: 500, Body: []byte("flaky plugin exploded")}, MarkIgnored},
		{Observation{Status: 502, Body: []byte("anything")}, MarkIgnored},
		{Observation{Status: 500, Body: []byte("CUDA out of memory")}, MarkFault},
		{Observation{Status: 504, Body: []byte("flaky plugin")}, MarkFault},
		// Non-status conditions (Validate refuses them) never match.
		{Observation{Err: &DialError{Encoder: "e", Err: errors.New("refused")}}, MarkFault},
	} {
		v := Judge(sglang.RouteEncode, nil, append(ignore, Condition{Kind: OnConnectFailure}), tgt, tc.o)
		if v.Breaker != tc.mark || v.Retry {
			t.Errorf("%d %q %v: %s retry=%v, want %s", tc.o.Status, tc.o.Body, tc.o.Err, v.Breaker, v.Retry, tc.mark)
		}
		if tc.mark == MarkIgnored && v.Cause != CauseOperator {
			t.Errorf("%q: cause %s", tc.o.Body, v.Cause)
		}
	}
}

// Every retry condition of every route reads the same verdict.
func TestVerdictRetryConditions(t *testing.T) {
	c := DefaultRetry()
	dial := Observation{Err: &DialError{Encoder: "e0", Err: errors.New("connection refused")}}
	for _, tc := range []struct {
		route *sglang.Route
		o     Observation
		retry bool
	}{
		{sglang.RouteMetadata, Observation{Status: 504, Body: []byte(`{"message":"encode metadata not ready"}`)}, true},
		{sglang.RouteMetadata, Observation{Status: 504, Body: []byte(`gateway timeout`)}, false},
		{sglang.RouteMetadata, Observation{Status: 500, Body: []byte(`encode metadata not ready`)}, false},
		{sglang.RouteMetadata, dial, true},
		{sglang.RouteMetadata, Observation{Err: io.ErrUnexpectedEOF}, false},
		{sglang.RouteReceiveURL, Observation{Status: 503}, true},
		{sglang.RouteReceiveURL, Observation{Status: 504, Body: []byte("anything")}, true},
		{sglang.RouteReceiveURL, Observation{Status: 400}, false},
		{sglang.RouteEncode, Observation{Status: 503, Body: []byte(`busy`)}, false},
		{sglang.RouteEncode, Observation{Err: fasthttp.ErrNoFreeConns}, true},
		{sglang.RouteEncode, Observation{Err: fasthttp.ErrTimeout}, false},
		{sglang.RouteSend, dial, true},
		{sglang.RouteSend, Observation{Status: 503}, false},
		{sglang.RouteSend, Observation{Status: 999}, false},
	} {
		v := Judge(tc.route, c.Policy(tc.route.Label), nil, Target{Encoder: "e0"}, tc.o)
		if v.Retry != tc.retry {
			t.Errorf("%s %+v: retry %v, want %v", tc.route.Path, tc.o, v.Retry, tc.retry)
		}
	}
	if v := Judge(sglang.RouteEncode, nil, nil, Target{}, dial); v.Retry {
		t.Error("no policy, yet retried")
	}
	if v := Judge(sglang.RouteSend, c.Policy("send"), nil, Target{}, Observation{Status: 999}); v.Reason != "status_other" {
		t.Errorf("reason %q", v.Reason)
	}
	if c.Policy("health") != nil {
		t.Error("Policy(health) is not nil")
	}
	c.Policy("send").MaxAttempts = 1 // Policy points into the config
	if c.Send.MaxAttempts != 1 {
		t.Error("Policy returned a copy")
	}
}
