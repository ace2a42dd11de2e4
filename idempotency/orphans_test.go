package idempotency

// Claims that failed Redis calls leave behind (redis_orphans.go). A proxy
// between a store and Redis (internal/faultproxy) passes a command through,
// drops Redis's reply and cuts the link: the claim is set, and the store
// does not know it.

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/faultproxy"
	"github.com/encgate/encgate/internal/redisclient"
	"github.com/encgate/encgate/internal/redistest"
)

// orphanClaimTTL is far beyond any test: a key freed within a test was not
// freed by its claim expiring.
const orphanClaimTTL = time.Hour

// replica is one gateway's store and deduplicator.
type replica struct {
	store *Redis
	sends *Sends
	reg   *prometheus.Registry
}

// newReplica returns a replica on srv, reached at addr ("" for srv's own),
// whose store runs on clk (nil: the wall clock). Sends runs on the wall
// clock; with a fake store clock only the orphan resolver's backoff waits on
// it.
func newReplica(t *testing.T, srv *redistest.Server, addr string, clk clock.Clock) *replica {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Store = "redis"
	cfg.ClaimTTL = configfile.Duration(orphanClaimTTL)
	st := newRedisStore(t, srv, redisOpts{claimTTL: orphanClaimTTL, addr: addr, clk: clk})
	loadScripts(t, srv)
	reg := prometheus.NewRegistry()
	return &replica{store: st, sends: NewSends(st, cfg, clock.Real{}, zap.NewNop(), NewMetrics(reg, nil)), reg: reg}
}

func (r *replica) orphans(t *testing.T, outcome string) float64 {
	t.Helper()
	return metricValue(t, r.reg, "encgate_idempotency_orphaned_claims_total", "outcome", outcome)
}

// loadScripts loads the store's scripts into srv, as any store's first
// calls do. Otherwise the first EVALSHA of a script is answered NOSCRIPT
// (and go-redis sends EVAL next), and a fault on it would drop that answer
// rather than the script's own.
func loadScripts(t *testing.T, srv *redistest.Server) {
	t.Helper()
	raw := rawClient(t, srv)
	for _, s := range []*redis.Script{getOrExistsScript, claimScript, completeScript, abandonScript, inspectScript, holdScript} {
		if err := s.Load(bg, raw).Err(); err != nil {
			t.Fatal(err)
		}
	}
}

// counted is a forward that counts its calls and answers ans.
func counted(n *atomic.Int32, ans Answer) ForwardFunc {
	return func(time.Duration) (Answer, bool) {
		n.Add(1)
		return ans, true
	}
}

// parked waits until the store's orphan resolver has failed its first try
// and waits on the fake clock (created is from clk.TimerCreated, taken
// before the failure): from then on only Advance makes it try again.
func parked(t *testing.T, created <-chan struct{}) {
	t.Helper()
	select {
	case <-created:
	case <-time.After(hangGuard):
		t.Fatal("the orphan resolver never waited for its next try")
	}
}

func mustHeal(t *testing.T, p *faultproxy.Proxy, f *faultproxy.Fault) {
	t.Helper()
	p.Heal()
	recv(t, "the heal", f.Healed())
}

// The case: a /send's claim is set but its reply is lost (the proxy
// drops it and cuts the link for 1.5s). The caller gets a 503; its retry
// once Redis is back gets 200, and the /send reached the encoder once.
// claim_ttl is an hour: the retry did not wait for the claim to expire.
func TestRedisLostClaimReplyThenRetryIsForwardedOnce(t *testing.T) {
	srv := redistest.Start(t)
	p := faultproxy.Start(t, srv.Addr())
	a, other := newReplica(t, srv, p.Addr(), nil), newReplica(t, srv, "", nil)
	req := Send{Key: Key{ReqID: "blip_local_part_0", Dest: "10.0.0.1:40000"}, FP: fpN(5), ReceiveCount: 1}
	ans := Answer{Status: 200, ContentType: "application/json", Body: []byte(`{"sent":true}`)}
	var forwards atomic.Int32
	deadline := func() time.Time { return time.Now().Add(hangGuard) }

	f := p.DropReplyAndCut(a.store.keys(req.Key).claim, 1500*time.Millisecond)
	if r := a.sends.Do(bg, req, deadline(), counted(&forwards, ans)); r.Outcome != Unavailable || !errors.Is(r.Err, ErrUnavailable) {
		t.Fatalf("the /send whose claim reply was lost: %v (%v), want Unavailable (503)", r.Outcome, r.Err)
	}
	recv(t, "the cut", f.Cut())
	recv(t, "the end of the 1.5s outage", f.Healed())

	if r := a.sends.Do(bg, req, deadline(), counted(&forwards, ans)); r.Outcome != Forwarded || !sameAnswer(r.Answer, ans) {
		t.Fatalf("the client's retry once Redis is back: %v %+v (%v), want Forwarded", r.Outcome, r.Answer, r.Err)
	}
	if r := other.sends.Do(bg, req, deadline(), counted(&forwards, ans)); r.Outcome != Replayed || !sameAnswer(r.Answer, ans) {
		t.Fatalf("a later duplicate on another replica: %v %+v", r.Outcome, r.Answer)
	}
	if n := forwards.Load(); n != 1 {
		t.Fatalf("the /send was forwarded %d times, want once", n)
	}
	// The claim was set (the proxy passed the command), so it was ended by
	// the resolver or taken over by the retry, whichever came first.
	waitFor(t, "the orphan to be resolved", func() bool { return a.store.Orphans() == 0 })
	if got := a.orphans(t, orphanAbandoned) + a.orphans(t, orphanTakenOver); got != 1 {
		t.Errorf("orphans abandoned + taken over = %v, want 1", got)
	}
	if got := metricValue(t, a.reg, "encgate_idempotency_orphaned_claims"); got != 0 {
		t.Errorf("encgate_idempotency_orphaned_claims = %v, want 0", got)
	}
}

// The retry on the same replica reaches Claim before the resolver could end
// the orphan (it waits on a fake clock that never moves): the claim script
// takes the orphaned claim over instead of answering Busy.
func TestRedisRetryTakesOverItsOwnOrphanedClaim(t *testing.T) {
	srv := redistest.Start(t)
	p := faultproxy.Start(t, srv.Addr())
	clk := clock.NewFake(time.Unix(1e9, 0))
	a := newReplica(t, srv, p.Addr(), clk)
	raw := rawClient(t, srv)
	req := Send{Key: Key{ReqID: "takeover_local_part_0", Dest: "10.0.0.1:40000"}, FP: fpN(6), ReceiveCount: 1}
	ks := a.store.keys(req.Key)
	ans := Answer{Status: 200, ContentType: "application/json", Body: []byte(`null`)}
	var forwards atomic.Int32
	deadline := func() time.Time { return time.Now().Add(hangGuard) }

	created := clk.TimerCreated()
	f := p.DropReplyAndCut(ks.claim, 0)
	if r := a.sends.Do(bg, req, deadline(), counted(&forwards, ans)); r.Outcome != Unavailable {
		t.Fatalf("the /send whose claim reply was lost: %v, want Unavailable", r.Outcome)
	}
	recv(t, "the cut", f.Cut())
	parked(t, created)
	// The orphaned claim is there, with this replica's id.
	if v, err := raw.Get(bg, ks.claim).Result(); err != nil || len(v) != claimValueLen || v[:replicaIDLen] != a.store.replica {
		t.Fatalf("the claim left in Redis: %q %v", v, err)
	}
	if a.store.Orphans() != 1 {
		t.Fatalf("orphans kept = %d, want 1", a.store.Orphans())
	}
	mustHeal(t, p, f)

	if r := a.sends.Do(bg, req, deadline(), counted(&forwards, ans)); r.Outcome != Forwarded || !sameAnswer(r.Answer, ans) {
		t.Fatalf("the retry: %v %+v (%v), want Forwarded", r.Outcome, r.Answer, r.Err)
	}
	if n := forwards.Load(); n != 1 {
		t.Fatalf("the /send was forwarded %d times, want once", n)
	}
	if got := a.orphans(t, orphanTakenOver); got != 1 {
		t.Errorf("orphans taken over = %v, want 1", got)
	}
	if a.store.Orphans() != 0 {
		t.Errorf("orphans kept after the takeover = %d", a.store.Orphans())
	}
}

// Redis comes back and nobody retries on the replica that lost the reply:
// its resolver ends the orphaned claim and wakes the other replica's
// waiter (it polls once an hour: the wake-up came by pub/sub), which then
// forwards the /send itself, long before claim_ttl.
func TestRedisOrphanResolverFreesTheKeyForAnotherReplica(t *testing.T) {
	srv := redistest.Start(t)
	p := faultproxy.Start(t, srv.Addr())
	clk := clock.NewFake(time.Unix(1e9, 0))
	a, b := newReplica(t, srv, p.Addr(), clk), newReplica(t, srv, "", nil)
	sh := serverShape(t, srv)
	req := Send{Key: Key{ReqID: "resolve_local_part_0", Dest: "10.0.0.1:40000"}, FP: fpN(7), ReceiveCount: 1}
	ks := a.store.keys(req.Key)
	ans := Answer{Status: 200, ContentType: "application/json", Body: []byte(`{"by":"b"}`)}
	var forwards atomic.Int32

	created := clk.TimerCreated()
	f := p.DropReplyAndCut(ks.claim, 0)
	if _, err := a.store.Claim(bg, req.Key, req.FP); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Claim with its reply lost: %v", err)
	}
	recv(t, "the cut", f.Cut())
	parked(t, created)
	if c := mustClaim(t, b.store, req.Key, req.FP, StateBusy); c.FP != req.FP {
		t.Fatalf("Busy FP = %+v", c.FP)
	}
	res := make(chan Result, 1)
	go func() { res <- b.sends.Do(bg, req, time.Now().Add(hangGuard), counted(&forwards, ans)) }()
	waitSubscribed(t, sh, ks.done)
	mustHeal(t, p, f)
	created = clk.TimerCreated()
	clk.Advance(a.store.retryMax) // the resolver's next try

	r := recv(t, "the other replica's /send", res)
	if r.Outcome != Forwarded || !sameAnswer(r.Answer, ans) || forwards.Load() != 1 {
		t.Fatalf("the other replica's /send: %v %+v (%v), forwards %d; want Forwarded once", r.Outcome, r.Answer, r.Err, forwards.Load())
	}
	waitFor(t, "the orphan to be counted", func() bool { return a.orphans(t, orphanAbandoned) == 1 })
	if a.store.Orphans() != 0 {
		t.Errorf("orphans kept = %d", a.store.Orphans())
	}
	// Done: the resolver waits for the next orphan, not on the clock.
	select {
	case <-created:
		t.Error("the resolver waits on the clock with nothing left to end")
	default:
	}
}

// A claim whose Abandon fails (the command is lost on its way, so the claim
// stays) is ended by the resolver once Redis answers.
func TestRedisFailedAbandonIsEndedOnceRedisAnswers(t *testing.T) {
	srv := redistest.Start(t)
	p := faultproxy.Start(t, srv.Addr())
	clk := clock.NewFake(time.Unix(1e9, 0))
	a, b := newReplica(t, srv, p.Addr(), clk), newReplica(t, srv, "", nil)
	req := Send{Key: Key{ReqID: "abandon_local_part_0", Dest: "10.0.0.1:40000"}, FP: fpN(8), ReceiveCount: 1}
	ks := a.store.keys(req.Key)

	var f *faultproxy.Fault
	created := clk.TimerCreated()
	// Nothing reaches the encoder: the claim is abandoned, and the abandon
	// never reaches Redis.
	notSent := func(time.Duration) (Answer, bool) {
		f = p.CutBefore(ks.claim, 0)
		return Answer{Status: 502}, false
	}
	if r := a.sends.Do(bg, req, time.Now().Add(hangGuard), notSent); r.Outcome != Forwarded || r.Answer.Status != 502 {
		t.Fatalf("a /send that reached no encoder: %v %+v", r.Outcome, r.Answer)
	}
	recv(t, "the cut", f.Cut())
	parked(t, created)
	mustClaim(t, b.store, req.Key, req.FP, StateBusy)
	if got := metricValue(t, a.reg, "encgate_idempotency_store_errors_total", "op", "abandon"); got != 1 {
		t.Errorf("store errors {op=abandon} = %v, want 1", got)
	}
	mustHeal(t, p, f)
	clk.Advance(a.store.retryMax)
	waitFor(t, "the orphan to be ended", func() bool { return a.orphans(t, orphanAbandoned) == 1 })
	mustClaim(t, b.store, req.Key, req.FP, StateClaimed)
}

// A claim whose /send is in flight on this replica is never taken over,
// not even by a Claim of the same key that carries an orphan token of this
// replica: a duplicate whose Claim reply was lost while the first /send was
// in flight. The duplicate's retry finds the key busy and gets the first
// /send's answer; the /send reached the encoder once. Its orphan (never
// set: the key was busy) is resolved as absent.
func TestRedisClaimInFlightIsNeverTakenOver(t *testing.T) {
	srv := redistest.Start(t)
	p := faultproxy.Start(t, srv.Addr())
	clk := clock.NewFake(time.Unix(1e9, 0))
	a := newReplica(t, srv, p.Addr(), clk)
	// A second deduplicator over the same store: its callers do not coalesce
	// with the first's in process, so they reach the store's Claim. It
	// shares the metrics (NewSends hands them to the store).
	cfg := DefaultConfig()
	cfg.ClaimTTL = configfile.Duration(orphanClaimTTL)
	dup := NewSends(a.store, cfg, clock.Real{}, zap.NewNop(), a.sends.m)
	sh := serverShape(t, srv)
	req := Send{Key: Key{ReqID: "inflight_local_part_0", Dest: "10.0.0.1:40000"}, FP: fpN(9), ReceiveCount: 1}
	ks := a.store.keys(req.Key)
	ans := Answer{Status: 200, ContentType: "application/json", Body: []byte(`{"first":true}`)}
	var forwards atomic.Int32
	entered, release := make(chan struct{}), make(chan struct{})
	forward := func(time.Duration) (Answer, bool) {
		if forwards.Add(1) == 1 {
			close(entered)
			<-release
		}
		return ans, true
	}
	first := make(chan Result, 1)
	go func() { first <- a.sends.Do(bg, req, time.Now().Add(hangGuard), forward) }()
	recv(t, "the first /send at the encoder", entered)

	// The duplicate's Claim: its reply is lost.
	created := clk.TimerCreated()
	f := p.DropReplyAndCut(ks.claim, 0)
	if _, err := a.store.Claim(bg, req.Key, req.FP); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("the duplicate's Claim with its reply lost: %v", err)
	}
	recv(t, "the cut", f.Cut())
	parked(t, created)
	if a.store.Orphans() != 1 {
		t.Fatalf("orphans kept = %d, want 1", a.store.Orphans())
	}
	mustHeal(t, p, f)

	// Its retries: the claim in flight is not taken over.
	if c := mustClaim(t, a.store, req.Key, req.FP, StateBusy); c.FP != req.FP {
		t.Fatalf("Busy FP = %+v", c.FP)
	}
	second := make(chan Result, 1)
	go func() { second <- dup.Do(bg, req, time.Now().Add(hangGuard), forward) }()
	waitSubscribed(t, sh, ks.done)
	close(release)
	if r := recv(t, "the first /send", first); r.Outcome != Forwarded || !sameAnswer(r.Answer, ans) {
		t.Fatalf("the first /send: %v %+v (%v)", r.Outcome, r.Answer, r.Err)
	}
	if r := recv(t, "the duplicate", second); r.Outcome != Inflight || !sameAnswer(r.Answer, ans) {
		t.Fatalf("the duplicate: %v %+v (%v), want Inflight with the first's answer", r.Outcome, r.Answer, r.Err)
	}
	if n := forwards.Load(); n != 1 {
		t.Fatalf("the /send was forwarded %d times, want once", n)
	}
	if got := a.orphans(t, orphanTakenOver); got != 0 {
		t.Fatalf("orphans taken over = %v, want 0", got)
	}
	clk.Advance(a.store.retryMax)
	waitFor(t, "the orphan to be resolved", func() bool { return a.orphans(t, orphanAbsent) == 1 })
}

// Redis stays away until the orphan's claim would have expired: the
// resolver gives up on it then (counted), and stops trying.
func TestRedisOrphanResolverGivesUpWhenTheClaimExpires(t *testing.T) {
	srv := redistest.Start(t)
	p := faultproxy.Start(t, srv.Addr())
	clk := clock.NewFake(time.Unix(1e9, 0))
	a := newReplica(t, srv, p.Addr(), clk)
	k := Key{ReqID: "expire_local_part_0", Dest: "10.0.0.1:40000"}

	created := clk.TimerCreated()
	f := p.DropReplyAndCut(a.store.keys(k).claim, 0)
	if _, err := a.store.Claim(bg, k, fpN(1)); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Claim with its reply lost: %v", err)
	}
	recv(t, "the cut", f.Cut())
	parked(t, created)
	// Each try fails while the link is cut; the waits grow to retryMax.
	for range 3 {
		created = clk.TimerCreated()
		clk.Advance(a.store.retryMax)
		parked(t, created)
	}
	if a.store.Orphans() != 1 || a.orphans(t, orphanExpired) != 0 {
		t.Fatalf("before claim_ttl: kept %d, expired %v", a.store.Orphans(), a.orphans(t, orphanExpired))
	}
	clk.Advance(orphanClaimTTL)
	waitFor(t, "the orphan to be given up", func() bool { return a.orphans(t, orphanExpired) == 1 })
	if a.store.Orphans() != 0 {
		t.Errorf("orphans kept = %d", a.store.Orphans())
	}
	if got := metricValue(t, a.reg, "encgate_idempotency_orphaned_claims"); got != 0 {
		t.Errorf("encgate_idempotency_orphaned_claims = %v", got)
	}
}

// The orphans kept are bounded, in all (max_orphaned_claims) and per key;
// one past a bound is counted and left to expire. Close counts those still
// kept and stops the resolver (goleak checks).
func TestRedisOrphansAreBounded(t *testing.T) {
	srv := redistest.Start(t)
	addr := srv.Addr()
	srv.Kill() // the resolver never reaches Redis
	clk := clock.NewFake(time.Unix(1e9, 0))
	cfg := redisclient.Default()
	cfg.Addr = addr
	const maxOrphans = maxOrphansPerKey + 2
	r, err := NewRedis(newClient(t, cfg), cfg, time.Minute, time.Minute, 0, maxOrphans, clk, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	r.observe(NewMetrics(reg, nil))
	until := clk.Now().Add(time.Minute)
	k := Key{"bounded", "h:1"}
	for range maxOrphansPerKey + 1 {
		r.addOrphan(k, r.newToken(), until, "claim", errors.New("test"))
	}
	if r.Orphans() != maxOrphansPerKey || len(r.orphanTokens(k)) != maxOrphansPerKey {
		t.Fatalf("kept %d for one key, want %d", r.Orphans(), maxOrphansPerKey)
	}
	for i := range 3 {
		r.addOrphan(Key{"bounded", "other:" + string(rune('0'+i))}, r.newToken(), until, "claim", errors.New("test"))
	}
	if r.Orphans() != maxOrphans {
		t.Fatalf("kept %d in all, want %d", r.Orphans(), maxOrphans)
	}
	ends := func(outcome string) float64 {
		return metricValue(t, reg, "encgate_idempotency_orphaned_claims_total", "outcome", outcome)
	}
	if got := ends(orphanOverflow); got != 2 {
		t.Errorf("overflow = %v, want 2", got)
	}
	if got := metricValue(t, reg, "encgate_idempotency_orphaned_claims"); got != maxOrphans {
		t.Errorf("encgate_idempotency_orphaned_claims = %v, want %d", got, maxOrphans)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if got := ends(orphanClosed); got != maxOrphans {
		t.Errorf("closed = %v, want %d", got, maxOrphans)
	}
	if got := metricValue(t, reg, "encgate_idempotency_orphaned_claims"); got != 0 {
		t.Errorf("encgate_idempotency_orphaned_claims after Close = %v", got)
	}
}

// A token carries its replica's id, so two replicas' tokens never agree.
func TestRedisTokensCarryTheReplicaID(t *testing.T) {
	srv := redistest.Start(t)
	a, b := newRedisStore(t, srv, redisOpts{}), newRedisStore(t, srv, redisOpts{})
	if a.replica == b.replica || len(a.replica) != replicaIDLen {
		t.Fatalf("replica ids %x and %x", a.replica, b.replica)
	}
	t1, t2 := a.newToken(), a.newToken()
	if len(t1) != tokenLen || t1[:replicaIDLen] != a.replica || t2[:replicaIDLen] != a.replica || t1 == t2 {
		t.Fatalf("tokens %x %x of replica %x", t1, t2, a.replica)
	}
}
