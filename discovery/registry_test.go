package discovery

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/redistest"
)

// regGuard bounds waits for things that must happen by themselves; it only
// catches a hang.
const regGuard = 15 * time.Second

func TestParseEncoderURLAccepts(t *testing.T) {
	cases := []struct{ raw, url, name string }{
		{"http://enc-a:8000", "http://enc-a:8000", "enc-a:8000"},
		{"HTTP://Enc-A.Example.COM:8000/", "http://enc-a.example.com:8000", "enc-a.example.com:8000"},
		{"https://10.0.0.5:30000///", "https://10.0.0.5:30000", "10.0.0.5:30000"},
		{"http://[::1]:8000", "http://[::1]:8000", "[::1]:8000"},
		{"http://[0:0:0:0:0:0:0:1]:8000/", "http://[::1]:8000", "[::1]:8000"},
		{"http://[2001:DB8::1]:1", "http://[2001:db8::1]:1", "[2001:db8::1]:1"},
		{"http://h:08000", "http://h:8000", "h:8000"},
		{"http://h:65535", "http://h:65535", "h:65535"},
		{"http://enc_0.svc:1", "http://enc_0.svc:1", "enc_0.svc:1"},
	}
	for _, c := range cases {
		u, name, err := ParseEncoderURL(c.raw)
		if err != nil || u != c.url || name != c.name {
			t.Errorf("ParseEncoderURL(%q) = %q, %q, %v; want %q, %q", c.raw, u, name, err, c.url, c.name)
		}
	}
}

func TestParseEncoderURLRejects(t *testing.T) {
	cases := []struct{ raw, msg string }{
		{"ftp://x:1", `url "ftp://x:1": scheme must be http or https`},
		{"enc:8000", `url "enc:8000": has no scheme; did you mean "http://enc:8000"?`},
		{"10.0.0.5:30000", `url "10.0.0.5:30000": has no scheme; did you mean "http://10.0.0.5:30000"?`},
		{"enc", `url "enc": scheme must be http or https`},
		{"", `url "": scheme must be http or https`},
		{"//h:1", `url "//h:1": scheme must be http or https`},
		{"http:h:1", `url "http:h:1": must be scheme://host:port`},
		{"http:///p", `url "http:///p": must be scheme://host:port`},
		{"http://h", `url "http://h": must have a port (host:port)`},
		{"http://h:", `url "http://h:": must have a port (host:port)`},
		{"http://h:0", `url "http://h:0": port must be 1..65535`},
		{"http://h:65536", `url "http://h:65536": port must be 1..65535`},
		{"http://h:99999999999999999999999", `url "http://h:99999999999999999999999": port must be 1..65535`},
		{"http://user:pw@h:1", `url "http://user:pw@h:1": must not carry userinfo`},
		{"http://h:1/?a=b", `url "http://h:1/?a=b": must not have a query`},
		{"http://h:1?", `url "http://h:1?": must not have a query`},
		{"http://h:1#x", `url "http://h:1#x": must not have a fragment`},
		{"http://h:1/#", `url "http://h:1/#": must not have a fragment`},
		{"http://:1", `url "http://:1": must have a host`},
		{"http://[fe80::1%25eth0]:1", `url "http://[fe80::1%25eth0]:1": host must not carry an IPv6 zone`},
		{"http://a%20b:1", ``},
		{"http://-h:1", `url "http://-h:1": host must be a DNS name or an IP address`},
		{"http://a..b:1", `url "http://a..b:1": host must be a DNS name or an IP address`},
		{"http://a!b:1", ``},
		{"http://h:1/a/../b", `url "http://h:1/a/../b": must be a base URL without a path (the gateway sends each route to host:port, as to a configured encoder)`},
		{"http://h:8000/p/0", `url "http://h:8000/p/0": must be a base URL without a path (the gateway sends each route to host:port, as to a configured encoder)`},
		{"http://h:1/./b", `url "http://h:1/./b": must be a base URL without a path (the gateway sends each route to host:port, as to a configured encoder)`},
		{"http://h:1 ", ``},
		{"http://h\x00:1", ``},
	}
	for _, c := range cases {
		u, name, err := ParseEncoderURL(c.raw)
		if err == nil {
			t.Errorf("ParseEncoderURL(%q) accepted: %q, %q", c.raw, u, name)
			continue
		}
		if !errors.Is(err, ErrInvalidURL) {
			t.Errorf("ParseEncoderURL(%q): %v does not match ErrInvalidURL", c.raw, err)
		}
		if c.msg != "" && err.Error() != c.msg {
			t.Errorf("ParseEncoderURL(%q): %q, want %q", c.raw, err, c.msg)
		}
		if c.msg == "" && !strings.HasPrefix(err.Error(), fmt.Sprintf("url %q: ", c.raw)) {
			t.Errorf("ParseEncoderURL(%q): %q does not name the url", c.raw, err)
		}
	}
}

func TestParseEncoderURLLong(t *testing.T) {
	raw := "http://h:1/" + strings.Repeat("a", 3000)
	_, _, err := ParseEncoderURL(raw)
	if err == nil || !strings.Contains(err.Error(), "longer than 2048 bytes") {
		t.Fatalf("err %v", err)
	}
	if len(err.Error()) > 300 {
		t.Fatalf("the error quotes %d bytes of the url", len(err.Error()))
	}
	// 2048 bytes is not refused for its length (its host is then too long
	// for a DNS name, which is refused for that).
	ok := "http://" + strings.Repeat("a", 2048-len("http://:1")) + ":1"
	if _, _, err := ParseEncoderURL(ok); err == nil || strings.Contains(err.Error(), "longer than 2048") {
		t.Fatalf("a 2048-byte url: %v", err)
	}
}

// FuzzParseEncoderURL: never panics; an accepted URL re-parses to itself
// with the same name, and its name is the URL without the scheme.
func FuzzParseEncoderURL(f *testing.F) {
	for _, s := range []string{
		"http://enc-a:8000", "HTTPS://E:1//", "http://[::1]:1/p", "http://[::ffff:1.2.3.4]:80",
		"http://h:1/%41%2f/", "http://h:1/a b", "ftp://x:1", "http://u@h:1", "http://h:1?#",
		"http://[fe80::1%25x]:1", "http://h:0001/p/0",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		u, name, err := ParseEncoderURL(raw)
		if err != nil {
			if !errors.Is(err, ErrInvalidURL) {
				t.Fatalf("%q: %v is not ErrInvalidURL", raw, err)
			}
			return
		}
		u2, name2, err := ParseEncoderURL(u)
		if err != nil || u2 != u || name2 != name {
			t.Fatalf("%q -> %q %q re-parses to %q %q %v", raw, u, name, u2, name2, err)
		}
		if !strings.HasSuffix(u, "://"+name) || strings.HasSuffix(u, "/") {
			t.Fatalf("%q -> url %q, name %q", raw, u, name)
		}
	})
}

func regConfig(max int, ttl time.Duration) BootstrapConfig {
	cfg := DefaultBootstrap()
	cfg.MaxEncoders = max
	cfg.TTL = configfile.Duration(ttl)
	return cfg
}

func regMembers(t *testing.T, r *Registry) []string {
	t.Helper()
	ms, err := r.Members(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	names := make([]string, len(ms))
	for i, m := range ms {
		if m.Source != SourceRegistered {
			t.Fatalf("member %+v: source %q", m, m.Source)
		}
		names[i] = m.URL
	}
	return names
}

func regSame(a []string, b ...string) bool {
	return strings.Join(a, " ") == strings.Join(b, " ")
}

// regTestBound runs the bound checks on two registries over one store (one
// registry twice for the memory store).
func regTestBound(t *testing.T, a, b *Registry) {
	ctx := context.Background()
	if err := a.Register(ctx, "http://e1:1"); err != nil {
		t.Fatal(err)
	}
	if err := b.Register(ctx, "http://e2:1"); err != nil {
		t.Fatal(err)
	}
	for _, r := range []*Registry{a, b} {
		if err := r.Register(ctx, "http://e3:1"); !errors.Is(err, ErrFull) {
			t.Fatalf("third distinct url: %v, want ErrFull", err)
		}
	}
	// Re-registering one that is there refreshes it and is not refused, in
	// any spelling that normalises to it.
	if err := a.Register(ctx, "HTTP://E2:1/"); err != nil {
		t.Fatalf("re-register at the bound: %v", err)
	}
	if err := b.Register(ctx, "http://e1:1"); err != nil {
		t.Fatalf("re-register at the bound: %v", err)
	}
	if got := regMembers(t, b); !regSame(got, "http://e1:1", "http://e2:1") {
		t.Fatalf("members %v", got)
	}
	// Unregistering frees a slot.
	if err := a.Unregister(ctx, "http://e1:1"); err != nil {
		t.Fatal(err)
	}
	if err := b.Register(ctx, "http://e3:1"); err != nil {
		t.Fatalf("after an unregistration: %v", err)
	}
	if got := regMembers(t, a); !regSame(got, "http://e2:1", "http://e3:1") {
		t.Fatalf("members %v", got)
	}
}

func TestRegistryBound(t *testing.T) {
	r := NewRegistry(regConfig(2, time.Minute), NewMemoryStore(clock.Real{}), clock.Real{}, zap.NewNop())
	regTestBound(t, r, r)
}

func TestRegistryInvalidAndUnknown(t *testing.T) {
	r := NewRegistry(regConfig(2, time.Minute), NewMemoryStore(clock.Real{}), clock.Real{}, zap.NewNop())
	ctx := context.Background()
	if err := r.Register(ctx, "ftp://x:1"); !errors.Is(err, ErrInvalidURL) {
		t.Fatalf("register ftp: %v", err)
	}
	if err := r.Unregister(ctx, "http://never:1"); err != nil {
		t.Fatalf("unregister unknown: %v", err)
	}
	if got := regMembers(t, r); len(got) != 0 {
		t.Fatalf("members %v", got)
	}
}

// regTestTTL checks expiry and Refresh on r, whose clock is clk.
func regTestTTL(t *testing.T, r *Registry, clk *clock.Fake, ttl time.Duration) {
	ctx := context.Background()
	if err := r.Register(ctx, "http://a:1"); err != nil {
		t.Fatal(err)
	}
	clk.Advance(ttl / 2)
	if err := r.Register(ctx, "http://b:1"); err != nil {
		t.Fatal(err)
	}
	clk.Advance(ttl/2 - time.Millisecond)
	if got := regMembers(t, r); !regSame(got, "http://a:1", "http://b:1") {
		t.Fatalf("just before a's TTL: %v", got)
	}
	clk.Advance(time.Millisecond)
	if got := regMembers(t, r); !regSame(got, "http://b:1") {
		t.Fatalf("at a's TTL: %v", got)
	}
	// Refresh extends b, and does not bring back a, which expired, nor add
	// one never registered.
	if err := r.Refresh(ctx, []string{"http://a:1", "HTTP://B:1/", "http://c:1", "not a url"}); err != nil {
		t.Fatal(err)
	}
	clk.Advance(ttl - time.Millisecond)
	if got := regMembers(t, r); !regSame(got, "http://b:1") {
		t.Fatalf("after a refresh: %v", got)
	}
	clk.Advance(time.Millisecond)
	if got := regMembers(t, r); len(got) != 0 {
		t.Fatalf("a refreshed TTL later: %v", got)
	}
	// Refresh does not bring back an unregistered URL either.
	if err := r.Register(ctx, "http://d:1"); err != nil {
		t.Fatal(err)
	}
	if err := r.Unregister(ctx, "http://d:1"); err != nil {
		t.Fatal(err)
	}
	if err := r.Refresh(ctx, []string{"http://d:1"}); err != nil {
		t.Fatal(err)
	}
	if got := regMembers(t, r); len(got) != 0 {
		t.Fatalf("refresh after unregister: %v", got)
	}
}

func TestRegistryTTL(t *testing.T) {
	clk := clock.NewFake(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	r := NewRegistry(regConfig(2, time.Minute), NewMemoryStore(clk), clk, zap.NewNop())
	regTestTTL(t, r, clk, time.Minute)
}

// TestRegistryExpiredFreesSlot: an expired registration does not hold a
// slot of the bound.
func TestRegistryExpiredFreesSlot(t *testing.T) {
	clk := clock.NewFake(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	r := NewRegistry(regConfig(1, time.Minute), NewMemoryStore(clk), clk, zap.NewNop())
	ctx := context.Background()
	if err := r.Register(ctx, "http://a:1"); err != nil {
		t.Fatal(err)
	}
	if err := r.Register(ctx, "http://b:1"); !errors.Is(err, ErrFull) {
		t.Fatalf("second: %v", err)
	}
	clk.Advance(time.Minute)
	if err := r.Register(ctx, "http://b:1"); err != nil {
		t.Fatalf("after a's TTL: %v", err)
	}
}

// regWaitTimer returns once a timer is pending on clk: Run is waiting for
// its next poll.
func regWaitTimer(t *testing.T, clk *clock.Fake) {
	t.Helper()
	created := clk.TimerCreated()
	if clk.Pending() > 0 {
		return
	}
	select {
	case <-created:
	case <-time.After(regGuard):
		t.Fatal("Run created no timer")
	}
}

func regURLs(ms []Member) []string {
	out := make([]string, len(ms))
	for i, m := range ms {
		out[i] = m.URL
	}
	return out
}

// regUpdates collects what Run reports.
type regUpdates chan []Member

func (u regUpdates) update(ms []Member) { u <- ms }

// next returns the next update, failing the test if none comes.
func (u regUpdates) next(t *testing.T) []string {
	t.Helper()
	select {
	case ms := <-u:
		return regURLs(ms)
	case <-time.After(regGuard):
		t.Fatal("no update from Run")
		return nil
	}
}

// until returns once an update equals want, failing if none does.
func (u regUpdates) until(t *testing.T, want ...string) {
	t.Helper()
	deadline := time.After(regGuard)
	for {
		select {
		case ms := <-u:
			if regSame(regURLs(ms), want...) {
				return
			}
		case <-deadline:
			t.Fatalf("no update with %v", want)
		}
	}
}

// regRun runs r.Run until the test ends.
func regRun(t *testing.T, r *Registry, interval time.Duration) regUpdates {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	u := make(regUpdates, 64)
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.Run(ctx, interval, u.update)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return u
}

// TestRegistryRunMemory: Run reports the set once at start, at once after a
// local change (the fake clock never moves, so no poll can be the cause),
// not after a re-registration that changes nothing, and at the first poll
// after a registration expires.
func TestRegistryRunMemory(t *testing.T) {
	clk := clock.NewFake(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	r := NewRegistry(regConfig(4, time.Minute), NewMemoryStore(clk), clk, zap.NewNop())
	ctx := context.Background()
	u := regRun(t, r, 10*time.Second)
	if got := u.next(t); len(got) != 0 {
		t.Fatalf("first update %v", got)
	}
	if err := r.Register(ctx, "http://a:1"); err != nil {
		t.Fatal(err)
	}
	if got := u.next(t); !regSame(got, "http://a:1") {
		t.Fatalf("after register: %v", got)
	}
	// A re-registration changes nothing: the next update is the next change.
	if err := r.Register(ctx, "http://a:1/"); err != nil {
		t.Fatal(err)
	}
	if err := r.Register(ctx, "http://b:1"); err != nil {
		t.Fatal(err)
	}
	// Run may see b with the re-registration's signal or the next one; either
	// way an update without b would be a duplicate.
	if got := u.next(t); !regSame(got, "http://a:1", "http://b:1") {
		t.Fatalf("after the second register: %v", got)
	}
	if err := r.Unregister(ctx, "http://a:1"); err != nil {
		t.Fatal(err)
	}
	if got := u.next(t); !regSame(got, "http://b:1") {
		t.Fatalf("after unregister: %v", got)
	}
	// Expiry: move past b's TTL; Run's next poll drops it. The poll timer
	// Run is waiting on, or one it creates meanwhile, is moved past too.
	clk.Advance(time.Minute)
	var got []string
	for done := false; !done; {
		created := clk.TimerCreated()
		if clk.Pending() > 0 {
			clk.Advance(10 * time.Second)
		}
		select {
		case ms := <-u:
			got, done = regURLs(ms), true
		case <-created:
		case <-time.After(regGuard):
			t.Fatal("no update after b's TTL")
		}
	}
	if len(got) != 0 {
		t.Fatalf("after b's TTL: %v", got)
	}
	select {
	case ms := <-u:
		t.Fatalf("unexpected update %v", ms)
	default:
	}
}

// TestRegistryRunStoreDown: while the store fails Run reports nothing (the
// last set stands), and reports the set once it can read it.
func TestRegistryRunStoreDown(t *testing.T) {
	clk := clock.NewFake(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	st := &regFlakyStore{Store: NewMemoryStore(clk)}
	st.fail(true)
	r := NewRegistry(regConfig(4, time.Minute), st, clk, zap.NewNop())
	u := regRun(t, r, time.Second)
	for i := 0; i < 3; i++ {
		regWaitTimer(t, clk)
		clk.Advance(time.Second)
	}
	regWaitTimer(t, clk)
	select {
	case ms := <-u:
		t.Fatalf("update %v while the store fails", ms)
	default:
	}
	st.fail(false)
	if err := r.Register(context.Background(), "http://a:1"); err != nil {
		t.Fatal(err)
	}
	if got := u.next(t); !regSame(got, "http://a:1") {
		t.Fatalf("after recovery: %v", got)
	}
}

// regFlakyStore fails List while told to.
type regFlakyStore struct {
	Store
	mu      sync.Mutex
	failing bool
}

func (f *regFlakyStore) fail(on bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failing = on
}

func (f *regFlakyStore) List(ctx context.Context) (Listing, error) {
	f.mu.Lock()
	failing := f.failing
	f.mu.Unlock()
	if failing {
		return Listing{}, errors.New("down")
	}
	return f.Store.List(ctx)
}

// regRedis returns a registry (a "replica") over srv under prefix.
func regRedis(t *testing.T, srv *redistest.Server, prefix string, cfg BootstrapConfig, clk clock.Clock) *Registry {
	t.Helper()
	return regRedisOn(t, regServer(t, srv), prefix, cfg, clk)
}

// regRedisOn is regRedis on any shape of Redis.
func regRedisOn(t *testing.T, sh *regShape, prefix string, cfg BootstrapConfig, clk clock.Clock) *Registry {
	t.Helper()
	return NewRegistry(cfg, NewRedisStore(sh.client(t), prefix), clk, zap.NewNop())
}

// TestRegistryRedisConverge: a registration on replica A shows in replica
// B's Run, and an unregistration on A takes it away there.
func TestRegistryRedisConverge(t *testing.T) { testRegistryConverge(t, regStartServer(t)) }

func testRegistryConverge(t *testing.T, sh *regShape) {
	cfg := regConfig(8, time.Minute)
	a := regRedisOn(t, sh, "t:", cfg, clock.Real{})
	b := regRedisOn(t, sh, "t:", cfg, clock.Real{})
	other := regRedisOn(t, sh, "other:", cfg, clock.Real{})
	ctx := context.Background()
	u := regRun(t, b, 10*time.Millisecond)
	if got := u.next(t); len(got) != 0 {
		t.Fatalf("first update %v", got)
	}
	if err := a.Register(ctx, "http://Enc-A:8000/"); err != nil {
		t.Fatal(err)
	}
	u.until(t, "http://enc-a:8000")
	if err := a.Register(ctx, "http://enc-b:8000"); err != nil {
		t.Fatal(err)
	}
	u.until(t, "http://enc-a:8000", "http://enc-b:8000")
	if err := a.Unregister(ctx, "http://enc-a:8000"); err != nil {
		t.Fatal(err)
	}
	u.until(t, "http://enc-b:8000")
	ms, err := b.Members(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) != 1 || ms[0] != (Member{Name: "enc-b:8000", URL: "http://enc-b:8000", Source: "registered"}) {
		t.Fatalf("members %+v", ms)
	}
	// Another prefix is another registry.
	if got := regMembers(t, other); len(got) != 0 {
		t.Fatalf("prefix other: sees %v", got)
	}
}

// TestRegistryRedisBound: the bound is one bound across replicas.
func TestRegistryRedisBound(t *testing.T) { testRegistryBound(t, regStartServer(t)) }

func testRegistryBound(t *testing.T, sh *regShape) {
	cfg := regConfig(2, time.Minute)
	regTestBound(t, regRedisOn(t, sh, "t:", cfg, clock.Real{}), regRedisOn(t, sh, "t:", cfg, clock.Real{}))
}

// TestRegistryRedisBoundConcurrent: replicas registering distinct URLs at
// once never store more than the bound between them.
func TestRegistryRedisBoundConcurrent(t *testing.T) {
	testRegistryBoundConcurrent(t, regStartServer(t))
}

func testRegistryBoundConcurrent(t *testing.T, sh *regShape) {
	const max = 5
	cfg := regConfig(max, time.Minute)
	regs := []*Registry{regRedisOn(t, sh, "t:", cfg, clock.Real{}), regRedisOn(t, sh, "t:", cfg, clock.Real{})}
	var (
		wg           sync.WaitGroup
		mu           sync.Mutex
		ok, full     int
		unexpected   []error
		start        = make(chan struct{})
		perRegistry  = 20
		registryURLs = func(r, i int) string { return fmt.Sprintf("http://e-%d-%d:1", r, i) }
	)
	for ri, reg := range regs {
		for i := 0; i < perRegistry; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				err := reg.Register(context.Background(), registryURLs(ri, i))
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil:
					ok++
				case errors.Is(err, ErrFull):
					full++
				default:
					unexpected = append(unexpected, err)
				}
			}()
		}
	}
	close(start)
	wg.Wait()
	if len(unexpected) > 0 {
		t.Fatalf("errors: %v", unexpected)
	}
	if ok != max || full != 2*perRegistry-max {
		t.Fatalf("%d stored, %d full; want %d and %d", ok, full, max, 2*perRegistry-max)
	}
	if got := regMembers(t, regs[1]); len(got) != max {
		t.Fatalf("members %v", got)
	}
}

// TestRegistryRedisTTL: in Redis the TTL runs on Redis's clock, whatever
// the registry's (a fake one here, an hour behind): a registration's expiry
// is Redis's now plus the TTL, a refresh moves it, an unregistration leaves
// a tombstone for the TTL, bounded in number, that a new registration
// clears; members expired by Redis's clock neither list nor count.
func TestRegistryRedisTTL(t *testing.T) { testRegistryTTL(t, regStartServer(t)) }

func testRegistryTTL(t *testing.T, sh *regShape) {
	const ttl = time.Minute
	clk := clock.NewFake(time.Now().Add(-time.Hour))
	r := regRedisOn(t, sh, "t:", regConfig(2, ttl), clk)
	raw := sh.raw
	ctx := context.Background()
	const key = "t:bootstrap:encoders"
	t0 := regRedisNow(t, raw)
	if err := r.Register(ctx, "http://a:1"); err != nil {
		t.Fatal(err)
	}
	t1 := regRedisNow(t, raw)
	regScoreIn(t, raw, key, "http://a:1", t0+ttl.Milliseconds(), t1+ttl.Milliseconds())
	if err := r.Refresh(ctx, []string{"http://a:1"}); err != nil {
		t.Fatal(err)
	}
	t2 := regRedisNow(t, raw)
	regScoreIn(t, raw, key, "http://a:1", t1+ttl.Milliseconds(), t2+ttl.Milliseconds())
	pttl, err := raw.PTTL(ctx, key).Result()
	if err != nil {
		t.Fatal(err)
	}
	if pttl <= 0 || pttl > ttl+registryKeyGrace {
		t.Fatalf("key PTTL %v, want in (0, %v]", pttl, ttl+registryKeyGrace)
	}

	// An unregistration leaves a tombstone: the negated expiry.
	if err := r.Unregister(ctx, "http://a:1"); err != nil {
		t.Fatal(err)
	}
	t3 := regRedisNow(t, raw)
	regScoreIn(t, raw, key, "http://a:1", -(t3 + ttl.Milliseconds()), -(t2 + ttl.Milliseconds()))
	if got := regMembers(t, r); len(got) != 0 {
		t.Fatalf("members after unregister: %v", got)
	}
	// At most max (2) tombstones: a third replaces the one expiring first.
	// (Each a millisecond of Redis's clock after the last, so that their
	// expiries differ.)
	for _, u := range []string{"http://b:1", "http://c:1"} {
		regNextMilli(t, raw)
		if err := r.Unregister(ctx, u); err != nil {
			t.Fatal(err)
		}
	}
	gone, err := raw.ZRangeByScore(ctx, key, &redis.ZRangeBy{Min: "-inf", Max: "(0"}).Result()
	if err != nil {
		t.Fatal(err)
	}
	if !regSame(gone, "http://c:1", "http://b:1") {
		t.Fatalf("tombstones %v, want c and b (a's expires first)", gone)
	}
	// A new registration clears the tombstone.
	if err := r.Register(ctx, "http://b:1"); err != nil {
		t.Fatal(err)
	}
	if s, err := raw.ZScore(ctx, key, "http://b:1").Result(); err != nil || s <= 0 {
		t.Fatalf("b after registering again: %v %v", s, err)
	}
	if got := regMembers(t, r); !regSame(got, "http://b:1") {
		t.Fatalf("members %v", got)
	}

	// Members expired by Redis's clock (as an older replica, or a slower
	// clock, could leave them): not listed, not counted against the bound,
	// swept by the next write.
	now := regRedisNow(t, raw)
	if err := raw.ZAdd(ctx, key, redis.Z{Score: float64(now - 1), Member: "http://old:1"},
		redis.Z{Score: float64(-(now - 1)), Member: "http://oldgone:1"}).Err(); err != nil {
		t.Fatal(err)
	}
	l, err := NewRedisStore(raw, "t:").List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(l.Live) != 1 || l.Live[0].URL != "http://b:1" || l.Live[0].Left <= 0 || l.Live[0].Left > ttl || !regSame(l.Gone, "http://c:1") {
		t.Fatalf("listing %+v", l)
	}
	if err := r.Register(ctx, "http://d:1"); err != nil {
		t.Fatalf("second of two with an expired member stored: %v", err)
	}
	for _, u := range []string{"http://old:1", "http://oldgone:1"} {
		if err := raw.ZScore(ctx, key, u).Err(); !errors.Is(err, redis.Nil) {
			t.Fatalf("%s not swept: %v", u, err)
		}
	}
	if err := r.Register(ctx, "http://e:1"); !errors.Is(err, ErrFull) {
		t.Fatalf("third: %v, want ErrFull", err)
	}
}

// regRaw returns a plain client on srv, to look at the set.
func regRaw(t *testing.T, srv *redistest.Server) *redis.Client {
	t.Helper()
	raw := redis.NewClient(&redis.Options{Addr: srv.Addr(), DisableIdentity: true})
	t.Cleanup(func() { _ = raw.Close() })
	return raw
}

// regRedisNow returns Redis's clock, unix ms.
func regRedisNow(t *testing.T, raw redis.UniversalClient) int64 {
	t.Helper()
	now, err := raw.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	return now.UnixMilli()
}

// regNextMilli returns once Redis's clock has moved on by a millisecond.
func regNextMilli(t *testing.T, raw redis.UniversalClient) {
	t.Helper()
	for start := regRedisNow(t, raw); regRedisNow(t, raw) == start; {
	}
}

// regScoreIn fails unless url's score in key is within [lo, hi]: an expiry
// taken from Redis's clock between two readings of it.
func regScoreIn(t *testing.T, raw redis.UniversalClient, key, url string, lo, hi int64) {
	t.Helper()
	s, err := raw.ZScore(context.Background(), key, url).Result()
	if err != nil {
		t.Fatalf("%s: %v", url, err)
	}
	if int64(s) < lo || int64(s) > hi {
		t.Fatalf("%s: score %d, want in [%d, %d] (Redis's clock)", url, int64(s), lo, hi)
	}
}

// TestBootstrapRedisDown: with Redis gone, Register fails with the store's
// error (not ErrFull or ErrInvalidURL), and the handler answers 503.
func TestBootstrapRedisDown(t *testing.T) {
	srv := redistest.Start(t)
	r := regRedis(t, srv, "t:", regConfig(2, time.Minute), clock.Real{})
	ctx := context.Background()
	if err := r.Register(ctx, "http://a:1"); err != nil {
		t.Fatal(err)
	}
	base := serveBootstrap(t, r, zap.NewNop())
	srv.Kill()
	err := r.Register(ctx, "http://b:1")
	if err == nil || errors.Is(err, ErrFull) || errors.Is(err, ErrInvalidURL) {
		t.Fatalf("register with redis down: %v", err)
	}
	for _, c := range []struct{ method, path, body string }{
		{"POST", "/register_encoder_url", `{"url":"http://b:1"}`},
		{"DELETE", "/unregister_encoder_url", `{"url":"http://a:1"}`},
		{"GET", "/list_encoder_urls", ""},
	} {
		a := bsCall(t, c.method, base+c.path, c.body)
		if a.status != 503 || !strings.HasPrefix(a.body, `{"error":"registration store unavailable: `) {
			t.Errorf("%s %s with redis down: %d %s", c.method, c.path, a.status, a.body)
		}
	}
	// A bad request is still the caller's fault, whatever the store's state.
	if a := bsCall(t, "POST", base+"/register_encoder_url", `{}`); a.status != 400 {
		t.Errorf("missing url with redis down: %d", a.status)
	}
	srv.Restart()
	if err := r.Register(ctx, "http://b:1"); err != nil {
		t.Fatalf("after restart: %v", err)
	}
}
