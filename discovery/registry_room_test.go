package discovery

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
)

// roomClock is how a room test moves the store's clock: step by at least a
// millisecond (so that registrations are ordered), or past the window.
type roomClock struct {
	step func()
	pass func()
}

// roomMust registers u and fails unless it evicted evicted ("" for none),
// for reason (counted, when r has metrics).
func roomMust(t *testing.T, r *Registry, u, evicted string, reason EvictReason) {
	t.Helper()
	ctx := context.Background()
	evictions := map[EvictReason]float64{}
	if r.m.evictions != nil {
		for _, why := range []EvictReason{EvictNeverPassed, EvictFailing} {
			evictions[why] = testutil.ToFloat64(r.m.evictions.WithLabelValues(why.String()))
		}
	}
	r.mu.Lock()
	before := make(map[string]bool, len(r.view))
	for v := range r.view {
		before[v] = true
	}
	r.mu.Unlock()
	if err := r.Register(ctx, u); err != nil {
		t.Fatalf("register %s: %v", u, err)
	}
	l, err := r.store.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	gone := map[string]bool{}
	for _, g := range l.Gone {
		gone[g] = true
	}
	live := map[string]bool{}
	for _, e := range l.Live {
		live[e.URL] = true
	}
	for v := range before {
		switch {
		case v == evicted && (live[v] || !gone[v]):
			t.Fatalf("register %s: %s should have made room (a tombstone), live %v gone %v", u, v, live[v], gone[v])
		case v != evicted && !live[v]:
			t.Fatalf("register %s evicted %s, want %q", u, v, evicted)
		}
	}
	if evicted != "" {
		if m := regMembers(t, r); strings.Contains(strings.Join(m, " "), evicted) {
			t.Fatalf("members after evicting %s: %v", evicted, m)
		}
		if r.m.evictions == nil {
		} else if got := testutil.ToFloat64(r.m.evictions.WithLabelValues(reason.String())); got != evictions[reason]+1 {
			t.Fatalf("register %s: evictions{reason=%s} = %v, want %v", u, reason, got, evictions[reason]+1)
		}
	}
}

// roomFull registers u and fails unless it is refused as full with
// unchecked registrations still in their grace.
func roomFull(t *testing.T, r *Registry, u string, unchecked int) *FullError {
	t.Helper()
	err := r.Register(context.Background(), u)
	var full *FullError
	if !errors.Is(err, ErrFull) || !errors.As(err, &full) {
		t.Fatalf("register %s: %v, want a *FullError", u, err)
	}
	if full.Unchecked != unchecked || full.Max != r.cfg.MaxEncoders || full.Window != r.window {
		t.Fatalf("register %s: %+v, want %d unchecked", u, full, unchecked)
	}
	return full
}

func roomRefresh(t *testing.T, r *Registry, urls ...string) {
	t.Helper()
	if err := r.Refresh(context.Background(), urls); err != nil {
		t.Fatal(err)
	}
}

// testRegistryRoom: at the bound a new registration takes the place of
// one that never passed a health check within its grace (the oldest
// registration first), then of one that has not passed for the window (the
// one failing longest); an entry within its grace, or that passed within
// the window, is never a victim, and a registry full of those refuses,
// saying why. An evicted URL that registers again is new: it cannot push
// out the newcomer that took its place.
func testRegistryRoom(t *testing.T, r *Registry, reg *prometheus.Registry, c roomClock) {
	const (
		n1, n2, p1 = "http://n1:1", "http://n2:1", "http://p1:1"
		x, y, z    = "http://x:1", "http://y:1", "http://z:1"
	)
	roomMust(t, r, n1, "", 0)
	c.step()
	roomMust(t, r, n2, "", 0)
	c.step()
	roomMust(t, r, p1, "", 0)
	roomRefresh(t, r, p1) // p1 passes its checks; n1 and n2 never do
	roomFull(t, r, x, 2)  // n1 and n2 are within their grace

	c.pass()
	roomMust(t, r, n1, "", 0) // registering again while live keeps its registration time
	roomRefresh(t, r, p1)
	roomMust(t, r, x, n1, EvictNeverPassed) // the oldest that never passed
	// n1, a dead URL that registers again, is new: it takes the place of
	// n2 (past its grace), never of x (within it).
	roomMust(t, r, n1, n2, EvictNeverPassed)
	full := roomFull(t, r, n2, 2) // n1 and x in their grace, p1 passing
	if msg := full.Error(); !strings.Contains(msg, "bootstrap.max_encoders 3 registered encoders: 2 registered less than") {
		t.Fatalf("refusal %q", msg)
	}
	roomRefresh(t, r, x)
	roomFull(t, r, n2, 1) // x passes now: only n1 is unchecked

	c.pass()
	// n1 is past its grace; x and p1 have not passed for the window, and
	// p1 passes again now. Never passed goes first, though x fails longer.
	roomRefresh(t, r, p1)
	roomMust(t, r, n2, n1, EvictNeverPassed)
	roomMust(t, r, y, x, EvictFailing)
	if m := regMembers(t, r); !regSame(m, n2, p1, y) {
		t.Fatalf("members %v, want n2 p1 y", m)
	}
	roomRefresh(t, r, p1, n2, y)
	full = roomFull(t, r, z, 0)
	if msg := full.Error(); !strings.HasPrefix(msg, "bootstrap.max_encoders 3 registered encoders, all passing health checks") {
		t.Fatalf("refusal %q", msg)
	}
	// Registering one that is there is no new registration: never refused.
	roomMust(t, r, n2, "", 0)

	for _, w := range []struct {
		metric, reason string
		n              float64
	}{
		{"encgate_bootstrap_evictions_total", "never_passed", 3},
		{"encgate_bootstrap_evictions_total", "failing", 1},
		{"encgate_bootstrap_registrations_refused_total", "full_unchecked", 3},
		{"encgate_bootstrap_registrations_refused_total", "full_all_passing", 1},
	} {
		if got := roomCounter(t, reg, w.metric, w.reason); got != w.n {
			t.Errorf("%s{reason=%q} = %v, want %v", w.metric, w.reason, got, w.n)
		}
	}
}

func roomCounter(t *testing.T, reg *prometheus.Registry, name, reason string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" && l.GetValue() == reason {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	t.Fatalf("no %s{reason=%q}", name, reason)
	return 0
}

func TestRegistryRoomMemory(t *testing.T) {
	const window = 10 * time.Second
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	reg := prometheus.NewRegistry()
	r := NewRegistry(regConfig(3, time.Minute), NewMemoryStore(clk), clk, zap.NewNop(), WithRoom(window), WithMetrics(reg))
	testRegistryRoom(t, r, reg, roomClock{
		step: func() { clk.Advance(time.Millisecond) },
		pass: func() { clk.Advance(window) },
	})
}

// roomRedisClock moves on with Redis's clock, which the Redis store's
// scripts read: pass waits until window has passed since the last write.
func roomRedisClock(t *testing.T, sh *regShape, window time.Duration) roomClock {
	return roomClock{
		step: func() { regNextMilli(t, sh.raw) },
		pass: func() {
			until := regRedisNow(t, sh.raw) + window.Milliseconds()
			regRetry(t, "Redis's clock passing the window", func() error {
				if regRedisNow(t, sh.raw) < until {
					return errors.New("not yet")
				}
				return nil
			})
		},
	}
}

// TestRegistryRoomRedis: the same on Redis, whose clock decides the grace
// and the window; the registrations' health facts are shared (a second
// replica's refresh protects an encoder the first never saw pass).
func TestRegistryRoomRedis(t *testing.T) { testRegistryRoomRedis(t, regStartServer(t)) }

func testRegistryRoomRedis(t *testing.T, sh *regShape) {
	const window = time.Second
	clk := clock.Real{}
	reg := prometheus.NewRegistry()
	r := NewRegistry(regConfig(3, time.Minute), NewRedisStore(sh.client(t), "room:"), clk, zap.NewNop(), WithRoom(window), WithMetrics(reg))
	testRegistryRoom(t, r, reg, roomRedisClock(t, sh, window))

	// Another replica saw p1 and y pass (its refresh), this one n2: all
	// three are passing for both, and neither makes room.
	other := NewRegistry(regConfig(3, time.Minute), NewRedisStore(sh.client(t), "room:"), clk, zap.NewNop(), WithRoom(window))
	regMembers(t, other) // its view: what Redis lists
	roomRedisClock(t, sh, window).pass()
	roomRefresh(t, other, "http://p1:1", "http://y:1")
	roomRefresh(t, r, "http://n2:1")
	roomFull(t, r, "http://z:1", 0)
	roomFull(t, other, "http://z:1", 0)

	// The health facts live in a second key, in the first one's slot.
	ctx := context.Background()
	checks := sameSlotKey("room:bootstrap:encoders", registryChecksSuffix)
	if n, err := sh.raw.ZCard(ctx, checks).Result(); err != nil || n != 3 {
		t.Fatalf("%s holds %d members (%v), want 3", checks, n, err)
	}
	if ttl, err := sh.raw.PTTL(ctx, checks).Result(); err != nil || ttl <= 0 {
		t.Fatalf("%s PTTL %v %v, want an expiry", checks, ttl, err)
	}
	// An unregistration drops them with the registration.
	if err := r.Unregister(ctx, "http://y:1"); err != nil {
		t.Fatal(err)
	}
	if err := sh.raw.ZScore(ctx, checks, "http://y:1").Err(); err == nil {
		t.Fatalf("y's health facts outlived its unregistration")
	}
}

// TestRegistryNoRoomWithoutWindow: without WithRoom the registry refuses
// at the bound as before, whatever the health facts.
func TestRegistryNoRoomWithoutWindow(t *testing.T) {
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	r := NewRegistry(regConfig(1, time.Minute), NewMemoryStore(clk), clk, zap.NewNop())
	roomMust(t, r, "http://a:1", "", 0)
	clk.Advance(30 * time.Second)
	err := r.Register(context.Background(), "http://b:1")
	if !errors.Is(err, ErrFull) || !strings.HasPrefix(err.Error(), "bootstrap.max_encoders encoders are registered (1)") {
		t.Fatalf("register at the bound without room: %v", err)
	}
}

// TestRegistryFullOfHealthyAnswers503: the bootstrap API's answer to a
// registration the registry refuses because every encoder passes: 503,
// Retry-After, and the bound in the message.
func TestRegistryFullOfHealthyAnswers503(t *testing.T) {
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	r := NewRegistry(regConfig(2, time.Minute), NewMemoryStore(clk), clk, zap.NewNop(), WithRoom(time.Second))
	roomMust(t, r, "http://a:1", "", 0)
	roomMust(t, r, "http://b:1", "", 0)
	clk.Advance(2 * time.Second)
	roomRefresh(t, r, "http://a:1", "http://b:1")
	base := serveBootstrap(t, r, zap.NewNop())
	a := bsCall(t, "POST", base+"/register_encoder_url", `{"url":"http://c:1"}`)
	want := bsErrorBody("bootstrap.max_encoders 2 registered encoders, all passing health checks; " +
		"one can register once another unregisters, or fails its health checks for 1s")
	if a.status != 503 || a.header.Get("Retry-After") != "5" || a.body != want {
		t.Fatalf("register when full of healthy: %d Retry-After=%q %s, want 503 5 %s", a.status, a.header.Get("Retry-After"), a.body, want)
	}
}

// TestSameSlotKey: the checks key hashes to the set's slot, by a hash tag
// of its own, or by the prefix's when it has one; every slot has a tag.
func TestSameSlotKey(t *testing.T) {
	if got := clusterSlot("123456789"); got != 0x31c3 { // the CRC16 check value, as in the Cluster spec
		t.Fatalf("slot of 123456789 = %#x", got)
	}
	for key, tag := range map[string]string{"{user1000}.following": "user1000", "foo{bar}{zap}": "bar",
		"foo{}{bar}": "foo{}{bar}", "foo{bar": "foo{bar", "plain": "plain"} {
		if got := hashTag(key); got != tag {
			t.Errorf("hashTag(%q) = %q, want %q", key, got, tag)
		}
	}
	for _, key := range []string{"bootstrap:encoders", "p:bootstrap:encoders", "encgate:bootstrap:encoders"} {
		k := sameSlotKey(key, ":checks")
		if !strings.HasPrefix(k, key+":checks{") || clusterSlot(k) != clusterSlot(key) {
			t.Fatalf("%s -> %s: slots %d and %d", key, k, clusterSlot(key), clusterSlot(k))
		}
	}
	if k := sameSlotKey("{eg}:bootstrap:encoders", ":checks"); k != "{eg}:bootstrap:encoders:checks" {
		t.Fatalf("with the prefix's hash tag: %s", k)
	}
	seen := make(map[uint16]bool, 16384)
	for i := 0; len(seen) < 16384; i++ {
		if i > 1<<20 {
			t.Fatalf("only %d slots have a decimal tag below %d", len(seen), i)
		}
		seen[clusterSlot(strconv.Itoa(i))] = true
	}
}
