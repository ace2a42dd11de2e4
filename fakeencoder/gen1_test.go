package fakeencoder

import (
	"flag"
	"io"
	"net/http"
	"strings"
	"testing"
)

// gen1Options are testOptions for GEN1 in mode.
func gen1Options(mode Mode) Options {
	o := testOptions()
	o.Generation = Gen1
	o.Mode = mode
	return o
}

// gen1Bodies are /encode bodies whose answers differ or agree across the
// generations (TestGen1EncodeValidation, TestGenerationsAnswerAsBefore).
var gen1Bodies = struct{ noID, noModality, badModality, noItems, emptyItems, noParts, noPartIdx, dictHashes string }{
	noID:        `{"mm_items":["x"],"modality":"IMAGE","num_parts":1,"part_idx":0}`,
	noModality:  `{"req_id":"a","mm_items":["x"],"num_parts":1,"part_idx":0}`,
	badModality: `{"req_id":"a","mm_items":["x"],"modality":"TEXT","num_parts":1,"part_idx":0}`,
	noItems:     `{"req_id":"a","modality":"IMAGE","num_parts":1,"part_idx":0}`,
	emptyItems:  `{"req_id":"a","mm_items":[],"modality":"AUDIO","num_parts":1,"part_idx":0}`,
	noParts:     `{"req_id":"a","mm_items":["x"],"modality":"IMAGE","part_idx":0}`,
	noPartIdx:   `{"req_id":"a","mm_items":["x"],"modality":"AUDIO","num_parts":1}`,
	dictHashes:  `{"req_id":"a","mm_items":["x"],"modality":"IMAGE","num_parts":1,"part_idx":0,"hashes":{}}`,
}

const gen1BadModalityMsg = "Invalid modality string: TEXT. Valid modalities are: ['IMAGE', 'VIDEO', 'AUDIO']"

func TestGen1EncodeValidation(t *testing.T) {
	b := gen1Bodies
	e := start(t, gen1Options(ModeMooncake))
	expectText500(t, post(t, e, RouteEncode, b.noID))
	expectErr(t, post(t, e, RouteEncode, b.noModality), http.StatusInternalServerError, Gen1MissingModality, "a")
	expectErr(t, post(t, e, RouteEncode, b.badModality), http.StatusInternalServerError, gen1BadModalityMsg, "a")
	expectErr(t, post(t, e, RouteEncode, strings.Replace(b.badModality, `"TEXT"`, `1`, 1)),
		http.StatusInternalServerError, "'int' object has no attribute 'upper'", "a")
	for _, c := range []struct{ body, msg string }{
		{b.noItems, "missing or empty mm_items"},
		{b.emptyItems, "missing or empty mm_items"},
		{b.noParts, "num_parts must be a positive integer"},
		{b.noPartIdx, "part_idx must be in [0, 1)"},
		{b.dictHashes, "hashes must be list/scalar, got dict"},
	} {
		expectErr(t, post(t, e, RouteEncode, c.body), http.StatusBadRequest, c.msg, "a")
	}
	if r := post(t, e, RouteEncode, encodeBody("ok")); r.status != http.StatusOK {
		t.Fatalf("valid encode: %d %s", r.status, r.body)
	}
}

// TestGenerationsAnswerAsBefore pins NEW's and GEN0's answers to the bodies
// GEN1 answers differently, so that GEN1 changed neither.
func TestGenerationsAnswerAsBefore(t *testing.T) {
	b := gen1Bodies
	type want struct {
		status int
		body   string
	}
	env := func(msg string) string { return envelope(msg, "a") }
	cases := []struct {
		body           string
		gen0, gnew, g1 want
	}{
		{b.noID, want{500, "Internal Server Error"}, want{400, `{"status":"error","message":"missing or invalid req_id","req_id":null}`}, want{500, "Internal Server Error"}},
		{b.noModality, want{500, env("'modality'")}, want{400, env("missing or invalid modality")}, want{500, env("'modality'")}},
		{b.badModality, want{500, env(gen1BadModalityMsg)}, want{400, env("unsupported modality: TEXT")}, want{500, env(gen1BadModalityMsg)}},
		{b.noItems, want{500, env("'mm_items'")}, want{400, env("missing or empty mm_items")}, want{400, env("missing or empty mm_items")}},
		{b.noParts, want{500, env("'num_parts'")}, want{400, env("num_parts must be a positive integer")}, want{400, env("num_parts must be a positive integer")}},
		{b.dictHashes, want{200, ""}, want{400, env("hashes must be list/scalar, got dict")}, want{400, env("hashes must be list/scalar, got dict")}},
	}
	servers := map[Generation]*Encoder{}
	for _, g := range []Generation{Gen0, GenNew, Gen1} {
		o := testOptions()
		o.Generation = g
		servers[g] = start(t, o)
	}
	for _, c := range cases {
		for g, w := range map[Generation]want{Gen0: c.gen0, GenNew: c.gnew, Gen1: c.g1} {
			r := post(t, servers[g], RouteEncode, c.body)
			if w.status == http.StatusOK {
				if r.status != http.StatusOK {
					t.Fatalf("%s %s: %d %s, want 200", g, c.body, r.status, r.body)
				}
				continue
			}
			if r.status != w.status || r.body != w.body {
				t.Fatalf("%s %s: %d %s, want %d %s", g, c.body, r.status, r.body, w.status, w.body)
			}
		}
	}
}

func TestGen1SendErrorsAreStarletteText(t *testing.T) {
	e := start(t, gen1Options(ModeMooncake))
	// Unknown req_id ("No embedding available…"/not staged): the 500 text.
	expectText500(t, post(t, e, RouteSend, sendBody("unknown", 7001, 1)))
	// A failed encode leaves nothing to send: the 500 text.
	post(t, e, RouteEncode, encodeBody("f", "fail:400:bad media"))
	expectText500(t, post(t, e, RouteSend, sendBody("f", 7001, 1)))
	// Refcount by raw /send calls: a duplicate releases the part early, and
	// a sibling rank then gets the 500 text (seed 002).
	post(t, e, RouteEncode, encodeBody("s"))
	expect(t, post(t, e, RouteSend, sendBody("s", 7001, 2)), http.StatusOK, "null")
	expect(t, post(t, e, RouteSend, sendBody("s", 7001, 2)), http.StatusOK, "null")
	expectText500(t, post(t, e, RouteSend, sendBody("s", 7002, 2)))
	// NEW, same sequence: the duplicate does not count, the sibling is served.
	n := start(t, testOptions())
	post(t, n, RouteEncode, encodeBody("s"))
	expect(t, post(t, n, RouteSend, sendBody("s", 7001, 2)), http.StatusOK, "null")
	expect(t, post(t, n, RouteSend, sendBody("s", 7001, 2)), http.StatusOK, "null")
	expect(t, post(t, n, RouteSend, sendBody("s", 7002, 2)), http.StatusOK, "null")
}

func TestBindFlagsGen1(t *testing.T) {
	var o Options
	fs := flag.NewFlagSet("fake-encoder", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o.BindFlags(fs)
	if err := fs.Parse([]string{"--generation=GEN1"}); err != nil || o.Generation != Gen1 {
		t.Fatalf("gen1: %+v %v", o, err)
	}
	if Gen1.String() != "gen1" {
		t.Fatalf("name %s", Gen1)
	}
	if e := New(Options{Generation: Gen1}); !e.opts.RefcountCalls {
		t.Fatal("Gen1 without RefcountCalls")
	}
}
