package fakeencoder

import (
	"encoding/json"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"
)

func TestEncodeEchoKeepsKeyOrderAndRawNumbers(t *testing.T) {
	e := start(t, testOptions())
	body := `{"req_id":"r1","num_parts":2,"part_idx":1,"modality":"image","prefill_host":"10.0.0.1",` +
		`"embedding_port":null,"embedding_size":5,"encoder_idx":0,"encoder_url":"http://enc",` +
		`"big":18446744073709551615,"f":1.50,"ctl":"a\u0001b","mm_items":["x","y"],"time_stats_json":"{}","hashes":[1,2]}`
	r := post(t, e, RouteEncode, body)
	if r.status != http.StatusOK || r.ctype != "application/json" {
		t.Fatalf("got %d %q %s", r.status, r.ctype, r.body)
	}
	re := regexp.MustCompile(`^\{"req_id":"r1","num_parts":2,"part_idx":1,"modality":"image","prefill_host":"10.0.0.1",` +
		`"embedding_port":null,"embedding_size":1048576,"encoder_idx":0,"encoder_url":"http://enc",` +
		`"big":18446744073709551615,"f":1.50,"ctl":"a\\u0001b","hashes":\[1,2\],"enter_time":\d+\.\d+,` +
		`"embedding_len":512,"embedding_dim":1024\}$`)
	if !re.MatchString(r.body) {
		t.Fatalf("echo %s", r.body)
	}
	if !json.Valid([]byte(r.body)) {
		t.Fatalf("invalid JSON %s", r.body)
	}
	if s := e.Stats(); s.Staged != 1 {
		t.Fatalf("staged %d, want 1", s.Staged)
	}
}

func TestEncodeValidation(t *testing.T) {
	e := start(t, testOptions())
	const tail = `"prefill_host":"h","embedding_port":null}`
	cases := []struct {
		name, body, msg, rawID string
	}{
		{"no req_id", `{"mm_items":["x"],"modality":"IMAGE","num_parts":1,"part_idx":0}`, "missing or invalid req_id", "null"},
		{"int req_id", `{"req_id":7,"mm_items":["x"],"modality":"IMAGE","num_parts":1,"part_idx":0}`, "missing or invalid req_id", "7"},
		{"empty req_id", `{"req_id":"","mm_items":["x"],"modality":"IMAGE","num_parts":1,"part_idx":0}`, "missing or invalid req_id", `""`},
		{"no modality", `{"req_id":"a","mm_items":["x"],"num_parts":1,"part_idx":0}`, "missing or invalid modality", `"a"`},
		{"int modality", `{"req_id":"a","mm_items":["x"],"modality":1,"num_parts":1,"part_idx":0}`, "missing or invalid modality", `"a"`},
		{"bad modality", `{"req_id":"a","mm_items":["x"],"modality":"TEXT","num_parts":1,"part_idx":0}`, "unsupported modality: TEXT", `"a"`},
		{"no items", `{"req_id":"a","modality":"IMAGE","num_parts":1,"part_idx":0}`, "missing or empty mm_items", `"a"`},
		{"empty items", `{"req_id":"a","mm_items":[],"modality":"VIDEO","num_parts":1,"part_idx":0}`, "missing or empty mm_items", `"a"`},
		{"null items", `{"req_id":"a","mm_items":null,"modality":"AUDIO","num_parts":1,"part_idx":0}`, "missing or empty mm_items", `"a"`},
		{"zero parts", `{"req_id":"a","mm_items":["x"],"modality":"IMAGE","num_parts":0,"part_idx":0}`, "num_parts must be a positive integer", `"a"`},
		{"float parts", `{"req_id":"a","mm_items":["x"],"modality":"IMAGE","num_parts":1.0,"part_idx":0}`, "num_parts must be a positive integer", `"a"`},
		{"bool parts", `{"req_id":"a","mm_items":["x"],"modality":"IMAGE","num_parts":true,"part_idx":0}`, "num_parts must be a positive integer", `"a"`},
		{"string parts", `{"req_id":"a","mm_items":["x"],"modality":"IMAGE","num_parts":"2","part_idx":0}`, "num_parts must be a positive integer", `"a"`},
		{"idx too big", `{"req_id":"a","mm_items":["x"],"modality":"IMAGE","num_parts":2,"part_idx":2}`, "part_idx must be in [0, 2)", `"a"`},
		{"idx negative", `{"req_id":"a","mm_items":["x"],"modality":"IMAGE","num_parts":3,"part_idx":-1}`, "part_idx must be in [0, 3)", `"a"`},
		{"no idx", `{"req_id":"a","mm_items":["x"],"modality":"IMAGE","num_parts":1,` + tail, "part_idx must be in [0, 1)", `"a"`},
		{"dict hashes", `{"req_id":"a","mm_items":["x"],"modality":"IMAGE","num_parts":1,"part_idx":0,"hashes":{}}`, "hashes must be list/scalar, got dict", `"a"`},
		{"float hashes", `{"req_id":"a","mm_items":["x"],"modality":"IMAGE","num_parts":1,"part_idx":0,"hashes":1.5}`, "hashes must be list/scalar, got float", `"a"`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := post(t, e, RouteEncode, c.body)
			want := `{"status":"error","message":"` + c.msg + `","req_id":` + c.rawID + `}`
			expect(t, r, http.StatusBadRequest, want)
		})
	}
	if s := e.Stats(); s.Staged != 0 {
		t.Fatalf("validation failures staged %d requests", s.Staged)
	}
}

func TestNotAnObjectIs422(t *testing.T) {
	e := start(t, testOptions())
	for _, route := range []string{RouteEncode, RouteSend, RouteMetadata, RouteRegister} {
		for _, body := range []string{`[1,2]`, `"x"`, `{`, ``} {
			r := post(t, e, route, body)
			if r.status != http.StatusUnprocessableEntity || r.ctype != "application/json" {
				t.Fatalf("%s %q: got %d %q", route, body, r.status, r.ctype)
			}
			var d struct {
				Detail []map[string]any `json:"detail"`
			}
			if err := json.Unmarshal([]byte(r.body), &d); err != nil || len(d.Detail) != 1 {
				t.Fatalf("%s %q: detail %s (%v)", route, body, r.body, err)
			}
		}
	}
}

func TestMetadataBlocksUntilPublished(t *testing.T) {
	opts := testOptions()
	opts.Faults.MetadataDelay = 20 * time.Millisecond
	e := start(t, opts)
	meta := postAsync(e, RouteMetadata, `{"req_id":"m1","part_idx":3}`)
	waitWaiting(t, e, RouteMetadata, 1)
	pending(t, meta, "metadata before /encode")
	enc := postAsync(e, RouteEncode, encodeBody("m1", "a", "b", "c"))
	want := `{"req_id":"m1","part_idx":3,"embedding_size":1572864,"embedding_len":768,"embedding_dim":1024}`
	expect(t, recv(t, meta), http.StatusOK, want)
	if r := recv(t, enc); r.status != http.StatusOK {
		t.Fatalf("encode %d %s", r.status, r.body)
	}
	// Published metadata answers at once.
	expect(t, post(t, e, RouteMetadata, `{"req_id":"m1","part_idx":3}`), http.StatusOK, want)
}

func TestMetadataPartIdxRawAndMissing(t *testing.T) {
	e := start(t, testOptions())
	post(t, e, RouteEncode, encodeBody("p1"))
	r := post(t, e, RouteMetadata, `{"req_id":"p1","part_idx":18446744073709551615}`)
	if r.status != http.StatusOK || !strings.Contains(r.body, `"part_idx":18446744073709551615,`) {
		t.Fatalf("got %d %s", r.status, r.body)
	}
	r = post(t, e, RouteMetadata, `{"req_id":"p1"}`)
	if r.status != http.StatusInternalServerError || r.body != "Internal Server Error" || !strings.HasPrefix(r.ctype, "text/plain") {
		t.Fatalf("missing part_idx: %d %q %q", r.status, r.ctype, r.body)
	}
	r = post(t, e, RouteMetadata, `{"part_idx":0}`)
	if r.status != http.StatusInternalServerError || r.body != "Internal Server Error" {
		t.Fatalf("missing req_id: %d %q", r.status, r.body)
	}
}

func TestLeading504s(t *testing.T) {
	opts := testOptions()
	opts.Faults.Leading504s = 2
	e := start(t, opts)
	post(t, e, RouteEncode, encodeBody("l1"))
	for i := 0; i < 2; i++ {
		expectErr(t, post(t, e, RouteMetadata, metaBody("l1")), http.StatusGatewayTimeout, "encode metadata not ready", "l1")
	}
	if r := post(t, e, RouteMetadata, metaBody("l1")); r.status != http.StatusOK {
		t.Fatalf("third call %d %s", r.status, r.body)
	}
	// Counters are per req_id.
	post(t, e, RouteEncode, encodeBody("l2"))
	expectErr(t, post(t, e, RouteMetadata, metaBody("l2")), http.StatusGatewayTimeout, "encode metadata not ready", "l2")
}

func TestMetadataTimeout(t *testing.T) {
	opts := testOptions()
	opts.MetadataTimeout = 30 * time.Millisecond
	e := start(t, opts)
	expectErr(t, post(t, e, RouteMetadata, metaBody("never")), http.StatusGatewayTimeout, "encode metadata not ready", "never")

	// After release the metadata is gone: a late pull times out too.
	post(t, e, RouteEncode, encodeBody("t1"))
	expect(t, post(t, e, RouteSend, sendBody("t1", 7001, 1)), http.StatusOK, "null")
	expectErr(t, post(t, e, RouteMetadata, metaBody("t1")), http.StatusGatewayTimeout, "encode metadata not ready", "t1")
}
