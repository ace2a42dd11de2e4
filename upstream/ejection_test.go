package upstream

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/encgate/encgate/internal/clock"
)

// ejectionPool is a pool of n encoders (nothing listens: the breakers are
// fed by hand) with max_ejected_percent pct.
func ejectionPool(t *testing.T, n, pct int) (*Pool, *prometheus.Registry) {
	t.Helper()
	var pairs []string
	for i := 0; i < n; i++ {
		pairs = append(pairs, fmt.Sprintf("enc-%d", i), fmt.Sprintf("http://127.0.0.1:%d", 1+i))
	}
	set := testSettings(pairs...)
	set.Breaker.MaxEjectedPercent = pct
	reg := prometheus.NewRegistry()
	return newTestPool(t, set, reg), reg
}

// tripBreaker feeds e's breaker consecutive_failures faults.
func tripBreaker(t *testing.T, e *Encoder) {
	t.Helper()
	for i := 0; i < e.Breaker.cfg.ConsecutiveFailures; i++ {
		done, ok := e.Breaker.Allow()
		if !ok {
			t.Fatalf("%s refused a request", e.Name)
		}
		done(MarkFault)
	}
}

func ejectedNames(p *Pool) (out []string) {
	for _, e := range p.Encoders() {
		if e.Breaker.Ejected() {
			out = append(out, e.Name)
		}
	}
	return out
}

// max_ejected_percent bounds the ejected share: floor(n × pct / 100) and
// never all of n, n counting the encoders neither down nor draining.
func TestEjectionGateBoundsTheShare(t *testing.T) {
	for _, tc := range []struct {
		n, pct, want int
	}{
		{1, 50, 0}, {1, 100, 0}, {2, 50, 1}, {2, 100, 1}, {3, 50, 1}, {4, 50, 2}, {4, 100, 3},
		{5, 50, 2}, {10, 50, 5}, {4, 0, 0}, {4, 24, 0}, {4, 25, 1},
	} {
		t.Run(fmt.Sprintf("n=%d,pct=%d", tc.n, tc.pct), func(t *testing.T) {
			p, reg := ejectionPool(t, tc.n, tc.pct)
			for _, e := range p.Encoders() {
				tripBreaker(t, e)
			}
			if got := ejectedNames(p); len(got) != tc.want {
				t.Fatalf("ejected %v, want %d of %d", got, tc.want, tc.n)
			}
			skipped := 0
			for _, e := range p.Encoders() {
				s := e.Breaker.Snapshot()
				if s.Ejected != (s.State == BreakerOpen) || s.Skipped+s.Ejections != 1 {
					t.Errorf("%s: %+v", e.Name, s)
				}
				skipped += int(s.Skipped)
				if !s.Ejected && !e.Usable() {
					t.Errorf("%s kept in service but not usable", e.Name)
				}
				v := 0.0
				if s.Ejected {
					v = 1
				}
				if got := gaugeValue(t, reg, "encgate_breaker_ejected", e.Name); got != v {
					t.Errorf("encgate_breaker_ejected{%s} = %v, want %v", e.Name, got, v)
				}
				if got := gaugeValue(t, reg, "encgate_breaker_ejections_skipped_total", e.Name); got != float64(s.Skipped) {
					t.Errorf("encgate_breaker_ejections_skipped_total{%s} = %v, want %v", e.Name, got, s.Skipped)
				}
			}
			if skipped != tc.n-tc.want {
				t.Fatalf("%d trips skipped, want %d", skipped, tc.n-tc.want)
			}
		})
	}
}

// Encoders down by active health, or draining, are outside n; a trip of
// one of them always ejects. A breaker that closes (or stops) gives its
// place back.
func TestEjectionGateCountsServingEncoders(t *testing.T) {
	p, reg := ejectionPool(t, 4, 50) // 2 of 4
	encs := p.Encoders()
	encs[3].SetUsable(false) // down: n = 3, 1 may be ejected
	tripBreaker(t, encs[0])
	tripBreaker(t, encs[1])
	if got := ejectedNames(p); len(got) != 1 || got[0] != "enc-0" {
		t.Fatalf("ejected %v, want enc-0 alone (1 of 3 serving)", got)
	}
	tripBreaker(t, encs[3]) // outside n: ejects, and takes no share
	if !encs[3].Breaker.Ejected() {
		t.Fatal("a down encoder's trip did not eject")
	}
	encs[3].Unforce() // n = 4 again, 2 may be ejected; enc-3 counts now
	tripBreaker(t, encs[2])
	if encs[2].Breaker.Ejected() {
		t.Fatal("a third of four was ejected")
	}
	// enc-0's ejection ends and its trial succeeds: its place is free.
	clk := p.clk.(*clock.Fake)
	clk.Advance(encs[0].Breaker.Snapshot().Ejection)
	done, ok := encs[0].Breaker.Allow()
	if !ok {
		t.Fatal("enc-0 refused its trial")
	}
	done(MarkSuccess)
	if encs[0].Breaker.State() != BreakerClosed || encs[0].Breaker.Ejected() {
		t.Fatalf("enc-0 after a good trial: %+v", encs[0].Breaker.Snapshot())
	}
	tripBreaker(t, encs[2])
	if !encs[2].Breaker.Ejected() {
		t.Fatal("enc-2 was not ejected into the place enc-0 gave back")
	}
	// Draining encoders are outside n, as down ones are: enc-1 and enc-0
	// leave, n = 1 (enc-2 is ejected; enc-3 counts only once it is up and
	// active), nothing more may go.
	drain := p.fleet.Load().set
	drain.Encoders = append([]EncoderConfig(nil), drain.Encoders...)
	drain.Encoders[0].Draining, drain.Encoders[1].Draining = true, true
	if _, _, err := p.Reload(drain); err != nil {
		t.Fatal(err)
	}
	if got := ejectedNames(p); len(got) != 2 || got[0] != "enc-2" || got[1] != "enc-3" {
		t.Fatalf("ejected %v", got)
	}
	// A removed encoder's breaker is stopped: its place goes with it.
	gone := p.fleet.Load().set
	gone.Encoders = gone.Encoders[:2]
	if _, _, err := p.Reload(gone); err != nil {
		t.Fatal(err)
	}
	p.ejections.mu.Lock()
	held := len(p.ejections.ejected)
	p.ejections.mu.Unlock()
	if held != 0 {
		t.Fatalf("the gate still holds %d breakers of removed encoders", held)
	}
	for _, s := range encoderSeries(t, reg) {
		if strings.Contains(s, "encoder=enc-2") || strings.Contains(s, "encoder=enc-3") {
			t.Errorf("a removed encoder's series stayed: %s", s)
		}
	}
	for _, name := range []string{"encgate_breaker_ejected", "encgate_breaker_ejections_total",
		"encgate_breaker_ejections_skipped_total", "encgate_breaker_ejection_seconds"} {
		gaugeValue(t, reg, name, "enc-0") // a staying encoder keeps them
	}
}

// Trips at the same moment cannot both pass: with n encoders tripping
// together, exactly the bound is ejected, every round.
func TestEjectionGateConcurrentTrips(t *testing.T) {
	const n, pct, rounds = 8, 50, 20
	for r := 0; r < rounds; r++ {
		p, _ := ejectionPool(t, n, pct)
		var start, wg sync.WaitGroup
		start.Add(1)
		for _, e := range p.Encoders() {
			// Every encoder one fault short of its trip, then the last
			// faults all at once.
			for i := 0; i < e.Breaker.cfg.ConsecutiveFailures-1; i++ {
				done, _ := e.Breaker.Allow()
				done(MarkFault)
			}
			done, ok := e.Breaker.Allow()
			if !ok {
				t.Fatal("refused")
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				start.Wait()
				done(MarkFault)
			}()
		}
		start.Done()
		wg.Wait()
		if got := ejectedNames(p); len(got) != n*pct/100 {
			t.Fatalf("round %d: ejected %v, want %d of %d", r, got, n*pct/100, n)
		}
		p.Close()
	}
}

// gaugeValue is the value of name{encoder=encoder} in reg (a gauge or a
// counter); it fails when the series is missing.
func gaugeValue(t *testing.T, reg *prometheus.Registry, name, encoder string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == "encoder" && lp.GetValue() == encoder {
					if g := m.GetGauge(); g != nil {
						return g.GetValue()
					}
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	t.Fatalf("no %s{encoder=%q}", name, encoder)
	return 0
}
