package redistest

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// clientWait bounds each go-redis call of these tests; a call that needs
// longer has failed.
const clientWait = 10 * time.Second

// A FailoverClient writes, the master dies, the sentinels promote the
// replica, and the same client writes again, to the new master, and reads
// what it wrote before (it had reached the replica: WAIT said so).
func TestSentinelFailover(t *testing.T) {
	s := StartSentinel(t)
	first := s.Nodes()[0].Addr()
	if got := s.MasterAddr(); got != first {
		t.Fatalf("MasterAddr() = %s, want the first master %s", got, first)
	}
	c := redis.NewFailoverClient(&redis.FailoverOptions{
		MasterName:    s.MasterName(),
		SentinelAddrs: s.SentinelAddrs(),
	})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), clientWait)
	defer cancel()
	if err := c.Set(ctx, "before", "1", 0).Err(); err != nil {
		t.Fatalf("SET before the failover: %v", err)
	}
	if n, err := c.Do(ctx, "WAIT", 1, 5000).Int(); err != nil || n != 1 {
		t.Fatalf("WAIT 1: %d replicas, %v", n, err)
	}

	old := s.KillMaster()
	if old != first {
		t.Fatalf("KillMaster killed %s, want the master %s", old, first)
	}
	now := s.WaitFailover(old)
	if now == old || s.Node(now) == nil {
		t.Fatalf("WaitFailover(%s) = %s", old, now)
	}
	if got := s.MasterAddr(); got != now {
		t.Fatalf("MasterAddr() after the failover = %s, want %s", got, now)
	}

	ctx, cancel = context.WithTimeout(context.Background(), clientWait)
	defer cancel()
	if err := c.Set(ctx, "after", "2", 0).Err(); err != nil {
		t.Fatalf("SET after the failover, same client: %v", err)
	}
	if v, err := c.Get(ctx, "before").Result(); err != nil || v != "1" {
		t.Errorf("GET before after the failover: %q, %v", v, err)
	}
	// The write went to the new master itself.
	if v, err := query(now, "", nil, "GET", "after"); err != nil || v != "2" {
		t.Errorf("GET after on the new master %s: %v, %v", now, v, err)
	}
}

// Passwords on the data nodes and on the sentinels, and TLS everywhere:
// a FailoverClient given all three reaches the master; a sentinel refuses a
// client without its password.
func TestSentinelPasswordsAndTLS(t *testing.T) {
	const pw, spw = "data pass", "sentinel \"pass\""
	s := StartSentinel(t, WithPassword(pw), WithSentinelPassword(spw), WithTLS())
	if s.Password() != pw || s.SentinelPassword() != spw || s.TLS() == nil {
		t.Fatalf("Password %q, SentinelPassword %q, TLS %v", s.Password(), s.SentinelPassword(), s.TLS())
	}
	c := redis.NewFailoverClient(&redis.FailoverOptions{
		MasterName:       s.MasterName(),
		SentinelAddrs:    s.SentinelAddrs(),
		SentinelPassword: spw,
		Password:         pw,
		TLSConfig:        s.ClientTLSConfig(),
	})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), clientWait)
	defer cancel()
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}
	if v, err := query(s.MasterAddr(), pw, s.ClientTLSConfig(), "GET", "k"); err != nil || v != "v" {
		t.Errorf("GET k on the master: %v, %v", v, err)
	}
	if err := pingTLS(s.SentinelAddrs()[0], "", s.ClientTLSConfig()); err == nil {
		t.Error("a sentinel answered PING without its password")
	}
	if err := ping(s.SentinelAddrs()[0], spw); err == nil {
		t.Error("a sentinel answered PING over plain TCP")
	}
}
