package sglang

import (
	"unicode/utf8"
)

// AppendEnvelope appends the encoder's error envelope,
// {"status":"error","message":message,"req_id":reqID}, with req_id null when
// reqID is nil. Keys keep the encoder's order; strings are escaped as JSON
// needs and no more (as orjson writes them: no HTML escaping), with invalid
// UTF-8 written as U+FFFD.
func AppendEnvelope(dst []byte, message string, reqID *string) []byte {
	dst = append(dst, `{"status":"error","message":`...)
	dst = AppendString(dst, message)
	dst = append(dst, `,"req_id":`...)
	if reqID == nil {
		dst = append(dst, "null"...)
	} else {
		dst = AppendString(dst, *reqID)
	}
	return append(dst, '}')
}

// AppendString appends s as a JSON string.
func AppendString(dst []byte, s string) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				dst = append(dst, '\\', c)
			case c == '\n':
				dst = append(dst, '\\', 'n')
			case c == '\r':
				dst = append(dst, '\\', 'r')
			case c == '\t':
				dst = append(dst, '\\', 't')
			case c < 0x20:
				dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			default:
				dst = append(dst, c)
			}
			i++
			continue
		}
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n == 1:
			dst = append(dst, `\ufffd`...)
		case r == '\u2028' || r == '\u2029': // valid JSON, but not valid JavaScript
			dst = append(dst, '\\', 'u', '2', '0', '2', hex[r&0xf])
		default:
			dst = append(dst, s[i:i+n]...)
		}
		i += n
	}
	return append(dst, '"')
}
