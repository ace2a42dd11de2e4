package gateway

import (
	"errors"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/upstream"
)

// metrics are the gateway's Prometheus collectors, registered on the
// registry passed to New (never the global one).
type metrics struct {
	requests        *prometheus.CounterVec   // route, code
	duration        *prometheus.HistogramVec // route
	upstream        *prometheus.CounterVec   // encoder, route, code
	retries         *prometheus.CounterVec   // route, reason
	budgetExhausted *prometheus.CounterVec   // route
	backoff         prometheus.Histogram
	reloads         *prometheus.CounterVec // result

	adminUnauthorized prometheus.Counter

	hot hot
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

func newMetrics(reg prometheus.Registerer, pool *upstream.Pool, conns *connLimiter) *metrics {
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
	m.retries = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "encgate_retries_total",
		Help: "Retries sent to encoders, by route and reason (connect_failure, timeout, status_<code>).",
	}, []string{"route", "reason"})
	m.budgetExhausted = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "encgate_retry_budget_exhausted_total",
		Help: "Retries not sent because the route's retry budget was spent; the last answer went back instead.",
	}, []string{"route"})
	m.backoff = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "encgate_retry_backoff_seconds",
		Help:    "Waits before retries.",
		Buckets: prometheus.ExponentialBucketsRange(0.001, 30, 14),
	})
	m.reloads = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "encgate_config_reloads_total",
		Help: "Config reloads (SIGHUP), by result: applied or refused.",
	}, []string{"result"})
	m.adminUnauthorized = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "encgate_admin_unauthorized_total",
		Help: "Admin requests refused with 401 for a missing or wrong bearer token (admin.token).",
	})
	reg.MustRegister(m.retries, m.budgetExhausted, m.backoff, m.reloads, m.adminUnauthorized,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "encgate_connections_open",
			Help: "Open client connections on the encoder-facing listener (bounded by limits.max_conns).",
		}, func() float64 { return float64(conns.open.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "encgate_connections_accepted_total",
			Help: "Client connections accepted on the encoder-facing listener.",
		}, func() float64 { return float64(conns.accepted.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "encgate_connections_rejected_total",
			Help: "Client connections answered 503 and closed because limits.max_conns were open.",
		}, func() float64 { return float64(conns.rejected.Load()) }),
	)
	for _, r := range []string{"applied", "refused"} {
		m.reloads.WithLabelValues(r)
	}
	for _, r := range []string{"metadata", "receive_url", "encode", "send"} {
		m.budgetExhausted.WithLabelValues(r)
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
	m.initHot()
	return m
}

// hot holds the children that nearly every request updates, so the request
// path skips the label hashing and lookups of WithLabelValues.
type hot struct {
	ok       sync.Map                       // *route -> requests{route, code="200"}, made on first use
	duration map[*route]prometheus.Observer // duration{route}
	upstream sync.Map                       // upstreamKey -> requests{encoder, route, code="200"}
}

type upstreamKey struct {
	enc *upstream.Encoder
	rt  *route
}

func (m *metrics) initHot() {
	m.hot.duration = map[*route]prometheus.Observer{}
	for _, rt := range append(append([]*route{}, routes...), unknownRoute) {
		m.hot.duration[rt] = m.duration.WithLabelValues(rt.label)
	}
}

func (m *metrics) observe(rt *route, code int, d time.Duration) {
	if code == fasthttp.StatusOK {
		c, ok := m.hot.ok.Load(rt)
		if !ok {
			c, _ = m.hot.ok.LoadOrStore(rt, m.requests.WithLabelValues(rt.label, codeLabel(code)))
		}
		c.(prometheus.Counter).Inc()
	} else {
		m.requests.WithLabelValues(rt.label, codeLabel(code)).Inc()
	}
	if o, ok := m.hot.duration[rt]; ok {
		o.Observe(d.Seconds())
	} else {
		m.duration.WithLabelValues(rt.label).Observe(d.Seconds())
	}
}

func (m *metrics) observeUpstream(enc *upstream.Encoder, rt *route, code int, err error) {
	label := codeLabel(code)
	if err != nil {
		switch {
		case errors.Is(err, fasthttp.ErrNoFreeConns): // includes *upstream.InflightLimitError
			label = "refused"
		case isDial(err):
			label = "dial_error"
		case upstream.IsTimeout(err):
			label = "timeout"
		default:
			label = "error"
		}
	}
	if err == nil && code == fasthttp.StatusOK {
		// Encoders removed by a reload leave an entry here until restart:
		// bounded by the names ever configured.
		k := upstreamKey{enc, rt}
		c, ok := m.hot.upstream.Load(k)
		if !ok {
			c, _ = m.hot.upstream.LoadOrStore(k, m.upstream.WithLabelValues(enc.Name, rt.label, label))
		}
		c.(prometheus.Counter).Inc()
		return
	}
	m.upstream.WithLabelValues(enc.Name, rt.label, label).Inc()
}
