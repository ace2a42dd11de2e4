package discovery

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
)

// stateConfig is a bootstrap config with a state file in a directory of
// the test's own.
func stateConfig(t *testing.T, max int, ttl time.Duration) BootstrapConfig {
	cfg := regConfig(max, ttl)
	cfg.Listen = "127.0.0.1:0"
	cfg.StateFile = filepath.Join(t.TempDir(), "registrations.json")
	return cfg
}

// stateOpen opens cfg's state file over a new memory store on clk and
// returns a registry over it.
func stateOpen(t *testing.T, cfg BootstrapConfig, clk clock.Clock, log *zap.Logger) (*Registry, *StateFile) {
	t.Helper()
	st := NewMemoryStore(clk)
	sf, err := OpenStateFile(cfg, st, clk, log, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	return NewRegistry(cfg, st, clk, zap.NewNop(), WithRoom(10*time.Second)), sf
}

// stateEntries returns the memory store's registrations.
func stateEntries(r *Registry) map[string]memEntry {
	m := r.store.(*memoryStore)
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[string]memEntry, len(m.live))
	for u, e := range m.live {
		out[u] = *e
	}
	return out
}

// TestStateFileRoundTrip: what a registry held (registration times,
// expiries, last passed checks) is what a registry opened on the file
// holds; the downtime moves the registration and last-passed times on, not
// the expiries; an unregistration stays unregistered; the file is bounded
// to max_encoders registrations, the healthiest kept.
func TestStateFileRoundTrip(t *testing.T) {
	const ttl = time.Minute
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	cfg := stateConfig(t, 3, ttl)
	r, sf := stateOpen(t, cfg, clk, zap.NewNop())
	ctx := context.Background()
	for _, u := range []string{"http://a:1", "http://b:1", "http://gone:1"} {
		if err := r.Register(ctx, u); err != nil {
			t.Fatal(err)
		}
		clk.Advance(time.Second)
	}
	roomRefresh(t, r, "http://a:1")
	if err := r.Unregister(ctx, "http://gone:1"); err != nil {
		t.Fatal(err)
	}
	before := stateEntries(r)
	if err := sf.Save(); err != nil {
		t.Fatal(err)
	}

	const down = 5 * time.Second
	clk.Advance(down)
	r2, _ := stateOpen(t, cfg, clk, zap.NewNop())
	after := stateEntries(r2)
	if len(after) != 2 {
		t.Fatalf("restored %v, want a and b", after)
	}
	for u, b := range before {
		a := after[u]
		if !a.exp.Equal(b.exp) || !a.registered.Equal(b.registered.Add(down)) ||
			a.passed.IsZero() != b.passed.IsZero() || !b.passed.IsZero() && !a.passed.Equal(b.passed.Add(down)) {
			t.Errorf("%s: restored %+v from %+v (%s down)", u, a, b, down)
		}
	}
	if got := regMembers(t, r2); !regSame(got, "http://a:1", "http://b:1") {
		t.Fatalf("members after the restart %v", got)
	}

	// Past the TTL of b (never refreshed) but not of a (refreshed later):
	// only a comes back.
	roomRefresh(t, r2, "http://a:1")
	if err := (&StateFile{path: cfg.StateFile, max: 3, store: r2.store.(*memoryStore), clk: clk, log: zap.NewNop(), write: writeAll}).Save(); err != nil {
		t.Fatal(err)
	}
	clk.Advance(ttl - 2*time.Second)
	r3, _ := stateOpen(t, cfg, clk, zap.NewNop())
	if got := regMembers(t, r3); !regSame(got, "http://a:1") {
		t.Fatalf("members after a restart past b's TTL: %v", got)
	}

	// A file of more than max_encoders (lowered since): the healthiest
	// max are kept, those that passed most recently first.
	small := cfg
	small.MaxEncoders = 1
	clk2 := clock.NewFake(clk.Now())
	r4, sf4 := stateOpen(t, stateConfig(t, 4, ttl), clk2, zap.NewNop())
	for _, u := range []string{"http://p:1", "http://q:1", "http://n:1"} {
		if err := r4.Register(ctx, u); err != nil {
			t.Fatal(err)
		}
	}
	roomRefresh(t, r4, "http://p:1")
	clk2.Advance(time.Second)
	roomRefresh(t, r4, "http://q:1")
	if err := sf4.Save(); err != nil {
		t.Fatal(err)
	}
	small.StateFile = sf4.path
	r5, _ := stateOpen(t, small, clk2, zap.NewNop())
	if got := regMembers(t, r5); !regSame(got, "http://q:1") {
		t.Fatalf("members of a file over max_encoders 1: %v, want q (passed last)", got)
	}
}

func writeAll(f *os.File, b []byte) error { _, err := f.Write(b); return err }

// TestStateFileCorruptStartsEmpty: a file that is not a state file is set
// aside (.corrupt) with a warning, and the registry starts empty; the next
// write makes a good file. A file that cannot be read at all is an error.
func TestStateFileCorruptStartsEmpty(t *testing.T) {
	for name, body := range map[string]string{
		"garbage":       "\x00\x01 not json",
		"truncated":     `{"version":1,"saved_at":"2026-01-01T00:00:00Z","encoders":[{"url":"http://a:1"`,
		"other version": `{"version":2,"saved_at":"2026-01-01T00:00:00Z","encoders":[]}`,
		"bad url":       `{"version":1,"saved_at":"2026-01-01T00:00:00Z","encoders":[{"url":"ftp://a:1","registered_at":"2026-01-01T00:00:00Z","expires_at":"2099-01-01T00:00:00Z"}]}`,
		"twice":         `{"version":1,"saved_at":"2026-01-01T00:00:00Z","encoders":[{"url":"http://a:1","registered_at":"2026-01-01T00:00:00Z","expires_at":"2099-01-01T00:00:00Z"},{"url":"http://a:1","registered_at":"2026-01-01T00:00:00Z","expires_at":"2099-01-01T00:00:00Z"}]}`,
		"oversized":     `{"version":1,"saved_at":"2026-01-01T00:00:00Z","encoders":[]}` + strings.Repeat(" ", int(stateMaxBytes(2))),
	} {
		t.Run(name, func(t *testing.T) {
			clk := clock.NewFake(time.Unix(1_700_000_000, 0))
			cfg := stateConfig(t, 2, time.Minute)
			if err := os.WriteFile(cfg.StateFile, []byte(body), 0o600); err != nil {
				t.Fatal(err)
			}
			core, logs := observer.New(zapcore.WarnLevel)
			r, sf := stateOpen(t, cfg, clk, zap.New(core))
			if got := regMembers(t, r); len(got) != 0 {
				t.Fatalf("members from a corrupt file: %v", got)
			}
			if w := logs.FilterMessageSnippet("not a state file").All(); len(w) != 1 {
				t.Fatalf("warnings %v", logs.All())
			}
			if b, err := os.ReadFile(cfg.StateFile + ".corrupt"); err != nil || string(b) != body {
				t.Fatalf("the corrupt file set aside: %v", err)
			}
			if err := r.Register(context.Background(), "http://a:1"); err != nil {
				t.Fatal(err)
			}
			if err := sf.Save(); err != nil {
				t.Fatal(err)
			}
			r2, _ := stateOpen(t, cfg, clk, zap.NewNop())
			if got := regMembers(t, r2); !regSame(got, "http://a:1") {
				t.Fatalf("members after the next write: %v", got)
			}
		})
	}
	t.Run("unreadable", func(t *testing.T) {
		cfg := stateConfig(t, 2, time.Minute)
		if err := os.Mkdir(cfg.StateFile, 0o700); err != nil { // reading a directory fails
			t.Fatal(err)
		}
		_, err := OpenStateFile(cfg, NewMemoryStore(clock.Real{}), clock.Real{}, zap.NewNop(), nil)
		if err == nil || !strings.HasPrefix(err.Error(), "bootstrap.state_file: reading "+cfg.StateFile) {
			t.Fatalf("open an unreadable state file: %v", err)
		}
	})
}

// TestStateFileWriteIsAtomic: a write cut short (here: the temporary file
// half written, then an error) never replaces the state: the file keeps
// the last good one, and no temporary file is left. A temporary file left
// by a crash mid-write is not read, and is removed at the next start.
func TestStateFileWriteIsAtomic(t *testing.T) {
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	cfg := stateConfig(t, 4, time.Minute)
	r, sf := stateOpen(t, cfg, clk, zap.NewNop())
	ctx := context.Background()
	if err := r.Register(ctx, "http://a:1"); err != nil {
		t.Fatal(err)
	}
	if err := sf.Save(); err != nil {
		t.Fatal(err)
	}
	good, err := os.ReadFile(cfg.StateFile)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Register(ctx, "http://b:1"); err != nil {
		t.Fatal(err)
	}
	cut := errors.New("disk full")
	sf.write = func(f *os.File, b []byte) error {
		if _, err := f.Write(b[:len(b)/2]); err != nil {
			return err
		}
		return cut
	}
	if err := sf.Save(); !errors.Is(err, cut) {
		t.Fatalf("save cut short: %v", err)
	}
	if got := testutil.ToFloat64(sf.writes.WithLabelValues("error")); got != 1 {
		t.Fatalf("writes{result=error} = %v", got)
	}
	if b, err := os.ReadFile(cfg.StateFile); err != nil || string(b) != string(good) {
		t.Fatalf("the state after a write cut short: %q %v, want the last good one %q", b, err, good)
	}
	dir := filepath.Dir(cfg.StateFile)
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Fatalf("files left in the state directory: %v", ents)
	}

	// A crash mid-write leaves a partial temporary file.
	partial := filepath.Join(dir, filepath.Base(cfg.StateFile)+".tmp-123")
	if err := os.WriteFile(partial, []byte(`{"version":1,"saved_at":`), 0o600); err != nil {
		t.Fatal(err)
	}
	r2, _ := stateOpen(t, cfg, clk, zap.NewNop())
	if got := regMembers(t, r2); !regSame(got, "http://a:1") {
		t.Fatalf("members after a crash mid-write: %v, want the last good state", got)
	}
	if _, err := os.Stat(partial); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the partial temporary file is still there: %v", err)
	}
}

// TestStateFileRunWritesOnChangeAtABoundedRate: Run writes the first change
// at once, then waits state_write_interval (the injected clock) before the
// next write, which carries every change made meanwhile.
func TestStateFileRunWritesOnChangeAtABoundedRate(t *testing.T) {
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	cfg := stateConfig(t, 4, time.Minute)
	cfg.StateWriteInterval = configfile.Duration(time.Second)
	r, sf := stateOpen(t, cfg, clk, zap.NewNop())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		sf.Run(ctx)
	}()
	t.Cleanup(func() { cancel(); <-done })
	holds := func(u string) bool {
		b, _ := os.ReadFile(cfg.StateFile)
		return strings.Contains(string(b), `"`+u+`"`)
	}
	spacing := clk.TimerCreated()
	if err := r.Register(ctx, "http://a:1"); err != nil {
		t.Fatal(err)
	}
	<-spacing // written, and waiting out the interval
	if !holds("http://a:1") {
		t.Fatal("the first change was not written at once")
	}
	for _, u := range []string{"http://b:1", "http://c:1"} {
		if err := r.Register(ctx, u); err != nil {
			t.Fatal(err)
		}
	}
	if holds("http://b:1") || holds("http://c:1") {
		t.Fatal("written again within state_write_interval")
	}
	spacing = clk.TimerCreated()
	clk.Advance(time.Second)
	<-spacing
	if !holds("http://b:1") || !holds("http://c:1") {
		t.Fatal("the changes made within the interval were not written after it")
	}
	if got := testutil.ToFloat64(sf.writes.WithLabelValues("ok")); got != 2 {
		t.Fatalf("writes{result=ok} = %v, want 2", got)
	}
}

// TestStateFileValidation: state_file's directory must exist and take a
// file, the path must not be a directory, and listen must be set;
// state_write_interval is within (0, ttl).
func TestStateFileValidation(t *testing.T) {
	dir := t.TempDir()
	check := func(mut func(*BootstrapConfig), want string) {
		t.Helper()
		cfg := DefaultBootstrap()
		cfg.Listen = "127.0.0.1:0"
		cfg.Insecure = true
		mut(&cfg)
		var p configfile.Problems
		cfg.Validate(&p, "bootstrap")
		err := p.Err()
		switch {
		case want == "" && err != nil:
			t.Errorf("unexpected problems: %v", err)
		case want != "" && (err == nil || !strings.Contains(err.Error(), want)):
			t.Errorf("problems %v, want %q", err, want)
		}
	}
	check(func(c *BootstrapConfig) { c.StateFile = filepath.Join(dir, "s.json") }, "")
	check(func(c *BootstrapConfig) { c.StateFile = filepath.Join(dir, "missing", "s.json") },
		"bootstrap.state_file: directory "+filepath.Join(dir, "missing")+": no such file or directory")
	check(func(c *BootstrapConfig) { c.StateFile = dir }, "bootstrap.state_file: "+dir+" exists and is not a regular file")
	check(func(c *BootstrapConfig) { c.StateFile = filepath.Join(dir, "s.json"); c.Listen = "" },
		"bootstrap.state_file: is set but listen is empty")
	check(func(c *BootstrapConfig) { c.StateWriteInterval = 0 }, "bootstrap.state_write_interval: must be above 0 and below ttl")
	check(func(c *BootstrapConfig) { c.StateWriteInterval = c.TTL }, "bootstrap.state_write_interval: must be above 0 and below ttl")
	if os.Geteuid() != 0 { // root writes anywhere
		ro := filepath.Join(dir, "ro")
		if err := os.Mkdir(ro, 0o500); err != nil {
			t.Fatal(err)
		}
		check(func(c *BootstrapConfig) { c.StateFile = filepath.Join(ro, "s.json") }, "bootstrap.state_file: directory "+ro+" is not writable")
	}
	if ents, _ := os.ReadDir(dir); len(ents) > 1 { // ro, and nothing the checks made
		t.Errorf("the checks left files: %v", ents)
	}
}
