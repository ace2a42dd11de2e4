package gateway

import (
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/encgate/encgate/idempotency"
	"github.com/encgate/encgate/internal/admin"
	"github.com/encgate/encgate/internal/bearer"
)

// adminMux serves the admin listener: the routes every admin listener
// has (internal/admin: /metrics, /healthz, /readyz, pprof), and the
// gateway's own behind admin.token, read from the live config per request.
func (s *Server) adminMux() *http.ServeMux {
	mux, protected, page := admin.NewMux(admin.Options{
		Registry:   s.reg,
		Ready:      s.ready.Load,
		Checks:     func() []admin.Check { return []admin.Check{s.dedupeCheck()} },
		Token:      func() string { return s.conf().Admin.Required() },
		Realm:      "encgate admin",
		Refused:    func(*http.Request, bearer.Outcome) { s.metrics.adminUnauthorized.Inc() },
		SessionTTL: func() time.Duration { return s.conf().Admin.SessionTTL.D() },
		Clock:      s.clk,
		Cookie:     "encgate_admin",
		Title:      "encgate",
	})
	page("GET /{$}", s.serveStatus) // the status page (status.go)
	protected("GET /admin/upstreams", s.serveUpstreams)
	protected("GET /admin/sends/{req_id}", s.serveSendRecord)
	protected("GET /admin/registrations", s.serveRegistrations)
	return mux
}

// dedupeCheck is the /send store's line on /readyz?verbose. It is
// advisory: while the store does not answer, /sends are refused (or
// forwarded without dedupe, idempotency.fail_open) but /encode and its
// follow-ups serve, and a store the replicas share fails for all of them
// at once, so readiness does not depend on it (docs/operations/redis.md).
func (s *Server) dedupeCheck() admin.Check {
	c := admin.Check{Name: "dedupe_store", Advisory: true}
	if h := storeHealth(s.store.Store); !h.Up {
		c.Err = fmt.Errorf("%v (since %s)", h.Err, h.Since.UTC().Format(time.RFC3339))
	}
	return c
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

func (s *Server) serveUpstreams(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, s.pool.States())
}

// serveRegistrations shows where the gateway's own registrations with
// sglang bootstrap servers stand (register_with): per bootstrap and URL,
// registered or pending, attempts, the last error. An empty list when
// register_with is not set.
func (s *Server) serveRegistrations(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, s.fleet.Registrations())
}
