package upstream

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/encgate/encgate/internal/sglang"
)

// poolMetrics are the per-encoder breaker and health series. Every
// configured encoder has them from the start; a removed encoder's go away.
type poolMetrics struct {
	state       *prometheus.GaugeVec   // encoder
	transitions *prometheus.CounterVec // encoder, from, to
	healthy     *prometheus.GaugeVec   // encoder
	refused     *prometheus.CounterVec // encoder, reason
	outcomes    *prometheus.CounterVec // encoder, outcome

	requests        *prometheus.CounterVec // encoder, route, code
	retries         *prometheus.CounterVec // route, reason
	budgetExhausted *prometheus.CounterVec // route
	backoff         prometheus.Histogram

	hot sync.Map // hotKey -> requests{encoder, route, code="200"}
}

type hotKey struct {
	enc   *Encoder
	route *sglang.Route
}

// Reasons for encgate_upstream_refused_total: the gateway's own limits that
// refuse an exchange before anything is sent.
const (
	RefusedMaxInflight = "max_inflight" // limits.max_inflight_per_encoder
	RefusedMaxConns    = "max_conns"    // upstream.max_conns_per_encoder
	RefusedBreaker     = "breaker"      // the breaker admitted no more placements
)

func newPoolMetrics(reg prometheus.Registerer) *poolMetrics {
	m := &poolMetrics{
		state: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "encgate_breaker_state",
			Help: "Circuit breaker state per encoder: 0 closed, 1 half-open, 2 open.",
		}, []string{"encoder"}),
		transitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_breaker_transitions_total",
			Help: "Circuit breaker state changes per encoder.",
		}, []string{"encoder", "from", "to"}),
		healthy: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "encgate_upstream_healthy",
			Help: "Active health per encoder: 1 up, 0 down.",
		}, []string{"encoder"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_upstream_refused_total",
			Help: "Exchanges the gateway refused before sending anything, by encoder and reason: max_inflight (limits.max_inflight_per_encoder), max_conns (upstream.max_conns_per_encoder) or breaker (an /encode the breaker admitted no more of).",
		}, []string{"encoder", "reason"}),
		outcomes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_breaker_outcomes_total",
			Help: "Exchanges as each encoder's breaker counted them: success, fault (an instance fault) or ignored (caused by the request, another request's failure, a long-poll that ran out, breaker.ignore, or the gateway's own limits).",
		}, []string{"encoder", "outcome"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_upstream_requests_total",
			Help: "Exchanges with encoders, by encoder, route and status code; code is dial_error, stale, timeout, error or refused when no answer came.",
		}, []string{"encoder", "route", "code"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_retries_total",
			Help: "Retries sent to encoders, by route and reason (connect_failure, timeout, status_<code>).",
		}, []string{"route", "reason"}),
		budgetExhausted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_retry_budget_exhausted_total",
			Help: "Retries not sent because the route's retry budget was spent; the last answer went back instead.",
		}, []string{"route"}),
		backoff: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "encgate_retry_backoff_seconds",
			Help:    "Waits before retries.",
			Buckets: prometheus.ExponentialBucketsRange(0.001, 30, 14),
		}),
	}
	reg.MustRegister(m.state, m.transitions, m.healthy, m.refused, m.outcomes, m.requests, m.retries, m.budgetExhausted, m.backoff)
	for _, r := range sglang.RetryLabels {
		m.budgetExhausted.WithLabelValues(r)
	}
	return m
}

// outcomeCounters returns name's breaker outcome counters, indexed by Mark.
func (m *poolMetrics) outcomeCounters(name string) (c [4]prometheus.Counter) {
	for _, mk := range []Mark{MarkSuccess, MarkFault, MarkIgnored} {
		c[mk] = m.outcomes.WithLabelValues(name, mk.String())
	}
	return c
}

// exchanged counts one exchange with t's encoder by its verdict.
func (m *poolMetrics) exchanged(t target, rt *sglang.Route, v *Verdict) {
	if c := t.enc.outcomes[v.Breaker]; c != nil {
		c.Inc()
	}
	if v.Label == "" {
		return
	}
	if v.Kind == KindBreakerBusy {
		m.refused.WithLabelValues(t.enc.Name, RefusedBreaker).Inc()
	}
	if v.Kind == KindAnswered && v.Status == 200 {
		// Encoders removed by a reload leave an entry here until restart:
		// bounded by the names ever configured.
		k := hotKey{t.enc, rt}
		c, ok := m.hot.Load(k)
		if !ok {
			c, _ = m.hot.LoadOrStore(k, m.requests.WithLabelValues(t.enc.Name, rt.Label, v.Label))
		}
		c.(prometheus.Counter).Inc()
		return
	}
	m.requests.WithLabelValues(t.enc.Name, rt.Label, v.Label).Inc()
}

func (m *poolMetrics) track(e *Encoder) {
	m.state.WithLabelValues(e.Name).Set(float64(e.Breaker.State()))
	up := 0.0
	if e.Health.Up() {
		up = 1
	}
	m.healthy.WithLabelValues(e.Name).Set(up)
}

// refusals returns name's refusal counters (creating both series).
func (m *poolMetrics) refusals(name string) (inflight, conns prometheus.Counter) {
	return m.refused.WithLabelValues(name, RefusedMaxInflight), m.refused.WithLabelValues(name, RefusedMaxConns)
}

func (m *poolMetrics) forget(name string) {
	m.state.DeleteLabelValues(name)
	m.healthy.DeleteLabelValues(name)
	m.refused.DeletePartialMatch(prometheus.Labels{"encoder": name})
	m.outcomes.DeletePartialMatch(prometheus.Labels{"encoder": name})
	m.transitions.DeletePartialMatch(prometheus.Labels{"encoder": name})
}

func (m *poolMetrics) breakerChanged(name string, from, to BreakerState) {
	m.state.WithLabelValues(name).Set(float64(to))
	m.transitions.WithLabelValues(name, from.String(), to.String()).Inc()
}

func (m *poolMetrics) healthChanged(name string, up bool) {
	v := 0.0
	if up {
		v = 1
	}
	m.healthy.WithLabelValues(name).Set(v)
}
