package fakeencoder

import (
	"fmt"
	"math"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/valyala/fastjson"
)

// outcome is a handler's answer, computed under e.mu and written after it is
// released.
type outcome struct {
	status int    // 0: write nothing (the client went away or Close)
	msg    string // error envelope message when status != 200
	body   []byte // success body
}

// write writes o as an error envelope or a JSON success.
func (o outcome) write(w http.ResponseWriter, rawID []byte) {
	switch {
	case o.status == 0:
	case o.status != http.StatusOK:
		writeEnvelope(w, o.status, o.msg, rawID)
	case o.body != nil:
		writeJSON(w, o.status, o.body)
	default:
		writeJSON(w, o.status, nullJSON)
	}
}

// errOutcome is a 500 error outcome.
func errOutcome(msg string) outcome {
	return outcome{status: http.StatusInternalServerError, msg: msg}
}

// sendFields are the /send fields sglang reads with [] (KeyError if absent),
// in the order it reads them.
var sendFields = []string{"prefill_host", "embedding_port", "session_id", "buffer_address"}

// handleSend answers POST /send (sglang handle_send_request and
// send_staged_embedding, non-DP).
func (e *Encoder) handleSend(w http.ResponseWriter, r *http.Request, req *request) {
	if !req.requireObject(w) {
		return
	}
	if req.idVal == nil {
		writeInternalError(w) // KeyError outside the try block
		return
	}
	if e.dp() {
		e.handleSendDP(w, r, req)
		return
	}
	id := req.id()
	dest := destination(req.field("prefill_host"), req.field("embedding_port"))
	e.mu.Lock()
	e.stats.sends[id+"|"+dest]++
	e.mu.Unlock()
	for _, k := range sendFields {
		if req.field(k) == nil {
			if e.gen0() {
				writeInternalError(w) // GEN0: a KeyError before any state is touched
				return
			}
			e.mu.Lock()
			e.releaseLocked(id, false) // NEW: any error inside /send releases
			e.mu.Unlock()
			errOutcome("'"+k+"'").write(w, req.rawID) // str(KeyError(k))
			return
		}
	}
	o := e.send(r, id, req.field("receive_count"), dest)
	if (e.gen0() || e.opts.Generation == Gen1) && o.status != 0 && o.status != http.StatusOK {
		// GEN0's /send has no try block, and GEN1's does not catch
		// encoder.send's exceptions (§12): every error is starlette's 500 text
		writeInternalError(w)
		return
	}
	if o.status == http.StatusOK && e.opts.EchoSend {
		o.body = append(append([]byte(`{"req_id":`), req.rawID...), `,"destination":`...)
		o.body = append(appendJSONString(o.body, dest), '}')
	}
	o.write(w, req.rawID)
}

// destination is NetworkAddress(prefill_host, embedding_port).to_host_port_str().
func destination(host, port *fastjson.Value) string {
	return net.JoinHostPort(pyStr(host), pyStr(port))
}

// send runs one staged-embedding send: state checks, the wait for the
// embedding, then the refcount.
func (e *Encoder) send(r *http.Request, id string, receiveCount *fastjson.Value, dest string) outcome {
	e.mu.Lock()
	defer e.mu.Unlock()
	st := e.states[id]
	if st == nil {
		return errOutcome(fmt.Sprintf("no staged embedding for req_id=%s (already released)", id))
	}
	if st.releaseRequested {
		e.releaseLocked(id, false)
		return errOutcome("Encoder request was released: " + id)
	}
	st.activeSends++
	res := e.waitLocked(r.Context(), RouteSend, id, 0, func() bool { return st.ready })
	st.activeSends--
	switch {
	case res != waitOK:
		e.releaseLocked(id, false)
		return outcome{}
	case st.failed:
		e.releaseLocked(id, false)
		return errOutcome("No embedding available for Mooncake GPU-direct transfer: " + id)
	}
	e.finishReleaseLocked(st) // a release requested while this send waited
	if !pyTruthy(receiveCount) {
		return outcome{status: http.StatusOK} // no count: left to the sweep
	}
	n, ok := countOf(receiveCount)
	if !ok {
		e.releaseLocked(id, false)
		return errOutcome("'>=' not supported between instances of 'int' and '" + pyTypeName(receiveCount) + "'")
	}
	e.noteSendDoneLocked(id, n, dest)
	return outcome{status: http.StatusOK}
}

// countOf is receive_count as the integer threshold Python's
// len(x) >= receive_count compares with; false for non-numbers.
func countOf(v *fastjson.Value) (int64, bool) {
	switch {
	case v == nil:
		return 0, false
	case v.Type() == fastjson.TypeTrue:
		return 1, true
	case v.Type() == fastjson.TypeFalse:
		return 0, true
	case v.Type() != fastjson.TypeNumber:
		return 0, false
	}
	if n, ok := pyInt(v); ok {
		if !n.IsInt64() {
			if n.Sign() > 0 {
				return math.MaxInt64, true
			}
			return math.MinInt64, true
		}
		return n.Int64(), true
	}
	f, err := strconv.ParseFloat(string(v.MarshalTo(nil)), 64)
	if err != nil || f > math.MaxInt64 {
		return math.MaxInt64, true
	}
	return int64(math.Ceil(f)), true
}

// handleMetadata answers POST /scheduler_receive_meta_data: block until the
// req_id's metadata is published or MetadataTimeout passes.
func (e *Encoder) handleMetadata(w http.ResponseWriter, r *http.Request, req *request) {
	if !req.requireObject(w) {
		return
	}
	if req.idVal == nil {
		writeInternalError(w)
		return
	}
	id := req.id()
	if e.leading504(id) {
		writeEnvelope(w, http.StatusGatewayTimeout, "encode metadata not ready", req.rawID)
		return
	}
	rank := -1
	if e.dp() {
		var ok bool
		if rank, ok = e.dpRankOf(w, r, RouteMetadata, req); !ok {
			return
		}
	}
	e.mu.Lock()
	res := e.waitLocked(r.Context(), RouteMetadata, id, e.opts.MetadataTimeout, func() bool { return e.meta[id] != nil })
	var m metaEntry
	if p := e.meta[id]; p != nil {
		m = *p
	}
	if res == waitOK && rank >= 0 {
		e.dpMetadataDoneLocked(id)
	}
	e.mu.Unlock()
	switch {
	case res == waitTimeout && rank >= 0:
		writeEnvelope(w, http.StatusGatewayTimeout, fmt.Sprintf("Encoder DP rank=%d metadata wait timed out after %ss",
			rank, pySeconds(e.opts.MetadataTimeout)), req.rawID)
	case res == waitTimeout:
		writeEnvelope(w, http.StatusGatewayTimeout, "encode metadata not ready", req.rawID)
	case res != waitOK:
	case m.hasErr:
		writeEnvelope(w, http.StatusInternalServerError, m.errMsg, req.rawID)
	case req.field("part_idx") == nil:
		writeInternalError(w) // request["part_idx"] KeyError
	default:
		b := append([]byte(`{"req_id":`), req.rawID...)
		b = append(b, `,"part_idx":`...)
		b = marshalValue(b, req.field("part_idx"))
		b = fmt.Appendf(b, `,"embedding_size":%d,"embedding_len":%d,"embedding_dim":%d}`, m.size, m.length, m.dim)
		writeJSON(w, http.StatusOK, b)
	}
}

// leading504 reports whether this metadata call for id is one of the first
// Faults.Leading504s, which answer 504 at once.
func (e *Encoder) leading504(id string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.faults.Leading504s <= 0 {
		return false
	}
	l := e.lead504[id]
	if l == nil {
		l = &lead504{}
		e.lead504[id] = l
		e.ensureSweeperLocked()
	}
	l.at = time.Now()
	if l.n < e.faults.Leading504s {
		l.n++
		return true
	}
	return false
}

// handleRegister answers POST /scheduler_receive_url (sglang
// register_embedding_destinations).
func (e *Encoder) handleRegister(w http.ResponseWriter, r *http.Request, req *request) {
	if !req.requireObject(w) {
		return
	}
	if e.gen0() {
		e.registerGen0(w, req)
		return
	}
	count, url := req.field("receive_count"), req.field("receive_url")
	if req.idVal == nil || count == nil || url == nil {
		writeInternalError(w) // KeyError outside the try block
		return
	}
	if e.dp() {
		if _, ok := e.dpRankOf(w, r, RouteRegister, req); !ok {
			return
		}
	}
	e.register(r, req.id(), count, url).write(w, req.rawID)
}

// register waits for the request state and records one destination URL.
func (e *Encoder) register(r *http.Request, id string, count, url *fastjson.Value) outcome {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.states[id] == nil {
		res := e.waitLocked(r.Context(), RouteRegister, id, e.opts.RegisterTimeout, func() bool { return e.states[id] != nil })
		switch res {
		case waitTimeout:
			return outcome{status: http.StatusGatewayTimeout, msg: "Timed out waiting for encoder request to start: " + id}
		case waitCanceled, waitClosed:
			return outcome{}
		}
	}
	if st := e.states[id]; st != nil && st.failed && e.opts.HoldFailedRegistrations {
		if e.waitLocked(r.Context(), RouteRegister, id, e.opts.RegisterTimeout, func() bool { return false }) != waitTimeout {
			return outcome{}
		}
		return outcome{status: http.StatusGatewayTimeout, msg: "Timed out waiting for encoder request to start: " + id}
	}
	if st := e.states[id]; st == nil || st.releaseRequested {
		return outcome{status: http.StatusBadRequest, msg: "Encoder request is not active: " + id}
	}
	reg := e.recv[id]
	if reg == nil {
		reg = newRecvReg(count)
		e.recv[id] = reg
	}
	if reg.countKey != pyKey(count) {
		return outcome{status: http.StatusBadRequest, msg: fmt.Sprintf(
			"Inconsistent receive_count for req_id=%s: registered %s, got %s", id, reg.countStr, pyStr(count))}
	}
	reg.urls[pyKey(url)] = pyStr(url)
	e.notifyLocked(id)
	return outcome{status: http.StatusOK}
}
