package idempotency

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the dedupe collectors, registered on the registry passed in.
type Metrics struct {
	forwarded    prometheus.Counter
	inflight     prometheus.Counter
	replay       prometheus.Counter
	released     prometheus.Counter
	conflicts    prometheus.Counter
	waitTimeouts prometheus.Counter
	failOpen     prometheus.Counter
	storeErrors  *prometheus.CounterVec
	destLimit    prometheus.Counter
	panics       prometheus.Counter
	refused      prometheus.Counter
	pending      prometheus.Gauge
	lost         *prometheus.CounterVec
	orphans      prometheus.Gauge
	orphanEnds   *prometheus.CounterVec
}

// NewMetrics registers the dedupe metrics. For the memory store it also
// exports its record count and evictions.
func NewMetrics(reg prometheus.Registerer, mem *Memory) *Metrics {
	dup := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "encgate_send_duplicates_suppressed_total",
		Help: "Duplicate /sends answered without reaching the encoder, by reason: inflight (coalesced), replay (stored answer), released (req_id already released).",
	}, []string{"reason"})
	m := &Metrics{
		forwarded: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "encgate_send_forwarded_total",
			Help: "/sends forwarded to an encoder (or its agent).",
		}),
		inflight: dup.WithLabelValues("inflight"),
		replay:   dup.WithLabelValues("replay"),
		released: dup.WithLabelValues("released"),
		conflicts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "encgate_send_conflicts_total",
			Help: "/sends refused with 422: the key was used with a different session_id or buffer_address.",
		}),
		waitTimeouts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "encgate_send_wait_timeouts_total",
			Help: "Duplicate /sends whose deadline passed while the first was still in flight (504).",
		}),
		failOpen: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "encgate_idempotency_fail_open_total",
			Help: "/sends forwarded without dedupe because the store was unreachable (redis.fail_open).",
		}),
		storeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_idempotency_store_errors_total",
			Help: "Failed store operations, by operation.",
		}, []string{"op"}),
	}
	m.destLimit = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "encgate_send_destinations_refused_total",
		Help: "/sends refused with 400 because their req_id already had as many destinations as idempotency.max_destinations_per_req_id (or the memory store's capacity) allows.",
	})
	m.panics = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "encgate_send_forward_panics_total",
		Help: "/sends whose forwarding panicked in the gateway; the caller and its waiters got a 500 envelope.",
	})
	m.refused = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "encgate_idempotency_complete_refused_total",
		Help: "/send answers the store refused to write (Redis out of memory, read-only, unreachable); each is held by the replica that forwarded it and retried.",
	})
	m.pending = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "encgate_idempotency_complete_pending",
		Help: "/send answers held by this replica until the store takes them.",
	})
	m.lost = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "encgate_idempotency_complete_lost_total",
		Help: "Held /send answers whose protection ended before the store took them, by reason: claim_lost (the claim lapsed or another replica took it: the /send may be forwarded again), expired (refused for the whole ttl), closed (the gateway stopped).",
	}, []string{"reason"})
	m.orphans = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "encgate_idempotency_orphaned_claims",
		Help: "Claims that failed Redis calls may have left (a claim whose reply was lost, an abandon that failed), with nothing forwarded under them, that this replica keeps to end once Redis answers.",
	})
	m.orphanEnds = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "encgate_idempotency_orphaned_claims_total",
		Help: "Claims left by failed Redis calls, by how each was resolved: abandoned (ended once Redis answered, waiters woken), taken_over (this replica's retry of the /send took it over), absent (Redis had not set it), expired (Redis did not answer before claim_ttl), closed (shutdown), overflow (not kept: past idempotency.max_orphaned_claims; it expires with claim_ttl).",
	}, []string{"outcome"})
	reg.MustRegister(dup, m.forwarded, m.conflicts, m.waitTimeouts, m.failOpen, m.storeErrors,
		m.destLimit, m.panics, m.refused, m.pending, m.lost, m.orphans, m.orphanEnds)
	for _, op := range []string{"claim", "complete", "abandon"} {
		m.storeErrors.WithLabelValues(op)
	}
	for _, reason := range []string{lostClaim, lostExpired, lostClosed} {
		m.lost.WithLabelValues(reason)
	}
	for _, o := range []string{orphanAbandoned, orphanTakenOver, orphanAbsent, orphanExpired, orphanClosed, orphanOverflow} {
		m.orphanEnds.WithLabelValues(o)
	}
	if mem != nil {
		reg.MustRegister(
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "encgate_idempotency_records",
				Help: "/send records held by the memory store.",
			}, func() float64 { return float64(mem.Records()) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "encgate_idempotency_evictions_total",
				Help: "Live /send records dropped because idempotency.capacity was reached.",
			}, func() float64 { return float64(mem.Evictions()) }),
		)
	}
	return m
}

// The store's side of the metrics; a nil *Metrics (a store used without
// Sends, in tests) counts nothing.

func (m *Metrics) completeRefused() {
	if m != nil {
		m.refused.Inc()
		m.pending.Inc()
	}
}

func (m *Metrics) pendingDone() {
	if m != nil {
		m.pending.Dec()
	}
}

func (m *Metrics) completeLost(reason string) {
	if m != nil {
		m.lost.WithLabelValues(reason).Inc()
	}
}

func (m *Metrics) orphanAdded() {
	if m != nil {
		m.orphans.Inc()
	}
}

// orphanEnded counts an orphaned claim resolved by outcome; one not kept
// (overflow) was never counted as held.
func (m *Metrics) orphanEnded(outcome string) {
	if m == nil {
		return
	}
	m.orphanEnds.WithLabelValues(outcome).Inc()
	if outcome != orphanOverflow {
		m.orphans.Dec()
	}
}
