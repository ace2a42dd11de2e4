package faultproxy

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/encgate/encgate/internal/redistest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// hangGuard only catches a hang.
const hangGuard = 15 * time.Second

func client(t *testing.T, addr string) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr, DisableIdentity: true, MaxRetries: -1,
		DialTimeout: time.Second, ReadTimeout: time.Second, WriteTimeout: time.Second})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func wait(t *testing.T, what string, c <-chan struct{}) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(hangGuard):
		t.Fatalf("%s did not happen", what)
	}
}

// The matched command is applied but its reply never comes; the link stays
// cut (new connections fail) until Heal; then the proxy forwards again.
func TestDropReplyAndCutUntilHeal(t *testing.T) {
	srv := redistest.Start(t)
	p := Start(t, srv.Addr())
	via, direct := client(t, p.Addr()), client(t, srv.Addr())
	ctx := context.Background()
	if err := via.Set(ctx, "before", "1", 0).Err(); err != nil {
		t.Fatalf("through the proxy before the fault: %v", err)
	}
	f := p.DropReplyAndCut("the-marked-key", 0)
	if err := via.Set(ctx, "other", "1", 0).Err(); err != nil {
		t.Fatalf("a command the fault does not match: %v", err)
	}
	select {
	case <-f.Cut():
		t.Fatal("cut by a command that does not match")
	default:
	}
	if err := via.Set(ctx, "the-marked-key", "applied", 0).Err(); err == nil {
		t.Fatal("the matched command got its reply")
	}
	wait(t, "the cut", f.Cut())
	if v, err := direct.Get(ctx, "the-marked-key").Result(); err != nil || v != "applied" {
		t.Fatalf("the matched command was not applied: %q %v", v, err)
	}
	for i := range 3 { // fresh connections too
		if err := via.Ping(ctx).Err(); err == nil {
			t.Fatalf("ping %d through the cut link answered", i)
		}
	}
	select {
	case <-f.Healed():
		t.Fatal("healed by itself with no outage duration")
	default:
	}
	p.Heal()
	wait(t, "the heal", f.Healed())
	if err := via.Set(ctx, "after", "1", 0).Err(); err != nil {
		t.Fatalf("through the proxy after Heal: %v", err)
	}
	// The fault is spent: the same command goes through now.
	if err := via.Set(ctx, "the-marked-key", "again", 0).Err(); err != nil {
		t.Fatalf("the matched command after the fault: %v", err)
	}
}

// A timed outage heals by itself.
func TestDropReplyAndCutForADuration(t *testing.T) {
	srv := redistest.Start(t)
	p := Start(t, srv.Addr())
	via := client(t, p.Addr())
	ctx := context.Background()
	f := p.DropReplyAndCut("ping", 50*time.Millisecond) // go-redis writes command names in lower case
	if err := via.Ping(ctx).Err(); err == nil {
		t.Fatal("the matched PING got its reply")
	}
	wait(t, "the cut", f.Cut())
	wait(t, "the heal", f.Healed())
	if err := via.Ping(ctx).Err(); err != nil {
		t.Fatalf("after the outage: %v", err)
	}
}

// CutBefore: the matched command is never applied, and the link is cut.
func TestCutBefore(t *testing.T) {
	srv := redistest.Start(t)
	p := Start(t, srv.Addr())
	via, direct := client(t, p.Addr()), client(t, srv.Addr())
	ctx := context.Background()
	f := p.CutBefore("never-set", 0)
	if err := via.Set(ctx, "never-set", "1", 0).Err(); err == nil {
		t.Fatal("the matched command got an answer")
	}
	wait(t, "the cut", f.Cut())
	if n, err := direct.Exists(ctx, "never-set").Result(); err != nil || n != 0 {
		t.Fatalf("the matched command reached the target: %d %v", n, err)
	}
	if err := via.Ping(ctx).Err(); err == nil {
		t.Fatal("ping through the cut link answered")
	}
	p.Heal()
	wait(t, "the heal", f.Healed())
	if err := via.Ping(ctx).Err(); err != nil {
		t.Fatalf("after Heal: %v", err)
	}
}
