package gpuagent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"runtime/debug"

	"go.uber.org/zap"

	"github.com/encgate/encgate/gpuagent/mooncake"
	"github.com/encgate/encgate/gpuagent/pipeline"
	"github.com/encgate/encgate/internal/sglang"
)

// maxSendBody bounds a /send body (sglang's are a few hundred bytes).
const maxSendBody = 64 << 10

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
	body, err := io.ReadAll(a.body(w, http.MaxBytesReader(w, r.Body, maxSendBody)))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeEnvelope(w, http.StatusRequestEntityTooLarge, "encgate: /send body over 64KiB", "")
			return
		}
		if stalled(err) {
			writeEnvelope(w, http.StatusRequestTimeout, fmt.Sprintf(
				"encgate: the /send body sent nothing for control.body_timeout (%s)", a.cfg.Control.BodyTimeout), "")
			return
		}
		writeEnvelope(w, http.StatusBadRequest, "encgate: reading the /send body: "+err.Error(), "")
		return
	}
	req, ferr := sglang.ParseSend(body, sglang.Limits{})
	if ferr != nil {
		if ferr.ReqID != "" {
			a.store.releaseID(ferr.ReqID) // as sglang: any error inside /send releases
		}
		writeEnvelope(w, http.StatusBadRequest, ferr.Message, ferr.ReqID)
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
func (a *Agent) send(ctx context.Context, req sglang.Send) *sendError {
	e := a.store.acquire(req.ReqID)
	if e == nil {
		return &sendError{status: http.StatusInternalServerError,
			msg: sglang.AlreadyReleasedMessage(req.ReqID)}
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
func (a *Agent) transfer(ctx context.Context, e *entry, req sglang.Send) *sendError {
	internal := func(format string, args ...any) *sendError {
		return &sendError{status: http.StatusInternalServerError, msg: fmt.Sprintf(format, args...)}
	}
	if !a.store.live(e) {
		return internal("%s", sglang.AlreadyReleasedMessage(req.ReqID))
	}
	if e.failed != "" {
		return internal("%s: %s", sglang.NoEmbedding, req.ReqID)
	}
	if want := e.tokens * e.dim * e.elem; e.mem.size() != want {
		return internal("Embedding size mismatch for %s: actual=%d, expected=%d (shape=[%d, %d], element_size=%d)",
			req.ReqID, e.mem.size(), want, e.tokens, e.dim, e.elem)
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
	nbytes := int(e.mem.size())
	unpin := a.pinPerSend(e)
	start := a.clk.Now()
	res, err := a.write(ctx, req.SessionID, req.BufferAddress, pipeline.Transfer{Source: e.mem.source(), Config: a.pipe})
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
	var partIdx *int64
	if req.HasPartIdx {
		partIdx = &req.PartIdx
	}
	err = a.notifier.Notify(ctx, Completion{
		ReqID: req.ReqID, PartIdx: partIdx, PrefillHost: req.PrefillHost, EmbeddingPort: int64(req.EmbeddingPort),
		EmbeddingSize: int64(nbytes), EmbeddingLen: e.tokens, EmbeddingDim: e.dim, Dtype: e.dtype,
		SessionID: req.SessionID, BufferAddress: req.BufferAddress,
	})
	if err != nil {
		a.metrics.notifyFailures.Inc()
		return internal("encgate: %d bytes for %s reached session=%s, but the completion notice failed, "+sglang.ReceiverNotTold+": %v",
			nbytes, req.ReqID, req.SessionID, err)
	}
	a.store.sent(e, req.Dest(), int64(req.ReceiveCount))
	return nil
}

// checkDestination refuses, before anything is sent, a session_id that does
// not parse and a session host or prefill_host outside allow_networks.
func (a *Agent) checkDestination(ctx context.Context, req sglang.Send) *sendError {
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
func (a *Agent) transferError(req sglang.Send, nbytes int, err error) *sendError {
	var rangeErr *mooncake.RangeError
	var rejected *mooncake.RejectedError
	var notAllowed *NotAllowedError
	var payloadErr *mooncake.PayloadError
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
	case errors.As(err, &payloadErr):
		a.metrics.transfers.WithLabelValues(resultFailed).Inc()
		return &sendError{status: http.StatusInternalServerError, msg: fmt.Sprintf(
			"%s for %s (session=%s, nbytes=%d, ret=-1): encgate: reading the staged embedding failed mid-transfer (%v); the destination range [%#x, %#x) may hold part of it",
			sglang.TransferFailed, req.ReqID, req.SessionID, nbytes, payloadErr.Err, req.BufferAddress, end)}
	case errors.As(err, &notAllowed):
		a.metrics.transfers.WithLabelValues(resultNotAllowed).Inc()
		return &sendError{status: http.StatusForbidden, msg: fmt.Sprintf(
			"encgate: refusing to send %s to session %s: %v; nothing was sent", req.ReqID, req.SessionID, notAllowed)}
	}
	a.metrics.transfers.WithLabelValues(resultFailed).Inc()
	return &sendError{status: http.StatusInternalServerError, msg: fmt.Sprintf(
		"%s for %s (session=%s, nbytes=%d, ret=-1): %v", sglang.TransferFailed, req.ReqID, req.SessionID, nbytes, err)}
}

// write runs the initiator. A passed file truncated by its writer after
// staging must not crash the agent: the kernel fails the socket write
// (EFAULT), and should Go code on this goroutine read the mapping, the fault
// becomes an error too.
func (a *Agent) write(ctx context.Context, session string, addr uint64, payload mooncake.Payload) (res mooncake.Result, err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if p := recover(); p != nil {
			if _, fault := p.(interface{ Addr() uintptr }); !fault {
				panic(p)
			}
			err = fmt.Errorf("reading the staged region faulted (was its file truncated?): %v", p)
		}
	}()
	return a.init.WriteFrom(ctx, session, addr, payload)
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
