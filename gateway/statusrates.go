package gateway

import (
	"math"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// The status page's rates come from the gateway's own metrics, in process:
// no Prometheus is needed to read them. Every statusSampleEvery the
// counters and histograms the page needs are read from the registry into a
// ring that holds the last statusHistory; the page reads them once more as
// it renders, and a rate is the difference between that reading and the
// oldest sample of the last minute, over the time between them. Quantiles
// are interpolated from the histogram buckets' differences as Prometheus's
// histogram_quantile does. Every time is the injected clock's.

const (
	statusSampleEvery = 5 * time.Second
	statusWindow      = time.Minute      // the window of a rate and a quantile
	statusHistory     = 10 * time.Minute // the sparklines' span
	// statusKept holds statusHistory of samples, and the one before it.
	statusKept = int(statusHistory/statusSampleEvery) + 2
)

// The metrics a sample reads.
const (
	metricUpstreamRequests = "encgate_upstream_requests_total"
	metricUpstreamDuration = "encgate_upstream_request_duration_seconds"
	metricEjections        = "encgate_breaker_ejections_total"
	metricDupSuppressed    = "encgate_send_duplicates_suppressed_total"
	metricSendForwarded    = "encgate_send_forwarded_total"
)

// bucket is a histogram bucket: its upper bound and the cumulative count
// of observations at or below it; the last bound is +Inf.
type bucket struct {
	Upper float64
	Count float64
}

// encCounters are one encoder's cumulative counters at a sample.
type encCounters struct {
	Requests  float64 // exchanges, every code
	Errors    float64 // exchanges answered 5xx or not answered
	Ejections float64
	Buckets   []bucket // encgate_upstream_request_duration_seconds
}

// statusSample is the counters at one time.
type statusSample struct {
	At        time.Time
	Enc       map[string]encCounters
	Dups      map[string]float64 // suppressed /sends by reason
	Forwarded float64            // /sends forwarded
}

// isErrorCode reports whether an encgate_upstream_requests_total code
// counts as an error on the page: a 5xx, or no answer (dial_error, stale,
// timeout, error, refused). A 4xx is the caller's request, not the
// encoder's failure.
func isErrorCode(code string) bool {
	n, err := strconv.Atoi(code)
	return err != nil || n >= 500
}

func labelValue(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// readSample reads the counters the page needs from g.
func readSample(g prometheus.Gatherer, at time.Time) statusSample {
	s := statusSample{At: at, Enc: map[string]encCounters{}, Dups: map[string]float64{}}
	mfs, _ := g.Gather()
	for _, f := range mfs {
		switch f.GetName() {
		case metricUpstreamRequests:
			for _, m := range f.GetMetric() {
				enc := labelValue(m, "encoder")
				c := s.Enc[enc]
				v := m.GetCounter().GetValue()
				c.Requests += v
				if isErrorCode(labelValue(m, "code")) {
					c.Errors += v
				}
				s.Enc[enc] = c
			}
		case metricUpstreamDuration:
			for _, m := range f.GetMetric() {
				enc := labelValue(m, "encoder")
				c := s.Enc[enc]
				h := m.GetHistogram()
				c.Buckets = make([]bucket, 0, len(h.GetBucket())+1)
				for _, b := range h.GetBucket() {
					if !math.IsInf(b.GetUpperBound(), 1) {
						c.Buckets = append(c.Buckets, bucket{b.GetUpperBound(), float64(b.GetCumulativeCount())})
					}
				}
				c.Buckets = append(c.Buckets, bucket{math.Inf(1), float64(h.GetSampleCount())})
				s.Enc[enc] = c
			}
		case metricEjections:
			for _, m := range f.GetMetric() {
				enc := labelValue(m, "encoder")
				c := s.Enc[enc]
				c.Ejections = m.GetCounter().GetValue()
				s.Enc[enc] = c
			}
		case metricDupSuppressed:
			for _, m := range f.GetMetric() {
				s.Dups[labelValue(m, "reason")] += m.GetCounter().GetValue()
			}
		case metricSendForwarded:
			for _, m := range f.GetMetric() {
				s.Forwarded += m.GetCounter().GetValue()
			}
		}
	}
	return s
}

// increase is a counter's increase from a to b; a counter that went down
// was reset (an encoder removed and added again) and counts from zero, as
// Prometheus's rate does.
func increase(a, b float64) float64 {
	if b < a {
		return b
	}
	return b - a
}

// bucketIncrease is each bucket's increase from a to b (by upper bound;
// a histogram that lost observations was reset and counts from zero).
func bucketIncrease(a, b []bucket) []bucket {
	if len(b) == 0 {
		return nil
	}
	reset := len(a) != len(b) || b[len(b)-1].Count < a[len(a)-1].Count
	out := make([]bucket, len(b))
	for i, bk := range b {
		out[i] = bk
		if !reset && a[i].Upper == bk.Upper {
			out[i].Count = bk.Count - a[i].Count
		}
	}
	return out
}

// histogramQuantile is Prometheus's histogram_quantile over cumulative
// buckets sorted by upper bound, the last +Inf: the q-quantile is
// interpolated linearly inside the bucket its rank falls in, the first
// bucket starting at 0; a rank in the +Inf bucket is the highest finite
// bound. NaN with no observations or q outside [0, 1].
func histogramQuantile(q float64, bs []bucket) float64 {
	if len(bs) == 0 || q < 0 || q > 1 || math.IsNaN(q) {
		return math.NaN()
	}
	total := bs[len(bs)-1].Count
	if total <= 0 {
		return math.NaN()
	}
	rank := q * total
	i := sort.Search(len(bs)-1, func(i int) bool { return bs[i].Count >= rank })
	if i == len(bs)-1 {
		if len(bs) < 2 {
			return math.NaN()
		}
		return bs[len(bs)-2].Upper
	}
	if i == 0 && bs[0].Upper <= 0 {
		return bs[0].Upper
	}
	lo, below := 0.0, 0.0
	if i > 0 {
		lo, below = bs[i-1].Upper, bs[i-1].Count
	}
	in := bs[i].Count - below
	if in <= 0 {
		return bs[i].Upper
	}
	return lo + (bs[i].Upper-lo)*(rank-below)/in
}

// statusRates is the ring of samples.
type statusRates struct {
	mu   sync.Mutex
	ring [statusKept]statusSample
	next int
	n    int
	// lastEjected is when each encoder was last seen ejected: its breaker's
	// EjectedAt while ejected, else the sample at which its ejection
	// counter was seen to grow.
	lastEjected map[string]time.Time
}

func newStatusRates() *statusRates {
	return &statusRates{lastEjected: map[string]time.Time{}}
}

// add keeps s, the newest sample.
func (r *statusRates) add(s statusSample) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.n > 0 {
		prev := r.ring[(r.next-1+statusKept)%statusKept]
		for name, c := range s.Enc {
			if c.Ejections > prev.Enc[name].Ejections && r.lastEjected[name].Before(prev.At) {
				r.lastEjected[name] = s.At
			}
		}
	}
	r.ring[r.next] = s
	r.next = (r.next + 1) % statusKept
	if r.n < statusKept {
		r.n++
	}
}

// due reports whether a sample at now is due: none yet, or the newest is
// statusSampleEvery old.
func (r *statusRates) due(now time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n == 0 || now.Sub(r.ring[(r.next-1+statusKept)%statusKept].At) >= statusSampleEvery
}

// ejectedAt records that name's breaker ejected it at t.
func (r *statusRates) ejectedAt(name string, t time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if t.After(r.lastEjected[name]) {
		r.lastEjected[name] = t
	}
}

// samples returns the samples held, oldest first.
func (r *statusRates) samples() ([]statusSample, map[string]time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]statusSample, 0, r.n)
	for i := r.n; i >= 1; i-- {
		out = append(out, r.ring[(r.next-i+statusKept)%statusKept])
	}
	last := make(map[string]time.Time, len(r.lastEjected))
	for k, v := range r.lastEjected {
		last[k] = v
	}
	return out, last
}

// encRates are one encoder's figures over the window.
type encRates struct {
	Window   time.Duration // the time the figures span (at most statusWindow)
	Requests float64       // exchanges in the window
	RPS      float64       // exchanges per second; NaN without a window
	ErrFrac  float64       // errors per exchange; NaN without exchanges
	P50, P99 float64       // seconds; NaN without timed exchanges
	// Ejections in the window, and in all.
	EjectionsWindow, Ejections float64
	// Spark is req/s between successive samples over statusHistory, the
	// reading at render last.
	Spark []float64
}

// dupRates are the duplicate suppression's figures over the window.
type dupRates struct {
	Window    time.Duration
	Forwarded float64            // /sends forwarded per second
	Reasons   []dupReason        // suppressed per second, by reason
	byReason  map[string]float64 // (the same)
}

type dupReason struct {
	Reason string
	Rate   float64
}

// windowBase is the oldest of samples (oldest first) no more than
// statusWindow before cur, or cur itself when there is none.
func windowBase(samples []statusSample, cur statusSample) statusSample {
	for _, s := range samples {
		if cur.At.Sub(s.At) <= statusWindow && !s.At.After(cur.At) {
			return s
		}
	}
	return cur
}

// ratesFor computes name's figures from samples (oldest first) and cur,
// the reading at render.
func ratesFor(name string, samples []statusSample, cur statusSample) encRates {
	base := windowBase(samples, cur)
	a, b := base.Enc[name], cur.Enc[name]
	out := encRates{Window: cur.At.Sub(base.At), Ejections: b.Ejections,
		Requests: increase(a.Requests, b.Requests), EjectionsWindow: increase(a.Ejections, b.Ejections)}
	out.RPS, out.ErrFrac = math.NaN(), math.NaN()
	if secs := out.Window.Seconds(); secs > 0 {
		out.RPS = out.Requests / secs
	}
	if out.Requests > 0 {
		out.ErrFrac = increase(a.Errors, b.Errors) / out.Requests
	}
	d := bucketIncrease(a.Buckets, b.Buckets)
	out.P50, out.P99 = histogramQuantile(0.5, d), histogramQuantile(0.99, d)
	// The sparkline: each interval's rate over the last statusHistory.
	all := append(append([]statusSample{}, samples...), cur)
	for i := 1; i < len(all); i++ {
		p, s := all[i-1], all[i]
		if cur.At.Sub(p.At) > statusHistory {
			continue
		}
		secs := s.At.Sub(p.At).Seconds()
		if secs <= 0 {
			continue
		}
		out.Spark = append(out.Spark, increase(p.Enc[name].Requests, s.Enc[name].Requests)/secs)
	}
	return out
}

// dupsFor computes the duplicate suppression's rates.
func dupsFor(samples []statusSample, cur statusSample) dupRates {
	base := windowBase(samples, cur)
	out := dupRates{Window: cur.At.Sub(base.At), byReason: map[string]float64{}}
	secs := out.Window.Seconds()
	rate := func(a, b float64) float64 {
		if secs <= 0 {
			return math.NaN()
		}
		return increase(a, b) / secs
	}
	out.Forwarded = rate(base.Forwarded, cur.Forwarded)
	reasons := make([]string, 0, len(cur.Dups))
	for r := range cur.Dups {
		reasons = append(reasons, r)
	}
	sort.Strings(reasons)
	for _, r := range reasons {
		v := rate(base.Dups[r], cur.Dups[r])
		out.byReason[r] = v
		out.Reasons = append(out.Reasons, dupReason{Reason: r, Rate: v})
	}
	return out
}

// sparkPoints draws values as an SVG polyline's points in a w×h box, the
// highest value at the top (zero at the bottom); "" for fewer than two.
func sparkPoints(values []float64, w, h float64) string {
	if len(values) < 2 {
		return ""
	}
	top := 0.0
	for _, v := range values {
		top = max(top, v)
	}
	var b strings.Builder
	for i, v := range values {
		x := w * float64(i) / float64(len(values)-1)
		y := h
		if top > 0 {
			y = h - (h-1)*v/top
		}
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(strconv.FormatFloat(x, 'f', 1, 64))
		b.WriteByte(',')
		b.WriteString(strconv.FormatFloat(y, 'f', 1, 64))
	}
	return b.String()
}
