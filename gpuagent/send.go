package gpuagent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"runtime/debug"
	"strconv"

	"go.uber.org/zap"

	"github.com/encgate/encgate/gpuagent/mooncake"
	"github.com/encgate/encgate/internal/jsonfield"
)

// maxSendBody bounds a /send body (sglang's are a few hundred bytes).
const maxSendBody = 64 << 10

// sendRequest is sglang's /send body, as far as the agent reads it.
type sendRequest struct {
	ReqID         string
	PartIdx       *int64 // nil when absent or null
	PrefillHost   string
	EmbeddingPort int64
	SessionID     string
	BufferAddress uint64
	ReceiveCount  int64 // 0 when absent or null: leave the release to the sweep
}

// dest is the destination sglang counts for the refcount.
func (r sendRequest) dest() string {
	return r.PrefillHost + ":" + strconv.FormatInt(r.EmbeddingPort, 10)
}

var sendKeys = []string{"req_id", "part_idx", "prefill_host", "embedding_port", "session_id", "buffer_address", "receive_count"}

// parseSend reads a /send body without decoding it: buffer_address is parsed
// from its digits as a uint64. ReqID is set whenever the body has one, even
// when another field is wrong. Errors are *badRequest.
func parseSend(body []byte) (sendRequest, error) {
	var r sendRequest
	var raw [7][]byte
	if err := jsonfield.Lookup(body, sendKeys, raw[:]); err != nil {
		return r, badf("encgate: /send body is not a JSON object: %v", err)
	}
	if id, ok := jsonfield.String(raw[0]); ok {
		r.ReqID = id
	}
	if r.ReqID == "" {
		return r, badf("missing or invalid req_id")
	}
	if !jsonfield.IsNull(raw[1]) {
		n, ok := jsonfield.Int(raw[1])
		if !ok {
			return r, badf("encgate: invalid part_idx %s", raw[1])
		}
		r.PartIdx = &n
	}
	var ok bool
	if r.PrefillHost, ok = jsonfield.String(raw[2]); !ok || r.PrefillHost == "" {
		return r, badf("encgate: missing or invalid prefill_host")
	}
	if r.EmbeddingPort, ok = jsonfield.Int(raw[3]); !ok || r.EmbeddingPort < 1 || r.EmbeddingPort > 65535 {
		return r, badf("encgate: missing or invalid embedding_port")
	}
	if r.SessionID, ok = jsonfield.String(raw[4]); !ok || r.SessionID == "" {
		return r, badf("encgate: missing or invalid session_id")
	}
	if r.BufferAddress, ok = parseUint64(raw[5]); !ok {
		return r, badf("encgate: missing or invalid buffer_address (want a non-negative integer)")
	}
	if !jsonfield.IsNull(raw[6]) {
		if r.ReceiveCount, ok = jsonfield.Int(raw[6]); !ok || r.ReceiveCount < 0 {
			return r, badf("encgate: invalid receive_count %s", raw[6])
		}
	}
	return r, nil
}

// parseUint64 parses a raw JSON integer in [0, 2^64).
func parseUint64(raw []byte) (uint64, bool) {
	if len(raw) == 0 || raw[0] < '0' || raw[0] > '9' {
		return 0, false
	}
	n, err := strconv.ParseUint(string(raw), 10, 64)
	return n, err == nil
}

// sendError is a /send failure: the status and sglang-shaped message.
type sendError struct {
	status int
	msg    string
	// keep says the staged entry survives (the failure was not the send's).
	keep bool
}

// serveSend is POST /send: sglang's _send for a staged embedding.
func (a *Agent) serveSend(w http.ResponseWriter, r *http.Request) {
	a.sending.Add(1)
	a.sends.Add(1)
	defer a.sends.Done()
	defer a.sending.Add(-1)
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxSendBody))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeEnvelope(w, http.StatusRequestEntityTooLarge, "encgate: /send body over 64KiB", "")
			return
		}
		writeEnvelope(w, http.StatusBadRequest, "encgate: reading the /send body: "+err.Error(), "")
		return
	}
	req, err := parseSend(body)
	if err != nil {
		if req.ReqID != "" {
			a.store.releaseID(req.ReqID) // as sglang: any error inside /send releases
		}
		writeEnvelope(w, http.StatusBadRequest, err.Error(), req.ReqID)
		return
	}
	if serr := a.send(r.Context(), req); serr != nil {
		if c := a.log.Check(zap.DebugLevel, "send failed"); c != nil {
			c.Write(zap.String("req_id", req.ReqID), zap.String("session_id", req.SessionID),
				zap.Int("status", serr.status), zap.String("message", serr.msg))
		}
		writeEnvelope(w, serr.status, serr.msg, req.ReqID)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write([]byte("null"))
}

// send runs sglang's checks, the transfer, the ack and the completion notice
// for one destination, then counts it. Any failure releases the req_id.
func (a *Agent) send(ctx context.Context, req sendRequest) *sendError {
	e := a.store.acquire(req.ReqID)
	if e == nil {
		return &sendError{status: http.StatusInternalServerError,
			msg: fmt.Sprintf("no staged embedding for req_id=%s (already released)", req.ReqID)}
	}
	defer a.store.done(e)
	select {
	case <-e.ready:
	case <-ctx.Done(): // the caller left while the bytes were still arriving
		return &sendError{status: http.StatusServiceUnavailable, keep: true,
			msg: fmt.Sprintf("encgate: /send for req_id=%s ended while its staging was in progress: %v", req.ReqID, ctx.Err())}
	}
	serr := a.transfer(ctx, e, req)
	if serr != nil && !serr.keep {
		a.store.release(e)
	}
	return serr
}

// transfer is send's part after the entry is ready.
func (a *Agent) transfer(ctx context.Context, e *entry, req sendRequest) *sendError {
	internal := func(format string, args ...any) *sendError {
		return &sendError{status: http.StatusInternalServerError, msg: fmt.Sprintf(format, args...)}
	}
	if !a.store.live(e) {
		return internal("no staged embedding for req_id=%s (already released)", req.ReqID)
	}
	if e.failed != "" {
		return internal("No embedding available for Mooncake GPU-direct transfer: %s", req.ReqID)
	}
	if want := e.tokens * e.dim * e.elem; int64(len(e.mem.data)) != want {
		return internal("Embedding size mismatch for %s: actual=%d, expected=%d (shape=[%d, %d], element_size=%d)",
			req.ReqID, len(e.mem.data), want, e.tokens, e.dim, e.elem)
	}
	if err := e.mem.check(); err != nil {
		return internal("encgate: staged embedding for %s is unusable: %v; nothing was sent", req.ReqID, err)
	}
	if serr := a.checkDestination(ctx, req); serr != nil {
		return serr
	}
	frame, serr := a.ackFrameFor(req)
	if serr != nil {
		return serr
	}
	nbytes := len(e.mem.data)
	unpin := a.pinPerSend(e)
	start := a.clk.Now()
	res, err := a.write(ctx, req.SessionID, req.BufferAddress, e.mem.data)
	a.metrics.transferTime.Observe(a.clk.Now().Sub(start).Seconds())
	unpin()
	if err != nil {
		return a.transferError(req, nbytes, err)
	}
	a.metrics.transfers.WithLabelValues(resultOK).Inc()
	a.metrics.transferBytes.Add(float64(res.Bytes))
	if c := a.log.Check(zap.DebugLevel, "transferred"); c != nil {
		c.Write(zap.String("req_id", req.ReqID), zap.String("session_id", req.SessionID), zap.Int("bytes", res.Bytes),
			zap.Int("proto_version", res.Version), zap.Bool("reused", res.Reused), zap.Bool("handshake", res.Handshake))
	}
	if serr := a.ack(ctx, e, req, frame, nbytes); serr != nil {
		return serr
	}
	err = a.notifier.Notify(ctx, Completion{
		ReqID: req.ReqID, PartIdx: req.PartIdx, PrefillHost: req.PrefillHost, EmbeddingPort: req.EmbeddingPort,
		EmbeddingSize: int64(nbytes), EmbeddingLen: e.tokens, EmbeddingDim: e.dim, Dtype: e.dtype,
		SessionID: req.SessionID, BufferAddress: req.BufferAddress,
	})
	if err != nil {
		a.metrics.notifyFailures.Inc()
		return internal("encgate: %d bytes for %s reached session=%s, but the completion notice failed, so the receiver will not know: %v",
			nbytes, req.ReqID, req.SessionID, err)
	}
	a.store.sent(e, req.dest(), req.ReceiveCount)
	return nil
}

// checkDestination refuses, before anything is sent, a session_id that does
// not parse and a session host or prefill_host outside allow_networks.
func (a *Agent) checkDestination(ctx context.Context, req sendRequest) *sendError {
	host, _, err := mooncake.ParseSessionID(req.SessionID)
	if err != nil {
		return &sendError{status: http.StatusBadRequest,
			msg: fmt.Sprintf("encgate: invalid session_id %q for %s: %v", req.SessionID, req.ReqID, err)}
	}
	for _, h := range []struct{ field, host string }{{"session_id", host}, {"prefill_host", req.PrefillHost}} {
		if err := a.checkHost(ctx, h.host); err != nil {
			a.metrics.transfers.WithLabelValues(resultNotAllowed).Inc()
			return &sendError{status: http.StatusForbidden,
				msg: fmt.Sprintf("encgate: refusing to send %s: %s: %v; nothing was sent", req.ReqID, h.field, err)}
		}
	}
	return nil
}

// transferError maps an initiator error to the /send answer.
func (a *Agent) transferError(req sendRequest, nbytes int, err error) *sendError {
	var rangeErr *mooncake.RangeError
	var rejected *mooncake.RejectedError
	var notAllowed *NotAllowedError
	end := req.BufferAddress + uint64(nbytes)
	switch {
	case errors.As(err, &rangeErr):
		a.metrics.transfers.WithLabelValues(resultRejected).Inc()
		return &sendError{status: http.StatusBadRequest, msg: fmt.Sprintf(
			"encgate: destination range [%#x, %#x) (%d bytes) for %s is not inside one buffer registered by session %s; nothing was sent",
			req.BufferAddress, end, nbytes, req.ReqID, req.SessionID)}
	case errors.As(err, &rejected):
		a.metrics.transfers.WithLabelValues(resultRejected).Inc()
		return &sendError{status: http.StatusBadRequest, msg: fmt.Sprintf(
			"encgate: session %s rejected the destination range [%#x, %#x) (%d bytes) for %s (ADDR_REJECTED); nothing was written",
			req.SessionID, req.BufferAddress, end, nbytes, req.ReqID)}
	case errors.As(err, &notAllowed):
		a.metrics.transfers.WithLabelValues(resultNotAllowed).Inc()
		return &sendError{status: http.StatusForbidden, msg: fmt.Sprintf(
			"encgate: refusing to send %s to session %s: %v; nothing was sent", req.ReqID, req.SessionID, notAllowed)}
	}
	a.metrics.transfers.WithLabelValues(resultFailed).Inc()
	return &sendError{status: http.StatusInternalServerError, msg: fmt.Sprintf(
		"Mooncake transfer_sync failed for %s (session=%s, nbytes=%d, ret=-1): %v", req.ReqID, req.SessionID, nbytes, err)}
}

// write runs the initiator. A /dev/shm file truncated by its writer after
// staging must not crash the agent: the kernel fails the socket write
// (EFAULT), and should Go code on this goroutine read the mapping, the fault
// becomes an error too.
func (a *Agent) write(ctx context.Context, session string, addr uint64, data []byte) (res mooncake.Result, err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if p := recover(); p != nil {
			if _, fault := p.(interface{ Addr() uintptr }); !fault {
				panic(p)
			}
			err = fmt.Errorf("reading the staged region faulted (was its shm file truncated?): %v", p)
		}
	}()
	return a.init.Write(ctx, session, addr, data)
}

// pinPerSend takes the per-send registration for an entry whose shared one
// failed, and returns its undo. Concurrent sends of one entry share it.
// The TCP transport reads pageable memory too, so a failed per-send
// registration does not stop the send.
func (a *Agent) pinPerSend(e *entry) (unpin func()) {
	if e.reg != regPerSend {
		return func() {}
	}
	a.metrics.registrations.WithLabelValues(regPerSend).Inc()
	e.pinMu.Lock()
	if e.pins == 0 {
		if err := a.pin(e.mem.data); err != nil {
			a.log.Debug("per-send registration failed; sending unpinned", zap.String("req_id", e.id), zap.Error(err))
		} else {
			e.pinned = true
		}
	}
	e.pins++
	e.pinMu.Unlock()
	return func() {
		e.pinMu.Lock()
		defer e.pinMu.Unlock()
		if e.pins--; e.pins == 0 && e.pinned {
			_ = a.unpin(e.mem.data)
			e.pinned = false
		}
	}
}
