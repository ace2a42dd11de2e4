package upstream

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/sglang"
)

// countingClock is a fake clock that counts its Now calls.
type countingClock struct {
	*clock.Fake
	reads atomic.Int64
}

func (c *countingClock) Now() time.Time { c.reads.Add(1); return c.Fake.Now() }

// TestPinnedFollowUpReadsTheClockOnce: a follow-up whose part is pinned
// here, with its start read by the caller (Call.Start, the gateway's one
// read per request), finds its pin and begins its attempt at that start;
// the one read left is the exchange's end (the upstream latency). Before,
// the pin's expiry check and the attempt's start read it as well.
func TestPinnedFollowUpReadsTheClockOnce(t *testing.T) {
	for _, park := range []bool{false, true} {
		enc := liveEncoder(t, "enc-1")
		clk := &countingClock{Fake: clock.NewFake(time.Unix(1e9, 0))}
		p, err := NewPool(testSettings("enc-1", enc.URL), DefaultAffinity(), Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry(),
			Clock: clk, Rand: func() float64 { return 0 }, Park: park})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		id := "clock-reads_part_0"
		if res := p.Exchange(newCall(sglang.RouteEncode, id)); res.Verdict.Kind != KindAnswered {
			t.Fatalf("/encode: %+v", res.Verdict)
		}
		for _, rt := range []*sglang.Route{sglang.RouteReceiveURL, sglang.RouteMetadata} {
			c := newCall(rt, id)
			c.Start = clk.Now()
			before := clk.reads.Load()
			var res Result
			if park {
				var ended bool
				// The encoder answers at once: the call ends where it runs.
				if res, ended = p.ExchangeParked(c, func(Result) { t.Error("parked") }); !ended {
					t.Fatalf("%s parked", rt.Path)
				}
			} else {
				res = p.Exchange(c)
			}
			if res.Verdict.Kind != KindAnswered || res.Verdict.Encoder != "enc-1" {
				t.Fatalf("%s: %+v", rt.Path, res.Verdict)
			}
			if got := clk.reads.Load() - before; got != 1 {
				t.Errorf("park %v, %s: the clock was read %d times, want 1 (the exchange's end)", park, rt.Path, got)
			}
		}
	}
}

// The pin read at the call's start is that time's: a follow-up that comes
// after a quiet spell longer than affinity.pin_ttl does not follow the
// expired pin, parked or not, and goes to its part's rendezvous owner.
func TestFollowUpDoesNotFollowAnExpiredPin(t *testing.T) {
	for _, park := range []bool{false, true} {
		a, b := liveEncoder(t, "enc-a"), liveEncoder(t, "enc-b")
		clk := clock.NewFake(time.Unix(1e9, 0))
		aff := DefaultAffinity()
		aff.UnknownWait = 0
		p, err := NewPool(testSettings("enc-a", a.URL, "enc-b", b.URL), aff, Deps{Log: zap.NewNop(),
			Registry: prometheus.NewRegistry(), Clock: clk, Rand: func() float64 { return 0 }, Park: park})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		id := ownedBy(t, p, "enc-a", "quiet")
		eb, _ := p.Lookup("enc-b")
		p.pins.Set(id, "enc-b", eb.ID()) // pinned away from its owner
		follow := func() string {
			c := newCall(sglang.RouteReceiveURL, id)
			c.Start = clk.Now()
			if park {
				res, ended := p.ExchangeParked(c, func(Result) { t.Error("parked") })
				if !ended {
					t.Fatal("parked")
				}
				return res.Verdict.Encoder
			}
			return p.Exchange(c).Verdict.Encoder
		}
		if got := follow(); got != "enc-b" {
			t.Fatalf("park %v: a follow-up within the pin's life went to %q, want its pin enc-b", park, got)
		}
		clk.Advance(aff.PinTTL.D() + time.Second)
		if got := follow(); got != "enc-a" {
			t.Fatalf("park %v: a follow-up after the pin expired went to %q, want its owner enc-a", park, got)
		}
	}
}
