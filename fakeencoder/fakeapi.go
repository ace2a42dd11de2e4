package fakeencoder

import (
	"encoding/json"
	"net/http"
	"time"
)

// faultsJSON is the JSON form of Faults served on /_fake/faults, with
// durations as Go duration strings ("250ms").
type faultsJSON struct {
	Latency       string   `json:"latency,omitempty"`
	MetadataDelay string   `json:"metadata_delay,omitempty"`
	Leading504s   int      `json:"leading_504s,omitempty"`
	FailureRate   float64  `json:"failure_rate,omitempty"`
	FailStatus    int      `json:"fail_status,omitempty"`
	FailMessage   string   `json:"fail_message,omitempty"`
	FailRoutes    []string `json:"fail_routes,omitempty"`
	Hang          bool     `json:"hang,omitempty"`
	Refuse        bool     `json:"refuse,omitempty"`
	HealthFail    bool     `json:"health_fail,omitempty"`
	HealthHang    bool     `json:"health_hang,omitempty"`
	HealthFlap    int      `json:"health_flap,omitempty"`
	CrashAt       int      `json:"crash_at,omitempty"`
	CrashRoutes   []string `json:"crash_routes,omitempty"`
	Truncate      bool     `json:"truncate,omitempty"`
	TruncRoutes   []string `json:"truncate_routes,omitempty"`
}

// toJSON converts f for /_fake/faults.
func (f Faults) toJSON() faultsJSON {
	dur := func(d time.Duration) string {
		if d == 0 {
			return ""
		}
		return d.String()
	}
	return faultsJSON{
		Latency: dur(f.Latency), MetadataDelay: dur(f.MetadataDelay),
		Leading504s: f.Leading504s, FailureRate: f.FailureRate,
		FailStatus: f.FailStatus, FailMessage: f.FailMessage, FailRoutes: f.FailRoutes,
		Hang: f.Hang, Refuse: f.Refuse, HealthFail: f.HealthFail, HealthHang: f.HealthHang,
		HealthFlap: f.HealthFlap, CrashAt: f.CrashAt, CrashRoutes: f.CrashRoutes,
		Truncate: f.Truncate, TruncRoutes: f.TruncateRoutes,
	}
}

// faults converts j back; it fails on a bad duration.
func (j faultsJSON) faults() (Faults, error) {
	f := Faults{
		Leading504s: j.Leading504s, FailureRate: j.FailureRate,
		FailStatus: j.FailStatus, FailMessage: j.FailMessage, FailRoutes: j.FailRoutes,
		Hang: j.Hang, Refuse: j.Refuse, HealthFail: j.HealthFail, HealthHang: j.HealthHang,
		HealthFlap: j.HealthFlap, CrashAt: j.CrashAt, CrashRoutes: j.CrashRoutes,
		Truncate: j.Truncate, TruncateRoutes: j.TruncRoutes,
	}
	for _, p := range []struct {
		s string
		d *time.Duration
	}{{j.Latency, &f.Latency}, {j.MetadataDelay, &f.MetadataDelay}} {
		if p.s == "" {
			continue
		}
		d, err := time.ParseDuration(p.s)
		if err != nil {
			return Faults{}, err
		}
		*p.d = d
	}
	return f, nil
}

// serveFake answers the control routes, which faults never touch:
// GET /_fake/stats, POST /_fake/reset (ResetStats), and GET or PUT/POST
// /_fake/faults (read or replace the faults; a JSON object, durations as Go
// duration strings).
func (e *Encoder) serveFake(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.URL.Path == RouteStats && r.Method == http.MethodGet:
		e.serveStats(w)
	case r.URL.Path == RouteReset && r.Method == http.MethodPost:
		e.ResetStats()
		writeJSON(w, http.StatusOK, nullJSON)
	case r.URL.Path == RouteFaults && r.Method == http.MethodGet:
		b, _ := json.Marshal(e.Faults().toJSON())
		writeJSON(w, http.StatusOK, b)
	case r.URL.Path == RouteFaults && (r.Method == http.MethodPut || r.Method == http.MethodPost):
		var j faultsJSON
		dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20))
		dec.DisallowUnknownFields()
		err := dec.Decode(&j)
		var f Faults
		if err == nil {
			f, err = j.faults()
		}
		if err != nil {
			writeDetail(w, http.StatusBadRequest, string(appendJSONString(nil, err.Error())))
			return
		}
		e.SetFaults(f)
		writeJSON(w, http.StatusOK, nullJSON)
	case r.URL.Path == RouteStats || r.URL.Path == RouteReset || r.URL.Path == RouteFaults:
		writeDetail(w, http.StatusMethodNotAllowed, `"Method Not Allowed"`)
	default:
		writeDetail(w, http.StatusNotFound, `"Not Found"`)
	}
}
