package idempotency

import (
	"time"

	"go.uber.org/zap"
)

// A claim can outlive the call that made it. A Claim whose reply is lost
// (Redis went away mid-call, or the link was cut) may or may not have set
// its claim. An Abandon that fails leaves its claim in place. Either way,
// nothing reached the encoder under that claim. Claim returned an error,
// so its caller did not forward, and Abandon is only called when nothing
// reached the encoder. Left alone, such a claim blocks its key for
// claim_ttl: every retry finds the key busy and waits, though nothing is in
// flight.
//
// This process therefore keeps the token of every such claim (an orphan)
// until the orphan is resolved:
//
//   - One background resolver (resolveOrphans) ends orphans with the
//     abandon script. It ends only a claim that still holds the orphan's
//     token, and wakes that key's waiters on every replica. The resolver
//     starts at once. While Redis does not answer it backs off, 10ms
//     doubling to min(1s, claim_ttl/4), on the store's clock. It gives up
//     on an orphan once its claim would have expired: claim_ttl after the
//     failed call, or after the Claim the failed Abandon ended, since Redis
//     expires claims with a relative PX. It stops at Close.
//   - A Claim of the same key in this process passes the key's orphan
//     tokens to the claim script. The script takes a claim holding one of
//     them over atomically, putting the new claim's value in its place, so
//     the client's retry is forwarded at once instead of waiting.
//
// Only tokens in the orphan set are ever ended or taken over, and a token
// enters the set only when nothing was forwarded under it. A claim whose
// /send is in flight here holds a token of its own, kept in tokens and never
// in the orphan set, so it is never taken over and no /send is forwarded
// twice. A claim of another replica starts with that replica's id, so its
// token is never equal to one of ours. Under redis.fail_open, a /send whose
// Claim failed is forwarded without dedupe. Its orphan may be taken over by
// a retry, which then forwards it again. Without a record that retry would
// be forwarded anyway, after claim_ttl.
//
// The set is bounded: at most max_orphaned_claims in all and
// maxOrphansPerKey per key. Past either bound a new orphan is not kept and
// its claim expires with claim_ttl, as before (counted: overflow).
//
// One case is left to claim_ttl. A Claim command can be held up in the
// network and reach Redis only after its orphan was resolved and the key
// freed, with TCP retransmitting it after the connection was given up. That
// claim is set again with nobody holding its token.

// maxOrphansPerKey bounds the orphan tokens kept for one key, and so the
// tokens every Claim of that key sends to the script. Each orphan is a
// retry of the same /send whose Claim failed; a client that retries more
// often than this within claim_ttl is waiting for Redis anyway.
const maxOrphansPerKey = 8

// Outcomes of encgate_idempotency_orphaned_claims_total.
const (
	orphanAbandoned = "abandoned"  // the resolver ended it once Redis answered
	orphanTakenOver = "taken_over" // a Claim of its key by this replica took it over
	orphanAbsent    = "absent"     // Redis answered and no claim held its token (the call had not applied it)
	orphanExpired   = "expired"    // Redis did not answer before its claim expired
	orphanClosed    = "closed"     // the store closed first
	orphanOverflow  = "overflow"   // not kept: past max_orphaned_claims or maxOrphansPerKey
)

// orphanClaim is a claim this process may hold under which nothing was
// forwarded. It is never modified after creation.
type orphanClaim struct {
	key   Key
	token string
	until time.Time // by then the claim has expired in Redis, if it was ever set
}

// addOrphan keeps tok, the token of a claim on k that a failed call may
// have left, until the resolver ends it, a Claim takes it over, or until.
// op names the failed call, for the log.
func (r *Redis) addOrphan(k Key, tok string, until time.Time, op string, cause error) {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	if r.orphanCount >= r.maxOrphans || len(r.orphans[k]) >= maxOrphansPerKey {
		first := !r.orphanOverflowed
		r.orphanOverflowed = true
		r.mu.Unlock()
		r.obs.Load().orphanEnded(orphanOverflow)
		if first {
			r.log.Warn("too many claims left by failed redis calls to keep; this one expires with idempotency.claim_ttl "+
				"(idempotency.max_orphaned_claims; logged once until every kept one is resolved)",
				zap.String("req_id", k.ReqID), zap.String("destination", k.Dest), zap.Int("kept", r.orphanCount))
		}
		return
	}
	r.orphans[k] = append(r.orphans[k], &orphanClaim{key: k, token: tok, until: until})
	r.orphanCount++
	if !r.resolving {
		r.resolving = true
		r.bg.Add(1)
		go r.resolveOrphans()
	}
	r.mu.Unlock()
	r.obs.Load().orphanAdded()
	r.log.Debug("a failed redis call may have left a claim; ending it once redis answers",
		zap.String("op", op), zap.String("req_id", k.ReqID), zap.String("destination", k.Dest), zap.Error(cause))
	select {
	case r.orphanKick <- struct{}{}:
	default:
	}
}

// orphanTokens returns k's orphans, for Claim to hand the script.
func (r *Redis) orphanTokens(k Key) []*orphanClaim {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.orphanCount == 0 {
		return nil
	}
	return append([]*orphanClaim(nil), r.orphans[k]...)
}

// settleOrphans ends the orphans in os that are still kept: the one whose
// token is taken (if any) as taken over, the others as outcome.
func (r *Redis) settleOrphans(os []*orphanClaim, taken, outcome string) {
	m := r.obs.Load()
	for _, o := range os {
		if !r.forgetOrphan(o) {
			continue // settled meanwhile, by the resolver or another Claim
		}
		if o.token == taken {
			m.orphanEnded(orphanTakenOver)
		} else {
			m.orphanEnded(outcome)
		}
	}
}

// forgetOrphan removes o and reports whether it was still kept.
func (r *Redis) forgetOrphan(o *orphanClaim) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	os := r.orphans[o.key]
	for i, x := range os {
		if x != o {
			continue
		}
		if len(os) == 1 {
			delete(r.orphans, o.key)
		} else {
			r.orphans[o.key] = append(os[:i:i], os[i+1:]...)
		}
		r.orphanCount--
		if r.orphanCount == 0 {
			r.orphanOverflowed = false
		}
		return true
	}
	return false
}

// Orphans is the number of claims this process keeps to end once Redis
// answers (see addOrphan).
func (r *Redis) Orphans() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.orphanCount
}

// resolveOrphans ends the orphans until the store closes: a pass over all
// of them whenever one is added, again after a backoff while Redis does not
// answer.
func (r *Redis) resolveOrphans() {
	defer r.bg.Done()
	first := min(completeRetryMin, r.retryMax)
	wait := first
	for {
		err := r.resolvePass()
		if r.life.Err() != nil {
			r.closeOrphans()
			return
		}
		if err == nil {
			wait = first
			select {
			case <-r.life.Done():
				r.closeOrphans()
				return
			case <-r.orphanKick:
			}
			continue
		}
		t := r.clk.NewTimer(wait)
		select {
		case <-r.life.Done():
			t.Stop()
			r.closeOrphans()
			return
		case <-t.C():
		}
		wait = min(2*wait, r.retryMax)
	}
}

// resolvePass drops the orphans whose claim has expired and tries to end
// the others, stopping at the first that Redis does not answer (its error).
func (r *Redis) resolvePass() (err error) {
	now := r.clk.Now()
	r.mu.Lock()
	all := make([]*orphanClaim, 0, r.orphanCount)
	for _, os := range r.orphans {
		all = append(all, os...)
	}
	r.mu.Unlock()
	m := r.obs.Load()
	ended, expired := 0, 0
	defer func() {
		if expired > 0 {
			r.log.Warn("redis did not answer before claims left by failed calls expired; their keys were blocked for idempotency.claim_ttl",
				zap.Int("claims", expired))
		}
		if ended > 0 {
			r.log.Info("redis answers again: ended claims left by failed calls, so their /sends may be sent again",
				zap.Int("claims", ended))
		}
	}()
	for _, o := range all {
		if !now.Before(o.until) {
			if r.forgetOrphan(o) {
				expired++
				m.orphanEnded(orphanExpired)
			}
			continue
		}
		found, err := r.abandon(r.life, o.key, o.token)
		if err != nil {
			return err
		}
		if !r.forgetOrphan(o) {
			continue // a Claim took it over meanwhile, and counted it
		}
		ended++
		if found {
			m.orphanEnded(orphanAbandoned)
		} else {
			m.orphanEnded(orphanAbsent)
		}
	}
	return nil
}

// closeOrphans counts the orphans left at Close.
func (r *Redis) closeOrphans() {
	r.mu.Lock()
	n := r.orphanCount
	clear(r.orphans)
	r.orphanCount = 0
	r.mu.Unlock()
	m := r.obs.Load()
	for range n {
		m.orphanEnded(orphanClosed)
	}
	if n > 0 {
		r.log.Warn("closed with claims left by failed redis calls; they expire with idempotency.claim_ttl", zap.Int("claims", n))
	}
}
