package idempotency

import (
	"context"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// go-redis probes a Redis that refused PoolSize dials once a second
		// from a goroutine that notices the closed pool only after its sleep.
		goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial"),
	)
}

// lookup adapts Store.Lookup to a nil-able record for assertions.
func lookup(s Store, ctx context.Context, k Key) (*Record, bool, error) {
	rec, found, released, err := s.Lookup(ctx, k)
	if !found {
		return nil, released, err
	}
	return &rec, released, err
}
