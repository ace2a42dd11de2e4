package upstream

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/big"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
	"go.yaml.in/yaml/v3"

	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/sglang"
)

// FuzzParseRetryAfter checks ParseRetryAfter against references: delta-seconds
// against big-integer arithmetic, dates against net/http's parser and against
// a date written with http.TimeFormat k seconds from now.
func FuzzParseRetryAfter(f *testing.F) {
	for _, s := range []string{
		"5", "0", " 120 ", "99999999999999999999999", "9223372036", "9223372037",
		"Thu, 01 Jan 2026 00:00:30 GMT", "Thursday, 01-Jan-26 00:01:00 GMT",
		"Thu Jan  1 00:00:07 2026", "-5", "+5", "1.5", "5s", "", "\t7\r\n", "0x10",
	} {
		f.Add([]byte(s), int64(1767225600), int32(30))
	}
	f.Fuzz(func(t *testing.T, v []byte, nowUnix int64, k int32) {
		now := time.Unix(nowUnix%(1<<40), 0).UTC() // years -32000..+36000
		d, ok := ParseRetryAfter(v, now)
		if ok && d < 0 {
			t.Fatalf("ParseRetryAfter(%q) = %v, negative", v, d)
		}
		if !ok && d != 0 {
			t.Fatalf("ParseRetryAfter(%q) refused but returned %v", v, d)
		}
		trimmed := bytes.TrimSpace(v)
		if d2, ok2 := ParseRetryAfter(trimmed, now); d2 != d || ok2 != ok {
			t.Fatalf("surrounding space changes the answer: %q -> %v,%v; %q -> %v,%v", v, d, ok, trimmed, d2, ok2)
		}
		switch {
		case len(trimmed) > 0 && strings.Trim(string(trimmed), "0123456789") == "":
			secs, _ := new(big.Int).SetString(string(trimmed), 10)
			limit := big.NewInt(int64(maxRetryAfter / time.Second))
			if secs.Cmp(limit) > 0 {
				secs = limit
			}
			want := time.Duration(secs.Int64()) * time.Second
			if !ok || d != want {
				t.Fatalf("ParseRetryAfter(%q) = %v, %v; want %v", v, d, ok, want)
			}
		case len(trimmed) > 0 && (trimmed[0] == '-' || trimmed[0] == '+'):
			if ok {
				t.Fatalf("signed value %q accepted as %v", v, d)
			}
		default:
			at, err := http.ParseTime(string(trimmed))
			if ok != (err == nil) {
				t.Fatalf("ParseRetryAfter(%q) ok=%v, http.ParseTime: %v", v, ok, err)
			}
			if ok && d != max(at.Sub(now), 0) {
				t.Fatalf("ParseRetryAfter(%q) = %v, want %v", v, d, max(at.Sub(now), 0))
			}
		}
		// A date k seconds from now, as a server writes it.
		at := now.Add(time.Duration(k) * time.Second)
		if at.Year() < 1000 || at.Year() > 9999 {
			return // http.TimeFormat writes four-digit years only
		}
		date := at.Format(http.TimeFormat)
		want := max(time.Duration(k)*time.Second, 0)
		if d, ok := ParseRetryAfter([]byte(date), now); !ok || d != want {
			t.Fatalf("ParseRetryAfter(%q) at %v = %v, %v; want %v", date, now, d, ok, want)
		}
	})
}

// fuzzTimeoutErr is a net.Error that timed out.
type fuzzTimeoutErr struct{}

func (fuzzTimeoutErr) Error() string   { return "i/o timeout" }
func (fuzzTimeoutErr) Timeout() bool   { return true }
func (fuzzTimeoutErr) Temporary() bool { return true }

// fuzzErr builds an exchange error from kind: nil, or one of the failures an
// exchange with an encoder can end in, wrapped kind/16 times.
func fuzzErr(kind uint8) error {
	var err error
	switch kind % 16 {
	case 0:
		return nil
	case 1:
		err = &DialError{Encoder: "e", Err: errors.New("connection refused")}
	case 2:
		err = &DialError{Encoder: "e", Err: &net.OpError{Op: "dial", Err: fuzzTimeoutErr{}}}
	case 3:
		err = &StaleConnError{Err: io.EOF}
	case 4:
		err = context.Canceled
	case 5:
		err = fasthttp.ErrNoFreeConns
	case 6:
		err = fasthttp.ErrTimeout
	case 7:
		err = context.DeadlineExceeded
	case 8:
		err = &net.OpError{Op: "read", Err: fuzzTimeoutErr{}}
	case 9:
		err = io.ErrUnexpectedEOF
	case 10:
		err = fasthttp.ErrBodyTooLarge
	case 11:
		err = errors.Join(errors.New("write: broken pipe"), context.Canceled)
	default:
		err = errors.New("connection reset by peer")
	}
	for range kind / 16 {
		err = fmt.Errorf("attempt: %w", err)
	}
	return err
}

// FuzzJudge checks the one classifier on arbitrary outcomes of every
// route: a 4xx answer is never a fault; provably-unsent outcomes are
// exactly those retried as connect_failure; a long-poll's timeout is never a
// fault; a /send is retried only when nothing was sent; the operator's
// ignore list only ever takes faults away; wrapping an error changes
// nothing; and the gateway's own envelope comes exactly with the failures
// that had no answer.
func FuzzJudge(f *testing.F) {
	f.Add(504, []byte(`{"status":"error","message":"encode metadata not ready"}`), uint8(0), 500, "already released", uint8(1))
	f.Add(500, []byte(`Encoder request was released`), uint8(0), 0, "", uint8(3))
	f.Add(500, []byte(`Internal Server Error`), uint8(0), 0, "", uint8(0))
	f.Add(400, []byte(`{"message":"bad"}`), uint8(0), 400, "bad", uint8(0))
	f.Add(503, []byte(`All encoder DP workers are dead.`), uint8(0), 503, "dead", uint8(0))
	f.Add(0, []byte(nil), uint8(1), 0, "", uint8(2))
	f.Add(0, []byte(nil), uint8(6), 0, "", uint8(1))
	f.Add(0, []byte(nil), uint8(4+16), 0, "", uint8(3))
	f.Add(600, []byte("x"), uint8(0), 599, "x", uint8(0))
	f.Add(-1, []byte("x"), uint8(0), 100, "", uint8(0))
	routes := []*sglang.Route{sglang.RouteEncode, sglang.RouteMetadata, sglang.RouteReceiveURL, sglang.RouteSend}
	f.Fuzz(func(t *testing.T, status int, body []byte, kind uint8, ignStatus int, ignBody string, route uint8) {
		rt := routes[int(route)%len(routes)]
		retry := DefaultRetry()
		pol := retry.Policy(rt.Label)
		var ignore []Condition
		if ignStatus >= 100 && ignStatus <= 599 {
			ignore = []Condition{{Kind: OnStatus, Status: ignStatus, BodyContains: ignBody}}
		}
		err := fuzzErr(kind)
		o := Observation{Status: status, Body: body, Err: err}
		tgt := Target{Encoder: "e", URL: "http://h:1"}
		v := Judge(rt, pol, ignore, tgt, o)
		plain := Judge(rt, pol, nil, tgt, o)
		switch {
		case err == nil && v.Kind != KindAnswered, err != nil && v.Kind == KindAnswered:
			t.Fatalf("%v: kind %s", err, v.Kind)
		case err == nil && status >= 400 && status <= 499 && v.Breaker == MarkFault:
			t.Fatalf("a %d answer counted as a fault", status)
		case err == nil && status < 400 && v.Breaker != MarkSuccess:
			t.Fatalf("a %d answer marked %s", status, v.Breaker)
		case (v.Delivery == NotSent) != (v.Reason == ReasonConnectFailure):
			t.Fatalf("%v: delivery %d, reason %q", err, v.Delivery, v.Reason)
		case rt.LongPoll && v.Kind == KindTimeout && v.Breaker == MarkFault:
			t.Fatalf("a %s timeout counted as a fault", rt.Path)
		case rt == sglang.RouteSend && v.Retry && v.Delivery != NotSent:
			t.Fatalf("a /send that may have been delivered is retried: %+v", o)
		case plain.Breaker != MarkFault && v.Breaker != plain.Breaker:
			t.Fatalf("the ignore list changed %s into %s", plain.Breaker, v.Breaker)
		case (v.Kind == KindAnswered) == (v.Message != ""):
			t.Fatalf("kind %s with message %q", v.Kind, v.Message)
		case v.Label == "" || v.Encoder != "e":
			t.Fatalf("label %q encoder %q", v.Label, v.Encoder)
		case v.Kind != KindAnswered && (v.Status < 500 || v.Status > 599):
			t.Fatalf("the gateway's own status %d", v.Status)
		}
		if err != nil {
			w := Judge(rt, pol, ignore, tgt, Observation{Status: status, Body: body, Err: fmt.Errorf("more: %w", err)})
			if w.Kind != v.Kind || w.Breaker != v.Breaker || w.Retry != v.Retry || w.Delivery != v.Delivery {
				t.Fatalf("wrapping %v changes its verdict from %+v to %+v", err, v, w)
			}
		}
	})
}

// FuzzConditionYAML decodes a condition strictly: never a panic, only
// statuses 100-599, and a decoded condition re-encodes (MarshalYAML, and
// String, which claims to be the YAML form) to itself.
func FuzzConditionYAML(f *testing.F) {
	for _, s := range []string{
		"connect_failure", "timeout", "{status: 504}", `{status: 504, body_contains: "encode metadata not ready"}`,
		"{status: 99}", "{status: 600}", "{status: 503, extra: 1}", "[1, 2]", "{status: x}",
		"{body_contains: \"\\u00e9\\t\\\"\"}", "status: 500\nbody_contains: 'it''s'", "~", "{status: 0x1f4}",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		var c Condition
		err := configfile.Decode([]byte(s), &c)
		if err != nil {
			return
		}
		if c == (Condition{}) {
			return // a null or empty document: UnmarshalYAML is not called
		}
		if c.Kind == OnStatus && (c.Status < 100 || c.Status > 599) {
			t.Fatalf("%q decoded to status %d", s, c.Status)
		}
		out, err := yaml.Marshal(c)
		if err != nil {
			t.Fatalf("marshal %+v: %v", c, err)
		}
		var back Condition
		if err := configfile.Decode(out, &back); err != nil || back != c {
			t.Fatalf("round trip %q -> %+v -> %q -> %+v, %v", s, c, out, back, err)
		}
		var fromString Condition
		if err := configfile.Decode([]byte(c.String()), &fromString); err != nil || fromString != c {
			t.Fatalf("String() = %q decodes to %+v, %v; want %+v", c.String(), fromString, err, c)
		}
	})
}

// FuzzBackoff checks Backoff's documented bounds for every policy Validate
// accepts: never negative, never above max_backoff, a positive Retry-After
// (capped by max_backoff) is a floor, and the full and equal jitters stay in
// their ranges.
func FuzzBackoff(f *testing.F) {
	f.Add(int64(50e6), int64(1e9), 2.0, uint8(0), 0.0, 3, 0.5, int64(0))
	f.Add(int64(100e6), int64(5e9), 2.0, uint8(1), 0.0, 60, 0.999, int64(7e9))
	f.Add(int64(1), int64(1), 1.0, uint8(2), 0.0, 1, 0.0, int64(-1))
	f.Add(int64(1e9), int64(2e9), 1.5, uint8(3), 0.2, 5, 1.0, int64(1e9))
	f.Add(int64(1), int64(math.MaxInt64), 10.0, uint8(2), 0.0, 20, 0.5, int64(0))
	f.Fuzz(func(t *testing.T, initial, maxB int64, mult float64, mode uint8, frac float64, n int, u float64, retryAfter int64) {
		p := DefaultRetry().Send
		p.InitialBackoff, p.MaxBackoff, p.Multiplier = configfile.Duration(initial), configfile.Duration(maxB), mult
		p.Jitter = []Jitter{{Mode: JitterFull}, {Mode: JitterEqual}, {Mode: JitterNone}, {Mode: JitterFraction, Fraction: frac}}[mode%4]
		var probs configfile.Problems
		p.validate(&probs, "retry.send", RouteSend)
		if probs.Err() != nil {
			return
		}
		w := p.Backoff(n, u, time.Duration(retryAfter))
		if w < 0 || w > p.MaxBackoff.D() {
			t.Fatalf("Backoff(%d, %v, %v) = %v, outside [0, %v] for %+v", n, u, retryAfter, w, p.MaxBackoff, p)
		}
		if retryAfter > 0 && w < min(time.Duration(retryAfter), p.MaxBackoff.D()) {
			t.Fatalf("Backoff(%d, %v, %v) = %v, below the Retry-After floor", n, u, retryAfter, w)
		}
		if retryAfter <= 0 && u >= 0 && u < 1 {
			none := p
			none.Jitter = Jitter{Mode: JitterNone}
			d := none.Backoff(n, u, 0)
			switch p.Jitter.Mode {
			case JitterFull:
				if w > d {
					t.Fatalf("full jitter: Backoff(%d, %v) = %v, above %v", n, u, w, d)
				}
			case JitterEqual:
				if w > d || w < d/2 { // not 2*w < d: 2*w overflows near the largest max_backoff
					t.Fatalf("equal jitter: Backoff(%d, %v) = %v, outside [%v/2, %v]", n, u, w, d, d)
				}
			}
		}
	})
}

// TestBackoffAtTheLargestMaxBackoff: float64(MaxInt64) rounds up to 2^63,
// and converting that back to a Duration gave a negative wait (found by
// FuzzBackoff).
func TestBackoffAtTheLargestMaxBackoff(t *testing.T) {
	p := DefaultRetry().Metadata
	p.InitialBackoff, p.MaxBackoff, p.Jitter = 1, configfile.Duration(math.MaxInt64), Jitter{Mode: JitterNone}
	for _, n := range []int{1, 20, 64} {
		if w := p.Backoff(n, 0.5, 0); w < 0 {
			t.Fatalf("Backoff(%d) = %v", n, w)
		}
	}
	if w := p.Backoff(64, 0.5, 0); w != time.Duration(math.MaxInt64) {
		t.Fatalf("Backoff(64) = %v, want the cap %v", w, time.Duration(math.MaxInt64))
	}
}
