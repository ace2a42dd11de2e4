package idempotency

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/redisclient"
)

// Redis is the store that several gateway replicas share. Each Store method
// is one Lua script, so a step of the protocol is atomic on the server.
//
// Keys (P = KeyPrefix, R = req_id, D = destination, E = R with every '%'
// written %25 and every '}' written %7D, or a lone '%' for an empty R).
// The hash tag {E} puts all of one req_id's keys in one cluster slot,
// which the scripts need:
//
//	P{E}:rec:D    record of (R, D)                                  PX ttl
//	P{E}:claim:D  claim on (R, D) while one replica forwards it     PX claim_ttl
//	P{E}:claims   set of R's destinations claimed lately             PX claim_ttl
//	P{E}:dests    set of R's destinations with a record             PX ttl
//	P{E}:counted  set of those whose /send carried a receive_count  PX ttl
//	P{E}:count    R's latest positive receive_count (admin)         PX ttl
//	P{E}:rel      present once R is released                        PX ttl
//	P{E}:done:D   pub/sub channel: the claim on (R, D) ended
//
// The names are injective: escaping is injective and leaves no '}' in E,
// so the first '}' after P{ ends E; what follows is one of the fixed
// names above, or rec:, claim: or done: and D, and no name is a prefix of
// another's; D is the rest of the key, and host:port with a numeric port
// is injective. A req_id or host holding '}' or ':' cannot make two keys
// one (FuzzRedisKeys).
// With no brace in KeyPrefix the hash tag is exactly E; with braces in it,
// every key still shares its req_id's slot (they share the prefix P{E}).
//
// Every Complete adds D to dests, D to counted when its receive_count is
// positive (release compares that call's receive_count with the size of
// counted, see Store), and renews the TTL of all of R's keys, records of
// other destinations included: like the memory store, which keeps a
// req_id's records together, no record expires while its req_id's release
// state lives on.
//
// Claim refuses a destination without a record when R already has
// max_destinations_per_req_id destinations, counting those in dests and
// those of claims whose claim key is live.
//
// Complete retries a refused write in the background (redis_pending.go):
// the record stays on this replica and answers its lookups and claims, the
// claim is extended every retry so no other replica claims the key, and
// the record is published on the done channel ('r' and the record) so
// other replicas' waiters get the answer without it being stored.
//
// A claim's value is a 16-byte token followed by the holder's Fingerprint
// (two big-endian uint64s). The token is the holder's replica id (8 random
// bytes drawn once per store, so once per gateway process) and then 8
// random bytes drawn for the claim. The length and layout of the value are
// those of the older fully random token, so replicas of both kinds share
// one Redis. Busy reports the holder's fingerprint. Only the holder, this
// process, which keeps the token until Complete or Abandon, may abandon the
// claim. A Claim that go-redis sends again after a lost reply finds its own
// token and is granted again. A claim that a failed call left behind with
// nothing forwarded under it (an orphan: a Claim whose reply was lost, an
// Abandon that failed) is ended by this process once Redis answers again,
// or taken over by its next Claim of the key (redis_orphans.go). A claim of
// another replica, or one whose /send is in flight here, never is. Keeping
// the replica id in the token means no other replica can ever hold a token
// equal to one of ours, and an operator reading a claim in Redis can tell
// which replica holds it.
//
// Record encoding (binary, version 2; version 1, read too, has no
// Encoder):
//
//	byte     2 (version)
//	varint   Status
//	8 bytes  FP.SessionID, big-endian
//	8 bytes  FP.BufferAddress, big-endian
//	uvarint  len(ContentType), then ContentType
//	uvarint  len(Encoder), then Encoder (the encoder that answered)
//	uvarint  len(Body), then Body (nothing may follow)
//
// Await waits on one pub/sub connection per Redis, started by the first
// Await: one goroutine reads it and wakes the waiters of each channel,
// another alone issues SUBSCRIBE and UNSUBSCRIBE (in order, batched), so
// waiters never block on them. A waiter re-reads the key (record? claim?)
// once at the start, after every message on its channel, after every
// subscription confirmation of its channel and every PollInterval. The
// confirmation comes only once the server has the subscription, so the
// re-read after it sees any change made before, and any change after is
// published to the waiter: no wake-up is lost. go-redis reconnects the
// connection and subscribes again after Redis restarts; the confirmations
// then wake the waiters, and polling covers whatever pub/sub misses.
//
// Every failure to reach Redis satisfies errors.Is(err, ErrUnavailable),
// except when the caller's own context ended first: then the error wraps the
// context's. Complete and Abandon ignore the caller's cancellation (the
// encoder has been called; dropping the write would let a duplicate through
// or block the key for claim_ttl); each operation is bounded by
// dial_timeout + timeout.
type Redis struct {
	c         redis.UniversalClient
	log       *zap.Logger
	clk       clock.Clock
	prefix    string
	ttl       time.Duration
	ttlMS     int64
	claimTTL  time.Duration
	maxDests  int
	opTimeout time.Duration // bound on one operation, retries included
	poll      time.Duration
	retryMax  time.Duration // longest wait between tries of a refused completion or an orphan's end
	replica   string        // the first replicaIDLen bytes of every token this store makes

	mu        sync.Mutex // protects tokens, nextPrune, hub, closed, pending, refusals and the orphans
	tokens    map[Key]claimToken
	nextPrune time.Time
	hub       *redisHub // started by the first Await
	closed    bool
	pending   map[Key]*pendingComplete // records Redis refused, held here until it takes them
	refusals  refusalBurst

	// Claims that failed calls may have left, with nothing forwarded under
	// them (redis_orphans.go).
	orphans          map[Key][]*orphanClaim
	orphanCount      int
	maxOrphans       int
	orphanOverflowed bool          // one was not kept since the set was last empty
	resolving        bool          // resolveOrphans runs
	orphanKick       chan struct{} // capacity 1: an orphan was added

	obs atomic.Pointer[Metrics] // set by NewSends; nil in bare tests

	// What the store's calls have learned of Redis (redis_health.go).
	hmu    sync.Mutex
	health Health
	seen   time.Time // when a call last had a result, answered or failed

	done chan struct{}   // closed by Close: waiters leave
	life context.Context // canceled by Close: background retries stop
	end  context.CancelFunc
	bg   sync.WaitGroup // the orphan resolver, retries of refused completions
}

// claimToken is the token of a claim this process holds.
type claimToken struct {
	token   string
	expires time.Time
}

var _ Store = (*Redis)(nil)

// remote marks Redis a remoteStore: Sends asks it Claim, not Lookup first.
func (r *Redis) remote() {}

const (
	tokenLen      = 16
	replicaIDLen  = 8 // the token's first bytes: the replica's id; the rest is the claim's own
	claimValueLen = tokenLen + 16
	recordVersion = 2
)

// NewRedis returns a store over client, which the caller owns (and closes
// after Close), using conn's key prefix, timeouts and poll interval. Records
// and release state live for ttl, claims for claimTTL; a req_id has at most
// maxDests destinations; at most maxOrphans claims left by failed calls are
// kept to end once Redis answers. It does not contact Redis; call Ping to
// check that it answers. Zero durations and sizes in conn take the defaults
// of redisclient.Default, as do maxDests and maxOrphans <= 0 (those of
// DefaultConfig) and a nil clk (the wall clock, which paces retries of
// refused completions and of ending orphaned claims) and log.
func NewRedis(client redis.UniversalClient, conn redisclient.Config, ttl, claimTTL time.Duration, maxDests, maxOrphans int, clk clock.Clock, log *zap.Logger) (*Redis, error) {
	cfg, def := conn, redisclient.Default()
	if client == nil {
		return nil, errors.New("idempotency: no redis client")
	}
	if ttl < time.Millisecond || claimTTL < time.Millisecond {
		return nil, fmt.Errorf("idempotency: ttl (%v) and claim_ttl (%v) must be at least 1ms", ttl, claimTTL)
	}
	if cfg.KeyPrefix == "" {
		cfg.KeyPrefix = def.KeyPrefix
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = def.DialTimeout
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = def.Timeout
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = def.PollInterval
	}
	if log == nil {
		log = zap.NewNop()
	}
	if clk == nil {
		clk = clock.Real{}
	}
	if maxDests <= 0 {
		maxDests = DefaultConfig().MaxDestinationsPerReqID
	}
	if maxOrphans <= 0 {
		maxOrphans = DefaultConfig().MaxOrphanedClaims
	}
	var id [replicaIDLen]byte
	_, _ = rand.Read(id[:]) // never fails (crypto/rand)
	c := client
	life, end := context.WithCancel(context.Background())
	return &Redis{
		c:         c,
		log:       log,
		clk:       clk,
		prefix:    cfg.KeyPrefix,
		ttl:       ttl,
		ttlMS:     ttl.Milliseconds(),
		claimTTL:  claimTTL,
		maxDests:  maxDests,
		opTimeout: cfg.DialTimeout.D() + cfg.Timeout.D(),
		poll:      cfg.PollInterval.D(),
		// A held claim is extended every retry; four tries per claim_ttl
		// leave three to fail before it could lapse.
		retryMax:   min(completeRetryMax, claimTTL/4),
		replica:    string(id[:]),
		tokens:     make(map[Key]claimToken),
		pending:    make(map[Key]*pendingComplete),
		orphans:    make(map[Key][]*orphanClaim),
		maxOrphans: maxOrphans,
		orphanKick: make(chan struct{}, 1),
		done:       make(chan struct{}),
		life:       life,
		end:        end,
		health:     Health{Since: clk.Now(), Err: errNotContacted},
	}, nil
}

// Close stops the pub/sub reader and the background work; the client is
// the caller's to close.
func (r *Redis) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	h := r.hub
	r.mu.Unlock()
	close(r.done)
	r.end()
	r.bg.Wait()
	if h != nil {
		h.close()
	}
	return nil
}

// Ping checks that Redis answers.
func (r *Redis) Ping(ctx context.Context) error {
	octx, cancel := r.opCtx(ctx)
	defer cancel()
	if err := r.c.Ping(octx).Err(); err != nil {
		return r.fail(ctx, "ping", err)
	}
	r.noteHealth(nil)
	return nil
}

// Key names.

// base is P{E}, the start of every key of reqID (see Redis).
func (r *Redis) base(reqID string) string { return r.prefix + "{" + redisclient.EscapeTag(reqID) + "}" }

type redisKeys struct {
	rec, claim, claims, dests, counted, count, rel, done string
	recPrefix, claimPrefix                               string
}

func (r *Redis) keys(k Key) redisKeys {
	b := r.base(k.ReqID)
	return redisKeys{
		rec:         b + ":rec:" + k.Dest,
		claim:       b + ":claim:" + k.Dest,
		claims:      b + ":claims",
		dests:       b + ":dests",
		counted:     b + ":counted",
		count:       b + ":count",
		rel:         b + ":rel",
		done:        b + ":done:" + k.Dest,
		recPrefix:   b + ":rec:",
		claimPrefix: b + ":claim:",
	}
}

// Scripts. KEYS name every key a script touches, except the records that
// Complete and Inspect reach through the dests set (same hash tag, so the
// same slot).
var (
	// KEYS: a, b. Returns the value of a, else EXISTS b.
	getOrExistsScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if v then return v end
return redis.call('EXISTS', KEYS[2])
`)

	// KEYS: rec, rel, claim, claims, dests.
	// ARGV: claim value, claimTTL ms, dest, max destinations, claim prefix,
	// then the tokens of this replica's orphaned claims on the key (none or
	// more).
	// Returns {0} claimed, {1, record} recorded, {2} released,
	// {3, holder's claim value} busy, {4} past the destination bound,
	// {5, token} claimed by taking over the orphaned claim that held token.
	// The bound counts the destinations done and those claimed by a live
	// claim; claims holds only destinations claimed within the bound, so the
	// loop is short. A claim taken over keeps its place within the bound.
	claimScript = redis.NewScript(`
local rec = redis.call('GET', KEYS[1])
if rec then return {1, rec} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {2} end
local cur = redis.call('GET', KEYS[3])
local orphan
if cur and string.sub(cur, 1, 16) ~= string.sub(ARGV[1], 1, 16) then
  local tok = string.sub(cur, 1, 16)
  for i = 6, #ARGV do
    if ARGV[i] == tok then orphan = tok end
  end
  if not orphan then return {3, cur} end
end
if not cur then
  local max = tonumber(ARGV[4])
  local n = redis.call('SCARD', KEYS[5])
  if n >= max then return {4} end
  for _, d in ipairs(redis.call('SMEMBERS', KEYS[4])) do
    if d ~= ARGV[3] and redis.call('SISMEMBER', KEYS[5], d) == 0 and redis.call('EXISTS', ARGV[5] .. d) == 1 then
      n = n + 1
    end
  end
  if n >= max then return {4} end
end
redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
redis.call('SADD', KEYS[4], ARGV[3])
if redis.call('PTTL', KEYS[4]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[4], ARGV[2])
end
if orphan then return {5, orphan} end
return {0}
`)

	// KEYS: rec, claim, claims, dests, count, rel, counted.
	// ARGV: record, ttl ms, receive_count, dest, done channel, rec prefix.
	// Keeps the first record of a key, ends any claim on it, counts the
	// destination (in counted only with a receive_count), releases by this
	// call's own receive_count (see Store), renews the req_id's keys, wakes
	// the waiters and returns 1 when the req_id is released. Its first
	// write is a SET, which a Redis out of memory refuses before anything
	// is written (a script's later writes would not be refused), so a
	// refused Complete changes nothing and is safe to repeat.
	completeScript = redis.NewScript(`
local ttl = ARGV[2]
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ttl) then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], ARGV[4])
redis.call('SADD', KEYS[4], ARGV[4])
redis.call('PEXPIRE', KEYS[4], ttl)
local rc = tonumber(ARGV[3])
if rc > 0 then
  redis.call('SADD', KEYS[7], ARGV[4])
  redis.call('SET', KEYS[5], rc, 'PX', ttl)
end
redis.call('PEXPIRE', KEYS[7], ttl)
redis.call('PEXPIRE', KEYS[5], ttl)
local released = redis.call('EXISTS', KEYS[6]) == 1
if not released and rc > 0 and redis.call('SCARD', KEYS[7]) >= rc then released = true end
if released then redis.call('SET', KEYS[6], '1', 'PX', ttl) end
for _, d in ipairs(redis.call('SMEMBERS', KEYS[4])) do
  if d ~= ARGV[4] then redis.call('PEXPIRE', ARGV[6] .. d, ttl) end
end
redis.call('PUBLISH', ARGV[5], '1')
if released then return 1 end
return 0
`)

	// KEYS: claim, claims. ARGV: token, done channel, dest.
	// Ends the claim if it still holds token and wakes the waiters; returns
	// 1 when it did, 0 when no claim held token.
	abandonScript = redis.NewScript(`
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 1, 16) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[3])
  redis.call('PUBLISH', ARGV[2], '0')
  return 1
end
return 0
`)

	// KEYS: dests, count, rel, claims. ARGV: rec prefix, claim prefix.
	// Returns {count, released, {dest, record, ...}, {in-flight dest, ...}}.
	inspectScript = redis.NewScript(`
local recs = {}
for _, d in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  recs[#recs + 1] = d
  recs[#recs + 1] = redis.call('GET', ARGV[1] .. d) or ''
end
local flying = {}
for _, d in ipairs(redis.call('SMEMBERS', KEYS[4])) do
  if redis.call('EXISTS', ARGV[2] .. d) == 1 then flying[#flying + 1] = d end
end
return {redis.call('GET', KEYS[2]) or '0', redis.call('EXISTS', KEYS[3]), recs, flying}
`)
)

// Lookup implements Store.
func (r *Redis) Lookup(ctx context.Context, k Key) (Record, bool, bool, error) {
	if rec := r.held(k); rec != nil {
		return *rec, true, false, nil
	}
	ks := r.keys(k)
	octx, cancel := r.opCtx(ctx)
	defer cancel()
	v, err := getOrExistsScript.Run(octx, r.c, []string{ks.rec, ks.rel}).Result()
	if err != nil {
		return Record{}, false, false, r.fail(ctx, "lookup", err)
	}
	r.noteHealth(nil)
	switch v := v.(type) {
	case string:
		rec, err := decodeRecord(v)
		if err != nil {
			return Record{}, false, false, fmt.Errorf("idempotency: %s: %w", ks.rec, err)
		}
		return *rec, true, false, nil
	case int64:
		return Record{}, false, v == 1, nil
	}
	return Record{}, false, false, fmt.Errorf("idempotency: lookup: unexpected reply %T", v)
}

// Claim implements Store. A fresh token marks the claim; go-redis may send
// the script again after a lost reply, and the script then finds its own
// token and grants the claim again instead of answering Busy. The tokens of
// this process's orphaned claims on k go along, so that a claim one of them
// holds is taken over rather than answered Busy (redis_orphans.go).
func (r *Redis) Claim(ctx context.Context, k Key, fp Fingerprint) (Claim, error) {
	if rec := r.held(k); rec != nil {
		return Claim{State: StateRecorded, Record: rec}, nil
	}
	ks := r.keys(k)
	tok := r.newToken()
	orphans := r.orphanTokens(k)
	args := make([]any, 5, 5+len(orphans))
	args[0], args[1], args[2], args[3], args[4] = claimValue(tok, fp), r.claimTTL.Milliseconds(), k.Dest, r.maxDests, ks.claimPrefix
	for _, o := range orphans {
		args = append(args, o.token)
	}
	octx, cancel := r.opCtx(ctx)
	defer cancel()
	res, err := claimScript.Run(octx, r.c, []string{ks.rec, ks.rel, ks.claim, ks.claims, ks.dests}, args...).Slice()
	if err != nil {
		// The claim may have been made with its reply lost. The caller gets
		// an error and forwards nothing under it, so it is an orphan: ended
		// once Redis answers, or taken over by the next Claim of k here. Had
		// it been set, it would expire claim_ttl after it was set, no later
		// than now.
		r.addOrphan(k, tok, r.clk.Now().Add(r.claimTTL), "claim", err)
		return Claim{}, r.fail(ctx, "claim", err)
	}
	r.noteHealth(nil)
	state, _ := res[0].(int64)
	switch {
	case state == 0 || state == 5 && len(res) == 2:
		r.keepToken(k, tok)
		if len(orphans) > 0 {
			// The script saw k's claim: one of these it took over (5), and
			// no claim holds the others.
			taken, _ := res[len(res)-1].(string)
			r.settleOrphans(orphans, taken, orphanAbsent)
		}
		return Claim{State: StateClaimed}, nil
	case state == 1 && len(res) == 2:
		s, _ := res[1].(string)
		rec, err := decodeRecord(s)
		if err != nil {
			return Claim{}, fmt.Errorf("idempotency: %s: %w", ks.rec, err)
		}
		return Claim{State: StateRecorded, Record: rec}, nil
	case state == 2:
		return Claim{State: StateReleased}, nil
	case state == 4:
		return Claim{}, &DestinationLimitError{ReqID: k.ReqID, Dest: k.Dest, Limit: r.maxDests,
			Bound: "idempotency.max_destinations_per_req_id"}
	case state == 3 && len(res) == 2:
		s, _ := res[1].(string)
		if len(s) != claimValueLen {
			return Claim{}, fmt.Errorf("idempotency: %s: corrupt claim (%d bytes)", ks.claim, len(s))
		}
		return Claim{State: StateBusy, FP: Fingerprint{
			SessionID:     binary.BigEndian.Uint64([]byte(s[tokenLen:])),
			BufferAddress: binary.BigEndian.Uint64([]byte(s[tokenLen+8:])),
		}}, nil
	}
	return Claim{}, fmt.Errorf("idempotency: claim: unexpected reply %v", res)
}

// newToken returns a fresh claim token: this replica's id, then random
// bytes.
func (r *Redis) newToken() string {
	var b [tokenLen]byte
	copy(b[:], r.replica)
	_, _ = rand.Read(b[replicaIDLen:]) // never fails (crypto/rand)
	return string(b[:])
}

// claimValue is a claim's stored value: the token, then fp.
func claimValue(tok string, fp Fingerprint) []byte {
	val := make([]byte, 0, claimValueLen)
	val = append(val, tok...)
	val = binary.BigEndian.AppendUint64(val, fp.SessionID)
	return binary.BigEndian.AppendUint64(val, fp.BufferAddress)
}

// Complete implements Store. The first record of a key is kept (as in the
// memory store); the claim on k ends whoever holds it, since with a record
// in place the key needs no claim. The encoder has had the /send by now, so
// the caller's cancellation or deadline does not stop the write; the store's
// own bound (dial_timeout + timeout) does. A write Redis refuses, or that
// gets no answer, is kept here and retried (holdCompletion), and Complete
// returns an error matching ErrCompletionPending.
func (r *Redis) Complete(ctx context.Context, k Key, rec *Record, receiveCount int) (bool, error) {
	ctx = context.WithoutCancel(ctx)
	tok := r.takeToken(k)
	released, err := r.complete(ctx, k, rec, receiveCount)
	if err != nil {
		return false, r.holdCompletion(k, tok, rec, receiveCount, err)
	}
	r.stored()
	return released, nil
}

// complete runs the complete script once.
func (r *Redis) complete(ctx context.Context, k Key, rec *Record, receiveCount int) (bool, error) {
	ks := r.keys(k)
	octx, cancel := r.opCtx(ctx)
	defer cancel()
	n, err := completeScript.Run(octx, r.c,
		[]string{ks.rec, ks.claim, ks.claims, ks.dests, ks.count, ks.rel, ks.counted},
		encodeRecord(rec), r.ttlMS, max(receiveCount, 0), k.Dest, ks.done, ks.recPrefix).Int64()
	if err != nil {
		return false, r.fail(ctx, "complete", err)
	}
	r.noteHealth(nil)
	return n == 1, nil
}

// Abandon implements Store. It ends the claim only if this process holds
// it, by the token Claim kept; with none it does nothing. Like Complete it
// runs even when the caller has gone: otherwise the key stays blocked for
// claim_ttl. When Redis does not answer, the claim is an orphan, which this
// process ends once Redis answers again (redis_orphans.go); the error is
// returned all the same.
func (r *Redis) Abandon(ctx context.Context, k Key) error {
	tok := r.takeToken(k)
	if tok.token == "" {
		return nil
	}
	if _, err := r.abandon(context.WithoutCancel(ctx), k, tok.token); err != nil {
		// Nothing reached the encoder under it (that is why it is
		// abandoned), and it lapses by tok.expires.
		r.addOrphan(k, tok.token, tok.expires, "abandon", err)
		return err
	}
	return nil
}

// abandon runs the abandon script once; found reports whether a claim held
// tok (and was ended).
func (r *Redis) abandon(ctx context.Context, k Key, tok string) (found bool, err error) {
	ks := r.keys(k)
	octx, cancel := r.opCtx(ctx)
	defer cancel()
	n, err := abandonScript.Run(octx, r.c, []string{ks.claim, ks.claims}, tok, ks.done, k.Dest).Int64()
	if err != nil {
		return false, r.fail(ctx, "abandon", err)
	}
	r.noteHealth(nil)
	return n == 1, nil
}

// Await implements Store: it returns when k has a record (ok), when no
// claim on k is left without one (!ok), or when ctx ends (its error).
func (r *Redis) Await(ctx context.Context, k Key) (*Record, bool, error) {
	if rec := r.held(k); rec != nil {
		return rec, true, nil
	}
	ks := r.keys(k)
	h, err := r.startHub()
	if err != nil {
		return nil, false, err
	}
	w := h.add(ks.done)
	defer h.remove(w)
	tick := time.NewTicker(r.poll)
	defer tick.Stop()
	for {
		// The holder's answer, published while Redis refuses to store it:
		// the claim stays until it is stored, so this is the only way to
		// have it meanwhile.
		if p := w.published.Load(); p != nil {
			if rec, err := decodeRecord(*p); err == nil {
				return rec, true, nil
			}
		}
		octx, cancel := r.opCtx(ctx)
		v, err := getOrExistsScript.Run(octx, r.c, []string{ks.rec, ks.claim}).Result()
		cancel()
		if err != nil {
			return nil, false, r.fail(ctx, "await", err)
		}
		r.noteHealth(nil)
		switch v := v.(type) {
		case string:
			rec, err := decodeRecord(v)
			if err != nil {
				return nil, false, fmt.Errorf("idempotency: %s: %w", ks.rec, err)
			}
			return rec, true, nil
		case int64:
			if v == 0 {
				return nil, false, nil
			}
		default:
			return nil, false, fmt.Errorf("idempotency: await: unexpected reply %T", v)
		}
		select {
		case <-ctx.Done():
			return nil, false, ctx.Err()
		case <-r.done:
			return nil, false, &unavailableError{op: "await", err: redis.ErrClosed}
		case <-w.wake:
		case <-tick.C:
		}
	}
}

// Inspect implements Store.
func (r *Redis) Inspect(ctx context.Context, reqID string) (ReqView, error) {
	v := ReqView{ReqID: reqID}
	ks := r.keys(Key{ReqID: reqID})
	octx, cancel := r.opCtx(ctx)
	defer cancel()
	res, err := inspectScript.Run(octx, r.c, []string{ks.dests, ks.count, ks.rel, ks.claims},
		ks.recPrefix, ks.claimPrefix).Slice()
	if err != nil {
		return v, r.fail(ctx, "inspect", err)
	}
	r.noteHealth(nil)
	if len(res) != 4 {
		return v, fmt.Errorf("idempotency: inspect: unexpected reply %v", res)
	}
	countText, _ := res[0].(string)
	if v.ReceiveCount, err = strconv.Atoi(countText); err != nil {
		return v, fmt.Errorf("idempotency: %s: %q is not a count", ks.count, countText)
	}
	released, _ := res[1].(int64)
	v.Released = released == 1
	recs, _ := res[2].([]any)
	done := make(map[string]bool, len(recs)/2)
	for i := 0; i+1 < len(recs); i += 2 {
		dest, _ := recs[i].(string)
		d := DestView{Dest: dest, State: "done"}
		if s, _ := recs[i+1].(string); s != "" {
			rec, err := decodeRecord(s)
			if err != nil {
				return v, fmt.Errorf("idempotency: %s%s: %w", ks.recPrefix, dest, err)
			}
			d.Status = rec.Status
		}
		done[dest] = true
		v.Destinations = append(v.Destinations, d)
	}
	v.Done = len(v.Destinations)
	flying, _ := res[3].([]any)
	for _, x := range flying {
		if dest, _ := x.(string); !done[dest] {
			v.Destinations = append(v.Destinations, DestView{Dest: dest, State: "in_flight"})
		}
	}
	sort.Slice(v.Destinations, func(i, j int) bool { return v.Destinations[i].Dest < v.Destinations[j].Dest })
	return v, nil
}

// opCtx bounds one operation, retries included; Close ends it too (the
// client is shared, so the store cannot close it to stop its own work).
func (r *Redis) opCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	octx, cancel := context.WithTimeout(ctx, r.opTimeout)
	if r.life.Err() != nil { // AfterFunc would cancel on another goroutine
		cancel()
		return octx, cancel
	}
	stop := context.AfterFunc(r.life, cancel)
	return octx, func() { stop(); cancel() }
}

// fail turns an error from go-redis into the store's: the caller's context
// error when that context ended, else an error that is ErrUnavailable.
func (r *Redis) fail(ctx context.Context, op string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("redis %s: %w", op, ctx.Err())
	}
	if r.life.Err() != nil {
		return &unavailableError{op: op, err: redis.ErrClosed}
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		// Our own bound ran out: not the caller's deadline, so it must not
		// read as one.
		err = fmt.Errorf("no answer within %v", r.opTimeout)
	}
	ue := &unavailableError{op: op, err: err}
	r.noteHealth(ue)
	return ue
}

// unavailableError is a failed Redis operation; errors.Is matches it to
// ErrUnavailable and to its cause.
type unavailableError struct {
	op  string
	err error
}

func (e *unavailableError) Error() string        { return "redis " + e.op + ": " + e.err.Error() }
func (e *unavailableError) Unwrap() error        { return e.err }
func (e *unavailableError) Is(target error) bool { return target == ErrUnavailable }

// keepToken remembers the token of a claim this process now holds. Entries
// that Complete or Abandon never took (a caller that stopped in between)
// are dropped once their claim has expired.
func (r *Redis) keepToken(k Key, tok string) {
	now := r.clk.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	if now.After(r.nextPrune) {
		for key, t := range r.tokens {
			if now.After(t.expires) {
				delete(r.tokens, key)
			}
		}
		r.nextPrune = now.Add(r.claimTTL)
	}
	r.tokens[k] = claimToken{token: tok, expires: now.Add(r.claimTTL)}
}

// takeToken forgets and returns this process's claim on k (a zero
// claimToken when it holds none).
func (r *Redis) takeToken(k Key) claimToken {
	r.mu.Lock()
	defer r.mu.Unlock()
	t, ok := r.tokens[k]
	if !ok {
		return claimToken{}
	}
	delete(r.tokens, k)
	return t
}
