package gateway

import (
	"fmt"

	"github.com/encgate/encgate/internal/fdlimit"
	"github.com/encgate/encgate/internal/listener"
	"github.com/encgate/encgate/internal/redisclient"
)

// descriptorParts is everything the config lets the gateway hold open at
// once. Each term is a bound the gateway enforces: the listeners' limits
// and their refusals in progress, every encoder's (and agent's) connection
// pool, the health probes' own pool of 2 per encoder, and the Redis pool
// with its pub/sub connection.
func (c Config) descriptorParts() []listener.DescriptorPart {
	encoders, agents := uint64(len(c.Encoders)), uint64(0)
	for _, e := range c.Encoders {
		if e.Agent != "" {
			agents++
		}
	}
	per := uint64(max(c.Upstream.MaxConnsPerEncoder, 0))
	parts := []listener.DescriptorPart{
		{Key: "limits.max_conns", What: "limits.max_conns", N: uint64(c.Limits.MaxConns)},
		{What: "connections being refused on listen", N: uint64(listener.LingerCap(c.Limits.MaxConns, listener.MaxLingering)) + 1},
		{Key: "admin.max_conns", What: "admin.max_conns", N: uint64(c.Admin.MaxConns)},
		{What: "connections being refused on admin_listen", N: uint64(listener.LingerCap(c.Admin.MaxConns, listener.AdminMaxLingering)) + 1},
		{Key: "upstream.max_conns_per_encoder", What: fmt.Sprintf("upstream.max_conns_per_encoder %d x %d (%d encoders, %d agents) =",
			per, encoders+agents, encoders, agents), N: per * (encoders + agents)},
		{What: "health probes (2 per encoder)", N: 2 * encoders},
	}
	if c.usesRedis() {
		// go-redis holds at most pool_size connections per server in its
		// pool, plus the pub/sub connections that wake waiters; a Sentinel
		// client adds one to a Sentinel, a cluster client pools per node
		// (counted here per seed node: a larger cluster needs more).
		pool := uint64(max(c.Redis.PoolSize, 0))
		switch c.Redis.Mode {
		case redisclient.Sentinel:
			parts = append(parts, listener.DescriptorPart{Key: "redis.pool_size", What: "redis.pool_size + pub/sub + a Sentinel", N: pool + 2})
		case redisclient.Cluster:
			n := uint64(len(c.Redis.ClusterAddrs))
			parts = append(parts, listener.DescriptorPart{Key: "redis.pool_size", What: fmt.Sprintf("(redis.pool_size + pub/sub) x %d nodes", n), N: (pool + 1) * n})
		default:
			parts = append(parts, listener.DescriptorPart{Key: "redis.pool_size", What: "redis.pool_size + pub/sub", N: pool + 1})
		}
	}
	return append(parts,
		listener.DescriptorPart{What: "listeners", N: 2},
		listener.DescriptorPart{What: "the parking poller (its epoll instance)", N: 1},
		listener.DescriptorPart{What: "the process's own files", N: listener.DescriptorMargin})
}

// Descriptors compares what cfg can make the gateway hold open with
// RLIMIT_NOFILE (listener.Budget over descriptorParts).
func Descriptors(cfg Config, l fdlimit.Limits, raise bool) (listener.DescriptorReport, error) {
	return listener.Budget(cfg.descriptorParts(), l, raise)
}
