package upstream

import "github.com/prometheus/client_golang/prometheus"

// poolMetrics are the per-encoder breaker and health series. Every
// configured encoder has them from the start; a removed encoder's go away.
type poolMetrics struct {
	state       *prometheus.GaugeVec   // encoder
	transitions *prometheus.CounterVec // encoder, from, to
	healthy     *prometheus.GaugeVec   // encoder
	refused     *prometheus.CounterVec // encoder, reason
}

// Reasons for encgate_upstream_refused_total: the gateway's own limits that
// refuse an exchange before anything is sent.
const (
	RefusedMaxInflight = "max_inflight" // limits.max_inflight_per_encoder
	RefusedMaxConns    = "max_conns"    // upstream.max_conns_per_encoder
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
			Help: "Exchanges the gateway refused before sending anything, by encoder and reason: max_inflight (limits.max_inflight_per_encoder) or max_conns (upstream.max_conns_per_encoder).",
		}, []string{"encoder", "reason"}),
	}
	reg.MustRegister(m.state, m.transitions, m.healthy, m.refused)
	return m
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
