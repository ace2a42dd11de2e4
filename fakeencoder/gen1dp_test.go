package fakeencoder

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// dpOptions are gen1Options in mooncake mode with DPSize 2 and a mapping
// wait short enough that a 404 comes fast.
func dpOptions() Options {
	o := gen1Options(ModeMooncake)
	o.DPSize = 2
	o.DPMappingWait = 50 * time.Millisecond
	return o
}

// expectBareText checks a plain-text answer sent with no Content-Type (a
// DP /send error, §3).
func expectBareText(t *testing.T, r reply, status int, body string) {
	t.Helper()
	expect(t, r, status, body)
	if r.ctype != "" {
		t.Fatalf("content type %q, want none", r.ctype)
	}
}

// unknownSend is the DP /send answer for a req_id with no mapping.
func unknownSend(id string) string { return "Encoder DP worker send error: Unknown req_id: " + id }

func TestGen1DPOptionsValidate(t *testing.T) {
	for _, c := range []struct {
		o    Options
		want string
	}{
		{Options{DPSize: 2}, "DPSize (--dp-size) 2 needs Generation gen1"},
		{Options{DPSize: 2, Generation: Gen0}, "got gen0"},
		{Options{DPSize: -1, Generation: Gen1}, "must be >= 1"},
		{Options{Generation: Gen1, DPMappingRace: true}, "DPMappingRace (--dp-mapping-race) needs DPSize"},
	} {
		e := New(c.o)
		err := e.Start("127.0.0.1:0")
		_ = e.Close()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Fatalf("%+v: %v, want an error with %q", c.o, err, c.want)
		}
	}
	e := start(t, dpOptions()) // Gen1 with DPSize 2 is fine
	if e.opts.DPMappingWait != 50*time.Millisecond || !e.dp() {
		t.Fatalf("opts %+v", e.opts)
	}
	var o Options
	fs := flag.NewFlagSet("fake-encoder", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o.BindFlags(fs)
	if o.DPSize != 1 || o.DPMappingWait != DefaultDPMappingWait {
		t.Fatalf("flag defaults %d %s", o.DPSize, o.DPMappingWait)
	}
	if err := fs.Parse([]string{"--generation=gen1", "--dp-size=4", "--dp-mapping-race", "--dp-mapping-wait=1s"}); err != nil {
		t.Fatal(err)
	}
	if o.DPSize != 4 || !o.DPMappingRace || o.DPMappingWait != time.Second || o.Validate() != nil {
		t.Fatalf("flags %+v", o)
	}
}

func TestGen1DPUnknownReqID(t *testing.T) {
	e := start(t, dpOptions())
	expectErr(t, post(t, e, RouteMetadata, metaBody("x")), http.StatusNotFound, "Unknown req_id: x", "x")
	expectErr(t, post(t, e, RouteRegister, registerBody("x", 1, "tcp://10.0.0.1:9000")), http.StatusNotFound, "Unknown req_id: x", "x")
	expectBareText(t, post(t, e, RouteSend, sendBody("x", 7001, 1)), http.StatusInternalServerError, unknownSend("x"))
	// Non-DP GEN1, the same /send: starlette's text; the pull waits for
	// metadata instead of a mapping (504 after MetadataTimeout).
	o := gen1Options(ModeMooncake)
	o.MetadataTimeout = 50 * time.Millisecond
	n := start(t, o)
	expectText500(t, post(t, n, RouteSend, sendBody("x", 7001, 1)))
	expectErr(t, post(t, n, RouteMetadata, metaBody("x")), http.StatusGatewayTimeout, "encode metadata not ready", "x")
}

func TestGen1DPMappingWaitCappedByMetadataTimeout(t *testing.T) {
	o := dpOptions()
	o.DPMappingWait = time.Hour
	o.MetadataTimeout = 50 * time.Millisecond
	e := start(t, o)
	expectErr(t, post(t, e, RouteMetadata, metaBody("x")), http.StatusNotFound, "Unknown req_id: x", "x")
}

func TestGen1DPMetadataTimeout(t *testing.T) {
	o := dpOptions()
	o.MetadataTimeout = 100 * time.Millisecond
	o.Faults.MetadataDelay = time.Hour // metadata is never published
	e := start(t, o)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for rank, id := range []string{"a", "b"} { // round robin: a on rank 0, b on rank 1
		enc := doAsync(ctx, e, http.MethodPost, RouteEncode, encodeBody(id))
		waitWaiting(t, e, RouteEncode, rank+1)
		expectErr(t, post(t, e, RouteMetadata, metaBody(id)), http.StatusGatewayTimeout,
			fmt.Sprintf("Encoder DP rank=%d metadata wait timed out after 0.1s", rank), id)
		pending(t, enc, "/encode")
	}
	cancel()
	if got := pySeconds(DefaultTimeout); got != "180.0" {
		t.Fatalf("pySeconds(180s) = %s", got)
	}
}

func TestGen1DPFailedEncodeDropsMapping(t *testing.T) {
	e := start(t, dpOptions())
	expectErr(t, post(t, e, RouteEncode, encodeBody("f", "fail:400:bad media")), http.StatusBadRequest, "bad media", "f")
	expectErr(t, post(t, e, RouteMetadata, metaBody("f")), http.StatusNotFound, "Unknown req_id: f", "f")
	expectErr(t, post(t, e, RouteRegister, registerBody("f", 1, "tcp://10.0.0.1:9000")), http.StatusNotFound, "Unknown req_id: f", "f")
	expectBareText(t, post(t, e, RouteSend, sendBody("f", 7001, 1)), http.StatusInternalServerError, unknownSend("f"))
	// Non-DP GEN1 keeps the error metadata (§5): the pull fails with it.
	n := start(t, gen1Options(ModeMooncake))
	post(t, n, RouteEncode, encodeBody("f", "fail:400:bad media"))
	expectErr(t, post(t, n, RouteMetadata, metaBody("f")), http.StatusInternalServerError, "bad media", "f")
}

func TestGen1DPPullAndRegisterBeforeEncode(t *testing.T) {
	o := dpOptions()
	o.DPMappingWait = 5 * time.Second
	e := start(t, o)
	pull := postAsync(e, RouteMetadata, metaBody("p"))
	reg := postAsync(e, RouteRegister, registerBody("p", 1, "tcp://10.0.0.1:9000"))
	waitWaiting(t, e, RouteMetadata, 1)
	waitWaiting(t, e, RouteRegister, 1)
	if r := post(t, e, RouteEncode, encodeBody("p")); r.status != http.StatusOK {
		t.Fatalf("encode: %d %s", r.status, r.body)
	}
	expect(t, recv(t, pull), http.StatusOK, `{"req_id":"p","part_idx":0,"embedding_size":524288,"embedding_len":256,"embedding_dim":1024}`)
	expect(t, recv(t, reg), http.StatusOK, "null")
}

func TestGen1DPSendErrors(t *testing.T) {
	e := start(t, dpOptions())
	post(t, e, RouteEncode, encodeBody("s"))
	expect(t, post(t, e, RouteSend, sendBody("s", 7001, 2)), http.StatusOK, "null")
	expect(t, post(t, e, RouteSend, sendBody("s", 7001, 2)), http.StatusOK, "null") // raw calls: released early
	// The mapping outlives the release: the sibling routes, and the worker
	// has nothing staged.
	expectBareText(t, post(t, e, RouteSend, sendBody("s", 7002, 2)), http.StatusInternalServerError,
		"Encoder DP worker send error: no staged embedding for /send req_id=s (already released)")
	post(t, e, RouteEncode, encodeBody("k"))
	expectBareText(t, post(t, e, RouteSend, `{"req_id":"k","part_idx":0}`), http.StatusInternalServerError,
		"Encoder DP worker send error: 'prefill_host'")
}

// raceSequence runs §12's race: rank A's /send (port 7001) held in flight by
// SendHook while rank B's metadata pull completes; then A is let go and B
// sends. It returns A's and B's /send replies.
func raceSequence(t *testing.T, race bool) (a, b reply) {
	held, release := make(chan struct{}), make(chan struct{})
	o := dpOptions()
	o.DPMappingRace = race
	o.MetadataTimeout = 200 * time.Millisecond
	o.SendHook = func(ctx context.Context, id, dest string) {
		if dest != "10.0.0.1:7001" {
			return
		}
		close(held)
		select {
		case <-release:
		case <-ctx.Done():
		}
	}
	e := start(t, o)
	if r := post(t, e, RouteEncode, encodeBody("r")); r.status != http.StatusOK {
		t.Fatalf("encode: %d %s", r.status, r.body)
	}
	sendA := postAsync(e, RouteSend, sendBody("r", 7001, 2))
	<-held
	expect(t, post(t, e, RouteMetadata, metaBody("r")), http.StatusOK,
		`{"req_id":"r","part_idx":0,"embedding_size":524288,"embedding_len":256,"embedding_dim":1024}`)
	close(release)
	a = recv(t, sendA)
	b = post(t, e, RouteSend, sendBody("r", 7002, 2))
	return a, b
}

func TestGen1DPMappingRace(t *testing.T) {
	a, b := raceSequence(t, true)
	expectBareText(t, a, http.StatusGatewayTimeout, "Encoder DP worker send error: Encoder DP rank=0 /send timed out after 0.2s")
	expectBareText(t, b, http.StatusInternalServerError, unknownSend("r"))
	// Without DPMappingRace the same sequence succeeds.
	a, b = raceSequence(t, false)
	expect(t, a, http.StatusOK, "null")
	expect(t, b, http.StatusOK, "null")
}
