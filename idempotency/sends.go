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
	"github.com/encgate/encgate/internal/sglang"
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
	Failed                     // answered by the gateway: an envelope of Result.Status naming Result.Err
)

// Answer is an HTTP answer as stored and replayed.
type Answer struct {
	Status      int
	ContentType string
	Body        []byte
	// Encoder names the encoder that answered ("" when none did), so a
	// replay can say which encoder it concerns after the req_id's pin is
	// gone.
	Encoder string
}

// Result is what Sends.Do decided.
type Result struct {
	Outcome  Outcome
	Answer   Answer // for Inflight and Replayed: the answer to give
	Field    string // for Conflict: the differing field
	Released bool   // for Forwarded: this answer released the req_id
	Err      error  // for Unavailable, FailedOpen and Failed
	// Status is Failed's: 400 for a destination past the req_id's bound
	// (Err is a *DestinationLimitError), 500 for a forward that panicked.
	Status int
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
	// remote: the store is a server (Redis): Do asks it only Claim, which
	// answers a record or a release as Lookup would (see remoteStore).
	remote bool

	shards [memShards]flightShard
}

type flightShard struct {
	mu      sync.Mutex // protects flights
	flights map[Key]*flight
}

// flight is one forwarded /send that identical calls wait on. It stays
// small: one is allocated per forwarded /send, and a larger one was seen to
// cost the memory store ~25 B per record in fragmented heap spans.
type flight struct {
	fp      Fingerprint
	done    chan struct{} // closed once ans or refusal is set
	ans     Answer        // the leader's answer, when it has one
	refusal *Result       // else what refused the leader
}

// settle records the leader's result for its waiters.
func (f *flight) settle(r Result) {
	switch r.Outcome {
	case Forwarded, FailedOpen, Replayed, Inflight:
		f.ans, f.refusal = r.Answer, nil
	default:
		f.refusal = &Result{Outcome: r.Outcome, Field: r.Field, Err: r.Err, Status: r.Status}
	}
}

// forWaiter is what a caller coalesced on f gets: the leader's answer when
// there is one, else the leader's own refusal (a waiter has the leader's
// fingerprint, so whatever refused the leader refuses it too).
func (f *flight) forWaiter() Result {
	if f.refusal != nil {
		return *f.refusal
	}
	return Result{Outcome: Inflight, Answer: f.ans}
}

// leaderLost is what waiters get if their leader ended without a result
// (a panic that escaped even its own recovery). Never modified.
var leaderLost = Result{Outcome: Failed, Status: 500,
	Err: errors.New("the identical /send this call waited on ended without an answer")}

// remoteStore is a Store each of whose calls is a round trip to a server
// (Redis). Its Claim answers what Lookup would, a stored record or the
// req_id's release, in the same round trip, so Sends asks it Claim alone: a
// first-time /send costs one round trip before it is forwarded (the claim)
// and one after (Complete, storing the answer), a replay one in all (the
// claim finds the record and claims nothing). A Lookup first would cost a
// round trip more on every first-time /send and save none on a replay.
type remoteStore interface{ remote() }

// NewSends returns a deduplicator over store. A store that counts its own
// events (Redis: refused and held completions) gets m.
func NewSends(store Store, cfg Config, clk clock.Clock, log *zap.Logger, m *Metrics) *Sends {
	if o, ok := store.(interface{ observe(*Metrics) }); ok {
		o.observe(m)
	}
	s := &Sends{store: store, clk: clk, log: log, m: m, failOpen: cfg.FailOpen, claimTTL: cfg.ClaimTTL.D()}
	_, s.remote = store.(remoteStore)
	for i := range s.shards {
		s.shards[i].flights = make(map[Key]*flight)
	}
	return s
}

// Store returns the underlying store.
func (s *Sends) Store() Store { return s.store }

// Replay answers req from the store alone, when it can: a stored record
// (or a conflict with it), or the req_id's release. It is the allocation-free
// fast path of a store in this process; Do repeats it, so callers may skip
// it. For a remote store it answers nothing and asks nothing: Do's claim
// answers a replay in the one round trip a Lookup would cost.
func (s *Sends) Replay(ctx context.Context, req Send) (Result, bool) {
	if s.remote {
		return Result{}, false
	}
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
//
// A store in this process is looked up first; a remote one is asked only
// Claim (see remoteStore), by the first caller of the key here: identical
// calls arriving meanwhile wait for it and cost the store nothing.
func (s *Sends) Do(ctx context.Context, req Send, deadline time.Time, forward ForwardFunc) Result {
	k := req.Key
	if !s.remote {
		rec, found, released, err := s.store.Lookup(ctx, k)
		if err != nil {
			return s.storeDownRecovering(ctx, req, err, deadline, forward)
		}
		if found || released {
			return s.fromStore(&rec, found, released, req.FP)
		}
	}
	fs := &s.shards[xxhash.Sum64String(k.ReqID)%memShards]
	fs.mu.Lock()
	if f := fs.flights[k]; f != nil {
		fs.mu.Unlock()
		return s.join(f, req.FP, deadline)
	}
	f := &flight{fp: req.FP, done: make(chan struct{}), refusal: &leaderLost}
	fs.flights[k] = f
	fs.mu.Unlock()
	// Whatever happens to the leader, its waiters are let go.
	defer func() {
		fs.mu.Lock()
		delete(fs.flights, k)
		fs.mu.Unlock()
		close(f.done)
	}()
	res := s.leadRecovering(ctx, req, deadline, forward)
	f.settle(res)
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
	return Result{Outcome: Replayed, Answer: Answer{rec.Status, rec.ContentType, rec.Body, rec.Encoder}}
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
		r := f.forWaiter()
		if r.Outcome == Inflight {
			s.m.inflight.Inc()
		}
		return r
	case <-t.C():
		s.m.waitTimeouts.Inc()
		return Result{Outcome: WaitTimeout}
	}
}

// leadState is how far a leader got, for leadRecovering.
type leadState struct {
	claimed    bool // it holds the store's claim on the key
	forwarding bool // forward was called: the /send may have reached the encoder
}

// leadRecovering is lead, with a panic turned into an answer. fasthttp
// does not recover a handler's panic: it would take the whole gateway
// down, and with it every other caller. So the panic is logged with its
// stack, counted, and answered with a 500 envelope; the flight's waiters
// get the same (Do closes the flight however the leader ends).
//
// What happens to the key depends on how far the leader got. Before forward
// was called nothing reached the encoder: the claim is abandoned and the
// caller may send again. Once forward was called, the /send may have reached
// the encoder (the panic may come after the exchange, while the answer is
// copied), so the claim is not abandoned: the 500 is stored as the key's
// record, as a timeout's 504 is, and the /send is never sent twice.
//
// (No closure is passed in: one allocated per forwarded /send lands in the
// size class of the memory store's entries and fragments their spans.)
func (s *Sends) leadRecovering(ctx context.Context, req Send, deadline time.Time, forward ForwardFunc) (res Result) {
	var st leadState
	defer func() {
		if p := recover(); p != nil {
			res = s.recovered(ctx, req, st, p)
		}
	}()
	return s.lead(ctx, req, deadline, forward, &st)
}

// storeDownRecovering is storeDown (its fail-open forward) with a panic
// turned into an answer, as leadRecovering.
func (s *Sends) storeDownRecovering(ctx context.Context, req Send, err error, deadline time.Time, forward ForwardFunc) (res Result) {
	var st leadState
	defer func() {
		if p := recover(); p != nil {
			res = s.recovered(ctx, req, st, p)
		}
	}()
	return s.storeDown(err, deadline, forward, &st)
}

// recovered logs and counts the panic p of a leader that got as far as st,
// and settles its key.
func (s *Sends) recovered(ctx context.Context, req Send, st leadState, p any) Result {
	s.m.panics.Inc()
	s.log.Error("forwarding a /send panicked; its caller and waiters get a 500",
		zap.String("req_id", req.Key.ReqID), zap.String("destination", req.Key.Dest),
		zap.Bool("may_have_reached_encoder", st.forwarding), zap.Any("panic", p), zap.Stack("stack"))
	return s.afterPanic(ctx, req, st)
}

// afterPanic settles the key of a leader that panicked (see leadRecovering).
// Its own store calls are guarded too: a panic here must not escape either.
func (s *Sends) afterPanic(ctx context.Context, req Send, st leadState) Result {
	msg := "internal error in the gateway before this /send was forwarded; it was not sent and may be sent again"
	if st.forwarding {
		msg = "internal error in the gateway while forwarding this /send; it may have reached the encoder, so it is not sent again"
	}
	res := Result{Outcome: Failed, Status: 500, Err: errors.New(msg)}
	if !st.claimed {
		return res
	}
	defer func() {
		if p := recover(); p != nil {
			s.log.Error("settling the key of a panicked /send panicked too; its claim expires with idempotency.claim_ttl",
				zap.String("req_id", req.Key.ReqID), zap.Any("panic", p))
		}
	}()
	if !st.forwarding {
		s.abandon(ctx, req.Key)
		return res
	}
	reqID := req.Key.ReqID
	rec := &Record{Status: 500, ContentType: "application/json",
		Body: sglang.AppendEnvelope(nil, "encgate: "+msg, &reqID), FP: req.FP}
	s.complete(ctx, req, rec)
	return res
}

// lead runs the claim protocol for the first caller of a key in process.
func (s *Sends) lead(ctx context.Context, req Send, deadline time.Time, forward ForwardFunc, st *leadState) Result {
	for {
		c, err := s.store.Claim(ctx, req.Key, req.FP)
		if err != nil {
			var limit *DestinationLimitError
			if errors.As(err, &limit) {
				s.m.destLimit.Inc()
				return Result{Outcome: Failed, Status: 400, Err: err}
			}
			return s.storeDown(err, deadline, forward, st)
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
		st.claimed = true
		return s.forwardClaimed(ctx, req, deadline, forward, st)
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
		return s.storeDown(err, deadline, nil, nil), false
	case !ok:
		return Result{}, true
	}
	if field := rec.FP.Diff(req.FP); field != "" {
		s.m.conflicts.Inc()
		return Result{Outcome: Conflict, Field: field}, false
	}
	s.m.inflight.Inc()
	return Result{Outcome: Inflight, Answer: Answer{rec.Status, rec.ContentType, rec.Body, rec.Encoder}}, false
}

func (s *Sends) forwardClaimed(ctx context.Context, req Send, deadline time.Time, forward ForwardFunc, st *leadState) Result {
	timeout := min(deadline.Sub(s.clk.Now()), s.claimTTL)
	st.forwarding = true
	ans, delivered := forward(timeout)
	s.m.forwarded.Inc()
	res := Result{Outcome: Forwarded, Answer: ans}
	if !delivered {
		st.forwarding = false // provably nothing reached the encoder
		s.abandon(ctx, req.Key)
		return res
	}
	rec := &Record{Status: ans.Status, ContentType: ans.ContentType, Body: ans.Body, FP: req.FP, Encoder: ans.Encoder}
	res.Released = s.complete(ctx, req, rec)
	return res
}

// complete stores rec for req's key and reports whether that released the
// req_id.
func (s *Sends) complete(ctx context.Context, req Send, rec *Record) bool {
	released, err := s.store.Complete(ctx, req.Key, rec, req.ReceiveCount)
	switch {
	case errors.Is(err, ErrCompletionPending):
		// Held by the store, which counts and logs it once per burst.
		s.m.storeErrors.WithLabelValues("complete").Inc()
	case err != nil:
		s.m.storeErrors.WithLabelValues("complete").Inc()
		s.log.Error("storing a /send answer failed: a duplicate may reach the encoder",
			zap.String("req_id", req.Key.ReqID), zap.String("destination", req.Key.Dest), zap.Error(err))
	}
	return released
}

// abandon ends the claim on k: nothing reached the encoder.
func (s *Sends) abandon(ctx context.Context, k Key) {
	if err := s.store.Abandon(ctx, k); err != nil {
		s.m.storeErrors.WithLabelValues("abandon").Inc()
		s.log.Warn("abandoning a /send claim failed; the store ends it once it answers again (at the latest it expires with idempotency.claim_ttl)",
			zap.String("req_id", k.ReqID), zap.String("destination", k.Dest), zap.Error(err))
	}
}

// storeDown handles an unreachable store: 503, or forward without dedupe
// when fail_open is set.
func (s *Sends) storeDown(err error, deadline time.Time, forward ForwardFunc, st *leadState) Result {
	s.m.storeErrors.WithLabelValues("claim").Inc()
	if s.failOpen && forward != nil {
		s.m.failOpen.Inc()
		if st != nil {
			st.forwarding = true
		}
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
