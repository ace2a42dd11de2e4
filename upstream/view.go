package upstream

import "time"

// EncoderState is one encoder as the admin listener shows it: a row of
// GET /admin/upstreams and of the status page.
type EncoderState struct {
	Name string `json:"name"`
	URL  string `json:"url"`
	// Source is where the encoder came from: static (the config file),
	// registered (sglang's bootstrap API) or dns.
	Source string `json:"source"`
	// Membership is active (takes new work) or draining (left its source;
	// serves only the req_ids pinned to it, and is dropped once none is).
	Membership string         `json:"membership"`
	Usable     bool           `json:"usable"`
	State      string         `json:"state"`
	Inflight   int64          `json:"inflight"`
	Polls      int64          `json:"polls"` // the long polls among Inflight (limits.poll_share)
	Requests   uint64         `json:"requests"`
	Pins       int            `json:"pins"`
	Breaker    BreakerView    `json:"breaker"`
	Health     HealthSnapshot `json:"health"`
	// Learned is what the encoder's answers taught the gateway of its
	// sglang generation's behaviour (Encoder.Learned).
	Learned LearnedView `json:"learned"`
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
func breakerView(s BreakerSnapshot) BreakerView {
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

// States is every encoder's state, in fleet order.
func (p *Pool) States() []EncoderState {
	pins := p.PinsByEncoder()
	var out []EncoderState
	for _, e := range p.Encoders() {
		membership := "active"
		if e.Draining() {
			membership = "draining"
		}
		out = append(out, EncoderState{
			Name: e.Name, URL: e.URL, Source: e.Source(), Membership: membership, Usable: e.Usable(), State: e.State(),
			Inflight: e.Inflight(), Polls: e.Polls(), Requests: e.Requests(), Pins: pins[e.Name],
			Breaker: breakerView(e.Breaker.Snapshot()),
			Health:  e.Health.Snapshot(), Learned: e.Learned(),
		})
	}
	return out
}
