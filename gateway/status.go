package gateway

import (
	_ "embed"
	"html/template"
	"net/http"
	"runtime/debug"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/encgate/encgate/internal/admin"
	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/upstream"
)

// The status page (GET / on the admin listener, behind admin.token like
// /admin/...; a browser signs in with a form, internal/admin): one
// self-contained HTML page, no external assets and no script, that
// refreshes itself, for the person on call. It shows what /admin/upstreams
// and /metrics hold, arranged for reading: the version and uptime; each
// encoder with its exchanges per second, error share and p50/p99 latency
// over the last minute and a sparkline of its last ten minutes
// (statusrates.go), its breaker and ejections; the duplicate suppression
// as rates, the counters, the gateway's latest own failure answers, and
// the part of the config a reload changes.

//go:embed status.html
var statusHTML string

var statusPage = admin.Parse("status", statusHTML, template.FuncMap{
	"lower": strings.ToLower,
	"ago": func(t time.Time, now time.Time) string {
		if t.IsZero() {
			return "never"
		}
		return admin.HumanDuration(now.Sub(t).Round(time.Second)) + " ago"
	},
})

// statusView is what the template renders.
type statusView struct {
	Now        time.Time
	Version    string
	Uptime     time.Duration
	Listen     string
	Ready      bool
	SignedIn   bool // through the session cookie: the page offers sign-out
	Window     time.Duration
	Encoders   []encoderRow
	Dups       dupRates
	Counters   []admin.Group
	Failures   []admin.Failure
	Reloadable string // the reloadable config, as YAML
	Refresh    int    // seconds
}

// encoderRow is one encoder: its state and its figures.
type encoderRow struct {
	upstream.EncoderState
	Rates       encRates
	Spark       string  // the sparkline's points
	SparkPeak   float64 // its highest req/s
	LastEjected time.Time
}

// Sparklines are drawn in a box this wide and high (CSS pixels).
const sparkW, sparkH = 120, 24

// statusSampler takes the status page's samples (statusrates.go).
type statusSampler struct {
	r    *statusRates
	quit chan struct{}
	done chan struct{}
}

// startStatusSampler takes the first sample and, on the wall clock, one
// every statusSampleEvery until Shutdown. On any other clock (a test's)
// no timer is made: samples are taken as the page renders (one when the
// newest is statusSampleEvery old) and by sampleStatus.
func (s *Server) startStatusSampler() {
	s.rates.r = newStatusRates()
	s.sampleStatus()
	if _, wall := s.clk.(clock.Real); !wall {
		return
	}
	s.rates.quit, s.rates.done = make(chan struct{}), make(chan struct{})
	go func() {
		defer close(s.rates.done)
		t := time.NewTicker(statusSampleEvery)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				s.sampleStatus()
			case <-s.rates.quit:
				return
			}
		}
	}()
}

// stop ends the sampling goroutine, if any, and waits for it.
func (st *statusSampler) stop() {
	if st.quit != nil {
		close(st.quit)
		<-st.done
		st.quit = nil
	}
}

// sampleStatus adds a sample at the clock's now.
func (s *Server) sampleStatus() { s.rates.r.add(readSample(s.reg, s.clk.Now())) }

// buildVersion names the build: Deps.Version, else the module version the
// go command stamped, else the VCS commit (marked dirty), else "dev".
func buildVersion(v string) string {
	if v != "" {
		return v
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "dev"
	}
	if bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	var rev, dirty string
	for _, st := range bi.Settings {
		switch st.Key {
		case "vcs.revision":
			rev = st.Value
		case "vcs.modified":
			if st.Value == "true" {
				dirty = " (dirty)"
			}
		}
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	if rev == "" {
		return "dev"
	}
	return "dev " + rev + dirty
}

// statusFamilies are the counters the page shows, in order.
var statusFamilies = []admin.Family{
	{Title: "Duplicate /sends suppressed, by reason", Name: "encgate_send_duplicates_suppressed_total"},
	{Title: "/sends forwarded", Name: "encgate_send_forwarded_total"},
	{Title: "Retries, by route and reason", Name: "encgate_retries_total"},
	{Title: "Retry budget exhausted, by route", Name: "encgate_retry_budget_exhausted_total"},
	{Title: "Dedupe store errors", Name: "encgate_idempotency_store_errors_total"},
	{Title: "/sends forwarded without dedupe (fail-open)", Name: "encgate_idempotency_fail_open_total"},
	{Title: "Config reloads", Name: "encgate_config_reloads_total"},
}

// reloadable is the part of the config a reload applies at once.
type reloadable struct {
	Encoders              any     `yaml:"encoders"`
	Upstream              any     `yaml:"upstream"`
	Retry                 any     `yaml:"retry"`
	Breaker               any     `yaml:"breaker"`
	Health                any     `yaml:"health"`
	MaxInflightPerEncoder int     `yaml:"limits.max_inflight_per_encoder"`
	PollShare             float64 `yaml:"limits.poll_share"`
	AdminToken            any     `yaml:"admin.token"`
	LogLevel              any     `yaml:"log.level"`
}

func (s *Server) serveStatus(w http.ResponseWriter, r *http.Request) {
	now := s.clk.Now()
	c := s.conf()
	v := statusView{Now: now, Version: buildVersion(s.version), Uptime: now.Sub(s.started).Round(time.Second),
		Ready: s.ready.Load(), SignedIn: admin.SignedIn(r), Failures: s.recent.List(), Refresh: 5}
	rates := s.rates.r
	if rates == nil { // the server was not started: no history
		rates = newStatusRates()
	}
	states := s.pool.States()
	for _, st := range states {
		if st.Breaker.Ejected {
			rates.ejectedAt(st.Name, st.Breaker.EjectedAt)
		}
	}
	cur := readSample(s.reg, now)
	if rates.due(now) {
		rates.add(cur)
	}
	samples, lastEjected := rates.samples()
	v.Window = now.Sub(windowBase(samples, cur).At)
	v.Dups = dupsFor(samples, cur)
	for _, st := range states {
		row := encoderRow{EncoderState: st, Rates: ratesFor(st.Name, samples, cur), LastEjected: lastEjected[st.Name]}
		row.Spark = sparkPoints(row.Rates.Spark, sparkW, sparkH)
		for _, x := range row.Rates.Spark {
			row.SparkPeak = max(row.SparkPeak, x)
		}
		v.Encoders = append(v.Encoders, row)
	}
	if s.ln != nil {
		v.Listen = s.ln.Addr().String()
	}
	v.Counters = admin.Gather(s.reg, statusFamilies)
	token := "not set"
	switch {
	case c.Admin.TokenFile != "":
		token = "set from admin.token_file " + c.Admin.TokenFile + " (not shown)"
	case c.Admin.Token != "":
		token = "set (not shown)"
	}
	y, _ := yaml.Marshal(reloadable{Encoders: c.Encoders, Upstream: c.Upstream, Retry: c.Retry, Breaker: c.Breaker,
		Health: c.Health, MaxInflightPerEncoder: c.Limits.MaxInflightPerEncoder,
		PollShare: c.Limits.PollShare, AdminToken: token, LogLevel: c.Log.Level})
	v.Reloadable = string(y)
	admin.Write(w, statusPage, v)
}
