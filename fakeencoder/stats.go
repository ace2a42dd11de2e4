package fakeencoder

import (
	"encoding/json"
	"maps"
	"net/http"
)

// Stats is a snapshot of what the encoder received, served as JSON by
// GET /_fake/stats.
type Stats struct {
	// Name is Options.Name.
	Name string `json:"name"`
	// Routes counts requests received per route path, faults included.
	Routes map[string]int64 `json:"routes"`
	// ReqIDs counts requests per string req_id, then per route.
	ReqIDs map[string]map[string]int64 `json:"req_ids"`
	// Sends counts the /send calls that reached the encoder logic (after
	// faults), keyed "req_id|prefill_host:embedding_port".
	Sends map[string]int64 `json:"sends"`
	// SendArrivals counts the /send calls that arrived, keyed as Sends but
	// counted as soon as the body is read, before any fault: the ones that
	// crashed the encoder, hung, failed or were answered truncated included.
	// It is what "a /send reached the encoder" means.
	SendArrivals map[string]int64 `json:"send_arrivals"`
	// Registrations counts the /scheduler_receive_url calls that arrived,
	// keyed "req_id|receive_url" and counted as soon as the body is read,
	// before any fault. Nil (and left out of the JSON) when there are none.
	Registrations map[string]int64 `json:"registrations,omitempty"`
	// Pushes lists the ZMQ messages pushed (Options.PushFrames), keyed
	// "req_id|url" (the registered receive_url, or
	// prefill_host:embedding_port), each PushEmbedding or PushError in push
	// order. A push counts once its frames were written and the receiver
	// closed its side or lingered past pushLinger. Nil (and left out of the
	// JSON) when there are none.
	Pushes map[string][]string `json:"pushes,omitempty"`
	// PushFailures counts the pushes that failed (refused, unreachable, cut
	// short), keyed as Pushes. Nil (and left out of the JSON) when there are
	// none.
	PushFailures map[string]int64 `json:"push_failures,omitempty"`
	// Staged is the number of req_ids with live request state.
	Staged int `json:"staged"`
	// Waiting counts the handlers blocked right now, per route: metadata,
	// registration, /send and zmq /encode waits, delays and hangs.
	Waiting map[string]int `json:"waiting"`
	// RegistrationAttempts counts the POST /register_encoder_url calls sent
	// to bootstrap servers (Options.RegisterURLs), every bootstrap and
	// retry together.
	RegistrationAttempts int64 `json:"registration_attempts"`
	// RegistrationsOK counts those answered 200: at most one per bootstrap
	// URL per join (Register), since a loop stops at its first success.
	RegistrationsOK int64 `json:"registrations_ok"`
	// Unregistrations counts the DELETE /unregister_encoder_url calls
	// answered 200 (Unregister, Close).
	Unregistrations int64 `json:"unregistrations"`
	// CacheHits counts the /encodes whose mm_items were in the media cache
	// (Options.CacheItems) and so skipped EncodeLatency.
	CacheHits int64 `json:"cache_hits"`
	// CacheMisses counts the /encodes that looked the media cache up and
	// did not find their mm_items; each paid EncodeLatency. Both counters
	// stay 0 with the cache off, and neither counts an /encode that failed
	// in preprocessing.
	CacheMisses int64 `json:"cache_misses"`
}

// statsData holds the counters behind Stats; guarded by Encoder.mu.
type statsData struct {
	routes   map[string]int64
	reqIDs   map[string]map[string]int64
	sends    map[string]int64
	arrivals map[string]int64
	regs     map[string]int64    // nil until the first registration
	pushes   map[string][]string // nil until the first push
	pushErrs map[string]int64    // nil until the first failed push

	regAttempts int64 // Stats.RegistrationAttempts
	regOK       int64 // Stats.RegistrationsOK
	unregs      int64 // Stats.Unregistrations
	cacheHits   int64 // Stats.CacheHits
	cacheMisses int64 // Stats.CacheMisses
}

// pushed records one pushed message of kind under key.
func (s *statsData) pushed(key, kind string) {
	if s.pushes == nil {
		s.pushes = map[string][]string{}
	}
	s.pushes[key] = append(s.pushes[key], kind)
}

// pushFailed records one failed push under key.
func (s *statsData) pushFailed(key string) {
	if s.pushErrs == nil {
		s.pushErrs = map[string]int64{}
	}
	s.pushErrs[key]++
}

func newStatsData() statsData {
	return statsData{
		routes:   map[string]int64{},
		reqIDs:   map[string]map[string]int64{},
		sends:    map[string]int64{},
		arrivals: map[string]int64{},
	}
}

// countRequest records one received request: its route, its string req_id,
// for a /send with a req_id its arrival per destination, and for a
// registration with a req_id and a receive_url its arrival per URL.
func (e *Encoder) countRequest(req *request) {
	route, reqID := req.route, req.statsID()
	var arrival, reg string
	if route == RouteSend && req.idVal != nil {
		arrival = req.id() + "|" + destination(req.field("prefill_host"), req.field("embedding_port"))
	}
	if url := req.field("receive_url"); route == RouteRegister && req.idVal != nil && url != nil {
		reg = req.id() + "|" + pyStr(url)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.stats.routes[route]++
	if arrival != "" {
		e.stats.arrivals[arrival]++
	}
	if reg != "" {
		if e.stats.regs == nil {
			e.stats.regs = map[string]int64{}
		}
		e.stats.regs[reg]++
	}
	if reqID == "" {
		return
	}
	m := e.stats.reqIDs[reqID]
	if m == nil {
		m = map[string]int64{}
		e.stats.reqIDs[reqID] = m
	}
	m[route]++
}

// Stats returns a snapshot of the counters and live state.
func (e *Encoder) Stats() Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	s := Stats{
		Name:         e.opts.Name,
		Routes:       maps.Clone(e.stats.routes),
		ReqIDs:       make(map[string]map[string]int64, len(e.stats.reqIDs)),
		Sends:        maps.Clone(e.stats.sends),
		SendArrivals: maps.Clone(e.stats.arrivals),
		Staged:       len(e.states),
		Waiting:      maps.Clone(e.waiting),

		Registrations: maps.Clone(e.stats.regs),
		PushFailures:  maps.Clone(e.stats.pushErrs),

		RegistrationAttempts: e.stats.regAttempts,
		RegistrationsOK:      e.stats.regOK,
		Unregistrations:      e.stats.unregs,
		CacheHits:            e.stats.cacheHits,
		CacheMisses:          e.stats.cacheMisses,
	}
	if e.stats.pushes != nil {
		s.Pushes = make(map[string][]string, len(e.stats.pushes))
		for k, v := range e.stats.pushes {
			s.Pushes[k] = append([]string(nil), v...)
		}
	}
	for id, m := range e.stats.reqIDs {
		s.ReqIDs[id] = maps.Clone(m)
	}
	return s
}

// ResetStats zeroes the request counters (live state is kept).
func (e *Encoder) ResetStats() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.stats = newStatsData()
}

// serveStats answers GET /_fake/stats.
func (e *Encoder) serveStats(w http.ResponseWriter) {
	b, err := json.Marshal(e.Stats())
	if err != nil {
		writeEmpty(w, http.StatusInternalServerError)
		return
	}
	writeJSON(w, http.StatusOK, b)
}
