package discovery

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/dnstest"
)

// failsafe only keeps a broken test from hanging until go test's own
// timeout; nothing waits for it in a passing run.
const failsafe = 30 * time.Second

// run is a DNS source running on a fake clock, its updates collected.
type run struct {
	fc      *clock.Fake
	reg     *prometheus.Registry
	logs    *observer.ObservedLogs
	updates chan []Member
	created <-chan struct{} // closed when the round in progress has ended
	cancel  context.CancelFunc
	done    chan struct{}
}

// startRun starts Run for cfgs; the test's cleanup stops it and checks
// that it returned.
func startRun(t *testing.T, cfgs ...DNSConfig) *run {
	t.Helper()
	core, logs := observer.New(zapcore.InfoLevel)
	r := &run{
		fc:      clock.NewFake(time.Unix(1_700_000_000, 0)),
		reg:     prometheus.NewRegistry(),
		logs:    logs,
		updates: make(chan []Member, 64),
		done:    make(chan struct{}),
	}
	d := NewDNS(cfgs, DNSDeps{Log: zap.New(core), Registry: r.reg, Clock: r.fc})
	r.created = r.fc.TimerCreated()
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go func() {
		defer close(r.done)
		d.Run(ctx, func(m []Member) { r.updates <- m })
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.done:
		case <-time.After(failsafe):
			t.Error("Run did not return after its context was cancelled")
		}
	})
	return r
}

// endRound waits until the round in progress is over. Run makes the timer
// for its next round only after calling update, so every update of the
// round is in r.updates by then.
func (r *run) endRound(t *testing.T) {
	t.Helper()
	select {
	case <-r.created:
	case <-r.done:
		t.Fatal("Run returned")
	case <-time.After(failsafe):
		t.Fatal("the round did not end")
	}
}

// advance moves the clock by d, starting the rounds due by then, and waits
// for the round to end.
func (r *run) advance(t *testing.T, d time.Duration) {
	t.Helper()
	r.created = r.fc.TimerCreated()
	r.fc.Advance(d)
	r.endRound(t)
}

// update returns the one update of the last round; it fails the test if
// there was none or more than one.
func (r *run) update(t *testing.T) []Member {
	t.Helper()
	select {
	case m := <-r.updates:
		select {
		case more := <-r.updates:
			t.Fatalf("two updates in one round: %v then %v", m, more)
		default:
		}
		return m
	default:
		t.Fatal("no update")
		return nil
	}
}

// noUpdate fails the test if the last round called update.
func (r *run) noUpdate(t *testing.T) {
	t.Helper()
	select {
	case m := <-r.updates:
		t.Fatalf("unexpected update %v", m)
	default:
	}
}

// errorsCounted reads encgate_discovery_errors_total{source="dns"} from the
// run's registry (discoveryErrors hands back the vector Run registered).
func (r *run) errorsCounted() float64 {
	return testutil.ToFloat64(discoveryErrors(r.reg).WithLabelValues("dns"))
}

// members is what update should get for hostports, sorted by Name.
func members(scheme string, hostports ...string) []Member {
	out := []Member{}
	for _, hp := range hostports {
		out = append(out, Member{Name: hp, URL: scheme + "://" + hp, Source: "dns"})
	}
	slices.SortFunc(out, func(a, b Member) int { return strings.Compare(a.Name, b.Name) })
	return out
}

func wantMembers(t *testing.T, got, want []Member) {
	t.Helper()
	if got == nil || !slices.Equal(got, want) {
		t.Fatalf("members = %#v, want %#v", got, want)
	}
}

func dnsConfig(name, resolver string) DNSConfig {
	c := DefaultDNS()
	c.Name, c.Port, c.Resolver = name, 8000, resolver
	return c
}

func TestDNSFollowsAnswers(t *testing.T) {
	srv := dnstest.Start(t)
	const name = "encoders.encgate.test"
	srv.Set(name, "127.0.0.2", "127.0.0.3")
	r := startRun(t, dnsConfig(name, srv.Addr()))
	interval := DefaultDNS().Interval.D()

	r.endRound(t)
	wantMembers(t, r.update(t), members("http", "127.0.0.2:8000", "127.0.0.3:8000"))

	r.advance(t, interval) // the same answer: nothing to tell
	r.noUpdate(t)

	srv.Set(name, "127.0.0.2")
	r.advance(t, interval)
	wantMembers(t, r.update(t), members("http", "127.0.0.2:8000"))

	srv.Fail(name, dns.RcodeServerFailure)
	before := srv.QueryCount(name)
	r.advance(t, interval)
	r.noUpdate(t) // the last fleet stands
	if srv.QueryCount(name) == before {
		t.Fatal("the round sent no query")
	}
	if got := r.errorsCounted(); got != 1 {
		t.Fatalf("discovery errors = %v, want 1", got)
	}
	warned := r.logs.FilterLevelExact(zapcore.WarnLevel).FilterField(zap.String("name", name)).All()
	if len(warned) != 1 || warned[0].ContextMap()["error"] == nil {
		t.Fatalf("want one warning naming %s with its error, got %v", name, warned)
	}

	srv.NXDomain(name) // an answer: the name has no encoders now
	r.advance(t, interval)
	wantMembers(t, r.update(t), []Member{})
	if got := r.errorsCounted(); got != 1 {
		t.Fatalf("discovery errors = %v after NXDOMAIN, want still 1", got)
	}

	srv.Set(name, "127.0.0.4")
	r.advance(t, interval)
	wantMembers(t, r.update(t), members("http", "127.0.0.4:8000"))

	srv.Set(name) // NOERROR without addresses: an answer too
	r.advance(t, interval)
	wantMembers(t, r.update(t), []Member{})
	if got := r.errorsCounted(); got != 1 {
		t.Fatalf("discovery errors = %v after an empty answer, want still 1", got)
	}
}

// TestDNSFailureKeepsLastAnswer has two names on two DNS servers: while
// one's lookups fail in some way, the other's changes still come through,
// with the failing name's last answer in the union.
func TestDNSFailureKeepsLastAnswer(t *testing.T) {
	const a, b = "a.encgate.test", "b.encgate.test"
	for _, tc := range []struct {
		kind    string
		fail    func(*dnstest.Server)
		recover bool
	}{
		{"servfail", func(s *dnstest.Server) { s.Fail(a, dns.RcodeServerFailure) }, true},
		{"refused", func(s *dnstest.Server) { s.Fail(a, dns.RcodeRefused) }, true},
		{"timeout", func(s *dnstest.Server) { s.Silence(a) }, true},
		{"server gone", (*dnstest.Server).Stop, false},
	} {
		t.Run(tc.kind, func(t *testing.T) {
			srvA, srvB := dnstest.Start(t), dnstest.Start(t)
			srvA.Set(a, "127.0.0.2")
			srvB.Set(b, "127.0.0.3")
			ca, cb := dnsConfig(a, srvA.Addr()), dnsConfig(b, srvB.Addr())
			// A 1s interval bounds each lookup by 1s of real time, the
			// wait for the timeout case.
			ca.Interval = configfile.Duration(time.Second)
			cb.Interval = ca.Interval
			r := startRun(t, ca, cb)
			r.endRound(t)
			wantMembers(t, r.update(t), members("http", "127.0.0.2:8000", "127.0.0.3:8000"))

			tc.fail(srvA)
			srvB.Set(b, "127.0.0.3", "127.0.0.4")
			r.advance(t, time.Second)
			wantMembers(t, r.update(t), members("http", "127.0.0.2:8000", "127.0.0.3:8000", "127.0.0.4:8000"))
			if got := r.errorsCounted(); got != 1 {
				t.Fatalf("discovery errors = %v, want 1", got)
			}
			if n := r.logs.FilterLevelExact(zapcore.WarnLevel).FilterField(zap.String("name", a)).Len(); n != 1 {
				t.Fatalf("%d warnings naming %s, want 1", n, a)
			}
			if n := r.logs.FilterLevelExact(zapcore.WarnLevel).FilterField(zap.String("name", b)).Len(); n != 0 {
				t.Fatalf("%d warnings naming %s, want none", n, b)
			}

			r.advance(t, time.Second) // still failing, nothing changed
			r.noUpdate(t)
			if got := r.errorsCounted(); got != 2 {
				t.Fatalf("discovery errors = %v, want 2", got)
			}
			if !tc.recover {
				return
			}

			srvA.Set(a, "127.0.0.5")
			r.advance(t, time.Second)
			wantMembers(t, r.update(t), members("http", "127.0.0.3:8000", "127.0.0.4:8000", "127.0.0.5:8000"))
			if got := r.errorsCounted(); got != 2 {
				t.Fatalf("discovery errors = %v after recovery, want still 2", got)
			}
			if n := r.logs.FilterMessageSnippet("answered again").FilterField(zap.String("name", a)).Len(); n != 1 {
				t.Fatalf("%d recovery logs for %s, want 1", n, a)
			}
		})
	}
}

// TestDNSFirstRoundAlwaysUpdates: the first round tells its result even
// when it is empty, so the caller knows discovery has run.
func TestDNSFirstRoundAlwaysUpdates(t *testing.T) {
	t.Run("nxdomain", func(t *testing.T) {
		srv := dnstest.Start(t)
		r := startRun(t, dnsConfig("none.encgate.test", srv.Addr()))
		r.endRound(t)
		wantMembers(t, r.update(t), []Member{})
		if got := r.errorsCounted(); got != 0 {
			t.Fatalf("discovery errors = %v, want 0", got)
		}
	})
	t.Run("failure", func(t *testing.T) {
		srv := dnstest.Start(t)
		srv.Fail("down.encgate.test", dns.RcodeServerFailure)
		r := startRun(t, dnsConfig("down.encgate.test", srv.Addr()))
		r.endRound(t)
		wantMembers(t, r.update(t), []Member{})
		if got := r.errorsCounted(); got != 1 {
			t.Fatalf("discovery errors = %v, want 1", got)
		}
	})
	t.Run("no names", func(t *testing.T) {
		reg := prometheus.NewRegistry()
		d := NewDNS(nil, DNSDeps{Registry: reg, Clock: clock.NewFake(time.Unix(0, 0))})
		ctx, cancel := context.WithCancel(context.Background())
		got := make(chan []Member, 2)
		done := make(chan struct{})
		go func() { defer close(done); d.Run(ctx, func(m []Member) { got <- m }) }()
		select {
		case m := <-got:
			wantMembers(t, m, []Member{})
		case <-time.After(failsafe):
			t.Fatal("no update")
		}
		cancel()
		select {
		case <-done:
		case <-time.After(failsafe):
			t.Fatal("Run did not return")
		}
		if len(got) != 0 {
			t.Fatalf("more updates: %v", <-got)
		}
	})
}

// TestDNSIPv6TCPAndDedup covers AAAA answers (bracketed names), an answer
// too big for UDP (the resolver retries over TCP) and an address found
// under two names (one member, the first name's scheme).
func TestDNSIPv6TCPAndDedup(t *testing.T) {
	srv := dnstest.Start(t)
	const v6, big = "v6.encgate.test", "big.encgate.test"
	srv.Set(v6, "127.0.0.2", "fd00::5")
	var bigIPs, want []string
	for i := range 150 {
		ip := fmt.Sprintf("127.0.%d.%d", 1+i/100, 1+i%100)
		bigIPs = append(bigIPs, ip)
		want = append(want, ip+":8000")
	}
	srv.Set(big, append(bigIPs, "127.0.0.2")...)
	c1 := dnsConfig(v6, srv.Addr())
	c1.Scheme = "https"
	r := startRun(t, c1, dnsConfig(big, srv.Addr()))
	r.endRound(t)

	wantAll := append(members("http", want...), members("https", "127.0.0.2:8000", "[fd00::5]:8000")...)
	slices.SortFunc(wantAll, func(a, b Member) int { return strings.Compare(a.Name, b.Name) })
	wantMembers(t, r.update(t), wantAll)
	if srv.TCPQueries() == 0 {
		t.Fatal("the big answer did not go over TCP")
	}
}

// TestDNSIntervalsPerName: each name is looked up on its own interval.
func TestDNSIntervalsPerName(t *testing.T) {
	srv := dnstest.Start(t)
	const fast, slow = "fast.encgate.test", "slow.encgate.test"
	srv.Set(fast, "127.0.0.2")
	srv.Set(slow, "127.0.0.3")
	cf, cs := dnsConfig(fast, srv.Addr()), dnsConfig(slow, srv.Addr())
	cf.Interval = configfile.Duration(10 * time.Second)
	cs.Interval = configfile.Duration(15 * time.Second)
	r := startRun(t, cf, cs)
	r.endRound(t)
	wantMembers(t, r.update(t), members("http", "127.0.0.2:8000", "127.0.0.3:8000"))

	f, s := srv.QueryCount(fast), srv.QueryCount(slow)
	srv.Set(slow, "127.0.0.4") // not looked up until 15s
	r.advance(t, 10*time.Second)
	r.noUpdate(t)
	if srv.QueryCount(fast) == f || srv.QueryCount(slow) != s {
		t.Fatalf("at 10s: fast queries %d -> %d, slow %d -> %d; want only fast looked up",
			f, srv.QueryCount(fast), s, srv.QueryCount(slow))
	}
	f = srv.QueryCount(fast)
	r.advance(t, 5*time.Second)
	wantMembers(t, r.update(t), members("http", "127.0.0.2:8000", "127.0.0.4:8000"))
	if srv.QueryCount(fast) != f || srv.QueryCount(slow) == s {
		t.Fatalf("at 15s: fast queries %d -> %d, slow %d -> %d; want only slow looked up",
			f, srv.QueryCount(fast), s, srv.QueryCount(slow))
	}
}

// TestDNSCancelDuringLookup: a lookup cut short by the end of Run is not
// a discovery error and produces no update.
func TestDNSCancelDuringLookup(t *testing.T) {
	srv := dnstest.Start(t)
	const name = "slow.encgate.test"
	srv.Set(name, "127.0.0.2")
	r := startRun(t, dnsConfig(name, srv.Addr()))
	r.endRound(t)
	wantMembers(t, r.update(t), members("http", "127.0.0.2:8000"))

	srv.Silence(name)
	r.created = r.fc.TimerCreated()
	r.fc.Advance(DefaultDNS().Interval.D())
	select {
	case <-srv.Dropped(): // the lookup is waiting for an answer
	case <-time.After(failsafe):
		t.Fatal("no query reached the server")
	}
	r.cancel()
	select {
	case <-r.done:
	case <-time.After(failsafe):
		t.Fatal("Run did not return")
	}
	r.noUpdate(t)
	if got := r.errorsCounted(); got != 0 {
		t.Fatalf("discovery errors = %v, want 0", got)
	}
}

func TestDNSDiscoveryErrorsShared(t *testing.T) {
	reg := prometheus.NewRegistry()
	v1 := discoveryErrors(reg)
	v2 := discoveryErrors(reg) // a second source on the same registry
	v1.WithLabelValues("registered").Inc()
	if got := testutil.ToFloat64(v2.WithLabelValues("registered")); got != 1 {
		t.Fatalf("the second caller got another vector: count %v, want 1", got)
	}
	if n, err := testutil.GatherAndCount(reg, "encgate_discovery_errors_total"); err != nil || n != 1 {
		t.Fatalf("gathered %d series (%v), want 1", n, err)
	}

	clash := prometheus.NewRegistry()
	clash.MustRegister(prometheus.NewGauge(prometheus.GaugeOpts{Name: "encgate_discovery_errors_total", Help: "not ours"}))
	defer func() {
		if recover() == nil {
			t.Fatal("a different collector under the name did not panic")
		}
	}()
	discoveryErrors(clash)
}

func TestDNSConfigValidate(t *testing.T) {
	valid := func() DNSConfig {
		c := DefaultDNS()
		c.Name, c.Port = "encoders.ns.svc.cluster.local", 30000
		return c
	}
	for _, tc := range []struct {
		desc  string
		edit  func(*DNSConfig)
		field string // "" for valid
		msg   string
	}{
		{"defaults with name and port", func(*DNSConfig) {}, "", ""},
		{"absolute name", func(c *DNSConfig) { c.Name = "encoders.ns.svc.cluster.local." }, "", ""},
		{"single label", func(c *DNSConfig) { c.Name = "encoders" }, "", ""},
		{"https", func(c *DNSConfig) { c.Scheme = "https" }, "", ""},
		{"resolver", func(c *DNSConfig) { c.Resolver = "10.96.0.10:53" }, "", ""},
		{"ipv6 resolver", func(c *DNSConfig) { c.Resolver = "[fd00::a]:53" }, "", ""},
		{"resolver by name", func(c *DNSConfig) { c.Resolver = "kube-dns.kube-system:53" }, "", ""},
		{"interval 1s", func(c *DNSConfig) { c.Interval = configfile.Duration(time.Second) }, "", ""},
		{"port 65535", func(c *DNSConfig) { c.Port = 65535 }, "", ""},

		{"no name", func(c *DNSConfig) { c.Name = "" }, "name", "must not be empty"},
		{"only a dot", func(c *DNSConfig) { c.Name = "." }, "name", "1 to 253"},
		{"empty label", func(c *DNSConfig) { c.Name = "a..b" }, "name", "1 to 63"},
		{"long label", func(c *DNSConfig) { c.Name = strings.Repeat("x", 64) + ".test" }, "name", "1 to 63"},
		{"long name", func(c *DNSConfig) { c.Name = strings.Repeat(strings.Repeat("x", 60)+".", 5) + "test" }, "name", "1 to 253"},
		{"hyphen", func(c *DNSConfig) { c.Name = "-encoders.test" }, "name", "hyphen"},
		{"url", func(c *DNSConfig) { c.Name = "http://encoders:8000" }, "name", "only letters"},
		{"space", func(c *DNSConfig) { c.Name = "enc oders" }, "name", "only letters"},
		{"no port", func(c *DNSConfig) { c.Port = 0 }, "port", "1..65535, got 0"},
		{"port too big", func(c *DNSConfig) { c.Port = 65536 }, "port", "1..65535, got 65536"},
		{"scheme", func(c *DNSConfig) { c.Scheme = "grpc" }, "scheme", `http or https, got "grpc"`},
		{"empty scheme", func(c *DNSConfig) { c.Scheme = "" }, "scheme", "http or https"},
		{"zero interval", func(c *DNSConfig) { c.Interval = 0 }, "interval", ">= 1s, got 0s"},
		{"short interval", func(c *DNSConfig) { c.Interval = configfile.Duration(500 * time.Millisecond) }, "interval", ">= 1s, got 500ms"},
		{"resolver without port", func(c *DNSConfig) { c.Resolver = "10.96.0.10" }, "resolver", "host:port"},
		{"resolver named port", func(c *DNSConfig) { c.Resolver = "10.96.0.10:domain" }, "resolver", "number"},
		{"resolver port 0", func(c *DNSConfig) { c.Resolver = "10.96.0.10:0" }, "resolver", "number"},
		{"resolver without host", func(c *DNSConfig) { c.Resolver = ":53" }, "resolver", "host"},
	} {
		t.Run(tc.desc, func(t *testing.T) {
			c := valid()
			tc.edit(&c)
			var p configfile.Problems
			c.Validate(&p, "discovery.dns[0]")
			err := p.Err()
			if tc.field == "" {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate accepted %+v", c)
			}
			want := "discovery.dns[0]." + tc.field + ": "
			if got := err.Error(); strings.Count(got, "\n") != 0 || !strings.HasPrefix(got, want) || !strings.Contains(got, tc.msg) {
				t.Fatalf("Validate = %q, want one problem %q...%q", got, want, tc.msg)
			}
		})
	}
}
