package fakeencoder

import (
	"context"
	"time"

	"github.com/valyala/fastjson"
)

// reqState mirrors sglang's ReqState: one encoder request's result and the
// work in flight on it.
type reqState struct {
	id               string
	activeEncodes    int
	activeSends      int
	releaseRequested bool
	preserveMeta     bool // keep the (error) metadata on release
	ready            bool // embedding_ready: staged embedding or error
	failed           bool // the staged result is an error
}

// metaEntry is one published metadata record (sglang EncoderMetaRegistry).
type metaEntry struct {
	hasErr bool
	errMsg string
	size   int64
	length int64
	dim    int64
	at     time.Time // last publish, for the sweep
}

// sendCount is the per-req_id /send refcount.
type sendCount struct {
	dests map[string]struct{} // NEW: distinct prefill_host:embedding_port
	calls int                 // OLD: raw calls
}

// recvReg holds /scheduler_receive_url registrations for one req_id.
type recvReg struct {
	countKey string            // receive_count identity, for the consistency check
	countStr string            // receive_count as Python prints it
	count    int64             // receive_count as an integer; -1 if not an integer
	urls     map[string]string // receive_url identity (pyKey) -> URL as Python prints it
}

// newRecvReg is an empty registration set whose receive_count is count.
func newRecvReg(count *fastjson.Value) *recvReg {
	n, ok := countOf(count)
	if !ok {
		n = -1
	}
	return &recvReg{countKey: pyKey(count), countStr: pyStr(count), count: n, urls: map[string]string{}}
}

// inflight is a GEN0 mooncake /encode in flight or done, which the
// receiver TP ranks' /encode calls with the same req_id wait for (sglang
// _inflight_encode_events and _inflight_encode_meta).
type inflight struct {
	done bool      // the first call finished (the event is set)
	ok   bool      // it succeeded: meta holds the sizes
	meta metaEntry // the sizes the first call answered
}

// lead504 counts the leading 504s answered for one req_id.
type lead504 struct {
	n  int
	at time.Time
}

// watch is a broadcast wake-up for the waiters on one req_id: ch is closed and
// replaced on every change.
type watch struct {
	ch chan struct{}
	n  int
}

// waitResult says how a wait ended.
type waitResult int

const (
	waitOK       waitResult = iota // the condition became true
	waitTimeout                    // the timeout passed
	waitCanceled                   // the client went away
	waitClosed                     // the encoder was closed
)

// notifyLocked wakes the waiters on id. e.mu must be held.
func (e *Encoder) notifyLocked(id string) {
	if w := e.watches[id]; w != nil {
		close(w.ch)
		w.ch = make(chan struct{})
	}
}

// waitLocked waits until cond() holds, re-checking it whenever id is
// notified. timeout <= 0 waits without a limit. e.mu must be held on entry;
// it is held again on return. route names the wait in Stats.Waiting.
func (e *Encoder) waitLocked(ctx context.Context, route, id string, timeout time.Duration, cond func() bool) waitResult {
	if cond() {
		return waitOK
	}
	var expired <-chan time.Time
	if timeout > 0 {
		t := time.NewTimer(timeout)
		defer t.Stop()
		expired = t.C
	}
	w := e.watches[id]
	if w == nil {
		w = &watch{ch: make(chan struct{})}
		e.watches[id] = w
	}
	w.n++
	e.waiting[route]++
	defer func() {
		if w.n--; w.n == 0 {
			delete(e.watches, id)
		}
		if e.waiting[route]--; e.waiting[route] == 0 {
			delete(e.waiting, route)
		}
	}()
	for {
		ch := w.ch
		e.mu.Unlock()
		var res waitResult
		select {
		case <-ch:
			res = waitOK
		case <-expired:
			res = waitTimeout
		case <-ctx.Done():
			res = waitCanceled
		case <-e.done:
			res = waitClosed
		}
		e.mu.Lock()
		switch {
		case res != waitOK && res != waitTimeout:
			return res
		case cond():
			return waitOK
		case res == waitTimeout:
			return waitTimeout
		}
	}
}

// sleep waits d (forever when d < 0), counted in Stats.Waiting under route.
// It reports false when the client went away or the encoder was closed.
func (e *Encoder) sleep(ctx context.Context, route string, d time.Duration) bool {
	if d == 0 {
		return true
	}
	if d < 0 {
		d = 0
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	res := e.waitLocked(ctx, route, "", d, func() bool { return false })
	return res == waitTimeout
}

// acquireEncodeLocked returns id's state, creating it, and takes an encode
// reference on it (sglang _acquire_encode_ref).
func (e *Encoder) acquireEncodeLocked(id string) *reqState {
	st := e.states[id]
	if st == nil {
		st = &reqState{id: id}
		e.states[id] = st
	}
	st.activeEncodes++
	e.notifyLocked(id)
	return st
}

// releaseEncodeRefLocked drops an encode reference and completes a release
// requested meanwhile (sglang _release_encode_ref).
func (e *Encoder) releaseEncodeRefLocked(st *reqState) {
	st.activeEncodes--
	if st.releaseRequested && st.activeEncodes == 0 {
		e.releaseLocked(st.id, false)
	}
}

// stageLocked marks the embedding (or an error) ready and wakes /send
// callers waiting for it.
func (e *Encoder) stageLocked(st *reqState, failed bool) {
	st.ready = true
	st.failed = failed
	e.notifyLocked(st.id)
}

// releaseLocked requests the release of id (sglang release_request): the
// state goes once no encode or send is active on it; the metadata goes with
// it unless preserve.
func (e *Encoder) releaseLocked(id string, preserve bool) {
	st := e.states[id]
	if st == nil {
		if !preserve {
			e.discardLocked(id)
		}
		return
	}
	st.releaseRequested = true
	st.preserveMeta = st.preserveMeta || preserve
	e.notifyLocked(id)
	e.finishReleaseLocked(st)
}

// finishReleaseLocked drops a release-requested state once it is idle.
func (e *Encoder) finishReleaseLocked(st *reqState) {
	if !st.releaseRequested || st.activeEncodes > 0 || st.activeSends > 0 || e.states[st.id] != st {
		return
	}
	delete(e.states, st.id)
	delete(e.recv, st.id)
	if !st.preserveMeta {
		e.discardLocked(st.id)
	}
	e.notifyLocked(st.id)
}

// discardLocked drops id's metadata and send refcount, and a finished GEN0
// /encode record (one in flight is dropped by its own call).
func (e *Encoder) discardLocked(id string) {
	delete(e.meta, id)
	delete(e.sendDone, id)
	if rec := e.dedupe[id]; rec != nil && rec.done {
		delete(e.dedupe, id)
	}
}

// publishLocked publishes id's metadata, wakes its waiters and arms the sweep.
func (e *Encoder) publishLocked(id string, m metaEntry) {
	m.at = time.Now()
	e.meta[id] = &m
	e.notifyLocked(id)
	e.ensureSweeperLocked()
}

// ensureSweeperLocked starts the sweeper goroutine once (sglang
// _ensure_sweeper). e.mu must be held.
func (e *Encoder) ensureSweeperLocked() {
	if !e.sweeping && !e.closed {
		e.sweeping = true
		e.bg.Add(1)
		go e.sweepLoop()
	}
}

// noteSendDoneLocked counts one /send and releases id once count is reached.
func (e *Encoder) noteSendDoneLocked(id string, count int64, dest string) {
	sc := e.sendDone[id]
	if sc == nil {
		sc = &sendCount{dests: map[string]struct{}{}}
		e.sendDone[id] = sc
	}
	sc.dests[dest] = struct{}{}
	sc.calls++
	done := int64(len(sc.dests)) >= count
	if e.opts.RefcountCalls {
		done = int64(sc.calls) >= count
	}
	if done {
		e.registryReleaseLocked(id)
	}
}

// registryReleaseLocked is the registry release: the request (mooncake holds the
// embedding in the registry's owner) and then the metadata.
func (e *Encoder) registryReleaseLocked(id string) {
	if e.opts.Mode == ModeMooncake {
		e.releaseLocked(id, false)
	}
	e.discardLocked(id)
}

// sweepLoop drops stale state until Close.
func (e *Encoder) sweepLoop() {
	defer e.bg.Done()
	every := max(e.opts.SweepAfter/4, 10*time.Millisecond)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-e.done:
			return
		case now := <-t.C:
			e.sweep(now)
		}
	}
}

// sweep releases requests whose last metadata publish is older than
// SweepAfter and forgets idle Leading504s counters.
func (e *Encoder) sweep(now time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for id, m := range e.meta {
		if now.Sub(m.at) > e.opts.SweepAfter {
			e.registryReleaseLocked(id)
		}
	}
	for id, at := range e.dpAt { // GEN1 DP: stale mappings (§2, SEND_TIMEOUT)
		if now.Sub(at) > e.opts.SendTimeout {
			e.dpDropLocked(id)
		}
	}
	for id, l := range e.lead504 {
		if now.Sub(l.at) > e.opts.SweepAfter {
			delete(e.lead504, id)
		}
	}
}
