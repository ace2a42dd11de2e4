package gateway

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/idempotency"
	"github.com/encgate/encgate/internal/listener"
	"github.com/encgate/encgate/internal/sglang"
	"github.com/encgate/encgate/upstream"
)

// metrics are the gateway's Prometheus collectors, registered on the
// registry passed to New (never the global one). The exchanges' own series
// (upstream requests, retries, breakers) are upstream's.
type metrics struct {
	requests *prometheus.CounterVec   // route, code
	duration *prometheus.HistogramVec // route
	reloads  *prometheus.CounterVec   // result

	adminUnauthorized prometheus.Counter
	clientGone        prometheus.Counter // parked exchanges whose client hung up

	hot hot
}

func newMetrics(reg prometheus.Registerer, pool *upstream.Pool, conns *listener.Limiter, store idempotency.Store) *metrics {
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
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_config_reloads_total",
			Help: "Config reloads (SIGHUP), by result: applied or refused.",
		}, []string{"result"}),
		adminUnauthorized: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "encgate_admin_unauthorized_total",
			Help: "Admin requests refused with 401 for a missing or wrong bearer token (admin.token).",
		}),
		clientGone: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "encgate_parked_clients_gone_total",
			Help: "Parked long polls whose client closed or reset its connection before the answer: the connection was closed at once, the exchange went on to its verdict and its answer was dropped (nginx logs these as 499).",
		}),
	}
	reg.MustRegister(m.requests, m.duration, m.reloads, m.adminUnauthorized, m.clientGone,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "encgate_connections_open",
			Help: "Open client connections on the encoder-facing listener (bounded by limits.max_conns).",
		}, func() float64 { return float64(conns.Open()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "encgate_connections_accepted_total",
			Help: "Client connections accepted on the encoder-facing listener.",
		}, func() float64 { return float64(conns.Accepted()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "encgate_connections_rejected_total",
			Help: "Client connections answered 503 and closed because limits.max_conns were open.",
		}, func() float64 { return float64(conns.Rejected()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "encgate_dedupe_store_up",
			Help: "1 while the /send dedupe store answers (the last call of its own, or its PING when idle, succeeded), 0 while it does not and /sends are refused (or forwarded without dedupe with idempotency.fail_open); always 1 for the memory store. /readyz?verbose says why.",
		}, func() float64 {
			if storeHealth(store).Up {
				return 1
			}
			return 0
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "encgate_pins",
			Help: "req_id -> encoder pins held (expired ones not yet swept included).",
		}, func() float64 { return float64(pool.PinsHeld()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "encgate_pin_waiters",
			Help: "req_ids whose follow-ups are waiting for their /encode to pin them.",
		}, func() float64 { return float64(pool.PinWaiters()) }),
	)
	// One series per state evicted, failed pins first to go, then pending,
	// then encoded (upstream.PinTable).
	for _, st := range []struct {
		label string
		state upstream.PinState
	}{{"failed", upstream.PinFailed}, {"pending", upstream.PinPending}, {"encoded", upstream.PinEncoded}} {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "encgate_pin_evictions_total",
			Help:        "Live pins dropped because affinity.max_pins was reached, by the state of the pin dropped (expired pins make room first and are not counted).",
			ConstLabels: prometheus.Labels{"state": st.label},
		}, func() float64 { return float64(pool.PinEvictions(st.state)) }))
	}
	for _, r := range []string{"applied", "refused"} {
		m.reloads.WithLabelValues(r)
	}
	for _, l := range sglang.Labels() {
		m.duration.WithLabelValues(l)
	}
	m.initHot()
	return m
}

// hot holds the children that nearly every request updates, so the request
// path skips the label hashing and lookups of WithLabelValues.
type hot struct {
	ok       sync.Map                              // *sglang.Route -> requests{route, code="200"}, made on first use
	duration map[*sglang.Route]prometheus.Observer // duration{route}
}

func (m *metrics) initHot() {
	m.hot.duration = map[*sglang.Route]prometheus.Observer{}
	for _, rt := range append(append([]*sglang.Route{}, sglang.Routes...), sglang.RouteUnknown) {
		m.hot.duration[rt] = m.duration.WithLabelValues(rt.Label)
	}
}

func (m *metrics) observe(rt *sglang.Route, code int, d time.Duration) {
	if code == fasthttp.StatusOK {
		c, ok := m.hot.ok.Load(rt)
		if !ok {
			c, _ = m.hot.ok.LoadOrStore(rt, m.requests.WithLabelValues(rt.Label, upstream.CodeLabel(code)))
		}
		c.(prometheus.Counter).Inc()
	} else {
		m.requests.WithLabelValues(rt.Label, upstream.CodeLabel(code)).Inc()
	}
	if o, ok := m.hot.duration[rt]; ok {
		o.Observe(d.Seconds())
	} else {
		m.duration.WithLabelValues(rt.Label).Observe(d.Seconds())
	}
}

// storeHealth is what the /send store knows of its backend: the Redis
// store's Health; a store with no backend to lose (memory) is always up.
func storeHealth(store idempotency.Store) idempotency.Health {
	if h, ok := store.(idempotency.HealthReporter); ok {
		return h.Health()
	}
	return idempotency.Health{Up: true}
}
