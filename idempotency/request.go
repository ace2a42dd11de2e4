package idempotency

import (
	"strconv"
	"strings"

	"github.com/cespare/xxhash/v2"

	"github.com/encgate/encgate/internal/sglang"
)

// Key identifies one /send: sglang counts distinct destinations of a req_id
// (a receiver's TP ranks), so each destination is its own key.
type Key struct {
	ReqID string
	Dest  string // prefill_host:embedding_port
}

// NewKey builds a Key whose two strings share one allocation, so the
// replay path allocates once for its key and a stored req_id and its first
// destination cost one small object. The port is written from its value,
// so one destination has one spelling.
func NewKey(reqID, host string, port int) Key {
	var num [8]byte
	p := strconv.AppendInt(num[:0], int64(port), 10)
	var b strings.Builder
	b.Grow(len(reqID) + len(host) + 1 + len(p))
	b.WriteString(reqID)
	b.WriteString(host)
	b.WriteByte(':')
	b.Write(p)
	s := b.String()
	return Key{ReqID: s[:len(reqID)], Dest: s[len(reqID):]}
}

// Fingerprint identifies a /send's payload beyond its key. A key repeated
// with a different fingerprint is a conflict (422), never a replay. Both
// parts come from decoded values, so JSON spellings of one value agree.
type Fingerprint struct {
	SessionID     uint64 // xxhash of the decoded session_id
	BufferAddress uint64 // the address itself
}

// Diff names the first field where fp and other differ, or "".
func (fp Fingerprint) Diff(other Fingerprint) string {
	switch {
	case fp.SessionID != other.SessionID:
		return "session_id"
	case fp.BufferAddress != other.BufferAddress:
		return "buffer_address"
	default:
		return ""
	}
}

// Send is a /send as the deduplicator sees it.
type Send struct {
	Key          Key
	FP           Fingerprint
	ReceiveCount int // 0 when absent or null: records then simply expire
}

// NewSend is the dedupe identity of a parsed /send. It copies what it
// keeps, so s may be a view of a request buffer that is reused later.
func NewSend(s sglang.Send) Send {
	return Send{
		Key:          NewKey(s.ReqID, s.PrefillHost, s.EmbeddingPort),
		FP:           Fingerprint{SessionID: xxhash.Sum64String(s.SessionID), BufferAddress: s.BufferAddress},
		ReceiveCount: s.ReceiveCount,
	}
}
