package idempotency

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/redistest"
)

// tripCounter is a redis.Hook counting round trips: a command or a
// pipeline each.
type tripCounter struct{ n atomic.Int64 }

func (c *tripCounter) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) { return next(ctx, network, addr) }
}

func (c *tripCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { c.n.Add(1); return next(ctx, cmd) }
}

func (c *tripCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error { c.n.Add(1); return next(ctx, cmds) }
}

// Over Redis, Sends asks the store Claim alone: a first-time /send costs
// one round trip before it is forwarded and one after (its answer stored),
// a replay and a destination after release one each, and Replay (the
// in-process fast path) none. gateway's TestRedisRoundTripsPerFlow counts
// the same through a whole gateway.
func TestRedisSendsRoundTrips(t *testing.T) {
	srv := redistest.Start(t)
	st := newRedisStore(t, srv, redisOpts{})
	trips := &tripCounter{}
	st.c.AddHook(trips)
	s := NewSends(st, DefaultConfig(), clock.Real{}, zap.NewNop(), NewMetrics(prometheus.NewRegistry(), nil))
	ctx := context.Background()
	deadline := time.Now().Add(hangGuard)
	// Every script is sent whole once per Redis (NOSCRIPT, then EVAL): not
	// what is measured here.
	warm := Send{Key: Key{ReqID: "warm", Dest: "10.0.0.1:1"}, FP: fpN(1), ReceiveCount: 1}
	s.Do(ctx, warm, deadline, func(time.Duration) (Answer, bool) { return okAnswer, true })
	s.Do(ctx, Send{Key: Key{ReqID: "warm", Dest: "10.0.0.1:2"}, FP: fpN(1), ReceiveCount: 1}, deadline, nil)

	cost := func(what string, want int64, f func()) {
		t.Helper()
		before := trips.n.Load()
		f()
		if got := trips.n.Load() - before; got != want {
			t.Errorf("%s: %d round trips, want %d", what, got, want)
		}
	}
	first := Send{Key: Key{ReqID: "r", Dest: "10.0.0.1:40000"}, FP: fpN(2), ReceiveCount: 2}
	cost("a first-time /send", 2, func() {
		before := trips.n.Load()
		res := s.Do(ctx, first, deadline, func(time.Duration) (Answer, bool) {
			if n := trips.n.Load() - before; n != 1 {
				t.Errorf("a first-time /send made %d round trips before it was forwarded, want 1", n)
			}
			return okAnswer, true
		})
		if res.Outcome != Forwarded {
			t.Errorf("first-time /send: outcome %v", res.Outcome)
		}
	})
	cost("Replay of a stored /send on a remote store", 0, func() {
		if _, ok := s.Replay(ctx, first); ok {
			t.Error("Replay answered from Redis")
		}
	})
	cost("a replayed /send", 1, func() {
		if res := s.Do(ctx, first, deadline, nil); res.Outcome != Replayed {
			t.Errorf("replay: outcome %v", res.Outcome)
		}
	})
	cost("a replay with another payload", 1, func() {
		if res := s.Do(ctx, Send{Key: first.Key, FP: fpN(3), ReceiveCount: 2}, deadline, nil); res.Outcome != Conflict {
			t.Errorf("conflict: outcome %v", res.Outcome)
		}
	})
	second := Send{Key: Key{ReqID: "r", Dest: "10.0.0.1:40001"}, FP: fpN(2), ReceiveCount: 2}
	cost("the releasing /send", 2, func() {
		if res := s.Do(ctx, second, deadline, func(time.Duration) (Answer, bool) { return okAnswer, true }); !res.Released {
			t.Errorf("the second of two destinations did not release: %+v", res)
		}
	})
	cost("a new destination after release", 1, func() {
		if res := s.Do(ctx, Send{Key: Key{ReqID: "r", Dest: "10.0.0.1:40002"}, FP: fpN(2), ReceiveCount: 2}, deadline, nil); res.Outcome != Released {
			t.Errorf("after release: outcome %v", res.Outcome)
		}
	})
}
