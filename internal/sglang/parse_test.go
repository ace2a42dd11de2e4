package sglang

import (
	"bytes"
	"encoding/json"
	"errors"
	"math/big"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/encgate/encgate/internal/jsonfield"
)

const goodSend = `{"req_id":"r_local_part_0","part_idx":0,"embedding_size":1024,"prefill_host":"10.0.0.1","embedding_port":40001,"session_id":"10.0.0.1:17000","buffer_address":18446744073709551615,"receive_count":4}`

func TestParseSend(t *testing.T) {
	s, err := ParseSend([]byte(goodSend), Limits{})
	if err != nil {
		t.Fatal(err)
	}
	want := Send{ReqID: "r_local_part_0", PrefillHost: "10.0.0.1", EmbeddingPort: 40001, SessionID: "10.0.0.1:17000",
		BufferAddress: 1<<64 - 1, PartIdx: 0, HasPartIdx: true, ReceiveCount: 4}
	if s != want || s.Dest() != "10.0.0.1:40001" {
		t.Fatalf("parsed %+v", s)
	}
	if s, err := ParseSend([]byte(`{"req_id":"r","part_idx":null,"prefill_host":"h","embedding_port":1,"session_id":"h:1","buffer_address":0,"receive_count":null}`), Limits{}); err != nil ||
		s.HasPartIdx || s.ReceiveCount != 0 {
		t.Fatalf("nulls: %+v %v", s, err)
	}
	for _, tc := range []struct{ body, field, msg, id string }{
		{`nope`, "", "not valid JSON", ""},
		{`[]`, "", "must be a JSON object", ""},
		{`{}`, "req_id", "missing or invalid req_id", ""},
		{`{"req_id":""}`, "req_id", "missing or invalid req_id", ""},
		{`{"req_id":5}`, "req_id", "missing or invalid req_id", ""},
		{`{"req_id":"r"}`, "prefill_host", "/send needs prefill_host", "r"},
		{`{"req_id":"r","prefill_host":""}`, "prefill_host", "prefill_host", "r"},
		{`{"req_id":"r","prefill_host":"h","embedding_port":"1"}`, "embedding_port", "[1, 65535]", "r"},
		{`{"req_id":"r","prefill_host":"h","embedding_port":0}`, "embedding_port", "embedding_port", "r"},
		{`{"req_id":"r","prefill_host":"h","embedding_port":-0}`, "embedding_port", "embedding_port", "r"},
		{`{"req_id":"r","prefill_host":"h","embedding_port":70000}`, "embedding_port", "embedding_port", "r"},
		{`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":5}`, "session_id", "session_id", "r"},
		{`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":""}`, "session_id", "session_id", "r"},
		{`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":"h:1","buffer_address":-1}`, "buffer_address", "2^64", "r"},
		{`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":"h:1","buffer_address":1.5e14}`, "buffer_address", "buffer_address", "r"},
		{`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":"h:1","buffer_address":18446744073709551616}`, "buffer_address", "buffer_address", "r"},
		{`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":"h:1","buffer_address":"1"}`, "buffer_address", "buffer_address", "r"},
		{`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":"h:1","buffer_address":1,"receive_count":-2}`, "receive_count", "receive_count", "r"},
		{`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":"h:1","buffer_address":1,"receive_count":1048577}`, "receive_count", "receive_count", "r"},
		{`{"req_id":"r","part_idx":"0","prefill_host":"h","embedding_port":1,"session_id":"h:1","buffer_address":1}`, "part_idx", "part_idx", "r"},
	} {
		_, err := ParseSend([]byte(tc.body), Limits{})
		if err == nil || err.Field != tc.field || !strings.Contains(err.Message, tc.msg) || err.ReqID != tc.id {
			t.Errorf("ParseSend(%s) = %+v; want field %q, message with %q, req_id %q", tc.body, err, tc.field, tc.msg, tc.id)
		}
	}
}

// The same text gives the same strings whether or not it needed decoding,
// so that keys built from either agree; text a strict decoder refuses
// (invalid UTF-8, a lone surrogate) is refused, never read as U+FFFD, so
// that two different ids can never become one; and a string over the
// field limit is refused.
func TestParseSendStrings(t *testing.T) {
	plain, _ := ParseSend([]byte(`{"req_id":"ab","prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1}`), Limits{})
	escaped, _ := ParseSend([]byte(`{"req_id":"a\u0062","prefill_host":"\u0068","embedding_port":1,"session_id":"\u0073","buffer_address":1}`), Limits{})
	if plain != escaped {
		t.Fatalf("%+v != %+v", plain, escaped)
	}
	pair, err := ParseSend([]byte(`{"req_id":"\ud83d\ude00","prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1}`), Limits{})
	if err != nil || pair.ReqID != "\U0001F600" {
		t.Fatalf("a surrogate pair: %q %v", pair.ReqID, err)
	}
	send := func(id, host string) string {
		return `{"req_id":"` + id + `","prefill_host":"` + host + `","embedding_port":1,"session_id":"s","buffer_address":1}`
	}
	for _, tc := range []struct{ body, field string }{
		{send("a\xff", "h"), "req_id"},
		{send("a\xed\xa0\x80", "h"), "req_id"}, // a surrogate in UTF-8
		{send(`a\ud800`, "h"), "req_id"},
		{send(`a\udc00b`, "h"), "req_id"},
		{send(`\ud800\u0041`, "h"), "req_id"},
		{send("r", "h\xc3"), "prefill_host"},
		{send("r", `\udfff`), "prefill_host"},
		{send(strings.Repeat("x", DefaultMaxFieldBytes+1), "h"), "req_id"},
		{send("r", strings.Repeat("h", DefaultMaxFieldBytes+1)), "prefill_host"},
		{send("r", strings.Repeat(`\u0068`, DefaultMaxFieldBytes+1)), "prefill_host"}, // long decoded
	} {
		if _, err := ParseSend([]byte(tc.body), Limits{}); err == nil || err.Field != tc.field {
			t.Errorf("%.80q: %+v, want refused at %s", tc.body, err, tc.field)
		}
	}
	if _, err := ParseSend([]byte(send(strings.Repeat("x", DefaultMaxFieldBytes), "h")), Limits{}); err != nil {
		t.Errorf("a req_id of exactly the limit: %v", err)
	}
	if _, err := ParseSend([]byte(send(strings.Repeat("x", 65), "h")), Limits{MaxFieldBytes: 64}); err == nil || !strings.Contains(err.Message, "limits.max_field_bytes (64 bytes)") {
		t.Errorf("a configured limit: %v", err)
	}
	// The other routes read req_id the same way.
	for _, rt := range []*Route{RouteEncode, RouteMetadata, RouteReceiveURL} {
		if _, err := rt.Parse([]byte(`{"req_id":"a\ud800","part_idx":0}`), Limits{}); err == nil || err.Field != "req_id" {
			t.Errorf("%s: a lone surrogate in req_id: %+v", rt.Path, err)
		}
	}
}

func TestParseFollowUps(t *testing.T) {
	for _, tc := range []struct {
		route       *Route
		body, field string
		msg         string
	}{
		{RouteMetadata, `{"req_id":"r","part_idx":0}`, "", ""},
		{RouteMetadata, `{"req_id":"r"}`, "part_idx", "encgate: /scheduler_receive_meta_data needs part_idx (a non-negative integer)"},
		{RouteMetadata, `{"req_id":"r","part_idx":"0"}`, "part_idx", "part_idx"},
		{RouteMetadata, `{"req_id":"r","part_idx":-1}`, "part_idx", "part_idx"},
		{RouteMetadata, `{"req_id":"r","part_idx":1.0}`, "part_idx", "part_idx"},
		{RouteMetadata, `{"part_idx":0}`, "req_id", MissingReqID},
		{RouteReceiveURL, `{"req_id":"r","receive_url":"10.0.0.1:5000","receive_count":2,"modality":"IMAGE"}`, "", ""},
		{RouteReceiveURL, `{"req_id":"r","receive_count":2}`, "receive_url", "encgate: /scheduler_receive_url needs receive_url"},
		{RouteReceiveURL, `{"req_id":"r","receive_url":"","receive_count":2}`, "receive_url", "receive_url"},
		{RouteReceiveURL, `{"req_id":"r","receive_url":5,"receive_count":2}`, "receive_url", "receive_url"},
		{RouteReceiveURL, `{"req_id":"r","receive_url":"h:1"}`, "receive_count", "receive_count"},
		{RouteReceiveURL, `{"req_id":"r","receive_url":"h:1","receive_count":0}`, "receive_count", "receive_count"},
		{RouteReceiveURL, `{"req_id":"r","receive_url":"h:1","receive_count":"2"}`, "receive_count", "receive_count"},
		{RouteReceiveURL, `{"req_id":"r","receive_url":"h:1","receive_count":null}`, "receive_count", "receive_count"},
	} {
		req, err := tc.route.Parse([]byte(tc.body), Limits{})
		switch {
		case tc.field == "" && (err != nil || req.ReqID != "r"):
			t.Errorf("%s %s: %+v %v", tc.route.Path, tc.body, req, err)
		case tc.field != "" && (err == nil || err.Field != tc.field || !strings.Contains(err.Message, tc.msg)):
			t.Errorf("%s %s: %+v; want field %q, message with %q", tc.route.Path, tc.body, err, tc.field, tc.msg)
		case err != nil && tc.field != "req_id" && err.ReqID != "r":
			t.Errorf("%s %s: envelope req_id %q", tc.route.Path, tc.body, err.ReqID)
		}
	}
}

// /encode is checked as NEW's validate_encode_request checks it, with its
// messages.
func TestParseEncode(t *testing.T) {
	const ok = `{"req_id":"r","modality":"image","mm_items":["x"],"num_parts":2,"part_idx":1}`
	if req, err := RouteEncode.Parse([]byte(ok), Limits{}); err != nil || req.ReqID != "r" || req.Rank {
		t.Fatalf("%+v %v", req, err)
	}
	rank := `{"req_id":"r","modality":"IMAGE","mm_items":["x"],"num_parts":1,"part_idx":0,"receive_count":6,"embedding_port":4000}`
	if req, err := RouteEncode.Parse([]byte(rank), Limits{}); err != nil || !req.Rank {
		t.Fatalf("GEN0 rank: %+v %v", req, err)
	}
	for _, tc := range []struct{ body, field, msg string }{
		{`{"modality":"IMAGE","mm_items":["x"],"num_parts":1,"part_idx":0}`, "req_id", "missing or invalid req_id"},
		{`{"req_id":"r","mm_items":["x"],"num_parts":1,"part_idx":0}`, "modality", "missing or invalid modality"},
		{`{"req_id":"r","modality":"TEXT","mm_items":["x"],"num_parts":1,"part_idx":0}`, "modality", "unsupported modality: TEXT"},
		{`{"req_id":"r","modality":"IMAGE","num_parts":1,"part_idx":0}`, "mm_items", "missing or empty mm_items"},
		{`{"req_id":"r","modality":"IMAGE","mm_items":[],"num_parts":1,"part_idx":0}`, "mm_items", "missing or empty mm_items"},
		{`{"req_id":"r","modality":"IMAGE","mm_items":[ ],"num_parts":1,"part_idx":0}`, "mm_items", "missing or empty mm_items"},
		{`{"req_id":"r","modality":"IMAGE","mm_items":"","num_parts":1,"part_idx":0}`, "mm_items", "missing or empty mm_items"},
		{`{"req_id":"r","modality":"IMAGE","mm_items":["x"],"num_parts":0,"part_idx":0}`, "num_parts", "num_parts must be a positive integer"},
		{`{"req_id":"r","modality":"IMAGE","mm_items":["x"],"num_parts":1.0,"part_idx":0}`, "num_parts", "num_parts must be a positive integer"},
		{`{"req_id":"r","modality":"IMAGE","mm_items":["x"],"num_parts":1,"part_idx":1}`, "part_idx", "part_idx must be in [0, 1)"},
		{`{"req_id":"r","modality":"IMAGE","mm_items":["x"],"num_parts":1,"part_idx":-1}`, "part_idx", "part_idx must be in [0, 1)"},
		{`{"req_id":"r","modality":"IMAGE","mm_items":["x"],"num_parts":1}`, "part_idx", "part_idx must be in [0, 1)"},
		{`{"req_id":"r","modality":"IMAGE","mm_items":["x"],"num_parts":1,"part_idx":0,"hashes":{"a":1}}`, "hashes", "hashes must be list/scalar, got dict"},
		{`{"req_id":"r","modality":"IMAGE","mm_items":["x"],"num_parts":1,"part_idx":0,"hashes":1.5}`, "hashes", "hashes must be list/scalar, got float"},
	} {
		_, err := RouteEncode.Parse([]byte(tc.body), Limits{})
		if err == nil || err.Field != tc.field || err.Message != tc.msg {
			t.Errorf("%s: %+v; want %s: %q", tc.body, err, tc.field, tc.msg)
		}
	}
	// Python integers have no size limit.
	big := `{"req_id":"r","modality":"IMAGE","mm_items":["x"],"num_parts":100000000000000000000000,"part_idx":99999999999999999999999}`
	if _, err := RouteEncode.Parse([]byte(big), Limits{}); err != nil {
		t.Errorf("big integers: %v", err)
	}
	bigOut := `{"req_id":"r","modality":"IMAGE","mm_items":["x"],"num_parts":100000000000000000000000,"part_idx":100000000000000000000000}`
	if _, err := RouteEncode.Parse([]byte(bigOut), Limits{}); err == nil || err.Message != "part_idx must be in [0, 100000000000000000000000)" {
		t.Errorf("big integers out of range: %v", err)
	}
}

func TestLookupAndLabels(t *testing.T) {
	for _, r := range Routes {
		if Lookup([]byte(r.Path)) != r {
			t.Errorf("Lookup(%s)", r.Path)
		}
	}
	if Lookup([]byte("/encode/")) != RouteUnknown || Lookup(nil) != RouteUnknown {
		t.Error("unknown paths")
	}
	if got := strings.Join(Labels(), ","); got != "encode,metadata,receive_url,send,health,profile,unknown" {
		t.Errorf("labels %s", got)
	}
}

var jsonIntRE = regexp.MustCompile(`^-?(0|[1-9][0-9]*)$`)

// strictRef reports whether a strict JSON decoder takes the string token
// raw: valid UTF-8, and every \u escape of a UTF-16 surrogate half of a
// pair (checked with unicode/utf16).
func strictRef(raw []byte) bool {
	if !utf8.Valid(raw) {
		return false
	}
	var units []uint16 // the run of \u escapes being read
	flush := func() bool {
		for i := 0; i < len(units); i++ {
			if !utf16.IsSurrogate(rune(units[i])) {
				continue
			}
			if i+1 >= len(units) || utf16.DecodeRune(rune(units[i]), rune(units[i+1])) == utf8.RuneError {
				return false
			}
			i++
		}
		units = units[:0]
		return true
	}
	for i := 0; i < len(raw); i++ {
		if raw[i] == '\\' && i+1 < len(raw) && raw[i+1] == 'u' && i+5 < len(raw) {
			n, err := strconv.ParseUint(string(raw[i+2:i+6]), 16, 16)
			if err != nil {
				return false
			}
			units = append(units, uint16(n))
			i += 5
			continue
		}
		if !flush() {
			return false
		}
		if raw[i] == '\\' {
			i++ // an escaped character: not the start of \u
		}
	}
	return flush()
}

// refParseSend is ParseSend written with encoding/json, check by check in
// the same order: the reference FuzzParseSendAgainstJSON compares with.
func refParseSend(body []byte) (Send, string, error) {
	var m map[string]json.RawMessage
	if json.Unmarshal(body, &m) != nil || m == nil {
		return Send{}, "", errors.New("not a JSON object")
	}
	str := func(k string) (string, bool) {
		var s string
		return s, bytes.HasPrefix(m[k], []byte(`"`)) && strictRef(m[k]) && json.Unmarshal(m[k], &s) == nil &&
			s != "" && len(s) <= DefaultMaxFieldBytes
	}
	intIn := func(k string, lo, hi *big.Int) (*big.Int, bool) {
		n, ok := new(big.Int).SetString(string(m[k]), 10)
		return n, ok && jsonIntRE.Match(m[k]) && n.Cmp(lo) >= 0 && n.Cmp(hi) <= 0
	}
	null := func(k string) bool { v, ok := m[k]; return !ok || string(v) == "null" }
	var s Send
	var ok bool
	if s.ReqID, ok = str("req_id"); !ok {
		return Send{}, "req_id", errors.New("req_id")
	}
	if s.PrefillHost, ok = str("prefill_host"); !ok {
		return Send{}, "prefill_host", errors.New("prefill_host")
	}
	port, ok := intIn("embedding_port", big.NewInt(1), big.NewInt(65535))
	if !ok {
		return Send{}, "embedding_port", errors.New("embedding_port")
	}
	s.EmbeddingPort = int(port.Int64())
	if s.SessionID, ok = str("session_id"); !ok {
		return Send{}, "session_id", errors.New("session_id")
	}
	addr, ok := intIn("buffer_address", big.NewInt(0), new(big.Int).SetUint64(1<<64-1))
	if !ok || bytes.HasPrefix(m["buffer_address"], []byte("-")) {
		return Send{}, "buffer_address", errors.New("buffer_address")
	}
	s.BufferAddress = addr.Uint64()
	if !null("receive_count") {
		n, ok := intIn("receive_count", big.NewInt(0), big.NewInt(MaxReceiveCount))
		if !ok {
			return Send{}, "receive_count", errors.New("receive_count")
		}
		s.ReceiveCount = int(n.Int64())
	}
	if !null("part_idx") {
		n, ok := intIn("part_idx", big.NewInt(0), big.NewInt(1<<63-1))
		if !ok {
			return Send{}, "part_idx", errors.New("part_idx")
		}
		s.PartIdx, s.HasPartIdx = n.Int64(), true
	}
	return s, "", nil
}

// FuzzParseSendAgainstJSON checks the one /send parser (the gateway's and
// the agent's) against encoding/json with a strict string check
// (strictRef): the same verdict, the same first offending field, and the
// same values (strings as encoding/json decodes them; buffer_address to the
// last digit).
func FuzzParseSendAgainstJSON(f *testing.F) {
	for _, s := range []string{
		goodSend,
		`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":0,"receive_count":1048576}`,
		`{"req_id":"r","prefill_host":"h","embedding_port":65536,"session_id":"s","buffer_address":1}`,
		`{"req_id":"r","prefill_host":"h","embedding_port":-0,"session_id":"s","buffer_address":99999999999999999999999}`,
		`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1.5}`,
		`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1,"receive_count":-0,"part_idx":-0}`,
		`{"req_id":"\u0072","prefill_host":"\u0068","embedding_port":1,"session_id":5,"buffer_address":1}`,
		"{\"req_id\":\"\xff\",\"prefill_host\":\"h\",\"embedding_port\":1,\"session_id\":\"s\",\"buffer_address\":1}",
		`{"req_id":"r","req_id":"s","prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1}`,
		`{"req_id":""}`, `[]`, `{`,
		`{"req_id":"\ud800","prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1}`,
		`{"req_id":"\ud83d\ude00\\u","prefill_host":"\udfff","embedding_port":1,"session_id":"s","buffer_address":1}`,
		`{"req_id":"r","prefill_host":"` + strings.Repeat("h", DefaultMaxFieldBytes+1) + `","embedding_port":1,"session_id":"s","buffer_address":1}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		if len(body) > 8<<10 {
			return // long bodies add no paths and slow minimisation
		}
		var probe [1][]byte
		if errors.Is(jsonfield.Lookup(body, []string{"x"}, probe[:]), jsonfield.ErrTooDeep) {
			return // nested beyond jsonfield.MaxDepth: encoding/json allows more on purpose
		}
		s, err := ParseSend(body, Limits{})
		want, field, werr := refParseSend(body)
		if (err == nil) != (werr == nil) {
			t.Fatalf("ParseSend(%s, Limits{}) = %+v, %v; encoding/json says %v", body, s, err, werr)
		}
		if err != nil {
			if field != "" && err.Field != field {
				t.Fatalf("ParseSend(%s, Limits{}) refuses %q, encoding/json %q", body, err.Field, field)
			}
			return
		}
		if s != want {
			t.Fatalf("ParseSend(%s, Limits{}) = %+v; encoding/json reads %+v", body, s, want)
		}
	})
}
