package gpuagent

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// Transfer results, the values of encgate_agent_transfers_total{result}.
const (
	resultOK         = "ok"          // the receiver confirmed the bytes
	resultRejected   = "rejected"    // range outside the peer's buffers; nothing written
	resultFailed     = "failed"      // handshake, connect, write or confirmation failed
	resultNotAllowed = "not_allowed" // destination outside transfer.allow_networks
)

// Ack results, the values of encgate_agent_acks_total{result}.
const (
	ackSent    = "sent"    // the frame reached the receiver's PULL socket
	ackFailed  = "failed"  // connect, handshake or write failed; the /send answered 500
	ackSkipped = "skipped" // a confirmed transfer with no ack: mode off, no frame (optional), or destination already acked
)

// Registration kinds, the values of encgate_agent_registrations_total{kind}.
const (
	regShared  = "shared"   // registered (pinned) once at staging
	regPerSend = "per_send" // the fallback: pinned around each send
	regDevice  = "device"   // a device copy (source=cuda); its pinned host buffers are the lanes'
)

// metrics are the agent's Prometheus collectors, registered on the registry
// passed to New (never the global one).
type metrics struct {
	stagedBytes    prometheus.Gauge
	deviceBytes    *prometheus.GaugeVec // by device ordinal
	stagedEntries  prometheus.Gauge
	transferBytes  prometheus.Counter
	transferTime   prometheus.Histogram
	transfers      *prometheus.CounterVec // result
	registrations  *prometheus.CounterVec // kind
	requests       *prometheus.CounterVec // route, code
	notifyFailures prometheus.Counter
	acks           *prometheus.CounterVec // result
	ackTime        prometheus.Histogram
	unauthorized   *prometheus.CounterVec // door
	stagesActive   prometheus.Gauge
	stagesCut      *prometheus.CounterVec // reason
	ownerConflicts prometheus.Counter
}

// Why a stage in progress ended without its bytes, the values of
// encgate_agent_stages_abandoned_total{reason}.
const (
	cutStalled = "stalled" // no body bytes for control.body_timeout
	cutClosed  = "closed"  // the connection closed or broke mid-body
	cutBusy    = "busy"    // staging.max_concurrent stages were already in progress
)

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		stagedBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "encgate_agent_staged_bytes",
			Help: "Bytes held for staged embeddings (being staged, staged, or released but still being sent) and staged ack frames, in host memory.",
		}),
		deviceBytes: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "encgate_agent_staged_device_bytes",
			Help: "Device memory held for embeddings staged by CUDA IPC handle, per device (cuda.capacity_bytes bounds it).",
		}, []string{"device"}),
		stagedEntries: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "encgate_agent_staged_entries",
			Help: "Staged entries held, failed encodes included.",
		}),
		transferBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "encgate_agent_transfer_bytes_total",
			Help: "Bytes written into receivers and confirmed.",
		}),
		transferTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "encgate_agent_transfer_seconds",
			Help:    "Time of one transfer through the Mooncake initiator (handshake included), whatever its result.",
			Buckets: prometheus.ExponentialBucketsRange(0.0001, 60, 20),
		}),
		transfers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_agent_transfers_total",
			Help: "Transfers by result: ok, rejected (range outside the peer's buffers), failed, not_allowed (destination outside transfer.allow_networks).",
		}, []string{"result"}),
		registrations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_agent_registrations_total",
			Help: "Memory registrations by kind: shared (once at staging) or per_send (the fallback, around each send).",
		}, []string{"kind"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_agent_requests_total",
			Help: "Requests answered on the control API, by route and status code.",
		}, []string{"route", "code"}),
		notifyFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "encgate_agent_notify_failures_total",
			Help: "Completion notices that failed after a confirmed transfer.",
		}),
		acks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_agent_acks_total",
			Help: "Completion acks after confirmed transfers, by result: sent, failed, skipped (mode off, no frame staged in optional mode, or the destination was already acked).",
		}, []string{"result"}),
		ackTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "encgate_agent_ack_seconds",
			Help:    "Time of one ack delivery (connect, ZMTP handshake, write and linger), sent or failed.",
			Buckets: prometheus.ExponentialBucketsRange(0.0001, 30, 16),
		}),
		unauthorized: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_agent_unauthorized_total",
			Help: "Requests refused with 401 for a missing or wrong bearer token, by door: control (the TCP listener's /send and receiver routes) or admin.",
		}, []string{"door"}),
		stagesActive: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "encgate_agent_stages_in_progress",
			Help: "Stages whose bytes are still arriving (each holds its reservation until it ends).",
		}),
		stagesCut: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_agent_stages_abandoned_total",
			Help: "Stages that ended without their bytes, by reason: stalled (no body bytes for control.body_timeout), closed (the connection went away mid-body), busy (staging.max_concurrent already in progress; refused before reserving).",
		}, []string{"reason"}),
		ownerConflicts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "encgate_agent_owner_conflicts_total",
			Help: "Stages, ack frames and failures refused with 409 because another process staged that req_id first.",
		}),
	}
	reg.MustRegister(m.stagedBytes, m.deviceBytes, m.stagedEntries, m.transferBytes, m.transferTime,
		m.transfers, m.registrations, m.requests, m.notifyFailures, m.acks, m.ackTime,
		m.unauthorized, m.stagesActive, m.stagesCut, m.ownerConflicts)
	for _, d := range []string{"control", "admin"} {
		m.unauthorized.WithLabelValues(d)
	}
	for _, r := range []string{cutStalled, cutClosed, cutBusy} {
		m.stagesCut.WithLabelValues(r)
	}
	for _, r := range []string{ackSent, ackFailed, ackSkipped} {
		m.acks.WithLabelValues(r)
	}
	for _, r := range []string{resultOK, resultRejected, resultFailed, resultNotAllowed} {
		m.transfers.WithLabelValues(r)
	}
	for _, k := range []string{regShared, regPerSend} {
		m.registrations.WithLabelValues(k)
	}
	return m
}

func (m *metrics) request(route string, code int) {
	m.requests.WithLabelValues(route, strconv.Itoa(code)).Inc()
}
