package idempotency

import (
	"bytes"
	"context"
	"errors"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
)

// refuseWritesOOM makes Redis (every master of a cluster) refuse every
// write that may grow memory, as a full Redis under noeviction does ("OOM
// command not allowed"). Reads, PEXPIRE, DEL and PUBLISH still go through.
// The test's cleanup lifts it.
func refuseWritesOOM(t *testing.T, sh *redisShape) {
	t.Helper()
	sh.each(t, func(n *redis.Client) error {
		if err := n.ConfigSet(bg, "maxmemory-policy", "noeviction").Err(); err != nil {
			return err
		}
		return n.ConfigSet(bg, "maxmemory", "1").Err()
	})
	t.Cleanup(func() {
		for _, n := range sh.nodes {
			_ = n.ConfigSet(bg, "maxmemory", "0").Err()
		}
	})
}

func acceptWritesOOM(t *testing.T, sh *redisShape) {
	t.Helper()
	sh.each(t, func(n *redis.Client) error { return n.ConfigSet(bg, "maxmemory", "0").Err() })
}

// refuseWritesReadOnly makes Redis a replica of a master that never
// answers, as a demoted master is after a failover: it keeps its data and
// answers reads, and refuses every write ("READONLY"), PEXPIRE included.
func refuseWritesReadOnly(t *testing.T, raw *redis.Client) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close() // refused from now on
	if err := raw.SlaveOf(context.Background(), "127.0.0.1", strconv.Itoa(port)).Err(); err != nil {
		t.Fatal(err)
	}
}

func acceptWritesReadOnly(t *testing.T, raw *redis.Client) {
	t.Helper()
	if err := raw.SlaveOf(context.Background(), "NO", "ONE").Err(); err != nil {
		t.Fatal(err)
	}
}

// replicaPair is two gateways' deduplicators over one Redis.
type replicaPair struct {
	stores [2]*Redis
	sends  [2]*Sends
	regs   [2]*prometheus.Registry
}

func newReplicaPair(t *testing.T, sh *redisShape, claimTTL time.Duration) *replicaPair {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Store = "redis"
	cfg.ClaimTTL = configfile.Duration(claimTTL)
	var p replicaPair
	for i := range 2 {
		// Waiters poll once an hour: an answer they get came by pub/sub.
		p.stores[i] = newStoreOn(t, sh, redisOpts{claimTTL: claimTTL})
		p.regs[i] = prometheus.NewRegistry()
		p.sends[i] = NewSends(p.stores[i], cfg, clock.Real{}, zap.NewNop(), NewMetrics(p.regs[i], nil))
	}
	return &p
}

func sameAnswer(a, b Answer) bool {
	return a.Status == b.Status && a.ContentType == b.ContentType && bytes.Equal(a.Body, b.Body)
}

// Redis runs out of memory (noeviction) while a /send is in flight, so the
// write of its answer is refused. The replica that forwarded holds the
// answer: its duplicates replay it, the other replica's duplicates get it
// (published on the key's channel) while the claim, extended, keeps them
// from forwarding, also past claim_ttl. Once Redis takes writes again the
// answer is stored and the claim ends. The /send reached the encoder once.
func TestRedisRefusedCompletionIsHeldAndNeverForwardedTwice(t *testing.T) {
	testRefusedCompletionIsHeld(t, startServerShape(t))
}

func testRefusedCompletionIsHeld(t *testing.T, sh *redisShape) {
	raw := sh.raw
	const claimTTL = 400 * time.Millisecond
	p := newReplicaPair(t, sh, claimTTL)
	a, b := p.sends[0], p.sends[1]
	req := Send{Key: Key{ReqID: "oom_local_part_0", Dest: "10.0.0.1:40000"}, FP: fpN(3), ReceiveCount: 2}
	ks := p.stores[0].keys(req.Key)
	ans := Answer{Status: 200, ContentType: "application/json", Body: []byte(`{"the":"answer"}`)}
	var forwards atomic.Int32
	forward := func(time.Duration) (Answer, bool) {
		if forwards.Add(1) == 1 {
			refuseWritesOOM(t, sh) // while the first /send is at the encoder
		}
		return ans, true
	}
	deadline := func() time.Time { return time.Now().Add(hangGuard) }

	if r := a.Do(bg, req, deadline(), forward); r.Outcome != Forwarded || !sameAnswer(r.Answer, ans) {
		t.Fatalf("leader: %+v", r)
	}
	if n, err := raw.Exists(bg, ks.rec).Result(); err != nil || n != 0 {
		t.Fatalf("the record was stored though Redis is out of memory (%d, %v)", n, err)
	}
	check := func(when string) {
		t.Helper()
		if r := a.Do(bg, req, deadline(), forward); r.Outcome != Replayed || !sameAnswer(r.Answer, ans) {
			t.Fatalf("%s: duplicate on the replica that forwarded: %v %+v", when, r.Outcome, r.Answer)
		}
		if r := b.Do(bg, req, deadline(), forward); r.Outcome != Inflight || !sameAnswer(r.Answer, ans) {
			t.Fatalf("%s: duplicate on the other replica: %v %+v (%v)", when, r.Outcome, r.Answer, r.Err)
		}
		if n := forwards.Load(); n != 1 {
			t.Fatalf("%s: the /send was forwarded %d times", when, n)
		}
	}
	check("while refused")
	// Redis expires claims by its own clock: let two claim_ttls pass on it.
	time.Sleep(2 * claimTTL)
	if pttl := raw.PTTL(bg, ks.claim).Val(); pttl <= 0 {
		t.Fatalf("the claim was not held past claim_ttl (PTTL %v)", pttl)
	}
	check("past claim_ttl")

	acceptWritesOOM(t, sh)
	waitFor(t, "the held answer to be stored", func() bool { return p.stores[0].Pending() == 0 })
	if n := raw.Exists(bg, ks.rec, ks.claim).Val(); n != 1 {
		t.Fatalf("after recovery: %d of record and claim exist, want the record alone", n)
	}
	if r := b.Do(bg, req, deadline(), forward); r.Outcome != Replayed || !sameAnswer(r.Answer, ans) {
		t.Fatalf("after recovery, on the other replica: %v %+v", r.Outcome, r.Answer)
	}
	if n := forwards.Load(); n != 1 {
		t.Fatalf("the /send was forwarded %d times", n)
	}
	for name, want := range map[string]float64{
		"encgate_idempotency_complete_refused_total": 1,
		"encgate_idempotency_complete_pending":       0,
		"encgate_idempotency_complete_lost_total":    0,
	} {
		if got := metricValue(t, p.regs[0], name); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
}

// Redis goes read-only (a failover) with a /send in flight and stays so
// past claim_ttl: even the claim cannot be extended, and it lapses. That
// is counted. No other replica can claim the key while writes are refused
// (its /sends get a 503), and once they are accepted the held answer is
// stored by the first retry, so the /send still reached the encoder once.
func TestRedisReadOnlyPastClaimTTLIsCountedAndStillForwardsOnce(t *testing.T) {
	sh := startServerShape(t)
	raw := sh.nodes[0]
	const claimTTL = 300 * time.Millisecond
	p := newReplicaPair(t, sh, claimTTL)
	a, b := p.sends[0], p.sends[1]
	req := Send{Key: Key{ReqID: "ro_local_part_0", Dest: "10.0.0.1:40000"}, FP: fpN(4), ReceiveCount: 1}
	ans := Answer{Status: 200, ContentType: "application/json", Body: []byte(`null`)}
	var forwards atomic.Int32
	forward := func(time.Duration) (Answer, bool) {
		if forwards.Add(1) == 1 {
			refuseWritesReadOnly(t, raw)
		}
		return ans, true
	}
	deadline := func() time.Time { return time.Now().Add(hangGuard) }
	t.Cleanup(func() { _ = raw.SlaveOf(context.Background(), "NO", "ONE").Err() })

	if r := a.Do(bg, req, deadline(), forward); r.Outcome != Forwarded {
		t.Fatalf("leader: %+v", r)
	}
	if r := b.Do(bg, req, deadline(), forward); r.Outcome != Inflight || !sameAnswer(r.Answer, ans) {
		t.Fatalf("duplicate on the other replica before claim_ttl: %v %+v (%v)", r.Outcome, r.Answer, r.Err)
	}
	waitFor(t, "the lapsed claim to be counted", func() bool {
		return metricValue(t, p.regs[0], "encgate_idempotency_complete_lost_total", "reason", "claim_lost") == 1
	})
	if r := b.Do(bg, req, deadline(), forward); r.Outcome != Unavailable {
		t.Fatalf("duplicate on the other replica, claim lapsed, Redis read-only: %v, want a 503", r.Outcome)
	}
	if r := a.Do(bg, req, deadline(), forward); r.Outcome != Replayed {
		t.Fatalf("duplicate on the replica that forwarded: %v", r.Outcome)
	}
	acceptWritesReadOnly(t, raw)
	waitFor(t, "the held answer to be stored", func() bool { return p.stores[0].Pending() == 0 })
	if r := b.Do(bg, req, deadline(), forward); r.Outcome != Replayed || !sameAnswer(r.Answer, ans) {
		t.Fatalf("after recovery, on the other replica: %v %+v", r.Outcome, r.Answer)
	}
	if n := forwards.Load(); n != 1 {
		t.Fatalf("the /send was forwarded %d times", n)
	}
}

// A store closed with a record still held counts it lost, and nothing
// outlives Close (goleak checks the retry goroutine is gone).
func TestRedisCloseWithAHeldRecordCountsItLost(t *testing.T) {
	testCloseWithAHeldRecord(t, startServerShape(t))
}

func testCloseWithAHeldRecord(t *testing.T, sh *redisShape) {
	p := newReplicaPair(t, sh, time.Minute)
	refuseWritesOOM(t, sh)
	k := Key{ReqID: "closed_local_part_0", Dest: "h:1"}
	// Out of memory a new claim is refused too: Complete without one.
	if _, err := p.stores[0].Complete(bg, k, recN(1, fpN(1)), 1); !errors.Is(err, ErrCompletionPending) || !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Complete out of memory: %v", err)
	}
	if rec, found, _, err := p.stores[0].Lookup(bg, k); err != nil || !found || !sameRecord(&rec, recN(1, fpN(1))) {
		t.Fatalf("Lookup of the held record: %+v %v %v", rec, found, err)
	}
	if err := p.stores[0].Close(); err != nil {
		t.Fatal(err)
	}
	if got := metricValue(t, p.regs[0], "encgate_idempotency_complete_lost_total", "reason", "closed"); got != 1 {
		t.Errorf("lost{closed} = %v", got)
	}
	if got := metricValue(t, p.regs[0], "encgate_idempotency_complete_pending"); got != 0 {
		t.Errorf("pending = %v", got)
	}
}
