package fakeencoder

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// alreadyReleased is the /send message for a req_id with no state.
func alreadyReleased(id string) string {
	return "no staged embedding for req_id=" + id + " (already released)"
}

func TestSendBeforeEncode(t *testing.T) {
	e := start(t, testOptions())
	expectErr(t, post(t, e, RouteSend, sendBody("early", 7001, 1)), http.StatusInternalServerError, alreadyReleased("early"), "early")
}

func TestSendRefcountTP4(t *testing.T) {
	e := start(t, testOptions())
	post(t, e, RouteEncode, encodeBody("tp4"))
	for _, port := range []int{7001, 7002, 7003} {
		expect(t, post(t, e, RouteSend, sendBody("tp4", port, 4)), http.StatusOK, "null")
	}
	// A repeated destination does not advance the NEW refcount.
	expect(t, post(t, e, RouteSend, sendBody("tp4", 7001, 4)), http.StatusOK, "null")
	if s := e.Stats(); s.Staged != 1 {
		t.Fatalf("released after 3 distinct destinations (staged %d)", s.Staged)
	}
	expect(t, post(t, e, RouteSend, sendBody("tp4", 7004, 4)), http.StatusOK, "null")
	if s := e.Stats(); s.Staged != 0 {
		t.Fatalf("not released after 4 destinations (staged %d)", s.Staged)
	}
	expectErr(t, post(t, e, RouteSend, sendBody("tp4", 7005, 4)), http.StatusInternalServerError, alreadyReleased("tp4"), "tp4")
	s := e.Stats()
	if s.Sends["tp4|10.0.0.1:7001"] != 2 || s.Sends["tp4|10.0.0.1:7004"] != 1 || s.Sends["tp4|10.0.0.1:7005"] != 1 {
		t.Fatalf("sends %v", s.Sends)
	}
	if s.ReqIDs["tp4"][RouteSend] != 6 || s.ReqIDs["tp4"][RouteEncode] != 1 {
		t.Fatalf("req_ids %v", s.ReqIDs)
	}
}

func TestRefcountCallsOld(t *testing.T) {
	opts := testOptions()
	opts.RefcountCalls = true
	e := start(t, opts)
	post(t, e, RouteEncode, encodeBody("old"))
	expect(t, post(t, e, RouteSend, sendBody("old", 7001, 2)), http.StatusOK, "null")
	expect(t, post(t, e, RouteSend, sendBody("old", 7001, 2)), http.StatusOK, "null") // a retry counts
	expectErr(t, post(t, e, RouteSend, sendBody("old", 7002, 2)), http.StatusInternalServerError, alreadyReleased("old"), "old")
}

func TestSendWithoutCountLeftToSweep(t *testing.T) {
	opts := testOptions()
	opts.SweepAfter = 40 * time.Millisecond
	e := start(t, opts)
	post(t, e, RouteEncode, encodeBody("nc"))
	for i := 0; i < 3; i++ {
		expect(t, post(t, e, RouteSend, sendBody("nc", 7001+i, -1)), http.StatusOK, "null")
	}
	expect(t, post(t, e, RouteSend, sendBody("nc", 7009, 0)), http.StatusOK, "null")
	waitFor(t, "the sweep", func() bool { return e.Stats().Staged == 0 })
	expectErr(t, post(t, e, RouteSend, sendBody("nc", 7001, 1)), http.StatusInternalServerError, alreadyReleased("nc"), "nc")
}

func TestSendMissingFieldReleases(t *testing.T) {
	e := start(t, testOptions())
	post(t, e, RouteEncode, encodeBody("mf"))
	body := strings.Replace(sendBody("mf", 7001, 2), `"session_id":"10.0.0.1:17000",`, "", 1)
	expectErr(t, post(t, e, RouteSend, body), http.StatusInternalServerError, "'session_id'", "mf")
	expectErr(t, post(t, e, RouteSend, sendBody("mf", 7002, 2)), http.StatusInternalServerError, alreadyReleased("mf"), "mf")

	r := post(t, e, RouteSend, `{"prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1}`)
	if r.status != http.StatusInternalServerError || r.body != "Internal Server Error" || !strings.HasPrefix(r.ctype, "text/plain") {
		t.Fatalf("missing req_id: %d %q %q", r.status, r.ctype, r.body)
	}
}

func TestPreprocessFailure(t *testing.T) {
	e := start(t, testOptions())
	const msg = "Failed to process mm items: cannot identify image file"
	expectErr(t, post(t, e, RouteEncode, encodeBody("pf", "fail:400:"+msg)), http.StatusBadRequest, msg, "pf")
	// The error metadata is preserved (until the sweep); the state is released.
	expectErr(t, post(t, e, RouteMetadata, metaBody("pf")), http.StatusInternalServerError, msg, "pf")
	expectErr(t, post(t, e, RouteSend, sendBody("pf", 7001, 1)), http.StatusInternalServerError, alreadyReleased("pf"), "pf")
	if s := e.Stats(); s.Staged != 0 {
		t.Fatalf("staged %d", s.Staged)
	}
}

func TestForwardFailureFailsWaitingSend(t *testing.T) {
	opts := testOptions()
	hold := make(chan struct{})
	opts.EncodeHook = func(ctx context.Context, _ string) {
		select {
		case <-hold:
		case <-ctx.Done():
		}
	}
	e := start(t, opts)
	const msg = "Internal encoding error: CUDA out of memory"
	enc := postAsync(e, RouteEncode, encodeBody("ff", "fail-encode:500:"+msg))
	// Metadata is published before the forward, so the receiver allocates.
	if r := post(t, e, RouteMetadata, metaBody("ff")); r.status != http.StatusOK {
		t.Fatalf("metadata %d %s", r.status, r.body)
	}
	send := postAsync(e, RouteSend, sendBody("ff", 7001, 1))
	waitWaiting(t, e, RouteSend, 1)
	close(hold)
	expectErr(t, recv(t, enc), http.StatusInternalServerError, msg, "ff")
	expectErr(t, recv(t, send), http.StatusInternalServerError, "No embedding available for Mooncake GPU-direct transfer: ff", "ff")
	expectErr(t, post(t, e, RouteMetadata, metaBody("ff")), http.StatusInternalServerError, msg, "ff")
	expectErr(t, post(t, e, RouteSend, sendBody("ff", 7002, 1)), http.StatusInternalServerError, alreadyReleased("ff"), "ff")
}

func TestSendAfterReleaseRequested(t *testing.T) {
	opts := testOptions()
	hold := make(chan struct{})
	opts.EncodeHook = func(ctx context.Context, _ string) {
		select {
		case <-hold:
		case <-ctx.Done():
		}
	}
	e := start(t, opts)
	enc := postAsync(e, RouteEncode, encodeBody("rr"))
	waitFor(t, "metadata", func() bool { return post(t, e, RouteMetadata, metaBody("rr")).status == http.StatusOK })
	// A malformed /send releases the request; the release waits for the
	// active encode, and meanwhile sends see "was released".
	expectErr(t, post(t, e, RouteSend, `{"req_id":"rr"}`), http.StatusInternalServerError, "'prefill_host'", "rr")
	expectErr(t, post(t, e, RouteSend, sendBody("rr", 7001, 1)), http.StatusInternalServerError, "Encoder request was released: rr", "rr")
	close(hold)
	if r := recv(t, enc); r.status != http.StatusOK {
		t.Fatalf("encode %d %s", r.status, r.body)
	}
	waitFor(t, "release", func() bool { return e.Stats().Staged == 0 })
}

func TestRegisterSemantics(t *testing.T) {
	opts := testOptions()
	opts.Mode = ModeZMQ
	opts.RegisterTimeout = 30 * time.Millisecond
	e := start(t, opts)
	expectErr(t, post(t, e, RouteRegister, registerBody("none", 2, "h:1")), http.StatusGatewayTimeout,
		"Timed out waiting for encoder request to start: none", "none")

	e2 := start(t, func() Options { o := opts; o.RegisterTimeout = 5 * time.Second; return o }())
	early := postAsync(e2, RouteRegister, registerBody("z1", 2, "10.0.0.2:5001"))
	waitWaiting(t, e2, RouteRegister, 1)
	enc := postAsync(e2, RouteEncode, encodeBody("z1"))
	expect(t, recv(t, early), http.StatusOK, "null")
	waitWaiting(t, e2, RouteEncode, 1)
	expect(t, post(t, e2, RouteRegister, registerBody("z1", 2, "10.0.0.2:5001")), http.StatusOK, "null") // set semantics
	expectErr(t, post(t, e2, RouteRegister, registerBody("z1", 3, "10.0.0.2:5002")), http.StatusBadRequest,
		"Inconsistent receive_count for req_id=z1: registered 2, got 3", "z1")
	pending(t, enc, "zmq /encode with 1 of 2 registrations")
	expect(t, post(t, e2, RouteRegister, registerBody("z1", 2, "10.0.0.2:5002")), http.StatusOK, "null")
	expect(t, recv(t, enc), http.StatusOK, "null")
	if s := e2.Stats(); s.Staged != 0 {
		t.Fatalf("zmq request not released (staged %d)", s.Staged)
	}
}

func TestRegisterNotActive(t *testing.T) {
	opts := testOptions()
	opts.Mode = ModeZMQ
	hold := make(chan struct{})
	opts.EncodeHook = func(ctx context.Context, _ string) {
		select {
		case <-hold:
		case <-ctx.Done():
		}
	}
	e := start(t, opts)
	enc := postAsync(e, RouteEncode, encodeBody("na"))
	waitFor(t, "state", func() bool { return e.Stats().Staged == 1 })
	post(t, e, RouteSend, `{"req_id":"na"}`) // releases; deferred while encoding
	expectErr(t, post(t, e, RouteRegister, registerBody("na", 1, "h:1")), http.StatusBadRequest, "Encoder request is not active: na", "na")
	close(hold)
	expect(t, recv(t, enc), http.StatusOK, "null")
}

func TestZMQEncode(t *testing.T) {
	opts := testOptions()
	opts.Mode = ModeZMQ
	opts.SendTimeout = 30 * time.Millisecond
	e := start(t, opts)
	// embedding_port set: delivered at once.
	body := strings.Replace(encodeBody("zp"), `"embedding_port":null`, `"embedding_port":6001`, 1)
	expect(t, post(t, e, RouteEncode, body), http.StatusOK, "null")
	// No registrations: SendTimeout passes, still 200 null, released.
	expect(t, post(t, e, RouteEncode, encodeBody("zt")), http.StatusOK, "null")
	if s := e.Stats(); s.Staged != 0 {
		t.Fatalf("staged %d", s.Staged)
	}
}

func TestZMQFailureKeepsStateForRegistrations(t *testing.T) {
	opts := testOptions()
	opts.Mode = ModeZMQ
	e := start(t, opts)
	expectErr(t, post(t, e, RouteEncode, encodeBody("zf", "fail:400:bad media")), http.StatusBadRequest, "bad media", "zf")
	// send_with_url still pushes the error to the receivers, so their
	// registrations succeed until receive_count is reached.
	expect(t, post(t, e, RouteRegister, registerBody("zf", 2, "h:1")), http.StatusOK, "null")
	if s := e.Stats(); s.Staged != 1 {
		t.Fatalf("staged %d, want 1", s.Staged)
	}
	expect(t, post(t, e, RouteRegister, registerBody("zf", 2, "h:2")), http.StatusOK, "null")
	waitFor(t, "release", func() bool { return e.Stats().Staged == 0 })
}

func TestEncodeCancelledReleases(t *testing.T) {
	opts := testOptions()
	opts.Faults.MetadataDelay = time.Hour
	e := start(t, opts)
	ctx, cancel := context.WithCancel(context.Background())
	enc := doAsync(ctx, e, http.MethodPost, RouteEncode, encodeBody("cx"))
	waitWaiting(t, e, RouteEncode, 1)
	if s := e.Stats(); s.Staged != 1 {
		t.Fatalf("staged %d, want 1", s.Staged)
	}
	cancel()
	recv(t, enc)
	waitFor(t, "release", func() bool { return e.Stats().Staged == 0 })
}

func TestHandlerWithoutStart(t *testing.T) {
	e := New(testOptions())
	srv := httptest.NewServer(e.Handler())
	defer srv.Close()
	defer e.Close()
	resp, err := client.Post(srv.URL+RouteEncode, "application/json", strings.NewReader(encodeBody("hs")))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || e.Stats().Staged != 1 {
		t.Fatalf("status %d, staged %d", resp.StatusCode, e.Stats().Staged)
	}
}
