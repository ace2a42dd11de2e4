package gateway

import (
	"fmt"
	"testing"

	"github.com/encgate/encgate/fakeencoder"
)

func TestSendBodyBytesPassUnchanged(t *testing.T) {
	up := newScripted(t)
	// Odd spacing, key order and the largest uint64 must all survive.
	req := `{ "req_id" : "big_local_part_0","part_idx":0,"embedding_size":18446744073709551615,` +
		`"embedding_len":256,"embedding_dim":1024,"prefill_host":"10.1.2.3","embedding_port":45678,` +
		`"session_id":"10.1.2.3:17001","buffer_address":18446744073709551615,"receive_count":4,"x":1.50e+3 }`
	reply := `{"weird" : 18446744073709551615 , "b":null}`
	up.answer("/send", scriptedAnswer{200, ct("application/json"), reply})
	g := startGateway(t, []string{up.URL}, func(c *Config) { c.Affinity.UnknownWait = 0 })
	a := post(t, g.base+"/send", req)
	if a.status != 200 || a.body != reply {
		t.Fatalf("answer %d %q, want 200 %q", a.status, a.body, reply)
	}
	got := up.received("/send")
	if len(got) != 1 || got[0] != req {
		t.Fatalf("encoder received %q, want %q", got, req)
	}
	if h := up.headers["/send"].Get("Content-Type"); h != "application/json" {
		t.Errorf("forwarded Content-Type %q", h)
	}
}

func TestNullSuccessBodyStaysNull(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), nil)
	id := "null_local_part_0"
	if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 {
		t.Fatalf("encode %d %s", a.status, a.body)
	}
	a := post(t, g.base+"/send", sendBody(id, 40000))
	if a.status != 200 || a.body != "null" || a.header.Get("Content-Type") != "application/json" {
		t.Fatalf("send answer %d %q %q", a.status, a.body, a.header.Get("Content-Type"))
	}
}

// The encoder's answers in the protocol reference's table (§3) must reach
// the caller unchanged: status, content type (or none) and body.
func TestUpstreamErrorsPassThrough(t *testing.T) {
	env := func(msg, id string) string {
		return fmt.Sprintf(`{"status":"error","message":%q,"req_id":%q}`, msg, id)
	}
	js := ct("application/json")
	tests := []struct {
		name, path string
		a          scriptedAnswer
	}{
		{"validation 400", "/encode", scriptedAnswer{400, js, env("missing or invalid modality", "p")}},
		{"media 400", "/encode", scriptedAnswer{400, js, env("Error while loading data http://x/a.png: 404", "p")}},
		{"internal 500", "/encode", scriptedAnswer{500, js, env("Internal encoding error: CUDA OOM", "p")}},
		{"batch timeout 504", "/encode", scriptedAnswer{504, js, env("encoder batch timed out", "p")}},
		{"dp dead 503", "/encode", scriptedAnswer{503, js, env("All encoder DP workers are dead.", "p")}},
		{"fastapi 422", "/encode", scriptedAnswer{422, js, `{"detail":[{"type":"dict_type","loc":["body"],"msg":"Input should be a valid dictionary"}]}`}},
		{"metadata 504", "/scheduler_receive_meta_data", scriptedAnswer{504, js, env("encode metadata not ready", "p")}},
		{"metadata error 500", "/scheduler_receive_meta_data", scriptedAnswer{500, js, env("encode metadata missing", "p")}},
		{"dp unknown 404", "/scheduler_receive_meta_data", scriptedAnswer{404, js, env("Unknown req_id: p", "p")}},
		{"dp timeout 504", "/scheduler_receive_meta_data", scriptedAnswer{504, js, env("Encoder DP rank=1 wait_metadata timed out after 180.0s", "p")}},
		{"released 500", "/send", scriptedAnswer{500, js, env("no staged embedding for req_id=p (already released)", "p")}},
		{"no embedding 500", "/send", scriptedAnswer{500, js, env("No embedding available for Mooncake GPU-direct transfer: p", "p")}},
		{"request released 500", "/send", scriptedAnswer{500, js, env("Encoder request was released: p", "p")}},
		{"rdma 500", "/send", scriptedAnswer{500, js, env("Mooncake transfer_sync failed for p (session=10.0.0.1:17000, nbytes=1024, ret=-1)", "p")}},
		{"dp text send 500, no content type", "/send", scriptedAnswer{500, nil, "Encoder DP worker send error: no staged embedding for /send req_id=p (already released)"}},
		{"starlette keyerror 500", "/send", scriptedAnswer{500, ct("text/plain; charset=utf-8"), "Internal Server Error"}},
		{"inconsistent count 400", "/scheduler_receive_url", scriptedAnswer{400, js, env("Inconsistent receive_count for req_id=p: registered 2, got 4", "p")}},
		{"register timeout 504", "/scheduler_receive_url", scriptedAnswer{504, js, env("Timed out waiting for encoder request to start: p", "p")}},
		{"not active 400", "/scheduler_receive_url", scriptedAnswer{400, js, env("Encoder request is not active: p", "p")}},
		{"not ready 503", "/scheduler_receive_url", scriptedAnswer{503, js, env("encoder not ready", "p")}},
	}
	up := newScripted(t)
	g := startGateway(t, []string{up.URL}, func(c *Config) { c.Affinity.UnknownWait = 0 })
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			up.answer(tc.path, tc.a)
			id := fmt.Sprintf("p%d", i)
			body := map[string]string{"/encode": encodeBody(id), "/scheduler_receive_meta_data": metaBody(id),
				"/scheduler_receive_url": registerBody(id, "10.0.0.1:5000", 2), "/send": sendBody(id, 40000)}[tc.path]
			a := post(t, g.base+tc.path, body)
			if a.status != tc.a.status || a.body != tc.a.body {
				t.Fatalf("got %d %q, want %d %q", a.status, a.body, tc.a.status, tc.a.body)
			}
			wantCT := ""
			if tc.a.contentType != nil {
				wantCT = *tc.a.contentType
			}
			if got := a.header.Get("Content-Type"); got != wantCT {
				t.Fatalf("Content-Type %q, want %q", got, wantCT)
			}
		})
	}
}

// The same against the faithful fake: real encoder behaviour, not a script.
func TestFakeEncoderErrorsPassThrough(t *testing.T) {
	encs := startFakes(t, 1, func(_ int, o *fakeencoder.Options) {
		o.Faults.Leading504s = 1
	})
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Affinity.UnknownWait = 0
		c.Retry.Metadata.MaxAttempts = 1 // the encoder's 504 itself is what passes through
	})
	want := func(a answer, status int, body string) {
		t.Helper()
		if a.status != status || a.body != body {
			t.Fatalf("got %d %q, want %d %q", a.status, a.body, status, body)
		}
	}
	want(post(t, g.base+"/encode", `{"req_id":"v","mm_items":["x"],"num_parts":1,"part_idx":0}`),
		400, `{"status":"error","message":"missing or invalid modality","req_id":"v"}`)
	want(post(t, g.base+"/send", sendBody("ghost", 1)),
		500, `{"status":"error","message":"no staged embedding for req_id=ghost (already released)","req_id":"ghost"}`)
	if a := post(t, g.base+"/encode", encodeBody("m")); a.status != 200 {
		t.Fatalf("encode %d %s", a.status, a.body)
	}
	want(post(t, g.base+"/scheduler_receive_meta_data", metaBody("m")),
		504, `{"status":"error","message":"encode metadata not ready","req_id":"m"}`)
	if a := post(t, g.base+"/scheduler_receive_meta_data", metaBody("m")); a.status != 200 {
		t.Fatalf("second metadata pull %d %s", a.status, a.body)
	}
	reg := `{"req_id":"m","receive_count":2,"receive_url":"10.0.0.1:5000"}`
	want(post(t, g.base+"/scheduler_receive_url", reg), 200, "null")
	want(post(t, g.base+"/scheduler_receive_url", `{"req_id":"m","receive_count":4,"receive_url":"10.0.0.1:5001"}`),
		400, `{"status":"error","message":"Inconsistent receive_count for req_id=m: registered 2, got 4","req_id":"m"}`)
}
