package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
	"unicode"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/encgate/encgate/discovery"
	"github.com/encgate/encgate/gateway"
	"github.com/encgate/encgate/gpuagent"
	"github.com/encgate/encgate/upstream"
)

// recorder is a registry that remembers every collector registered on it,
// so that each one's descriptors can be listed: a vector with no children
// yet is in no Gather.
type recorder struct {
	*prometheus.Registry
	collectors []prometheus.Collector
}

func newRecorder() *recorder { return &recorder{Registry: prometheus.NewRegistry()} }

// Register registers c and remembers it when the registry takes it (one
// refused as already registered is the same metric, shared).
func (r *recorder) Register(c prometheus.Collector) error {
	if err := r.Registry.Register(c); err != nil {
		return err
	}
	r.collectors = append(r.collectors, c)
	return nil
}

// MustRegister registers each of cs, panicking as prometheus's does.
func (r *recorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

// Unregister unregisters c and forgets it.
func (r *recorder) Unregister(c prometheus.Collector) bool {
	if !r.Registry.Unregister(c) {
		return false
	}
	for i, x := range r.collectors {
		if x == c {
			r.collectors = append(r.collectors[:i], r.collectors[i+1:]...)
			break
		}
	}
	return true
}

// metric is one metric family as the reference lists it.
type metric struct {
	name, typ, help string
	labels          []string
}

// listMetrics lists every metric registered on r.
//
// What a metric is comes from two places. Its name, help and label names
// come from its descriptor, which every registered collector gives through
// Describe whether or not it has children: each descriptor is made into a
// constant metric with placeholder label values (as many as it takes) and
// gathered from a scratch registry, so nothing depends on Desc's String
// format. Its type is not in the descriptor: it comes from gathering r
// itself, after every vector (CounterVec, GaugeVec, HistogramVec,
// SummaryVec) has been given one child, so that each appears. A metric
// that still does not appear (a custom collector that emits nothing now)
// is an error naming it, never a guess.
func listMetrics(r *recorder) ([]metric, error) {
	var descs []*prometheus.Desc
	seen := map[string]bool{}
	for _, c := range r.collectors {
		ch := make(chan *prometheus.Desc)
		go func() { c.Describe(ch); close(ch) }()
		var mine []*prometheus.Desc
		for d := range ch {
			if !seen[d.String()] {
				seen[d.String()] = true
				descs = append(descs, d)
				mine = append(mine, d)
			}
		}
		if len(mine) == 1 {
			if err := addChild(c, mine[0]); err != nil {
				return nil, err
			}
		}
	}
	// Name, help and labels, from the descriptors.
	scratch := prometheus.NewRegistry()
	var consts []prometheus.Metric
	for _, d := range descs {
		m, err := constMetric(d)
		if err != nil {
			return nil, err
		}
		consts = append(consts, m)
	}
	if err := scratch.Register(emitter(consts)); err != nil {
		return nil, err
	}
	fams, err := scratch.Gather()
	if err != nil {
		return nil, err
	}
	// Types, from the registry itself.
	real, err := r.Gather()
	if err != nil {
		return nil, err
	}
	types := map[string]dto.MetricType{}
	for _, f := range real {
		types[f.GetName()] = f.GetType()
	}
	var out []metric
	var problems []error
	for _, f := range fams {
		m := metric{name: f.GetName(), help: f.GetHelp()}
		if len(f.GetMetric()) > 0 {
			for _, lp := range f.GetMetric()[0].GetLabel() {
				m.labels = append(m.labels, lp.GetName())
			}
		}
		t, ok := types[m.name]
		if !ok {
			problems = append(problems, fmt.Errorf("metric %s: its collector emitted nothing, so its type is unknown", m.name))
			continue
		}
		m.typ = strings.ToLower(t.String())
		out = append(out, m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out, errors.Join(problems...)
}

// labelCount is how many variable labels d has: the count NewConstMetric
// takes.
func labelCount(d *prometheus.Desc) (int, error) {
	var err error
	for n := range 64 {
		if _, err = prometheus.NewConstMetric(d, prometheus.UntypedValue, 0, placeholders(n)...); err == nil {
			return n, nil
		}
	}
	return 0, fmt.Errorf("descriptor %s: %w", d, err)
}

func constMetric(d *prometheus.Desc) (prometheus.Metric, error) {
	n, err := labelCount(d)
	if err != nil {
		return nil, err
	}
	return prometheus.NewConstMetric(d, prometheus.UntypedValue, 0, placeholders(n)...)
}

func placeholders(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("refgen%d", i)
	}
	return out
}

// addChild gives a vector c, whose one descriptor is d, a child, so that
// it appears when gathered.
func addChild(c prometheus.Collector, d *prometheus.Desc) error {
	var get func(...string) error
	switch v := c.(type) {
	case *prometheus.CounterVec:
		get = func(l ...string) error { _, err := v.GetMetricWithLabelValues(l...); return err }
	case *prometheus.GaugeVec:
		get = func(l ...string) error { _, err := v.GetMetricWithLabelValues(l...); return err }
	case *prometheus.HistogramVec:
		get = func(l ...string) error { _, err := v.GetMetricWithLabelValues(l...); return err }
	case *prometheus.SummaryVec:
		get = func(l ...string) error { _, err := v.GetMetricWithLabelValues(l...); return err }
	default:
		return nil
	}
	n, err := labelCount(d)
	if err != nil {
		return err
	}
	return get(placeholders(n)...)
}

// emitter is an unchecked collector of fixed metrics.
type emitter []prometheus.Metric

func (emitter) Describe(chan<- *prometheus.Desc) {}

func (e emitter) Collect(ch chan<- prometheus.Metric) {
	for _, m := range e {
		ch <- m
	}
}

// gatewayMetrics builds gateways the way main does, on recorders, with
// every optional part on (a bootstrap API with a state file, DNS discovery,
// self-registration; and then a Redis store, which takes the state file's
// place), starts and stops each, and lists the union of their metrics.
// Nothing it reaches answers: addresses are loopback port 1.
func gatewayMetrics() ([]metric, error) {
	// go-redis logs every failed dial of the Redis that is not there.
	redis.SetLogger(quiet{})
	dir, err := os.MkdirTemp("", "refgen")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	base := func() gateway.Config {
		c := gateway.DefaultConfig()
		c.Listen, c.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
		c.Encoders = []upstream.EncoderConfig{{Name: "e0", URL: "http://127.0.0.1:1", Agent: "http://127.0.0.1:1"}}
		// Small bounds: the descriptors they need fit any RLIMIT_NOFILE.
		c.Limits.MaxConns, c.Admin.MaxConns, c.Upstream.MaxConnsPerEncoder, c.Redis.PoolSize = 16, 4, 4, 2
		c.Bootstrap.Listen, c.Bootstrap.Insecure = "127.0.0.1:0", true
		dns := discovery.DefaultDNS()
		dns.Name, dns.Port, dns.Resolver = "encoders.invalid.", 8000, "127.0.0.1:1"
		c.Discovery.DNS = []discovery.DNSConfig{dns}
		c.RegisterWith, c.AdvertiseURL = []string{"http://127.0.0.1:1"}, "http://127.0.0.1:2"
		return c
	}
	memory := base()
	memory.Bootstrap.StateFile = filepath.Join(dir, "registrations.json")
	shared := base()
	shared.Idempotency.Store, shared.Redis.Addr = "redis", "127.0.0.1:1"
	byName := map[string]metric{}
	for _, cfg := range []gateway.Config{memory, shared} {
		rec := newRecorder()
		s, err := gateway.New(cfg, gateway.Deps{Log: zap.NewNop(), Registry: rec})
		if err != nil {
			return nil, fmt.Errorf("building a gateway: %w", err)
		}
		if err := s.Start(); err != nil {
			return nil, fmt.Errorf("starting a gateway: %w", err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err = s.Shutdown(ctx)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("stopping a gateway: %w", err)
		}
		ms, err := listMetrics(rec)
		if err != nil {
			return nil, err
		}
		for _, m := range ms {
			byName[m.name] = m
		}
	}
	out := make([]metric, 0, len(byName))
	for _, m := range byName {
		out = append(out, m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out, nil
}

// quiet is a go-redis logger that writes nothing.
type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

// agentMetrics builds an agent the way main does, on a recorder, and lists
// its metrics.
func agentMetrics() ([]metric, error) {
	dir, err := os.MkdirTemp("", "refgen")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	cfg := gpuagent.DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Control.Socket = filepath.Join(dir, "agent.sock")
	cfg.CUDA.Mode = gpuagent.CUDAOff
	rec := newRecorder()
	a, err := gpuagent.New(cfg, gpuagent.Deps{Log: zap.NewNop(), Registry: rec})
	if err != nil {
		return nil, fmt.Errorf("building an agent: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := a.Shutdown(ctx); err != nil {
		return nil, fmt.Errorf("stopping an agent: %w", err)
	}
	return listMetrics(rec)
}

// metricsReference renders docs/reference/metrics.md.
func metricsReference() ([]byte, error) {
	gw, gerr := gatewayMetrics()
	ag, aerr := agentMetrics()
	if err := errors.Join(gerr, aerr); err != nil {
		return nil, err
	}
	var b bytes.Buffer
	b.WriteString(generatedNote)
	b.WriteString("\n# Metrics reference\n\n")
	b.WriteString("Every metric the gateway and the agent serve on their admin listener's `/metrics`, " +
		"generated by `" + command + "` from the collectors each registers (with every optional part on: " +
		"bootstrap API, DNS discovery, self-registration, the Redis store). " +
		"Besides these, both serve the Prometheus client's standard `go_*` and `process_*` metrics.\n\n" +
		"A metric whose labels are listed has one series per combination of their values; " +
		"a histogram's `le` label and its `_bucket`, `_sum` and `_count` series are left out.\n")
	for _, part := range []struct {
		title string
		ms    []metric
	}{{"Gateway", gw}, {"Agent", ag}} {
		fmt.Fprintf(&b, "\n## %s\n\n", part.title)
		b.WriteString("| Name | Type | Labels | Help |\n|---|---|---|---|\n")
		for _, m := range part.ms {
			labels := "—"
			if len(m.labels) > 0 {
				var ls []string
				for _, l := range m.labels {
					ls = append(ls, code(l))
				}
				labels = strings.Join(ls, ", ")
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", code(m.name), m.typ, labels, cell(escapeHelp(m.help)))
		}
	}
	return b.Bytes(), nil
}

// escapeHelp makes a help text plain Markdown text: the characters that
// would start markup are escaped.
func escapeHelp(s string) string {
	var b strings.Builder
	rs := []rune(s)
	word := func(i int) bool {
		return i >= 0 && i < len(rs) && (unicode.IsLetter(rs[i]) || unicode.IsDigit(rs[i]))
	}
	for i, r := range rs {
		// An underscore inside a word (max_conns) starts nothing.
		if strings.ContainsRune("\\`*[]<>", r) || r == '_' && !(word(i-1) && word(i+1)) {
			b.WriteRune('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}
