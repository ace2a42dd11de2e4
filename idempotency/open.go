package idempotency

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
)

// Opened is a store built from config, with what its owner must run and close.
type Opened struct {
	Store  Store
	Memory *Memory // non-nil for the memory store (its metrics)
	stop   func() error
}

// Close stops the store's background work and connections.
func (o *Opened) Close() error { return o.stop() }

// Open builds the configured store and starts its background work.
func Open(cfg Config, clk clock.Clock, log *zap.Logger) (*Opened, error) {
	switch cfg.Store {
	case "memory":
		m := NewMemory(cfg.Capacity, cfg.MaxDestinationsPerReqID, cfg.TTL.D(), clk)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			m.Run(ctx)
		}()
		return &Opened{Store: m, Memory: m, stop: func() error { cancel(); <-done; return nil }}, nil
	case "redis":
		r, err := NewRedis(cfg.Redis, cfg.TTL.D(), cfg.ClaimTTL.D(), cfg.MaxDestinationsPerReqID, cfg.MaxOrphanedClaims, clk, log)
		if err != nil {
			return nil, err
		}
		// Start even when Redis is down: each /send then gets a 503 (or is
		// forwarded with fail_open) until it is back.
		ctx, cancel := context.WithTimeout(context.Background(), cfg.Redis.DialTimeout.D()+cfg.Redis.Timeout.D())
		defer cancel()
		switch err := r.Ping(ctx); {
		case err == nil:
		case redis.IsAuthError(err):
			// Redis answers but refuses the credentials: a config or Secret
			// that disagrees with the server's, not an outage.
			log.Error("redis refuses the gateway's credentials (idempotency.redis.username, password or password_file); /sends are refused until it accepts them",
				zap.String("addr", cfg.Redis.Addr), zap.Bool("fail_open", cfg.Redis.FailOpen), zap.Error(err))
		default:
			log.Warn("redis is not reachable yet; /sends are refused until it is", zap.String("addr", cfg.Redis.Addr),
				zap.Bool("fail_open", cfg.Redis.FailOpen), zap.Error(err))
		}
		return &Opened{Store: r, stop: r.Close}, nil
	default:
		return nil, fmt.Errorf("idempotency.store: unknown store %q", cfg.Store)
	}
}
