package gateway

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/upstream"
)

// oom is the fault of issue 25: every /encode answers 500 "CUDA out of
// memory" while /health answers 200.
var oom = fakeencoder.Faults{FailureRate: 1, FailStatus: http.StatusInternalServerError,
	FailMessage: "CUDA out of memory", FailRoutes: []string{routeEncode}}

// Issue 25, must-show A: at one /encode every 3 s (fake clock), an encoder
// that fails every /encode with 500 while /health answers 200 is ejected
// and stays ejected, its ejections growing, with at most one trial /encode
// per ejection; after the first trip at most 5% of the callers' /encodes
// fail. Once it recovers it is back (breaker closed, taking work) within
// two ejections. Real sockets; the breaker's defaults.
func TestBreakerLowTrafficFailingEncoder(t *testing.T) {
	encs := startFakes(t, 2, nil)
	bad := encs[1]
	bad.SetFaults(oom)
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	g := startGatewayDeps(t, fakeURLs(encs), nil, zap.NewNop(), clk)
	e, _ := g.Pool().Lookup("enc-1")
	cfg := upstream.DefaultBreaker()

	const every = 3 * time.Second
	const failing = 240 // /encodes while enc-1 fails
	var (
		firstTrip           = -1
		failedBefore        int
		sentAfter, failed   int
		lengths             []time.Duration
		trials              = map[uint64]int{} // /encodes enc-1 got after ejection k ended
		recovered, rejoined time.Time
		recoveryEjection    time.Duration
		total               int
	)
	for i := 0; ; i++ {
		clk.Advance(every)
		if i == failing {
			bad.SetFaults(fakeencoder.Faults{})
			recovered, recoveryEjection = clk.Now(), e.Breaker.Snapshot().Ejection
		}
		if i >= failing+400 {
			t.Fatalf("enc-1 not back %s after it recovered: %+v", clk.Now().Sub(recovered), e.Breaker.Snapshot())
		}
		before := e.Breaker.Snapshot()
		got := bad.Stats().Routes[routeEncode]
		a := post(t, g.base+"/encode", encodeBody(fmt.Sprintf("low-%d_local_part_0", i)))
		total++
		reached := bad.Stats().Routes[routeEncode] - got
		after := e.Breaker.Snapshot()
		if after.Ejections > before.Ejections {
			lengths = append(lengths, after.Ejection)
			if firstTrip < 0 {
				firstTrip = i
			}
		}
		if i >= failing {
			if after.State == upstream.BreakerClosed && reached == 1 && a.status == http.StatusOK {
				rejoined = clk.Now()
				break
			}
			continue
		}
		if a.status != http.StatusOK {
			if a.status != http.StatusInternalServerError || !strings.Contains(a.body, "CUDA out of memory") ||
				a.header.Get("X-Encgate-Encoder") != "enc-1" {
				t.Fatalf("/encode %d: %d from %q %s, want enc-1's own 500", i, a.status, a.header.Get("X-Encgate-Encoder"), a.body)
			}
		}
		switch {
		case firstTrip < 0 || i == firstTrip:
			if a.status != http.StatusOK {
				failedBefore++
			}
		default:
			sentAfter++
			if a.status != http.StatusOK {
				failed++
			}
			if reached > 0 {
				if before.State != upstream.BreakerHalfOpen {
					t.Fatalf("/encode %d reached enc-1 with its breaker %s", i, before.State)
				}
				trials[before.Ejections] += int(reached)
			}
		}
	}
	if firstTrip < 0 {
		t.Fatal("enc-1 never tripped")
	}
	for k, n := range trials {
		if n > 1 {
			t.Errorf("after ejection %d enc-1 got %d trial /encodes, want at most 1", k, n)
		}
	}
	for k := 1; k < len(lengths); k++ {
		want := min(time.Duration(k+1)*cfg.BaseEjectionTime.D(), cfg.MaxEjectionTime.D())
		if lengths[k] != want || lengths[k] <= lengths[k-1] && lengths[k] != cfg.MaxEjectionTime.D() {
			t.Errorf("ejection %d lasted %s, want %s (lengths %v)", k+1, lengths[k], want, lengths)
		}
	}
	if len(lengths) < 3 {
		t.Errorf("%d ejections in %s of a failing encoder, want the growth shown over at least 3", len(lengths), failing*every)
	}
	share := float64(failed) / float64(sentAfter)
	if share > 0.05 {
		t.Errorf("%d of %d /encodes after the first trip failed (%.1f%%), want at most 5%%", failed, sentAfter, 100*share)
	}
	back := rejoined.Sub(recovered)
	if back > 2*recoveryEjection {
		t.Errorf("enc-1 back %s after it recovered, want within two ejections (2 x %s)", back, recoveryEjection)
	}
	// It takes its share of new work again.
	served := 0
	for i := 0; i < 20; i++ {
		clk.Advance(every)
		a := post(t, g.base+"/encode", encodeBody(fmt.Sprintf("after-%d_local_part_0", i)))
		if a.status != http.StatusOK {
			t.Fatalf("/encode after recovery: %d %s", a.status, a.body)
		}
		if a.header.Get("X-Encgate-Encoder") == "enc-1" {
			served++
		}
	}
	if served == 0 {
		t.Error("the recovered enc-1 took none of 20 /encodes")
	}
	t.Logf("one /encode every %s, enc-1 failing every /encode with 500 \"CUDA out of memory\" and /health 200 for %d /encodes (%s):",
		every, failing, failing*every)
	t.Logf("  before the first trip (/encode %d): %d failed", firstTrip+1, failedBefore)
	t.Logf("  after it: %d of %d client /encodes failed (%.1f%%); trial /encodes per ejection %v", failed, sentAfter, 100*share, trials)
	t.Logf("  ejections %v", lengths)
	t.Logf("  recovered in ejection of %s; closed and serving %s later (%d /encodes in all); then %d of 20 new /encodes went to it",
		recoveryEjection, back, total, served)
}

// transitionLog is every "breaker state changed" line of one encoder, as
// "from->to"; a line logged below warn reads "from->to (at LEVEL)", which
// no test expects.
func transitionLog(logs *observer.ObservedLogs, encoder string) []string {
	var out []string
	for _, l := range logs.FilterMessage("breaker state changed").All() {
		f := l.ContextMap()
		if f["encoder"] == encoder {
			s := fmt.Sprint(f["from"], "->", f["to"])
			if l.Level != zapcore.WarnLevel {
				s += " (at " + l.Level.String() + ")"
			}
			out = append(out, s)
		}
	}
	return out
}

// Issue 25, must-show B: health probes pass throughout and never close a
// breaker. Every state change is recorded (the breaker's onChange logs
// each); across many passing probes after each ejection the breaker stays
// half-open, and it closes only on a real /encode that succeeded.
func TestBreakerHealthNeverCloses(t *testing.T) {
	encs := startFakes(t, 2, nil)
	bad := encs[1]
	bad.SetFaults(oom)
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	core, logs := observer.New(zapcore.InfoLevel)
	g := startGatewayDeps(t, fakeURLs(encs), func(c *Config) {
		c.Health = upstream.HealthConfig{Path: "/health", Interval: configfile.Duration(time.Second),
			Timeout: configfile.Duration(500 * time.Millisecond), DownAfter: 2, UpAfter: 2}
		c.Breaker.ConsecutiveFailures = 2
		c.Breaker.BaseEjectionTime = configfile.Duration(5 * time.Second)
	}, zap.New(core), clk)
	e, _ := g.Pool().Lookup("enc-1")
	var checks [2]uint64
	// probe runs one round of health checks: every loop parked on the
	// clock (one per encoder, the pin and /send sweepers, and enc-1's
	// ejection timer while it is open), then a second, then each probe.
	probe := func() {
		t.Helper()
		eventually(t, "every timer parked on the clock", func() bool {
			n := len(encs) + 2
			if e.Breaker.Snapshot().State == upstream.BreakerOpen {
				n++
			}
			return clk.Pending() == n
		})
		clk.Advance(time.Second)
		for i, enc := range g.Pool().Encoders() {
			checks[i]++
			eventually(t, enc.Name+"'s probe", func() bool { return enc.Health.Snapshot().Checks >= checks[i] })
			if s := enc.Health.Snapshot(); !s.Up || s.LastError != "" {
				t.Fatalf("%s's probe failed: %+v", enc.Name, s)
			}
		}
	}
	encode := func(prefix string) answer {
		t.Helper()
		return post(t, g.base+"/encode", encodeBody(ownedBy(t, g, "enc-1", prefix)))
	}
	// Passing probes across the end of an ejection and well past it: the
	// breaker turns half-open and stays so.
	probesThrough := func() {
		t.Helper()
		for k := 0; k < 3*int(e.Breaker.Snapshot().Ejection/time.Second); k++ {
			probe()
			if st := e.Breaker.State(); st == upstream.BreakerClosed {
				t.Fatalf("a passing probe closed the breaker (round %d)", k)
			}
		}
		if st := e.Breaker.State(); st != upstream.BreakerHalfOpen {
			t.Fatalf("after its ejection and passing probes the breaker is %s, want half_open", st)
		}
	}

	encode("trip-a")
	encode("trip-b")
	if st := e.Breaker.State(); st != upstream.BreakerOpen {
		t.Fatalf("after 2 faults the breaker is %s", st)
	}
	probesThrough()
	if a := encode("trial-1"); a.status != http.StatusInternalServerError {
		t.Fatalf("the failing trial: %d %s", a.status, a.body)
	}
	if st := e.Breaker.State(); st != upstream.BreakerOpen {
		t.Fatalf("after a failed trial the breaker is %s", st)
	}
	bad.SetFaults(fakeencoder.Faults{}) // recovered
	probesThrough()
	beforeSuccess := transitionLog(logs, "enc-1")
	if a := encode("trial-2"); a.status != http.StatusOK || a.header.Get("X-Encgate-Encoder") != "enc-1" {
		t.Fatalf("the good trial: %d from %q %s", a.status, a.header.Get("X-Encgate-Encoder"), a.body)
	}
	all := transitionLog(logs, "enc-1")
	want := []string{"closed->open", "open->half_open", "half_open->open", "open->half_open", "half_open->closed"}
	if fmt.Sprint(all) != fmt.Sprint(want) {
		t.Fatalf("enc-1's state changes %v, want %v", all, want)
	}
	for _, tr := range beforeSuccess {
		if strings.HasSuffix(tr, "->closed") {
			t.Fatalf("%s before any real request succeeded (changes %v)", tr, beforeSuccess)
		}
	}
	t.Logf("%d health rounds passed; enc-1's state changes %v, ->closed only after the successful /encode", checks[1], all)
}

// Issue 25, must-show C: every encoder fails every /encode. At most
// max_ejected_percent of the fleet is ejected; the rest stays in service
// and the callers get the encoders' own 500s, never "no usable encoder".
func TestBreakerWholeFleetFailing(t *testing.T) {
	const n = 4
	encs := startFakes(t, n, func(_ int, o *fakeencoder.Options) { o.Faults = oom })
	clk := clock.NewFake(time.Unix(1_700_000_000, 0))
	g := startGatewayDeps(t, fakeURLs(encs), nil, zap.NewNop(), clk)
	limit := n * upstream.DefaultBreaker().MaxEjectedPercent / 100
	most, statuses := 0, map[int]int{}
	for i := 0; i < 300; i++ {
		clk.Advance(3 * time.Second)
		a := post(t, g.base+"/encode", encodeBody(fmt.Sprintf("fleet-%d_local_part_0", i)))
		statuses[a.status]++
		if a.status != http.StatusInternalServerError || !strings.Contains(a.body, "CUDA out of memory") ||
			!strings.HasPrefix(a.header.Get("X-Encgate-Encoder"), "enc-") {
			t.Fatalf("/encode %d: %d from %q %s, want an encoder's own 500", i, a.status, a.header.Get("X-Encgate-Encoder"), a.body)
		}
		ejected := 0
		for _, e := range g.Pool().Encoders() {
			if e.Breaker.Snapshot().Ejected {
				ejected++
			}
		}
		if ejected > limit {
			t.Fatalf("/encode %d: %d of %d encoders ejected, max_ejected_percent allows %d", i, ejected, n, limit)
		}
		most = max(most, ejected)
	}
	skipped := seriesValue(t, g, "encgate_breaker_ejections_skipped_total")
	ejections := seriesValue(t, g, "encgate_breaker_ejections_total")
	if most != limit || skipped == 0 {
		t.Errorf("at most %d ejected at once and %v trips kept in service, want %d and some", most, skipped, limit)
	}
	t.Logf("%d encoders all failing, 300 /encodes: answers %v; at most %d ejected at once (bound %d); %v ejections, %v trips kept in service",
		n, statuses, most, limit, ejections, skipped)
}
