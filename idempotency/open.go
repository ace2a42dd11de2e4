package idempotency

import (
	"context"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/redisclient"
)

// Opened is a store built from config, with what its owner must run and close.
type Opened struct {
	Store  Store
	Memory *Memory // non-nil for the memory store (its metrics)
	stop   func() error
}

// Close stops the store's background work and connections.
func (o *Opened) Close() error { return o.stop() }

// Open builds the configured store and starts its background work. The
// redis store runs over client (the gateway's one client for the redis:
// section conn, which the caller owns); the memory store takes neither.
// A Redis whose TLS refuses the client for good (its certificate does not
// verify, or it refuses the client's certificate) is an error; one that
// refuses the credentials, or is only down, is logged, and /sends are
// refused (or forwarded, with fail_open) until it takes them.
func Open(cfg Config, client redis.UniversalClient, conn redisclient.Config, clk clock.Clock, log *zap.Logger) (*Opened, error) {
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
		r, err := NewRedis(client, conn, cfg.TTL.D(), cfg.ClaimTTL.D(), cfg.MaxDestinationsPerReqID, cfg.MaxOrphanedClaims, clk, log)
		if err != nil {
			return nil, err
		}
		ctx, cancel := context.WithTimeout(context.Background(), conn.DialTimeout.D()+conn.Timeout.D())
		defer cancel()
		var refused *redisclient.RefusedError
		err = redisclient.Check(ctx, client)
		if err == nil {
			r.noteHealth(nil)
		} else {
			r.noteHealth(&unavailableError{op: "check", err: err})
		}
		switch {
		case err == nil:
		case errors.As(err, &refused) && refused.TLS():
			_ = r.Close()
			return nil, fmt.Errorf("redis at %s: %w", conn.Where(), err)
		case errors.As(err, &refused):
			// Redis answers but refuses the credentials: a config or Secret
			// that disagrees with the server's, not an outage.
			log.Error("redis refuses the gateway's credentials (redis.username, password or password_file); /sends are refused until it accepts them",
				zap.String("redis", conn.Where()), zap.Bool("fail_open", cfg.FailOpen), zap.Error(err))
		default:
			log.Warn("redis is not reachable yet; /sends are refused until it is", zap.String("redis", conn.Where()),
				zap.Bool("fail_open", cfg.FailOpen), zap.Error(err))
		}
		r.startHealth(HealthPingInterval)
		return &Opened{Store: r, stop: r.Close}, nil
	default:
		return nil, fmt.Errorf("idempotency.store: unknown store %q", cfg.Store)
	}
}
