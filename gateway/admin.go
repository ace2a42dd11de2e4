package gateway

import (
	"encoding/json"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/encgate/encgate/idempotency"
	"github.com/encgate/encgate/internal/bearer"
	"github.com/encgate/encgate/internal/sglang"
	"github.com/encgate/encgate/upstream"
)

// adminMux serves the admin listener. With admin.token set, /admin/... and
// /debug/pprof/... (heap, goroutine stacks and the command line are in
// there) need the bearer token; /healthz and /readyz stay open for probes,
// and /metrics for scrapers (its labels are bounded: route, code, encoder
// name; never a req_id or a URL).
func (s *Server) adminMux() *http.ServeMux {
	mux := http.NewServeMux()
	protected := func(pattern string, h http.HandlerFunc) { mux.Handle(pattern, s.requireToken(h)) }
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{Registry: s.reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !s.ready.Load() {
			http.Error(w, "not ready", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
	protected("GET /{$}", s.serveStatus) // the status page (status.go)
	protected("GET /admin/upstreams", s.serveUpstreams)
	protected("GET /admin/sends/{req_id}", s.serveSendRecord)
	protected("GET /admin/registrations", s.serveRegistrations)
	// Go's profiler, on the admin listener only (never the encoder-facing one).
	protected("GET /debug/pprof/", pprof.Index)
	protected("GET /debug/pprof/cmdline", pprof.Cmdline)
	protected("GET /debug/pprof/profile", pprof.Profile)
	protected("GET /debug/pprof/symbol", pprof.Symbol)
	protected("GET /debug/pprof/trace", pprof.Trace)
	return mux
}

// bearerRealm is the challenge of a 401 on the admin listener.
const bearerRealm = "encgate admin"

// requireToken lets a request through to h when admin.token is unset or the
// request carries "Authorization: Bearer <token>" (the scheme in any case,
// RFC 7235); otherwise it answers 401 with a Bearer challenge (RFC 6750).
// The live config is read per request, so a reload changes the token at
// once. Tokens are compared in constant time, as SHA-256 digests so that
// not even the length leaks.
func (s *Server) requireToken(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch o := bearer.Authorize(r.Header.Get("Authorization"), s.conf().Admin.token()); o {
		case bearer.Allowed:
			h.ServeHTTP(w, r)
		default:
			s.metrics.adminUnauthorized.Inc()
			w.Header().Set("WWW-Authenticate", bearer.Challenge(bearerRealm, o))
			msg := `encgate: this admin route needs "Authorization: Bearer <admin.token>"`
			if o == bearer.Wrong {
				msg = "encgate: the bearer token is not admin.token"
			}
			writeAdminError(w, http.StatusUnauthorized, msg)
		}
	})
}

// writeAdminError answers an admin request with the gateway's envelope.
func writeAdminError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(sglang.AppendEnvelope(nil, msg, nil))
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
