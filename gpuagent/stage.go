package gpuagent

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"syscall"

	"go.uber.org/zap"
)

// stageAnswer is the 200 body of a stage: the metadata sglang publishes.
type stageAnswer struct {
	ReqID         string `json:"req_id"`
	EmbeddingSize int64  `json:"embedding_size"`
	EmbeddingLen  int64  `json:"embedding_len"`
	EmbeddingDim  int64  `json:"embedding_dim"`
}

// failedAnswer is the 200 body of a recorded failed encode.
type failedAnswer struct {
	ReqID string `json:"req_id"`
	Error string `json:"error"`
}

// serveStage is POST /v1/stage on the Unix socket: stage an embedding for
// req_id from the body or a passed file descriptor, or record that its
// encode failed. The stager (the connection's peer process) owns what it
// stages.
func (a *Agent) serveStage(w http.ResponseWriter, r *http.Request) {
	conn, _ := stagerOf(r)
	req, err := parseStageQuery(r.URL.RawQuery)
	if err != nil {
		writeEnvelope(w, http.StatusBadRequest, err.Error(), queryReqID(r.URL.RawQuery))
		return
	}
	if req.Error != "" {
		a.stageFailed(w, req, conn.peer)
		return
	}
	if limit := a.cfg.Staging.MaxStage(); req.NBytes > int64(limit) {
		writeEnvelope(w, http.StatusRequestEntityTooLarge, fmt.Sprintf(
			"encgate: embedding of %d bytes is over staging.max_stage_bytes (%s)", req.NBytes, limit), req.ReqID)
		return
	}
	// Refuse a body of the wrong length before reserving anything.
	if want := req.bodyBytes(); r.ContentLength >= 0 && r.ContentLength != want {
		writeEnvelope(w, http.StatusBadRequest, sizeMessage(req, r.ContentLength), req.ReqID)
		return
	}
	var gpu *gpu
	if req.Source == sourceCUDA {
		var err error
		if gpu, err = a.gpus.device(req.Device); err != nil {
			writeEnvelope(w, http.StatusNotImplemented, fmt.Sprintf(
				"encgate: this agent cannot stage by CUDA IPC handle (source=cuda) on device %d: %v; stage the bytes instead (source=body or fd)",
				req.Device, err), req.ReqID)
			return
		}
	}
	var fd = -1
	if req.Source == sourceFD {
		var ok bool
		if fd, ok = conn.takeFD(); !ok {
			writeEnvelope(w, http.StatusBadRequest, fmt.Sprintf(
				"encgate: source=fd but no file descriptor came with the request for req_id=%s (pass one with SCM_RIGHTS in the same sendmsg as the request's first bytes)",
				req.ReqID), req.ReqID)
			return
		}
	}
	select {
	case a.stages <- struct{}{}:
	default:
		if fd >= 0 {
			_ = syscall.Close(fd)
		}
		a.metrics.stagesCut.WithLabelValues(cutBusy).Inc()
		w.Header().Set("Retry-After", "1")
		writeEnvelope(w, http.StatusServiceUnavailable, fmt.Sprintf(
			"encgate: %d stages are already in progress (staging.max_concurrent); retry req_id=%s", cap(a.stages), req.ReqID), req.ReqID)
		return
	}
	a.metrics.stagesActive.Inc()
	defer func() {
		a.metrics.stagesActive.Dec()
		<-a.stages
	}()
	e := &entry{id: req.ReqID, tokens: req.Tokens, dim: req.Dim, dtype: req.Dtype, elem: req.Elem,
		nbytes: req.NBytes, source: req.Source, device: gpu != nil, at: a.clk.Now(), owner: conn.peer}
	if !a.reserve(w, e) {
		if fd >= 0 {
			_ = syscall.Close(fd)
		}
		return
	}
	settled := false
	defer func() { // a panic below must not keep the reservation
		if !settled {
			a.store.abort(e)
		}
	}()
	mem, err := a.load(w, r, req, fd, gpu)
	if err != nil {
		settled = true // aborted here, with an answer
		a.store.abort(e)
		var bad *badRequest
		var gerr *stageErr
		switch {
		case errors.As(err, &gerr):
			writeEnvelope(w, gerr.status, fmt.Sprintf("encgate: req_id=%s: %s; nothing is staged", req.ReqID, gerr.msg), req.ReqID)
		case errors.As(err, &bad):
			writeEnvelope(w, http.StatusBadRequest, bad.msg, req.ReqID)
		case stalled(err):
			a.metrics.stagesCut.WithLabelValues(cutStalled).Inc()
			a.log.Info("a stage body stalled; its reservation is released", zap.String("req_id", req.ReqID),
				zap.Stringer("stager", conn.peer), zap.Duration("body_timeout", a.cfg.Control.BodyTimeout.D()))
			writeEnvelope(w, http.StatusRequestTimeout, fmt.Sprintf(
				"encgate: the stage body for req_id=%s sent nothing for control.body_timeout (%s); nothing is staged",
				req.ReqID, a.cfg.Control.BodyTimeout), req.ReqID)
		case errors.Is(err, errBodyBroken):
			a.metrics.stagesCut.WithLabelValues(cutClosed).Inc()
			writeEnvelope(w, http.StatusBadRequest, fmt.Sprintf("encgate: %v for req_id=%s; nothing is staged", err, req.ReqID), req.ReqID)
		default:
			writeEnvelope(w, http.StatusInternalServerError, "encgate: "+err.Error(), req.ReqID)
		}
		return
	}
	reg := regShared
	if mem.device != nil {
		reg = regDevice
	} else if err := a.pin(mem.data); err != nil {
		reg = regPerSend
		a.log.Debug("shared registration failed; registering per send", zap.String("req_id", req.ReqID), zap.Error(err))
	} else {
		a.metrics.registrations.WithLabelValues(regShared).Inc()
	}
	settled = true
	a.store.commit(e, mem, reg)
	if c := a.log.Check(zap.DebugLevel, "staged"); c != nil {
		c.Write(zap.String("req_id", req.ReqID), zap.Int64("bytes", req.NBytes), zap.String("source", e.source),
			zap.String("registration", reg), zap.Stringer("stager", conn.peer))
	}
	writeJSON(w, http.StatusOK, stageAnswer{ReqID: req.ReqID, EmbeddingSize: req.NBytes, EmbeddingLen: req.Tokens, EmbeddingDim: req.Dim})
}

// bodyBytes is the body length a stage must have.
func (r stageRequest) bodyBytes() int64 {
	if r.Source == sourceFD || r.Source == sourceCUDA {
		return 0
	}
	return r.NBytes
}

// stageFailed records a failed encode: /sends for it then get sglang's
// "No embedding available" answer.
func (a *Agent) stageFailed(w http.ResponseWriter, req stageRequest, owner stager) {
	e := &entry{id: req.ReqID, failed: req.Error, at: a.clk.Now(), owner: owner}
	if !a.reserve(w, e) {
		return
	}
	a.store.commit(e, region{}, "")
	writeJSON(w, http.StatusOK, failedAnswer{ReqID: req.ReqID, Error: req.Error})
}

// reserve adds e to the store, or answers 409 or 507 and returns false.
func (a *Agent) reserve(w http.ResponseWriter, e *entry) bool {
	err := a.store.reserve(e)
	if a.reserved != nil {
		a.reserved(e.id)
	}
	var owned *ownedError
	switch {
	case errors.As(err, &owned):
		a.ownerConflict(w, e.id, e.owner, owned.owner)
		return false
	case errors.Is(err, errExists):
		writeEnvelope(w, http.StatusConflict, fmt.Sprintf("encgate: req_id=%s is already staged", e.id), e.id)
		return false
	case errors.Is(err, errCapacity):
		held, _ := a.store.usage()
		writeEnvelope(w, http.StatusInsufficientStorage, fmt.Sprintf(
			"encgate: staging %d bytes for req_id=%s would exceed staging.capacity_bytes (%s; %d bytes held)",
			e.nbytes, e.id, a.cfg.Staging.CapacityBytes, held), e.id)
		return false
	}
	return true
}

// ownerConflict answers 409 to a stager touching a req_id another process
// staged, and logs it: on one node that is a bug or an attack.
func (a *Agent) ownerConflict(w http.ResponseWriter, id string, who, owner stager) {
	a.metrics.ownerConflicts.Inc()
	a.log.Warn("refused a stage for a req_id another process staged", zap.String("req_id", id),
		zap.Stringer("stager", who), zap.Stringer("owner", owner))
	writeEnvelope(w, http.StatusConflict, fmt.Sprintf(
		"encgate: req_id=%s was staged by another process (%s); only it may stage its embedding, ack frame or failure", id, owner), id)
}

// errBodyBroken is a stage body whose connection closed or broke mid-way.
var errBodyBroken = errors.New("the stage body ended early (connection closed or broken)")

// load puts the embedding's bytes in memory the agent owns: a device copy
// of the allocation a CUDA IPC handle names (gpu set), the mapped passed
// file (fd, which load owns), or the body read into fresh memory,
// which must be exactly NBytes and arrive without a pause of
// control.body_timeout.
func (a *Agent) load(w http.ResponseWriter, r *http.Request, req stageRequest, fd int, gpu *gpu) (region, error) {
	if gpu != nil {
		return gpu.copyIn(req.Handle, req.Offset, req.NBytes)
	}
	if req.Source == sourceFD {
		return mapFD(fd, req.Offset, req.NBytes)
	}
	mem, err := allocRegion(req.NBytes)
	if err != nil {
		return region{}, err
	}
	body := a.body(w, r.Body)
	n, err := io.ReadFull(body, mem.data)
	switch {
	case err == nil:
	case stalled(err):
		_ = mem.free()
		return region{}, err
	case errors.Is(err, io.ErrUnexpectedEOF) && r.ContentLength >= 0:
		// The declared length was right, so the connection ended early.
		_ = mem.free()
		return region{}, errBodyBroken
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		_ = mem.free()
		return region{}, &badRequest{msg: sizeMessage(req, int64(n))}
	default:
		_ = mem.free()
		return region{}, fmt.Errorf("%w: %v", errBodyBroken, err)
	}
	var one [1]byte
	if m, _ := io.ReadFull(body, one[:]); m > 0 {
		_ = mem.free()
		return region{}, &badRequest{msg: sizeMessage(req, -1)}
	}
	return mem, nil
}

// sizeMessage says the body does not hold tokens*dim*element_size bytes;
// got < 0 means "more".
func sizeMessage(req stageRequest, got int64) string {
	have := fmt.Sprintf("%d bytes", got)
	if got < 0 {
		have = "more bytes"
	}
	return fmt.Sprintf("encgate: body has %s, want tokens*dim*element_size = %d*%d*%d = %d for req_id=%s",
		have, req.Tokens, req.Dim, req.Elem, req.NBytes, req.ReqID)
}

// queryReqID is the query's req_id for an error envelope, or "".
func queryReqID(raw string) string {
	q, err := url.ParseQuery(raw)
	if err != nil {
		return ""
	}
	return q.Get("req_id")
}
