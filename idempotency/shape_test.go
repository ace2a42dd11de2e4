package idempotency

import (
	"context"
	"sort"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/encgate/encgate/internal/redisclient"
	"github.com/encgate/encgate/internal/redistest"
)

// redisShape is the Redis a test's stores share: one redis-server, or a
// Redis Cluster of three masters. A store test that must hold on any Redis
// takes one; TestRedisOnCluster runs those tests on a real cluster.
type redisShape struct {
	conn  redisclient.Config    // mode and addresses; the rest default
	raw   redis.UniversalClient // the test's own client, to read and plant keys
	nodes []*redis.Client       // every server: the one, or each master
}

// serverShape is srv alone.
func serverShape(t *testing.T, srv *redistest.Server) *redisShape {
	t.Helper()
	conn := redisclient.Default()
	conn.Addr = srv.Addr()
	n := redis.NewClient(&redis.Options{Addr: srv.Addr(), Password: srv.Password(), DisableIdentity: true})
	t.Cleanup(func() { _ = n.Close() })
	return &redisShape{conn: conn, raw: n, nodes: []*redis.Client{n}}
}

// clusterShape is c, emptied for t: every master flushed and taking writes
// again, so that the tests sharing one cluster each start as on a fresh
// server.
func clusterShape(t *testing.T, c *redistest.Cluster) *redisShape {
	t.Helper()
	conn := redisclient.Default()
	conn.Mode = redisclient.Cluster
	conn.ClusterAddrs = c.Addrs()
	conn.Password = c.Password()
	raw := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), Password: c.Password(), DisableIdentity: true})
	t.Cleanup(func() { _ = raw.Close() })
	sh := &redisShape{conn: conn, raw: raw}
	for _, n := range c.Nodes() {
		nc := redis.NewClient(&redis.Options{Addr: n.Addr(), Password: n.Password(), DisableIdentity: true})
		t.Cleanup(func() { _ = nc.Close() })
		sh.nodes = append(sh.nodes, nc)
	}
	sh.each(t, func(n *redis.Client) error {
		if err := n.ConfigSet(bg, "maxmemory", "0").Err(); err != nil {
			return err
		}
		return n.FlushAll(bg).Err()
	})
	return sh
}

// each runs f on every server, failing t on the first error.
func (sh *redisShape) each(t *testing.T, f func(n *redis.Client) error) {
	t.Helper()
	for _, n := range sh.nodes {
		if err := f(n); err != nil {
			t.Fatalf("%s: %v", n.Options().Addr, err)
		}
	}
}

// numSub is how many connections listen on channel, over every server (a
// cluster node counts only its own subscribers). It does not fail the test,
// so any goroutine may call it.
func (sh *redisShape) numSub(channel string) (int64, error) {
	var total int64
	for _, n := range sh.nodes {
		m, err := n.PubSubNumSub(context.Background(), channel).Result()
		if err != nil {
			return 0, err
		}
		total += m[channel]
	}
	return total, nil
}

// keys are the keys matching pattern on every server, sorted.
func (sh *redisShape) keys(t *testing.T, pattern string) []string {
	t.Helper()
	var out []string
	sh.each(t, func(n *redis.Client) error {
		ks, err := n.Keys(context.Background(), pattern).Result()
		out = append(out, ks...)
		return err
	})
	sort.Strings(out)
	return out
}

// startServerShape is a new redis-server of t's own.
func startServerShape(t *testing.T) *redisShape {
	t.Helper()
	return serverShape(t, redistest.Start(t))
}
