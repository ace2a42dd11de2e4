package gateway

import (
	_ "embed"
	"html/template"
	"net/http"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/encgate/encgate/internal/admin"
	"github.com/encgate/encgate/upstream"
)

// The status page (GET / on the admin listener, behind admin.token like
// /admin/...): one self-contained HTML page, no external assets, that
// refreshes itself, for the person on call. It shows what /admin/upstreams
// and /metrics hold, arranged for reading: each encoder, the duplicate
// suppression and retry counters, the gateway's latest own failure answers,
// and the part of the config a reload changes.

//go:embed status.html
var statusHTML string

var statusPage = admin.Parse("status", statusHTML, template.FuncMap{
	"lower": strings.ToLower,
	"ago": func(t time.Time, now time.Time) string {
		if t.IsZero() {
			return "never"
		}
		return now.Sub(t).Round(time.Second).String() + " ago"
	},
})

// statusView is what the template renders.
type statusView struct {
	Now        time.Time
	Uptime     string
	Listen     string
	Ready      bool
	Encoders   []upstream.EncoderState
	Counters   []admin.Group
	Failures   []admin.Failure
	Reloadable string // the reloadable config, as YAML
	Refresh    int    // seconds
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

func (s *Server) serveStatus(w http.ResponseWriter, _ *http.Request) {
	now := s.clk.Now()
	c := s.conf()
	v := statusView{Now: now, Uptime: now.Sub(s.started).Round(time.Second).String(), Ready: s.ready.Load(),
		Encoders: s.pool.States(), Failures: s.recent.List(), Refresh: 5}
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
