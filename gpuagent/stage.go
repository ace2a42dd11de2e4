package gpuagent

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"

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

// serveStage is POST /v1/stage: stage an embedding for req_id from the body
// or a /dev/shm file, or record that its encode failed.
func (a *Agent) serveStage(w http.ResponseWriter, r *http.Request) {
	req, err := parseStageQuery(r.URL.RawQuery)
	if err != nil {
		writeEnvelope(w, http.StatusBadRequest, err.Error(), queryReqID(r.URL.RawQuery))
		return
	}
	if req.Error != "" {
		a.stageFailed(w, req)
		return
	}
	if req.NBytes > int64(a.cfg.Staging.MaxStageBytes) {
		writeEnvelope(w, http.StatusRequestEntityTooLarge, fmt.Sprintf(
			"encgate: embedding of %d bytes is over staging.max_stage_bytes (%s)", req.NBytes, a.cfg.Staging.MaxStageBytes), req.ReqID)
		return
	}
	// Refuse a body of the wrong length before reserving anything.
	if req.SHM == "" && r.ContentLength >= 0 && r.ContentLength != req.NBytes {
		writeEnvelope(w, http.StatusBadRequest, sizeMessage(req, r.ContentLength), req.ReqID)
		return
	}
	e := &entry{id: req.ReqID, tokens: req.Tokens, dim: req.Dim, dtype: req.Dtype, elem: req.Elem,
		nbytes: req.NBytes, source: "http", at: a.clk.Now()}
	if req.SHM != "" {
		e.source = "shm"
	}
	if !a.reserve(w, e) {
		return
	}
	mem, err := a.load(r, req)
	if err != nil {
		a.store.abort(e)
		var bad *badRequest
		if errors.As(err, &bad) {
			writeEnvelope(w, http.StatusBadRequest, bad.msg, req.ReqID)
		} else {
			writeEnvelope(w, http.StatusInternalServerError, "encgate: "+err.Error(), req.ReqID)
		}
		return
	}
	reg := regShared
	if err := a.pin(mem.data); err != nil {
		reg = regPerSend
		a.log.Debug("shared registration failed; registering per send", zap.String("req_id", req.ReqID), zap.Error(err))
	} else {
		a.metrics.registrations.WithLabelValues(regShared).Inc()
	}
	a.store.commit(e, mem, reg)
	if c := a.log.Check(zap.DebugLevel, "staged"); c != nil {
		c.Write(zap.String("req_id", req.ReqID), zap.Int64("bytes", req.NBytes), zap.String("source", e.source),
			zap.String("registration", reg))
	}
	writeJSON(w, http.StatusOK, stageAnswer{ReqID: req.ReqID, EmbeddingSize: req.NBytes, EmbeddingLen: req.Tokens, EmbeddingDim: req.Dim})
}

// stageFailed records a failed encode: /sends for it then get sglang's
// "No embedding available" answer.
func (a *Agent) stageFailed(w http.ResponseWriter, req stageRequest) {
	e := &entry{id: req.ReqID, failed: req.Error, at: a.clk.Now()}
	if !a.reserve(w, e) {
		return
	}
	a.store.commit(e, region{}, "")
	writeJSON(w, http.StatusOK, failedAnswer{ReqID: req.ReqID, Error: req.Error})
}

// reserve adds e to the store, or answers 409 or 507 and returns false.
func (a *Agent) reserve(w http.ResponseWriter, e *entry) bool {
	switch err := a.store.reserve(e); {
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

// load puts the embedding's bytes in memory the agent owns: the mapped shm
// file, or the body read into fresh memory, which must be exactly NBytes.
func (a *Agent) load(r *http.Request, req stageRequest) (region, error) {
	if req.SHM != "" {
		return mapSHM(req.SHM, req.Offset, req.NBytes)
	}
	mem, err := allocRegion(req.NBytes)
	if err != nil {
		return region{}, err
	}
	n, err := io.ReadFull(r.Body, mem.data)
	switch {
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		_ = mem.free()
		return region{}, &badRequest{msg: sizeMessage(req, int64(n))}
	case err != nil:
		_ = mem.free()
		return region{}, badf("encgate: reading the stage body: %v", err)
	}
	var one [1]byte
	if m, _ := io.ReadFull(r.Body, one[:]); m > 0 {
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
