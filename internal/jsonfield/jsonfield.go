// Package jsonfield reads top-level members of a JSON object without copying
// or decoding the document: it validates the whole input strictly (RFC 8259,
// as encoding/json does) and hands back each wanted member's raw value as a
// subslice of the input. Numbers stay as their text, so a 64-bit GPU address
// never passes through float64.
package jsonfield

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"unicode/utf8"
)

// MaxDepth bounds nesting so hostile input cannot exhaust the stack.
const MaxDepth = 512

// Errors returned by Lookup. A *SyntaxError wraps ErrSyntax.
var (
	ErrSyntax    = errors.New("jsonfield: invalid JSON")
	ErrNotObject = errors.New("jsonfield: JSON body is not an object")
	ErrTooDeep   = errors.New("jsonfield: JSON nested too deeply")
)

// SyntaxError says where the input stopped being JSON.
type SyntaxError struct {
	Offset int
	Msg    string
}

func (e *SyntaxError) Error() string {
	return fmt.Sprintf("invalid JSON at byte %d: %s", e.Offset, e.Msg)
}

// Unwrap makes errors.Is(err, ErrSyntax) true.
func (e *SyntaxError) Unwrap() error { return ErrSyntax }

// Lookup validates data as one JSON value that must be an object, and for
// each keys[i] stores the raw value of that top-level member in out[i] (nil
// when absent; the last occurrence wins, as in Python and encoding/json).
// out must be at least as long as keys. Lookup does not allocate when keys
// are written without escapes.
func Lookup(data []byte, keys []string, out [][]byte) error {
	for i := range keys {
		out[i] = nil
	}
	s := scanner{data: data}
	s.skipSpace()
	if s.pos >= len(data) {
		return s.fail("unexpected end of input")
	}
	if data[s.pos] != '{' {
		if err := s.value(0); err != nil {
			return err
		}
		return ErrNotObject
	}
	if err := s.object(0, keys, out); err != nil {
		return err
	}
	s.skipSpace()
	if s.pos != len(data) {
		return s.fail("data after the top-level value")
	}
	return nil
}

// String decodes a raw JSON value that must be a string. ok is false for any
// other JSON type. As with encoding/json, each byte of invalid UTF-8 reads
// as U+FFFD.
func String(raw []byte) (s string, ok bool) {
	if len(raw) < 2 || raw[0] != '"' {
		return "", false
	}
	inner := raw[1 : len(raw)-1]
	if bytes.IndexByte(inner, '\\') < 0 && utf8.Valid(inner) {
		return string(inner), true
	}
	if err := json.Unmarshal(raw, &s); err != nil {
		return "", false
	}
	return s, true
}

// Int parses a raw JSON value that must be an integer (no fraction or
// exponent) fitting in int64.
func Int(raw []byte) (int64, bool) {
	if len(raw) == 0 || !(raw[0] == '-' || (raw[0] >= '0' && raw[0] <= '9')) {
		return 0, false
	}
	n, err := strconv.ParseInt(string(raw), 10, 64)
	return n, err == nil
}

// IsNull reports whether raw is absent or the JSON literal null.
func IsNull(raw []byte) bool { return raw == nil || string(raw) == "null" }

type scanner struct {
	data []byte
	pos  int
}

func (s *scanner) fail(msg string) error { return &SyntaxError{Offset: s.pos, Msg: msg} }

func (s *scanner) skipSpace() {
	for s.pos < len(s.data) {
		switch s.data[s.pos] {
		case ' ', '\t', '\n', '\r':
			s.pos++
		default:
			return
		}
	}
}

func (s *scanner) value(depth int) error {
	if depth > MaxDepth {
		return ErrTooDeep
	}
	s.skipSpace()
	if s.pos >= len(s.data) {
		return s.fail("unexpected end of input")
	}
	switch c := s.data[s.pos]; {
	case c == '{':
		return s.object(depth, nil, nil)
	case c == '[':
		return s.array(depth)
	case c == '"':
		return s.str()
	case c == '-' || (c >= '0' && c <= '9'):
		return s.number()
	case c == 't':
		return s.literal("true")
	case c == 'f':
		return s.literal("false")
	case c == 'n':
		return s.literal("null")
	default:
		return s.fail(fmt.Sprintf("unexpected character %q", c))
	}
}

// object scans {...} at s.pos; at depth 0 it records wanted members.
func (s *scanner) object(depth int, keys []string, out [][]byte) error {
	if depth > MaxDepth {
		return ErrTooDeep
	}
	s.pos++ // '{'
	s.skipSpace()
	if s.pos < len(s.data) && s.data[s.pos] == '}' {
		s.pos++
		return nil
	}
	for {
		s.skipSpace()
		if s.pos >= len(s.data) || s.data[s.pos] != '"' {
			return s.fail("expected a member name")
		}
		kStart := s.pos
		if err := s.str(); err != nil {
			return err
		}
		key := s.data[kStart:s.pos]
		s.skipSpace()
		if s.pos >= len(s.data) || s.data[s.pos] != ':' {
			return s.fail("expected ':' after a member name")
		}
		s.pos++
		s.skipSpace()
		vStart := s.pos
		if err := s.value(depth + 1); err != nil {
			return err
		}
		if keys != nil {
			match(key, s.data[vStart:s.pos], keys, out)
		}
		s.skipSpace()
		if s.pos >= len(s.data) {
			return s.fail("unexpected end of input in an object")
		}
		switch s.data[s.pos] {
		case ',':
			s.pos++
		case '}':
			s.pos++
			return nil
		default:
			return s.fail("expected ',' or '}' in an object")
		}
	}
}

// match stores value under every wanted key equal to the quoted raw key.
func match(rawKey, value []byte, keys []string, out [][]byte) {
	inner := rawKey[1 : len(rawKey)-1]
	if bytes.IndexByte(inner, '\\') >= 0 {
		// Rare: an escaped member name. Decode it (this allocates).
		name, ok := String(rawKey)
		if !ok {
			return
		}
		inner = []byte(name)
	}
	for i, k := range keys {
		if string(inner) == k { // compiled without a copy
			out[i] = value
		}
	}
}

func (s *scanner) array(depth int) error {
	s.pos++ // '['
	s.skipSpace()
	if s.pos < len(s.data) && s.data[s.pos] == ']' {
		s.pos++
		return nil
	}
	for {
		if err := s.value(depth + 1); err != nil {
			return err
		}
		s.skipSpace()
		if s.pos >= len(s.data) {
			return s.fail("unexpected end of input in an array")
		}
		switch s.data[s.pos] {
		case ',':
			s.pos++
		case ']':
			s.pos++
			return nil
		default:
			return s.fail("expected ',' or ']' in an array")
		}
	}
}

// plain marks bytes that may appear in a string without further checks.
var plain = func() (t [256]bool) {
	for c := 0x20; c < 256; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

func (s *scanner) str() error {
	s.pos++ // opening quote
	for s.pos < len(s.data) {
		c := s.data[s.pos]
		if plain[c] {
			s.pos++
			continue
		}
		switch {
		case c == '"':
			s.pos++
			return nil
		case c == '\\':
			if err := s.escape(); err != nil {
				return err
			}
		default:
			return s.fail("control character in a string")
		}
	}
	return s.fail("unterminated string")
}

func (s *scanner) escape() error {
	s.pos++ // backslash
	if s.pos >= len(s.data) {
		return s.fail("unterminated escape")
	}
	switch s.data[s.pos] {
	case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
		s.pos++
		return nil
	case 'u':
		if s.pos+4 >= len(s.data) {
			return s.fail("short \\u escape")
		}
		for _, h := range s.data[s.pos+1 : s.pos+5] {
			if !isHex(h) {
				return s.fail("bad \\u escape")
			}
		}
		s.pos += 5
		return nil
	default:
		return s.fail("bad escape")
	}
}

func isHex(c byte) bool {
	return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

func (s *scanner) digits() int {
	n := 0
	for s.pos < len(s.data) && s.data[s.pos] >= '0' && s.data[s.pos] <= '9' {
		s.pos++
		n++
	}
	return n
}

func (s *scanner) number() error {
	if s.data[s.pos] == '-' {
		s.pos++
	}
	if s.pos < len(s.data) && s.data[s.pos] == '0' {
		s.pos++
	} else if s.digits() == 0 {
		return s.fail("bad number")
	}
	if s.pos < len(s.data) && s.data[s.pos] == '.' {
		s.pos++
		if s.digits() == 0 {
			return s.fail("bad number fraction")
		}
	}
	if s.pos < len(s.data) && (s.data[s.pos] == 'e' || s.data[s.pos] == 'E') {
		s.pos++
		if s.pos < len(s.data) && (s.data[s.pos] == '+' || s.data[s.pos] == '-') {
			s.pos++
		}
		if s.digits() == 0 {
			return s.fail("bad number exponent")
		}
	}
	return nil
}

func (s *scanner) literal(lit string) error {
	if len(s.data)-s.pos < len(lit) || string(s.data[s.pos:s.pos+len(lit)]) != lit {
		return s.fail("bad literal")
	}
	s.pos += len(lit)
	return nil
}
