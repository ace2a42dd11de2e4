package gpuagent

import (
	"fmt"
	"net/http"
	"strconv"
)

// maxReceiverRead bounds GET /v1/receiver/bytes.
const maxReceiverRead = 64 << 20

// receiverInfo is GET /v1/receiver.
type receiverInfo struct {
	SessionID string           `json:"session_id"`
	Buffers   []receiverBuffer `json:"buffers"`
}

type receiverBuffer struct {
	Addr   uint64 `json:"addr"`
	Length uint64 `json:"length"`
}

// serveReceiver is GET /v1/receiver: the session_id to put in a /send and
// the registered buffers, so a transfer into this agent can be aimed.
func (a *Agent) serveReceiver(w http.ResponseWriter, _ *http.Request) {
	if a.recv == nil {
		writeEnvelope(w, http.StatusNotFound, "encgate: this agent runs no receiver (receiver: in its config)", "")
		return
	}
	info := receiverInfo{SessionID: a.recv.SessionID(), Buffers: []receiverBuffer{}}
	for _, b := range a.recv.Buffers() {
		info.Buffers = append(info.Buffers, receiverBuffer{Addr: b.Addr, Length: b.Length})
	}
	writeJSON(w, http.StatusOK, info)
}

// serveReceiverBytes is GET /v1/receiver/bytes?addr=A&len=L (decimal,
// L <= 64MiB): the bytes of a registered buffer, to verify a transfer.
func (a *Agent) serveReceiverBytes(w http.ResponseWriter, r *http.Request) {
	if a.recv == nil {
		writeEnvelope(w, http.StatusNotFound, "encgate: this agent runs no receiver (receiver: in its config)", "")
		return
	}
	q := r.URL.Query()
	addr, err := strconv.ParseUint(q.Get("addr"), 10, 64)
	if err != nil {
		writeEnvelope(w, http.StatusBadRequest, fmt.Sprintf("encgate: addr must be a decimal address, got %q", q.Get("addr")), "")
		return
	}
	n, err := decimal(q.Get("len"))
	if err != nil || n < 1 || n > maxReceiverRead {
		writeEnvelope(w, http.StatusBadRequest, fmt.Sprintf("encgate: len must be a decimal in [1, %d], got %q", maxReceiverRead, q.Get("len")), "")
		return
	}
	b, err := a.recv.Bytes(addr, int(n))
	if err != nil {
		writeEnvelope(w, http.StatusBadRequest, "encgate: "+err.Error(), "")
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	_, _ = w.Write(b)
}
