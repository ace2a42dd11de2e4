package sglang

import (
	"encoding/json"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestAppendEnvelope(t *testing.T) {
	id := "r_local_part_0"
	if got := string(AppendEnvelope(nil, "encode metadata not ready", &id)); got != `{"status":"error","message":"encode metadata not ready","req_id":"r_local_part_0"}` {
		t.Errorf("got %s", got)
	}
	if got := string(AppendEnvelope(nil, `a "q" <b> & \ `+"\n\t\x01\u2028", nil)); got != `{"status":"error","message":"a \"q\" <b> & \\ \n\t\u0001\u2028","req_id":null}` {
		t.Errorf("got %s", got)
	}
}

// FuzzEnvelope: the envelope is always valid JSON with the three keys in
// the encoder's order, and decodes back to the message and req_id (invalid
// UTF-8 as U+FFFD, as encoding/json reads it).
func FuzzEnvelope(f *testing.F) {
	f.Add("encode metadata not ready", "r", true)
	f.Add("\xff\u2029\"\\", "", false)
	f.Fuzz(func(t *testing.T, msg, id string, hasID bool) {
		var idp *string
		if hasID {
			idp = &id
		}
		b := AppendEnvelope(nil, msg, idp)
		var got struct {
			Status  string  `json:"status"`
			Message string  `json:"message"`
			ReqID   *string `json:"req_id"`
		}
		if err := json.Unmarshal(b, &got); err != nil {
			t.Fatalf("%q: %v", b, err)
		}
		fix := func(s string) string { return strings.ToValidUTF8(s, "\ufffd") }
		if !utf8.Valid(b) || got.Status != "error" || got.Message != fixEach(msg) || (idp == nil) != (got.ReqID == nil) ||
			(idp != nil && *got.ReqID != fixEach(id)) {
			t.Fatalf("%q decodes to %+v (want %q, %q)", b, got, fix(msg), id)
		}
		if !strings.HasPrefix(string(b), `{"status":"error","message":`) {
			t.Fatalf("key order: %s", b)
		}
	})
}

// fixEach replaces each invalid byte with U+FFFD, as encoding/json does.
func fixEach(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && n == 1 {
			b.WriteRune(utf8.RuneError)
		} else {
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}
