package idempotency

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/redistest"
)

// pingCounter counts the PINGs a client sends.
type pingCounter struct{ n atomic.Int64 }

func (*pingCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (*pingCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (p *pingCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if strings.EqualFold(cmd.Name(), "ping") {
			p.n.Add(1)
		}
		return next(ctx, cmd)
	}
}

// TestRedisHealth: the store learns Redis's state from its own calls and,
// when it makes none for HealthPingInterval, from one PING per interval on
// its clock: a busy store sends no PING, an idle one one per interval.
// Redis killed mid-test reads down (the failing call named), and up again
// after its restart.
func TestRedisHealth(t *testing.T) {
	srv := redistest.Start(t)
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	r := newRedisStore(t, srv, redisOpts{clk: clk})
	pings := &pingCounter{}
	r.c.AddHook(pings)
	ctx := context.Background()
	k := Key{ReqID: "health", Dest: "h:1"}
	const iv = HealthPingInterval

	if h := r.Health(); h.Up || !errors.Is(h.Err, errNotContacted) {
		t.Fatalf("before any call: %+v, want down, not contacted", h)
	}
	if _, _, _, err := r.Lookup(ctx, k); err != nil {
		t.Fatal(err)
	}
	if h := r.Health(); !h.Up || h.Err != nil || !h.Since.Equal(clk.Now()) {
		t.Fatalf("after a lookup Redis answered: %+v, want up since %v", h, clk.Now())
	}

	// tick moves the clock by d and waits until the watcher has done its
	// round (pinged or not) and waits again.
	tick := func(d time.Duration) {
		t.Helper()
		created := clk.TimerCreated()
		clk.Advance(d)
		select {
		case <-created:
		case <-time.After(hangGuard):
			t.Fatal("the health watcher did not wait again")
		}
	}
	created := clk.TimerCreated()
	r.startHealth(iv)
	<-created

	// Busy: a call half way through the interval; the watcher's round
	// finds it and sends nothing.
	clk.Advance(iv / 2)
	if _, _, _, err := r.Lookup(ctx, k); err != nil {
		t.Fatal(err)
	}
	tick(iv / 2)
	if n := pings.n.Load(); n != 0 {
		t.Errorf("%d PINGs while the store's own calls were answered, want 0", n)
	}

	// Idle and Redis gone: the next round's PING fails.
	srv.Kill()
	tick(iv)
	h := r.Health()
	if h.Up || !errors.Is(h.Err, ErrUnavailable) || !strings.Contains(h.Err.Error(), "redis ping") || !h.Since.Equal(clk.Now()) {
		t.Fatalf("Redis killed, a PING round later: %+v, want down since %v on the ping", h, clk.Now())
	}
	if n := pings.n.Load(); n != 1 {
		t.Errorf("%d PINGs in one idle interval, want 1", n)
	}
	downSince := h.Since

	// Still down: one PING a round, the state and its start unchanged.
	tick(iv)
	if h := r.Health(); h.Up || !h.Since.Equal(downSince) {
		t.Errorf("still down: %+v, want down since %v", h, downSince)
	}
	if n := pings.n.Load(); n != 2 {
		t.Errorf("%d PINGs in two idle intervals, want 2", n)
	}

	// Back: the next PING is answered.
	srv.Restart()
	tick(iv)
	if h := r.Health(); !h.Up || h.Err != nil || !h.Since.Equal(clk.Now()) {
		t.Fatalf("Redis restarted, a PING round later: %+v, want up since %v", h, clk.Now())
	}

	// A call's failure says so at once, without waiting for a PING.
	srv.Kill()
	if _, _, _, err := r.Lookup(ctx, k); err == nil {
		t.Fatal("a lookup succeeded with Redis killed")
	}
	if h := r.Health(); h.Up || !strings.Contains(h.Err.Error(), "redis lookup") {
		t.Fatalf("after a failed lookup: %+v, want down on the lookup", h)
	}
	srv.Restart()
	if _, _, _, err := r.Lookup(ctx, k); err != nil {
		t.Fatal(err)
	}
	if h := r.Health(); !h.Up {
		t.Fatalf("after a lookup Redis answered again: %+v, want up", h)
	}

	// The caller's own deadline says nothing of Redis.
	done, cancel := context.WithCancel(ctx)
	cancel()
	_, _, _, _ = r.Lookup(done, k)
	if h := r.Health(); !h.Up {
		t.Errorf("after a lookup whose caller had gone: %+v, want still up", h)
	}
}
