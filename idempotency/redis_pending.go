package idempotency

import (
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// A completion Redis refuses (out of memory under noeviction, read-only
// after a failover, no answer) must not turn a delivered /send back into an
// unclaimed key: a duplicate would then wait out its deadline, and once the
// claim lapsed another replica would forward the /send a second time. So
// the replica that forwarded keeps the record (pending) until Redis takes
// it:
//
//   - its own lookups, claims and waits answer from it (held);
//   - every retry first holds the claim: it extends the claim this replica
//     holds (a PEXPIRE, which Redis accepts even out of memory), or takes it
//     again if it lapsed, and publishes the record on the key's done
//     channel, so waiters on other replicas get the answer while it cannot
//     be stored, and their claims keep finding the key busy;
//   - then, after a backoff (10ms doubling to min(1s, claim_ttl/4)), it
//     tries the completion again.
//
// It gives up after ttl (the record's own lifetime, by when a stored record
// would have expired too) or when the store closes, and counts that in
// encgate_idempotency_complete_lost_total. If Redis refuses even extending
// the claim (read-only) for longer than claim_ttl, the claim lapses: once
// Redis takes writes again, another replica's duplicate that claims the key
// before this replica's next retry stores the record would be forwarded
// again. That is counted (reason claim_lost) when this replica sees it.
//
// A release the late completion causes is not reported to the caller (its
// answer was written long before); the pin then expires by its TTL.

// Backoff between tries of a refused completion.
const (
	completeRetryMin = 10 * time.Millisecond
	completeRetryMax = time.Second
)

// Reasons of encgate_idempotency_complete_lost_total.
const (
	lostClaim   = "claim_lost" // the claim lapsed or another replica took it
	lostExpired = "expired"    // Redis refused it for the whole ttl
	lostClosed  = "closed"     // the gateway stopped with it unstored
)

// pendingComplete is a record Redis refused, held by the replica whose
// /send it answers. Only its retry goroutine changes it after creation;
// rec is never modified.
type pendingComplete struct {
	rec          *Record
	receiveCount int
	claim        []byte    // the claim value this replica holds the key with
	since        time.Time // the first refusal
	heldUntil    time.Time // when the claim lapses unless extended again
	lost         bool      // counted as claim_lost
}

// refusalBurst is a run of refused completions, logged once when it starts
// and once when Redis takes a completion again.
type refusalBurst struct {
	on    bool
	since time.Time
	n     int // refused completions
	lost  int // pending records whose claim was lost
}

// pendingError is Complete's error for a held record.
type pendingError struct{ cause error }

func (e *pendingError) Error() string {
	return "redis refused the record (" + e.cause.Error() + "); it is " + ErrCompletionPending.Error()
}
func (e *pendingError) Unwrap() error { return e.cause }
func (e *pendingError) Is(target error) bool {
	return target == ErrCompletionPending || target == ErrUnavailable
}

// KEYS: rec, claim, claims. ARGV: claim value, claimTTL ms, dest, done
// channel, published record. Returns 0 when the claim was extended, 1 when
// it had lapsed and was taken again, 2 when another replica holds it, 3
// when a record is stored (the next completion keeps that one). The publish
// comes before any write: out of memory, a lapsed claim cannot be taken
// again (a SET) but the waiters still get the answer.
var holdScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[1]) == 1 then return 3 end
redis.call('PUBLISH', ARGV[4], ARGV[5])
local ttl = tonumber(ARGV[2])
local cur = redis.call('GET', KEYS[2])
if cur then
  if string.sub(cur, 1, 16) ~= string.sub(ARGV[1], 1, 16) then return 2 end
  redis.call('PEXPIRE', KEYS[2], ttl)
  if redis.call('PTTL', KEYS[3]) < ttl then redis.call('PEXPIRE', KEYS[3], ttl) end
  return 0
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ttl)
redis.call('SADD', KEYS[3], ARGV[3])
if redis.call('PTTL', KEYS[3]) < ttl then redis.call('PEXPIRE', KEYS[3], ttl) end
return 1
`)

// held returns the record of k this replica holds for Redis, or nil.
func (r *Redis) held(k Key) *Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.pending) == 0 {
		return nil
	}
	if p := r.pending[k]; p != nil {
		return p.rec
	}
	return nil
}

// Pending is the number of records held for Redis now.
func (r *Redis) Pending() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.pending)
}

// holdCompletion keeps rec for k after Redis refused it (cause) and starts
// retrying. tok is the claim this replica held on k.
func (r *Redis) holdCompletion(k Key, tok claimToken, rec *Record, receiveCount int, cause error) error {
	now := r.clk.Now()
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return cause
	}
	if r.pending[k] != nil {
		// The key's first record is the one kept (as Redis would).
		r.mu.Unlock()
		return &pendingError{cause}
	}
	if tok.token == "" {
		// No claim of ours to extend (pruned, or a Complete without Claim):
		// hold it with a new one from the first retry.
		tok = claimToken{token: r.newToken(), expires: now}
	}
	p := &pendingComplete{rec: rec, receiveCount: receiveCount, claim: claimValue(tok.token, rec.FP),
		since: now, heldUntil: tok.expires}
	r.pending[k] = p
	first := !r.refusals.on
	if first {
		r.refusals = refusalBurst{on: true, since: now}
	}
	r.refusals.n++
	r.bg.Add(1)
	r.mu.Unlock()
	if first {
		r.log.Warn("redis refused storing a /send's answer; this replica holds it, answers its duplicates from it, "+
			"keeps the claim and retries (logged once until redis takes one again)",
			zap.String("req_id", k.ReqID), zap.String("destination", k.Dest), zap.Error(cause))
	}
	m := r.obs.Load()
	m.completeRefused()
	go r.retryCompletion(k, p)
	return &pendingError{cause}
}

// retryCompletion holds k's claim and retries its completion until Redis
// takes it, ttl passes, or the store closes.
func (r *Redis) retryCompletion(k Key, p *pendingComplete) {
	defer r.bg.Done()
	wait := min(completeRetryMin, r.retryMax)
	for {
		r.holdClaim(k, p)
		t := r.clk.NewTimer(wait)
		select {
		case <-r.life.Done():
			t.Stop()
			r.settle(k, p, lostClosed)
			return
		case <-t.C():
		}
		if _, err := r.complete(r.life, k, p.rec, p.receiveCount); err == nil {
			r.settle(k, p, "")
			return
		}
		if !r.clk.Now().Before(p.since.Add(r.ttl)) {
			r.settle(k, p, lostExpired)
			return
		}
		wait = min(2*wait, r.retryMax)
	}
}

// holdClaim keeps k claimed by this replica and publishes its record.
func (r *Redis) holdClaim(k Key, p *pendingComplete) {
	ks := r.keys(k)
	ctx, cancel := r.opCtx(r.life)
	defer cancel()
	before := r.clk.Now()
	state, err := holdScript.Run(ctx, r.c, []string{ks.rec, ks.claim, ks.claims},
		p.claim, r.claimTTL.Milliseconds(), k.Dest, ks.done, publishedRecord+string(encodeRecord(p.rec))).Int64()
	switch {
	case err == nil:
		r.noteHealth(nil)
	case r.life.Err() == nil:
		r.noteHealth(&unavailableError{op: "hold", err: err})
	}
	lost := false
	switch {
	case err != nil:
		// Refused even this (read-only) or unreachable: the claim lives
		// until its last extension runs out.
		lost = !before.Before(p.heldUntil)
	case state == 0:
		p.heldUntil = before.Add(r.claimTTL)
	case state == 1:
		p.heldUntil = before.Add(r.claimTTL)
		lost = true // it had lapsed: the key was open meanwhile
	case state == 2:
		lost = true // another replica may be forwarding it again
	}
	if !lost || p.lost {
		return
	}
	p.lost = true
	r.obs.Load().completeLost(lostClaim)
	r.mu.Lock()
	firstLoss := r.refusals.lost == 0
	r.refusals.lost++
	r.mu.Unlock()
	if firstLoss {
		r.log.Warn("redis refused a held /send answer for longer than idempotency.claim_ttl: its claim lapsed, "+
			"so another replica may forward that /send again (logged once until redis takes one again)",
			zap.String("req_id", k.ReqID), zap.String("destination", k.Dest), zap.Error(err))
	}
}

// settle ends p: stored when lost is "", else given up for that reason.
func (r *Redis) settle(k Key, p *pendingComplete, lost string) {
	r.mu.Lock()
	if r.pending[k] == p {
		delete(r.pending, k)
	}
	r.mu.Unlock()
	m := r.obs.Load()
	m.pendingDone()
	if lost == "" {
		r.stored()
		return
	}
	m.completeLost(lost)
	r.log.Warn("gave up storing a /send's answer in redis; once its claim lapses the /send may be forwarded again",
		zap.String("req_id", k.ReqID), zap.String("destination", k.Dest), zap.String("reason", lost),
		zap.Duration("held_for", r.clk.Now().Sub(p.since)))
}

// stored ends a burst of refusals: Redis took a completion.
func (r *Redis) stored() {
	r.mu.Lock()
	if !r.refusals.on {
		r.mu.Unlock()
		return
	}
	b, left := r.refusals, len(r.pending)
	r.refusals = refusalBurst{}
	r.mu.Unlock()
	r.log.Info("redis stores /send answers again", zap.Int("refused", b.n), zap.Int("claims_lost", b.lost),
		zap.Int("still_held", left), zap.Duration("after", r.clk.Now().Sub(b.since)))
}

// observe implements the hook NewSends uses to hand the store its metrics.
func (r *Redis) observe(m *Metrics) { r.obs.Store(m) }
