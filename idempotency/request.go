package idempotency

import (
	"bytes"
	"errors"
	"strings"
	"unsafe"

	"github.com/cespare/xxhash/v2"

	"github.com/encgate/encgate/internal/jsonfield"
)

// Key identifies one /send: sglang counts distinct destinations of a req_id
// (a receiver's TP ranks), so each destination is its own key.
type Key struct {
	ReqID string
	Dest  string // prefill_host:embedding_port
}

// NewKey builds a Key whose two strings share one allocation, so the
// replay path allocates once for its key and a stored req_id and its first
// destination cost one small object.
func NewKey(reqID, host, port string) Key {
	var b strings.Builder
	b.Grow(len(reqID) + len(host) + len(port) + 1)
	b.WriteString(reqID)
	b.WriteString(host)
	b.WriteByte(':')
	b.WriteString(port)
	s := b.String()
	return Key{ReqID: s[:len(reqID)], Dest: s[len(reqID):]}
}

// Fingerprint identifies a /send's payload beyond its key. A key repeated
// with a different fingerprint is a conflict (422), never a replay.
type Fingerprint struct {
	SessionID     uint64 // xxhash of the raw JSON value
	BufferAddress uint64 // xxhash of the raw JSON number text
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

// Send is what the gateway reads from a /send body.
type Send struct {
	Key          Key
	FP           Fingerprint
	ReceiveCount int // 0 when absent or null: records then simply expire
}

var sendKeys = []string{"req_id", "prefill_host", "embedding_port", "session_id", "buffer_address", "receive_count"}

// Errors from ParseSend; the gateway answers them with a 400 envelope.
var (
	ErrBadReqID        = errors.New("missing or invalid req_id")
	ErrBadDestination  = errors.New("encgate: /send needs prefill_host (a string) and embedding_port (an integer)")
	ErrBadTransfer     = errors.New("encgate: /send needs session_id (a string) and buffer_address (an integer)")
	ErrBadReceiveCount = errors.New("encgate: /send receive_count must be a non-negative integer")
)

// ParseSend reads a /send body. It rejects bodies the encoder would fail on
// in a way that releases the whole request for the sibling ranks (a missing
// field raises inside sglang's /send handler), so the gateway answers them
// itself. buffer_address is checked as JSON integer text of any size and
// never converted.
func ParseSend(body []byte) (Send, error) {
	var raw [6][]byte
	if err := jsonfield.Lookup(body, sendKeys, raw[:]); err != nil {
		return Send{}, err
	}
	var s Send
	reqID, ok := stringView(raw[0])
	if !ok || reqID == "" {
		return s, ErrBadReqID
	}
	host, ok := stringView(raw[1])
	port, okPort := jsonfield.Int(raw[2])
	if !ok || host == "" || !okPort || port < 0 || port > 65535 {
		return s, ErrBadDestination
	}
	if _, ok := stringView(raw[3]); !ok || !isInteger(raw[4]) {
		return s, ErrBadTransfer
	}
	if !jsonfield.IsNull(raw[5]) {
		n, ok := jsonfield.Int(raw[5])
		if !ok || n < 0 || n > 1<<20 {
			return s, ErrBadReceiveCount
		}
		s.ReceiveCount = int(n)
	}
	s.Key = NewKey(reqID, host, unsafeString(raw[2]))
	s.FP = Fingerprint{SessionID: xxhash.Sum64(raw[3]), BufferAddress: xxhash.Sum64(raw[4])}
	return s, nil
}

// isInteger reports whether raw is JSON integer text (any length, no sign).
func isInteger(raw []byte) bool {
	if len(raw) == 0 {
		return false
	}
	for _, c := range raw {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// stringView returns a JSON string's content without copying when it has no
// escapes (the common case); the view lives only until NewKey copies it.
func stringView(raw []byte) (string, bool) {
	if len(raw) >= 2 && raw[0] == '"' && bytes.IndexByte(raw, '\\') < 0 {
		return unsafeString(raw[1 : len(raw)-1]), true
	}
	return jsonfield.String(raw)
}

func unsafeString(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	return unsafe.String(&b[0], len(b))
}
