package fakeencoder

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/valyala/fastjson"
)

// modalities are the modality names /encode accepts (case-insensitive).
var modalities = []string{"IMAGE", "VIDEO", "AUDIO"}

// validateEncode is sglang's validate_encode_request: "" when valid, else the
// 400 message.
func validateEncode(o *fastjson.Object) string {
	id := o.Get("req_id")
	if id == nil || id.Type() != fastjson.TypeString || len(id.GetStringBytes()) == 0 {
		return "missing or invalid req_id"
	}
	mod := o.Get("modality")
	if mod == nil || mod.Type() != fastjson.TypeString {
		return "missing or invalid modality"
	}
	if !validModality(string(mod.GetStringBytes())) {
		return "unsupported modality: " + string(mod.GetStringBytes())
	}
	items := o.Get("mm_items")
	if items == nil || items.Type() == fastjson.TypeNull || (items.Type() == fastjson.TypeArray && len(items.GetArray()) == 0) {
		return "missing or empty mm_items"
	}
	numParts, ok := pyInt(o.Get("num_parts"))
	if !ok || numParts.Sign() <= 0 {
		return "num_parts must be a positive integer"
	}
	partIdx, ok := pyInt(o.Get("part_idx"))
	if !ok || partIdx.Sign() < 0 || partIdx.Cmp(numParts) >= 0 {
		return fmt.Sprintf("part_idx must be in [0, %s)", numParts)
	}
	if h := o.Get("hashes"); h != nil {
		switch h.Type() {
		case fastjson.TypeObject:
			return "hashes must be list/scalar, got dict"
		case fastjson.TypeNumber:
			if _, ok := pyInt(h); !ok {
				return "hashes must be list/scalar, got float"
			}
		}
	}
	return ""
}

// validModality reports whether s names a supported modality.
func validModality(s string) bool {
	for _, m := range modalities {
		if strings.EqualFold(s, m) {
			return true
		}
	}
	return false
}

// encodeFailure is a failure requested through the first mm_item.
type encodeFailure struct {
	status  int
	msg     string
	forward bool // "fail-encode:": after the metadata publish
}

// failureHook parses a "fail:<status>:<msg>" or
// "fail-encode:<status>:<msg>" first mm_item.
func failureHook(items *fastjson.Value) *encodeFailure {
	if items == nil || items.Type() != fastjson.TypeArray || len(items.GetArray()) == 0 {
		return nil
	}
	first := items.GetArray()[0]
	if first.Type() != fastjson.TypeString {
		return nil
	}
	s := string(first.GetStringBytes())
	f := &encodeFailure{}
	switch {
	case strings.HasPrefix(s, "fail:"):
		s = strings.TrimPrefix(s, "fail:")
	case strings.HasPrefix(s, "fail-encode:"):
		s, f.forward = strings.TrimPrefix(s, "fail-encode:"), true
	default:
		return nil
	}
	code, msg, ok := strings.Cut(s, ":")
	status, err := strconv.Atoi(code)
	if !ok || err != nil || status < 400 || status > 599 {
		return nil
	}
	f.status, f.msg = status, msg
	return f
}

// sizes is the metadata of an encode of n mm_items.
func (e *Encoder) sizes(n int) metaEntry {
	length := int64(e.opts.TokensPerItem) * int64(n)
	dim := int64(e.opts.Dim)
	return metaEntry{size: length * dim * int64(e.opts.ElementSize), length: length, dim: dim}
}

// itemCount is the number of mm_items (a non-list counts as one item).
func itemCount(items *fastjson.Value) int {
	if items != nil && items.Type() == fastjson.TypeArray {
		return len(items.GetArray())
	}
	return 1
}

// handleEncode answers POST /encode: validate, create the request state,
// publish metadata after MetadataDelay, encode for EncodeLatency (skipped on
// a media cache hit, Options.CacheItems), then answer per Mode. GEN0 is
// handled by encodeGen0.
func (e *Encoder) handleEncode(w http.ResponseWriter, r *http.Request, req *request) {
	if !req.requireObject(w) {
		return
	}
	if e.gen0() {
		e.encodeGen0(w, r, req)
		return
	}
	if e.opts.Generation == Gen1 {
		if !validateGen1(w, req) {
			return
		}
		e.encode(w, r, req, nil)
		return
	}
	if msg := validateEncode(req.obj); msg != "" {
		writeEnvelope(w, http.StatusBadRequest, msg, req.rawID)
		return
	}
	e.encode(w, r, req, nil)
}

// encode runs an accepted /encode. first is the GEN0 dedupe record this call
// owns (nil otherwise): it is finished with the encode's outcome.
func (e *Encoder) encode(w http.ResponseWriter, r *http.Request, req *request, first *inflight) {
	enter, id, ctx := time.Now(), req.id(), r.Context()
	fail := failureHook(req.field("mm_items"))
	e.mu.Lock()
	if e.dp() {
		e.dpAssignLocked(id)
	}
	st := e.acquireEncodeLocked(id)
	e.mu.Unlock()
	if !e.sleep(ctx, RouteEncode, e.Faults().MetadataDelay) {
		e.abortEncode(st, first)
		return
	}
	if fail != nil && !fail.forward {
		e.failEncode(w, req, st, fail, first)
		return
	}
	m := e.sizes(itemCount(req.field("mm_items")))
	staging := e.opts.Stage != nil && e.opts.Mode == ModeMooncake
	if !staging { // with an agent, metadata waits until the embedding is staged there
		e.mu.Lock()
		e.publishLocked(id, m)
		e.mu.Unlock()
	}
	key, cached, cacheAfter := e.cacheLookup(req) // Options.CacheItems
	latency := e.opts.EncodeLatency
	if cached {
		latency = 0 // a cache hit runs no model forward
	}
	if !e.runEncodeHook(ctx, id) || !e.sleep(ctx, RouteEncode, latency) {
		e.abortEncode(st, first)
		return
	}
	if fail == nil && staging {
		if err := e.opts.Stage(ctx, id, int(m.length), int(m.dim), e.opts.ElementSize); err != nil {
			fail = &encodeFailure{status: http.StatusInternalServerError, msg: "Internal encoding error: staging: " + err.Error()}
		}
	}
	if fail != nil {
		e.failEncode(w, req, st, fail, first)
		return
	}
	if cacheAfter {
		e.cache.add(key)
	}
	e.mu.Lock()
	e.stageLocked(st, false)
	e.finishInflightLocked(id, first, &m)
	e.releaseEncodeRefLocked(st)
	e.publishLocked(id, m)
	e.mu.Unlock()
	if e.opts.Mode == ModeMooncake {
		writeJSON(w, http.StatusOK, echoEncode(req.obj, enter, m))
		return
	}
	e.deliverZMQ(w, r, req, st, m)
}

// runEncodeHook calls Options.EncodeHook with a context that ends when the
// client goes away or the encoder closes; false if either happened.
func (e *Encoder) runEncodeHook(ctx context.Context, id string) bool {
	if e.opts.EncodeHook != nil {
		hctx, cancel := context.WithCancel(ctx)
		stop := context.AfterFunc(e.ctx, cancel)
		e.opts.EncodeHook(hctx, id)
		stop()
		cancel()
	}
	return ctx.Err() == nil && e.ctx.Err() == nil
}

// abortEncode retires an encode whose caller went away: sglang releases the
// request when the /encode handler is cancelled, while the encode itself
// runs to completion, so a /send already waiting for it is not stranded.
// GEN0 siblings waiting for it get "Encode failed on the first request".
func (e *Encoder) abortEncode(st *reqState, first *inflight) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !st.ready {
		e.stageLocked(st, false)
	}
	e.finishInflightLocked(st.id, first, nil)
	e.releaseEncodeRefLocked(st)
	e.releaseLocked(st.id, false)
}

// failEncode stages and publishes an encode error, releases the request the
// way sglang does for the mode, and answers the error envelope. With
// PushFrames in zmq mode the error frame goes to prefill_host:embedding_port
// before the answer, or, with no port, to each URL as it is registered, in
// the background.
func (e *Encoder) failEncode(w http.ResponseWriter, req *request, st *reqState, f *encodeFailure, first *inflight) {
	zmqWait, pushPorts := false, false
	e.mu.Lock()
	e.stageLocked(st, true)
	e.finishInflightLocked(st.id, first, nil)
	e.releaseEncodeRefLocked(st)
	e.publishLocked(st.id, metaEntry{hasErr: true, errMsg: f.msg})
	if e.dp() {
		e.dpDropLocked(st.id) // §12, runtime.py:946-957
	}
	switch {
	case e.opts.Mode == ModeMooncake:
		e.releaseLocked(st.id, true) // the error metadata stays until the sweep
	case hasEmbeddingPort(req) && e.opts.PushFrames && e.pushesErrorToPort(req):
		pushPorts = true // released once the error frames are out
	case hasEmbeddingPort(req):
		e.releaseLocked(st.id, false)
	default:
		zmqWait = true // send_with_url pushes the error in the background
	}
	e.mu.Unlock()
	var msg *zmqMessage
	if e.opts.PushFrames {
		msg = errorMessage(req, f)
	}
	if pushPorts {
		e.pushTo(req.id(), portDestinations(req), msg)
		e.mu.Lock()
		e.releaseLocked(st.id, false)
		e.mu.Unlock()
	}
	if zmqWait {
		e.goBackground(func() {
			e.mu.Lock()
			defer e.mu.Unlock()
			if msg != nil {
				e.pushRegisteredLocked(e.ctx, st, msg)
			} else {
				e.waitRegistrationsLocked(e.ctx, st)
			}
			e.releaseLocked(st.id, false)
		})
	}
	writeEnvelope(w, f.status, f.msg, req.rawID)
}

// hasEmbeddingPort reports whether /encode named a destination port.
func hasEmbeddingPort(req *request) bool {
	p := req.field("embedding_port")
	return p != nil && p.Type() != fastjson.TypeNull
}

// deliverZMQ finishes a zmq /encode: with embedding_port set the embedding
// goes there at once; otherwise it waits (up to SendTimeout) for
// receive_count registered URLs. Either way it releases the request and
// answers null. With PushFrames the embedding message m's sizes describe is
// pushed to those destinations before the answer.
func (e *Encoder) deliverZMQ(w http.ResponseWriter, r *http.Request, req *request, st *reqState, m metaEntry) {
	res := waitOK
	if e.opts.PushFrames {
		msg := embeddingMessage(req, m)
		if hasEmbeddingPort(req) {
			e.pushTo(req.id(), portDestinations(req), msg)
			e.mu.Lock()
		} else {
			e.mu.Lock()
			res = e.pushRegisteredLocked(r.Context(), st, msg)
		}
	} else {
		e.mu.Lock()
		if !hasEmbeddingPort(req) {
			res = e.waitRegistrationsLocked(r.Context(), st)
		}
	}
	if res != waitClosed {
		e.releaseLocked(st.id, false)
	}
	e.mu.Unlock()
	if res == waitOK || res == waitTimeout {
		writeJSON(w, http.StatusOK, nullJSON)
	}
}

// waitRegistrationsLocked waits until st's receive_count URLs are registered
// or its release was requested (sglang send_with_url). e.mu must be held.
func (e *Encoder) waitRegistrationsLocked(ctx context.Context, st *reqState) waitResult {
	return e.waitLocked(ctx, RouteEncode, st.id, e.opts.SendTimeout, func() bool {
		if st.releaseRequested {
			return true
		}
		reg := e.recv[st.id]
		return reg != nil && reg.count >= 0 && int64(len(reg.urls)) >= reg.count
	})
}

// echoEncode builds the mooncake /encode answer: the request in its key
// order with raw values, less time_stats_json and mm_items, plus enter_time
// and the embedding sizes (existing keys are overwritten in place, as a
// Python dict update does).
func echoEncode(o *fastjson.Object, enter time.Time, m metaEntry) []byte {
	var d orderedDict
	o.Visit(func(k []byte, v *fastjson.Value) { d.set(string(k), marshalValue(nil, v)) })
	d.del("time_stats_json")
	d.set("enter_time", []byte(pyFloat(unixFloat(enter))))
	d.del("mm_items")
	d.set("embedding_size", strconv.AppendInt(nil, m.size, 10))
	d.set("embedding_len", strconv.AppendInt(nil, m.length, 10))
	d.set("embedding_dim", strconv.AppendInt(nil, m.dim, 10))
	return d.marshal()
}

// orderedDict is a tiny insertion-ordered map of raw JSON values with Python
// dict semantics.
type orderedDict struct {
	keys []string
	vals map[string][]byte
}

func (d *orderedDict) set(k string, raw []byte) {
	if d.vals == nil {
		d.vals = map[string][]byte{}
	}
	if _, ok := d.vals[k]; !ok {
		d.keys = append(d.keys, k)
	}
	d.vals[k] = raw
}

func (d *orderedDict) del(k string) {
	if _, ok := d.vals[k]; !ok {
		return
	}
	delete(d.vals, k)
	for i, key := range d.keys {
		if key == k {
			d.keys = append(d.keys[:i], d.keys[i+1:]...)
			return
		}
	}
}

func (d *orderedDict) marshal() []byte {
	b := []byte{'{'}
	for i, k := range d.keys {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, k)
		b = append(b, ':')
		b = append(b, d.vals[k]...)
	}
	return append(b, '}')
}

// marshalValue appends v as JSON: numbers keep their raw text (never
// float64), strings are re-escaped as orjson would.
func marshalValue(b []byte, v *fastjson.Value) []byte {
	switch v.Type() {
	case fastjson.TypeString:
		return appendJSONString(b, string(v.GetStringBytes()))
	case fastjson.TypeArray:
		b = append(b, '[')
		for i, x := range v.GetArray() {
			if i > 0 {
				b = append(b, ',')
			}
			b = marshalValue(b, x)
		}
		return append(b, ']')
	case fastjson.TypeObject:
		var d orderedDict
		o, _ := v.Object()
		o.Visit(func(k []byte, x *fastjson.Value) { d.set(string(k), marshalValue(nil, x)) })
		return append(b, d.marshal()...)
	}
	return v.MarshalTo(b)
}
