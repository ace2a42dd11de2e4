package gateway

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/encgate/encgate/upstream"
)

// metrics are the gateway's Prometheus collectors, registered on the
// registry passed to New (never the global one).
type metrics struct {
	requests *prometheus.CounterVec   // route, code
	duration *prometheus.HistogramVec // route
	upstream *prometheus.CounterVec   // encoder, route, code
}

// codeLabels avoids formatting a status code on every request.
var codeLabels = func() (t [600]string) {
	for i := range t {
		t[i] = strconv.Itoa(i)
	}
	return t
}()

func codeLabel(code int) string {
	if code >= 0 && code < len(codeLabels) {
		return codeLabels[code]
	}
	return strconv.Itoa(code)
}

func newMetrics(reg prometheus.Registerer, pool *upstream.Pool) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_requests_total",
			Help: "Requests answered on the encoder-facing listener, by route and status code.",
		}, []string{"route", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "encgate_request_duration_seconds",
			Help:    "Time from reading a request to answering it, by route.",
			Buckets: prometheus.ExponentialBucketsRange(0.0005, 240, 20),
		}, []string{"route"}),
		upstream: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_upstream_requests_total",
			Help: "Exchanges with encoders, by encoder, route and status code; code is dial_error, timeout or error when no answer came.",
		}, []string{"encoder", "route", "code"}),
	}
	reg.MustRegister(m.requests, m.duration, m.upstream,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "encgate_pins",
			Help: "req_id -> encoder pins held (expired ones not yet swept included).",
		}, func() float64 { return float64(pool.Pins.Len()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "encgate_pin_evictions_total",
			Help: "Live pins dropped because affinity.max_pins was reached.",
		}, func() float64 { return float64(pool.Pins.Evictions()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "encgate_pin_waiters",
			Help: "req_ids whose follow-ups are waiting for their /encode to pin them.",
		}, func() float64 { return float64(pool.Pins.Waiting()) }),
	)
	for _, l := range routeLabels() {
		m.duration.WithLabelValues(l)
	}
	return m
}

func (m *metrics) observe(rt *route, code int, d time.Duration) {
	m.requests.WithLabelValues(rt.label, codeLabel(code)).Inc()
	m.duration.WithLabelValues(rt.label).Observe(d.Seconds())
}

func (m *metrics) observeUpstream(enc *upstream.Encoder, rt *route, code int, err error) {
	label := codeLabel(code)
	if err != nil {
		switch {
		case isDial(err):
			label = "dial_error"
		case upstream.IsTimeout(err):
			label = "timeout"
		default:
			label = "error"
		}
	}
	m.upstream.WithLabelValues(enc.Name, rt.label, label).Inc()
}
