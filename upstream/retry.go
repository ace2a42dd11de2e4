package upstream

import (
	"bytes"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/sglang"
	"go.yaml.in/yaml/v3"
)

// Jitter modes.
const (
	// JitterFull waits U[0,d) (Envoy, AWS "full jitter"): the best spread.
	JitterFull = "full"
	// JitterEqual waits d/2 + U[0,d/2): never less than half the backoff.
	JitterEqual = "equal"
	// JitterNone waits exactly d.
	JitterNone = "none"
	// JitterFraction waits d·(1 + U[-f,+f)) (smg's jitter_factor, gRPC A6's
	// random(0.8, 1.2) for f = 0.2).
	JitterFraction = "fraction"
)

// Jitter says how a backoff is randomised. In YAML it is one of the words
// full, equal, none, or a number in (0,1] such as 0.2 (Mode "fraction").
type Jitter struct {
	Mode     string
	Fraction float64
}

// String writes j as it is written in YAML.
func (j Jitter) String() string {
	if j.Mode == JitterFraction {
		return strconv.FormatFloat(j.Fraction, 'g', -1, 64)
	}
	return j.Mode
}

// UnmarshalYAML reads a jitter word or a fraction. The range of a fraction is
// checked by Validate, so that the problem comes with its field path.
func (j *Jitter) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return configfile.ValueError(n, "want a jitter: full, equal, none or a fraction such as 0.2")
	}
	switch n.Value {
	case JitterFull, JitterEqual, JitterNone:
		*j = Jitter{Mode: n.Value}
		return nil
	}
	f, err := strconv.ParseFloat(n.Value, 64)
	if err != nil {
		return configfile.ValueError(n, "jitter %q is not full, equal, none or a fraction such as 0.2", n.Value)
	}
	*j = Jitter{Mode: JitterFraction, Fraction: f}
	return nil
}

// MarshalYAML writes j back as a word or a number.
func (j Jitter) MarshalYAML() (any, error) {
	if j.Mode == JitterFraction {
		return j.Fraction, nil
	}
	return j.Mode, nil
}

func (j Jitter) valid() bool {
	switch j.Mode {
	case JitterFull, JitterEqual, JitterNone:
		return true
	case JitterFraction:
		return j.Fraction > 0 && j.Fraction <= 1 // false for NaN too
	}
	return false
}

// RetryPolicy is how one route is retried.
type RetryPolicy struct {
	// MaxAttempts counts every attempt, the first included (>= 1; 1 means
	// no retry). smg's max_retries counts the same way.
	MaxAttempts int `yaml:"max_attempts"`
	// InitialBackoff is the wait before the first retry, before jitter.
	InitialBackoff configfile.Duration `yaml:"initial_backoff"`
	// MaxBackoff caps every wait, Retry-After included.
	MaxBackoff configfile.Duration `yaml:"max_backoff"`
	// Multiplier grows the wait from one retry to the next (>= 1).
	Multiplier float64 `yaml:"multiplier"`
	// Jitter randomises each wait.
	Jitter Jitter `yaml:"jitter"`
	// PerTryTimeout bounds one attempt.
	PerTryTimeout configfile.Duration `yaml:"per_try_timeout"`
	// Deadline bounds all attempts and the waits between them together, as
	// Envoy's route timeout does, so retries cannot multiply a timeout.
	Deadline configfile.Duration `yaml:"deadline"`
	// RetryOn lists the outcomes that may be retried. A list given in YAML
	// replaces the default list; it is not merged with it.
	RetryOn []Condition `yaml:"retry_on"`
}

// BudgetConfig bounds retries across all requests of a route (Finagle's
// RetryBudget, Envoy's retry_budget): retries in the last Window may be at
// most Ratio × requests in the last Window plus MinPerSecond × Window.
type BudgetConfig struct {
	// Ratio is the fraction of requests that retries may add (0.2).
	Ratio float64 `yaml:"ratio"`
	// MinPerSecond is a floor of retries per second, so that a quiet
	// gateway can still retry (10).
	MinPerSecond float64 `yaml:"min_per_second"`
	// Window is how long a request counts towards the budget, Finagle's
	// deposit TTL (10s). Counted in whole seconds, rounded up.
	Window configfile.Duration `yaml:"window"`
}

// RetryConfig holds the retry policy of each upstream route and the retry
// budget.
type RetryConfig struct {
	// Metadata is the policy of POST /scheduler_receive_meta_data, a
	// receiver rank's metadata pull.
	Metadata RetryPolicy `yaml:"metadata"`
	// ReceiveURL is the policy of POST /scheduler_receive_url, a receiver
	// rank's registration of where the embedding goes.
	ReceiveURL RetryPolicy `yaml:"receive_url"`
	// Encode is the policy of POST /encode.
	Encode RetryPolicy `yaml:"encode"`
	// Send is the policy of POST /send.
	Send RetryPolicy `yaml:"send"`
	// Budget bounds the retries of each route: over a sliding window they
	// may add at most ratio × requests plus min_per_second × window; when it
	// is spent, the last answer goes back at once.
	Budget BudgetConfig `yaml:"budget"`
}

// Route labels, as Policy takes them and metrics carry them.
const (
	RouteMetadata   = sglang.LabelMetadata
	RouteReceiveURL = sglang.LabelReceiveURL
	RouteEncode     = sglang.LabelEncode
	RouteSend       = sglang.LabelSend
)

func retryDur(d time.Duration) configfile.Duration { return configfile.Duration(d) }

// DefaultRetry returns the retry defaults.
func DefaultRetry() RetryConfig {
	return RetryConfig{
		Metadata: RetryPolicy{
			MaxAttempts:    6,
			InitialBackoff: retryDur(100 * time.Millisecond),
			MaxBackoff:     retryDur(5 * time.Second),
			Multiplier:     2,
			Jitter:         Jitter{Mode: JitterFull},
			// sglang's encoder blocks a metadata pull up to 180s waiting for
			// the part (meta_registry.wait) before it answers 504. A 30s
			// per-try timeout plus `timeout` in retry_on re-asks within the
			// 180s deadline instead of holding one exchange for all of it;
			// the pull is a read, so asking again is safe.
			PerTryTimeout: retryDur(30 * time.Second),
			Deadline:      retryDur(180 * time.Second),
			RetryOn: []Condition{
				{Kind: OnStatus, Status: 504, BodyContains: sglang.MetadataNotReady},
				// A GEN1 DP encoder's words for the same wait (§12).
				{Kind: OnStatus, Status: 504, BodyContains: sglang.DPMetadataTimedOut},
				{Kind: OnConnectFailure},
				{Kind: OnTimeout},
			},
		},
		ReceiveURL: RetryPolicy{
			MaxAttempts:    3,
			InitialBackoff: retryDur(100 * time.Millisecond),
			MaxBackoff:     retryDur(2 * time.Second),
			Multiplier:     2,
			Jitter:         Jitter{Mode: JitterFull},
			// The encoder may legitimately hold it up to 180s waiting for
			// the /encode of the same req_id.
			PerTryTimeout: retryDur(200 * time.Second),
			Deadline:      retryDur(600 * time.Second),
			// Registering a receive URL is a set operation, so repeating
			// it is idempotent.
			RetryOn: []Condition{
				{Kind: OnConnectFailure},
				{Kind: OnStatus, Status: 503},
				{Kind: OnStatus, Status: 504},
			},
		},
		Encode: RetryPolicy{
			MaxAttempts:    3,
			InitialBackoff: retryDur(50 * time.Millisecond),
			MaxBackoff:     retryDur(1 * time.Second),
			Multiplier:     2,
			Jitter:         Jitter{Mode: JitterFull},
			// A healthy encoder answers every /encode within its own two
			// bounds (protocol reference §1.1, §7): the batch watchdog,
			// SGLANG_ENCODER_REQ_TIMEOUT (180s, then 504 "encoder batch
			// timed out"; a DP rank's future has the same 180s), and for
			// zmq_to_scheduler, after the encode, the wait for the
			// receivers' registrations, SGLANG_ENCODER_SEND_TIMEOUT (180s,
			// then it still answers 200). 40s above those 360s covers what
			// neither bound counts (loading media, the queue before a batch,
			// the answer on the wire), so no healthy /encode is cut, while
			// an encoder that stopped answering (SIGSTOP, a wedged process,
			// a link that keeps the socket open) holds an /encode 400s and
			// no longer: the try ends in a 504 that counts against its
			// breaker. The earlier 1800s was the receiver's whole budget for
			// the call (SGLANG_ENCODER_HTTP_TIMEOUT): a stopped encoder held
			// every /encode sent to it for 30 minutes, and the receiver gave
			// up at the moment the gateway would have answered.
			PerTryTimeout: retryDur(400 * time.Second),
			// Retries follow only outcomes where nothing was sent (a failed
			// connect, a full in-flight limit or breaker, "All encoder DP
			// workers are dead."), which come early: 20s over one try
			// leaves the last attempt a whole try after two connect
			// timeouts (upstream.connect_timeout, 5s) and their backoffs
			// (max_backoff, 1s). Far below the receiver's 1800s, so the
			// gateway's answer, not the receiver's timeout, ends the call.
			Deadline: retryDur(420 * time.Second),
			RetryOn: []Condition{
				{Kind: OnConnectFailure},
				{Kind: OnStatus, Status: 503, BodyContains: sglang.DPWorkersDead},
			},
		},
		Send: RetryPolicy{
			MaxAttempts:    3,
			InitialBackoff: retryDur(50 * time.Millisecond),
			MaxBackoff:     retryDur(1 * time.Second),
			Multiplier:     2,
			Jitter:         Jitter{Mode: JitterFull},
			PerTryTimeout:  retryDur(180 * time.Second),
			Deadline:       retryDur(180 * time.Second),
			RetryOn:        []Condition{{Kind: OnConnectFailure}},
		},
		Budget: BudgetConfig{Ratio: 0.2, MinPerSecond: 10, Window: retryDur(10 * time.Second)},
	}
}

// Policy returns the policy for a route label: "metadata", "receive_url",
// "encode", "send"; nil for any other.
func (c *RetryConfig) Policy(route string) *RetryPolicy {
	switch route {
	case RouteMetadata:
		return &c.Metadata
	case RouteReceiveURL:
		return &c.ReceiveURL
	case RouteEncode:
		return &c.Encode
	case RouteSend:
		return &c.Send
	}
	return nil
}

// Validate checks every policy and the budget; path is the field path of c
// ("retry"), so problems read like retry.send.retry_on[1].
func (c RetryConfig) Validate(p *configfile.Problems, path string) {
	for _, route := range []string{RouteMetadata, RouteReceiveURL, RouteEncode, RouteSend} {
		c.Policy(route).validate(p, path+"."+route, route)
	}
	b := c.Budget
	bp := path + ".budget"
	if !(b.Ratio >= 0 && b.Ratio <= 10) {
		p.Addf(bp+".ratio", "must be between 0 and 10, got %g", b.Ratio)
	}
	if !(b.MinPerSecond >= 0) || math.IsInf(b.MinPerSecond, 1) {
		p.Addf(bp+".min_per_second", "must be a number >= 0, got %g", b.MinPerSecond)
	}
	if b.Window < retryDur(time.Second) {
		p.Addf(bp+".window", "must be >= 1s, got %s", b.Window)
	}
}

func (r *RetryPolicy) validate(p *configfile.Problems, path, route string) {
	if r.MaxAttempts < 1 || r.MaxAttempts > 20 {
		p.Addf(path+".max_attempts", "must be between 1 and 20, got %d", r.MaxAttempts)
	}
	p.Positive(path+".initial_backoff", r.InitialBackoff)
	if r.MaxBackoff < r.InitialBackoff {
		p.Addf(path+".max_backoff", "must be >= initial_backoff (%s), got %s", r.InitialBackoff, r.MaxBackoff)
	}
	if !(r.Multiplier >= 1) || math.IsInf(r.Multiplier, 1) {
		p.Addf(path+".multiplier", "must be a number >= 1, got %g", r.Multiplier)
	}
	if !r.Jitter.valid() {
		p.Addf(path+".jitter", "must be full, equal, none or a fraction in (0,1], got %s", r.Jitter)
	}
	p.Positive(path+".per_try_timeout", r.PerTryTimeout)
	p.Positive(path+".deadline", r.Deadline)
	for i, c := range r.RetryOn {
		if why := refuse(route, c); why != "" {
			p.Addf(path+".retry_on["+itoa(i)+"]", "%s; got %s", why, c)
		}
	}
}

// refuse says why route must not be retried on c, or "" when it may be.
func refuse(route string, c Condition) string {
	switch route {
	case RouteSend:
		if c.Kind != OnConnectFailure {
			return "/send may only be retried on connect_failure: a /send that reached the encoder re-writes the receiver's buffer and sends a second ack"
		}
		return ""
	case RouteEncode:
		if c.Kind != OnConnectFailure && c != (Condition{Kind: OnStatus, Status: 503, BodyContains: sglang.DPWorkersDead}) {
			return "/encode may only be retried on connect_failure or {status: 503, body_contains: \"" + sglang.DPWorkersDead +
				"\"}: once an /encode was delivered, the encoder may have staged or pushed the embedding, and 4xx are final"
		}
		return ""
	}
	if c.Kind != OnStatus {
		return ""
	}
	switch {
	case c.Status >= 400 && c.Status < 500:
		return "4xx answers are never retried: they are the caller's fault and do not change on retry"
	case c.Status < 400:
		return "only 5xx answers may be retried: a " + itoa(c.Status) + " is a final answer"
	}
	return ""
}

// Backoff returns the wait before retry number n (n = 1 is the wait after
// the first attempt). With d = min(InitialBackoff × Multiplier^(n-1),
// MaxBackoff) and u a uniform random number in [0,1) supplied by the caller:
//
//	full:       u·d                 in [0, d)
//	equal:      d/2 + u·d/2         in [d/2, d)
//	none:       d
//	fraction f: d·(1 + f·(2u-1))    in [d(1-f), d(1+f)), clamped to [0, MaxBackoff]
//
// A positive retryAfter (the encoder's Retry-After) is a floor: capped by
// MaxBackoff, it replaces d when larger, and the jittered wait is never
// below it. A policy with an unknown jitter mode waits d.
func (p *RetryPolicy) Backoff(n int, u float64, retryAfter time.Duration) time.Duration {
	if n < 1 {
		n = 1
	}
	if !(u >= 0) { // NaN too
		u = 0
	} else if u >= 1 {
		u = math.Nextafter(1, 0)
	}
	maxB := float64(p.MaxBackoff)
	if maxB < 0 {
		maxB = 0
	}
	d := float64(p.InitialBackoff) * math.Pow(p.Multiplier, float64(n-1))
	if !(d <= maxB) { // beyond the cap, +Inf or NaN
		d = maxB
	}
	if d < 0 {
		d = 0
	}
	floor := 0.0
	if retryAfter > 0 {
		floor = math.Min(float64(retryAfter), maxB)
		d = math.Max(d, floor)
	}
	var w float64
	switch p.Jitter.Mode {
	case JitterFull:
		w = d * u
	case JitterEqual:
		w = d/2 + d/2*u
	case JitterFraction:
		w = d * (1 + p.Jitter.Fraction*(2*u-1))
		w = math.Min(math.Max(w, 0), maxB)
	default:
		w = d
	}
	w = math.Max(w, floor)
	if w >= maxB { // float64 rounding can put maxB above MaxBackoff (up to 2^63, which overflows)
		return max(p.MaxBackoff.D(), 0)
	}
	return time.Duration(math.Round(w))
}

// TryTimeout returns the timeout for an attempt that starts elapsed after
// the first attempt started: PerTryTimeout, shortened to what is left of
// Deadline. ok is false when the deadline leaves no time for an attempt,
// so a caller asks TryTimeout(elapsed + backoff) before it waits.
func (p *RetryPolicy) TryTimeout(elapsed time.Duration) (time.Duration, bool) {
	left := p.Deadline.D() - elapsed
	if left <= 0 {
		return 0, false
	}
	return min(p.PerTryTimeout.D(), left), true
}

// maxRetryAfter bounds a delta-seconds value so it fits a time.Duration.
const maxRetryAfter = time.Duration(math.MaxInt64 / int64(time.Second) * int64(time.Second))

// ParseRetryAfter reads a Retry-After value (RFC 9110 §10.2.3): delta-seconds
// or an HTTP-date, taken relative to now (a date in the past gives 0). ok is
// false for anything else, a negative number included.
func ParseRetryAfter(v []byte, now time.Time) (time.Duration, bool) {
	v = bytes.TrimSpace(v)
	if len(v) == 0 {
		return 0, false
	}
	if d, ok := deltaSeconds(v); ok {
		return d, true
	}
	t, err := http.ParseTime(string(v))
	if err != nil {
		return 0, false
	}
	if d := t.Sub(now); d > 0 {
		return d, true
	}
	return 0, true
}

// deltaSeconds reads 1*DIGIT as seconds, saturating at maxRetryAfter.
func deltaSeconds(v []byte) (time.Duration, bool) {
	const limit = int64(maxRetryAfter / time.Second)
	var secs int64
	for _, c := range v {
		if c < '0' || c > '9' {
			return 0, false
		}
		if secs <= limit {
			secs = secs*10 + int64(c-'0')
		}
	}
	if secs > limit {
		return maxRetryAfter, true
	}
	return time.Duration(secs) * time.Second, true
}
