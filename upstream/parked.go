package upstream

import (
	"context"
	"sync"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/poller"
	"github.com/encgate/encgate/internal/sglang"
)

// ExchangeParked is Exchange for a call whose answer the encoder may hold
// for minutes (a long poll: a metadata pull, a registration). Once an
// attempt's request is out, the attempt parks instead of waiting on this
// goroutine: the Pool's poller watches its connection, a timer its try's
// deadline, and whichever comes first resumes it on a goroutine of its own,
// which reads the answer, judges it and goes on with the call exactly as
// Exchange would (retries, backoff, the breaker, the verdict).
//
// It returns (res, true) when the call ended on this goroutine (answered
// at once, refused, or nothing to watch: a TLS connection is awaited
// here). It returns false when an attempt parked: finished(res) then runs
// once the call ends, on another goroutine, and c, with all it points to
// (Body, Resp, ...), must stay valid and untouched until then: the caller
// copies what it borrowed. Without a poller (Deps.Park off, or not Linux)
// it is Exchange.
func (p *Pool) ExchangeParked(c *Call, finished func(Result)) (Result, bool) {
	if p.poller == nil {
		return p.Exchange(c), true
	}
	pr := parkedRuns.Get().(*parkedRun)
	p.startRun(pr, c, finished)
	r := &pr.run
	// A follow-up that comes before its part's /encode waits up to
	// affinity.unknown_wait for the pin (pinned.pick): parked as well,
	// when nothing but this table can end the wait.
	if pn, ok := r.st.(*pinned); ok && c.Route.Kind == sglang.KindFollowUp && !pn.have {
		pn.waited = true // before the wait is registered: it may end at once
		if !p.pins.WaitFunc(c.ReqID, p.aff.UnknownWait.D(), c.Stop, pr.pinWaited) {
			return Result{}, false
		}
		pn.waited = false
	}
	if r.next() {
		res := r.end()
		pr.recycle()
		return res, true
	}
	return Result{}, false
}

// parkedRuns pools the runs of calls that end without parking (most: an
// answer that comes at once); one that parked is left to the collector,
// since a late wake-up of its watch or timer may still reach it.
var parkedRuns = sync.Pool{New: func() any { return new(parkedRun) }}

// recycle gives back the run of a call that ended without parking.
func (pr *parkedRun) recycle() {
	*pr = parkedRun{}
	parkedRuns.Put(pr)
}

// pinWaited goes on with a call whose wait for its pin ended (the pin
// came, or affinity.unknown_wait passed), through the pool's sendGate:
// in a 504 storm thousands of pulls end their waits together, and each
// would otherwise start a goroutine that grows a request's stack and then
// waits its turn to dial (upstream.max_dials_per_encoder) with it.
func (pr *parkedRun) pinWaited() { pr.p.sendGate.enter(pr.afterPin) }

// afterPin runs the call's attempts from where its pin wait left them;
// the gate's slot is left as soon as the first attempt's request is out
// (run.attempt) or the call ends without one.
func (pr *parkedRun) afterPin() {
	pr.run.gated = true
	if pr.run.next() {
		pr.run.leaveGate()
		pr.finished(pr.run.end())
	}
	// Otherwise an attempt or a backoff parked, and the slot was left
	// before it did (run.attempt, run.after): the run may already go on
	// elsewhere, so it is not touched here.
}

// unseenPart reports a follow-up that waited affinity.unknown_wait for its
// part's pin and found none: this gateway has not seen the part's /encode,
// and its encoder holds such a pull until the part comes (sglang: up to
// 180 s), so it parks at once rather than after ParkAfter.
func (pr *parkedRun) unseenPart() bool {
	pn, ok := pr.run.st.(*pinned)
	return ok && pn.waited && !pn.found
}

// sendGate bounds the goroutines that carry parked calls from the end of
// their pin wait to their first request being out: enter runs f on a
// goroutine of its own when fewer than its bound are running, and queues
// it (a function value, no goroutine) otherwise; leave hands the slot to
// the next queued. A slot is held through a dial at most (bounded by
// upstream.connect_timeout), never through a wait for an answer or a
// backoff.
type sendGate struct {
	mu   sync.Mutex
	free int
	q    []func()
}

func newSendGate(n int) *sendGate { return &sendGate{free: max(n, 1)} }

func (g *sendGate) enter(f func()) {
	g.mu.Lock()
	if g.free > 0 {
		g.free--
		g.mu.Unlock()
		go f()
		return
	}
	g.q = append(g.q, f)
	g.mu.Unlock()
}

func (g *sendGate) leave() {
	g.mu.Lock()
	if len(g.q) > 0 {
		f := g.q[0]
		g.q[0] = nil
		g.q = g.q[1:]
		g.mu.Unlock()
		go f()
		return
	}
	g.free++
	g.mu.Unlock()
}

// parkedRun is a run whose attempts park. One attempt is parked at a time;
// gen tells its wake-ups (the watch's, the timer's) from those of an
// earlier park of the same call, which may still run late.
type parkedRun struct {
	run
	finished func(Result)
	// The run's strategy (run.st points to one), kept here so that a call
	// that never parks allocates none.
	pinned pinned
	ranked ranked

	mu    sync.Mutex
	gen   uint64
	woke  bool
	watch poller.Watch
	timer *time.Timer
	sent  *sentRequest
	// A backoff waited out parked (pause): its timer on the pool's clock,
	// and the stop of its registration on Call.Stop.
	pauseTimer clock.Timer
	pauseStop  func() bool
	// Func values made once per run, for the pause's timer and stop.
	pauseEndFn, pauseStopFn func()
	// A metadata pull waiting parked for another of the same part
	// (awaitFlight): that pull's flight, and this wait's timer and stop.
	flight      *metaFlight
	flightTimer clock.Timer
	flightStop  func() bool
}

// How a parked wait on a flight ended.
const (
	flightAnswered = iota
	flightTimedOut
	flightStopped
)

// awaitFlight waits parked for lead, another pull's exchange of the same
// part at its encoder (metaShare), for up to timeout (this attempt's try)
// or until the call's Stop: false when lead has ended already (its answer
// is then taken at once, where the attempt runs).
func (pr *parkedRun) awaitFlight(lead *metaFlight, timeout time.Duration) bool {
	r := &pr.run
	r.leaveGate() // nothing is sent: the slot is not this wait's to hold
	pr.mu.Lock()
	defer pr.mu.Unlock() // the functions below wait for it: they may run before it is set up
	pr.gen++
	gen := pr.gen
	pr.woke = false
	if !pr.p.meta.onFinish(lead, func() { pr.flightEnded(gen, flightAnswered) }) {
		return false
	}
	pr.p.meta.waitingOn(1) // before the timer: a test sees it once the timer is made
	pr.flight = lead
	pr.flightTimer = pr.p.clk.AfterFunc(timeout, func() { pr.flightEnded(gen, flightTimedOut) })
	pr.flightStop = context.AfterFunc(pr.c.Stop, func() { pr.flightEnded(gen, flightStopped) })
	return true
}

// flightEnded goes on with a pull that waited parked for another's
// exchange, once: the first of its end, the try's timeout and the call's
// Stop. Its observation is judged as a shared one, as a pull that waited
// on its goroutine would judge it, and the call goes on from there.
func (pr *parkedRun) flightEnded(gen uint64, how int) {
	pr.mu.Lock()
	if gen != pr.gen || pr.woke || pr.flight == nil {
		pr.mu.Unlock()
		return
	}
	pr.woke = true
	pr.flightTimer.Stop()
	pr.flightStop()
	lead := pr.flight
	pr.flight, pr.flightTimer, pr.flightStop = nil, nil, nil
	pr.mu.Unlock()
	r := &pr.run
	r.p.meta.waitingOn(-1)
	var o Observation
	switch how {
	case flightAnswered:
		r.p.meta.took(r.c, lead, &o)
	case flightTimedOut:
		o.Err = fasthttp.ErrTimeout // as if its own pull had run out
	default:
		o.Err = context.Canceled
	}
	r.sharedVerdict(o)
	if r.goOn() {
		pr.finished(r.end())
	}
}

// pause waits out a retry backoff of wait parked: the pool's clock runs
// pauseEnd when it has passed, and the call's Stop ending first ends the
// call with the attempt's verdict, as a slept backoff's early end does.
func (pr *parkedRun) pause(wait time.Duration) {
	if pr.pauseEndFn == nil {
		pr.pauseEndFn = func() { pr.pauseEnded(false) }
		pr.pauseStopFn = func() { pr.pauseEnded(true) }
	}
	pr.mu.Lock()
	defer pr.mu.Unlock()
	pr.gen++
	pr.woke = false
	pr.pauseTimer = pr.p.clk.AfterFunc(wait, pr.pauseEndFn)
	pr.pauseStop = context.AfterFunc(pr.c.Stop, pr.pauseStopFn)
	pr.p.m.paused.Inc()
}

// pauseEnded goes on with the call once its backoff has passed (through
// the pool's sendGate, as a pin wait's end does: a storm's backoffs end
// together), or ends it when stopped: the first of the two, once.
func (pr *parkedRun) pauseEnded(stopped bool) {
	pr.mu.Lock()
	if pr.woke || pr.pauseTimer == nil {
		pr.mu.Unlock()
		return
	}
	pr.woke = true
	pr.pauseTimer.Stop()
	pr.pauseStop()
	pr.pauseTimer, pr.pauseStop = nil, nil
	pr.mu.Unlock()
	pr.p.m.paused.Dec()
	if stopped {
		pr.finished(pr.run.end())
		return
	}
	pr.p.sendGate.enter(pr.afterPause)
}

// afterPause runs the call's next attempts once its backoff has passed.
func (pr *parkedRun) afterPause() {
	pr.run.gated = true
	pr.run.n++
	if pr.run.next() {
		pr.run.leaveGate()
		pr.finished(pr.run.end())
	}
	// Otherwise parked again, the slot left first (see afterPin).
}

// grace is how long an attempt's answer may take to begin and still be
// read where the attempt runs (the pool's parkAfter): an answer that
// comes at once costs no park and wake-up. None for a part this gateway
// has not seen (unseenPart).
func (pr *parkedRun) grace() time.Duration {
	if pr.unseenPart() {
		return 0
	}
	return pr.p.parkAfter
}

// park watches sent's connection, whose answer has not begun within the
// attempt's grace, and its try's deadline; false when there is no
// descriptor to watch (the attempt is then awaited where it is).
func (pr *parkedRun) park(sent *sentRequest) bool {
	fd, ok := sent.fd()
	if !ok {
		return false
	}
	pr.mu.Lock()
	defer pr.mu.Unlock()
	pr.gen++
	gen := pr.gen
	w, err := pr.p.poller.Watch(fd, func(poller.Event) { pr.wake(gen) })
	if err != nil {
		return false
	}
	pr.watch, pr.sent, pr.woke = w, sent, false
	// The socket's deadline is wall-clock time, as the socket is; the
	// timer makes the read that resumes the attempt find it passed, so its
	// verdict is the timeout the awaiting read would have had.
	pr.timer = time.AfterFunc(time.Until(sent.deadline), func() { pr.wake(gen) })
	pr.p.m.parked.Inc()
	return true
}

// wake resumes the parked attempt, once: the first of its watch and its
// timer to fire.
func (pr *parkedRun) wake(gen uint64) {
	pr.mu.Lock()
	if gen != pr.gen || pr.woke {
		pr.mu.Unlock()
		return
	}
	pr.woke = true
	pr.p.poller.Stop(pr.watch)
	pr.timer.Stop()
	sent := pr.sent
	pr.sent, pr.timer = nil, nil
	pr.mu.Unlock()
	pr.p.m.parked.Dec()
	if pr.run.resume(sent) {
		pr.finished(pr.run.end())
	}
}
