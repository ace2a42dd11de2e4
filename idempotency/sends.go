package idempotency

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
)

// Outcome says how a /send was answered.
type Outcome int

// Outcomes of Sends.Do.
const (
	Forwarded   Outcome = iota // this call went to the encoder
	Inflight                   // coalesced on an identical call in flight
	Replayed                   // answered from a stored record
	Released                   // req_id released; this destination never seen
	Conflict                   // same key, different payload (422)
	Unavailable                // the store could not be reached (503)
	FailedOpen                 // the store could not be reached; forwarded without dedupe
	WaitTimeout                // the call it coalesced on outlived this caller's deadline (504)
)

// Answer is an HTTP answer as stored and replayed.
type Answer struct {
	Status      int
	ContentType string
	Body        []byte
}

// Result is what Sends.Do decided.
type Result struct {
	Outcome  Outcome
	Answer   Answer // for Inflight and Replayed: the answer to give
	Field    string // for Conflict: the differing field
	Released bool   // for Forwarded: this answer released the req_id
	Err      error  // for Unavailable and FailedOpen
}

// ForwardFunc sends the call to the encoder and returns the answer the
// caller got. delivered is false when nothing reached the encoder (a
// connect failure, or an answer the gateway made itself): such answers are
// not stored, so the caller may try again.
type ForwardFunc func(timeout time.Duration) (a Answer, delivered bool)

// Sends deduplicates /sends over a Store. It is safe for concurrent use.
type Sends struct {
	store    Store
	clk      clock.Clock
	log      *zap.Logger
	m        *Metrics
	failOpen bool
	claimTTL time.Duration

	shards [memShards]flightShard
}

type flightShard struct {
	mu      sync.Mutex // protects flights
	flights map[Key]*flight
}

// flight is one forwarded /send that identical calls wait on.
type flight struct {
	fp   Fingerprint
	done chan struct{} // closed once answer is set
	ans  Answer
}

// NewSends returns a deduplicator over store.
func NewSends(store Store, cfg Config, clk clock.Clock, log *zap.Logger, m *Metrics) *Sends {
	s := &Sends{store: store, clk: clk, log: log, m: m, failOpen: cfg.Redis.FailOpen, claimTTL: cfg.ClaimTTL.D()}
	for i := range s.shards {
		s.shards[i].flights = make(map[Key]*flight)
	}
	return s
}

// Store returns the underlying store.
func (s *Sends) Store() Store { return s.store }

// Replay answers req from the store alone, when it can: a stored record
// (or a conflict with it), or the req_id's release. It is the allocation-free
// fast path; Do repeats it, so callers may skip it.
func (s *Sends) Replay(ctx context.Context, req Send) (Result, bool) {
	rec, found, released, err := s.store.Lookup(ctx, req.Key)
	if err != nil || !(found || released) {
		return Result{}, false
	}
	return s.fromStore(&rec, found, released, req.FP), true
}

// Do answers one /send: from a stored record, by waiting for an identical
// call in flight, or by forwarding it (and storing the answer). deadline is
// this caller's: a waiter leaves at it without disturbing the call it waits
// on; a forwarded call gets the time left, capped by the claim TTL.
func (s *Sends) Do(ctx context.Context, req Send, deadline time.Time, forward ForwardFunc) Result {
	k := req.Key
	rec, found, released, err := s.store.Lookup(ctx, k)
	if err != nil {
		return s.storeDown(err, deadline, forward)
	}
	if found || released {
		return s.fromStore(&rec, found, released, req.FP)
	}
	fs := &s.shards[xxhash.Sum64String(k.ReqID)%memShards]
	fs.mu.Lock()
	if f := fs.flights[k]; f != nil {
		fs.mu.Unlock()
		return s.join(f, req.FP, deadline)
	}
	f := &flight{fp: req.FP, done: make(chan struct{})}
	fs.flights[k] = f
	fs.mu.Unlock()

	res := s.lead(ctx, req, deadline, forward)
	f.ans = res.Answer
	fs.mu.Lock()
	delete(fs.flights, k)
	fs.mu.Unlock()
	close(f.done)
	return res
}

// fromStore turns a Lookup or Claim hit (a record when found, else a
// release) into a result.
func (s *Sends) fromStore(rec *Record, found, released bool, fp Fingerprint) Result {
	if !found {
		s.m.released.Inc()
		return Result{Outcome: Released}
	}
	if field := rec.FP.Diff(fp); field != "" {
		s.m.conflicts.Inc()
		return Result{Outcome: Conflict, Field: field}
	}
	s.m.replay.Inc()
	return Result{Outcome: Replayed, Answer: Answer{rec.Status, rec.ContentType, rec.Body}}
}

// join waits for the flight f until the caller's deadline.
func (s *Sends) join(f *flight, fp Fingerprint, deadline time.Time) Result {
	if field := f.fp.Diff(fp); field != "" {
		s.m.conflicts.Inc()
		return Result{Outcome: Conflict, Field: field}
	}
	t := s.clk.NewTimer(deadline.Sub(s.clk.Now()))
	defer t.Stop()
	select {
	case <-f.done:
		s.m.inflight.Inc()
		return Result{Outcome: Inflight, Answer: f.ans}
	case <-t.C():
		s.m.waitTimeouts.Inc()
		return Result{Outcome: WaitTimeout}
	}
}

// lead runs the claim protocol for the first caller of a key in process.
func (s *Sends) lead(ctx context.Context, req Send, deadline time.Time, forward ForwardFunc) Result {
	for {
		c, err := s.store.Claim(ctx, req.Key, req.FP)
		if err != nil {
			return s.storeDown(err, deadline, forward)
		}
		switch c.State {
		case StateRecorded:
			return s.fromStore(c.Record, true, false, req.FP)
		case StateReleased:
			return s.fromStore(nil, false, true, req.FP)
		case StateBusy:
			if r, again := s.awaitOther(ctx, req, c.FP, deadline); !again {
				return r
			}
			continue // the other replica delivered nothing: claim again
		}
		return s.forwardClaimed(ctx, req, deadline, forward)
	}
}

// awaitOther waits for another replica's claim. again is true when that
// claim ended without a record, so this caller may claim the key itself.
func (s *Sends) awaitOther(ctx context.Context, req Send, holder Fingerprint, deadline time.Time) (r Result, again bool) {
	if field := holder.Diff(req.FP); field != "" {
		s.m.conflicts.Inc()
		return Result{Outcome: Conflict, Field: field}, false
	}
	wctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	rec, ok, err := s.store.Await(wctx, req.Key)
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		s.m.waitTimeouts.Inc()
		return Result{Outcome: WaitTimeout}, false
	case err != nil:
		return s.storeDown(err, deadline, nil), false
	case !ok:
		return Result{}, true
	}
	if field := rec.FP.Diff(req.FP); field != "" {
		s.m.conflicts.Inc()
		return Result{Outcome: Conflict, Field: field}, false
	}
	s.m.inflight.Inc()
	return Result{Outcome: Inflight, Answer: Answer{rec.Status, rec.ContentType, rec.Body}}, false
}

func (s *Sends) forwardClaimed(ctx context.Context, req Send, deadline time.Time, forward ForwardFunc) Result {
	timeout := min(deadline.Sub(s.clk.Now()), s.claimTTL)
	ans, delivered := forward(timeout)
	s.m.forwarded.Inc()
	res := Result{Outcome: Forwarded, Answer: ans}
	if !delivered {
		if err := s.store.Abandon(ctx, req.Key); err != nil {
			s.m.storeErrors.WithLabelValues("abandon").Inc()
			s.log.Warn("abandoning a /send claim failed; it expires with idempotency.claim_ttl",
				zap.String("req_id", req.Key.ReqID), zap.String("destination", req.Key.Dest), zap.Error(err))
		}
		return res
	}
	rec := &Record{Status: ans.Status, ContentType: ans.ContentType, Body: ans.Body, FP: req.FP}
	released, err := s.store.Complete(ctx, req.Key, rec, req.ReceiveCount)
	if err != nil {
		s.m.storeErrors.WithLabelValues("complete").Inc()
		s.log.Error("storing a /send answer failed: a duplicate may reach the encoder",
			zap.String("req_id", req.Key.ReqID), zap.String("destination", req.Key.Dest), zap.Error(err))
	}
	res.Released = released
	return res
}

// storeDown handles an unreachable store: 503, or forward without dedupe
// when fail_open is set.
func (s *Sends) storeDown(err error, deadline time.Time, forward ForwardFunc) Result {
	s.m.storeErrors.WithLabelValues("claim").Inc()
	if s.failOpen && forward != nil {
		s.m.failOpen.Inc()
		ans, _ := forward(min(deadline.Sub(s.clk.Now()), s.claimTTL))
		s.m.forwarded.Inc()
		return Result{Outcome: FailedOpen, Answer: ans, Err: err}
	}
	return Result{Outcome: Unavailable, Err: fmt.Errorf("%w: %w", ErrUnavailable, err)}
}

// Inflight lists the destinations of reqID with a /send in flight here.
func (s *Sends) Inflight(reqID string) []string {
	fs := &s.shards[xxhash.Sum64String(reqID)%memShards]
	fs.mu.Lock()
	defer fs.mu.Unlock()
	var out []string
	for k := range fs.flights {
		if k.ReqID == reqID {
			out = append(out, k.Dest)
		}
	}
	return out
}
