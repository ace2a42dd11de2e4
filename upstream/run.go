package upstream

import (
	"time"

	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/sglang"
)

// run is one call's attempts: route → attempts under the route's policy,
// budget and deadline, each judged once. Its state lives here rather than
// in locals, so that an attempt the encoder holds can park (parked.go):
// the goroutine returns, and the attempt is finished and the attempts go
// on, on another goroutine, once the answer begins or the try's deadline
// passes. Exchange runs it on the caller's goroutine from start to end.
type run struct {
	p        *Pool
	c        *Call
	f        *fleet
	pol      *RetryPolicy
	st       strategy
	budget   *Budget
	start    time.Time // the call's start: its one clock read (Call.Start)
	deadline time.Time // the route's, from the call's start
	res      Result
	n        int       // the attempt in progress, from 1
	t        target    // its target
	tryStart time.Time // when it began, for encgate_upstream_request_duration_seconds

	// The attempt in flight while it is parked: what finishing it needs.
	fl       *metaFlight // the metadata flight it leads, if any
	ticket   Ticket      // the breaker's, when admitted
	admitted bool
	tryEnd   time.Time   // when exchanged read the clock
	sent     sentRequest // the attempt's exchange, while its answer is awaited (parked)
	// gated: this run holds a slot of the pool's sendGate until its
	// first request is out (parkedRun.afterPin).
	gated bool
	// pk, when set, is the parkedRun this run is part of: an attempt
	// whose answer has not begun within its grace (pk.grace) parks
	// (pk.park), and then goes on in resume. Nil: every attempt is awaited
	// where it runs.
	pk *parkedRun
}

// begin reads the clock once for the call and sets its deadline.
func (r *run) begin() {
	now := r.c.Start
	if now.IsZero() {
		now = r.p.clk.Now()
	}
	r.start = now
	r.deadline = now.Add(r.pol.Deadline.D())
	if r.c.Limit > 0 && now.Add(r.c.Limit).Before(r.deadline) {
		r.deadline = now.Add(r.c.Limit)
	}
	r.budget = r.f.budgets[r.c.Route.Label]
	r.budget.RequestAt(now)
	r.n = 1
}

// next runs attempts from r.n on: true when the call ended, false when an
// attempt, or a backoff, parked.
func (r *run) next() bool {
	for {
		t, end, ok := r.st.pick(r.n, r.res.Delivered)
		if end != nil {
			r.res.Verdict = *end
			return true
		}
		if !ok {
			return true
		}
		r.t = t
		if r.attempt() {
			return false
		}
		if end, paused := r.after(); end || paused {
			return end
		}
		r.n++
	}
}

// end finishes the call: an /encode's outcome is recorded on its pin.
func (r *run) end() Result {
	if r.c.Route.Kind == sglang.KindEncode {
		rk, _ := r.st.(*ranked)
		r.res.placed = rk != nil && rk.placed != nil && !rk.lost
		r.p.recordEncode(r.c, r.res)
	}
	return r.res
}

// after reads attempt r.n's verdict: end when the call ends with it;
// otherwise another attempt follows, after its backoff: slept here, or,
// for a run that may park and knows when to stop (Call.Stop), waited out
// parked (parkedRun.pause). paused says the latter: the attempts go on
// from the pause's end, on another goroutine, which may already be
// running, so the caller returns without touching the run.
func (r *run) after() (end, paused bool) {
	r.leaveGate() // an attempt that sent nothing (a shared pull's) ends here; no backoff holds the slot
	p, c, res := r.p, r.c, &r.res
	res.Attempts, res.enc = r.n, r.t.enc
	res.Delivered = res.Delivered || res.Verdict.Delivery != NotSent
	if r.t.failedReg > 0 && p.endFailedRegistration(c, &r.t, &res.Verdict) {
		return true, false
	}
	if !res.Verdict.Retry && p.unknownWhilePending(c, &res.Verdict) {
		res.Verdict.Retry = true
	}
	if !res.Verdict.Retry || r.n >= r.pol.MaxAttempts || !r.st.more(r.n+1) {
		return true, false
	}
	wait := r.pol.Backoff(r.n, p.rand(), p.retryAfter(c, &res.Verdict))
	if p.clk.Now().Add(wait).After(r.deadline) {
		return true, false
	}
	// A long poll whose try ran out in the gateway while the encoder
	// held it (by design: sglang holds a pull up to 180s) goes on
	// waiting without spending the budget: each such retry comes a
	// whole per-try timeout after the last, so they cannot storm, and
	// charging them would fail thousands of held pulls at once in a
	// slow encode. The encoder's own quick 504s (a storm) still pay.
	// Nor does a retry after a shared answer (another rank's pull of
	// the same part): every rank of the part shares that one
	// exchange's "not ready", and their retries share one again, so
	// charging each would spend the budget TP times for one round trip.
	if !heldPollExpired(&res.Verdict) && !res.Verdict.Shared && !r.budget.Retry() {
		p.m.budgetExhausted.WithLabelValues(c.Route.Label).Inc()
		return true, false
	}
	p.m.retries.WithLabelValues(c.Route.Label, res.Verdict.Reason).Inc()
	p.m.backoff.Observe(wait.Seconds())
	if r.waitsParked() {
		r.pk.pause(wait)
		return false, true
	}
	return !p.sleep(c.Done, wait), false
}

// attempt is one exchange of the call with r.t, judged once; the breaker
// is told the verdict's Mark when it admitted the exchange. True when it
// parked: resume finishes it.
func (r *run) attempt() bool {
	p, c, t, v := r.p, r.c, &r.t, &r.res.Verdict
	if r.n > 1 || r.tryStart.IsZero() {
		r.tryStart = p.clk.Now()
	} // else startRun found attempt 1's pin with no wait: it began at the call's start
	timeout := min(r.pol.PerTryTimeout.D(), r.deadline.Sub(r.tryStart))
	if t.failedReg > 0 {
		timeout = min(timeout, t.failedReg)
	}
	if timeout <= 0 {
		*v = noTimeVerdict(c.Route, t.name)
		return false
	}
	r.fl = nil
	if c.Route == sglang.RouteMetadata && p.meta != nil {
		var o Observation
		fl, lead, served := p.meta.join(c, t.enc.id, &o)
		if lead != nil {
			if r.waitsParked() {
				c.Resp.Reset()
				if r.pk.awaitFlight(lead, timeout) {
					return true
				}
				p.meta.took(c, lead, &o) // it ended meanwhile
			} else {
				p.meta.wait(c, lead, timeout, &o)
			}
			served = true
		}
		if served {
			r.sharedVerdict(o)
			return false
		}
		r.fl = fl
	}
	r.ticket, r.admitted = t.enc.Breaker.Admit(r.tryStart)
	if !r.admitted && t.place != nil {
		o := Observation{Err: &breakerBusyError{state: t.enc.Breaker.State().String()}}
		if r.fl != nil {
			p.meta.finish(r.fl, c.Resp, o)
		}
		*v = Judge(c.Route, r.pol, r.f.set.Breaker.Ignore, t.name, o)
		r.settle()
		return false
	}
	c.Resp.Reset()
	req := fasthttp.AcquireRequest()
	req.Header.SetMethodBytes(c.Method)
	req.SetRequestURI(c.Route.Path)
	if len(c.ContentType) > 0 {
		req.Header.SetContentTypeBytes(c.ContentType)
	}
	if len(c.Via) > 0 {
		req.Header.SetBytesV(fasthttp.HeaderVia, c.Via)
	}
	req.SetBodyRaw(c.Body)
	var err error
	if r.pk == nil {
		err = t.do(req, c.Resp, timeout)
		fasthttp.ReleaseRequest(req)
	} else {
		var sent *sentRequest
		var begun bool
		sent, begun, err = t.send(&r.sent, req, c.Resp, timeout, r.pk.grace())
		fasthttp.ReleaseRequest(req)
		r.leaveGate()
		if err == nil {
			if !begun && r.pk.park(sent) {
				return true
			}
			err = sent.receive(c.Resp) // no descriptor to watch: awaited here
			t.enc.release(t.poll)
		}
	}
	r.exchanged(err)
	r.settle()
	return false
}

// waitsParked says whether the run waits with no goroutine of its own
// (a backoff, another pull's flight): it may park, and its call's Stop
// tells it of the server's shutdown, as Done tells a waiting goroutine.
func (r *run) waitsParked() bool { return r.pk != nil && r.c.Stop != nil }

// sharedVerdict judges another pull's exchange as this attempt's own,
// but neither told to the breaker nor counted as a request.
func (r *run) sharedVerdict(o Observation) {
	v := &r.res.Verdict
	*v = Judge(r.c.Route, r.pol, r.f.set.Breaker.Ignore, r.t.name, o)
	v.Breaker, v.Shared = MarkNone, true
}

// resume finishes a parked attempt (its answer has begun, or its try's
// deadline passed) and goes on with the call: true when the call ended,
// false when a backoff or a later attempt parked in turn.
func (r *run) resume(sent *sentRequest) bool {
	err := sent.receive(r.c.Resp)
	r.t.enc.release(r.t.poll)
	r.exchanged(err)
	r.settle()
	return r.goOn()
}

// goOn goes on with the call from its attempt's verdict, once a parked
// wait of that attempt has ended: true when the call ended, false when a
// backoff or a later attempt parked in turn.
func (r *run) goOn() bool {
	if end, paused := r.after(); end || paused {
		return end
	}
	r.n++
	return r.next()
}

// exchanged judges the attempt's exchange from its error or the answer
// in c.Resp, shares it with the metadata flight it led, and learns from
// it.
func (r *run) exchanged(err error) {
	p, c, t := r.p, r.c, &r.t
	end := p.clk.Now()
	r.tryEnd = end
	o := Observation{Err: err}
	if err == nil {
		o.Status, o.Body = c.Resp.StatusCode(), c.Resp.Body()
	}
	if r.fl != nil {
		p.meta.finish(r.fl, c.Resp, o)
		r.fl = nil
	}
	v := &r.res.Verdict
	*v = Judge(c.Route, r.pol, r.f.set.Breaker.Ignore, t.name, o)
	// Timed: what was sent, long polls left out (the encoder holds them
	// as long as it likes).
	if !t.poll && v.Kind != KindRefused && t.enc.latency != nil {
		t.enc.latency.Observe(end.Sub(r.tryStart).Seconds())
	}
	if !t.name.Agent {
		t.enc.learn(c.Route, v, o.Body, end)
	}
}

// settle tells the breaker the attempt's Mark and counts the exchange.
func (r *run) settle() {
	v := &r.res.Verdict
	if r.admitted {
		r.admitted = false
		r.ticket.Report(v.Breaker, r.tryEnd)
	} else if v.Breaker != MarkNone {
		v.Breaker = MarkNone // sent uncounted: the state cannot move elsewhere
	}
	r.ticket = Ticket{}
	r.p.m.exchanged(r.t, r.c.Route, v)
}

// leaveGate gives back the sendGate slot the run holds, if any.
func (r *run) leaveGate() {
	if r.gated {
		r.gated = false
		r.p.sendGate.leave()
	}
}
