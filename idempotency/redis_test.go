package idempotency

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/redisclient"
	"github.com/encgate/encgate/internal/redistest"
	"github.com/encgate/encgate/internal/secretfile/secretfiletest"
)

// hangGuard bounds calls that must return by themselves; it only catches a
// hang and is far above any timeout the stores are configured with.
const hangGuard = 15 * time.Second

type redisOpts struct {
	ttl, claimTTL, poll time.Duration
	maxDests            int    // 0: the default
	passwordFile        string // redis.password_file
	addr                string // "": the server's own (else a proxy in front of it)
	clk                 clock.Clock
}

// newRedisStore returns a store (a "replica") on srv. By default waiters
// poll once an hour, so a test that sees a waiter woken proves pub/sub.
func newRedisStore(t *testing.T, srv *redistest.Server, o redisOpts) *Redis {
	t.Helper()
	return newStoreOn(t, serverShape(t, srv), o)
}

// newStoreOn is newRedisStore on any shape of Redis.
func newStoreOn(t *testing.T, sh *redisShape, o redisOpts) *Redis {
	t.Helper()
	if o.ttl == 0 {
		o.ttl = time.Minute
	}
	if o.claimTTL == 0 {
		o.claimTTL = 30 * time.Second
	}
	if o.poll == 0 {
		o.poll = time.Hour
	}
	cfg := sh.conn
	if o.addr != "" {
		cfg.Addr = o.addr
	}
	if o.clk == nil {
		o.clk = clock.Real{}
	}
	cfg.KeyPrefix = "t:"
	cfg.PoolSize = 16
	cfg.PollInterval = configfile.Duration(o.poll)
	cfg.PasswordFile = o.passwordFile
	r, err := NewRedis(newClient(t, cfg), cfg, o.ttl, o.claimTTL, o.maxDests, 0, o.clk, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r
}

// newClient is the client cfg describes, closed when t ends (after the
// stores built on it, whose Cleanups run first).
func newClient(t *testing.T, cfg redisclient.Config) redis.UniversalClient {
	t.Helper()
	c, err := redisclient.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// rawClient is a plain client to look at what the store wrote.
func rawClient(t *testing.T, srv *redistest.Server) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: srv.Addr(), Password: srv.Password(), DisableIdentity: true})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func fpN(n uint64) Fingerprint { return Fingerprint{SessionID: n, BufferAddress: math.MaxUint64 - n} }

func recN(n int, fp Fingerprint) *Record {
	return &Record{Status: 200 + n, ContentType: "application/json", Body: []byte(fmt.Sprintf(`{"n":%d}`, n)), FP: fp}
}

func sameRecord(a, b *Record) bool {
	return a != nil && b != nil && a.Status == b.Status && a.ContentType == b.ContentType &&
		bytes.Equal(a.Body, b.Body) && a.FP == b.FP
}

func mustClaim(t *testing.T, r *Redis, k Key, fp Fingerprint, want ClaimState) Claim {
	t.Helper()
	c, err := r.Claim(context.Background(), k, fp)
	if err != nil {
		t.Fatalf("Claim(%v): %v", k, err)
	}
	if c.State != want {
		t.Fatalf("Claim(%v) state = %v, want %v", k, c.State, want)
	}
	return c
}

func mustComplete(t *testing.T, r *Redis, k Key, rec *Record, n int) bool {
	t.Helper()
	released, err := r.Complete(context.Background(), k, rec, n)
	if err != nil {
		t.Fatalf("Complete(%v): %v", k, err)
	}
	return released
}

// waitFor polls cond until it holds or hangGuard passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(hangGuard)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitSubscribed waits until some connection listens on channel, so that
// what the test does next can only reach the waiter through pub/sub.
func waitSubscribed(t *testing.T, sh *redisShape, channel string) {
	t.Helper()
	waitFor(t, "a subscriber on "+channel, func() bool {
		n, err := sh.numSub(channel)
		return err == nil && n > 0
	})
}

type awaitResult struct {
	rec *Record
	ok  bool
	err error
}

func goAwait(ctx context.Context, r *Redis, k Key) <-chan awaitResult {
	out := make(chan awaitResult, 1)
	go func() {
		rec, ok, err := r.Await(ctx, k)
		out <- awaitResult{rec, ok, err}
	}()
	return out
}

func recv[T any](t *testing.T, what string, c <-chan T) T {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(hangGuard):
		t.Fatalf("%s did not return", what)
		panic("unreachable")
	}
}

func TestRedisRecordEncoding(t *testing.T) {
	recs := []*Record{
		{Status: 200, ContentType: "application/json", Body: []byte("null"), FP: fpN(1)},
		{Status: 500, Body: []byte("no staged embedding for req_id=x (already released)"), FP: Fingerprint{math.MaxUint64, 0}},
		{Status: 204},
	}
	for _, rec := range recs {
		enc := encodeRecord(rec)
		got, err := decodeRecord(string(enc))
		if err != nil || !sameRecord(got, rec) {
			t.Fatalf("round trip of %+v: %+v, %v", rec, got, err)
		}
		// Every truncation and any trailing byte is an error, never a panic.
		for i := range len(enc) {
			if _, err := decodeRecord(string(enc[:i])); !errors.Is(err, errCorruptRecord) {
				t.Fatalf("%+v truncated to %d bytes: err = %v", rec, i, err)
			}
		}
		if _, err := decodeRecord(string(enc) + "x"); !errors.Is(err, errCorruptRecord) {
			t.Fatalf("trailing byte: err = %v", err)
		}
	}
	for _, bad := range []string{"", "\x02", "\x01\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", "\x01\x90\x03" + strings.Repeat("\x00", 16) + "\xff\xff\xff\xff\x0f"} {
		if _, err := decodeRecord(bad); !errors.Is(err, errCorruptRecord) {
			t.Errorf("decodeRecord(%q) err = %v", bad, err)
		}
	}
}

func TestRedisClaimCompleteReplayRelease(t *testing.T) {
	testClaimCompleteReplayRelease(t, startServerShape(t))
}

func testClaimCompleteReplayRelease(t *testing.T, sh *redisShape) {
	a, b := newStoreOn(t, sh, redisOpts{}), newStoreOn(t, sh, redisOpts{})
	ctx := context.Background()
	k1, k2, k3 := Key{"r1", "10.0.0.1:40001"}, Key{"r1", "10.0.0.2:40001"}, Key{"r1", "10.0.0.3:40001"}

	if rec, released, err := lookup(a, ctx, k1); rec != nil || released || err != nil {
		t.Fatalf("Lookup of a new key = %v, %v, %v", rec, released, err)
	}
	mustClaim(t, a, k1, fpN(1), StateClaimed)
	// Another replica sees the holder's fingerprint.
	if c := mustClaim(t, b, k1, fpN(2), StateBusy); c.FP != fpN(1) {
		t.Fatalf("Busy FP = %+v, want the holder's %+v", c.FP, fpN(1))
	}
	if mustComplete(t, a, k1, recN(1, fpN(1)), 2) {
		t.Fatal("released after 1 of 2 destinations")
	}
	if rec, released, err := lookup(b, ctx, k1); err != nil || released || !sameRecord(rec, recN(1, fpN(1))) {
		t.Fatalf("Lookup after Complete = %+v, %v, %v", rec, released, err)
	}
	if c := mustClaim(t, b, k1, fpN(1), StateRecorded); !sameRecord(c.Record, recN(1, fpN(1))) {
		t.Fatalf("Claim of a recorded key returned %+v", c.Record)
	}
	// A repeated destination does not advance the count, and the first
	// record stays.
	if mustComplete(t, b, k1, recN(9, fpN(1)), 2) {
		t.Fatal("a repeated destination released the req_id")
	}
	if rec, _, _ := lookup(a, ctx, k1); !sameRecord(rec, recN(1, fpN(1))) {
		t.Fatalf("record replaced by a repeat: %+v", rec)
	}
	if rec, released, _ := lookup(a, ctx, k3); rec != nil || released {
		t.Fatal("k3 released before receive_count destinations")
	}
	mustClaim(t, b, k2, fpN(1), StateClaimed)
	if !mustComplete(t, b, k2, recN(2, fpN(1)), 2) {
		t.Fatal("not released after 2 of 2 destinations")
	}
	// Released: a new destination is refused, done ones still replay.
	if rec, released, err := lookup(a, ctx, k3); rec != nil || !released || err != nil {
		t.Fatalf("Lookup of a new destination after release = %v, %v, %v", rec, released, err)
	}
	mustClaim(t, a, k3, fpN(1), StateReleased)
	if rec, released, _ := lookup(a, ctx, k2); released || !sameRecord(rec, recN(2, fpN(1))) {
		t.Fatalf("Lookup of a done destination after release = %+v, %v", rec, released)
	}
	// Other req_ids are untouched.
	if rec, released, _ := lookup(a, ctx, Key{"r2", k3.Dest}); rec != nil || released {
		t.Fatal("another req_id is released")
	}
}

func TestRedisReceiveCount(t *testing.T) { testReceiveCount(t, startServerShape(t)) }

func testReceiveCount(t *testing.T, sh *redisShape) {
	r := newStoreOn(t, sh, redisOpts{})
	dest := func(i int) Key { return Key{"rc", fmt.Sprintf("10.0.0.1:%d", 40000+i)} }
	// Each /send's own receive_count is compared with the destinations
	// counted so far, and only /sends with one are counted (sglang NEW).
	if mustComplete(t, r, dest(0), recN(0, fpN(1)), 0) || mustComplete(t, r, dest(1), recN(1, fpN(1)), 3) {
		t.Fatal("released early")
	}
	if mustComplete(t, r, dest(1), recN(1, fpN(1)), 2) {
		t.Fatal("a repeated destination counted twice")
	}
	if mustComplete(t, r, dest(2), recN(2, fpN(1)), 0) {
		t.Fatal("a /send without receive_count released the req_id")
	}
	if !mustComplete(t, r, dest(3), recN(3, fpN(1)), 2) {
		t.Fatal("not released when a /send's own receive_count (2) was reached")
	}
	v, err := r.Inspect(context.Background(), "rc")
	if err != nil || v.ReceiveCount != 2 || v.Done != 4 || !v.Released {
		t.Fatalf("Inspect = %+v, %v", v, err)
	}
	// Without receive_count a req_id is never released.
	for i := range 5 {
		if mustComplete(t, r, Key{"none", fmt.Sprint(i)}, recN(i, fpN(1)), 0) {
			t.Fatalf("released without receive_count at %d", i)
		}
	}
}

func TestRedisAbandon(t *testing.T) { testAbandon(t, startServerShape(t)) }

func testAbandon(t *testing.T, sh *redisShape) {
	a, b := newStoreOn(t, sh, redisOpts{}), newStoreOn(t, sh, redisOpts{})
	ctx := context.Background()
	k := Key{"ab", "h:1"}
	mustClaim(t, a, k, fpN(1), StateClaimed)
	// Only the holder can abandon: b holds no token for k.
	if err := b.Abandon(ctx, k); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, b, k, fpN(1), StateBusy)
	if err := a.Abandon(ctx, k); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, b, k, fpN(2), StateClaimed)
	// a's token is spent: a second Abandon by a leaves b's claim alone.
	if err := a.Abandon(ctx, k); err != nil {
		t.Fatal(err)
	}
	if c := mustClaim(t, a, k, fpN(1), StateBusy); c.FP != fpN(2) {
		t.Fatalf("Busy FP = %+v", c.FP)
	}
	if rec, released, _ := lookup(a, ctx, k); rec != nil || released {
		t.Fatal("Abandon left a record")
	}
}

// A Claim that go-redis sends again after a lost reply finds its own token
// and is granted, instead of answering Busy against itself.
func TestRedisClaimScriptIsRepeatable(t *testing.T) {
	testClaimScriptIsRepeatable(t, startServerShape(t))
}

func testClaimScriptIsRepeatable(t *testing.T, sh *redisShape) {
	r := newStoreOn(t, sh, redisOpts{})
	ks := r.keys(Key{"rep", "h:1"})
	keys := []string{ks.rec, ks.rel, ks.claim, ks.claims, ks.dests}
	val := strings.Repeat("T", tokenLen) + strings.Repeat("\x00", 16)
	for i := range 2 {
		res, err := claimScript.Run(context.Background(), r.c, keys, val, 30000, "h:1", 1024, ks.claimPrefix).Slice()
		if err != nil || res[0].(int64) != 0 {
			t.Fatalf("run %d: %v, %v", i, res, err)
		}
	}
	other := strings.Repeat("U", tokenLen) + strings.Repeat("\x00", 16)
	res, err := claimScript.Run(context.Background(), r.c, keys, other, 30000, "h:1", 1024, ks.claimPrefix).Slice()
	if err != nil || res[0].(int64) != 3 {
		t.Fatalf("other token: %v, %v", res, err)
	}
}

func TestRedisClaimExpires(t *testing.T) { testClaimExpires(t, startServerShape(t)) }

func testClaimExpires(t *testing.T, sh *redisShape) {
	const claimTTL = 300 * time.Millisecond
	a := newStoreOn(t, sh, redisOpts{claimTTL: claimTTL, poll: 10 * time.Millisecond})
	b := newStoreOn(t, sh, redisOpts{claimTTL: claimTTL, poll: 10 * time.Millisecond})
	k := Key{"exp", "h:1"}
	mustClaim(t, a, k, fpN(1), StateClaimed)
	// A waiter on a claim that lapses (a crashed replica: no message) sees
	// it end by polling.
	res := recv(t, "Await on a lapsing claim", goAwait(context.Background(), b, k))
	if res.err != nil || res.ok || res.rec != nil {
		t.Fatalf("Await = %+v", res)
	}
	mustClaim(t, b, k, fpN(2), StateClaimed)
}

// Every key the store writes has a TTL, and all of them sit under the
// prefix with the req_id's hash tag.
func TestRedisEveryKeyExpires(t *testing.T) { testEveryKeyExpires(t, startServerShape(t)) }

func testEveryKeyExpires(t *testing.T, sh *redisShape) {
	const ttl, claimTTL = time.Minute, 30 * time.Second
	r := newStoreOn(t, sh, redisOpts{ttl: ttl, claimTTL: claimTTL})
	raw := sh.raw
	ctx := context.Background()
	for i := range 2 {
		k := Key{"ttl", fmt.Sprintf("h:%d", i)}
		mustClaim(t, r, k, fpN(1), StateClaimed)
		mustComplete(t, r, k, recN(i, fpN(1)), 3)
	}
	mustClaim(t, r, Key{"ttl", "h:2"}, fpN(1), StateClaimed) // in flight
	mustClaim(t, r, Key{"other", "h:0"}, fpN(1), StateClaimed)
	if err := r.Abandon(ctx, Key{"other", "h:0"}); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, r, Key{"rel", "h:0"}, fpN(1), StateClaimed)
	mustComplete(t, r, Key{"rel", "h:0"}, recN(0, fpN(1)), 1)

	keys := sh.keys(t, "*")
	want := map[string]time.Duration{
		"t:{ttl}:rec:h:0": ttl, "t:{ttl}:rec:h:1": ttl, "t:{ttl}:dests": ttl, "t:{ttl}:count": ttl, "t:{ttl}:counted": ttl,
		"t:{ttl}:claim:h:2": claimTTL, "t:{ttl}:claims": claimTTL,
		"t:{rel}:rec:h:0": ttl, "t:{rel}:dests": ttl, "t:{rel}:count": ttl, "t:{rel}:counted": ttl, "t:{rel}:rel": ttl,
	}
	if len(keys) != len(want) {
		t.Errorf("keys = %q, want those of %v", keys, want)
	}
	for _, key := range keys {
		max, ok := want[key]
		if !ok {
			t.Errorf("unexpected key %q", key)
			continue
		}
		if pttl := raw.PTTL(ctx, key).Val(); pttl <= 0 || pttl > max {
			t.Errorf("PTTL(%s) = %v, want (0, %v]", key, pttl, max)
		}
	}
}

func TestRedisInspect(t *testing.T) { testInspect(t, startServerShape(t)) }

func testInspect(t *testing.T, sh *redisShape) {
	r := newStoreOn(t, sh, redisOpts{})
	ctx := context.Background()
	if v, err := r.Inspect(ctx, "none"); err != nil || v.ReqID != "none" || len(v.Destinations) != 0 || v.Done != 0 {
		t.Fatalf("Inspect of an unknown req_id = %+v, %v", v, err)
	}
	mustClaim(t, r, Key{"in", "b:1"}, fpN(1), StateClaimed)
	mustComplete(t, r, Key{"in", "b:1"}, &Record{Status: 500, FP: fpN(1)}, 3)
	mustClaim(t, r, Key{"in", "a:1"}, fpN(1), StateClaimed)
	mustComplete(t, r, Key{"in", "a:1"}, recN(0, fpN(1)), 3)
	mustClaim(t, r, Key{"in", "c:1"}, fpN(1), StateClaimed)
	mustClaim(t, r, Key{"in", "d:1"}, fpN(1), StateClaimed)
	if err := r.Abandon(ctx, Key{"in", "d:1"}); err != nil {
		t.Fatal(err)
	}
	v, err := r.Inspect(ctx, "in")
	if err != nil {
		t.Fatal(err)
	}
	want := ReqView{ReqID: "in", ReceiveCount: 3, Done: 2, Destinations: []DestView{
		{Dest: "a:1", State: "done", Status: 200},
		{Dest: "b:1", State: "done", Status: 500},
		{Dest: "c:1", State: "in_flight"},
	}}
	if fmt.Sprint(v) != fmt.Sprint(want) {
		t.Fatalf("Inspect = %+v\nwant      %+v", v, want)
	}
}

func TestRedisCorruptRecordIsAnError(t *testing.T) {
	testCorruptRecordIsAnError(t, startServerShape(t))
}

func testCorruptRecordIsAnError(t *testing.T, sh *redisShape) {
	r := newStoreOn(t, sh, redisOpts{})
	raw := sh.raw
	ctx := context.Background()
	k := Key{"bad", "h:1"}
	raw.Set(ctx, r.keys(k).rec, "\x01garbage", time.Minute)
	raw.SAdd(ctx, r.keys(k).dests, k.Dest)
	if _, _, err := lookup(r, ctx, k); !errors.Is(err, errCorruptRecord) {
		t.Errorf("Lookup: %v", err)
	}
	if _, err := r.Claim(ctx, k, fpN(1)); !errors.Is(err, errCorruptRecord) {
		t.Errorf("Claim: %v", err)
	}
	if _, err := r.Inspect(ctx, k.ReqID); !errors.Is(err, errCorruptRecord) {
		t.Errorf("Inspect: %v", err)
	}
	if _, _, err := r.Await(ctx, k); !errors.Is(err, errCorruptRecord) {
		t.Errorf("Await: %v", err)
	}
}

// Also on a Redis that requires a password, with password_file: every
// connection of the stores authenticates, the pub/sub one included.
func TestRedisAwaitWokenByCompleteOnAnotherReplica(t *testing.T) {
	t.Run("no password", func(t *testing.T) { testAwaitWokenOnAnotherReplica(t, startServerShape(t), redisOpts{}) })
	t.Run("password_file", func(t *testing.T) {
		const pw = "replicas' redis password"
		o := redisOpts{passwordFile: secretfiletest.Write(t, "redis.password", pw+"\n", 0o600)}
		testAwaitWokenOnAnotherReplica(t, serverShape(t, redistest.Start(t, redistest.WithPassword(pw))), o)
	})
}

func testAwaitWokenOnAnotherReplica(t *testing.T, sh *redisShape, o redisOpts) {
	a, b := newStoreOn(t, sh, o), newStoreOn(t, sh, o)
	k := Key{"aw", "h:1"}
	mustClaim(t, a, k, fpN(1), StateClaimed)
	// Two waiters on b share its one subscription.
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	w1, w2 := goAwait(ctx, b, k), goAwait(ctx, b, k)
	waitSubscribed(t, sh, a.keys(k).done)
	mustComplete(t, a, k, recN(1, fpN(1)), 0)
	for i, w := range []<-chan awaitResult{w1, w2} {
		res := recv(t, "Await", w)
		if res.err != nil || !res.ok || !sameRecord(res.rec, recN(1, fpN(1))) {
			t.Fatalf("waiter %d: %+v", i, res)
		}
	}
	// Both gone: b unsubscribes.
	waitFor(t, "the unsubscribe", func() bool {
		n, err := sh.numSub(a.keys(k).done)
		return err == nil && n == 0
	})
}

func TestRedisAwaitWokenByAbandon(t *testing.T) { testAwaitWokenByAbandon(t, startServerShape(t)) }

func testAwaitWokenByAbandon(t *testing.T, sh *redisShape) {
	a, b := newStoreOn(t, sh, redisOpts{}), newStoreOn(t, sh, redisOpts{})
	k := Key{"aw", "h:1"}
	mustClaim(t, a, k, fpN(1), StateClaimed)
	w := goAwait(context.Background(), b, k)
	waitSubscribed(t, sh, a.keys(k).done)
	if err := a.Abandon(context.Background(), k); err != nil {
		t.Fatal(err)
	}
	if res := recv(t, "Await", w); res.err != nil || res.ok || res.rec != nil {
		t.Fatalf("Await after Abandon = %+v", res)
	}
}

func TestRedisAwaitHonoursDeadline(t *testing.T) {
	srv := redistest.Start(t)
	a, b := newRedisStore(t, srv, redisOpts{}), newRedisStore(t, srv, redisOpts{})
	k := Key{"aw", "h:1"}
	mustClaim(t, a, k, fpN(1), StateClaimed)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	res := recv(t, "Await", goAwait(ctx, b, k))
	if !errors.Is(res.err, context.DeadlineExceeded) || errors.Is(res.err, ErrUnavailable) {
		t.Fatalf("Await past its deadline = %+v", res)
	}
	// A context that ended before the call.
	if _, _, err := b.Await(ctx, k); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Await with an ended context: %v", err)
	}
}

func TestRedisCloseEndsWaiters(t *testing.T) {
	sh := startServerShape(t)
	a, b := newStoreOn(t, sh, redisOpts{}), newStoreOn(t, sh, redisOpts{})
	k := Key{"close", "h:1"}
	mustClaim(t, a, k, fpN(1), StateClaimed)
	w := goAwait(context.Background(), b, k)
	waitSubscribed(t, sh, a.keys(k).done)
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if res := recv(t, "Await", w); !errors.Is(res.err, ErrUnavailable) {
		t.Fatalf("Await across Close = %+v", res)
	}
	if _, _, err := b.Await(context.Background(), k); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Await after Close: %v", err)
	}
	if _, _, err := lookup(b, context.Background(), k); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Lookup after Close: %v", err)
	}
}

// Redis dies: every method fails with ErrUnavailable and nothing hangs; a
// waiter in progress fails too; after a restart the store, pub/sub included,
// works again.
func TestRedisUnavailableAndBack(t *testing.T) {
	srv := redistest.Start(t)
	a := newRedisStore(t, srv, redisOpts{})
	b := newRedisStore(t, srv, redisOpts{})
	polling := newRedisStore(t, srv, redisOpts{poll: 10 * time.Millisecond})
	sh := serverShape(t, srv)
	ctx := context.Background()
	k := Key{"down", "h:1"}

	// b's pub/sub connection is up before Redis dies.
	mustClaim(t, a, k, fpN(1), StateClaimed)
	w := goAwait(ctx, b, k)
	waitSubscribed(t, sh, a.keys(k).done)
	mustComplete(t, a, k, recN(1, fpN(1)), 0)
	if res := recv(t, "Await", w); !res.ok {
		t.Fatalf("Await before the crash = %+v", res)
	}
	k2 := Key{"down", "h:2"}
	mustClaim(t, a, k2, fpN(1), StateClaimed)
	inProgress := goAwait(ctx, polling, k2)
	waitSubscribed(t, sh, a.keys(k2).done)

	srv.Kill()

	if res := recv(t, "Await in progress", inProgress); !errors.Is(res.err, ErrUnavailable) {
		t.Errorf("Await in progress when Redis died: %+v", res)
	}
	calls := map[string]func() error{
		"Ping":   func() error { return a.Ping(ctx) },
		"Lookup": func() error { _, _, err := lookup(a, ctx, k); return err },
		"Claim":  func() error { _, err := a.Claim(ctx, k2, fpN(1)); return err },
		"Complete": func() error {
			// Its own key: the record is held here from now on, and would
			// answer the other calls on it.
			_, err := a.Complete(ctx, Key{"down", "completed"}, recN(2, fpN(1)), 1)
			return err
		},
		"Abandon": func() error {
			held := Key{"down", "held"} // as if a had claimed it
			a.keepToken(held, strings.Repeat("T", tokenLen))
			return a.Abandon(ctx, held)
		},
		"Await":   func() error { _, _, err := b.Await(ctx, k2); return err },
		"Inspect": func() error { _, err := a.Inspect(ctx, k.ReqID); return err },
	}
	for name, call := range calls {
		done := make(chan error, 1)
		go func() { done <- call() }()
		err := recv(t, name, done)
		if !errors.Is(err, ErrUnavailable) || errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("%s with Redis down: %v", name, err)
		}
	}

	srv.Restart()
	// go-redis may refuse to dial for a moment after a burst of refused
	// dials; wait until the store answers again.
	waitFor(t, "the store to reach the restarted Redis", func() bool { return a.Ping(ctx) == nil && b.Ping(ctx) == nil })

	// Redis came back empty; the whole protocol works, and b's one pub/sub
	// connection reconnected (b only polls once an hour).
	k3 := Key{"back", "h:1"}
	mustClaim(t, a, k3, fpN(1), StateClaimed)
	if c := mustClaim(t, b, k3, fpN(1), StateBusy); c.FP != fpN(1) {
		t.Fatalf("Busy FP after restart = %+v", c.FP)
	}
	w = goAwait(ctx, b, k3)
	waitSubscribed(t, sh, a.keys(k3).done)
	mustComplete(t, a, k3, recN(3, fpN(1)), 1)
	if res := recv(t, "Await after restart", w); res.err != nil || !res.ok || !sameRecord(res.rec, recN(3, fpN(1))) {
		t.Fatalf("Await after restart = %+v", res)
	}
	mustClaim(t, b, Key{"back", "h:2"}, fpN(1), StateReleased)
}

// A store that was never reachable fails fast too, and Close stops it.
func TestRedisNeverReachable(t *testing.T) {
	srv := redistest.Start(t)
	addr := srv.Addr()
	srv.Kill()
	cfg := redisclient.Default()
	cfg.Addr = addr
	r, err := NewRedis(newClient(t, cfg), cfg, time.Minute, time.Minute, 0, 0, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	done := make(chan error, 1)
	go func() { _, _, err := r.Await(context.Background(), Key{"x", "y"}); done <- err }()
	if err := recv(t, "Await", done); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Await: %v", err)
	}
}

func TestNewRedisRejectsBadArguments(t *testing.T) {
	cfg := redisclient.Default()
	c := newClient(t, cfg)
	if _, err := NewRedis(c, cfg, 0, time.Minute, 0, 0, nil, nil); err == nil {
		t.Error("ttl 0 accepted")
	}
	if _, err := NewRedis(c, cfg, time.Minute, time.Microsecond, 0, 0, nil, nil); err == nil {
		t.Error("claim_ttl under 1ms accepted")
	}
	if _, err := NewRedis(nil, cfg, time.Minute, time.Minute, 0, 0, nil, nil); err == nil {
		t.Error("no client accepted")
	}
}

// The coordinator across replicas: 64 concurrent calls for one key, split
// over two gateways that share one Redis, reach the encoder once and all
// get its answer.
func TestRedisSendsAcrossReplicas(t *testing.T) { testSendsAcrossReplicas(t, startServerShape(t)) }

func testSendsAcrossReplicas(t *testing.T, sh *redisShape) {
	const callers = 64
	cfg := DefaultConfig()
	cfg.Store = "redis"
	replicas := [2]*Sends{}
	var stores [2]*Redis
	for i := range replicas {
		stores[i] = newStoreOn(t, sh, redisOpts{claimTTL: cfg.ClaimTTL.D()})
		replicas[i] = NewSends(stores[i], cfg, clock.Real{}, zap.NewNop(), NewMetrics(prometheus.NewRegistry(), nil))
	}
	answer := Answer{Status: 200, ContentType: "application/json", Body: []byte(`{"ok":true}`)}
	var (
		forwards atomic.Int32
		entered  sync.WaitGroup
		results  [callers]Result
		wg       sync.WaitGroup
	)
	entered.Add(callers)
	req := Send{Key: Key{ReqID: "fanin", Dest: "10.0.0.1:40001"}, FP: fpN(7), ReceiveCount: 4}
	done := stores[0].keys(req.Key).done
	forward := func(time.Duration) (Answer, bool) {
		forwards.Add(1)
		// Every caller has started Do, so the other replica's first caller
		// finds the key claimed and waits on it through Redis: hold the
		// answer until that waiter listens.
		entered.Wait()
		for deadline := time.Now().Add(hangGuard); ; time.Sleep(time.Millisecond) {
			if n, err := sh.numSub(done); err == nil && n > 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Error("no replica waits on the claim through Redis")
				break
			}
		}
		return answer, true
	}
	deadline := time.Now().Add(hangGuard)
	for i := range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			entered.Done()
			results[i] = replicas[i%2].Do(context.Background(), req, deadline, forward)
		}()
	}
	wg.Wait()
	if n := forwards.Load(); n != 1 {
		t.Fatalf("%d forwards, want 1", n)
	}
	outcomes := map[Outcome]int{}
	for i, r := range results {
		outcomes[r.Outcome]++
		switch r.Outcome {
		case Forwarded, Inflight, Replayed:
		default:
			t.Fatalf("caller %d: outcome %v (%v)", i, r.Outcome, r.Err)
		}
		if r.Answer.Status != answer.Status || r.Answer.ContentType != answer.ContentType || !bytes.Equal(r.Answer.Body, answer.Body) {
			t.Fatalf("caller %d: answer %+v", i, r.Answer)
		}
	}
	// Inflight: at least the other replica's waiter on the claim.
	if outcomes[Forwarded] != 1 || outcomes[Inflight] < 1 {
		t.Fatalf("outcomes %v", outcomes)
	}
	t.Logf("outcomes: forwarded %d, inflight %d, replayed %d", outcomes[Forwarded], outcomes[Inflight], outcomes[Replayed])
}

// A stored record keeps the encoder that answered; a version-1 record
// (written before it had one) still reads, without it.
func TestRecordKeepsItsEncoder(t *testing.T) {
	rec := &Record{Status: 200, ContentType: "application/json", Body: []byte("null"), FP: Fingerprint{1, 2}, Encoder: "enc-7"}
	back, err := decodeRecord(string(encodeRecord(rec)))
	if err != nil || back.Encoder != "enc-7" || back.Status != 200 || string(back.Body) != "null" || back.FP != rec.FP {
		t.Fatalf("round trip: %+v %v", back, err)
	}
	v1 := []byte{1}
	v1 = binary.AppendVarint(v1, 200)
	v1 = binary.BigEndian.AppendUint64(v1, 1)
	v1 = binary.BigEndian.AppendUint64(v1, 2)
	v1 = append(binary.AppendUvarint(v1, 4), "text"...)
	v1 = append(binary.AppendUvarint(v1, 4), "null"...)
	old, err := decodeRecord(string(v1))
	if err != nil || old.Encoder != "" || old.ContentType != "text" || string(old.Body) != "null" {
		t.Fatalf("version 1: %+v %v", old, err)
	}
	m := NewMemory(100, 16, time.Minute, clock.NewFake(time.Unix(0, 0)))
	k := NewKey("r", "h", 1)
	if _, err := m.Complete(context.Background(), k, rec, 1); err != nil {
		t.Fatal(err)
	}
	if got, found, _, _ := m.Lookup(context.Background(), k); !found || got.Encoder != "enc-7" {
		t.Fatalf("memory store: %+v %v", got, found)
	}
}
