package upstream

import (
	"math"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/encgate/encgate/internal/configfile"
	"go.yaml.in/yaml/v3"
)

func msDur(x float64) time.Duration { return time.Duration(math.Round(x * 1e6)) }

func TestBackoffJitterModes(t *testing.T) {
	// d for attempts 1..8: 100, 200, 400, 800, 1600, 3200, 5000 (6400
	// capped), 5000 (12800 capped) ms.
	tests := []struct {
		jitter Jitter
		u      float64
		want   [8]float64 // ms
	}{
		{Jitter{Mode: JitterFull}, 0, [8]float64{0, 0, 0, 0, 0, 0, 0, 0}},
		{Jitter{Mode: JitterFull}, 0.5, [8]float64{50, 100, 200, 400, 800, 1600, 2500, 2500}},
		{Jitter{Mode: JitterFull}, 0.999, [8]float64{99.9, 199.8, 399.6, 799.2, 1598.4, 3196.8, 4995, 4995}},
		{Jitter{Mode: JitterEqual}, 0, [8]float64{50, 100, 200, 400, 800, 1600, 2500, 2500}},
		{Jitter{Mode: JitterEqual}, 0.5, [8]float64{75, 150, 300, 600, 1200, 2400, 3750, 3750}},
		{Jitter{Mode: JitterEqual}, 0.999, [8]float64{99.95, 199.9, 399.8, 799.6, 1599.2, 3198.4, 4997.5, 4997.5}},
		{Jitter{Mode: JitterNone}, 0, [8]float64{100, 200, 400, 800, 1600, 3200, 5000, 5000}},
		{Jitter{Mode: JitterNone}, 0.5, [8]float64{100, 200, 400, 800, 1600, 3200, 5000, 5000}},
		{Jitter{Mode: JitterNone}, 0.999, [8]float64{100, 200, 400, 800, 1600, 3200, 5000, 5000}},
		{Jitter{Mode: JitterFraction, Fraction: 0.2}, 0, [8]float64{80, 160, 320, 640, 1280, 2560, 4000, 4000}},
		{Jitter{Mode: JitterFraction, Fraction: 0.2}, 0.5, [8]float64{100, 200, 400, 800, 1600, 3200, 5000, 5000}},
		// 1.1996 × d, and never above max_backoff.
		{Jitter{Mode: JitterFraction, Fraction: 0.2}, 0.999, [8]float64{119.96, 239.92, 479.84, 959.68, 1919.36, 3838.72, 5000, 5000}},
		{Jitter{Mode: JitterFraction, Fraction: 1}, 0, [8]float64{0, 0, 0, 0, 0, 0, 0, 0}},
	}
	for _, tc := range tests {
		p := RetryPolicy{
			InitialBackoff: retryDur(100 * time.Millisecond), MaxBackoff: retryDur(5 * time.Second),
			Multiplier: 2, Jitter: tc.jitter,
		}
		for n := 1; n <= 8; n++ {
			if got, want := p.Backoff(n, tc.u, 0), msDur(tc.want[n-1]); got != want {
				t.Errorf("jitter %s u=%g: Backoff(%d) = %v, want %v", tc.jitter, tc.u, n, got, want)
			}
		}
	}
}

func TestBackoffEdges(t *testing.T) {
	p := RetryPolicy{
		InitialBackoff: retryDur(50 * time.Millisecond), MaxBackoff: retryDur(30 * time.Second),
		Multiplier: 1.5, Jitter: Jitter{Mode: JitterNone},
	}
	// smg's defaults: about 50, 75, 112.5 and 168.75 ms.
	for n, want := range []float64{50, 75, 112.5, 168.75} {
		if got := p.Backoff(n+1, 0, 0); got != msDur(want) {
			t.Errorf("multiplier 1.5: Backoff(%d) = %v, want %vms", n+1, got, want)
		}
	}
	if got := p.Backoff(0, 0, 0); got != msDur(50) {
		t.Errorf("Backoff(0) = %v, want the first wait", got)
	}
	if got := p.Backoff(10000, 0, 0); got != 30*time.Second {
		t.Errorf("Backoff(10000) = %v, want the cap", got)
	}
	p.Multiplier = 1
	if got := p.Backoff(7, 0, 0); got != msDur(50) {
		t.Errorf("multiplier 1: Backoff(7) = %v, want constant 50ms", got)
	}
	p.Jitter = Jitter{Mode: JitterFull}
	if got := p.Backoff(1, 1.5, 0); got > msDur(50) {
		t.Errorf("u out of range: Backoff = %v, want <= 50ms", got)
	}
	if got := p.Backoff(1, math.NaN(), 0); got != 0 {
		t.Errorf("u NaN: Backoff = %v, want 0", got)
	}
}

func TestBackoffRetryAfter(t *testing.T) {
	base := RetryPolicy{
		InitialBackoff: retryDur(100 * time.Millisecond), MaxBackoff: retryDur(5 * time.Second), Multiplier: 2,
	}
	tests := []struct {
		jitter Jitter
		n      int
		u      float64
		ra     time.Duration
		want   time.Duration
	}{
		// Larger than d: replaces it and is not jittered below itself.
		{Jitter{Mode: JitterFull}, 1, 0, 2 * time.Second, 2 * time.Second},
		{Jitter{Mode: JitterFull}, 1, 0.999, 2 * time.Second, 2 * time.Second},
		{Jitter{Mode: JitterEqual}, 1, 0, 2 * time.Second, 2 * time.Second},
		{Jitter{Mode: JitterNone}, 1, 0.5, 2 * time.Second, 2 * time.Second},
		{Jitter{Mode: JitterFraction, Fraction: 0.2}, 1, 0, 2 * time.Second, 2 * time.Second},
		{Jitter{Mode: JitterFraction, Fraction: 0.2}, 1, 0.999, 2 * time.Second, msDur(2399.2)},
		// Capped by max_backoff.
		{Jitter{Mode: JitterFull}, 1, 0.5, time.Minute, 5 * time.Second},
		{Jitter{Mode: JitterNone}, 1, 0, time.Minute, 5 * time.Second},
		{Jitter{Mode: JitterFraction, Fraction: 0.2}, 1, 0.999, time.Minute, 5 * time.Second},
		// Smaller than d: d stays, but the wait is never below Retry-After.
		{Jitter{Mode: JitterFull}, 3, 0.5, 50 * time.Millisecond, 200 * time.Millisecond},
		{Jitter{Mode: JitterFull}, 3, 0, 50 * time.Millisecond, 50 * time.Millisecond},
		{Jitter{Mode: JitterNone}, 3, 0, 50 * time.Millisecond, 400 * time.Millisecond},
		// Zero or negative: ignored.
		{Jitter{Mode: JitterFull}, 2, 0.5, 0, 100 * time.Millisecond},
		{Jitter{Mode: JitterFull}, 2, 0.5, -time.Second, 100 * time.Millisecond},
	}
	for _, tc := range tests {
		p := base
		p.Jitter = tc.jitter
		if got := p.Backoff(tc.n, tc.u, tc.ra); got != tc.want {
			t.Errorf("jitter %s n=%d u=%g Retry-After %v: Backoff = %v, want %v", tc.jitter, tc.n, tc.u, tc.ra, got, tc.want)
		}
	}
}

func TestTryTimeout(t *testing.T) {
	p := RetryPolicy{PerTryTimeout: retryDur(30 * time.Second), Deadline: retryDur(180 * time.Second)}
	tests := []struct {
		elapsed time.Duration
		want    time.Duration
		ok      bool
	}{
		{0, 30 * time.Second, true},
		{149 * time.Second, 30 * time.Second, true},
		{170 * time.Second, 10 * time.Second, true},
		{180 * time.Second, 0, false},
		{200 * time.Second, 0, false},
	}
	for _, tc := range tests {
		got, ok := p.TryTimeout(tc.elapsed)
		if got != tc.want || ok != tc.ok {
			t.Errorf("TryTimeout(%v) = %v, %v; want %v, %v", tc.elapsed, got, ok, tc.want, tc.ok)
		}
	}
	// Metadata defaults: six 30s tries fit in 180s only without backoff, so
	// the last try is shortened to what the deadline leaves.
	m := DefaultRetry().Metadata
	elapsed := time.Duration(0)
	tries := 0
	for n := 1; n <= m.MaxAttempts; n++ {
		to, ok := m.TryTimeout(elapsed)
		if !ok {
			break
		}
		tries++
		elapsed += to + m.Backoff(n, 0.999, 0) // every try times out
	}
	if tries != 6 || elapsed < m.Deadline.D() {
		t.Errorf("metadata defaults: %d tries using %v", tries, elapsed)
	}
}

func TestParseRetryAfter(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC) // a Thursday
	tests := []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"5", 5 * time.Second, true},
		{"0", 0, true},
		{" 120 ", 120 * time.Second, true},
		{"99999999999999999999999", maxRetryAfter, true},
		{"Thu, 01 Jan 2026 00:00:30 GMT", 30 * time.Second, true}, // IMF-fixdate
		{"Thursday, 01-Jan-26 00:01:00 GMT", time.Minute, true},   // RFC 850
		{"Thu Jan  1 00:00:07 2026", 7 * time.Second, true},       // asctime
		{"Wed, 31 Dec 2025 23:59:00 GMT", 0, true},                // in the past
		{"-5", 0, false},
		{"1.5", 0, false},
		{"5s", 0, false},
		{"soon", 0, false},
		{"", 0, false},
		{"   ", 0, false},
		{"Thu, 01 Jan 2026 00:00:30", 0, false},
	}
	for _, tc := range tests {
		got, ok := ParseRetryAfter([]byte(tc.in), now)
		if got != tc.want || ok != tc.ok {
			t.Errorf("ParseRetryAfter(%q) = %v, %v; want %v, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
}

type retryTimeoutErr struct{}

func (retryTimeoutErr) Error() string   { return "i/o timeout" }
func (retryTimeoutErr) Timeout() bool   { return true }
func (retryTimeoutErr) Temporary() bool { return true }

func TestValidate(t *testing.T) {
	var p configfile.Problems
	DefaultRetry().Validate(&p, "retry")
	if err := p.Err(); err != nil {
		t.Fatalf("defaults are invalid: %v", err)
	}
	tests := []struct {
		name string
		edit func(c *RetryConfig)
		want string
	}{
		{"max_attempts 0", func(c *RetryConfig) { c.Metadata.MaxAttempts = 0 },
			"retry.metadata.max_attempts: must be between 1 and 20, got 0"},
		{"max_attempts 21", func(c *RetryConfig) { c.Encode.MaxAttempts = 21 },
			"retry.encode.max_attempts: must be between 1 and 20, got 21"},
		{"initial_backoff", func(c *RetryConfig) { c.Send.InitialBackoff = 0 },
			"retry.send.initial_backoff: must be > 0, got 0s"},
		{"max_backoff", func(c *RetryConfig) { c.ReceiveURL.MaxBackoff = retryDur(50 * time.Millisecond) },
			"retry.receive_url.max_backoff: must be >= initial_backoff (100ms), got 50ms"},
		{"multiplier", func(c *RetryConfig) { c.Metadata.Multiplier = 0.5 },
			"retry.metadata.multiplier: must be a number >= 1, got 0.5"},
		{"multiplier NaN", func(c *RetryConfig) { c.Metadata.Multiplier = math.NaN() },
			"retry.metadata.multiplier: must be a number >= 1, got NaN"},
		{"jitter 0", func(c *RetryConfig) { c.Metadata.Jitter = Jitter{Mode: JitterFraction} },
			"retry.metadata.jitter: must be full, equal, none or a fraction in (0,1], got 0"},
		{"jitter 1.5", func(c *RetryConfig) { c.Encode.Jitter = Jitter{Mode: JitterFraction, Fraction: 1.5} },
			"retry.encode.jitter: must be full, equal, none or a fraction in (0,1], got 1.5"},
		{"jitter unset", func(c *RetryConfig) { c.Send.Jitter = Jitter{} },
			"retry.send.jitter: must be full, equal, none or a fraction in (0,1], got "},
		{"per_try_timeout", func(c *RetryConfig) { c.Encode.PerTryTimeout = 0 },
			"retry.encode.per_try_timeout: must be > 0, got 0s"},
		{"deadline", func(c *RetryConfig) { c.ReceiveURL.Deadline = retryDur(-time.Second) },
			"retry.receive_url.deadline: must be > 0, got -1s"},
		{"send timeout", func(c *RetryConfig) { c.Send.RetryOn = append(c.Send.RetryOn, Condition{Kind: OnTimeout}) },
			"retry.send.retry_on[1]: /send may only be retried on connect_failure: a /send that reached the encoder re-writes the receiver's buffer and sends a second ack; got timeout"},
		{"send 503", func(c *RetryConfig) {
			c.Send.RetryOn = []Condition{{Kind: OnStatus, Status: 503}, {Kind: OnConnectFailure}}
		}, "retry.send.retry_on[0]: /send may only be retried on connect_failure: a /send that reached the encoder re-writes the receiver's buffer and sends a second ack; got {status: 503}"},
		{"encode timeout", func(c *RetryConfig) { c.Encode.RetryOn = append(c.Encode.RetryOn, Condition{Kind: OnTimeout}) },
			`retry.encode.retry_on[2]: /encode may only be retried on connect_failure or {status: 503, body_contains: "All encoder DP workers are dead."}: once an /encode was delivered, the encoder may have staged or pushed the embedding, and 4xx are final; got timeout`},
		{"encode bare 503", func(c *RetryConfig) { c.Encode.RetryOn[1] = Condition{Kind: OnStatus, Status: 503} },
			`retry.encode.retry_on[1]: /encode may only be retried on connect_failure or {status: 503, body_contains: "All encoder DP workers are dead."}: once an /encode was delivered, the encoder may have staged or pushed the embedding, and 4xx are final; got {status: 503}`},
		{"encode 429", func(c *RetryConfig) { c.Encode.RetryOn = []Condition{{Kind: OnStatus, Status: 429}} },
			`retry.encode.retry_on[0]: /encode may only be retried on connect_failure or {status: 503, body_contains: "All encoder DP workers are dead."}: once an /encode was delivered, the encoder may have staged or pushed the embedding, and 4xx are final; got {status: 429}`},
		{"metadata 4xx", func(c *RetryConfig) {
			c.Metadata.RetryOn = append(c.Metadata.RetryOn, Condition{Kind: OnStatus, Status: 404, BodyContains: "x"})
		}, `retry.metadata.retry_on[4]: 4xx answers are never retried: they are the caller's fault and do not change on retry; got {status: 404, body_contains: "x"}`},
		{"receive_url 429", func(c *RetryConfig) { c.ReceiveURL.RetryOn[1] = Condition{Kind: OnStatus, Status: 429} },
			"retry.receive_url.retry_on[1]: 4xx answers are never retried: they are the caller's fault and do not change on retry; got {status: 429}"},
		{"receive_url 200", func(c *RetryConfig) { c.ReceiveURL.RetryOn[2] = Condition{Kind: OnStatus, Status: 200} },
			"retry.receive_url.retry_on[2]: only 5xx answers may be retried: a 200 is a final answer; got {status: 200}"},
		{"budget ratio", func(c *RetryConfig) { c.Budget.Ratio = 11 },
			"retry.budget.ratio: must be between 0 and 10, got 11"},
		{"budget ratio negative", func(c *RetryConfig) { c.Budget.Ratio = -0.1 },
			"retry.budget.ratio: must be between 0 and 10, got -0.1"},
		{"budget min_per_second", func(c *RetryConfig) { c.Budget.MinPerSecond = -1 },
			"retry.budget.min_per_second: must be a number >= 0, got -1"},
		{"budget window", func(c *RetryConfig) { c.Budget.Window = retryDur(500 * time.Millisecond) },
			"retry.budget.window: must be >= 1s, got 500ms"},
	}
	for _, tc := range tests {
		c := DefaultRetry()
		tc.edit(&c)
		var p configfile.Problems
		c.Validate(&p, "retry")
		err := p.Err()
		if err == nil || err.Error() != tc.want {
			t.Errorf("%s:\n got %v\nwant %s", tc.name, err, tc.want)
		}
	}
	// Allowed edge values.
	c := DefaultRetry()
	c.Metadata.MaxAttempts, c.Send.MaxAttempts = 1, 20
	c.Metadata.MaxBackoff = c.Metadata.InitialBackoff
	c.Metadata.Multiplier = 1
	c.Metadata.Jitter = Jitter{Mode: JitterFraction, Fraction: 1}
	c.ReceiveURL.RetryOn = nil
	c.Metadata.RetryOn = []Condition{{Kind: OnStatus, Status: 500}, {Kind: OnTimeout}}
	c.Budget = BudgetConfig{Ratio: 0, MinPerSecond: 0, Window: retryDur(time.Second)}
	var pr configfile.Problems
	c.Validate(&pr, "retry")
	if err := pr.Err(); err != nil {
		t.Errorf("edge values refused: %v", err)
	}
	// Every problem is reported, not just the first.
	c = DefaultRetry()
	c.Metadata.MaxAttempts, c.Send.Deadline, c.Budget.Window = 0, 0, 0
	pr = configfile.Problems{}
	c.Validate(&pr, "retry")
	if n := len(strings.Split(pr.Err().Error(), "\n")); n != 3 {
		t.Errorf("want 3 problems, got %d: %v", n, pr.Err())
	}
}

type retryFile struct {
	Retry RetryConfig `yaml:"retry"`
}

func TestDecodeRetry(t *testing.T) {
	tests := []struct {
		name string
		in   string
		edit func(c *RetryConfig) // the expected change to the defaults
	}{
		{"empty", "", func(*RetryConfig) {}},
		{"partial override", "retry: {metadata: {max_attempts: 2}}", func(c *RetryConfig) { c.Metadata.MaxAttempts = 2 }},
		{"durations", "retry:\n  send:\n    per_try_timeout: 10s\n    deadline: 1m\n", func(c *RetryConfig) {
			c.Send.PerTryTimeout, c.Send.Deadline = retryDur(10*time.Second), retryDur(time.Minute)
		}},
		{"jitter equal", "retry: {encode: {jitter: equal}}", func(c *RetryConfig) { c.Encode.Jitter = Jitter{Mode: JitterEqual} }},
		{"jitter none", "retry: {encode: {jitter: none}}", func(c *RetryConfig) { c.Encode.Jitter = Jitter{Mode: JitterNone} }},
		{"jitter full", "retry: {encode: {jitter: full}}", func(c *RetryConfig) {}},
		{"jitter 0.2", "retry: {metadata: {jitter: 0.2}}", func(c *RetryConfig) {
			c.Metadata.Jitter = Jitter{Mode: JitterFraction, Fraction: 0.2}
		}},
		{"jitter 1", "retry: {metadata: {jitter: 1}}", func(c *RetryConfig) {
			c.Metadata.Jitter = Jitter{Mode: JitterFraction, Fraction: 1}
		}},
		{"jitter 0 decodes, Validate refuses", "retry: {metadata: {jitter: 0}}", func(c *RetryConfig) {
			c.Metadata.Jitter = Jitter{Mode: JitterFraction}
		}},
		{"retry_on replaces", "retry:\n  receive_url:\n    retry_on:\n      - timeout\n      - {status: 502}\n      - {status: 504, body_contains: \"not ready\"}\n", func(c *RetryConfig) {
			c.ReceiveURL.RetryOn = []Condition{{Kind: OnTimeout}, {Kind: OnStatus, Status: 502}, {Kind: OnStatus, Status: 504, BodyContains: "not ready"}}
		}},
		{"retry_on emptied", "retry: {metadata: {retry_on: []}}", func(c *RetryConfig) { c.Metadata.RetryOn = []Condition{} }},
		{"budget partial", "retry: {budget: {ratio: 0.1}}", func(c *RetryConfig) { c.Budget.Ratio = 0.1 }},
		{"budget window", "retry: {budget: {window: 30s, min_per_second: 0}}", func(c *RetryConfig) {
			c.Budget.Window, c.Budget.MinPerSecond = retryDur(30*time.Second), 0
		}},
	}
	for _, tc := range tests {
		got := retryFile{Retry: DefaultRetry()}
		if err := configfile.Decode([]byte(tc.in), &got); err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		want := DefaultRetry()
		tc.edit(&want)
		if !reflect.DeepEqual(got.Retry, want) {
			t.Errorf("%s:\n got %+v\nwant %+v", tc.name, got.Retry, want)
		}
	}

	bad := []struct{ in, want string }{
		{"retry: {metadata: {jitter: sometimes}}", `retry.metadata.jitter: jitter "sometimes" is not full, equal, none or a fraction`},
		{"retry: {metadata: {jitter: [1]}}", "want a jitter"},
		{"retry: {metadata: {max_attempt: 2}}", `retry.metadata.max_attempt: unknown key, did you mean "max_attempts"? (line 1)`},
		{"retry: {send: {retry_on: [reset]}}", `unknown condition "reset"`},
		{"retry: {send: {retry_on: [{status: 503, body: x}]}}", `unknown key "body"`},
		{"retry: {budget: {window: soon}}", `"soon" is not a duration`},
		{"retry: {health: {}}", "retry.health: unknown key (line 1)"},
	}
	for _, tc := range bad {
		got := retryFile{Retry: DefaultRetry()}
		err := configfile.Decode([]byte(tc.in), &got)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Decode(%q) = %v, want %q", tc.in, err, tc.want)
		}
	}
}

func TestMarshalRetryRoundTrip(t *testing.T) {
	c := DefaultRetry()
	c.Send.Jitter = Jitter{Mode: JitterFraction, Fraction: 0.25}
	c.Encode.Jitter = Jitter{Mode: JitterEqual}
	out, err := yaml.Marshal(retryFile{Retry: c})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"jitter: 0.25", "jitter: equal", "jitter: full", "initial_backoff: 100ms",
		"- connect_failure", "body_contains: encode metadata not ready"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("marshalled config lacks %q:\n%s", want, out)
		}
	}
	var back retryFile
	if err := configfile.Decode(out, &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back.Retry, c) {
		t.Errorf("round trip:\n got %+v\nwant %+v", back.Retry, c)
	}
	if s := (Jitter{Mode: JitterFraction, Fraction: 0.2}).String(); s != "0.2" {
		t.Errorf("String = %q", s)
	}
	if s := (Jitter{Mode: JitterNone}).String(); s != "none" {
		t.Errorf("String = %q", s)
	}
}
