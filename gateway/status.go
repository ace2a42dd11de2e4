package gateway

import (
	"bytes"
	_ "embed"
	"html/template"
	"net/http"
	"sort"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"go.yaml.in/yaml/v3"
)

// The status page (GET / on the admin listener, behind admin.token like
// /admin/...): one self-contained HTML page, no external assets, that
// refreshes itself, for the person on call. It shows what /admin/upstreams
// and /metrics hold, arranged for reading: each encoder, the duplicate
// suppression and retry counters, the gateway's latest own failure answers,
// and the part of the config a reload changes.

//go:embed status.html
var statusHTML string

var statusPage = template.Must(template.New("status").Funcs(template.FuncMap{
	"lower": strings.ToLower,
	"ago": func(t time.Time, now time.Time) string {
		if t.IsZero() {
			return "never"
		}
		return now.Sub(t).Round(time.Second).String() + " ago"
	},
}).Parse(statusHTML))

// statusView is what the template renders.
type statusView struct {
	Now        time.Time
	Uptime     string
	Listen     string
	Ready      bool
	Encoders   []UpstreamState
	Counters   []counterGroup
	Failures   []recentFailure
	Reloadable string // the reloadable config, as YAML
	Refresh    int    // seconds
}

// counterGroup is one metric family's series, for a table.
type counterGroup struct {
	Title  string
	Metric string
	Rows   []counterRow
}

type counterRow struct {
	Labels string
	Value  float64
}

// statusFamilies are the counters the page shows, in order.
var statusFamilies = []struct{ title, name string }{
	{"Duplicate /sends suppressed, by reason", "encgate_send_duplicates_suppressed_total"},
	{"/sends forwarded", "encgate_send_forwarded_total"},
	{"Retries, by route and reason", "encgate_retries_total"},
	{"Retry budget exhausted, by route", "encgate_retry_budget_exhausted_total"},
	{"Dedupe store errors", "encgate_idempotency_store_errors_total"},
	{"/sends forwarded without dedupe (fail-open)", "encgate_idempotency_fail_open_total"},
	{"Config reloads", "encgate_config_reloads_total"},
}

// reloadable is the part of the config a reload applies at once.
type reloadable struct {
	Encoders              any `yaml:"encoders"`
	Upstream              any `yaml:"upstream"`
	Retry                 any `yaml:"retry"`
	Breaker               any `yaml:"breaker"`
	Health                any `yaml:"health"`
	MaxInflightPerEncoder int `yaml:"limits.max_inflight_per_encoder"`
	AdminToken            any `yaml:"admin.token"`
	LogLevel              any `yaml:"log.level"`
}

func (s *Server) serveStatus(w http.ResponseWriter, _ *http.Request) {
	now := s.clk.Now()
	c := s.conf()
	v := statusView{Now: now, Uptime: now.Sub(s.started).Round(time.Second).String(), Ready: s.ready.Load(),
		Encoders: s.upstreamStates(), Failures: s.recent.list(), Refresh: 5}
	if s.ln != nil {
		v.Listen = s.ln.Addr().String()
	}
	v.Counters = s.statusCounters()
	token := "not set"
	if c.Admin.Token != "" {
		token = "set (not shown)"
	}
	y, _ := yaml.Marshal(reloadable{Encoders: c.Encoders, Upstream: c.Upstream, Retry: c.Retry, Breaker: c.Breaker,
		Health: c.Health, MaxInflightPerEncoder: c.Limits.MaxInflightPerEncoder, AdminToken: token, LogLevel: c.Log.Level})
	v.Reloadable = string(y)
	var buf bytes.Buffer
	if err := statusPage.Execute(&buf, v); err != nil {
		http.Error(w, "status page: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	// Self-contained: nothing may load from elsewhere, and nothing of it
	// may be framed by another page.
	w.Header().Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'")
	_, _ = w.Write(buf.Bytes())
}

// statusCounters reads statusFamilies from the registry.
func (s *Server) statusCounters() []counterGroup {
	fams, _ := s.reg.Gather()
	byName := map[string]*dto.MetricFamily{}
	for _, f := range fams {
		byName[f.GetName()] = f
	}
	var out []counterGroup
	for _, sf := range statusFamilies {
		g := counterGroup{Title: sf.title, Metric: sf.name}
		if f := byName[sf.name]; f != nil {
			for _, m := range f.GetMetric() {
				var labels []string
				for _, l := range m.GetLabel() {
					labels = append(labels, l.GetName()+"="+l.GetValue())
				}
				val := m.GetCounter().GetValue()
				if m.GetGauge() != nil {
					val = m.GetGauge().GetValue()
				}
				g.Rows = append(g.Rows, counterRow{Labels: strings.Join(labels, ", "), Value: val})
			}
		}
		sort.Slice(g.Rows, func(i, j int) bool { return g.Rows[i].Labels < g.Rows[j].Labels })
		out = append(out, g)
	}
	return out
}
