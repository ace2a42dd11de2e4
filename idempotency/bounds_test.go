package idempotency

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/redistest"
)

// metricValue is the value of the series of name whose labels include the
// given name/value pairs, summed; 0 when there is none.
func metricValue(t *testing.T, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, lp := range m.GetLabel() {
					found = found || lp.GetName() == labels[i] && lp.GetValue() == labels[i+1]
				}
				if !found {
					continue series
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}

// One req_id with 20,000 destinations: the first ones up to the bound are
// forwarded, every one after is refused before forwarding with an error
// naming the bound, the store holds no more than the bound (and its
// capacity), and the req_id's done destinations still replay.
func TestMemoryOneReqIDStaysWithinCapacityAndTheDestinationBound(t *testing.T) {
	const dests = 20_000
	for _, tc := range []struct {
		capacity, maxDests, want int
		bound                    string
	}{
		{capacity: 64, maxDests: 1024, want: 64, bound: "idempotency.capacity"},
		{capacity: 1_000_000, maxDests: 1024, want: 1024, bound: "idempotency.max_destinations_per_req_id"},
	} {
		t.Run(fmt.Sprintf("capacity=%d", tc.capacity), func(t *testing.T) {
			clk := clock.NewFake(t0)
			mem := NewMemory(tc.capacity, tc.maxDests, time.Hour, clk)
			reg := prometheus.NewRegistry()
			s := NewSends(mem, DefaultConfig(), clk, zap.NewNop(), NewMetrics(reg, mem))
			forwards := 0
			fwd := func(time.Duration) (Answer, bool) { forwards++; return okAnswer, true }
			deadline := clk.Now().Add(time.Hour)
			for i := range dests {
				res := s.Do(bg, Send{Key: NewKey("many_local_part_0", "10.0.0.1", 1+i)}, deadline, fwd)
				if i < tc.want {
					if res.Outcome != Forwarded {
						t.Fatalf("destination %d: outcome %v (%v)", i, res.Outcome, res.Err)
					}
					continue
				}
				var limit *DestinationLimitError
				if res.Outcome != Failed || res.Status != 400 || !errors.As(res.Err, &limit) ||
					limit.Limit != tc.want || limit.Bound != tc.bound || !strings.Contains(res.Err.Error(), tc.bound) {
					t.Fatalf("destination %d: %+v, want a 400 naming %s (%d)", i, res, tc.bound, tc.want)
				}
			}
			if forwards != tc.want {
				t.Fatalf("%d forwards, want %d", forwards, tc.want)
			}
			if got := mem.Records(); got != int64(tc.want) || got > int64(tc.capacity) {
				t.Fatalf("%d records held, want %d (capacity %d)", got, tc.want, tc.capacity)
			}
			if got := metricValue(t, reg, "encgate_send_destinations_refused_total"); got != dests-float64(tc.want) {
				t.Errorf("encgate_send_destinations_refused_total = %v, want %d", got, dests-tc.want)
			}
			if res := s.Do(bg, Send{Key: NewKey("many_local_part_0", "10.0.0.1", tc.want)}, deadline, fwd); res.Outcome != Replayed {
				t.Errorf("a done destination: %v", res.Outcome)
			}
			if res := s.Do(bg, Send{Key: NewKey("other_local_part_0", "10.0.0.1", 1)}, deadline, fwd); res.Outcome != Forwarded {
				t.Errorf("another req_id: %v", res.Outcome)
			}
		})
	}
}

// boundedStores runs f against a memory store and a Redis store, each
// bounding a req_id at maxDests destinations.
func boundedStores(t *testing.T, maxDests int, f func(t *testing.T, st Store)) {
	t.Run("memory", func(t *testing.T) {
		f(t, NewMemory(1_000_000, maxDests, time.Hour, clock.NewFake(t0)))
	})
	t.Run("redis", func(t *testing.T) {
		f(t, newRedisStore(t, redistest.Start(t), redisOpts{maxDests: maxDests}))
	})
}

// The bound counts claims in flight, not only records: destinations
// claimed at once cannot pass it together. An abandoned claim stops
// counting; a done destination is never refused.
func TestDestinationBoundCountsClaimsInFlight(t *testing.T) {
	boundedStores(t, 4, func(t *testing.T, st Store) {
		k := func(i int) Key { return NewKey("fly", "10.0.0.1", 40000+i) }
		for i := range 4 {
			if c, err := st.Claim(bg, k(i), Fingerprint{}); err != nil || c.State != StateClaimed {
				t.Fatalf("claim %d: %+v, %v", i, c, err)
			}
		}
		var limit *DestinationLimitError
		if _, err := st.Claim(bg, k(4), Fingerprint{}); !errors.As(err, &limit) || limit.Limit != 4 {
			t.Fatalf("fifth claim while four are in flight: %v", err)
		}
		if err := st.Abandon(bg, k(0)); err != nil {
			t.Fatal(err)
		}
		if c, err := st.Claim(bg, k(4), Fingerprint{}); err != nil || c.State != StateClaimed {
			t.Fatalf("claim after an abandon: %+v, %v", c, err)
		}
		for i := 1; i <= 4; i++ {
			if _, err := st.Complete(bg, k(i), okRec(Fingerprint{}), 0); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := st.Claim(bg, k(5), Fingerprint{}); !errors.As(err, &limit) {
			t.Fatalf("a fifth destination after four done: %v", err)
		}
		if c, err := st.Claim(bg, k(2), Fingerprint{}); err != nil || c.State != StateRecorded {
			t.Fatalf("a done destination at the bound: %+v, %v", c, err)
		}
	})
}

// A replica that crashed holding claims does not hold its req_id's
// destination budget past claim_ttl.
func TestRedisDestinationBoundForgetsLapsedClaims(t *testing.T) {
	srv := redistest.Start(t)
	const claimTTL = 200 * time.Millisecond
	crashed := newRedisStore(t, srv, redisOpts{maxDests: 2, claimTTL: claimTTL})
	r := newRedisStore(t, srv, redisOpts{maxDests: 2, claimTTL: claimTTL})
	mustClaim(t, crashed, Key{"lapse", "h:1"}, fpN(1), StateClaimed)
	mustClaim(t, crashed, Key{"lapse", "h:2"}, fpN(1), StateClaimed)
	var limit *DestinationLimitError
	if _, err := r.Claim(bg, Key{"lapse", "h:3"}, fpN(1)); !errors.As(err, &limit) {
		t.Fatalf("third destination while two are claimed: %v", err)
	}
	// Redis expires the claims by its own clock.
	waitFor(t, "the crashed replica's claims to lapse", func() bool {
		c, err := r.Claim(bg, Key{"lapse", "h:3"}, fpN(1))
		return err == nil && c.State == StateClaimed
	})
}

// BenchmarkMemoryLookupManyDestinations looks up one destination of a
// req_id holding n of them: with the index past linearDests the cost stays
// flat in n (before it, a /send on a req_id with 20,000 destinations
// scanned them all under the shard lock).
func BenchmarkMemoryLookupManyDestinations(b *testing.B) {
	for _, n := range []int{1, 8, 16, 64, 1024, 20000} {
		b.Run(fmt.Sprintf("dests=%d", n), func(b *testing.B) {
			m := NewMemory(1_000_000, maxDestinationsLimit, time.Hour, clock.NewFake(t0))
			keys := make([]Key, n)
			for i := range keys {
				keys[i] = NewKey("many_local_part_0", "10.0.0.1", 1+i)
				_, _ = m.Complete(bg, keys[i], okRec(Fingerprint{}), 0)
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, found, _, _ := m.Lookup(bg, keys[i%n]); !found {
					b.Fatal("not found")
				}
			}
		})
	}
}
