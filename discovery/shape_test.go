package discovery

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/encgate/encgate/internal/redistest"
)

// regShape is the Redis the registries of a test share: one redis-server,
// or a Redis Cluster of three masters (TestRegistryRedisOnCluster).
type regShape struct {
	// client is a new client, one replica's, closed when the test ends.
	client func(t *testing.T) redis.UniversalClient
	// raw is the test's own client, to look at and plant what the
	// registries share.
	raw redis.UniversalClient
}

// regTimeout bounds each step of a replica's client (which does not retry).
const regTimeout = time.Second

// regServer is srv alone.
func regServer(t *testing.T, srv *redistest.Server) *regShape {
	t.Helper()
	return &regShape{
		client: func(t *testing.T) redis.UniversalClient {
			c := redis.NewClient(&redis.Options{Addr: srv.Addr(), DisableIdentity: true, MaxRetries: -1,
				DialTimeout: regTimeout, ReadTimeout: regTimeout, WriteTimeout: regTimeout})
			t.Cleanup(func() { _ = c.Close() })
			return c
		},
		raw: regRaw(t, srv),
	}
}

// regStartServer is a new redis-server of t's own.
func regStartServer(t *testing.T) *regShape { return regServer(t, redistest.Start(t)) }

// regCluster is c, every node flushed, so that the tests sharing one
// cluster each start as on a fresh server.
func regCluster(t *testing.T, c *redistest.Cluster) *regShape {
	t.Helper()
	for _, n := range c.Nodes() {
		nc := redis.NewClient(&redis.Options{Addr: n.Addr(), DisableIdentity: true})
		err := nc.FlushAll(context.Background()).Err()
		_ = nc.Close()
		if err != nil {
			t.Fatalf("FLUSHALL on %s: %v", n.Addr(), err)
		}
	}
	newClient := func(t *testing.T, retries int) redis.UniversalClient {
		cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), DisableIdentity: true, MaxRetries: retries,
			DialTimeout: regTimeout, ReadTimeout: regTimeout, WriteTimeout: regTimeout})
		t.Cleanup(func() { _ = cc.Close() })
		return cc
	}
	return &regShape{
		client: func(t *testing.T) redis.UniversalClient { return newClient(t, -1) },
		raw:    newClient(t, 0),
	}
}
