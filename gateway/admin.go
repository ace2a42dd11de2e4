package gateway

import (
	"encoding/json"
	"net/http"
	"time"

	"github.com/encgate/encgate/idempotency"
	"github.com/encgate/encgate/internal/admin"
	"github.com/encgate/encgate/internal/bearer"
	"github.com/encgate/encgate/upstream"
)

// adminMux serves the admin listener: the routes every admin listener
// has (internal/admin: /metrics, /healthz, /readyz, pprof), and the
// gateway's own behind admin.token, read from the live config per request.
func (s *Server) adminMux() *http.ServeMux {
	mux, protected := admin.NewMux(admin.Options{
		Registry: s.reg,
		Ready:    s.ready.Load,
		Token:    func() string { return s.conf().Admin.token() },
		Realm:    "encgate admin",
		Refused:  func(*http.Request, bearer.Outcome) { s.metrics.adminUnauthorized.Inc() },
	})
	protected("GET /{$}", s.serveStatus) // the status page (status.go)
	protected("GET /admin/upstreams", s.serveUpstreams)
	protected("GET /admin/sends/{req_id}", s.serveSendRecord)
	protected("GET /admin/registrations", s.serveRegistrations)
	return mux
}

// serveSendRecord shows one req_id's /send destinations: done (with the
// stored status) or in flight, the receive count and whether it is released.
func (s *Server) serveSendRecord(w http.ResponseWriter, r *http.Request) {
	reqID := r.PathValue("req_id")
	view, err := s.sends.Store().Inspect(r.Context(), reqID)
	if err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	known := map[string]bool{}
	for _, d := range view.Destinations {
		known[d.Dest] = true
	}
	for _, dest := range s.sends.Inflight(reqID) {
		if !known[dest] {
			view.Destinations = append(view.Destinations, idempotency.DestView{Dest: dest, State: "in_flight"})
		}
	}
	if view.Destinations == nil {
		view.Destinations = []idempotency.DestView{}
	}
	writeJSON(w, view)
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// UpstreamState is one row of GET /admin/upstreams.
type UpstreamState struct {
	Name string `json:"name"`
	URL  string `json:"url"`
	// Source is where the encoder came from: static (the config file),
	// registered (sglang's bootstrap API) or dns.
	Source string `json:"source"`
	// Membership is active (takes new work) or draining (left its source;
	// serves only the req_ids pinned to it, and is dropped once none is).
	Membership string                  `json:"membership"`
	Usable     bool                    `json:"usable"`
	State      string                  `json:"state"`
	Inflight   int64                   `json:"inflight"`
	Polls      int64                   `json:"polls"` // the long polls among Inflight (limits.poll_share)
	Requests   uint64                  `json:"requests"`
	Pins       int                     `json:"pins"`
	Breaker    BreakerView             `json:"breaker"`
	Health     upstream.HealthSnapshot `json:"health"`
	// Learned is what the encoder's answers taught the gateway of its
	// sglang generation's behaviour (upstream.Encoder.Learned).
	Learned upstream.LearnedView `json:"learned"`
}

// BreakerView is the passive (breaker) state of an encoder. The counts
// (requests .. consecutive_successes) are since the state last changed;
// recent_* are the last min_requests successes and faults that
// failure_ratio reads.
type BreakerView struct {
	State                string `json:"state"`
	Requests             uint32 `json:"requests"`
	TotalSuccesses       uint32 `json:"total_successes"`
	TotalFailures        uint32 `json:"total_failures"`
	ConsecutiveFailures  uint32 `json:"consecutive_failures"`
	ConsecutiveSuccesses uint32 `json:"consecutive_successes"`
	RecentCounted        int    `json:"recent_counted"`
	RecentFaults         int    `json:"recent_faults"`
	// Ejected: from a trip that ejected the encoder until its breaker
	// closes again (open and half-open).
	Ejected bool `json:"ejected"`
	// Trips is the multiplier of the current ejection while ejected, else
	// of the last one after ejection_decay: the next is one more.
	Trips int `json:"trips"`
	// Ejections and SkippedEjections count the breaker's ejections and the
	// trips max_ejected_percent kept in service.
	Ejections        uint64 `json:"ejections"`
	SkippedEjections uint64 `json:"skipped_ejections"`
	// EjectionSeconds is the current (or last) ejection's length;
	// EjectedAt and EjectedUntil when it began and ends, while ejected.
	EjectionSeconds float64   `json:"ejection_seconds"`
	EjectedAt       time.Time `json:"ejected_at,omitzero"`
	EjectedUntil    time.Time `json:"ejected_until,omitzero"`
}

// breakerView is s's view.
func breakerView(s upstream.BreakerSnapshot) BreakerView {
	v := BreakerView{State: s.State.String(), Requests: s.Counts.Requests, TotalSuccesses: s.Counts.TotalSuccesses,
		TotalFailures: s.Counts.TotalFailures, ConsecutiveFailures: s.Counts.ConsecutiveFailures,
		ConsecutiveSuccesses: s.Counts.ConsecutiveSuccesses, RecentCounted: s.RecentCounted, RecentFaults: s.RecentFaults,
		Ejected: s.Ejected, Trips: s.Trips, Ejections: s.Ejections, SkippedEjections: s.Skipped,
		EjectionSeconds: s.Ejection.Seconds()}
	if s.Ejected {
		v.EjectedAt, v.EjectedUntil = s.EjectedAt, s.Until
	}
	return v
}

func (s *Server) serveUpstreams(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, s.upstreamStates())
}

// upstreamStates is every encoder's row, in fleet order.
func (s *Server) upstreamStates() []UpstreamState {
	pins := s.pool.PinsByEncoder()
	var out []UpstreamState
	for _, e := range s.pool.Encoders() {
		membership := "active"
		if e.Draining() {
			membership = "draining"
		}
		out = append(out, UpstreamState{
			Name: e.Name, URL: e.URL, Source: e.Source(), Membership: membership, Usable: e.Usable(), State: e.State(),
			Inflight: e.Inflight(), Polls: e.Polls(), Requests: e.Requests(), Pins: pins[e.Name],
			Breaker: breakerView(e.Breaker.Snapshot()),
			Health:  e.Health.Snapshot(), Learned: e.Learned(),
		})
	}
	return out
}

// serveRegistrations shows where the gateway's own registrations with
// sglang bootstrap servers stand (register_with): per bootstrap and URL,
// registered or pending, attempts, the last error. An empty list when
// register_with is not set.
func (s *Server) serveRegistrations(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, s.fleet.Registrations())
}
