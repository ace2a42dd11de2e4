package discovery

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/redistest"
)

// regLossyStore is a memory store that can fail (a store that cannot be
// reached) and lose everything (a Redis that restarts empty).
type regLossyStore struct {
	clk     clock.Clock
	mu      sync.Mutex
	inner   Store
	failing bool
}

func newRegLossyStore(clk clock.Clock) *regLossyStore {
	return &regLossyStore{clk: clk, inner: NewMemoryStore(clk)}
}

func (s *regLossyStore) fail(on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failing = on
}

func (s *regLossyStore) lose() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.inner = NewMemoryStore(s.clk)
}

func (s *regLossyStore) get() (Store, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.failing {
		return nil, errors.New("down")
	}
	return s.inner, nil
}

func (s *regLossyStore) Add(ctx context.Context, url string, ttl time.Duration, room Room) (AddResult, error) {
	st, err := s.get()
	if err != nil {
		return AddResult{}, err
	}
	return st.Add(ctx, url, ttl, room)
}

func (s *regLossyStore) Refresh(ctx context.Context, urls []string, ttl time.Duration, max int) ([]RefreshOutcome, error) {
	st, err := s.get()
	if err != nil {
		return nil, err
	}
	return st.Refresh(ctx, urls, ttl, max)
}

func (s *regLossyStore) Remove(ctx context.Context, url string, ttl time.Duration, max int) error {
	st, err := s.get()
	if err != nil {
		return err
	}
	return st.Remove(ctx, url, ttl, max)
}

func (s *regLossyStore) List(ctx context.Context) (Listing, error) {
	st, err := s.get()
	if err != nil {
		return Listing{}, err
	}
	return st.List(ctx)
}

// stored returns the URLs the store holds live.
func (s *regLossyStore) stored(t *testing.T) []string {
	t.Helper()
	l, err := s.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	out := make([]string, len(l.Live))
	for i, e := range l.Live {
		out[i] = e.URL
	}
	return out
}

// TestRegistryReassertsWhatTheStoreLost: after the store loses everything
// the registry still serves what it saw, re-asserts on Refresh those it
// is asked to (the healthy ones) and no other, and lets the others go when
// their known end passes. An outage longer than the TTL does not end the
// healthy ones: their ends move on with each failed refresh.
func TestRegistryReassertsWhatTheStoreLost(t *testing.T) {
	clk := clock.NewFake(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	st := newRegLossyStore(clk)
	r := NewRegistry(regConfig(4, time.Minute), st, clk, zap.NewNop())
	ctx := context.Background()
	for _, u := range []string{"http://e1:1", "http://e2:1"} {
		if err := r.Register(ctx, u); err != nil {
			t.Fatal(err)
		}
	}
	st.lose()
	if got := regMembers(t, r); !regSame(got, "http://e1:1", "http://e2:1") {
		t.Fatalf("after the store lost them: %v", got)
	}
	clk.Advance(30 * time.Second)
	if err := r.Refresh(ctx, []string{"http://e1:1", "http://never:1"}); err != nil {
		t.Fatal(err)
	}
	if got := st.stored(t); !regSame(got, "http://e1:1") {
		t.Fatalf("stored after the refresh: %v, want e1 re-asserted and nothing invented", got)
	}
	// e2 was not refreshed (not healthy): it leaves at the end it had.
	clk.Advance(30*time.Second - time.Millisecond)
	if got := regMembers(t, r); !regSame(got, "http://e1:1", "http://e2:1") {
		t.Fatalf("just before e2's end: %v", got)
	}
	clk.Advance(time.Millisecond)
	if got := regMembers(t, r); !regSame(got, "http://e1:1") {
		t.Fatalf("at e2's end: %v", got)
	}
	if err := r.Refresh(ctx, []string{"http://e1:1", "http://e2:1"}); err != nil {
		t.Fatal(err)
	}
	if got := st.stored(t); !regSame(got, "http://e1:1") {
		t.Fatalf("e2 re-asserted after its end: %v", got)
	}

	// An outage of three half-TTLs, refreshes failing; the store then
	// comes back empty.
	st.fail(true)
	for i := 0; i < 3; i++ {
		clk.Advance(30 * time.Second)
		if err := r.Refresh(ctx, []string{"http://e1:1"}); err == nil {
			t.Fatal("refresh with the store down: no error")
		}
	}
	st.lose()
	st.fail(false)
	if got := regMembers(t, r); !regSame(got, "http://e1:1") {
		t.Fatalf("after an outage longer than the TTL: %v", got)
	}
	if err := r.Refresh(ctx, []string{"http://e1:1"}); err != nil {
		t.Fatal(err)
	}
	if got := st.stored(t); !regSame(got, "http://e1:1") {
		t.Fatalf("stored after the outage: %v", got)
	}
}

// regRetry runs f until it succeeds, failing the test if it has not within
// regGuard: for the first calls after a restart (a pooled connection may
// still be the dead server's), and to wait for Redis's clock.
func regRetry(t *testing.T, what string, f func() error) {
	t.Helper()
	deadline := time.Now().Add(regGuard)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v", what, err)
		}
		time.Sleep(5 * time.Millisecond) // polling: nothing signals Redis's clock passing a point
	}
}

// regEventuallyMembers returns once r's members are want.
func regEventuallyMembers(t *testing.T, r *Registry, what string, want ...string) {
	t.Helper()
	regRetry(t, what, func() error {
		ms, err := r.Members(context.Background())
		if err != nil {
			return err
		}
		if got := regURLs(ms); !regSame(got, want...) {
			return fmt.Errorf("members %v, want %v", got, want)
		}
		return nil
	})
}

// TestRegistryRedisRestartReasserts: Redis restarts empty under two
// replicas. Both keep serving the encoder one of them registered; the
// refresh of either puts it back, for every replica, including a third
// that never saw it and cannot invent it.
func TestRegistryRedisRestartReasserts(t *testing.T) {
	srv := redistest.Start(t)
	cfg := regConfig(8, time.Minute)
	a := regRedis(t, srv, "t:", cfg, clock.Real{})
	b := regRedis(t, srv, "t:", cfg, clock.Real{})
	raw := regRaw(t, srv)
	ctx := context.Background()
	const enc = "http://enc:1"
	if err := b.Register(ctx, enc); err != nil {
		t.Fatal(err)
	}
	if got := regMembers(t, a); !regSame(got, enc) {
		t.Fatalf("replica a: %v", got)
	}

	srv.Restart()
	for name, r := range map[string]*Registry{"a": a, "b": b} {
		regEventuallyMembers(t, r, "replica "+name+" after the restart", enc)
	}
	c := regRedis(t, srv, "t:", cfg, clock.Real{})
	if got := regMembers(t, c); len(got) != 0 {
		t.Fatalf("replica c, which never saw it: %v", got)
	}
	if err := c.Refresh(ctx, []string{enc}); err != nil {
		t.Fatal(err)
	}
	if n, err := raw.Exists(ctx, "t:bootstrap:encoders").Result(); err != nil || n != 0 {
		t.Fatalf("after replica c's refresh the set exists (%d, %v): c invented the registration", n, err)
	}

	regRetry(t, "replica a's refresh", func() error { return a.Refresh(ctx, []string{enc}) })
	if s, err := raw.ZScore(ctx, "t:bootstrap:encoders", enc).Result(); err != nil || s <= 0 {
		t.Fatalf("after replica a's refresh: %v %v", s, err)
	}
	for name, r := range map[string]*Registry{"a": a, "b": b, "c": c} {
		if got := regMembers(t, r); !regSame(got, enc) {
			t.Fatalf("replica %s after the re-assert: %v", name, got)
		}
	}
}

// TestRegistryRedisUnregisterStaysOut: an encoder that unregisters on one
// replica is not re-asserted by another that still serves it, even when
// Redis lost it before the unregistration; registering again brings it
// back.
func TestRegistryRedisUnregisterStaysOut(t *testing.T) {
	srv := redistest.Start(t)
	cfg := regConfig(8, time.Minute)
	a := regRedis(t, srv, "t:", cfg, clock.Real{})
	b := regRedis(t, srv, "t:", cfg, clock.Real{})
	raw := regRaw(t, srv)
	ctx := context.Background()
	const enc = "http://enc:1"
	if err := a.Register(ctx, enc); err != nil {
		t.Fatal(err)
	}
	if got := regMembers(t, b); !regSame(got, enc) {
		t.Fatalf("replica b: %v", got)
	}
	srv.Restart()
	regRetry(t, "unregistering on b", func() error { return b.Unregister(ctx, enc) })
	// a has not read Redis since: it still serves enc, and refreshes it.
	regRetry(t, "refreshing on a", func() error { return a.Refresh(ctx, []string{enc}) })
	if s, err := raw.ZScore(ctx, "t:bootstrap:encoders", enc).Result(); err != nil || s >= 0 {
		t.Fatalf("after a's refresh: score %v (%v), want the tombstone", s, err)
	}
	for name, r := range map[string]*Registry{"a": a, "b": b} {
		if got := regMembers(t, r); len(got) != 0 {
			t.Fatalf("replica %s after the unregistration: %v", name, got)
		}
	}
	// A new registration (on either) clears the tombstone.
	if err := b.Register(ctx, enc); err != nil {
		t.Fatal(err)
	}
	for name, r := range map[string]*Registry{"a": a, "b": b} {
		if got := regMembers(t, r); !regSame(got, enc) {
			t.Fatalf("replica %s after registering again: %v", name, got)
		}
	}
	if err := a.Refresh(ctx, []string{enc}); err != nil {
		t.Fatal(err)
	}
	if s, err := raw.ZScore(ctx, "t:bootstrap:encoders", enc).Result(); err != nil || s <= 0 {
		t.Fatalf("refreshed after registering again: %v %v", s, err)
	}
}

// TestRegistryRedisRefreshRacesUnregister: a replica re-asserting from its
// view while another takes the registration back, at once, many times:
// the unregistration always wins, whichever runs first.
func TestRegistryRedisRefreshRacesUnregister(t *testing.T) {
	testRegistryRefreshRacesUnregister(t, regStartServer(t))
}

func testRegistryRefreshRacesUnregister(t *testing.T, sh *regShape) {
	cfg := regConfig(64, time.Minute)
	a := regRedisOn(t, sh, "t:", cfg, clock.Real{})
	b := regRedisOn(t, sh, "t:", cfg, clock.Real{})
	raw := sh.raw
	ctx := context.Background()
	for i := 0; i < 32; i++ {
		u := fmt.Sprintf("http://e%d:1", i)
		if err := b.Register(ctx, u); err != nil {
			t.Fatal(err)
		}
		if got := regMembers(t, a); !slices.Contains(got, u) {
			t.Fatalf("a does not see %s: %v", u, got)
		}
		if i%2 == 0 { // Redis lost it: a's refresh is a re-assert
			if err := raw.ZRem(ctx, "t:bootstrap:encoders", u).Err(); err != nil {
				t.Fatal(err)
			}
		}
		var wg sync.WaitGroup
		errs := make([]error, 2)
		wg.Add(2)
		go func() { defer wg.Done(); errs[0] = a.Refresh(ctx, []string{u}) }()
		go func() { defer wg.Done(); errs[1] = b.Unregister(ctx, u) }()
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		if s, err := raw.ZScore(ctx, "t:bootstrap:encoders", u).Result(); err != nil || s >= 0 {
			t.Fatalf("%s: score %v (%v), want the tombstone", u, s, err)
		}
	}
	if got := regMembers(t, a); len(got) != 0 {
		t.Fatalf("replica a: %v", got)
	}
}

// regSkewedClock is the real clock read off by a fixed offset: a replica
// whose clock is set wrong.
type regSkewedClock struct{ off time.Duration }

func (c regSkewedClock) Now() time.Time                       { return time.Now().Add(c.off) }
func (c regSkewedClock) NewTimer(d time.Duration) clock.Timer { return clock.Real{}.NewTimer(d) }
func (c regSkewedClock) AfterFunc(d time.Duration, f func()) clock.Timer {
	return clock.Real{}.AfterFunc(d, f)
}

// TestRegistryRedisClockSkew: replicas whose clocks are more than the TTL
// ahead and behind agree with one on time: expiries are Redis's now plus
// the TTL whoever writes them, nobody's registration is swept as expired by
// a replica ahead or kept by one behind, and a short registration ends for
// every replica once Redis's clock passes it.
func TestRegistryRedisClockSkew(t *testing.T) { testRegistryClockSkew(t, regStartServer(t)) }

func testRegistryClockSkew(t *testing.T, sh *regShape) {
	const ttl = time.Minute
	cfg := regConfig(8, ttl)
	onTime := regRedisOn(t, sh, "t:", cfg, clock.Real{})
	ahead := regRedisOn(t, sh, "t:", cfg, regSkewedClock{2 * ttl})
	behind := regRedisOn(t, sh, "t:", cfg, regSkewedClock{-2 * ttl})
	replicas := map[string]*Registry{"on time": onTime, "ahead": ahead, "behind": behind}
	raw := sh.raw
	ctx := context.Background()
	const key = "t:bootstrap:encoders"
	all := []string{"http://ahead:1", "http://behind:1", "http://ontime:1"}

	t0 := regRedisNow(t, raw)
	for u, r := range map[string]*Registry{all[0]: ahead, all[1]: behind, all[2]: onTime} {
		if err := r.Register(ctx, u); err != nil {
			t.Fatal(err)
		}
	}
	t1 := regRedisNow(t, raw)
	for _, u := range all {
		regScoreIn(t, raw, key, u, t0+ttl.Milliseconds(), t1+ttl.Milliseconds())
	}
	for name, r := range replicas {
		if got := regMembers(t, r); !regSame(got, all...) {
			t.Fatalf("replica %s: %v", name, got)
		}
	}
	for _, r := range []*Registry{ahead, behind} {
		if err := r.Refresh(ctx, all); err != nil {
			t.Fatal(err)
		}
	}
	t2 := regRedisNow(t, raw)
	for _, u := range all {
		regScoreIn(t, raw, key, u, t1+ttl.Milliseconds(), t2+ttl.Milliseconds())
	}

	// Short registrations, through the replica on time and the one ahead,
	// end for every replica once Redis's clock passes them, not before.
	// Each replica first sees one live (on a machine too slow to list one
	// within its TTL, the next is tried).
	short := regConfig(8, 500*time.Millisecond)
	through := []*Registry{regRedisOn(t, sh, "t:", short, clock.Real{}), regRedisOn(t, sh, "t:", short, regSkewedClock{2 * ttl})}
	var lastEnd int64
	n := 0
	for _, name := range []string{"ahead", "behind", "on time"} {
		regRetry(t, "replica "+name+" seeing a short registration", func() error {
			u := fmt.Sprintf("http://short%d:1", n)
			if err := through[n%2].Register(ctx, u); err != nil {
				return err
			}
			n++
			s, err := raw.ZScore(ctx, key, u).Result()
			if err != nil {
				return err
			}
			lastEnd = max(lastEnd, int64(s))
			if got := regMembers(t, replicas[name]); !slices.Contains(got, u) {
				return fmt.Errorf("%s not listed: %v", u, got)
			}
			return nil
		})
	}
	for name, r := range replicas {
		regEventuallyMembers(t, r, "replica "+name+" after the short registrations", all...)
		if now := regRedisNow(t, raw); now < lastEnd {
			t.Fatalf("replica %s dropped the short registrations at Redis time %d, before the last ends at %d", name, now, lastEnd)
		}
	}
	for _, u := range all {
		if s, err := raw.ZScore(ctx, key, u).Result(); err != nil || s <= 0 {
			t.Fatalf("%s: %v %v", u, s, err)
		}
	}
}

// TestMemoryStoreTombstones: the memory store keeps tombstones as Redis
// does: a refresh from a registry that still serves an unregistered URL
// does not bring it back, at most max are kept (the one expiring first
// makes room), they end after the TTL, and a registration clears one.
func TestMemoryStoreTombstones(t *testing.T) {
	clk := clock.NewFake(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	st := NewMemoryStore(clk)
	cfg := regConfig(2, time.Minute)
	a := NewRegistry(cfg, st, clk, zap.NewNop())
	b := NewRegistry(cfg, st, clk, zap.NewNop())
	ctx := context.Background()
	if err := a.Register(ctx, "http://x:1"); err != nil {
		t.Fatal(err)
	}
	if got := regMembers(t, b); !regSame(got, "http://x:1") {
		t.Fatalf("b: %v", got)
	}
	if err := a.Unregister(ctx, "http://x:1"); err != nil {
		t.Fatal(err)
	}
	if err := b.Refresh(ctx, []string{"http://x:1"}); err != nil {
		t.Fatal(err)
	}
	for _, u := range []string{"http://y:1", "http://z:1"} {
		clk.Advance(time.Second)
		if err := a.Unregister(ctx, u); err != nil {
			t.Fatal(err)
		}
	}
	l, err := st.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(l.Live) != 0 || !regSame(l.Gone, "http://y:1", "http://z:1") {
		t.Fatalf("listing %+v, want no live URL and the tombstones of y and z", l)
	}
	if err := b.Register(ctx, "http://y:1"); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Minute)
	if l, err = st.List(ctx); err != nil || len(l.Gone) != 0 || len(l.Live) != 0 {
		t.Fatalf("a TTL later: %+v %v", l, err)
	}
}
