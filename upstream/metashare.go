package upstream

import (
	"context"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/jsonfield"
)

// metaShare makes a part's metadata pulls reach its encoder once per
// gateway replica (affinity.metadata_cache). Every receiver TP rank of a
// part pulls the same metadata; on a DP encoder of sglang's GEN1 a sibling
// rank's pull answered while the part's /send is in flight makes the DP
// dispatcher drop the req_id's mapping (protocol reference §12, "DP
// mapping race"). So:
//
//   - while one attempt of a pull for a key (req_id, raw part_idx, encoder)
//     is at the encoder, the others for that key wait for its observation
//     instead of sending (each still within its own try and Call.Done);
//   - a 200 answer is kept (bounded LRU) and answers later pulls of the
//     key without reaching the encoder, until the req_id's /encode is
//     placed again (drop).
//
// Each caller judges the shared observation itself; only the exchange
// that went out is told to its breaker and counted as an upstream request.
type metaShare struct {
	clk clock.Clock

	mu      sync.Mutex
	flights map[shareKey]*metaFlight
	done    *simplelru.LRU[shareKey, *metaAnswer]
	byReq   map[string][]shareKey // the done keys of each req_id, for drop
	waiting prometheus.Gauge      // encgate_metadata_pulls_waiting: on a flight, parked or not

	inflight prometheus.Counter // encgate_metadata_pulls_shared_total{how="inflight"}
	answered prometheus.Counter // encgate_metadata_pulls_shared_total{how="answered"}
}

// shareKey names one part's pull at one encoder.
type shareKey struct {
	reqID string
	part  string // the raw part_idx value
	enc   uint64 // Encoder.id
}

// metaAnswer is one pull's observation, owned by the share (copied in and
// out: Call.Resp is each caller's own).
type metaAnswer struct {
	err    error
	status int
	body   []byte
	ctype  []byte
}

// metaFlight is a pull at the encoder; done closes once ans is set, and
// fns (parked waiters', see onFinish) then run.
type metaFlight struct {
	key  shareKey
	done chan struct{}
	ans  metaAnswer
	fns  []func() // run, each on a goroutine of its own, once done closes; under metaShare.mu
}

// Ways a pull was answered without its own round trip.
const (
	SharedInflight = "inflight" // waited for a pull of the same part in flight
	SharedAnswered = "answered" // a kept 200 answered it
)

func newMetaShare(size int, clk clock.Clock, m *poolMetrics) *metaShare {
	if size <= 0 {
		return nil
	}
	s := &metaShare{clk: clk, flights: map[shareKey]*metaFlight{}, byReq: map[string][]shareKey{},
		inflight: m.metaShared.WithLabelValues(SharedInflight), answered: m.metaShared.WithLabelValues(SharedAnswered),
		waiting: m.metaWaiting}
	// The eviction callback runs inside Add and Remove, which are only
	// called with mu held.
	s.done, _ = simplelru.NewLRU(size, func(k shareKey, _ *metaAnswer) { s.unindex(k) })
	return s
}

var partKey = []string{"part_idx"}

// keyOf is c's share key at enc; ok is false when the body has no
// part_idx to key on (the encoder then answers it alone).
func keyOf(c *Call, enc uint64) (shareKey, bool) {
	var raw [1][]byte
	if jsonfield.Lookup(c.Body, partKey, raw[:]) != nil || raw[0] == nil {
		return shareKey{}, false
	}
	return shareKey{reqID: c.ReqID, part: string(raw[0]), enc: enc}, true
}

// join decides one pull attempt: answered from a kept answer (served
// true: c.Resp and o hold the observation), answered by lead, another
// pull's flight of the same key, once it ends (the caller waits for it:
// wait, or onFinish), or sent by this caller, which then leads fl (nil
// when the body gives no key) and must finish it.
func (s *metaShare) join(c *Call, enc uint64, o *Observation) (fl, lead *metaFlight, served bool) {
	k, ok := keyOf(c, enc)
	if !ok {
		return nil, nil, false
	}
	s.mu.Lock()
	if a, ok := s.done.Get(k); ok {
		s.mu.Unlock()
		a.copyTo(c.Resp, o)
		s.answered.Inc()
		return nil, nil, true
	}
	if lead, ok := s.flights[k]; ok {
		s.mu.Unlock()
		return nil, lead, false
	}
	fl = &metaFlight{key: k, done: make(chan struct{})}
	s.flights[k] = fl
	s.mu.Unlock()
	return fl, nil, false
}

// onFinish registers fn to run, on a goroutine of its own, once lead ends:
// a parked pull's wait for it, with no goroutine meanwhile. false when
// lead has ended already (its answer can be taken at once: took).
func (s *metaShare) onFinish(lead *metaFlight, fn func()) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.flights[lead.key] != lead {
		return false // finish set the answer before it let go of the key
	}
	lead.fns = append(lead.fns, fn)
	return true
}

// waitingOn counts a pull waiting on a flight, parked or not: delta +1
// as it begins, -1 as it ends.
func (s *metaShare) waitingOn(delta float64) { s.waiting.Add(delta) }

// took is lead's observation, for a pull that waited for it.
func (s *metaShare) took(c *Call, lead *metaFlight, o *Observation) {
	lead.ans.copyTo(c.Resp, o)
	s.inflight.Inc()
}

// wait takes lead's observation, or ends at c's own try timeout (a
// timeout, as if its own pull had run out) or Call.Done (canceled).
func (s *metaShare) wait(c *Call, lead *metaFlight, timeout time.Duration, o *Observation) {
	s.waitingOn(1) // before the timer: a test sees it once the timer is made
	defer s.waitingOn(-1)
	t := s.clk.NewTimer(timeout)
	defer t.Stop()
	c.Resp.Reset()
	select {
	case <-lead.done:
		s.took(c, lead, o)
	case <-t.C():
		*o = Observation{Err: fasthttp.ErrTimeout}
	case <-c.Done:
		*o = Observation{Err: context.Canceled}
	}
}

// finish ends fl with the leader's observation o (resp holds its answer):
// its waiters take a copy, and a 200 is kept.
func (s *metaShare) finish(fl *metaFlight, resp *fasthttp.Response, o Observation) {
	a := &fl.ans
	a.err, a.status = o.Err, o.Status
	if o.Err == nil {
		a.body = append([]byte(nil), o.Body...)
		a.ctype = append([]byte(nil), resp.Header.ContentType()...)
	}
	s.mu.Lock()
	delete(s.flights, fl.key)
	fns := fl.fns
	fl.fns = nil
	if o.Err == nil && o.Status == fasthttp.StatusOK {
		if _, had := s.done.Peek(fl.key); !had {
			s.byReq[fl.key.reqID] = append(s.byReq[fl.key.reqID], fl.key)
		}
		s.done.Add(fl.key, a)
	}
	s.mu.Unlock()
	close(fl.done)
	for _, f := range fns {
		go f()
	}
}

// drop forgets the kept answers of reqID: its /encode is being placed
// again, and the encoder's answers to the earlier one no longer hold.
// Pulls in flight are left alone: they may well be the new /encode's
// own (a pull may come before its /encode).
func (s *metaShare) drop(reqID string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	keys, ok := s.byReq[reqID]
	if !ok {
		return
	}
	for _, k := range append([]shareKey(nil), keys...) {
		s.done.Remove(k) // unindex removes it from byReq
	}
	delete(s.byReq, reqID)
}

// unindex removes k from byReq; mu is held.
func (s *metaShare) unindex(k shareKey) {
	keys := s.byReq[k.reqID]
	for i, x := range keys {
		if x == k {
			keys = append(keys[:i], keys[i+1:]...)
			break
		}
	}
	if len(keys) == 0 {
		delete(s.byReq, k.reqID)
	} else {
		s.byReq[k.reqID] = keys
	}
}

// Len is the number of kept answers.
func (s *metaShare) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.done.Len()
}

// copyTo writes a into resp (reset first) and o.
func (a *metaAnswer) copyTo(resp *fasthttp.Response, o *Observation) {
	resp.Reset()
	*o = Observation{Err: a.err}
	if a.err != nil {
		return
	}
	resp.SetStatusCode(a.status)
	if len(a.ctype) > 0 {
		resp.Header.SetContentTypeBytes(a.ctype)
	}
	resp.SetBody(a.body)
	o.Status, o.Body = a.status, resp.Body()
}
