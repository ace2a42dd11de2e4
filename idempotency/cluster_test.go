package idempotency

import (
	"context"
	"fmt"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/encgate/encgate/internal/redistest"
)

// The store on a real Redis Cluster (three masters made by redis-cli
// --cluster create), running the tests that hold on one Redis. A script
// whose keys fall in two slots is refused with CROSSSLOT; a key sent to a
// node that does not own its slot gets MOVED, which the client follows;
// pub/sub must reach a waiter whose one subscription lives on another node.
// One cluster serves every subtest, each starting with every node flushed
// and taking writes.
func TestRedisOnCluster(t *testing.T) {
	c := redistest.StartCluster(t)
	for _, tc := range []struct {
		name string
		f    func(*testing.T, *redisShape)
	}{
		{"ClaimCompleteReplayRelease", testClaimCompleteReplayRelease},
		{"ReceiveCount", testReceiveCount},
		{"Abandon", testAbandon},
		{"ClaimScriptIsRepeatable", testClaimScriptIsRepeatable},
		{"ClaimExpires", testClaimExpires},
		{"EveryKeyExpires", testEveryKeyExpires},
		{"Inspect", testInspect},
		{"CorruptRecordIsAnError", testCorruptRecordIsAnError},
		{"CollidingKeysStayDistinct", testCollidingKeysStayDistinct},
		{"AwaitWokenOnAnotherReplica", func(t *testing.T, sh *redisShape) { testAwaitWokenOnAnotherReplica(t, sh, redisOpts{}) }},
		{"AwaitWokenByAbandon", testAwaitWokenByAbandon},
		{"AwaitWokenAcrossNodes", testAwaitWokenAcrossNodes},
		{"SendsAcrossReplicas", testSendsAcrossReplicas},
		{"RefusedCompletionIsHeld", testRefusedCompletionIsHeld},
		{"CloseWithAHeldRecord", testCloseWithAHeldRecord},
		{"KeysShareOneSlot", testKeysShareOneSlot},
	} {
		t.Run(tc.name, func(t *testing.T) { tc.f(t, clusterShape(t, c)) })
	}
}

// oddReqIDs are req_ids with the bytes the hash tag escapes or could be
// cut by: braces, '%' and escapes, the empty req_id.
var oddReqIDs = []string{"r_local_part_0", "", "}", "{", "%", "%7D", "%25", "a}b{c", "{x}", "x}:rec:y", "p%}", "}}{{"}

// Every key and channel the store names for a req_id and destination lies
// in one slot, by the cluster's own CLUSTER KEYSLOT; and the req_ids do not
// all share one slot (the keys spread over the masters).
func testKeysShareOneSlot(t *testing.T, sh *redisShape) {
	r := newStoreOn(t, sh, redisOpts{})
	ctx := context.Background()
	slots := map[int64]bool{}
	for _, id := range oddReqIDs {
		var slot int64 = -1
		for _, dest := range []string{"10.0.0.1:40000", "h}:1", "{h}:2"} {
			for role, key := range allKeys(r, Key{id, dest}) {
				s, err := sh.raw.ClusterKeySlot(ctx, key).Result()
				if err != nil {
					t.Fatalf("CLUSTER KEYSLOT %q: %v", key, err)
				}
				if slot < 0 {
					slot = s
				}
				if s != slot {
					t.Errorf("req_id %q: %s key %q is in slot %d, its other keys in %d", id, role, key, s, slot)
				}
			}
		}
		slots[slot] = true
		// And the whole protocol runs for it on the cluster.
		k := Key{id, "h}:1"}
		mustClaim(t, r, k, fpN(1), StateClaimed)
		if !mustComplete(t, r, k, recN(1, fpN(1)), 1) {
			t.Errorf("req_id %q: not released", id)
		}
		if v, err := r.Inspect(ctx, id); err != nil || v.Done != 1 || !v.Released {
			t.Errorf("req_id %q: Inspect = %+v, %v", id, v, err)
		}
	}
	if len(slots) < 2 {
		t.Fatalf("every req_id's keys share one slot %v: the check proves nothing", slots)
	}
}

// A store's waiters share one pub/sub connection, on one node of the
// cluster. A waiter on a req_id whose keys live on another node is woken
// all the same: the Complete there publishes cluster-wide. (The waiter
// polls once an hour.)
func testAwaitWokenAcrossNodes(t *testing.T, sh *redisShape) {
	a, b := newStoreOn(t, sh, redisOpts{}), newStoreOn(t, sh, redisOpts{})
	cc := sh.raw.(*redis.ClusterClient)
	ctx := context.Background()
	// subscribedOn is the node whose connections listen on channel.
	subscribedOn := func(channel string) string {
		t.Helper()
		on := ""
		for _, n := range sh.nodes {
			m, err := n.PubSubNumSub(ctx, channel).Result()
			if err != nil {
				t.Fatal(err)
			}
			if m[channel] > 0 {
				if on != "" {
					t.Fatalf("%s has subscribers on %s and %s: the store has one connection", channel, on, n.Options().Addr)
				}
				on = n.Options().Addr
			}
		}
		return on
	}
	first := Key{"first_local_part_0", "h:1"}
	mustClaim(t, a, first, fpN(1), StateClaimed)
	w1 := goAwait(ctx, b, first)
	waitSubscribed(t, sh, a.keys(first).done)
	hub := subscribedOn(a.keys(first).done)

	// A req_id whose keys live elsewhere.
	var other Key
	for i := 0; other.ReqID == ""; i++ {
		if i == 100 {
			t.Fatal("no req_id on another node in 100 tries")
		}
		k := Key{fmt.Sprintf("other-%d_local_part_0", i), "h:1"}
		m, err := cc.MasterForKey(ctx, a.keys(k).rec)
		if err != nil {
			t.Fatal(err)
		}
		if m.Options().Addr != hub {
			other = k
		}
	}
	mustClaim(t, a, other, fpN(2), StateClaimed)
	w2 := goAwait(ctx, b, other)
	waitSubscribed(t, sh, a.keys(other).done)
	if on := subscribedOn(a.keys(other).done); on != hub {
		t.Fatalf("the second waiter subscribed on %s, not on the store's connection at %s", on, hub)
	}
	mustComplete(t, a, other, recN(2, fpN(2)), 0)
	if res := recv(t, "the waiter on the other node's req_id", w2); res.err != nil || !res.ok || !sameRecord(res.rec, recN(2, fpN(2))) {
		t.Fatalf("Await(%v) = %+v", other, res)
	}
	mustComplete(t, a, first, recN(1, fpN(1)), 0)
	if res := recv(t, "the first waiter", w1); res.err != nil || !res.ok || !sameRecord(res.rec, recN(1, fpN(1))) {
		t.Fatalf("Await(%v) = %+v", first, res)
	}
}
