package fakeencoder

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// GEN1's DP mode (Options.Generation = Gen1, Options.DPSize > 1; protocol
// reference §2, §3 and §12). The HTTP process dispatches each route to a
// worker rank: /encode picks a rank (round robin here) and records
// req_id → rank; the follow-up routes route by that mapping.
//
//   - /scheduler_receive_meta_data and /scheduler_receive_url with no
//     mapping wait up to min(DPMappingWait, MetadataTimeout) for it, else 404
//     envelope "Unknown req_id: X" (§2).
//   - A metadata wait that runs out is 504 envelope "Encoder DP rank=R
//     metadata wait timed out after Xs" (§12: the dispatcher's timer wins).
//   - A failed /encode drops the mapping (§12, runtime.py:946-957).
//   - /send errors are plain text with no Content-Type, "Encoder DP worker
//     send error: <msg>" (§3); a /send with no mapping does not wait (§2).
//   - Options.DPMappingRace imitates GEN1's dispatcher bug (§12): a metadata
//     pull that completes while a /send of the same req_id is in flight drops
//     the mapping and discards that /send's result, which then answers 504
//     once REQ_TIMEOUT (MetadataTimeout) from its dispatch has passed.

// DefaultDPMappingWait is the longest a DP metadata pull or registration
// waits for its req_id → rank mapping (sglang's 5 s, §2).
const DefaultDPMappingWait = 5 * time.Second

// dpSend is one DP /send in flight at the encoder.
type dpSend struct {
	discarded bool // its result was discarded (DPMappingRace)
}

// dp reports whether the fake runs GEN1's DP mode.
func (e *Encoder) dp() bool { return e.opts.Generation == Gen1 && e.opts.DPSize > 1 }

// Validate reports options that contradict each other.
func (o *Options) Validate() error {
	var errs []string
	if o.DPSize < 0 {
		errs = append(errs, fmt.Sprintf("DPSize (--dp-size) must be >= 1, got %d", o.DPSize))
	}
	if o.DPSize > 1 && o.Generation != Gen1 {
		errs = append(errs, fmt.Sprintf("DPSize (--dp-size) %d needs Generation gen1 (only GEN1's DP mode is imitated), got %s", o.DPSize, o.Generation))
	}
	if o.DPMappingRace && o.DPSize <= 1 {
		errs = append(errs, "DPMappingRace (--dp-mapping-race) needs DPSize (--dp-size) > 1")
	}
	if len(errs) == 0 {
		return nil
	}
	return errors.New("fakeencoder: " + strings.Join(errs, "; "))
}

// dpAssignLocked records id → rank for a dispatched /encode, round robin,
// and wakes the follow-ups waiting for the mapping.
func (e *Encoder) dpAssignLocked(id string) {
	e.dpRank[id] = e.dpNext
	e.dpAt[id] = time.Now()
	e.ensureSweeperLocked()
	e.dpNext = (e.dpNext + 1) % e.opts.DPSize
	e.notifyLocked(id)
}

// dpDropLocked drops id's mapping.
func (e *Encoder) dpDropLocked(id string) {
	delete(e.dpRank, id)
	delete(e.dpAt, id)
	e.notifyLocked(id)
}

// dpRankOf waits up to min(DPMappingWait, MetadataTimeout) for id's mapping
// (a metadata pull or a registration, §2). ok false: the answer was written
// (404) or the client or encoder went away.
func (e *Encoder) dpRankOf(w http.ResponseWriter, r *http.Request, route string, req *request) (int, bool) {
	id := req.id()
	e.mu.Lock()
	res := e.waitLocked(r.Context(), route, id, min(e.opts.DPMappingWait, e.opts.MetadataTimeout), func() bool {
		_, ok := e.dpRank[id]
		return ok
	})
	rank := e.dpRank[id]
	e.mu.Unlock()
	switch res {
	case waitOK:
		return rank, true
	case waitTimeout:
		writeEnvelope(w, http.StatusNotFound, "Unknown req_id: "+id, req.rawID)
	}
	return 0, false
}

// pySeconds is d as Python prints a float number of seconds ("180.0").
func pySeconds(d time.Duration) string { return pyFloat(d.Seconds()) }

// writeDPSendError answers a DP /send error as sglang's Response(content=…,
// status_code=…): plain text with no Content-Type (§3).
func writeDPSendError(w http.ResponseWriter, status int, msg string) {
	text := "Encoder DP worker send error: " + msg
	h := w.Header()
	h["Content-Type"] = nil // no sniffed type either
	h.Set("Content-Length", strconv.Itoa(len(text)))
	w.WriteHeader(status)
	_, _ = w.Write([]byte(text))
}

// handleSendDP answers a DP /send. req has an object body and a req_id.
func (e *Encoder) handleSendDP(w http.ResponseWriter, r *http.Request, req *request) {
	id := req.id()
	dest := destination(req.field("prefill_host"), req.field("embedding_port"))
	e.mu.Lock()
	e.stats.sends[id+"|"+dest]++
	rank, ok := e.dpRank[id]
	if !ok {
		e.mu.Unlock()
		// §2: "an unknown id returns {"_error": "Unknown req_id: X"}, which
		// becomes a 500 text response", worded by §3's DP /send rule.
		writeDPSendError(w, http.StatusInternalServerError, "Unknown req_id: "+id)
		return
	}
	dispatched := time.Now()
	s := &dpSend{}
	if e.dpSends[id] == nil {
		e.dpSends[id] = map[*dpSend]struct{}{}
	}
	e.dpSends[id][s] = struct{}{}
	e.mu.Unlock()
	o := e.sendDPWork(r, req, id, dest)
	e.mu.Lock()
	delete(e.dpSends[id], s)
	if len(e.dpSends[id]) == 0 {
		delete(e.dpSends, id)
	}
	discarded := s.discarded
	e.mu.Unlock()
	if discarded {
		// The dispatcher dropped this result (§12); the future runs out.
		if !e.sleep(r.Context(), RouteSend, max(time.Until(dispatched.Add(e.opts.MetadataTimeout)), 0)) {
			return
		}
		writeDPSendError(w, http.StatusGatewayTimeout,
			fmt.Sprintf("Encoder DP rank=%d /send timed out after %ss", rank, pySeconds(e.opts.MetadataTimeout)))
		return
	}
	switch {
	case o.status == 0:
	case o.status != http.StatusOK:
		writeDPSendError(w, o.status, o.msg)
	default:
		o.write(w, req.rawID)
	}
}

// sendDPWork is the worker's part of a DP /send: SendHook, then the send.
func (e *Encoder) sendDPWork(r *http.Request, req *request, id, dest string) outcome {
	if !e.runSendHook(r.Context(), id, dest) {
		return outcome{}
	}
	for _, k := range sendFields {
		if req.field(k) == nil {
			e.mu.Lock()
			e.releaseLocked(id, false)
			e.mu.Unlock()
			return errOutcome("'" + k + "'") // str(KeyError(k)) in the worker
		}
	}
	o := e.send(r, id, req.field("receive_count"), dest)
	if o.status == http.StatusInternalServerError && strings.HasPrefix(o.msg, "no staged embedding for req_id=") {
		o.msg = fmt.Sprintf("no staged embedding for /send req_id=%s (already released)", id) // §3, DP
	}
	return o
}

// runSendHook calls Options.SendHook with a context that ends when the
// client goes away or the encoder closes; false if either happened.
func (e *Encoder) runSendHook(ctx context.Context, id, dest string) bool {
	if e.opts.SendHook != nil {
		hctx, cancel := context.WithCancel(ctx)
		stop := context.AfterFunc(e.ctx, cancel)
		e.opts.SendHook(hctx, id, dest)
		stop()
		cancel()
	}
	return ctx.Err() == nil && e.ctx.Err() == nil
}

// dpMetadataDoneLocked is the dispatcher processing a metadata result for
// id: with DPMappingRace and a /send of id in flight, it drops the mapping
// and discards those sends' results (§12, runtime.py:975-986, 924-930).
func (e *Encoder) dpMetadataDoneLocked(id string) {
	if !e.opts.DPMappingRace || len(e.dpSends[id]) == 0 {
		return
	}
	for s := range e.dpSends[id] {
		s.discarded = true
	}
	e.dpDropLocked(id)
}
