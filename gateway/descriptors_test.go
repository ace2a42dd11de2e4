package gateway

import (
	"errors"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/encgate/encgate/internal/fdlimit"
	"github.com/encgate/encgate/internal/listener"
	"github.com/encgate/encgate/upstream"
)

// fakeLimits is an RLIMIT_NOFILE for New.
type fakeLimits struct{ soft, hard uint64 }

func (f *fakeLimits) Get() (uint64, uint64, error) { return f.soft, f.hard, nil }
func (f *fakeLimits) Set(soft, hard uint64) error {
	f.soft, f.hard = soft, hard
	return nil
}

func fdConfig() Config {
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Encoders = []upstream.EncoderConfig{
		{Name: "enc-a", URL: "http://127.0.0.1:1"},
		{Name: "enc-b", URL: "http://127.0.0.1:2", Agent: "http://127.0.0.1:3"},
	}
	cfg.Limits.MaxConns = 100
	cfg.Admin.MaxConns = 16
	cfg.Upstream.MaxConnsPerEncoder = 10
	return cfg
}

// Every bound the config sets is a term: the two listeners' limits and
// their refusals in progress, a pool per encoder and per agent, the probes,
// the Redis pool with its pub/sub connection, and the process's own files.
func TestDescriptorsCountEveryBound(t *testing.T) {
	cfg := fdConfig()
	mem, err := Descriptors(cfg, &fakeLimits{soft: 1 << 20, hard: 1 << 20}, false)
	if err != nil {
		t.Fatal(err)
	}
	// 100 + (100+1) + 16 + (8+1) + 10*(2 encoders + 1 agent) + 2*2 probes + 2 listeners + the poller's 1 + margin
	want := uint64(100 + 101 + 16 + 9 + 30 + 4 + 2 + 1 + listener.DescriptorMargin)
	if mem.Limits.Need != want || !mem.Checked {
		t.Fatalf("memory store: need %d (checked %v), want %d: %s", mem.Limits.Need, mem.Checked, want, mem)
	}
	cfg.Idempotency.Store = "redis"
	cfg.Redis.PoolSize = 20
	rd, err := Descriptors(cfg, &fakeLimits{soft: 1 << 20, hard: 1 << 20}, false)
	if err != nil {
		t.Fatal(err)
	}
	if rd.Limits.Need != want+21 {
		t.Fatalf("redis store: need %d, want %d: %s", rd.Limits.Need, want+21, rd)
	}
	for _, term := range []string{"limits.max_conns 100", "admin.max_conns 16", "upstream.max_conns_per_encoder 10 x 3 (2 encoders, 1 agents) = 30",
		"health probes (2 per encoder) 4", "redis.pool_size + pub/sub 21"} {
		if !strings.Contains(rd.String(), term) {
			t.Errorf("the report lacks %q: %s", term, rd)
		}
	}
}

// Where the config fits under the hard limit but not the soft one, New
// raises the soft limit to the hard one and logs the figures.
func TestNewRaisesTheSoftLimitWhereThatMakesItFit(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	l := &fakeLimits{soft: 256, hard: 4096}
	s, err := New(fdConfig(), Deps{Log: zap.New(core), Registry: prometheus.NewRegistry(), Descriptors: l})
	if err != nil {
		t.Fatal(err)
	}
	s.pool.Close()
	_ = s.store.Close()
	if l.soft != 4096 {
		t.Fatalf("soft limit %d, want it raised to the hard limit 4096", l.soft)
	}
	line := logs.FilterMessageSnippet("descriptors: the config fits").All()
	if len(line) != 1 {
		t.Fatalf("no descriptors line in the log: %v", logs.All())
	}
	f := line[0].ContextMap()
	if f["need"] != uint64(327) || f["soft_limit"] != uint64(4096) || f["soft_limit_found"] != uint64(256) || f["raised"] != true {
		t.Errorf("descriptors line %v, want need 327, soft 256 raised to 4096", f)
	}
}

// A config that cannot fit under the hard limit is refused, with the
// numbers and the keys to change, before anything is built.
func TestNewRefusesAConfigThatCannotFit(t *testing.T) {
	l := &fakeLimits{soft: 256, hard: 256}
	cfg := fdConfig()
	cfg.Limits.MaxConns = 10000
	_, err := New(cfg, Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry(), Descriptors: l})
	var de *listener.DescriptorError
	if !errors.As(err, &de) {
		t.Fatalf("New: %v, want a *listener.DescriptorError", err)
	}
	var tooSmall *fdlimit.TooSmallError
	if !errors.As(err, &tooSmall) || tooSmall.Hard != 256 {
		t.Errorf("%v does not wrap the limit's *fdlimit.TooSmallError", err)
	}
	for _, want := range []string{"can hold 10255 descriptors open", "limits.max_conns 10000", "its hard limit 256",
		"lower limits.max_conns, upstream.max_conns_per_encoder or admin.max_conns", "ulimit -Hn"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error lacks %q:\n%v", want, err)
		}
	}
	if l.soft != 256 {
		t.Errorf("the soft limit changed to %d", l.soft)
	}
}

// Encoders and upstream apply at reload, so a reload that would need more
// descriptors than the hard limit allows is refused as New refuses it, and
// the running config stays; one that fits applies.
func TestReloadRefusesAConfigThatCannotFit(t *testing.T) {
	l := &fakeLimits{soft: 400, hard: 400}
	s, err := New(fdConfig(), Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry(), Descriptors: l})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s.pool.Close(); _ = s.store.Close() }()
	before := s.conf()
	next := *before
	next.Upstream.MaxConnsPerEncoder = 1000
	var de *listener.DescriptorError
	if err := s.Reload(next); !errors.As(err, &de) {
		t.Fatalf("Reload: %v, want a *listener.DescriptorError", err)
	}
	if s.conf() != before || s.conf().Upstream.MaxConnsPerEncoder != 10 {
		t.Fatalf("the refused reload changed the config: %+v", s.conf().Upstream)
	}
	next.Upstream.MaxConnsPerEncoder = 20
	if err := s.Reload(next); err != nil || s.conf().Upstream.MaxConnsPerEncoder != 20 {
		t.Fatalf("a reload that fits: %v", err)
	}
}
