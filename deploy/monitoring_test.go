package deploy

// Tests for the operator's monitoring kit: the Grafana dashboard
// (grafana/encgate.json) and the Prometheus alert rules
// (prometheus/alerts.yaml).
//
// The static tests read both files: the dashboard's shape (rows, panels,
// targets, the datasource variable) and the rows and alerts the issue asks
// for. TestMonitoringNamesExistInARunningGatewayAndAgent then starts real
// gateways, a gpuagent, fake encoders, a Mooncake receiver and a
// redis-server on loopback, drives the traffic that makes the watched
// series move (a retry, a tripped breaker, a suppressed duplicate /send, a
// transfer, a failed ack and a failed transfer, an exhausted retry budget,
// Redis dying under fail-open, a refused reload, failing DNS discovery, a
// pending self-registration), scrapes every /metrics, and checks each
// expression of the dashboard and the rules against what was scraped: every
// metric name, how it is used (rate() on counters only, histograms by their
// _bucket with le), every label a matcher, a grouping, a legend or an
// annotation names, and every label value an equality matcher names.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.uber.org/zap"
	"go.yaml.in/yaml/v3"

	"github.com/encgate/encgate/discovery"
	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/gateway"
	"github.com/encgate/encgate/gpuagent"
	"github.com/encgate/encgate/gpuagent/mooncake"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/redistest"
	"github.com/encgate/encgate/internal/testtool"
	"github.com/encgate/encgate/upstream"
)

const (
	dashboardFile = "grafana/encgate.json"
	alertsFile    = "prometheus/alerts.yaml"
	alertTests    = "prometheus/alerts_test.yaml"
)

// ---------------------------------------------------------------- the files

type dashboard struct {
	UID           string `json:"uid"`
	Title         string `json:"title"`
	Editable      *bool  `json:"editable"`
	SchemaVersion int    `json:"schemaVersion"`
	Templating    struct {
		List []dashVariable `json:"list"`
	} `json:"templating"`
	Panels []panel `json:"panels"`
}

type dashVariable struct {
	Type       string          `json:"type"`
	Name       string          `json:"name"`
	Label      string          `json:"label"`
	Query      json.RawMessage `json:"query"`
	Datasource *datasourceRef  `json:"datasource"`
	Multi      bool            `json:"multi"`
	IncludeAll bool            `json:"includeAll"`
	AllValue   string          `json:"allValue"`
	Refresh    int             `json:"refresh"`
}

type datasourceRef struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type panel struct {
	ID          int            `json:"id"`
	Type        string         `json:"type"`
	Title       string         `json:"title"`
	Description string         `json:"description"`
	Collapsed   bool           `json:"collapsed"`
	Datasource  *datasourceRef `json:"datasource"`
	GridPos     *struct {
		H, W, X, Y int
	} `json:"gridPos"`
	Targets     []panelTarget `json:"targets"`
	Panels      []panel       `json:"panels"` // a collapsed row's
	FieldConfig struct {
		Defaults struct {
			Unit string `json:"unit"`
		} `json:"defaults"`
	} `json:"fieldConfig"`
}

type panelTarget struct {
	RefID        string         `json:"refId"`
	Expr         string         `json:"expr"`
	LegendFormat string         `json:"legendFormat"`
	Datasource   *datasourceRef `json:"datasource"`
}

// datasourceVar is how every panel and query names the Prometheus data
// source: the dashboard's datasource variable, so it imports into any
// Grafana whatever its data source is called.
const datasourceVar = "${datasource}"

func loadDashboard(t *testing.T) dashboard {
	t.Helper()
	raw, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("%s does not parse: %v", dashboardFile, err)
	}
	return d
}

// rowPanels returns the dashboard's rows with the panels under each, in
// order: a row's panels are those after it up to the next row, or, for a
// collapsed row, its own.
func rowPanels(d dashboard) (titles []string, under map[string][]panel, loose []panel) {
	under = map[string][]panel{}
	cur := ""
	for _, p := range d.Panels {
		if p.Type == "row" {
			cur = p.Title
			titles = append(titles, cur)
			under[cur] = append(under[cur], p.Panels...)
			continue
		}
		if cur == "" {
			loose = append(loose, p)
			continue
		}
		under[cur] = append(under[cur], p)
	}
	return titles, under, loose
}

type alertRuleFile struct {
	Groups []struct {
		Name  string      `yaml:"name"`
		Rules []alertRule `yaml:"rules"`
	} `yaml:"groups"`
}

type alertRule struct {
	Alert       string            `yaml:"alert"`
	Record      string            `yaml:"record"`
	Expr        string            `yaml:"expr"`
	For         string            `yaml:"for"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

func loadAlerts(t *testing.T) []alertRule {
	t.Helper()
	f, err := os.Open(alertsFile)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dec := yaml.NewDecoder(f)
	dec.KnownFields(true) // a misspelt key (annotation:) is an error, not a rule without it
	var rf alertRuleFile
	if err := dec.Decode(&rf); err != nil {
		t.Fatalf("%s does not parse: %v", alertsFile, err)
	}
	var out []alertRule
	for _, g := range rf.Groups {
		out = append(out, g.Rules...)
	}
	if len(out) == 0 {
		t.Fatalf("%s has no rules", alertsFile)
	}
	return out
}

// monExpression is one PromQL expression of the kit and what names labels of
// its result: a target's legend format, or an alert's annotations.
type monExpression struct {
	where  string
	expr   string
	refs   []string // labels of the result it refers to
	alert  bool
	target bool
}

var (
	legendRef     = regexp.MustCompile(`\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}`)
	annotationRef = regexp.MustCompile(`\$labels\.([A-Za-z_][A-Za-z0-9_]*)`)
	encgateName   = regexp.MustCompile(`encgate_[a-z0-9_]+`)
)

func templateRefs(re *regexp.Regexp, s string) []string {
	var out []string
	for _, m := range re.FindAllStringSubmatch(s, -1) {
		out = append(out, m[1])
	}
	return out
}

func dashboardExpressions(d dashboard) []monExpression {
	var out []monExpression
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			for _, tg := range p.Targets {
				out = append(out, monExpression{
					where: fmt.Sprintf("panel %q target %s", p.Title, tg.RefID),
					expr:  tg.Expr,
					refs:  templateRefs(legendRef, tg.LegendFormat),
				})
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	return out
}

func alertExpressions(rules []alertRule) []monExpression {
	var out []monExpression
	for _, r := range rules {
		var rs []string
		for _, a := range r.Annotations {
			rs = append(rs, templateRefs(annotationRef, a)...)
		}
		out = append(out, monExpression{where: "alert " + r.Alert, expr: r.Expr, refs: rs, alert: true})
	}
	return out
}

// labelValuesQuery is the one form of query variable the dashboard uses:
// label_values(SELECTOR, LABEL).
var labelValuesQuery = regexp.MustCompile(`^label_values\(\s*(.+?)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)$`)

// metricNamePattern is a metric name, whole.
var metricNamePattern = regexp.MustCompile(`^[A-Za-z_:][A-Za-z0-9_:]*$`)

// labelValues reads a query variable's label_values(SELECTOR, LABEL):
// the metrics SELECTOR reads (a name, or a __name__ matcher: = one name,
// =~ names joined by |), its other matchers, and LABEL.
func labelValues(q string) (names []string, matchers []promMatcher, label string, err error) {
	m := labelValuesQuery.FindStringSubmatch(q)
	if m == nil {
		return nil, nil, "", fmt.Errorf("%q is not label_values(selector, label)", q)
	}
	toks, err := lexPromQL(m[1])
	if err != nil {
		return nil, nil, "", err
	}
	i := 0
	if i < len(toks) && toks[i].kind == 'i' {
		names = append(names, toks[i].text)
		i++
	}
	if i < len(toks) && toks[i].kind == 'p' && toks[i].text == "{" {
		for i++; i < len(toks) && !(toks[i].kind == 'p' && toks[i].text == "}"); i++ {
			if toks[i].kind == 'p' && toks[i].text == "," {
				continue
			}
			if i+2 >= len(toks) || toks[i].kind != 'i' || toks[i+1].kind != 'p' || toks[i+2].kind != 's' {
				return nil, nil, "", fmt.Errorf("cannot read the matchers of %q", m[1])
			}
			mt := promMatcher{toks[i].text, toks[i+1].text, toks[i+2].text}
			i += 2
			if mt.label != "__name__" {
				matchers = append(matchers, mt)
				continue
			}
			switch mt.op {
			case "=":
				names = append(names, mt.value)
			case "=~":
				names = append(names, strings.Split(mt.value, "|")...)
			default:
				return nil, nil, "", fmt.Errorf("%q: __name__%s names no metric", m[1], mt.op)
			}
		}
		if i >= len(toks) {
			return nil, nil, "", fmt.Errorf("unterminated matchers in %q", m[1])
		}
		i++
	}
	if i != len(toks) || len(names) == 0 {
		return nil, nil, "", fmt.Errorf("%q is not one metric selector", m[1])
	}
	for _, n := range names {
		if !metricNamePattern.MatchString(n) {
			return nil, nil, "", fmt.Errorf("%q: %q is not a metric name", m[1], n)
		}
	}
	return names, matchers, m[2], nil
}

// variableQuery returns a query variable's query, written either as a
// string or as {"query": "..."}.
func variableQuery(v dashVariable) string {
	var s string
	if json.Unmarshal(v.Query, &s) == nil {
		return s
	}
	var o struct {
		Query string `json:"query"`
	}
	_ = json.Unmarshal(v.Query, &o)
	return o.Query
}

// ---------------------------------------------------------------- static checks

// The rows the issue lists, each with what it must show: a metric one of
// its targets uses, and the label that target's legend must name ("" for
// none), so "per route" and "by reason" are really per route and by reason.
var wantRows = []struct {
	title string
	want  [][2]string
}{
	{"Gateway: requests and latency", [][2]string{
		{"encgate_requests_total", "route"}, {"encgate_request_duration_seconds", "route"}}},
	{"Gateway: encoders (upstream codes, breakers, health)", [][2]string{
		{"encgate_upstream_requests_total", "code"}, {"encgate_breaker_state", "encoder"}, {"encgate_upstream_healthy", "encoder"}}},
	{"Gateway: retries and budget", [][2]string{
		{"encgate_retries_total", "reason"}, {"encgate_retry_budget_exhausted_total", "route"}}},
	{"Gateway: pins and /send duplicate suppression", [][2]string{
		{"encgate_pins", ""}, {"encgate_send_duplicates_suppressed_total", "reason"}}},
	{"Gateway: dedupe store (Redis) and reloads", [][2]string{
		{"encgate_idempotency_store_errors_total", "op"}, {"encgate_idempotency_fail_open_total", ""},
		{"encgate_config_reloads_total", "result"}}},
	{"Fleet", [][2]string{
		{"encgate_fleet_encoders", "state"}, {"encgate_discovery_errors_total", "source"}, {"encgate_self_registrations", "state"}}},
	{"Agents: staging", [][2]string{{"encgate_agent_staged_bytes", ""}}},
	{"Agents: transfers and acks", [][2]string{
		{"encgate_agent_transfer_bytes_total", ""}, {"encgate_agent_transfer_seconds", ""}, {"encgate_agent_acks_total", "result"}}},
}

// histogramBase strips a histogram series' suffix, for comparing with the
// family names above.
func histogramBase(name string) string {
	for _, s := range []string{"_bucket", "_sum", "_count"} {
		if b, ok := strings.CutSuffix(name, s); ok {
			return b
		}
	}
	return name
}

// dashboardScopeVars are the variables every selector of every panel
// target matches on (Grafana's dashboard-linter: template-job-rule,
// template-instance-rule, target-job-rule, target-instance-rule), each with
// the label the linter wants on it.
var dashboardScopeVars = []struct{ name, label string }{{"job", "Job"}, {"instance", "Instance"}}

// grafanaUnits are unit ids Grafana knows (its valueFormats categories),
// those a panel of this dashboard may reasonably show; dashboard-linter's
// panel-units-rule refuses a panel without a known one.
var grafanaUnits = promSet(
	"none", "short", "percent", "percentunit",
	"ns", "µs", "ms", "s", "m", "h", "d", "dtdurations", "dtdurationms",
	"bytes", "decbytes", "bits", "decbits",
	"Bps", "binBps", "bps", "binbps",
	"reqps", "rps", "ops", "cps", "wps", "iops", "opm", "rpm", "cpm", "wpm", "hertz")

// TestDashboardIsWellFormed checks the dashboard's shape and the
// conventions of Grafana's dashboard-linter (which is not a Go module this
// repository may fetch): a datasource variable (template-datasource-rule);
// job and instance query variables, multi-valued with All as ".+", reloaded
// on a time range change (template-job-rule, template-instance-rule,
// template-on-time-change-reload-rule); every selector of every target
// matching job=~"$job" and instance=~"$instance" (target-job-rule,
// target-instance-rule); a unit on every panel (panel-units-rule); every
// panel on the datasource variable (panel-datasource-rule), titled, with a
// description (panel-title-description-rule) and a target
// (panel-no-targets-rule); and editable false (uneditable-dashboard-rule).
func TestDashboardIsWellFormed(t *testing.T) {
	d := loadDashboard(t)
	if d.UID == "" || d.Title == "" {
		t.Errorf("the dashboard needs a uid and a title (uid %q, title %q)", d.UID, d.Title)
	}
	if d.Editable == nil || *d.Editable {
		t.Error("the dashboard is editable: provisioned dashboards are changed in the file, so set editable: false")
	}
	if d.SchemaVersion < 36 {
		t.Errorf("schemaVersion %d: want the JSON model of Grafana 10 or later (>= 36)", d.SchemaVersion)
	}
	var haveDS bool
	for _, v := range d.Templating.List {
		switch v.Type {
		case "datasource":
			var q string
			_ = json.Unmarshal(v.Query, &q)
			if v.Name == "datasource" && q == "prometheus" {
				haveDS = true
			}
		case "query":
			if v.Datasource == nil || v.Datasource.UID != datasourceVar {
				t.Errorf("variable %q must query %s", v.Name, datasourceVar)
			}
			if _, _, _, err := labelValues(variableQuery(v)); err != nil {
				t.Errorf("variable %q: %v", v.Name, err)
			}
		}
	}
	if !haveDS {
		t.Errorf("no datasource variable named datasource of type prometheus")
	}
	for _, want := range dashboardScopeVars {
		i := slices.IndexFunc(d.Templating.List, func(v dashVariable) bool { return v.Name == want.name })
		if i < 0 {
			t.Errorf("no %s variable", want.name)
			continue
		}
		v := d.Templating.List[i]
		if v.Type != "query" || v.Label != want.label || !v.Multi || !v.IncludeAll || v.AllValue != ".+" || v.Refresh != 2 {
			t.Errorf("variable %s: type %q, label %q, multi %v, includeAll %v, allValue %q, refresh %d; want query, %q, true, true, \".+\", 2 (on time range change)",
				v.Name, v.Type, v.Label, v.Multi, v.IncludeAll, v.AllValue, v.Refresh, want.label)
		}
		if _, _, label, err := labelValues(variableQuery(v)); err == nil && label != want.name {
			t.Errorf("variable %s lists the values of %s, want %s", v.Name, label, want.name)
		}
	}

	titles, under, loose := rowPanels(d)
	for _, p := range loose {
		t.Errorf("panel %q comes before the first row", p.Title)
	}
	ids := map[int]string{}
	var check func(p panel)
	check = func(p panel) {
		if prev, dup := ids[p.ID]; dup || p.ID == 0 {
			t.Errorf("panel %q: id %d is zero or also %q's", p.Title, p.ID, prev)
		}
		ids[p.ID] = p.Title
		if p.GridPos == nil || p.GridPos.W <= 0 || p.GridPos.H <= 0 || p.GridPos.X+p.GridPos.W > 24 {
			t.Errorf("panel %q: gridPos %+v is not inside the 24-column grid", p.Title, p.GridPos)
		}
		if p.Type == "row" {
			for _, c := range p.Panels {
				check(c)
			}
			return
		}
		if strings.TrimSpace(p.Title) == "" {
			t.Errorf("panel %d has no title", p.ID)
		}
		if strings.TrimSpace(p.Description) == "" {
			t.Errorf("panel %q has no description", p.Title)
		}
		if p.Type != "timeseries" && p.Type != "stat" {
			t.Errorf("panel %q: type %q, want timeseries or stat", p.Title, p.Type)
		}
		if p.Datasource == nil || p.Datasource.Type != "prometheus" || p.Datasource.UID != datasourceVar {
			t.Errorf("panel %q: datasource %+v, want prometheus %s", p.Title, p.Datasource, datasourceVar)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no target", p.Title)
		}
		if u := p.FieldConfig.Defaults.Unit; !grafanaUnits[u] {
			t.Errorf("panel %q: unit %q (fieldConfig.defaults.unit) is not one of %v", p.Title, u, monSorted(grafanaUnits))
		}
		refIDs := map[string]bool{}
		for _, tg := range p.Targets {
			if strings.TrimSpace(tg.Expr) == "" {
				t.Errorf("panel %q target %s has no expression", p.Title, tg.RefID)
			}
			if tg.RefID == "" || refIDs[tg.RefID] {
				t.Errorf("panel %q: refId %q is empty or repeated", p.Title, tg.RefID)
			}
			refIDs[tg.RefID] = true
			if tg.Datasource != nil && tg.Datasource.UID != datasourceVar {
				t.Errorf("panel %q target %s: datasource %+v, want %s", p.Title, tg.RefID, tg.Datasource, datasourceVar)
			}
			a, err := analyzePromQL(tg.Expr)
			if err != nil {
				t.Errorf("panel %q target %s: %v", p.Title, tg.RefID, err)
				continue
			}
			for _, sel := range a.selectors {
				for _, want := range dashboardScopeVars {
					if !slices.Contains(sel.matchers, promMatcher{want.name, "=~", "$" + want.name}) {
						t.Errorf("panel %q target %s: selector %s has no %s=~\"$%s\"", p.Title, tg.RefID, sel.name, want.name, want.name)
					}
				}
			}
		}
	}
	for _, p := range d.Panels {
		check(p)
	}

	for _, row := range wantRows {
		ps, ok := under[row.title]
		if !ok {
			t.Errorf("no row titled %q (rows: %q)", row.title, titles)
			continue
		}
		if len(ps) == 0 {
			t.Errorf("row %q has no panels", row.title)
		}
		for _, w := range row.want {
			if !rowShows(ps, w[0], w[1]) {
				t.Errorf("row %q: no target uses %s with {{%s}} in its legend", row.title, w[0], w[1])
			}
		}
	}
}

// rowShows reports whether one of ps's targets uses metric (a histogram by
// any of its series) with label in its legend.
func rowShows(ps []panel, metric, label string) bool {
	for _, p := range ps {
		for _, tg := range p.Targets {
			uses := false
			for _, n := range encgateName.FindAllString(tg.Expr, -1) {
				if n == metric || histogramBase(n) == metric {
					uses = true
				}
			}
			if uses && (label == "" || slices.Contains(templateRefs(legendRef, tg.LegendFormat), label)) {
				return true
			}
		}
	}
	return false
}

// The alerts the issue asks for, each found by what its expression watches.
var wantAlerts = []struct {
	what        string
	metrics     []string
	promMatcher *promMatcher // one of its selectors must have it
	for_        string       // "" for any
	severity    string       // "" for any
}{
	{what: "an encoder ejected by its breaker for 5 minutes", metrics: []string{"encgate_breaker_ejected"}, for_: "5m"},
	{what: "a failing encoder kept in service by max_ejected_percent", metrics: []string{"encgate_breaker_ejections_skipped_total"}, severity: "critical"},
	{what: "all encoders unusable", metrics: []string{"encgate_upstream_healthy", "encgate_breaker_ejected", "encgate_fleet_encoders"}, severity: "critical"},
	{what: "retry budget exhausted", metrics: []string{"encgate_retry_budget_exhausted_total"}},
	{what: "long polls refused at limits.poll_share", metrics: []string{"encgate_upstream_refused_total"}, promMatcher: &promMatcher{"reason", "=", "poll_share"}},
	{what: "live pins evicted at affinity.max_pins", metrics: []string{"encgate_pin_evictions_total"}, promMatcher: &promMatcher{"state", "=~", "pending|encoded"}},
	{what: "dedupe store errors", metrics: []string{"encgate_idempotency_store_errors_total"}},
	{what: "fail-open forwards", metrics: []string{"encgate_idempotency_fail_open_total"}},
	{what: "agent ack failures", metrics: []string{"encgate_agent_acks_total"}, promMatcher: &promMatcher{"result", "=", "failed"}},
	{what: "agent transfer failures", metrics: []string{"encgate_agent_transfers_total"}, promMatcher: &promMatcher{"result", "!=", "ok"}},
	{what: "config reload refused", metrics: []string{"encgate_config_reloads_total"}, promMatcher: &promMatcher{"result", "=", "refused"}},
}

var alertSeverities = []string{"critical", "warning", "info"}

func TestAlertRulesAreWellFormed(t *testing.T) {
	rules := loadAlerts(t)
	names := map[string]bool{}
	for _, r := range rules {
		if r.Alert == "" {
			t.Errorf("a rule with expr %q is not an alert (record: %q): the file holds alerts only", r.Expr, r.Record)
			continue
		}
		if names[r.Alert] {
			t.Errorf("alert %s is defined twice", r.Alert)
		}
		names[r.Alert] = true
		if strings.TrimSpace(r.Expr) == "" {
			t.Errorf("alert %s has no expr", r.Alert)
		}
		if _, err := model.ParseDuration(r.For); err != nil {
			t.Errorf("alert %s: for %q: %v (write for: explicitly, 0m included)", r.Alert, r.For, err)
		}
		if !slices.Contains(alertSeverities, r.Labels["severity"]) {
			t.Errorf("alert %s: severity %q, want one of %q", r.Alert, r.Labels["severity"], alertSeverities)
		}
		for _, k := range []string{"summary", "description"} {
			if strings.TrimSpace(r.Annotations[k]) == "" {
				t.Errorf("alert %s has no %s", r.Alert, k)
			}
		}
		if _, err := analyzePromQL(r.Expr); err != nil {
			t.Errorf("alert %s: %v", r.Alert, err)
		}
	}
	for _, w := range wantAlerts {
		if found := findAlert(rules, w.metrics, w.promMatcher, w.for_, w.severity); found == "" {
			t.Errorf("no alert for %s: none watches %q with matcher %v, for %q, severity %q",
				w.what, w.metrics, w.promMatcher, w.for_, w.severity)
		}
	}
}

func findAlert(rules []alertRule, metrics []string, m *promMatcher, forWant, severity string) string {
	for _, r := range rules {
		a, err := analyzePromQL(r.Expr)
		if err != nil {
			continue
		}
		used := map[string]bool{}
		hasMatcher := m == nil
		for _, s := range a.selectors {
			used[s.name] = true
			if m != nil && slices.Contains(s.matchers, *m) && slices.Contains(metrics, s.name) {
				hasMatcher = true
			}
		}
		ok := hasMatcher && (forWant == "" || r.For == forWant) && (severity == "" || r.Labels["severity"] == severity)
		for _, name := range metrics {
			ok = ok && used[name]
		}
		if ok {
			return r.Alert
		}
	}
	return ""
}

// TestAlertRuleUnitTests runs the rules' unit tests (alerts_test.yaml,
// Prometheus's own rule test format) through promtool, and checks that
// they cover every alert: each has an evaluation where it fires and one
// where it does not. It skips without promtool (.ci/run installs Debian's
// prometheus package for it, and runs the same tests itself).
func TestAlertRuleUnitTests(t *testing.T) {
	var file struct {
		RuleFiles []string `yaml:"rule_files"`
		Tests     []struct {
			Name  string `yaml:"name"`
			Evals []struct {
				EvalTime  string `yaml:"eval_time"`
				Alertname string `yaml:"alertname"`
				ExpAlerts []any  `yaml:"exp_alerts"`
			} `yaml:"alert_rule_test"`
		} `yaml:"tests"`
	}
	raw, err := os.ReadFile(alertTests)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, &file); err != nil {
		t.Fatalf("%s does not parse: %v", alertTests, err)
	}
	if !slices.Equal(file.RuleFiles, []string{filepath.Base(alertsFile)}) {
		t.Errorf("%s loads %q, want [%s]", alertTests, file.RuleFiles, filepath.Base(alertsFile))
	}
	fires, quiet := map[string]bool{}, map[string]bool{}
	for _, tc := range file.Tests {
		for _, e := range tc.Evals {
			if len(e.ExpAlerts) > 0 {
				fires[e.Alertname] = true
			} else {
				quiet[e.Alertname] = true
			}
		}
	}
	for _, r := range loadAlerts(t) {
		if !fires[r.Alert] {
			t.Errorf("%s has no case where %s fires", alertTests, r.Alert)
		}
		if !quiet[r.Alert] {
			t.Errorf("%s has no case where %s does not fire", alertTests, r.Alert)
		}
	}

	promtool := testtool.Need(t, "promtool", "prometheus")
	out, err := exec.Command(promtool, "test", "rules", alertTests).CombinedOutput()
	if err != nil {
		t.Errorf("promtool test rules %s: %v\n%s", alertTests, err, out)
	}
}

// TestDashboardAndAlertsPassPromtool runs Prometheus's own checker over the
// rules, and over every dashboard expression (as recording rules, with
// Grafana's variables given values), so each is PromQL that Prometheus
// parses. It skips without promtool (.ci/run installs Debian's prometheus
// package for it).
func TestDashboardAndAlertsPassPromtool(t *testing.T) {
	promtool := testtool.Need(t, "promtool", "prometheus")
	run := func(path string) {
		t.Helper()
		out, err := exec.Command(promtool, "check", "rules", path).CombinedOutput()
		if err != nil {
			t.Errorf("promtool check rules %s: %v\n%s", path, err, out)
		}
	}
	run(alertsFile)

	vars := strings.NewReplacer("$__rate_interval", "5m", "$job", ".+", "$instance", ".+")
	type rec struct {
		Record string `yaml:"record"`
		Expr   string `yaml:"expr"`
	}
	var recs []rec
	d := loadDashboard(t)
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			for _, tg := range p.Targets {
				e := vars.Replace(tg.Expr)
				if strings.Contains(e, "$") {
					t.Errorf("panel %q target %s uses a variable the dashboard does not define: %s", p.Title, tg.RefID, tg.Expr)
				}
				recs = append(recs, rec{Record: fmt.Sprintf("dashboard:panel_%d:%s", p.ID, strings.ToLower(tg.RefID)), Expr: e})
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	doc := map[string]any{"groups": []any{map[string]any{"name": "dashboard", "rules": recs}}}
	raw, err := yaml.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "dashboard-rules.yaml")
	if err := os.WriteFile(path, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	run(path)
}

// ---------------------------------------------------------------- PromQL, as far as the checks need it

// promAggregators and promFunctions are PromQL's; any other name followed by "("
// is refused, so a typo (rates(...)) is not taken for a metric.
var promAggregators = promSet("sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
	"bottomk", "topk", "quantile", "limitk", "limit_ratio")

var promFunctions = promSet("abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh",
	"avg_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh", "count_over_time",
	"day_of_month", "day_of_week", "day_of_year", "days_in_month", "deg", "delta", "deriv",
	"double_exponential_smoothing", "exp", "floor", "histogram_avg", "histogram_count", "histogram_fraction",
	"histogram_quantile", "histogram_stddev", "histogram_stdvar", "histogram_sum", "holt_winters", "hour",
	"idelta", "increase", "info", "irate", "label_join", "label_replace", "last_over_time", "ln", "log10",
	"log2", "mad_over_time", "max_over_time", "min_over_time", "minute", "month", "pi", "predict_linear",
	"present_over_time", "quantile_over_time", "rad", "rate", "resets", "round", "scalar", "sgn", "sin",
	"sinh", "sort", "sort_by_label", "sort_by_label_desc", "sort_desc", "sqrt", "stddev_over_time",
	"stdvar_over_time", "sum_over_time", "tan", "tanh", "time", "timestamp", "vector", "year")

// promKeywords stand between operands; none of them is a metric.
var promKeywords = promSet("and", "or", "unless", "bool", "offset", "inf", "nan", "atan2")

// promRateFuncs take a counter's range; applied to a gauge they mean nothing.
var promRateFuncs = promSet("rate", "irate", "increase")

// promTargetLabels are the labels Prometheus adds to every scraped series.
var promTargetLabels = promSet("job", "instance")

func promSet(xs ...string) map[string]bool {
	m := make(map[string]bool, len(xs))
	for _, x := range xs {
		m[x] = true
	}
	return m
}

type promToken struct {
	kind byte // 'i' identifier, 'n' number, 's' string, 'r' [range], 'v' $variable, 'p' punctuation
	text string
}

func lexPromQL(expr string) ([]promToken, error) {
	var out []promToken
	isIdent := func(c byte, first bool) bool {
		return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || !first && c >= '0' && c <= '9'
	}
	for i := 0; i < len(expr); {
		c := expr[i]
		switch {
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			i++
		case c == '#':
			for i < len(expr) && expr[i] != '\n' {
				i++
			}
		case isIdent(c, true):
			j := i + 1
			for j < len(expr) && isIdent(expr[j], false) {
				j++
			}
			out = append(out, promToken{'i', expr[i:j]})
			i = j
		case c >= '0' && c <= '9' || c == '.' && i+1 < len(expr) && expr[i+1] >= '0' && expr[i+1] <= '9':
			j := i + 1
			for j < len(expr) && (expr[j] >= '0' && expr[j] <= '9' || expr[j] == '.' ||
				(expr[j] == 'e' || expr[j] == 'E') && j+1 < len(expr) && (expr[j+1] >= '0' && expr[j+1] <= '9' || expr[j+1] == '-' || expr[j+1] == '+')) {
				if expr[j] == 'e' || expr[j] == 'E' {
					j++
				}
				j++
			}
			for j < len(expr) && (expr[j] >= 'a' && expr[j] <= 'z') { // a duration: 5m, 1h30m
				j++
			}
			out = append(out, promToken{'n', expr[i:j]})
			i = j
		case c == '"' || c == '\'' || c == '`':
			j := i + 1
			for j < len(expr) && expr[j] != c {
				if expr[j] == '\\' && c != '`' {
					j++
				}
				j++
			}
			if j >= len(expr) {
				return nil, fmt.Errorf("unterminated string at %d", i)
			}
			s := expr[i+1 : j]
			if c == '"' {
				if u, err := strconv.Unquote(expr[i : j+1]); err == nil {
					s = u
				}
			}
			out = append(out, promToken{'s', s})
			i = j + 1
		case c == '[':
			j := strings.IndexByte(expr[i:], ']')
			if j < 0 {
				return nil, fmt.Errorf("unterminated [ at %d", i)
			}
			out = append(out, promToken{'r', expr[i : i+j+1]})
			i += j + 1
		case c == '$':
			j := i + 1
			if j < len(expr) && expr[j] == '{' {
				k := strings.IndexByte(expr[j:], '}')
				if k < 0 {
					return nil, fmt.Errorf("unterminated ${ at %d", i)
				}
				j += k + 1
			} else {
				for j < len(expr) && isIdent(expr[j], false) {
					j++
				}
			}
			out = append(out, promToken{'v', expr[i:j]})
			i = j
		default:
			two := ""
			if i+1 < len(expr) {
				two = expr[i : i+2]
			}
			switch two {
			case "==", "!=", "<=", ">=", "=~", "!~":
				out = append(out, promToken{'p', two})
				i += 2
				continue
			}
			if !strings.ContainsRune("(){},=<>+-*/%^", rune(c)) {
				return nil, fmt.Errorf("unexpected %q at %d", c, i)
			}
			out = append(out, promToken{'p', string(c)})
			i++
		}
	}
	return out, nil
}

type promMatcher struct{ label, op, value string }

type promSelector struct {
	name     string
	matchers []promMatcher
	calls    []string // functions it is an argument of, outermost first
	aggs     []int    // aggregations it is inside, indices into analysis.aggs
}

type promAggregation struct {
	op     string
	by     []string
	hasBy  bool
	nested bool // inside another aggregation
}

type promAnalysis struct {
	selectors []promSelector
	aggs      []promAggregation
	matching  []string // labels of on(...), ignoring(...), group_left(...), group_right(...)
}

// analyzePromQL reads expr's metric selectors, aggregations and vector matching.
// It is not a PromQL parser: promtool is (TestDashboardAndAlertsPassPromtool);
// it refuses what the kit has no business using (without, unknown
// functions, selectors without a metric name).
func analyzePromQL(expr string) (*promAnalysis, error) {
	toks, err := lexPromQL(expr)
	if err != nil {
		return nil, err
	}
	a := &promAnalysis{}
	type frame struct {
		kind byte // 'c' call, 'a' aggregation, 'p' parenthesis
		name string
		agg  int
	}
	var stack []frame
	is := func(i int, kind byte, text string) bool {
		return i < len(toks) && toks[i].kind == kind && toks[i].text == text
	}
	labelList := func(i int) ([]string, int, error) { // toks[i] is "("
		if !is(i, 'p', "(") {
			return nil, i, errors.New("a label list must follow by, on, ignoring or group_*")
		}
		var ls []string
		for i++; i < len(toks); i++ {
			switch {
			case is(i, 'p', ")"):
				return ls, i + 1, nil
			case is(i, 'p', ","):
			case toks[i].kind == 'i':
				ls = append(ls, toks[i].text)
			default:
				return nil, i, fmt.Errorf("unexpected %q in a label list", toks[i].text)
			}
		}
		return nil, i, errors.New("unterminated label list")
	}
	for i := 0; i < len(toks); i++ {
		tk := toks[i]
		switch {
		case tk.kind == 'i' && promAggregators[tk.text]:
			ag := promAggregation{op: tk.text}
			for _, f := range stack {
				ag.nested = ag.nested || f.kind == 'a'
			}
			j := i + 1
			if is(j, 'i', "without") {
				return nil, errors.New(tk.text + " without (...): group with by (...)")
			}
			if is(j, 'i', "by") {
				ls, k, err := labelList(j + 1)
				if err != nil {
					return nil, err
				}
				ag.by, ag.hasBy, j = ls, true, k
			}
			if !is(j, 'p', "(") {
				return nil, fmt.Errorf("%s must be followed by its argument in parentheses", tk.text)
			}
			a.aggs = append(a.aggs, ag)
			stack = append(stack, frame{kind: 'a', name: tk.text, agg: len(a.aggs) - 1})
			i = j
		case tk.kind == 'i' && (tk.text == "on" || tk.text == "ignoring" || tk.text == "group_left" || tk.text == "group_right"):
			if tk.text[0] == 'g' && !is(i+1, 'p', "(") {
				continue
			}
			ls, j, err := labelList(i + 1)
			if err != nil {
				return nil, err
			}
			a.matching = append(a.matching, ls...)
			i = j - 1
		case tk.kind == 'i' && is(i+1, 'p', "("):
			if !promFunctions[tk.text] {
				return nil, fmt.Errorf("%s(...) is not a PromQL function", tk.text)
			}
			stack = append(stack, frame{kind: 'c', name: tk.text})
			i++
		case tk.kind == 'i' && (tk.text == "by" || tk.text == "without"):
			return nil, fmt.Errorf("%s where no aggregation ends", tk.text)
		case tk.kind == 'i' && promKeywords[tk.text]:
		case tk.kind == 'i':
			s := promSelector{name: tk.text}
			for _, f := range stack {
				switch f.kind {
				case 'c':
					s.calls = append(s.calls, f.name)
				case 'a':
					s.aggs = append(s.aggs, f.agg)
				}
			}
			if is(i+1, 'p', "{") {
				j := i + 2
				for ; j < len(toks) && !is(j, 'p', "}"); j++ {
					if is(j, 'p', ",") {
						continue
					}
					if j+2 >= len(toks) || toks[j].kind != 'i' || toks[j+1].kind != 'p' || toks[j+2].kind != 's' {
						return nil, fmt.Errorf("cannot read the matchers of %s", tk.text)
					}
					s.matchers = append(s.matchers, promMatcher{toks[j].text, toks[j+1].text, toks[j+2].text})
					j += 2
				}
				if j >= len(toks) {
					return nil, fmt.Errorf("unterminated matchers of %s", tk.text)
				}
				i = j
			}
			a.selectors = append(a.selectors, s)
		case tk.kind == 'p' && tk.text == "{":
			return nil, errors.New("a selector without a metric name: name the metric before {")
		case tk.kind == 'p' && tk.text == "(":
			stack = append(stack, frame{kind: 'p'})
		case tk.kind == 'p' && tk.text == ")":
			if len(stack) == 0 {
				return nil, errors.New("unbalanced )")
			}
			f := stack[len(stack)-1]
			stack = stack[:len(stack)-1]
			if f.kind == 'a' && is(i+1, 'i', "by") {
				if a.aggs[f.agg].hasBy {
					return nil, fmt.Errorf("%s has two by clauses", f.name)
				}
				ls, j, err := labelList(i + 2)
				if err != nil {
					return nil, err
				}
				a.aggs[f.agg].by, a.aggs[f.agg].hasBy = ls, true
				i = j - 1
			}
			if f.kind == 'a' && is(i+1, 'i', "without") {
				return nil, errors.New(f.name + "(...) without (...): group with by (...)")
			}
		}
	}
	if len(stack) > 0 {
		return nil, errors.New("unbalanced (")
	}
	if len(a.selectors) == 0 {
		return nil, errors.New("no metric in the expression")
	}
	return a, nil
}

// ---------------------------------------------------------------- checking against /metrics

// monFamilies is what the scrapes held: every family of the gateways' and the
// agent's /metrics, by name.
type monFamilies map[string]*dto.MetricFamily

// resolve finds the family a selector's name reads: the family itself, or
// for name_bucket, name_sum and name_count the histogram name (part is then
// bucket, sum or count).
func (ex monFamilies) resolve(name string) (fam *dto.MetricFamily, part string) {
	if f, ok := ex[name]; ok {
		return f, ""
	}
	for _, p := range []string{"bucket", "sum", "count"} {
		if b, ok := strings.CutSuffix(name, "_"+p); ok {
			if f, ok := ex[b]; ok && f.GetType() == dto.MetricType_HISTOGRAM {
				return f, p
			}
		}
	}
	return nil, ""
}

func monFamilyLabels(f *dto.MetricFamily, part string) map[string]bool {
	ls := map[string]bool{}
	for _, m := range f.GetMetric() {
		for _, l := range m.GetLabel() {
			ls[l.GetName()] = true
		}
	}
	if part == "bucket" {
		ls["le"] = true
	}
	return ls
}

func monFamilyValues(f *dto.MetricFamily, label string) map[string]bool {
	vs := map[string]bool{}
	for _, m := range f.GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == label {
				vs[l.GetValue()] = true
			}
		}
	}
	return vs
}

// problems lists what is wrong with e against the scraped families.
func (ex monFamilies) problems(e monExpression) []string {
	var out []string
	bad := func(format string, args ...any) { out = append(out, e.where+": "+fmt.Sprintf(format, args...)) }

	for _, n := range encgateName.FindAllString(e.expr, -1) {
		if f, _ := ex.resolve(n); f == nil {
			bad("%s is not in the /metrics of a running gateway or agent", n)
		}
	}
	a, err := analyzePromQL(e.expr)
	if err != nil {
		bad("%v", err)
		return out
	}
	all := map[string]bool{} // every label of every selector's family
	aggLabels := make([]map[string]bool, len(a.aggs))
	aggBuckets := make([]bool, len(a.aggs))
	for i := range aggLabels {
		aggLabels[i] = map[string]bool{}
	}
	for _, s := range a.selectors {
		if !strings.HasPrefix(s.name, "encgate_") {
			bad("%s is not one of encgate's metrics (every name starts with encgate_)", s.name)
			continue
		}
		f, part := ex.resolve(s.name)
		if f == nil {
			continue // reported above
		}
		if f.GetType() == dto.MetricType_HISTOGRAM && part == "" {
			bad("%s is a histogram: its series are %[1]s_bucket, %[1]s_sum and %[1]s_count", s.name)
			continue
		}
		counter := f.GetType() == dto.MetricType_COUNTER || part != ""
		inRate := false
		for _, c := range s.calls {
			inRate = inRate || promRateFuncs[c]
		}
		switch {
		case counter && !inRate:
			bad("%s is a counter: read it through rate() or increase()", s.name)
		case !counter && inRate:
			bad("%s is a %s: rate() and increase() are for counters", s.name, strings.ToLower(f.GetType().String()))
		}
		if part == "bucket" {
			if !slices.Contains(s.calls, "histogram_quantile") {
				bad("%s is read outside histogram_quantile()", s.name)
			}
			for _, ai := range s.aggs {
				aggBuckets[ai] = true
				if !slices.Contains(a.aggs[ai].by, "le") {
					bad("%s(...) over %s must keep le (by (..., le))", a.aggs[ai].op, s.name)
				}
			}
		}
		ls := monFamilyLabels(f, part)
		for l := range ls {
			all[l] = true
			for _, ai := range s.aggs {
				aggLabels[ai][l] = true
			}
		}
		for _, m := range s.matchers {
			if !ls[m.label] && !promTargetLabels[m.label] {
				bad("%s has no label %s (it has %v)", s.name, m.label, monSorted(ls))
				continue
			}
			if strings.Contains(m.value, "$") || promTargetLabels[m.label] {
				continue // a dashboard variable, or a label of the scrape
			}
			switch m.op {
			case "=", "!=":
				if vs := monFamilyValues(f, m.label); !vs[m.value] {
					bad("%s{%s%s%q}: no series has %s=%q (values: %v)", s.name, m.label, m.op, m.value, m.label, m.value, monSorted(vs))
				}
			case "=~", "!~":
				if _, err := regexp.Compile("^(?:" + m.value + ")$"); err != nil {
					bad("%s{%s%s%q}: %v", s.name, m.label, m.op, m.value, err)
				}
			}
		}
	}
	for i, ag := range a.aggs {
		for _, l := range ag.by {
			if l == "le" && !aggBuckets[i] {
				bad("%s by (..., le) over no histogram bucket", ag.op)
			} else if l != "le" && !aggLabels[i][l] && !promTargetLabels[l] {
				bad("%s by (%s): no metric inside has the label %s", ag.op, strings.Join(ag.by, ", "), l)
			}
		}
	}
	for _, l := range a.matching {
		if !all[l] && !promTargetLabels[l] {
			bad("on/ignoring/group (%s): no metric here has that label", l)
		}
	}
	// The labels of the result: the outermost aggregations' by (le
	// consumed by histogram_quantile), or, with none, the metrics' own.
	result := map[string]bool{}
	outer := false
	for _, ag := range a.aggs {
		if !ag.nested {
			outer = true
			for _, l := range ag.by {
				if l != "le" {
					result[l] = true
				}
			}
		}
	}
	if !outer {
		for l := range all {
			result[l] = true
		}
		for l := range promTargetLabels {
			result[l] = true
		}
	}
	for _, r := range e.refs {
		if !result[r] {
			what := "legend"
			if e.alert {
				what = "annotations"
			}
			bad("the %s name {{%s}}, which the result does not have (it has %v)", what, r, monSorted(result))
		}
	}
	if e.alert && (!result["job"] || !result["instance"]) {
		bad("the alert must keep job and instance (it keeps %v), so it names the replica or node", monSorted(result))
	}
	return out
}

func monSorted(m map[string]bool) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// ---------------------------------------------------------------- the running fleet

// scrapeMetrics reads url's /metrics into families.
func scrapeMetrics(t *testing.T, url string) monFamilies {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("scraping %s: %v", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scraping %s: %s", url, resp.Status)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parsing %s: %v", url, err)
	}
	return fams
}

// value sums the series of name (a histogram's name_count or name_sum
// included) whose labels include want.
func (ex monFamilies) value(name string, want map[string]string) float64 {
	f, part := ex.resolve(name)
	if f == nil {
		return 0
	}
	sum := 0.0
	for _, m := range f.GetMetric() {
		ok := true
		for k, v := range want {
			found := false
			for _, l := range m.GetLabel() {
				found = found || l.GetName() == k && l.GetValue() == v
			}
			ok = ok && found
		}
		if !ok {
			continue
		}
		switch {
		case part == "count":
			sum += float64(m.GetHistogram().GetSampleCount())
		case part == "sum":
			sum += m.GetHistogram().GetSampleSum()
		case m.Counter != nil:
			sum += m.GetCounter().GetValue()
		case m.Gauge != nil:
			sum += m.GetGauge().GetValue()
		case m.Untyped != nil:
			sum += m.GetUntyped().GetValue()
		}
	}
	return sum
}

// scrapeMetricsUntil scrapes url until cond holds, for series a background loop
// moves (DNS lookups, self-registration): it fails after 20 s.
func scrapeMetricsUntil(t *testing.T, url, what string, cond func(monFamilies) bool) monFamilies {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		ex := scrapeMetrics(t, url)
		if cond(ex) {
			return ex
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s never held", url, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

type monClient struct {
	t    *testing.T
	base string
	hc   *http.Client
}

type monAnswer struct {
	status int
	body   []byte
	header http.Header
}

func (c *monClient) post(path, body string) monAnswer {
	c.t.Helper()
	resp, err := c.hc.Post(c.base+path, "application/json", strings.NewReader(body))
	if err != nil {
		c.t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return monAnswer{resp.StatusCode, b, resp.Header}
}

func monEncodeBody(reqID string) string {
	return fmt.Sprintf(`{"req_id":%q,"mm_items":["https://example.com/%s.png"],"modality":"IMAGE","num_parts":1,"part_idx":0,`+
		`"prefill_host":"127.0.0.1","embedding_port":null}`, reqID, reqID)
}

func monMetaBody(reqID string) string { return fmt.Sprintf(`{"req_id":%q,"part_idx":0}`, reqID) }

func monSendBody(reqID string, size, monAckPort int, session string, addr uint64) string {
	return fmt.Sprintf(`{"req_id":%q,"part_idx":0,"embedding_size":%d,"prefill_host":"127.0.0.1","embedding_port":%d,`+
		`"session_id":%q,"buffer_address":%d,"receive_count":1}`, reqID, size, monAckPort, session, addr)
}

// encodeAndPull runs a part's /encode and its metadata pull, and returns
// the embedding_size the pull answered.
func (c *monClient) encodeAndPull(reqID string) int {
	c.t.Helper()
	if a := c.post("/encode", monEncodeBody(reqID)); a.status != http.StatusOK {
		c.t.Fatalf("/encode %s: %d %s", reqID, a.status, a.body)
	}
	return c.pull(reqID)
}

// pull runs a part's metadata pull and returns its embedding_size.
func (c *monClient) pull(reqID string) int {
	c.t.Helper()
	a := c.post("/scheduler_receive_meta_data", monMetaBody(reqID))
	if a.status != http.StatusOK {
		c.t.Fatalf("metadata %s: %d %s", reqID, a.status, a.body)
	}
	var meta struct {
		EmbeddingSize int `json:"embedding_size"`
	}
	if err := json.Unmarshal(a.body, &meta); err != nil || meta.EmbeddingSize <= 0 {
		c.t.Fatalf("metadata %s: no embedding_size in %s (%v)", reqID, a.body, err)
	}
	return meta.EmbeddingSize
}

// monEmbedding is a part's staged bytes, derived from its req_id so the
// receiver's copy can be checked.
func monEmbedding(reqID string, n int) []byte {
	h := fnv.New64a()
	_, _ = h.Write([]byte(reqID))
	x := h.Sum64() | 1
	out := make([]byte, n)
	for i := range out {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		out[i] = byte(x)
	}
	return out
}

func monAckFrame(reqID string) []byte { return []byte("EmbeddingData(req_id=" + reqID + ")") }

// monStager hands the agent a part's embedding and ack frame over its Unix
// socket, as an encoder wired to the agent does before it publishes the
// part's metadata (the fake encoder's Stage hook).
func monStager(sock string) func(ctx context.Context, reqID string, tokens, dim, elem int) error {
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	post := func(ctx context.Context, url string, body []byte) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
		if err != nil {
			return err
		}
		resp, err := hc.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b, _ := io.ReadAll(resp.Body)
			return fmt.Errorf("agent answered %d: %s", resp.StatusCode, b)
		}
		return nil
	}
	return func(ctx context.Context, reqID string, tokens, dim, elem int) error {
		url := fmt.Sprintf("http://agent/v1/stage?req_id=%s&tokens=%d&dim=%d&dtype=bfloat16", reqID, tokens, dim)
		if err := post(ctx, url, monEmbedding(reqID, tokens*dim*elem)); err != nil {
			return err
		}
		return post(ctx, "http://agent/v1/ack?req_id="+reqID, monAckFrame(reqID))
	}
}

// monAckPort is a receiver rank's PULL socket for one request's ack.
type monAckPort struct {
	sock   zmq4.Socket
	cancel context.CancelFunc
	port   int
}

func monListenAck(t *testing.T) *monAckPort {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sock := zmq4.NewPull(ctx, zmq4.WithLogger(log.New(io.Discard, "", 0)))
	if err := sock.Listen("tcp://127.0.0.1:0"); err != nil {
		cancel()
		t.Fatal(err)
	}
	p := &monAckPort{sock: sock, cancel: cancel, port: sock.Addr().(*net.TCPAddr).Port}
	t.Cleanup(func() {
		cancel()
		_ = sock.Close()
	})
	return p
}

// frame returns the first message's frames; the agent delivers the ack
// before its /send answers, so the bound only turns a lost ack into an
// error.
func (p *monAckPort) frame(timeout time.Duration) ([][]byte, error) {
	timer := time.AfterFunc(timeout, p.cancel)
	defer timer.Stop()
	for {
		msg, err := p.sock.Recv()
		if err == nil {
			return msg.Frames, nil
		}
		if errors.Is(err, context.Canceled) {
			return nil, fmt.Errorf("no ack within %v", timeout)
		}
	}
}

// monClosedPort returns a loopback port nothing listens on (just released).
func monClosedPort(t *testing.T, network string) int {
	t.Helper()
	if network == "udp" {
		c, err := net.ListenPacket("udp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		return c.LocalAddr().(*net.UDPAddr).Port
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func monFake(t *testing.T, o fakeencoder.Options) *fakeencoder.Encoder {
	t.Helper()
	e := fakeencoder.New(o)
	if err := e.Start("127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	return e
}

func monGateway(t *testing.T, cfg gateway.Config) *gateway.Server {
	t.Helper()
	gw, err := gateway.New(cfg, gateway.Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	if err := gw.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = gw.Shutdown(ctx)
	})
	return gw
}

// monGatewayConfig is a loopback gateway sized for a test.
func monGatewayConfig() gateway.Config {
	cfg := gateway.DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Limits.MaxConns = 256
	cfg.Upstream.MaxConnsPerEncoder = 32
	return cfg
}

// The gateway's route labels the traffic below moves.
const (
	monRouteMetadata = "metadata"
	monRouteEncode   = "encode"
)

func TestMonitoringNamesExistInARunningGatewayAndAgent(t *testing.T) {
	const tokens, dim = 4, 8 // 64-byte bf16 embeddings

	// A node: a Mooncake receiver standing in for a language server's
	// rank, and a gpuagent whose socket the node's encoder stages through.
	recv, err := mooncake.NewReceiver(mooncake.ReceiverConfig{
		HandshakeListen: "127.0.0.1:0", DataListen: "127.0.0.1:0", AdvertiseHost: "127.0.0.1",
		Buffers: []int{1 << 16},
	}, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	if err := recv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = recv.Close() })
	dir, err := os.MkdirTemp("", "encgate-mon-") // short: a Unix socket path has 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	tokenFile := filepath.Join(dir, "agent.token")
	if err := os.WriteFile(tokenFile, []byte("monitoring-test-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	acfg := gpuagent.DefaultConfig()
	acfg.Listen, acfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	acfg.Control.Socket = filepath.Join(dir, "agent.sock")
	acfg.Control.SocketMode = "0600"
	acfg.Control.TokenFile = tokenFile
	agent, err := gpuagent.New(acfg, gpuagent.Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	if err := agent.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = agent.Shutdown(ctx)
	})

	// Gateway A, memory store: an encoder behind the agent whose first
	// metadata pull per part is "not ready" (a retry), and a flaky one
	// whose breaker trips; DNS discovery against a resolver that answers
	// nothing, and self-registration with a bootstrap that is not there.
	staged := monFake(t, fakeencoder.Options{Name: "enc-agent", Mode: fakeencoder.ModeMooncake,
		TokensPerItem: tokens, Dim: dim, Stage: monStager(acfg.Control.Socket),
		Faults: fakeencoder.Faults{Leading504s: 1}})
	flaky := monFake(t, fakeencoder.Options{Name: "enc-flaky", Mode: fakeencoder.ModeMooncake,
		TokensPerItem: tokens, Dim: dim,
		Faults: fakeencoder.Faults{FailureRate: 1, FailStatus: 500, FailRoutes: []string{"/encode"},
			FailMessage: "Internal encoding error: CUDA out of memory (injected)"}})
	cfgA := monGatewayConfig()
	cfgA.Encoders = []upstream.EncoderConfig{
		{Name: "enc-agent", URL: staged.URL(), Agent: "http://" + agent.Addr(), AgentTokenFile: tokenFile},
		{Name: "enc-flaky", URL: flaky.URL()},
	}
	cfgA.Breaker.ConsecutiveFailures = 2
	cfgA.Breaker.BaseEjectionTime = configfile.Duration(10 * time.Minute) // open until the scrape
	cfgA.Breaker.MaxEjectionTime = cfgA.Breaker.BaseEjectionTime
	cfgA.Discovery.DNS = []discovery.DNSConfig{{Name: "encoders.invalid.", Port: 30000, Scheme: "http",
		Interval: configfile.Duration(time.Second), Resolver: fmt.Sprintf("127.0.0.1:%d", monClosedPort(t, "udp"))}}
	cfgA.RegisterWith = []string{fmt.Sprintf("http://127.0.0.1:%d", monClosedPort(t, "tcp"))}
	cfgA.AdvertiseURL = "http://127.0.0.1:8080"
	gwA := monGateway(t, cfgA)
	a := &monClient{t: t, base: "http://" + gwA.Addr(), hc: &http.Client{Timeout: 30 * time.Second}}
	t.Cleanup(a.hc.CloseIdleConnections)

	// A: trip enc-flaky's breaker. /encodes are placed by req_id, so send
	// parts until two have landed on it.
	flakyEnc, found := gwA.Pool().Lookup("enc-flaky")
	if !found {
		t.Fatal("gateway A has no encoder enc-flaky")
	}
	for i := 0; flakyEnc.Breaker.State() != upstream.BreakerOpen; i++ {
		if i == 200 {
			t.Fatalf("enc-flaky's breaker did not open after %d /encodes", i)
		}
		a.post("/encode", monEncodeBody(fmt.Sprintf("trip-%d", i)))
	}

	// A: a part through the agent. Its metadata pull is retried (the
	// first answer is 504 "not ready"), its /send moves the bytes into the
	// receiver and acks the rank, and the same /send again is answered
	// from the store.
	buf := recv.Buffers()[0]
	const ok = "mon-ok"
	size := a.encodeAndPull(ok)
	ack := monListenAck(t)
	send := monSendBody(ok, size, ack.port, recv.SessionID(), buf.Addr)
	if r := a.post("/send", send); r.status != http.StatusOK {
		t.Fatalf("/send %s: %d %s", ok, r.status, r.body)
	}
	frames, err := ack.frame(10 * time.Second)
	if err != nil || len(frames) != 1 || !bytes.Equal(frames[0], monAckFrame(ok)) {
		t.Fatalf("the rank's ack: %q, %v", frames, err)
	}
	if got, err := recv.Bytes(buf.Addr, size); err != nil || !bytes.Equal(got, monEmbedding(ok, size)) {
		t.Fatalf("the receiver does not hold %s's embedding: %v", ok, err)
	}
	if r := a.post("/send", send); r.status != http.StatusOK || r.header.Get("X-Encgate-Replayed") != "true" {
		t.Fatalf("the duplicate /send: %d replayed=%q", r.status, r.header.Get("X-Encgate-Replayed"))
	}

	// A: a transfer that lands but whose ack finds no rank, and one whose
	// destination answers no Mooncake handshake.
	const ackLost = "mon-ack-lost"
	size = a.encodeAndPull(ackLost)
	if r := a.post("/send", monSendBody(ackLost, size, monClosedPort(t, "tcp"), recv.SessionID(), buf.Addr+64)); r.status != http.StatusInternalServerError {
		t.Fatalf("/send %s with no rank to ack: %d %s", ackLost, r.status, r.body)
	}
	const noPeer = "mon-no-peer"
	size = a.encodeAndPull(noPeer)
	session := fmt.Sprintf("127.0.0.1:%d", monClosedPort(t, "tcp"))
	if r := a.post("/send", monSendBody(noPeer, size, ack.port, session, buf.Addr+128)); r.status != http.StatusInternalServerError {
		t.Fatalf("/send %s to no Mooncake peer: %d %s", noPeer, r.status, r.body)
	}

	// A: a reload the config's validation refuses.
	bad := cfgA
	bad.Retry.Budget.Ratio = -1
	if err := gwA.Reload(bad); err == nil {
		t.Fatal("a reload with retry.budget.ratio -1 was applied")
	}

	// Gateway B (Redis store, fail_open, no retry budget at all) in a
	// subtest of its own: without redis-server it is skipped, and the rest
	// is still checked.
	var exB monFamilies
	t.Run("redis", func(t *testing.T) {
		exB = runRedisGateway(t, tokens, dim, ack.port, recv.SessionID(), buf.Addr+192)
	})

	// Scrape. A's DNS source and registrar run on their own: wait for the
	// failed lookup and the failed registration to be counted.
	exA := scrapeMetricsUntil(t, "http://"+gwA.AdminAddr()+"/metrics", "a failed DNS lookup and a failed registration", func(ex monFamilies) bool {
		return ex.value("encgate_discovery_errors_total", map[string]string{"source": "dns"}) >= 1 &&
			ex.value("encgate_self_registration_attempts_total", map[string]string{"result": "error"}) >= 1
	})
	exAgent := scrapeMetrics(t, "http://"+agent.AdminAddr()+"/metrics")

	// The traffic did what it was for: the series the rules and panels
	// watch moved.
	for _, w := range []struct {
		ex     monFamilies
		scrape string
		name   string
		labels map[string]string
		min    float64
	}{
		{exA, "A", "encgate_breaker_state", map[string]string{"encoder": "enc-flaky"}, 2},
		{exA, "A", "encgate_breaker_ejected", map[string]string{"encoder": "enc-flaky"}, 1},
		{exA, "A", "encgate_breaker_ejections_total", map[string]string{"encoder": "enc-flaky"}, 1},
		{exA, "A", "encgate_breaker_transitions_total", map[string]string{"encoder": "enc-flaky", "to": "open"}, 1},
		{exA, "A", "encgate_upstream_requests_total", map[string]string{"encoder": "enc-flaky", "code": "500"}, 2},
		{exA, "A", "encgate_requests_total", map[string]string{"route": monRouteEncode, "code": "500"}, 2},
		{exA, "A", "encgate_request_duration_seconds_count", map[string]string{"route": monRouteEncode}, 3},
		{exA, "A", "encgate_retries_total", map[string]string{"route": monRouteMetadata}, 3},
		{exA, "A", "encgate_retry_backoff_seconds_count", nil, 3},
		{exA, "A", "encgate_send_duplicates_suppressed_total", map[string]string{"reason": "replay"}, 1},
		{exA, "A", "encgate_send_forwarded_total", nil, 3},
		{exA, "A", "encgate_config_reloads_total", map[string]string{"result": "refused"}, 1},
		{exA, "A", "encgate_self_registrations", map[string]string{"state": "pending"}, 1},
		{exA, "A", "encgate_fleet_encoders", map[string]string{"source": "static", "state": "active"}, 2},
		{exAgent, "agent", "encgate_agent_transfers_total", map[string]string{"result": "ok"}, 2},
		{exAgent, "agent", "encgate_agent_transfers_total", map[string]string{"result": "failed"}, 1},
		{exAgent, "agent", "encgate_agent_transfer_bytes_total", nil, 128},
		{exAgent, "agent", "encgate_agent_transfer_seconds_count", nil, 3},
		{exAgent, "agent", "encgate_agent_acks_total", map[string]string{"result": "sent"}, 1},
		{exAgent, "agent", "encgate_agent_acks_total", map[string]string{"result": "failed"}, 1},
		{exAgent, "agent", "encgate_agent_ack_seconds_count", nil, 2},
		{exAgent, "agent", "encgate_agent_requests_total", map[string]string{"code": "200"}, 1},
	} {
		if got := w.ex.value(w.name, w.labels); got < w.min {
			t.Errorf("%s's %s%s = %g after the traffic, want >= %g", w.scrape, w.name, monLabels(w.labels), got, w.min)
		}
	}

	all := monFamilies{}
	for _, ex := range []monFamilies{exA, exB, exAgent} {
		for name, f := range ex {
			if prev, ok := all[name]; ok {
				f = monMergeFamilies(prev, f)
			}
			all[name] = f
		}
	}
	d := loadDashboard(t)
	exprs := append(dashboardExpressions(d), alertExpressions(loadAlerts(t))...)
	for _, e := range exprs {
		for _, p := range all.problems(e) {
			t.Error(p)
		}
	}
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		names, matchers, label, err := labelValues(variableQuery(v))
		if err != nil {
			t.Errorf("variable %q: %v", v.Name, err)
			continue
		}
		for _, name := range names {
			f, part := all.resolve(name)
			if f == nil {
				t.Errorf("variable %q: %s is not in the /metrics of a running gateway or agent", v.Name, name)
				continue
			}
			ls := monFamilyLabels(f, part)
			for _, l := range append([]string{label}, monMatcherLabels(matchers)...) {
				if !ls[l] && !promTargetLabels[l] {
					t.Errorf("variable %q: %s has no label %s", v.Name, name, l)
				}
			}
		}
	}
	t.Logf("%d expressions checked against %d families (%d from gateway A, %d from B, %d from the agent)",
		len(exprs), len(all), len(exA), len(exB), len(exAgent))
}

// runRedisGateway runs gateway B: a Redis store with fail_open and no retry
// budget. A metadata pull's retry is refused by the budget, then Redis dies
// and a /send goes out without dedupe. It returns B's scrape, after
// checking that those series moved.
func runRedisGateway(t *testing.T, tokens, dim, ackPort int, session string, addr uint64) monFamilies {
	rd := redistest.Start(t)
	plain := monFake(t, fakeencoder.Options{Name: "enc-b", Mode: fakeencoder.ModeMooncake,
		TokensPerItem: tokens, Dim: dim, Faults: fakeencoder.Faults{Leading504s: 1}})
	cfg := monGatewayConfig()
	cfg.Encoders = []upstream.EncoderConfig{{Name: "enc-b", URL: plain.URL()}}
	cfg.Retry.Budget = upstream.BudgetConfig{Ratio: 0, MinPerSecond: 0, Window: configfile.Duration(10 * time.Second)}
	cfg.Idempotency.Store = "redis"
	cfg.Redis.Addr = rd.Addr()
	cfg.Idempotency.FailOpen = true
	cfg.Redis.Timeout = configfile.Duration(200 * time.Millisecond)
	cfg.Redis.DialTimeout = configfile.Duration(200 * time.Millisecond)
	gw := monGateway(t, cfg)
	b := &monClient{t: t, base: "http://" + gw.Addr(), hc: &http.Client{Timeout: 30 * time.Second}}
	t.Cleanup(b.hc.CloseIdleConnections)

	const id = "mon-redis"
	if r := b.post("/encode", monEncodeBody(id)); r.status != http.StatusOK {
		t.Fatalf("B /encode: %d %s", r.status, r.body)
	}
	if r := b.post("/scheduler_receive_meta_data", monMetaBody(id)); r.status != http.StatusGatewayTimeout {
		t.Fatalf("B metadata with no retry budget: %d %s, want the encoder's 504", r.status, r.body)
	}
	size := b.pull(id)
	rd.Kill()
	if r := b.post("/send", monSendBody(id, size, ackPort, session, addr)); r.status != http.StatusOK {
		t.Fatalf("B /send with Redis down and fail_open: %d %s", r.status, r.body)
	}
	ex := scrapeMetrics(t, "http://"+gw.AdminAddr()+"/metrics")
	for _, w := range []struct {
		name   string
		labels map[string]string
	}{
		{"encgate_retry_budget_exhausted_total", map[string]string{"route": monRouteMetadata}},
		{"encgate_idempotency_store_errors_total", map[string]string{"op": "claim"}},
		{"encgate_idempotency_fail_open_total", nil},
	} {
		if got := ex.value(w.name, w.labels); got < 1 {
			t.Errorf("B's %s%s = %g after the traffic, want >= 1", w.name, monLabels(w.labels), got)
		}
	}
	return ex
}

// monMatcherLabels are the labels matchers name.
func monMatcherLabels(ms []promMatcher) []string {
	var out []string
	for _, m := range ms {
		out = append(out, m.label)
	}
	return out
}

// monLabels writes labels as a selector's matchers: {a="x",b="y"}.
func monLabels(labels map[string]string) string {
	var kv []string
	for k, v := range labels {
		kv = append(kv, fmt.Sprintf("%s=%q", k, v))
	}
	sort.Strings(kv)
	return "{" + strings.Join(kv, ",") + "}"
}

// monMergeFamilies is one family holding both scrapes' series (two gateways
// export the same names).
func monMergeFamilies(a, b *dto.MetricFamily) *dto.MetricFamily {
	m := &dto.MetricFamily{Name: a.Name, Help: a.Help, Type: a.Type}
	m.Metric = append(append(m.Metric, a.Metric...), b.Metric...)
	return m
}
