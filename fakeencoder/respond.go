package fakeencoder

import (
	"math/big"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/valyala/fastjson"
)

// nullJSON is the JSON null body sglang answers on success (ORJSONResponse
// of None).
var nullJSON = []byte("null")

// writeJSON writes body as an application/json response.
func writeJSON(w http.ResponseWriter, status int, body []byte) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// writeText writes a text/plain response.
func writeText(w http.ResponseWriter, status int, text string) {
	h := w.Header()
	h.Set("Content-Type", "text/plain; charset=utf-8")
	h.Set("Content-Length", strconv.Itoa(len(text)))
	w.WriteHeader(status)
	_, _ = w.Write([]byte(text))
}

// writeEmpty writes a response with no body and no content type.
func writeEmpty(w http.ResponseWriter, status int) {
	w.Header().Set("Content-Length", "0")
	w.WriteHeader(status)
}

// writeInternalError answers like starlette on an unhandled exception (for
// example a KeyError on a required field read outside a try block).
func writeInternalError(w http.ResponseWriter) {
	writeText(w, http.StatusInternalServerError, "Internal Server Error")
}

// writeEnvelope writes sglang's error envelope
// {"status":"error","message":msg,"req_id":rawID}; rawID is raw JSON.
func writeEnvelope(w http.ResponseWriter, status int, msg string, rawID []byte) {
	if len(rawID) == 0 {
		rawID = nullJSON
	}
	b := make([]byte, 0, 64+len(msg)+len(rawID))
	b = append(b, `{"status":"error","message":`...)
	b = appendJSONString(b, msg)
	b = append(b, `,"req_id":`...)
	b = append(b, rawID...)
	b = append(b, '}')
	writeJSON(w, status, b)
}

// writeDetail writes a FastAPI-style {"detail": <raw>} error.
func writeDetail(w http.ResponseWriter, status int, rawDetail string) {
	writeJSON(w, status, []byte(`{"detail":`+rawDetail+`}`))
}

// write422 answers a body that is not a JSON object the way FastAPI answers a
// `request: dict` parameter: 422 with a pydantic error list.
func write422(w http.ResponseWriter, body []byte, v *fastjson.Value, parseErr error) {
	var d string
	switch {
	case len(strings.TrimSpace(string(body))) == 0 || (v != nil && v.Type() == fastjson.TypeNull):
		d = `[{"type":"missing","loc":["body"],"msg":"Field required","input":null}]`
	case parseErr != nil:
		d = `[{"type":"json_invalid","loc":["body",0],"msg":"JSON decode error","input":{},"ctx":{"error":"Expecting value"}}]`
	default:
		d = `[{"type":"dict_type","loc":["body"],"msg":"Input should be a valid dictionary","input":` + string(marshalValue(nil, v)) + `}]`
	}
	writeDetail(w, http.StatusUnprocessableEntity, d)
}

// appendJSONString appends s as a JSON string the way orjson writes it:
// non-ASCII as UTF-8, only '"', '\\' and control characters escaped.
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c >= utf8.RuneSelf {
			r, n := utf8.DecodeRuneInString(s[i:])
			if r == utf8.RuneError && n == 1 {
				b = append(b, `\ufffd`...)
			} else {
				b = append(b, s[i:i+n]...)
			}
			i += n
			continue
		}
		switch {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c == '\n':
			b = append(b, '\\', 'n')
		case c == '\r':
			b = append(b, '\\', 'r')
		case c == '\t':
			b = append(b, '\\', 't')
		case c < 0x20:
			b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		default:
			b = append(b, c)
		}
		i++
	}
	return append(b, '"')
}

// pyFloat formats f the way Python's repr (and orjson) prints a float such as
// time.time(): shortest round-trip digits, always with a fraction.
func pyFloat(f float64) string {
	s := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.ContainsAny(s, ".eE") {
		s += ".0"
	}
	return s
}

// unixFloat is t as Python's time.time().
func unixFloat(t time.Time) float64 {
	return float64(t.UnixMicro()) / 1e6
}

// pyInt returns v as an integer when it is a JSON integer (Python int, not
// bool and not float).
func pyInt(v *fastjson.Value) (*big.Int, bool) {
	if v == nil || v.Type() != fastjson.TypeNumber {
		return nil, false
	}
	raw := string(v.MarshalTo(nil))
	if strings.ContainsAny(raw, ".eE") {
		return nil, false
	}
	n, ok := new(big.Int).SetString(raw, 10)
	return n, ok
}

// pyStr returns v as Python's str() would print the decoded value: a string's
// text, an integer's digits, True/False/None; other values as raw JSON.
func pyStr(v *fastjson.Value) string {
	if v == nil {
		return "None"
	}
	switch v.Type() {
	case fastjson.TypeString:
		return string(v.GetStringBytes())
	case fastjson.TypeNumber:
		if n, ok := pyInt(v); ok {
			return n.String()
		}
		return string(v.MarshalTo(nil))
	case fastjson.TypeTrue:
		return "True"
	case fastjson.TypeFalse:
		return "False"
	case fastjson.TypeNull:
		return "None"
	}
	return string(v.MarshalTo(nil))
}

// pyKey is an identity for v like a Python dict key: the type plus pyStr.
func pyKey(v *fastjson.Value) string {
	if v == nil {
		return "n:"
	}
	if v.Type() == fastjson.TypeString {
		return "s:" + pyStr(v)
	}
	return "v:" + pyStr(v)
}

// pyTruthy reports whether Python would treat the decoded v as true.
func pyTruthy(v *fastjson.Value) bool {
	if v == nil {
		return false
	}
	switch v.Type() {
	case fastjson.TypeNull, fastjson.TypeFalse:
		return false
	case fastjson.TypeString:
		return len(v.GetStringBytes()) > 0
	case fastjson.TypeNumber:
		f, err := v.Float64()
		return err != nil || f != 0
	case fastjson.TypeArray:
		a, _ := v.Array()
		return len(a) > 0
	case fastjson.TypeObject:
		o, _ := v.Object()
		return o.Len() > 0
	}
	return true
}

// pyTypeName is Python's type(x).__name__ of the decoded v.
func pyTypeName(v *fastjson.Value) string {
	switch v.Type() {
	case fastjson.TypeObject:
		return "dict"
	case fastjson.TypeArray:
		return "list"
	case fastjson.TypeString:
		return "str"
	case fastjson.TypeNumber:
		if _, ok := pyInt(v); ok {
			return "int"
		}
		return "float"
	case fastjson.TypeTrue, fastjson.TypeFalse:
		return "bool"
	}
	return "NoneType"
}
