package fakeencoder

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// gen0Options are testOptions for GEN0 in mode.
func gen0Options(mode Mode) Options {
	o := testOptions()
	o.Generation = Gen0
	o.Mode = mode
	return o
}

// rankEncodeBody is the /encode body a GEN0 receiver TP rank posts in
// mooncake mode: its own embedding_port, and receive_count = TP size.
func rankEncodeBody(id string, port, tp int, items ...string) string {
	if len(items) == 0 {
		items = []string{"data:image/png;base64,AAAA"}
	}
	b, _ := json.Marshal(items)
	return fmt.Sprintf(`{"encoder_idx":0,"mm_items":%s,"num_parts":1,"part_idx":0,"req_id":%q,"modality":"IMAGE",`+
		`"prefill_host":"10.0.0.1","embedding_port":%d,"receive_count":%d}`, b, id, port, tp)
}

// heldHook is an EncodeHook that counts its calls, reports each entry on
// entered and blocks until release is closed.
type heldHook struct {
	calls   atomic.Int32
	entered chan string
	release chan struct{}
}

func newHeldHook() *heldHook {
	return &heldHook{entered: make(chan string, 16), release: make(chan struct{})}
}

func (h *heldHook) hook(ctx context.Context, id string) {
	h.calls.Add(1)
	h.entered <- id
	select {
	case <-h.release:
	case <-ctx.Done():
	}
}

// waitEntered waits until the hook was entered.
func (h *heldHook) waitEntered(t *testing.T) {
	t.Helper()
	select {
	case <-h.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the encode hook was not entered within 10s")
	}
}

// expectText checks a starlette 500 text answer.
func expectText500(t *testing.T, r reply) {
	t.Helper()
	expect(t, r, http.StatusInternalServerError, "Internal Server Error")
	if !strings.HasPrefix(r.ctype, "text/plain") {
		t.Fatalf("content type %q, want text/plain", r.ctype)
	}
}

func TestGen0RanksEncodeOnce(t *testing.T) {
	opts := gen0Options(ModeMooncake)
	h := newHeldHook()
	opts.EncodeHook = h.hook
	e := start(t, opts)

	const tp = 6
	replies := []<-chan reply{postAsync(e, RouteEncode, rankEncodeBody("g0", 7000, tp))}
	h.waitEntered(t) // the first call is encoding
	for i := 1; i < tp; i++ {
		replies = append(replies, postAsync(e, RouteEncode, rankEncodeBody("g0", 7000+i, tp)))
	}
	waitWaiting(t, e, RouteEncode, tp-1)
	close(h.release)
	for i, ch := range replies {
		r := recv(t, ch)
		if r.status != http.StatusOK || r.ctype != "application/json" {
			t.Fatalf("rank %d: %d %q %s", i, r.status, r.ctype, r.body)
		}
		var got map[string]any
		if err := json.Unmarshal([]byte(r.body), &got); err != nil {
			t.Fatalf("rank %d: %v in %s", i, err, r.body)
		}
		if got["embedding_size"] != 524288.0 || got["embedding_len"] != 256.0 || got["embedding_dim"] != 1024.0 {
			t.Fatalf("rank %d sizes: %s", i, r.body)
		}
		if got["embedding_port"] != float64(7000+i) || got["receive_count"] != float64(tp) {
			t.Fatalf("rank %d did not get its own request echoed: %s", i, r.body)
		}
		if _, ok := got["mm_items"]; ok {
			t.Fatalf("rank %d: mm_items echoed: %s", i, r.body)
		}
		if _, ok := got["enter_time"]; ok != (i == 0) {
			t.Fatalf("rank %d: enter_time present %v (only the first call sets it): %s", i, ok, r.body)
		}
	}
	if n := h.calls.Load(); n != 1 {
		t.Fatalf("%d encodes, want 1", n)
	}
	want := `{"encoder_idx":0,"num_parts":1,"part_idx":0,"req_id":"g0","modality":"IMAGE","prefill_host":"10.0.0.1",` +
		`"embedding_port":7100,"receive_count":6,"embedding_size":524288,"embedding_len":256,"embedding_dim":1024}`
	// The metadata is kept for later callers until the request is released.
	expect(t, post(t, e, RouteEncode, rankEncodeBody("g0", 7100, tp)), http.StatusOK, want)
	if n := h.calls.Load(); n != 1 {
		t.Fatalf("a later rank encoded again (%d encodes)", n)
	}
	// GEN0 counts raw /send calls against receive_count.
	for i := 0; i < tp; i++ {
		expect(t, post(t, e, RouteSend, sendBody("g0", 7000, tp)), http.StatusOK, "null")
	}
	if s := e.Stats(); s.Staged != 0 {
		t.Fatalf("not released after %d /send calls (staged %d)", tp, s.Staged)
	}
	expectText500(t, post(t, e, RouteSend, sendBody("g0", 7000, tp)))
	// Released: the next /encode encodes anew.
	enc := postAsync(e, RouteEncode, rankEncodeBody("g0", 7000, tp))
	h.waitEntered(t)
	if r := recv(t, enc); r.status != http.StatusOK {
		t.Fatalf("encode after release: %d %s", r.status, r.body)
	}
	if n := h.calls.Load(); n != 2 {
		t.Fatalf("%d encodes, want 2", n)
	}
}

func TestGen0FirstEncodeFails(t *testing.T) {
	opts := gen0Options(ModeMooncake)
	h := newHeldHook()
	opts.EncodeHook = h.hook
	e := start(t, opts)

	const msg = "Failed to process mm items: cannot identify image file"
	first := postAsync(e, RouteEncode, rankEncodeBody("gf", 7000, 4, "fail-encode:400:"+msg))
	h.waitEntered(t)
	var siblings []<-chan reply
	for i := 1; i < 4; i++ {
		siblings = append(siblings, postAsync(e, RouteEncode, rankEncodeBody("gf", 7000+i, 4)))
	}
	waitWaiting(t, e, RouteEncode, 3)
	close(h.release)
	expectErr(t, recv(t, first), http.StatusBadRequest, msg, "gf")
	for _, ch := range siblings {
		expectErr(t, recv(t, ch), http.StatusInternalServerError, Gen0DuplicateFailed, "gf")
	}
	// The failed record was dropped: a later call encodes anew.
	if r := post(t, e, RouteEncode, rankEncodeBody("gf", 7000, 4)); r.status != http.StatusOK {
		t.Fatalf("encode after a failed first: %d %s", r.status, r.body)
	}
	h.waitEntered(t)
	if n := h.calls.Load(); n != 2 {
		t.Fatalf("%d encodes, want 2", n)
	}

	// A preprocessing failure ("fail:") goes the same way.
	expectErr(t, post(t, e, RouteEncode, rankEncodeBody("gp", 7000, 2, "fail:400:"+msg)), http.StatusBadRequest, msg, "gp")
	if r := post(t, e, RouteEncode, rankEncodeBody("gp", 7001, 2)); r.status != http.StatusOK {
		t.Fatalf("encode after a failed first: %d %s", r.status, r.body)
	}
	h.waitEntered(t)
	if n := h.calls.Load(); n != 3 {
		t.Fatalf("%d encodes, want 3", n)
	}
}

func TestGen0EncodeValidatesNothing(t *testing.T) {
	for _, mode := range []Mode{ModeMooncake, ModeZMQ} {
		t.Run(string(mode), func(t *testing.T) {
			opts := gen0Options(mode)
			opts.SendTimeout = 1 // no registrations come: do not wait for them
			e := start(t, opts)
			expectText500(t, post(t, e, RouteEncode, `{"mm_items":["x"],"modality":"IMAGE","num_parts":1,"part_idx":0}`))
			const tail = `"prefill_host":"h","embedding_port":null}`
			cases := []struct{ body, msg string }{
				{`{"req_id":"a","mm_items":["x"],"num_parts":1,"part_idx":0,` + tail, "'modality'"},
				{`{"req_id":"a","mm_items":["x"],"modality":"TEXT","num_parts":1,"part_idx":0,` + tail,
					"Invalid modality string: TEXT. Valid modalities are: ['IMAGE', 'VIDEO', 'AUDIO']"},
				{`{"req_id":"a","mm_items":["x"],"modality":1,"num_parts":1,"part_idx":0,` + tail, "'int' object has no attribute 'upper'"},
				{`{"req_id":"a","modality":"IMAGE","num_parts":1,"part_idx":0,` + tail, "'mm_items'"},
				{`{"req_id":"a","mm_items":["x"],"modality":"IMAGE","part_idx":0,` + tail, "'num_parts'"},
				{`{"req_id":"a","mm_items":["x"],"modality":"IMAGE","num_parts":1,` + tail, "'part_idx'"},
			}
			for _, c := range cases {
				expectErr(t, post(t, e, RouteEncode, c.body), http.StatusInternalServerError, c.msg, "a")
			}
			// What NEW rejects with 400 is encoded.
			for _, body := range []string{
				`{"req_id":7,"mm_items":["x"],"modality":"image","num_parts":0,"part_idx":5,` + tail,
				`{"req_id":"","mm_items":["x"],"modality":"AUDIO","num_parts":1,"part_idx":0,"hashes":{},` + tail,
			} {
				if r := post(t, e, RouteEncode, body); r.status != http.StatusOK {
					t.Fatalf("%s: %d %s", body, r.status, r.body)
				}
			}
		})
	}
	e := start(t, gen0Options(ModeZMQ))
	expectErr(t, post(t, e, RouteEncode, `{"req_id":"z","mm_items":["x"],"modality":"IMAGE","num_parts":1,"part_idx":0}`),
		http.StatusInternalServerError, "'embedding_port'", "z")
}

func TestGen0Send(t *testing.T) {
	e := start(t, gen0Options(ModeMooncake))
	expectText500(t, post(t, e, RouteSend, sendBody("unknown", 7001, 1)))
	expectText500(t, post(t, e, RouteSend, `{"prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1}`))

	post(t, e, RouteEncode, rankEncodeBody("s0", 7001, 2))
	for _, field := range []string{`"prefill_host":"10.0.0.1",`, `"embedding_port":7001,`, `"session_id":"10.0.0.1:17000",`, `,"buffer_address":140737488355328`} {
		expectText500(t, post(t, e, RouteSend, strings.Replace(sendBody("s0", 7001, 2), field, "", 1)))
	}
	// A missing field is a KeyError before anything is touched: no release,
	// and it counts nothing.
	expect(t, post(t, e, RouteSend, sendBody("s0", 7001, 2)), http.StatusOK, "null")
	expect(t, post(t, e, RouteSend, sendBody("s0", 7001, 2)), http.StatusOK, "null") // raw calls: a repeat counts
	expectText500(t, post(t, e, RouteSend, sendBody("s0", 7002, 2)))
	// A failed encode leaves nothing to send.
	post(t, e, RouteEncode, rankEncodeBody("s1", 7001, 1, "fail:400:bad media"))
	expectText500(t, post(t, e, RouteSend, sendBody("s1", 7001, 1)))
}

func TestGen0EarlyRegistrationIsStored(t *testing.T) {
	e := start(t, gen0Options(ModeZMQ))
	expect(t, post(t, e, RouteRegister, registerBody("r0", 1, "10.0.0.2:5001")), http.StatusOK, "null")
	if s := e.Stats(); s.Staged != 0 || s.Registrations["r0|10.0.0.2:5001"] != 1 || len(s.Waiting) != 0 {
		t.Fatalf("early registration: %+v", s)
	}
	expect(t, post(t, e, RouteEncode, encodeBody("r0")), http.StatusOK, "null")
	if s := e.Stats(); s.Staged != 0 {
		t.Fatalf("zmq request not released (staged %d)", s.Staged)
	}

	// A registration after its /encode started wakes it, as in NEW.
	enc := postAsync(e, RouteEncode, encodeBody("r1"))
	waitWaiting(t, e, RouteEncode, 1)
	expect(t, post(t, e, RouteRegister, registerBody("r1", 2, "10.0.0.2:5001")), http.StatusOK, "null")
	expect(t, post(t, e, RouteRegister, registerBody("r1", 2, "10.0.0.2:5001")), http.StatusOK, "null") // set semantics
	expectText500(t, post(t, e, RouteRegister, registerBody("r1", 3, "10.0.0.2:5002")))                 // assert
	pending(t, enc, "zmq /encode with 1 of 2 registrations")
	expect(t, post(t, e, RouteRegister, registerBody("r1", 2, "10.0.0.2:5002")), http.StatusOK, "null")
	expect(t, recv(t, enc), http.StatusOK, "null")

	expectText500(t, post(t, e, RouteRegister, `{"receive_count":1,"receive_url":"h:1"}`))
	expectText500(t, post(t, e, RouteRegister, `{"req_id":"r2","receive_url":"h:1"}`))
	expectText500(t, post(t, e, RouteRegister, `{"req_id":"r2","receive_count":1}`))
	s := e.Stats()
	want := map[string]int64{"r0|10.0.0.2:5001": 1, "r1|10.0.0.2:5001": 2, "r1|10.0.0.2:5002": 2, "r2|h:1": 1}
	if fmt.Sprint(s.Registrations) != fmt.Sprint(want) {
		t.Fatalf("registrations %v, want %v", s.Registrations, want)
	}
}

func TestGen0HasNoMetadataRoute(t *testing.T) {
	opts := gen0Options(ModeMooncake)
	opts.Faults.FailureRate = 1 // the default fail routes do not include it in GEN0
	e := start(t, opts)
	expect(t, post(t, e, RouteMetadata, metaBody("m")), http.StatusNotFound, `{"detail":"Not Found"}`)
	expect(t, get(t, e, RouteMetadata), http.StatusNotFound, `{"detail":"Not Found"}`)
	if s := e.Stats(); s.Routes[RouteMetadata] != 2 || len(s.ReqIDs) != 0 {
		t.Fatalf("stats %+v", s)
	}
}

func TestBindFlagsGeneration(t *testing.T) {
	parse := func(args ...string) (Options, error) {
		var o Options
		fs := flag.NewFlagSet("fake-encoder", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		o.BindFlags(fs)
		return o, fs.Parse(args)
	}
	o, err := parse()
	if err != nil || o.Generation != GenNew || o.PushFrames || o.RefcountCalls {
		t.Fatalf("defaults: %+v %v", o, err)
	}
	o, err = parse("--generation=gen0", "--push-frames", "--mode=zmq")
	if err != nil || o.Generation != Gen0 || !o.PushFrames || o.Mode != ModeZMQ {
		t.Fatalf("gen0: %+v %v", o, err)
	}
	if o, err = parse("--generation=NEW"); err != nil || o.Generation != GenNew {
		t.Fatalf("new: %+v %v", o, err)
	}
	if _, err := parse("--generation=old"); err == nil {
		t.Fatal("--generation=old accepted")
	}
	if Gen0.String() != "gen0" || GenNew.String() != "new" {
		t.Fatalf("names %s %s", Gen0, GenNew)
	}
	// Gen0 implies RefcountCalls.
	if e := New(Options{Generation: Gen0}); !e.opts.RefcountCalls {
		t.Fatal("Gen0 without RefcountCalls")
	}
}
