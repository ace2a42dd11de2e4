package gateway

// The chaos suite's Redis faults: two gateway replicas share one real
// redis-server, and Redis starts refusing writes (out of memory under
// noeviction) while /sends are at the encoders. The chaos invariants hold
// throughout (chaos.check): no /send reaches the encoders twice, every
// caller is answered within its bound.

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/encgate/encgate/idempotency"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/faultproxy"
	"github.com/encgate/encgate/internal/redistest"
)

// redisReplicas is a chaos fleet whose gateway (c.g) and a second replica
// (other) dedupe /sends through one redis-server.
type redisReplicas struct {
	*chaos
	other *gw
	raw   *redis.Client
}

func newRedisReplicas(t *testing.T, claimTTL time.Duration) *redisReplicas {
	t.Helper()
	rd := redistest.Start(t)
	c := newChaos(t, 2, func(cfg *Config) {
		cfg.Idempotency.Store = "redis"
		cfg.Redis.Addr = rd.Addr()
		cfg.Redis.Timeout = configfile.Duration(200 * time.Millisecond)
		cfg.Redis.DialTimeout = configfile.Duration(200 * time.Millisecond)
		cfg.Idempotency.ClaimTTL = configfile.Duration(claimTTL)
		// The second replica never saw the /encode: it routes follow-ups by
		// rendezvous order at once, to the encoder the first placed it on.
		cfg.Affinity.UnknownWait = 0
	}, nil)
	other := serveGateway(t, c.cfg, zap.NewNop(), c.clk)
	raw := redis.NewClient(&redis.Options{Addr: rd.Addr(), DisableIdentity: true})
	t.Cleanup(func() { _ = raw.Close() })
	return &redisReplicas{chaos: c, raw: raw, other: other}
}

// replica is gateway i (0: c.g, 1: the other).
func (r *redisReplicas) replica(i int) *gw {
	if i%2 == 0 {
		return r.g
	}
	return r.other
}

// callAt is chaos.callAt: the caller's deadline is the route's bound plus
// slack, and the answer must be this request's.
func (r *redisReplicas) callAt(g *gw, route, id, body, dest string) (reply, bool) {
	return r.chaos.callAt(g, route, id, body, dest)
}

// part is chaos.part across the replicas: /encode and the metadata pull
// through the first, each rank's dups copies of its /send split between
// both, at once. It returns the /sends' statuses by rank.
func (r *redisReplicas) part(id string) map[int][]int {
	out := map[int][]int{}
	if a, ok := r.callAt(r.g, routeEncode, id, encodeBody(id), ""); !ok || a.status != http.StatusOK {
		r.t.Errorf("/encode %s: %d %s", id, a.status, a.body)
		return out
	}
	if m, ok := r.callAt(r.g, routeMetadata, id, metaBody(id), ""); !ok || m.status != http.StatusOK {
		r.t.Errorf("metadata %s: %d %s", id, m.status, m.body)
		return out
	}
	return r.sendAll(id)
}

// sendAll sends every rank's /send for id dups times at once, alternating
// replicas, and returns the statuses by rank.
func (r *redisReplicas) sendAll(id string) map[int][]int {
	var mu sync.Mutex
	out := map[int][]int{}
	var wg sync.WaitGroup
	for rank := 0; rank < r.tp; rank++ {
		for d := 0; d < r.dups; d++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if a, ok := r.callAt(r.replica(rank+d), routeSend, id, tpSend(id, rank, r.tp), sendDest(rank)); ok {
					mu.Lock()
					out[rank] = append(out[rank], a.status)
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	return out
}

// arrived is how many /sends of ids reached the encoders.
func (r *redisReplicas) arrived(ids []string) int64 {
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	var n int64
	for _, e := range r.encs {
		for k, c := range e.Stats().SendArrivals {
			if want[strings.SplitN(k, "|", 2)[0]] {
				n += c
			}
		}
	}
	return n
}

// held is how many /send answers the replicas hold for Redis now.
func (r *redisReplicas) held() int {
	n := 0
	for i := range 2 {
		if st, ok := r.replica(i).store.Store.(*idempotency.Redis); ok {
			n += st.Pending()
		}
	}
	return n
}

func (r *redisReplicas) metric(name string, labels ...string) float64 {
	return seriesValue(r.t, r.g, name, labels...) + seriesValue(r.t, r.other, name, labels...)
}

// TestChaosRedisRefusesWritesMidFlight: Redis runs out of memory while a
// wave of parts has /sends at the encoders (each answer takes 300ms there),
// stays so past claim_ttl while every /send is repeated on both replicas,
// then recovers and every /send is repeated again. A /send whose answer
// Redis refused to store is answered from the replica that forwarded it
// (held there, its claim extended, its answer published to the other
// replica's waiters); one that could not be claimed gets a 503 and is
// forwarded, once, after the recovery. Nothing reaches an encoder twice and
// every caller is answered within its bound.
func TestChaosRedisRefusesWritesMidFlight(t *testing.T) {
	chaosLeakCheck(t)
	const claimTTL = time.Second
	r := newRedisReplicas(t, claimTTL)
	ctx := context.Background()
	for _, e := range r.encs {
		f := e.Faults()
		f.Latency = 300 * time.Millisecond
		e.SetFaults(f)
	}

	// Before: both replicas dedupe through Redis.
	warm := ids("warm", 4)
	for _, id := range warm {
		for rank, st := range r.part(id) {
			for _, s := range st {
				if s != http.StatusOK {
					t.Fatalf("healthy Redis, %s rank %d: status %d", id, rank, s)
				}
			}
		}
	}

	// Mid-flight: Redis refuses writes once the wave's first /send is at an
	// encoder; the other /sends are claimed before, or refused after.
	wave := ids("oom", 8)
	var wg sync.WaitGroup
	statuses := make([]map[int][]int, len(wave))
	for i, id := range wave {
		wg.Add(1)
		go func() {
			defer wg.Done()
			statuses[i] = r.part(id)
		}()
	}
	eventually(t, "a /send of the wave at an encoder", func() bool { return r.arrived(wave) > 0 })
	if err := r.raw.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err(); err != nil {
		t.Fatal(err)
	}
	if err := r.raw.ConfigSet(ctx, "maxmemory", "1").Err(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	counts := map[int]int{}
	for _, st := range statuses {
		for _, s := range st {
			for _, code := range s {
				counts[code]++
			}
		}
	}
	t.Logf("mid-flight statuses: %v; answers held for Redis: %d", counts, r.held())
	if r.metric("encgate_idempotency_complete_refused_total") < 1 {
		t.Error("no /send answer was refused by Redis: the fault did not hit mid-flight")
	}
	for code := range counts {
		if code != http.StatusOK && code != http.StatusServiceUnavailable {
			t.Errorf("status %d mid-flight (want 200, or 503 for a /send Redis could not claim)", code)
		}
	}

	// Past claim_ttl, Redis still refusing: every /send again, through both
	// replicas. Redis expires by its own clock: let claim_ttl pass on it.
	time.Sleep(claimTTL + claimTTL/2)
	for _, id := range wave {
		r.sendAll(id)
	}

	// Recovery: the held answers are stored, and every /send once more.
	if err := r.raw.ConfigSet(ctx, "maxmemory", "0").Err(); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the held answers to be stored", func() bool { return r.held() == 0 })
	for _, id := range append(wave, warm...) {
		for rank, st := range r.sendAll(id) {
			for _, s := range st {
				if s != http.StatusOK {
					t.Errorf("after recovery, %s rank %d: status %d", id, rank, s)
				}
			}
		}
	}
	if lost := r.metric("encgate_idempotency_complete_lost_total"); lost != 0 {
		t.Errorf("encgate_idempotency_complete_lost_total = %v", lost)
	}
	r.check()
	t.Logf("refused and held: %v", fmt.Sprint(r.metric("encgate_idempotency_complete_refused_total")))
}

// TestChaosRedisLostClaimReplyThenRetryIsForwardedOnce: a Redis blip mid
// /send. A proxy between the gateway and Redis lets the /send's claim
// through to Redis, which sets it, drops the reply and cuts the link for
// 1.5s. The caller gets a 503; its retry once Redis is back gets a 200, and
// the /send reached the encoder once. claim_ttl is an hour: the retry did
// not wait for the claim to expire (before, it got a 504 until then).
func TestChaosRedisLostClaimReplyThenRetryIsForwardedOnce(t *testing.T) {
	chaosLeakCheck(t)
	rd := redistest.Start(t)
	p := faultproxy.Start(t, rd.Addr())
	c := newChaos(t, 2, func(cfg *Config) {
		cfg.Idempotency.Store = "redis"
		cfg.Redis.Addr = p.Addr()
		cfg.Redis.Timeout = configfile.Duration(200 * time.Millisecond)
		cfg.Redis.DialTimeout = configfile.Duration(200 * time.Millisecond)
		cfg.Idempotency.ClaimTTL = configfile.Duration(time.Hour)
	}, nil)
	// A first part loads the store's scripts into Redis, so the fault below
	// drops the claim script's own reply (not a NOSCRIPT answer to it).
	if res := c.part("warm-0_local_part_0"); !res.ok {
		t.Fatalf("healthy Redis: %v %s", res.status, res.last)
	}
	id := "blip-0_local_part_0"
	for _, call := range []struct{ route, body string }{{routeEncode, encodeBody(id)}, {routeMetadata, metaBody(id)}} {
		if a, ok := c.call(call.route, id, call.body, ""); !ok || a.status != http.StatusOK {
			t.Fatalf("%s: %d %s", call.route, a.status, a.body)
		}
	}
	f := p.DropReplyAndCut("{"+id+"}:claim:", 1500*time.Millisecond)
	a, ok := c.call(routeSend, id, tpSend(id, 0, c.tp), sendDest(0))
	if !ok || a.status != http.StatusServiceUnavailable {
		t.Fatalf("the /send whose claim reply was lost: %d %s, want 503", a.status, a.body)
	}
	select {
	case <-f.Cut():
	default:
		t.Fatal("the /send was answered but its claim's reply was not dropped")
	}
	select {
	case <-f.Healed():
	case <-time.After(time.Minute):
		t.Fatal("the 1.5s outage did not end")
	}
	if a, ok := c.call(routeSend, id, tpSend(id, 0, c.tp), sendDest(0)); !ok || a.status != http.StatusOK {
		t.Fatalf("the client's retry once Redis is back: %d %s, want 200", a.status, a.body)
	}
	a, ok = c.call(routeSend, id, tpSend(id, 0, c.tp), sendDest(0))
	if !ok || a.status != http.StatusOK || a.header.Get("X-Encgate-Replayed") != "true" {
		t.Fatalf("a later duplicate: %d %q %s, want a replayed 200", a.status, a.header.Get("X-Encgate-Replayed"), a.body)
	}
	var arrived int64
	for _, e := range c.encs {
		arrived += e.Stats().SendArrivals[id+"|"+sendDest(0)]
	}
	if arrived != 1 {
		t.Fatalf("the /send reached the encoders %d times, want once", arrived)
	}
	eventually(t, "the orphaned claim to be resolved", func() bool {
		return seriesValue(t, c.g, "encgate_idempotency_orphaned_claims") == 0
	})
	if got := seriesValue(t, c.g, "encgate_idempotency_orphaned_claims_total", "outcome", "abandoned") +
		seriesValue(t, c.g, "encgate_idempotency_orphaned_claims_total", "outcome", "taken_over"); got != 1 {
		t.Errorf("orphaned claims abandoned + taken over = %v, want 1", got)
	}
	c.check()
}
