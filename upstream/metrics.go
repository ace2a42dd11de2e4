package upstream

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/encgate/encgate/internal/sglang"
)

// poolMetrics are the per-encoder breaker, health and exchange series. Every
// configured encoder has them from the start; a removed encoder's go away
// (forget), and nothing of an Encoder object is kept here: series and the
// hot map are keyed by the encoder's name, so a reload that rebuilds an
// encoder under the same name reuses them, and the retired object (with
// its HTTP clients) can be collected.
type poolMetrics struct {
	state       *prometheus.GaugeVec   // encoder
	transitions *prometheus.CounterVec // encoder, from, to
	healthy     *prometheus.GaugeVec   // encoder
	refused     *prometheus.CounterVec // encoder, reason
	polls       *prometheus.GaugeVec   // encoder
	outcomes    *prometheus.CounterVec // encoder, outcome
	ejected     *prometheus.GaugeVec   // encoder
	ejections   *prometheus.CounterVec // encoder
	skipped     *prometheus.CounterVec // encoder
	ejection    *prometheus.GaugeVec   // encoder

	requests        *prometheus.CounterVec   // encoder, route, code
	duration        *prometheus.HistogramVec // encoder
	retries         *prometheus.CounterVec   // route, reason
	budgetExhausted *prometheus.CounterVec   // route
	backoff         prometheus.Histogram

	metaShared  *prometheus.CounterVec // how
	metaWaiting prometheus.Gauge       // encgate_metadata_pulls_waiting
	parked      prometheus.Gauge       // encgate_upstream_parked
	paused      prometheus.Gauge       // encgate_upstream_backoffs_parked

	// hot caches requests{encoder, route, code="200"} by hotKey, so the
	// common answer skips the vector's label hashing. Bounded by the
	// configured names times the routes; forget drops a name's entries.
	hot sync.Map // hotKey -> prometheus.Counter

	// mu orders forget against the creation of series: forget holds it
	// while it marks an encoder forgotten and deletes its series, and
	// whatever creates a series for an encoder holds it for reading and
	// first checks the mark. An exchange still in flight on a removed
	// encoder, or its breaker's last transition, then cannot bring the
	// removed name's series back after forget deleted them.
	mu sync.RWMutex
}

// hotKey is an encoder's name and a route: never the *Encoder, which a
// reload replaces (a changed breaker, health or upstream section rebuilds
// every encoder under its old name).
type hotKey struct {
	encoder string
	route   *sglang.Route
}

// Reasons for encgate_upstream_refused_total: the gateway's own limits that
// refuse an exchange before anything is sent.
const (
	RefusedMaxInflight = "max_inflight" // limits.max_inflight_per_encoder
	RefusedPollShare   = "poll_share"   // limits.poll_share: the long polls' bound
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
		ejected: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "encgate_breaker_ejected",
			Help: "1 while an encoder is ejected by its breaker: from a trip that ejected it until the breaker closes again (open and half-open), else 0.",
		}, []string{"encoder"}),
		ejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_breaker_ejections_total",
			Help: "Ejections per encoder: each trip that took the encoder out of service, a half-open breaker's reopening included.",
		}, []string{"encoder"}),
		skipped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_breaker_ejections_skipped_total",
			Help: "Trips per encoder that breaker.max_ejected_percent kept in service: ejecting the encoder would have taken the fleet's ejected share past the bound (or ejected all of it).",
		}, []string{"encoder"}),
		ejection: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "encgate_breaker_ejection_seconds",
			Help: "Length of the encoder's current (or last) ejection: breaker.base_ejection_time times its trips, at most max_ejection_time; 0 before the first.",
		}, []string{"encoder"}),
		healthy: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "encgate_upstream_healthy",
			Help: "Active health per encoder: 1 up, 0 down.",
		}, []string{"encoder"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_upstream_refused_total",
			Help: "Exchanges the gateway refused before sending anything, by encoder and reason: max_inflight (limits.max_inflight_per_encoder), poll_share (a long poll past limits.poll_share of it), max_conns (upstream.max_conns_per_encoder) or breaker (an /encode the breaker admitted no more of).",
		}, []string{"encoder", "reason"}),
		polls: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "encgate_upstream_polls_inflight",
			Help: "Long polls in flight per encoder: metadata pulls and registrations of parts not known encoded when sent, which limits.poll_share bounds.",
		}, []string{"encoder"}),
		outcomes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_breaker_outcomes_total",
			Help: "Exchanges as each encoder's breaker counted them: success, fault (an instance fault) or ignored (caused by the request, another request's failure, a long-poll that ran out, breaker.ignore, or the gateway's own limits).",
		}, []string{"encoder", "outcome"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_upstream_requests_total",
			Help: "Exchanges with encoders, by encoder, route and status code; code is dial_error, stale, timeout, error or refused when no answer came.",
		}, []string{"encoder", "route", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "encgate_upstream_request_duration_seconds",
			Help:    "Time from sending an exchange to an encoder to reading its answer (or its failure), by encoder; long polls (metadata pulls and registrations of a part not known encoded, which an encoder may hold) are left out.",
			Buckets: prometheus.ExponentialBucketsRange(0.001, 120, 18),
		}, []string{"encoder"}),
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
		metaShared: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_metadata_pulls_shared_total",
			Help: "Metadata pull attempts answered without a round trip of their own (affinity.metadata_cache), by how: inflight (took the answer of the same part's pull already at the encoder) or answered (a kept 200 of that part and encoder).",
		}, []string{"how"}),
	}
	m.parked = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "encgate_upstream_parked",
		Help: "Attempts whose request is out and whose answer the encoder has not begun (50 ms after the request went out, or later), parked: watched by the poller with no goroutine of their own (long polls: metadata pulls and registrations).",
	})
	m.metaWaiting = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "encgate_metadata_pulls_waiting",
		Help: "Metadata pulls waiting for another pull of the same part at its encoder to be answered (affinity.metadata_cache: every receiver TP rank pulls each part); a parkable one waits parked, with no goroutine of its own.",
	})
	m.paused = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "encgate_upstream_backoffs_parked",
		Help: "Calls waiting out a retry backoff parked: a timer with no goroutine of their own (long polls and /encode, whose attempts park; other routes sleep their backoffs).",
	})
	reg.MustRegister(m.state, m.transitions, m.ejected, m.ejections, m.skipped, m.ejection, m.healthy, m.refused, m.polls, m.outcomes, m.requests, m.duration, m.retries, m.budgetExhausted, m.backoff, m.metaShared, m.metaWaiting, m.parked, m.paused)
	m.metaShared.WithLabelValues(SharedInflight)
	m.metaShared.WithLabelValues(SharedAnswered)
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
	e := t.enc
	if c := e.outcomes[v.Breaker]; c != nil {
		c.Inc() // after forget, a child no longer in the vector: counted nowhere
	}
	if v.Label == "" {
		return
	}
	hot := v.Kind == KindAnswered && v.Status == 200
	if hot && !e.forgotten.Load() {
		// Found: a live series, or one forget deleted a moment ago (then
		// the increment is lost with the series, as it should be). A
		// forgotten e never counts into a later encoder of its name.
		if c, ok := m.hot.Load(hotKey{e.Name, rt}); ok {
			c.(prometheus.Counter).Inc()
			return
		}
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	if e.forgotten.Load() {
		return // the encoder was removed and its series with it
	}
	if v.Kind == KindBreakerBusy {
		m.refused.WithLabelValues(e.Name, RefusedBreaker).Inc()
	}
	c := m.requests.WithLabelValues(e.Name, rt.Label, v.Label)
	if hot {
		m.hot.Store(hotKey{e.Name, rt}, c) // the vector returns the same child to every caller
	}
	c.Inc()
}

// track sets e's state series; e is new to the pool.
func (m *poolMetrics) track(e *Encoder) {
	// Read the states before taking mu: Breaker.Snapshot may move an
	// expired open breaker to half-open, whose onChange (breakerChanged)
	// takes mu.
	bs := e.Breaker.Snapshot()
	ejected := 0.0
	if bs.Ejected {
		ejected = 1
	}
	up := 0.0
	if e.Health.Up() {
		up = 1
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	if e.forgotten.Load() {
		return
	}
	m.state.WithLabelValues(e.Name).Set(float64(bs.State))
	m.ejected.WithLabelValues(e.Name).Set(ejected)
	m.ejection.WithLabelValues(e.Name).Set(bs.Ejection.Seconds())
	m.ejections.WithLabelValues(e.Name)
	m.skipped.WithLabelValues(e.Name)
	m.healthy.WithLabelValues(e.Name).Set(up)
}

// latency returns name's exchange duration histogram (creating it).
func (m *poolMetrics) latency(name string) prometheus.Observer {
	return m.duration.WithLabelValues(name)
}

// refusals returns name's refusal counters (creating both series).
func (m *poolMetrics) refusals(name string) (inflight, conns prometheus.Counter) {
	return m.refused.WithLabelValues(name, RefusedMaxInflight), m.refused.WithLabelValues(name, RefusedMaxConns)
}

// pollSeries returns name's long-poll refusal counter and its gauge of long
// polls in flight (creating both series).
func (m *poolMetrics) pollSeries(name string) (refused prometheus.Counter, inflight prometheus.Gauge) {
	return m.refused.WithLabelValues(name, RefusedPollShare), m.polls.WithLabelValues(name)
}

// forget deletes every series of e's name and its hot entries, for an
// encoder whose name the fleet no longer has. e is marked first, under mu,
// so that nothing counted for it later creates them again; counters e
// itself holds (outcomes, refusals) are out of the vectors from here on,
// and go when e does.
func (m *poolMetrics) forget(e *Encoder) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e.forgotten.Store(true)
	name := e.Name
	m.state.DeleteLabelValues(name)
	m.healthy.DeleteLabelValues(name)
	m.polls.DeleteLabelValues(name)
	m.ejected.DeleteLabelValues(name)
	m.ejections.DeleteLabelValues(name)
	m.skipped.DeleteLabelValues(name)
	m.ejection.DeleteLabelValues(name)
	m.refused.DeletePartialMatch(prometheus.Labels{"encoder": name})
	m.outcomes.DeletePartialMatch(prometheus.Labels{"encoder": name})
	m.transitions.DeletePartialMatch(prometheus.Labels{"encoder": name})
	m.requests.DeletePartialMatch(prometheus.Labels{"encoder": name})
	m.duration.DeleteLabelValues(name)
	m.hot.Range(func(k, _ any) bool {
		if k.(hotKey).encoder == name {
			m.hot.Delete(k)
		}
		return true
	})
}

// breakerChanged records a transition of e's breaker. It runs under the
// breaker's lock (see BreakerHooks), so it only takes mu for reading.
func (m *poolMetrics) breakerChanged(e *Encoder, from, to BreakerState) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if e.forgotten.Load() {
		return
	}
	m.state.WithLabelValues(e.Name).Set(float64(to))
	m.transitions.WithLabelValues(e.Name, from.String(), to.String()).Inc()
	if to == BreakerClosed {
		m.ejected.WithLabelValues(e.Name).Set(0)
	}
}

// breakerTripped records a trip of e's breaker, under its lock as
// breakerChanged.
func (m *poolMetrics) breakerTripped(e *Encoder, trip BreakerTrip) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if e.forgotten.Load() {
		return
	}
	if !trip.Ejected {
		m.skipped.WithLabelValues(e.Name).Inc()
		return
	}
	m.ejected.WithLabelValues(e.Name).Set(1)
	m.ejections.WithLabelValues(e.Name).Inc()
	m.ejection.WithLabelValues(e.Name).Set(trip.Ejection.Seconds())
}

func (m *poolMetrics) healthChanged(e *Encoder, up bool) {
	v := 0.0
	if up {
		v = 1
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	if e.forgotten.Load() {
		return
	}
	m.healthy.WithLabelValues(e.Name).Set(v)
}
