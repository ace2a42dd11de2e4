package main

import (
	"reflect"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/encgate/encgate/internal/configfile"
)

// sampleConfig is a config for the walker's tests.
type sampleConfig struct {
	// Documented is a key with a comment.
	Documented configfile.Duration `yaml:"documented"`
	Bare       string              `yaml:"bare"`
	// Inner is a section.
	Inner sampleInner `yaml:"inner"`
	// List is a list of sections.
	List []sampleInner `yaml:"list"`
	// Embedded keys are lifted into this struct's own.
	SampleEmbedded `yaml:",inline"`
	// Moved is refused wherever it is, so it is no key.
	Moved configfile.Moved `yaml:"moved,omitempty"`
	// Hidden is set by code, never by the file.
	Hidden bool `yaml:"-"`
}

// sampleInner is a section.
type sampleInner struct {
	// FirstKey and SecondKey share this comment, which names both.
	FirstKey  int `yaml:"first_key"`
	SecondKey int `yaml:"second_key"`
	ThirdKey  int `yaml:"third_key"`
}

// SampleEmbedded is inlined.
type SampleEmbedded struct {
	// Size is a size.
	Size configfile.ByteSize `yaml:"size"`
}

func sampleWalk(t *testing.T) (*walker, map[string]key) {
	t.Helper()
	root, mod, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	docs := newDocIndex(root, mod)
	docs.tests = true
	w := &walker{docs: docs, types: map[reflect.Type]*valueType{}}
	w.walkConfig(sampleConfig{Documented: configfile.Duration(5e9), Inner: sampleInner{FirstKey: 1}, SampleEmbedded: SampleEmbedded{Size: 8 << 20}})
	keys := map[string]key{}
	for _, k := range w.keys {
		keys[k.path] = k
	}
	return w, keys
}

// A field without a doc comment is a problem that names its key, its
// struct and its file; one declared right under a comment that names it
// shares that comment.
func TestUndocumentedField(t *testing.T) {
	w, keys := sampleWalk(t)
	var got []string
	for _, p := range w.problems {
		got = append(got, p.Error())
	}
	want := []string{
		"config key bare: field refgen.sampleConfig.Bare (docs/refgen/refgen_test.go) has no doc comment: write one (it is this key's entry in docs/reference/configuration.md)",
		"config key inner.third_key: field refgen.sampleInner.ThirdKey (docs/refgen/refgen_test.go) has no doc comment: write one (it is this key's entry in docs/reference/configuration.md)",
		"config key list[].third_key: field refgen.sampleInner.ThirdKey (docs/refgen/refgen_test.go) has no doc comment: write one (it is this key's entry in docs/reference/configuration.md)",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("problems:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if d := keys["inner.second_key"].doc; !strings.Contains(d, "FirstKey and SecondKey") {
		t.Errorf("inner.second_key's doc is %q, want the comment it shares with first_key", d)
	}
}

// Keys follow configfile's rules: inline lifts, "-" and Moved are no keys,
// lists' entries are under [], and defaults are written as YAML writes them.
func TestKeys(t *testing.T) {
	_, keys := sampleWalk(t)
	var paths []string
	for p := range keys {
		paths = append(paths, p)
	}
	want := map[string]struct{ typ, def string }{
		"documented":        {"duration", "5s"},
		"bare":              {"string", `""`},
		"inner":             {"mapping", ""},
		"inner.first_key":   {"integer", "1"},
		"inner.second_key":  {"integer", "0"},
		"inner.third_key":   {"integer", "0"},
		"list":              {"list of mappings", "[]"},
		"list[].first_key":  {"integer", ""},
		"list[].second_key": {"integer", ""},
		"list[].third_key":  {"integer", ""},
		"size":              {"size", "8MiB"},
	}
	if len(keys) != len(want) {
		t.Errorf("keys %v, want %d of them", paths, len(want))
	}
	for p, w := range want {
		k, ok := keys[p]
		if !ok {
			t.Errorf("no key %s", p)
			continue
		}
		if k.typ != w.typ || k.def != w.def {
			t.Errorf("%s: type %q default %q, want %q %q", p, k.typ, k.def, w.typ, w.def)
		}
	}
}

// A key's doc names keys, not Go fields.
func TestKeyDoc(t *testing.T) {
	_, keys := sampleWalk(t)
	if got, want := keyDoc(keys["inner.second_key"]), "`first_key` and `second_key` share this comment, which names both.\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

// A vector with no children is listed with its type and labels; a
// collector that emits nothing is an error naming its metric.
func TestListMetrics(t *testing.T) {
	r := newRecorder()
	r.MustRegister(prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "h_seconds", Help: "A histogram."}, []string{"route", "code"}))
	r.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "g", Help: "A gauge."}, func() float64 { return 1 }))
	ms, err := listMetrics(r)
	if err != nil {
		t.Fatal(err)
	}
	want := []metric{{name: "g", typ: "gauge", help: "A gauge."}, {name: "h_seconds", typ: "histogram", help: "A histogram.", labels: []string{"code", "route"}}}
	if !reflect.DeepEqual(ms, want) {
		t.Errorf("got %+v, want %+v", ms, want)
	}
	r.MustRegister(silent{prometheus.NewDesc("quiet_total", "Says nothing.", nil, nil)})
	if _, err := listMetrics(r); err == nil || !strings.Contains(err.Error(), "metric quiet_total: its collector emitted nothing") {
		t.Errorf("got %v, want the silent collector named", err)
	}
}

// silent describes a metric and never emits it.
type silent struct{ d *prometheus.Desc }

func (s silent) Describe(ch chan<- *prometheus.Desc) { ch <- s.d }
func (silent) Collect(chan<- prometheus.Metric)      {}

// The drift check shows what changed.
func TestDiff(t *testing.T) {
	got := diff("a\nb\nc\nd\n", "a\nb\nX\nd\n")
	if want := "  b\n- c\n+ X\n  d\n"; !strings.Contains(got, want) {
		t.Errorf("diff:\n%s\nwant it to hold:\n%s", got, want)
	}
	if diff("same\n", "same\n") != "" {
		t.Error("a diff of equal texts")
	}
}
