package upstream

import (
	"bytes"
	"context"
	"sync"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/jsonfield"
	"github.com/encgate/encgate/internal/sglang"
)

// Call is one caller request on its way to an encoder.
type Call struct {
	Route *sglang.Route
	ReqID string
	// Rank marks a GEN0 receiver rank's own /encode (sglang.Request.Rank).
	Rank bool
	// Method, ContentType and Body are sent as they are; Body is shared,
	// not copied.
	Method      []byte
	ContentType []byte
	Body        []byte
	// PlaceKey, for an /encode, is the raw text of its body's mm_items
	// value (a view of Body, shared, not copied). With affinity.encode_by
	// content the /encode is placed by rendezvous on its hash under bounded
	// load (Pool.placement); nil, or encode_by req_id, places it by ReqID.
	// Follow-ups ignore it: they follow the pin.
	PlaceKey []byte
	// Limit, when positive, caps the route's retry deadline (a /send gets
	// what is left of its claim).
	Limit time.Duration
	// Done ends waits early: the caller's server is shutting down.
	Done <-chan struct{}
	// Stop, when set, is Done as a context, ended at the same moment: a
	// call that may park (ExchangeParked) waits out its retry backoffs
	// parked too, with no goroutine, and Stop is how such a wait learns of
	// the shutdown (context.AfterFunc). Without it backoffs are slept.
	Stop context.Context
	// Resp receives each attempt's answer; after Exchange it holds the
	// last one when the verdict is KindAnswered. The caller owns it.
	Resp *fasthttp.Response
	// Via, when set, is sent as the Via header of every attempt (and of a
	// broadcast's requests): the caller's hop list with the gateway's own
	// entry appended, by which a gateway that sees its own entry come back
	// knows the request looped. Each attempt's request is built afresh
	// from the call, so nothing of the caller's headers passes unless it is
	// carried here. Shared, not copied.
	Via []byte
	// Start, when set, is when the caller read the request (its one clock
	// read): the route's deadline counts from it, and the retry budget
	// counts the call in its second. Zero: the exchange reads the clock.
	Start time.Time
}

// Result is how a call ended.
type Result struct {
	// Verdict is the last attempt's, or the routing decision's when the
	// call ended without an exchange.
	Verdict Verdict
	// Attempts counts the exchanges tried, refused ones included.
	Attempts int
	// Delivered says some attempt may have reached an encoder.
	Delivered bool

	enc    *Encoder // the last attempt's encoder
	placed bool     // this call placed the req_id's pin
}

// Exchange runs c: route → attempts under the route's policy, budget and
// deadline, each judged once (Judge) → breaker, metrics and retry read
// that verdict. An /encode is placed by the ranked strategy (placement
// order, re-pinned on each retry) unless its req_id is already pinned, in
// which case it follows the pin as every follow-up does (the pinned
// strategy). Its outcome is then recorded on the pin.
func (p *Pool) Exchange(c *Call) Result {
	sr := syncRuns.Get().(*syncRun)
	sr.call = *c // the run reads its own copy, so the caller's may stay on its stack
	p.startRun(&sr.pr, &sr.call, nil)
	sr.pr.run.next()
	res := sr.pr.run.end()
	*sr = syncRun{} // it never parked: nothing else can reach it
	syncRuns.Put(sr)
	return res
}

// syncRun is Exchange's pooled run, one that never parks, with the copy of
// its call (a parked call's is its caller's, so a held pull does not
// carry this one).
type syncRun struct {
	pr   parkedRun
	call Call
}

var syncRuns = sync.Pool{New: func() any { return new(syncRun) }}

// startRun begins c's run in pr, a pooled run (its strategy in it, so the
// call allocates neither); finished, when set, makes it a parkable run
// (ExchangeParked) that ends by calling finished.
func (p *Pool) startRun(pr *parkedRun, c *Call, finished func(Result)) {
	f := p.fleet.Load()
	pr.finished = finished
	r := &pr.run
	*r = run{p: p, c: c, f: f, pol: f.set.Retry.Policy(c.Route.Label)}
	if finished != nil {
		r.pk = pr
	}
	if c.Route.Kind == sglang.KindEncode {
		pr.ranked = ranked{p: p, c: c}
		r.st = &pr.ranked
	} else {
		pr.pinned = pinned{p: p, c: c}
		r.st = &pr.pinned
	}
	r.begin()
	if c.Route.Kind == sglang.KindFollowUp {
		// Most follow-ups find their part pinned here: that pin, read at
		// the call's start, is attempt 1's, with no wait for it, and the
		// attempt begins at that start too, so the call reads the clock
		// for neither.
		if pin, ok := p.pins.LocalAt(c.ReqID, r.start); ok {
			pr.pinned.have, pr.pinned.pin = true, pin
			r.tryStart = r.start
		}
	}
}

// A strategy picks the target of each attempt of one call.
type strategy interface {
	// pick returns the target of attempt n (from 1); sent says an earlier
	// attempt may have reached an encoder. A non-nil end finishes the call
	// with that verdict instead (routing answered: no usable encoder, a
	// remembered failure); ok false finishes it with the last attempt's
	// verdict (no encoder is left to try).
	pick(n int, sent bool) (t target, end *Verdict, ok bool)
	// more reports, without side effects, whether attempt n may have a
	// target, so that no backoff is waited for nothing.
	more(n int) bool
}

// unknownWhilePending reports a DP encoder's 404 "Unknown req_id" to a
// metadata pull or registration while the part's /encode is still in
// flight (its pin pending): the encoder's dispatcher gave up waiting for
// the req_id's mapping (min(5 s, REQ_TIMEOUT), §2, §12) before the /encode
// reached it. That is "not ready yet", retried under the route's policy
// like the 504s; it was never a breaker fault (a 4xx). Once the /encode
// ended, its pin answers instead (pinned.pick), and with no pin the pull
// had already waited affinity.unknown_wait for one.
func (p *Pool) unknownWhilePending(c *Call, v *Verdict) bool {
	if v.Kind != KindAnswered || v.Status != fasthttp.StatusNotFound || !c.Route.LongPoll ||
		!bytes.Contains(c.Resp.Body(), []byte(sglang.UnknownReqID)) {
		return false
	}
	pin, ok := p.pins.Current(c.ReqID)
	return ok && pin.State == PinPending
}

// endFailedRegistration ends a registration forwarded for a part whose
// /encode its encoder failed (target.failedReg), and learns from it: an
// answer within the bound is the encoder's own (GEN0 and GEN1 take it with
// 200 and push their error frame to the rank), so it passes; a try cut
// off at the bound means the encoder holds such registrations (NEW; a
// GEN1 DP encoder's 404 comes only after its mapping wait): the rank gets
// the remembered failure now, and later ones to this encoder are answered
// at once. True when the call ends here.
func (p *Pool) endFailedRegistration(c *Call, t *target, v *Verdict) bool {
	now := p.clk.Now()
	l := &t.enc.learned
	switch {
	case v.Kind == KindAnswered && v.Status == fasthttp.StatusOK:
		l.set(&l.failedRegistration, Yes, now)
		return true
	case v.Kind == KindAnswered:
		return true
	case v.Kind != KindTimeout:
		return false // not sent, or broken: the policy decides
	}
	l.set(&l.failedRegistration, No, now)
	if pin, ok := p.pins.Current(c.ReqID); ok && pin.Failed() {
		*v = rememberedVerdict(pin)
		return true
	}
	return false
}

// heldPollExpired reports a long-poll try that the gateway's per-try
// timeout ended while the encoder was holding it.
func heldPollExpired(v *Verdict) bool { return v.Kind == KindTimeout && v.Cause == CauseExpired }

// retryAfter is the encoder's Retry-After on the last answer, if any.
func (p *Pool) retryAfter(c *Call, v *Verdict) time.Duration {
	if v.Kind != KindAnswered {
		return 0
	}
	h := c.Resp.Header.Peek(fasthttp.HeaderRetryAfter)
	if len(h) == 0 {
		return 0
	}
	d, _ := ParseRetryAfter(h, p.clk.Now())
	return d
}

// sleep waits d on the injected clock; false when done closes first.
func (p *Pool) sleep(done <-chan struct{}, d time.Duration) bool {
	t := p.clk.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C():
		return true
	case <-done:
		return false
	}
}

// recordEncode remembers how an /encode ended on its req_id's pin: a 200
// marks the pin encoded; anything else marks it failed, so that its
// follow-ups get the same status and message at once (Pins.Fail keeps a
// pin already encoded). An /encode the gateway refused before anything of
// it was sent, and that placed no pin (no usable encoder, every breaker or
// in-flight limit refusing, the pinned encoder down), records nothing: no
// encoder holds anything of the part, and a refusal a client can repeat at
// any rate must not take the bound's slots from parts that are encoded.
func (p *Pool) recordEncode(c *Call, res Result) {
	v := res.Verdict
	if v.Kind == KindAnswered && v.Status == fasthttp.StatusOK {
		p.pins.Encoded(c.ReqID, res.enc.id)
		return
	}
	msg, answered := v.Message, v.Kind == KindAnswered
	if !answered && !res.Delivered && !res.placed {
		return
	}
	f := Failure{Status: v.Status, Message: msg, Answered: answered,
		Consequence: v.Cause == CauseOtherRequest, Placed: res.placed}
	if answered {
		f.Message = AnswerMessage(c.Resp.Body())
		f.Encoder, f.EncoderID = res.enc.Name, res.enc.id
	}
	p.pins.Fail(c.ReqID, f)
}

var messageKey = []string{"message"}

// AnswerMessage extracts the message of an encoder's error answer as
// sglang's receivers do: the envelope's "message", else the raw text.
func AnswerMessage(body []byte) string {
	var raw [1][]byte
	if jsonfield.Lookup(body, messageKey, raw[:]) == nil {
		if m, ok := jsonfield.String(raw[0]); ok {
			return m
		}
	}
	return string(bytes.TrimSpace(body))
}

// ranked places an /encode: the usable encoders in Pool.placement's
// order, one per attempt, the req_id pinned to each as its attempt is
// admitted (see target.place). A req_id already pinned (a GEN0 sibling
// rank's /encode, a retry of a placed one) follows its pin.
type ranked struct {
	p      *Pool
	c      *Call
	list   []*Encoder
	buf    [16]*Encoder
	placed *Encoder // where the pin is, once an attempt was admitted
	lost   bool     // a sibling placed or settled the pin meanwhile
	follow *pinned
}

// placement appends to dst the order in which an unpinned /encode tries
// the usable encoders: rendezvous on its req_id, or with affinity.encode_by
// content and media to hash (Call.PlaceKey), rendezvous on the media's hash
// under bounded load (boundLoad, affinity.load_factor), so that the same
// media reaches the encoder whose cache holds it unless that encoder holds
// more than its share. It allocates nothing.
func (p *Pool) placement(c *Call, dst []*Encoder) []*Encoder {
	if p.aff.EncodeBy != EncodeByContent || len(c.PlaceKey) == 0 {
		return p.Ranked(c.ReqID, dst)
	}
	start := len(dst)
	dst = p.RankedBy(contentHash(c.PlaceKey), dst)
	boundLoad(dst[start:], p.aff.LoadFactor)
	return dst
}

func (s *ranked) pick(n int, sent bool) (target, *Verdict, bool) {
	if s.follow != nil || s.lost {
		return s.followPin(n, sent)
	}
	if n == 1 {
		// This replica's table only: with shared pins, Place asks the
		// share in the same round trip (a sibling placed on another
		// replica is followed from there).
		if pin, ok := s.p.pins.Local(s.c.ReqID); ok && !pin.Failed() {
			return s.followPin(n, sent)
		}
		s.list = s.p.placement(s.c, s.buf[:0])
		if len(s.list) == 0 {
			v := noEncoderVerdict()
			return target{}, &v, false
		}
	}
	if n > len(s.list) {
		return target{}, nil, false
	}
	e := s.list[n-1]
	return e.targetFor(s.c.Route, func() bool { return s.place(e) }), nil, true
}

// place pins the req_id to e as its attempt goes out: a first placement,
// or a move from the encoder an earlier attempt reached with nothing. When
// a concurrent /encode of the same req_id (a GEN0 sibling rank's) pinned it
// first, this call follows that pin from its next attempt on; it still
// goes now if that pin is on e.
func (s *ranked) place(e *Encoder) bool {
	id := s.c.ReqID
	var ok bool
	var pin Pin
	if s.placed == nil {
		pin, ok = s.p.pins.Place(id, e.Name, e.id)
	} else {
		ok = s.placed == e || s.p.pins.Move(id, s.placed.id, e.Name, e.id)
		if !ok {
			pin, _ = s.p.pins.Get(id)
		}
	}
	if ok {
		s.placed = e
		if s.p.meta != nil {
			s.p.meta.drop(id) // the encoder's answers to an earlier /encode of it no longer hold
		}
		return true
	}
	s.lost = true
	return pin.EncoderID == e.id
}

func (s *ranked) followPin(n int, sent bool) (target, *Verdict, bool) {
	if s.follow == nil {
		s.follow = &pinned{p: s.p, c: s.c}
		n, sent = 1, false // its first pick reads the pin
	}
	return s.follow.pick(n, sent)
}

func (s *ranked) more(n int) bool {
	if s.follow != nil || s.lost {
		return true
	}
	return n <= len(s.list)
}

// pinned sends a call to the encoder that holds its req_id: the pin's
// (waiting up to affinity.unknown_wait for one to appear, as follow-ups
// may come before their /encode), else the rendezvous owner. Every attempt
// goes to the same encoder, unless the part's /encode fails meanwhile:
// then the failure is the answer (see decide).
type pinned struct {
	p      *Pool
	c      *Call
	t      target
	found  bool // attempt 1 followed a pin
	waited bool // the wait for a pin was done before attempt 1 (ExchangeParked)
	have   bool // pin is attempt 1's, read at the call's start (startRun)
	pin    Pin
}

func (s *pinned) pick(n int, sent bool) (target, *Verdict, bool) {
	if n > 1 && s.t.enc != nil {
		pin, ok := s.p.pins.Current(s.c.ReqID)
		switch {
		case !ok:
		case pin.Failed() && (!s.found || !s.forwardFailed(pin)):
			return s.decide(pin, true)
		case s.found && !sent && pin.EncoderID != s.t.enc.id:
			// The /encode moved on (nothing reached the encoder it was
			// pinned to) and so did nothing of this call: follow it.
			return s.decide(pin, true)
		}
		s.t.poll = s.longPoll(pin, ok) // the part may have been encoded since the last attempt
		return s.t, nil, true
	}
	var pin Pin
	var ok bool
	switch {
	case s.c.Route.Kind == sglang.KindEncode:
		pin, ok = s.p.pins.Get(s.c.ReqID)
	case s.have:
		pin, ok = s.pin, true
	case s.waited: // ExchangeParked waited already (PinTable.WaitFunc)
		pin, ok = s.p.pins.Wait(s.c.ReqID, 0, s.c.Done)
	default:
		pin, ok = s.p.pins.Wait(s.c.ReqID, s.p.aff.UnknownWait.D(), s.c.Done)
	}
	return s.decide(pin, ok)
}

func (s *pinned) more(int) bool { return true }

// decide turns what the pin table says into the target, or the answer.
//
//   - No pin: the rendezvous owner, as the part's /encode would choose it.
//   - A failed /encode: its status and message at once, except for a
//     registration whose failure an encoder answered that is not known to
//     hold such registrations: GEN0 and GEN1 report a failed zmq encode
//     only through their error frame to URLs registered with them, so the
//     registration is forwarded (it is idempotent), bounded by
//     affinity.failed_registration_wait, and the rank hears the encoder's
//     own failure (endFailedRegistration).
//   - The encoder is no longer configured, or down by active health: a
//     fast 503 naming it; its staged state cannot move.
//   - Its breaker is open: a follow-up gets the same fast 503. A sibling's
//     /encode still goes, uncounted: it is not new work but the part
//     already placed there, and the encoder answers it from that encode.
func (s *pinned) decide(pin Pin, ok bool) (target, *Verdict, bool) {
	if !ok {
		e, err := s.p.Owner(s.c.ReqID)
		if err != nil {
			v := noEncoderVerdict()
			return target{}, &v, false
		}
		s.t = e.targetFor(s.c.Route, nil)
		s.t.poll = s.longPoll(pin, ok)
		return s.t, nil, true
	}
	s.found = true
	e, known := s.p.lookupPinned(pin)
	switch {
	case pin.Failed() && !(known && s.forwardFailed(pin)):
		v := rememberedVerdict(pin)
		return target{}, &v, false
	case !known:
		v := goneVerdict(pin.Encoder)
		return target{}, &v, false
	case e.Down(), !e.Usable() && !s.throughOpenBreaker(pin):
		v := unusableVerdict(e)
		return target{}, &v, false
	}
	s.t = e.targetFor(s.c.Route, nil)
	s.t.poll = s.longPoll(pin, ok)
	if pin.Failed() {
		s.t.failedReg = s.p.aff.FailedRegistrationWait.D()
	}
	return s.t, nil, true
}

// longPoll classifies an attempt by the pin read as it is picked: a
// metadata pull or registration of a part not known encoded (no pin, or a
// pending one) may be held by the encoder until the part's encode (up to
// 180 s), so it counts against the long polls' bound (target.poll). One of
// a part already encoded is answered at once, and, like /encode and /send,
// counts against the total only. An attempt already sent stays as it was
// classed when the part is encoded meanwhile.
func (s *pinned) longPoll(pin Pin, ok bool) bool {
	return s.c.Route.Kind == sglang.KindFollowUp && s.c.Route.LongPoll && (!ok || pin.State == PinPending)
}

// forwardFailed: a registration for a part whose encoder answered the
// failure goes to that encoder unless it is known to hold such
// registrations (see decide, Encoder.forwardsFailedRegistration).
func (s *pinned) forwardFailed(pin Pin) bool {
	if s.c.Route != sglang.RouteReceiveURL || !pin.Answered {
		return false
	}
	e, ok := s.p.lookupPinned(pin)
	return ok && e.forwardsFailedRegistration()
}

// throughOpenBreaker: state already on the encoder that only it can answer
// for (a sibling /encode; a gen0 registration after a failure) goes even
// while its breaker is open.
//
// So does a follow-up whose pin another replica placed: that replica's
// breaker admitted the /encode, the part is on the encoder, and this
// replica's breaker (which judges this replica's own exchanges) cannot
// move it. It goes uncounted, like a sibling's /encode.
func (s *pinned) throughOpenBreaker(pin Pin) bool {
	return s.c.Route.Kind == sglang.KindEncode || pin.Failed() || pin.Remote
}

// BroadcastAnswer is one encoder's part of a broadcast.
type BroadcastAnswer struct {
	Encoder string
	Status  int
	Text    string
}

// Broadcast sends c to every encoder within timeout each, outside the
// breakers and retry policies (a profile command), and returns each answer
// in fleet order: the encoder's status and text, or the gateway's verdict.
func (p *Pool) Broadcast(c *Call, timeout time.Duration) []BroadcastAnswer {
	encs := p.Encoders()
	out := make([]BroadcastAnswer, len(encs))
	done := make(chan struct{})
	for i, e := range encs {
		go func() {
			defer func() { done <- struct{}{} }()
			out[i] = p.broadcastOne(c, e, timeout)
		}()
	}
	for range encs {
		<-done
	}
	return out
}

func (p *Pool) broadcastOne(c *Call, e *Encoder, timeout time.Duration) BroadcastAnswer {
	req := fasthttp.AcquireRequest()
	resp := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.Header.SetMethodBytes(c.Method)
	req.SetRequestURI(c.Route.Path)
	if len(c.ContentType) > 0 {
		req.Header.SetContentTypeBytes(c.ContentType)
	}
	if len(c.Via) > 0 {
		req.Header.SetBytesV(fasthttp.HeaderVia, c.Via)
	}
	req.SetBodyRaw(c.Body)
	t := e.targetFor(c.Route, nil)
	err := t.do(req, resp, timeout)
	o := Observation{Err: err}
	if err == nil {
		o.Status, o.Body = resp.StatusCode(), resp.Body()
	}
	v := Judge(c.Route, nil, nil, t.name, o)
	v.Breaker = MarkNone // outside the breakers
	p.m.exchanged(t, c.Route, &v)
	if v.Kind != KindAnswered {
		return BroadcastAnswer{Encoder: e.Name, Status: v.Status, Text: v.Message}
	}
	return BroadcastAnswer{Encoder: e.Name, Status: v.Status, Text: string(bytes.TrimRight(o.Body, "\n"))}
}
