package upstream

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/encgate/encgate/internal/redistest"
)

// The shared pins on a real Redis Cluster (three masters made by redis-cli
// --cluster create). Each script touches its req_id's one hash; the
// placements' channel is published cluster-wide, so a waiter whose
// subscription lives on another node than the pin is woken. One cluster
// serves every subtest, each on flushed nodes.
func TestSharedPinsOnCluster(t *testing.T) {
	c := redistest.StartCluster(t)
	ctx := context.Background()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), DisableIdentity: true})
	t.Cleanup(func() { _ = cc.Close() })
	var nodes []*redis.Client
	for _, n := range c.Nodes() {
		nc := redis.NewClient(&redis.Options{Addr: n.Addr(), DisableIdentity: true})
		t.Cleanup(func() { _ = nc.Close() })
		nodes = append(nodes, nc)
	}
	tables := func(t *testing.T, n int) []*PinTable {
		t.Helper()
		for _, nc := range nodes {
			if err := nc.FlushAll(ctx).Err(); err != nil {
				t.Fatal(err)
			}
		}
		return sharedTablesOn(t, cc, nodes, n)
	}

	t.Run("FollowOneRule", func(t *testing.T) { testSharedPinsFollowOneRule(t, tables(t, 3)) })

	t.Run("WakesAWaiterAcrossNodes", func(t *testing.T) {
		ts := tables(t, 2)
		// The replicas' subscriptions live on the node of the channel's
		// slot; the pin of this req_id on another.
		var sub string
		for _, nc := range nodes {
			if m, err := nc.PubSubNumSub(ctx, "t:pins:placed").Result(); err == nil && m["t:pins:placed"] > 0 {
				sub = nc.Options().Addr
			}
		}
		if sub == "" {
			t.Fatal("no node has the replicas' subscriptions")
		}
		pins := NewRedisPins(cc, "t:", time.Minute, time.Second, time.Hour, nil, nil)
		reqID := ""
		for i := 0; reqID == ""; i++ {
			if i == 100 {
				t.Fatal("no req_id whose pin lives off the subscribers' node in 100 tries")
			}
			id := fmt.Sprintf("w-%d_local_part_0", i)
			m, err := cc.MasterForKey(ctx, pins.key(id))
			if err != nil {
				t.Fatal(err)
			}
			if m.Options().Addr != sub {
				reqID = id
			}
		}
		testSharedPinWakesAWaiter(t, ts, reqID)
	})

	// req_ids with the bytes the hash tag escapes: each one's operations
	// run (one key each), and their pins are kept apart.
	t.Run("OddReqIDs", func(t *testing.T) {
		ts := tables(t, 2)
		a, b := ts[0], ts[1]
		odd := []string{"", "}", "{", "%", "%7D", "%25", "a}b{c", "{x}", "}}{{"}
		for i, id := range odd {
			enc := fmt.Sprintf("enc-%d", i)
			if p, placed := a.Place(id, enc, uint64(i+1)); !placed || p.Encoder != enc {
				t.Fatalf("req_id %q: place %+v %v", id, p, placed)
			}
		}
		for i, id := range odd {
			if p, ok := b.Get(id); !ok || p.Encoder != fmt.Sprintf("enc-%d", i) || !p.Remote {
				t.Errorf("req_id %q on the other replica: %+v %v", id, p, ok)
			}
		}
	})
}
