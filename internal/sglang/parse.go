package sglang

import (
	"bytes"
	"errors"
	"strconv"
	"strings"
	"unicode/utf8"
	"unsafe"

	"github.com/encgate/encgate/internal/jsonfield"
)

// Request is what encgate reads from a request body.
type Request struct {
	// ReqID is the part id. It is a copy the caller may keep, except for
	// /send, where it is Send.ReqID (see Send).
	ReqID string
	// Rank marks a GEN0 receiver rank's own /encode: it carries the rank's
	// receive_count (§11). NEW's tokenizer sends none.
	Rank bool
	// Send is the parsed /send body (Send route only).
	Send Send
	// MMItems is the raw JSON text of an /encode's mm_items value exactly
	// as the body holds it (a view of the body, not a copy, valid as long
	// as the body is): what content placement hashes, as the encoder's
	// media cache keys the same bytes. Nil on other routes.
	MMItems []byte
}

// FieldError is a body encgate refuses before forwarding it: the encoder
// would index a missing field (a KeyError: a 500 that reads as an encoder
// fault, and for /send the release of the whole request for every sibling
// rank) or would refuse it with this message itself.
type FieldError struct {
	// Field is the offending field, "" when the body is not a JSON object.
	Field string
	// Message is the envelope message: sglang's own wording where the
	// encoder has one, else encgate's, naming the field.
	Message string
	// ReqID is the body's req_id when it has a valid one, for the envelope.
	ReqID string
}

func (e *FieldError) Error() string { return e.Message }

// MissingReqID is the encoder's message for a missing or invalid req_id.
const MissingReqID = "missing or invalid req_id"

// Limits bound what a body's fields may hold.
type Limits struct {
	// MaxFieldBytes bounds each string field encgate keys by or routes on
	// (req_id, prefill_host, session_id, receive_url), decoded; 0 means
	// DefaultMaxFieldBytes. A part id is ~50 bytes, a host at most 255.
	MaxFieldBytes int
}

// DefaultMaxFieldBytes is Limits.MaxFieldBytes when unset.
const DefaultMaxFieldBytes = 512

func (l Limits) maxField() int {
	if l.MaxFieldBytes <= 0 {
		return DefaultMaxFieldBytes
	}
	return l.MaxFieldBytes
}

// strictString decodes a JSON string as a strict decoder would: invalid
// UTF-8 and lone surrogate escapes (\ud800 unpaired) are refused rather
// than read as U+FFFD, so that two different texts can never become one
// key, and a string longer than max bytes decoded is refused. Without
// escapes the result is a view of raw (see Send).
func strictString(raw []byte, max int) (s string, ok bool, tooLong bool) {
	if len(raw) < 2 || raw[0] != '"' {
		return "", false, false
	}
	inner := raw[1 : len(raw)-1]
	if !utf8.Valid(inner) || !pairedSurrogates(inner) {
		return "", false, false
	}
	if bytes.IndexByte(inner, '\\') < 0 {
		if len(inner) > max {
			return "", true, true
		}
		if len(inner) == 0 {
			return "", true, false
		}
		return unsafe.String(&inner[0], len(inner)), true, false
	}
	if s, ok = jsonfield.String(raw); !ok {
		return "", false, false
	}
	if len(s) > max {
		return "", true, true
	}
	return s, true, false
}

// pairedSurrogates reports whether every \uD800-\uDFFF escape in a JSON
// string's inner text is half of a high-low pair.
func pairedSurrogates(inner []byte) bool {
	for i := 0; i < len(inner); i++ {
		if inner[i] != '\\' {
			continue
		}
		i++
		if i >= len(inner) || inner[i] != 'u' {
			continue
		}
		c, ok := hex4(inner[i+1:])
		if !ok {
			return false
		}
		i += 4
		switch {
		case c >= 0xdc00 && c <= 0xdfff:
			return false // a low half alone
		case c >= 0xd800 && c <= 0xdbff:
			if i+2 >= len(inner) || inner[i+1] != '\\' || inner[i+2] != 'u' {
				return false
			}
			lo, ok := hex4(inner[i+3:])
			if !ok || lo < 0xdc00 || lo > 0xdfff {
				return false
			}
			i += 6
		}
	}
	return true
}

func hex4(b []byte) (rune, bool) {
	if len(b) < 4 {
		return 0, false
	}
	var r rune
	for _, c := range b[:4] {
		switch {
		case c >= '0' && c <= '9':
			r = r<<4 | rune(c-'0')
		case c >= 'a' && c <= 'f':
			r = r<<4 | rune(c-'a'+10)
		case c >= 'A' && c <= 'F':
			r = r<<4 | rune(c-'A'+10)
		default:
			return 0, false
		}
	}
	return r, true
}

func notJSON(err error) *FieldError {
	if errors.Is(err, jsonfield.ErrNotObject) {
		return &FieldError{Message: "encgate: request body must be a JSON object"}
	}
	return &FieldError{Message: "encgate: request body is not valid JSON: " + err.Error()}
}

func needs(route, field, what, reqID string) *FieldError {
	return &FieldError{Field: field, ReqID: reqID, Message: "encgate: " + route + " needs " + field + " (" + what + ")"}
}

// reqIDOf reads raw as a req_id: a non-empty, strictly decoded JSON string
// within the field limit. It is a copy the caller may keep.
func reqIDOf(raw []byte, lim Limits) (string, *FieldError) {
	id, ok, long := strictString(raw, lim.maxField())
	switch {
	case long:
		return "", &FieldError{Field: "req_id", Message: tooLong("req_id", lim)}
	case !ok || id == "":
		return "", &FieldError{Field: "req_id", Message: MissingReqID}
	}
	return strings.Clone(id), nil
}

func tooLong(field string, lim Limits) string {
	return "encgate: " + field + " is longer than limits.max_field_bytes (" + strconv.Itoa(lim.maxField()) + " bytes)"
}

// text reads a required non-empty string field of route's body strictly;
// what names the form in the message.
func text(raw []byte, lim Limits, route, field, what, reqID string) (string, *FieldError) {
	v, ok, long := strictString(raw, lim.maxField())
	switch {
	case long:
		return "", &FieldError{Field: field, ReqID: reqID, Message: tooLong(field, lim)}
	case !ok || v == "":
		return "", needs(route, field, what, reqID)
	}
	return v, nil
}

var encodeKeys = []string{"req_id", "modality", "mm_items", "num_parts", "part_idx", "hashes", "receive_count"}

// parseEncode checks /encode as NEW's validate_encode_request does (§1.1),
// with its messages, so a NEW fleet sees the answer it would have given
// and a GEN0 fleet, which validates nothing, gets it instead of a failure
// deep inside a batch that reads as an encoder fault.
func parseEncode(body []byte, lim Limits) (Request, *FieldError) {
	var raw [7][]byte
	if err := jsonfield.Lookup(body, encodeKeys, raw[:]); err != nil {
		return Request{}, notJSON(err)
	}
	id, ferr := reqIDOf(raw[0], lim)
	if ferr != nil {
		return Request{}, ferr
	}
	bad := func(field, msg string) (Request, *FieldError) {
		return Request{}, &FieldError{Field: field, Message: msg, ReqID: id}
	}
	mod, ok := jsonfield.String(raw[1])
	if !ok {
		return bad("modality", "missing or invalid modality")
	}
	if !validModality(mod) {
		return bad("modality", "unsupported modality: "+mod)
	}
	if !truthy(raw[2]) {
		return bad("mm_items", "missing or empty mm_items")
	}
	numParts, ok := integer(raw[3])
	if !ok || numParts.sign <= 0 {
		return bad("num_parts", "num_parts must be a positive integer")
	}
	partIdx, ok := integer(raw[4])
	if !ok || partIdx.sign < 0 || partIdx.cmp(numParts) >= 0 {
		return bad("part_idx", "part_idx must be in [0, "+numParts.String()+")")
	}
	if h := raw[5]; h != nil && !jsonfield.IsNull(h) {
		switch {
		case h[0] == '{':
			return bad("hashes", "hashes must be list/scalar, got dict")
		case h[0] == '-' || h[0] >= '0' && h[0] <= '9':
			if _, ok := integer(h); !ok {
				return bad("hashes", "hashes must be list/scalar, got float")
			}
		}
	}
	return Request{ReqID: id, Rank: raw[6] != nil && !jsonfield.IsNull(raw[6]), MMItems: raw[2]}, nil
}

// validModality reports whether Modality.from_str takes s.
func validModality(s string) bool {
	for _, m := range [...]string{"IMAGE", "VIDEO", "AUDIO"} {
		if strings.EqualFold(s, m) {
			return true
		}
	}
	return false
}

// truthy reports whether Python finds the decoded raw value true.
func truthy(raw []byte) bool {
	switch {
	case raw == nil, jsonfield.IsNull(raw), string(raw) == "false", string(raw) == `""`:
		return false
	case raw[0] == '[' || raw[0] == '{':
		inner := bytes.TrimSpace(raw[1 : len(raw)-1])
		return len(inner) > 0
	case raw[0] == '-' || raw[0] >= '0' && raw[0] <= '9':
		f, err := strconv.ParseFloat(string(raw), 64)
		return err != nil || f != 0
	}
	return true
}

var metadataKeys = []string{"req_id", "part_idx"}

// parseMetadata: the encoder echoes request["part_idx"] (§1.2).
func parseMetadata(body []byte, lim Limits) (Request, *FieldError) {
	var raw [2][]byte
	if err := jsonfield.Lookup(body, metadataKeys, raw[:]); err != nil {
		return Request{}, notJSON(err)
	}
	id, ferr := reqIDOf(raw[0], lim)
	if ferr != nil {
		return Request{}, ferr
	}
	if n, ok := jsonfield.Int(raw[1]); !ok || n < 0 {
		return Request{}, needs(PathMetadata, "part_idx", "a non-negative integer", id)
	}
	return Request{ReqID: id}, nil
}

var receiveURLKeys = []string{"req_id", "receive_url", "receive_count"}

// MaxReceiveCount bounds receive_count: a receiver's TP size.
const MaxReceiveCount = 1 << 20

// parseReceiveURL: the encoder reads receive_count and receive_url with []
// (§1.4) and connects a ZMQ PUSH socket to the URL.
func parseReceiveURL(body []byte, lim Limits) (Request, *FieldError) {
	var raw [3][]byte
	if err := jsonfield.Lookup(body, receiveURLKeys, raw[:]); err != nil {
		return Request{}, notJSON(err)
	}
	id, ferr := reqIDOf(raw[0], lim)
	if ferr != nil {
		return Request{}, ferr
	}
	if _, ferr := text(raw[1], lim, PathReceiveURL, "receive_url", `a non-empty string such as "10.0.0.7:41003"`, id); ferr != nil {
		return Request{}, ferr
	}
	if n, ok := jsonfield.Int(raw[2]); !ok || n < 1 || n > MaxReceiveCount {
		return Request{}, needs(PathReceiveURL, "receive_count", "an integer in [1, "+strconv.Itoa(MaxReceiveCount)+"]", id)
	}
	return Request{ReqID: id}, nil
}

func parseSendRoute(body []byte, lim Limits) (Request, *FieldError) {
	s, err := ParseSend(body, lim)
	if err != nil {
		return Request{}, err
	}
	return Request{ReqID: s.ReqID, Send: s}, nil
}

// Send is a /send body (§1.3): the destination rank and its landing buffer.
//
// ReqID, PrefillHost and SessionID are views into the body when their JSON
// text needs no decoding, so that a replayed /send allocates nothing to
// read them: a caller that keeps one past the body's lifetime copies it.
type Send struct {
	ReqID       string
	PrefillHost string
	// EmbeddingPort is the rank's ZMQ PULL port for the completion ack.
	EmbeddingPort int
	// SessionID is the receiver's Mooncake session, "host:rpc_port".
	SessionID string
	// BufferAddress is the destination GPU virtual address, exact to the
	// last digit (~1e14: never through float64).
	BufferAddress uint64
	// PartIdx is set when HasPartIdx.
	PartIdx    int64
	HasPartIdx bool
	// ReceiveCount is the receiver's TP size; 0 when absent or null
	// (records then simply expire, as sglang leaves them to its sweep).
	ReceiveCount int
}

var sendKeys = []string{"req_id", "prefill_host", "embedding_port", "session_id", "buffer_address", "receive_count", "part_idx"}

// ParseSend reads a /send body within lim. It refuses what the encoder would fail on
// in a way that releases the whole request for the sibling ranks (sglang
// reads prefill_host, embedding_port, session_id and buffer_address with
// [], §1.3, and releases on any error inside /send, §4), and what could
// not reach a receiver (a port outside 1-65535, an empty session).
func ParseSend(body []byte, lim Limits) (Send, *FieldError) {
	var raw [7][]byte
	if err := jsonfield.Lookup(body, sendKeys, raw[:]); err != nil {
		return Send{}, notJSON(err)
	}
	var s Send
	var ok, long bool
	switch s.ReqID, ok, long = strictString(raw[0], lim.maxField()); {
	case long:
		return Send{}, &FieldError{Field: "req_id", Message: tooLong("req_id", lim)}
	case !ok || s.ReqID == "":
		return Send{}, &FieldError{Field: "req_id", Message: MissingReqID}
	}
	id := s.ReqID
	var ferr *FieldError
	if s.PrefillHost, ferr = text(raw[1], lim, PathSend, "prefill_host", "a non-empty string", id); ferr != nil {
		return Send{}, ferr
	}
	port, ok := jsonfield.Int(raw[2])
	if !ok || port < 1 || port > 65535 {
		return Send{}, needs(PathSend, "embedding_port", "an integer in [1, 65535]", id)
	}
	s.EmbeddingPort = int(port)
	if s.SessionID, ferr = text(raw[3], lim, PathSend, "session_id", `a non-empty string "host:port"`, id); ferr != nil {
		return Send{}, ferr
	}
	if s.BufferAddress, ok = parseUint64(raw[4]); !ok {
		return Send{}, needs(PathSend, "buffer_address", "an integer in [0, 2^64)", id)
	}
	if !jsonfield.IsNull(raw[5]) {
		n, ok := jsonfield.Int(raw[5])
		if !ok || n < 0 || n > MaxReceiveCount {
			return Send{}, needs(PathSend, "receive_count", "absent, null or an integer in [0, "+strconv.Itoa(MaxReceiveCount)+"]", id)
		}
		s.ReceiveCount = int(n)
	}
	if !jsonfield.IsNull(raw[6]) {
		n, ok := jsonfield.Int(raw[6])
		if !ok || n < 0 {
			return Send{}, needs(PathSend, "part_idx", "absent, null or a non-negative integer", id)
		}
		s.PartIdx, s.HasPartIdx = n, true
	}
	return s, nil
}

// Dest is the destination sglang counts for the refcount,
// "prefill_host:embedding_port".
func (s Send) Dest() string { return s.PrefillHost + ":" + strconv.Itoa(s.EmbeddingPort) }

// parseUint64 parses raw JSON integer text in [0, 2^64).
func parseUint64(raw []byte) (uint64, bool) {
	if len(raw) == 0 || raw[0] < '0' || raw[0] > '9' || (raw[0] == '0' && len(raw) > 1) {
		return 0, false
	}
	n, err := strconv.ParseUint(string(raw), 10, 64)
	return n, err == nil
}

// decimal is a JSON integer of any size, as Python reads it.
type decimal struct {
	sign   int    // -1, 0, 1
	digits string // without sign or leading zeros; "" for zero
}

// integer reads raw as a JSON integer (no fraction, no exponent).
func integer(raw []byte) (decimal, bool) {
	s := string(raw)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	if s == "" || (s[0] == '0' && len(s) > 1) {
		return decimal{}, false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return decimal{}, false
		}
	}
	if s == "0" {
		return decimal{}, true
	}
	d := decimal{sign: 1, digits: s}
	if neg {
		d.sign = -1
	}
	return d, true
}

func (d decimal) cmp(o decimal) int {
	if d.sign != o.sign {
		if d.sign < o.sign {
			return -1
		}
		return 1
	}
	c := 0
	switch {
	case len(d.digits) != len(o.digits):
		c = 1
		if len(d.digits) < len(o.digits) {
			c = -1
		}
	default:
		c = strings.Compare(d.digits, o.digits)
	}
	return c * d.sign
}

func (d decimal) String() string {
	switch d.sign {
	case 0:
		return "0"
	case -1:
		return "-" + d.digits
	}
	return d.digits
}
