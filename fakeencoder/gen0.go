package fakeencoder

import (
	"fmt"
	"net/http"
	"strconv"

	"github.com/valyala/fastjson"
)

// GEN0 (Options.Generation = Gen0, protocol reference §11): the flat
// disaggregation/encode_server.py generation. What differs from NEW lives
// here; everything else is shared.

// Gen0DuplicateFailed is the message a GEN0 receiver rank's /encode gets
// when the first /encode with its req_id failed.
const Gen0DuplicateFailed = "Encode failed on the first request"

// gen0Modalities is Python's repr of the names Modality.from_str accepts.
const gen0Modalities = "['IMAGE', 'VIDEO', 'AUDIO']"

// encodeGen0 answers a GEN0 /encode. Nothing is validated: a missing req_id
// is a KeyError outside the try block (starlette's 500 text), other missing
// keys and a bad modality fail inside it (a 500 envelope with Python's
// error text). In mooncake mode every receiver TP rank posts /encode with
// the same req_id; the first call encodes and the others wait for it, then
// answer with its sizes, or 500 "Encode failed on the first request".
func (e *Encoder) encodeGen0(w http.ResponseWriter, r *http.Request, req *request) {
	if req.idVal == nil {
		writeInternalError(w) // request["req_id"] before the try block
		return
	}
	id := req.id()
	var first *inflight
	if e.opts.Mode == ModeMooncake {
		e.mu.Lock()
		if rec := e.dedupe[id]; rec != nil {
			e.encodeDuplicateLocked(w, r, req, rec)
			return
		}
		first = &inflight{}
		e.dedupe[id] = first
		e.mu.Unlock()
	}
	if msg := gen0EncodeError(req, e.opts.Mode); msg != "" {
		e.mu.Lock()
		e.finishInflightLocked(id, first, nil)
		e.mu.Unlock()
		writeEnvelope(w, http.StatusInternalServerError, msg, req.rawID)
		return
	}
	e.encode(w, r, req, first)
}

// encodeDuplicateLocked answers a GEN0 mooncake /encode whose req_id has a
// first call: it waits (without a limit, as sglang's event.wait does) until
// that call is done, then echoes its own request without mm_items, plus the
// first call's sizes. e.mu is held on entry and released on return.
func (e *Encoder) encodeDuplicateLocked(w http.ResponseWriter, r *http.Request, req *request, rec *inflight) {
	id := req.id()
	res := e.waitLocked(r.Context(), RouteEncode, id, 0, func() bool { return rec.done })
	ok, m := rec.ok, rec.meta
	noItems := res == waitOK && ok && req.field("mm_items") == nil
	if noItems {
		// del resp["mm_items"] raises inside the try block, whose handler
		// drops the request's in-flight record and staged embedding.
		if e.dedupe[id] == rec {
			delete(e.dedupe, id)
		}
		e.releaseLocked(id, false)
	}
	e.mu.Unlock()
	switch {
	case res != waitOK: // the client went away or the encoder closed
	case !ok:
		writeEnvelope(w, http.StatusInternalServerError, Gen0DuplicateFailed, req.rawID)
	case noItems:
		writeEnvelope(w, http.StatusInternalServerError, "'mm_items'", req.rawID)
	default:
		writeJSON(w, http.StatusOK, echoDuplicate(req.obj, m))
	}
}

// finishInflightLocked marks the GEN0 /encode record rec done and wakes the
// calls waiting for it. With m (a success) the record stays for later
// callers until the request is released or swept (discardLocked); without
// (a failure) it is dropped, so a later call encodes anew. A nil rec is a
// no-op.
func (e *Encoder) finishInflightLocked(id string, rec *inflight, m *metaEntry) {
	if rec == nil || rec.done {
		return
	}
	rec.done = true
	if m != nil {
		rec.ok, rec.meta = true, *m
	} else if e.dedupe[id] == rec {
		delete(e.dedupe, id)
	}
	e.notifyLocked(id)
}

// gen0EncodeError is the error a GEN0 /encode body fails with inside the
// handler's try block (str() of the Python exception), or "". It checks what
// GEN0 reads, in its order: Modality.from_str(request["modality"]), then
// encode_request's mm_items, num_parts and part_idx, and in zmq mode
// request["embedding_port"] (and prefill_host when a port is given). GEN0
// reads embedding_port only after the encode; the fake fails it before.
func gen0EncodeError(req *request, mode Mode) string {
	mod := req.field("modality")
	switch {
	case mod == nil:
		return "'modality'"
	case mod.Type() != fastjson.TypeString:
		return "'" + pyTypeName(mod) + "' object has no attribute 'upper'"
	case !validModality(string(mod.GetStringBytes())):
		return fmt.Sprintf("Invalid modality string: %s. Valid modalities are: %s", mod.GetStringBytes(), gen0Modalities)
	}
	for _, k := range []string{"mm_items", "num_parts", "part_idx"} {
		if req.field(k) == nil {
			return "'" + k + "'"
		}
	}
	if mode == ModeZMQ {
		p := req.field("embedding_port")
		if p == nil {
			return "'embedding_port'"
		}
		if p.Type() != fastjson.TypeNull && req.field("prefill_host") == nil {
			return "'prefill_host'"
		}
	}
	return ""
}

// echoDuplicate builds a GEN0 sibling's /encode answer: its own request in
// key order with raw values, less time_stats_json and mm_items, plus the
// first call's sizes (no enter_time: only the first call sets it).
func echoDuplicate(o *fastjson.Object, m metaEntry) []byte {
	var d orderedDict
	o.Visit(func(k []byte, v *fastjson.Value) { d.set(string(k), marshalValue(nil, v)) })
	d.del("time_stats_json")
	d.del("mm_items")
	d.set("embedding_size", strconv.AppendInt(nil, m.size, 10))
	d.set("embedding_len", strconv.AppendInt(nil, m.length, 10))
	d.set("embedding_dim", strconv.AppendInt(nil, m.dim, 10))
	return d.marshal()
}

// registerGen0 answers a GEN0 /scheduler_receive_url: the URL is stored
// whether or not its /encode has come (no wait; an entry whose /encode
// never comes stays, as GEN0's does) and wakes a zmq /encode waiting for
// it. A missing req_id, receive_count or receive_url is a KeyError and a
// changed receive_count fails an assert: starlette's 500 text. GEN0 reads
// them in that order, so a first registration without receive_url still
// fixes the count.
func (e *Encoder) registerGen0(w http.ResponseWriter, req *request) {
	if req.idVal == nil {
		writeInternalError(w)
		return
	}
	id, count, url := req.id(), req.field("receive_count"), req.field("receive_url")
	e.mu.Lock()
	reg := e.recv[id]
	if reg == nil && count != nil {
		reg = newRecvReg(count)
		e.recv[id] = reg
	}
	ok := reg != nil && count != nil && reg.countKey == pyKey(count) && url != nil
	if ok {
		reg.urls[pyKey(url)] = pyStr(url)
		e.notifyLocked(id)
	}
	e.mu.Unlock()
	if !ok {
		writeInternalError(w)
		return
	}
	writeJSON(w, http.StatusOK, nullJSON)
}
