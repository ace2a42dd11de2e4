// Package admin holds what the gateway's and the agent's status pages
// (GET / on their admin listeners) share: the counters read from a
// Prometheus registry for a table, the page's style, and how a page is
// written. Each page is one self-contained HTML document, rendered with
// html/template (every value escaped), that refreshes itself; the
// Content-Security-Policy it is served with forbids loading anything, so
// nothing a page shows can pull in a script or an image from elsewhere.
package admin

import (
	"bytes"
	"html/template"
	"net/http"
	"sort"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// Family is a metric the page shows as a table. Unit "bytes" writes its
// values in binary multiples (HumanBytes); otherwise they are whole numbers.
type Family struct{ Title, Name, Unit string }

// Group is one family's series.
type Group struct {
	Title  string
	Metric string
	Rows   []Row
}

// Row is one series: its labels as "k=v, k=v", its value, and the value
// as the page writes it.
type Row struct {
	Labels string
	Value  float64
	Text   string
}

// Gather reads fams from g, in the order given; a family with no series
// yet has no rows.
func Gather(g prometheus.Gatherer, fams []Family) []Group {
	mfs, _ := g.Gather()
	byName := map[string]*dto.MetricFamily{}
	for _, f := range mfs {
		byName[f.GetName()] = f
	}
	out := make([]Group, 0, len(fams))
	for _, sf := range fams {
		grp := Group{Title: sf.Title, Metric: sf.Name}
		if f := byName[sf.Name]; f != nil {
			for _, m := range f.GetMetric() {
				var labels []string
				for _, l := range m.GetLabel() {
					labels = append(labels, l.GetName()+"="+l.GetValue())
				}
				var v float64
				switch {
				case m.GetCounter() != nil:
					v = m.GetCounter().GetValue()
				case m.GetGauge() != nil:
					v = m.GetGauge().GetValue()
				case m.GetHistogram() != nil:
					v = float64(m.GetHistogram().GetSampleCount())
				}
				text := strconv.FormatFloat(v, 'f', 0, 64)
				if sf.Unit == "bytes" {
					text = HumanBytes(int64(v))
				}
				grp.Rows = append(grp.Rows, Row{Labels: strings.Join(labels, ", "), Value: v, Text: text})
			}
		}
		sort.Slice(grp.Rows, func(i, j int) bool { return grp.Rows[i].Labels < grp.Rows[j].Labels })
		out = append(out, grp)
	}
	return out
}

// Style is the pages' shared CSS.
const Style = `body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; margin: 0 0 .2em; }
h2 { font-size: 1.1em; margin: 1.4em 0 .4em; }
table { border-collapse: collapse; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.state { font-weight: 600; padding: 0 .4em; border-radius: 3px; }
.closed, .up, .active, .yes, .staged { background: #d9f2d9; }
.open, .down, .no, .failed { background: #f7d4d4; }
.half_open, .draining, .joining, .staging, .ack_only { background: #fbeec5; }
.muted { color: #777; }
pre { background: #f7f7f7; padding: .6em; overflow-x: auto; max-width: 100%; }
form.signout { float: right; }
details > summary { cursor: pointer; font-weight: 600; margin: 1.4em 0 .4em; }
td.spark { padding: .1em .3em; }`

// CountersTemplate renders []Group as one table per family; a page's
// template includes it with {{template "counters" .Counters}}.
const CountersTemplate = `{{define "counters"}}{{range .}}<h2>{{.Title}}</h2>
<table class="counter" data-metric="{{.Metric}}">
<tr><th>labels</th><th>value</th></tr>
{{range .Rows}}<tr><td>{{if .Labels}}{{.Labels}}{{else}}<span class="muted">(none)</span>{{end}}</td><td class="num">{{.Text}}</td></tr>{{else}}<tr><td colspan="2" class="muted">none yet</td></tr>{{end}}
</table>
{{end}}{{end}}`

// Parse parses a page's template with the counters template, the style
// (as the template function style), the units (UnitFuncs) and funcs.
func Parse(name, page string, funcs template.FuncMap) *template.Template {
	f := template.FuncMap{"style": func() template.CSS { return template.CSS(Style) }}
	for k, v := range UnitFuncs {
		f[k] = v
	}
	for k, v := range funcs {
		f[k] = v
	}
	return template.Must(template.Must(template.New(name).Funcs(f).Parse(CountersTemplate)).Parse(page))
}

// Write renders t with data and serves it: HTML, never cached, loading
// nothing from elsewhere, never framed.
func Write(w http.ResponseWriter, t *template.Template, data any) {
	writePage(w, http.StatusOK, t, data)
}

// CSP is the pages' Content-Security-Policy: nothing loaded from anywhere
// (inline styles and inline SVG are part of the page), forms posted only
// to the listener itself, never framed.
const CSP = "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"

func writePage(w http.ResponseWriter, status int, t *template.Template, data any) {
	var buf bytes.Buffer
	if err := t.Execute(&buf, data); err != nil {
		http.Error(w, "status page: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Content-Security-Policy", CSP)
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}
