package gateway

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

// histogramQuantile is Prometheus's: linear inside the bucket the rank
// falls in, the first bucket from 0, the +Inf bucket answered with the
// highest finite bound, NaN without observations.
func TestHistogramQuantile(t *testing.T) {
	inf := math.Inf(1)
	bs := []bucket{{0.1, 10}, {0.2, 30}, {0.4, 90}, {0.8, 100}, {inf, 100}}
	for _, c := range []struct{ q, want float64 }{
		{0.5, 0.2 + 0.2*(50-30)/60.0}, // rank 50 in (0.2, 0.4]
		{0.05, 0.1 * 5 / 10},          // rank 5 in the first bucket, from 0
		{0.99, 0.4 + 0.4*(99-90)/10.0},
		{1, 0.8},
		{0, 0},
	} {
		if got := histogramQuantile(c.q, bs); !near(got, c.want) {
			t.Errorf("q=%v: %v, want %v", c.q, got, c.want)
		}
	}
	// A rank in +Inf: the highest finite bound.
	if got := histogramQuantile(0.99, []bucket{{0.1, 1}, {0.2, 2}, {inf, 10}}); got != 0.2 {
		t.Errorf("a rank in +Inf: %v, want 0.2", got)
	}
	for _, empty := range [][]bucket{nil, {{0.1, 0}, {inf, 0}}} {
		if got := histogramQuantile(0.5, empty); !math.IsNaN(got) {
			t.Errorf("no observations: %v, want NaN", got)
		}
	}
	if !math.IsNaN(histogramQuantile(1.5, bs)) || !math.IsNaN(histogramQuantile(-0.1, bs)) {
		t.Error("a q outside [0, 1] is not NaN")
	}
	// Differences of cumulative buckets, and a reset.
	a := []bucket{{0.1, 5}, {0.2, 5}, {inf, 6}}
	b := []bucket{{0.1, 5}, {0.2, 15}, {inf, 16}}
	d := bucketIncrease(a, b)
	if d[0].Count != 0 || d[1].Count != 10 || d[2].Count != 10 {
		t.Errorf("bucketIncrease: %v", d)
	}
	if got := histogramQuantile(0.5, d); !near(got, 0.15) {
		t.Errorf("p50 of the increase: %v, want 0.15", got)
	}
	if r := bucketIncrease(b, a); r[2].Count != 6 {
		t.Errorf("a histogram reset counts from zero: %v", r)
	}
	if increase(10, 4) != 4 || increase(4, 10) != 6 {
		t.Error("increase does not treat a decrease as a reset")
	}
}

// Rates over the last minute: the difference between the reading and the
// oldest sample of the minute, over the time between them, on the clock
// the samples were taken with; samples older than the minute are left
// out; the sparkline has one rate per interval of the last 10 minutes.
func TestStatusRatesOverTheLastMinute(t *testing.T) {
	inf := math.Inf(1)
	t0 := time.Unix(1_700_000_000, 0)
	r := newStatusRates()
	sample := func(at time.Duration, req, errs, ej float64, fast, total float64, dups, fwd float64) statusSample {
		return statusSample{At: t0.Add(at), Enc: map[string]encCounters{"enc-0": {Requests: req, Errors: errs, Ejections: ej,
			Buckets: []bucket{{0.01, fast}, {0.1, total}, {inf, total}}}}, Dups: map[string]float64{"done": dups}, Forwarded: fwd}
	}
	r.add(sample(0, 0, 0, 0, 0, 0, 0, 0))
	r.add(sample(30*time.Second, 1000, 0, 0, 1000, 1000, 0, 10))    // older than the window at 95 s
	r.add(sample(45*time.Second, 1600, 10, 1, 1500, 1600, 20, 100)) // the window's base at 95 s
	r.add(sample(90*time.Second, 2200, 20, 1, 1500, 2200, 50, 160))
	cur := sample(95*time.Second, 2600, 30, 2, 1500, 2600, 70, 200)
	samples, last := r.samples()
	if len(samples) != 4 {
		t.Fatalf("%d samples held, want 4", len(samples))
	}
	if got := last["enc-0"]; !got.Equal(t0.Add(45 * time.Second)) {
		t.Errorf("last ejection seen at %v, want the sample at which the counter grew (45 s)", got.Sub(t0))
	}
	er := ratesFor("enc-0", samples, cur)
	if er.Window != 50*time.Second || er.Requests != 1000 || !near(er.RPS, 20) || !near(er.ErrFrac, 0.02) || er.EjectionsWindow != 1 {
		t.Errorf("rates: %+v, want a 50 s window, 1000 requests, 20/s, 2%% errors, 1 ejection", er)
	}
	// The window's 1000 timed exchanges all fell in (0.01, 0.1].
	if !near(er.P50, 0.01+0.09*0.5) || !near(er.P99, 0.01+0.09*0.99) {
		t.Errorf("p50 %v, p99 %v", er.P50, er.P99)
	}
	want := []float64{1000.0 / 30, 600.0 / 15, 600.0 / 45, 400.0 / 5}
	if len(er.Spark) != len(want) {
		t.Fatalf("sparkline %v, want %v", er.Spark, want)
	}
	for i := range want {
		if !near(er.Spark[i], want[i]) {
			t.Errorf("sparkline[%d] = %v, want %v", i, er.Spark[i], want[i])
		}
	}
	d := dupsFor(samples, cur)
	if !near(d.byReason["done"], 50.0/50) || !near(d.Forwarded, 100.0/50) {
		t.Errorf("duplicate rates: %+v", d)
	}
	// An encoder the samples never saw: no rate rather than a made-up one.
	if er := ratesFor("enc-9", samples, cur); er.Requests != 0 || !math.IsNaN(er.ErrFrac) || !math.IsNaN(er.P99) {
		t.Errorf("an unseen encoder: %+v", er)
	}
	// A reading at the base's own time has no window.
	if er := ratesFor("enc-0", nil, cur); !math.IsNaN(er.RPS) {
		t.Errorf("no history: RPS %v, want NaN", er.RPS)
	}
	// The ring keeps statusKept samples, dropping the oldest.
	for i := 0; i < statusKept+5; i++ {
		r.add(sample(100*time.Second+time.Duration(i)*statusSampleEvery, 0, 0, 0, 0, 0, 0, 0))
	}
	if samples, _ := r.samples(); len(samples) != statusKept || !samples[0].At.Equal(t0.Add(100*time.Second+5*statusSampleEvery)) {
		t.Errorf("the ring holds %d samples from %v", len(samples), samples[0].At.Sub(t0))
	}
	if !r.due(t0.Add(100*time.Second+time.Duration(statusKept+5)*statusSampleEvery)) ||
		r.due(t0.Add(100*time.Second+time.Duration(statusKept+4)*statusSampleEvery+time.Second)) {
		t.Error("due does not say a sample is due every statusSampleEvery")
	}
}

// readSample reads the page's series from a registry: requests and errors
// (5xx and no answer; not 4xx) per encoder, its latency buckets with +Inf
// last, ejections, suppressed duplicates by reason, forwarded /sends.
func TestReadSample(t *testing.T) {
	reg := prometheus.NewRegistry()
	req := prometheus.NewCounterVec(prometheus.CounterOpts{Name: metricUpstreamRequests}, []string{"encoder", "route", "code"})
	dur := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: metricUpstreamDuration, Buckets: []float64{0.1, 1}}, []string{"encoder"})
	ej := prometheus.NewCounterVec(prometheus.CounterOpts{Name: metricEjections}, []string{"encoder"})
	dups := prometheus.NewCounterVec(prometheus.CounterOpts{Name: metricDupSuppressed}, []string{"reason"})
	fwd := prometheus.NewCounter(prometheus.CounterOpts{Name: metricSendForwarded})
	reg.MustRegister(req, dur, ej, dups, fwd)
	req.WithLabelValues("a", "encode", "200").Add(7)
	req.WithLabelValues("a", "encode", "400").Add(1)
	req.WithLabelValues("a", "send", "503").Add(2)
	req.WithLabelValues("a", "encode", "timeout").Add(3)
	dur.WithLabelValues("a").Observe(0.05)
	dur.WithLabelValues("a").Observe(5)
	ej.WithLabelValues("a").Add(4)
	dups.WithLabelValues("done").Add(6)
	fwd.Add(9)
	s := readSample(reg, time.Unix(1, 0))
	a := s.Enc["a"]
	if a.Requests != 13 || a.Errors != 5 || a.Ejections != 4 || s.Dups["done"] != 6 || s.Forwarded != 9 {
		t.Errorf("sample: %+v", s)
	}
	if len(a.Buckets) != 3 || a.Buckets[0] != (bucket{0.1, 1}) || a.Buckets[1] != (bucket{1, 1}) || !math.IsInf(a.Buckets[2].Upper, 1) || a.Buckets[2].Count != 2 {
		t.Errorf("buckets: %v", a.Buckets)
	}
}

func TestSparkPoints(t *testing.T) {
	if got := sparkPoints([]float64{0, 5, 10}, 120, 24); got != "0.0,24.0 60.0,12.5 120.0,1.0" {
		t.Errorf("sparkPoints: %q", got)
	}
	if got := sparkPoints([]float64{0, 0}, 120, 24); got != "0.0,24.0 120.0,24.0" {
		t.Errorf("an idle sparkline: %q", got)
	}
	if sparkPoints([]float64{3}, 120, 24) != "" || strings.Contains(sparkPoints([]float64{1, 2}, 120, 24), "NaN") {
		t.Error("sparkPoints on too few values")
	}
}
