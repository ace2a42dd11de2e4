package fakeencoder

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// client never keeps connections alive, so no client goroutine outlives a
// test and a refused listener is really refused.
var client = &http.Client{
	Timeout:   10 * time.Second,
	Transport: &http.Transport{DisableKeepAlives: true},
}

// testOptions are Options with waits short enough that a broken test fails
// fast rather than hanging for sglang's 180 s.
func testOptions() Options {
	return Options{
		MetadataTimeout: 5 * time.Second,
		RegisterTimeout: 5 * time.Second,
		SendTimeout:     5 * time.Second,
		SweepAfter:      time.Minute,
	}
}

// start starts an encoder on a real loopback socket, closed at test end.
func start(t *testing.T, opts Options) *Encoder {
	t.Helper()
	e := New(opts)
	if err := e.Start("127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	return e
}

// reply is a received response.
type reply struct {
	status int
	ctype  string
	body   string
	err    error
}

// do sends one request.
func do(ctx context.Context, e *Encoder, method, route, body string) reply {
	req, err := http.NewRequestWithContext(ctx, method, e.URL()+route, strings.NewReader(body))
	if err != nil {
		return reply{err: err}
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := client.Do(req)
	if err != nil {
		return reply{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return reply{status: resp.StatusCode, ctype: resp.Header.Get("Content-Type"), body: string(b), err: err}
}

// post sends a POST and fails the test on a transport error.
func post(t *testing.T, e *Encoder, route, body string) reply {
	t.Helper()
	r := do(context.Background(), e, http.MethodPost, route, body)
	if r.err != nil {
		t.Fatalf("POST %s: %v", route, r.err)
	}
	return r
}

// get sends a GET and fails the test on a transport error.
func get(t *testing.T, e *Encoder, route string) reply {
	t.Helper()
	r := do(context.Background(), e, http.MethodGet, route, "")
	if r.err != nil {
		t.Fatalf("GET %s: %v", route, r.err)
	}
	return r
}

// postAsync sends a POST in a goroutine; the reply arrives on the channel.
func postAsync(e *Encoder, route, body string) <-chan reply {
	return doAsync(context.Background(), e, http.MethodPost, route, body)
}

// doAsync sends a request in a goroutine; the reply arrives on the channel.
func doAsync(ctx context.Context, e *Encoder, method, route, body string) <-chan reply {
	ch := make(chan reply, 1)
	go func() { ch <- do(ctx, e, method, route, body) }()
	return ch
}

// recv waits for an async reply.
func recv(t *testing.T, ch <-chan reply) reply {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("no reply within 10s")
	}
	return reply{}
}

// pending fails the test if ch already has a reply.
func pending(t *testing.T, ch <-chan reply, what string) {
	t.Helper()
	select {
	case r := <-ch:
		t.Fatalf("%s answered early: %d %s", what, r.status, r.body)
	default:
	}
}

// waitFor polls cond (a state signal such as Stats, not a timing guess).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// waitWaiting waits until n handlers are blocked on route.
func waitWaiting(t *testing.T, e *Encoder, route string, n int) {
	t.Helper()
	waitFor(t, fmt.Sprintf("%d waiting on %s", n, route), func() bool { return e.Stats().Waiting[route] == n })
}

// encodeBody is a valid /encode body for id with n mm_items (the first may
// be a failure hook).
func encodeBody(id string, items ...string) string {
	if len(items) == 0 {
		items = []string{"data:image/png;base64,AAAA"}
	}
	b, _ := json.Marshal(items)
	return fmt.Sprintf(`{"req_id":%q,"mm_items":%s,"modality":"IMAGE","num_parts":1,"part_idx":0,"prefill_host":"10.0.0.1","embedding_port":null}`, id, b)
}

// sendBody is a /send body for id from destination port, with receive_count
// rc (omitted when rc < 0).
func sendBody(id string, port, rc int) string {
	s := fmt.Sprintf(`{"req_id":%q,"part_idx":0,"embedding_size":524288,"embedding_len":256,"embedding_dim":1024,"prefill_host":"10.0.0.1","embedding_port":%d,"session_id":"10.0.0.1:17000","buffer_address":140737488355328`, id, port)
	if rc >= 0 {
		s += fmt.Sprintf(`,"receive_count":%d`, rc)
	}
	return s + "}"
}

// metaBody is a /scheduler_receive_meta_data body.
func metaBody(id string) string {
	return fmt.Sprintf(`{"req_id":%q,"part_idx":0}`, id)
}

// registerBody is a /scheduler_receive_url body.
func registerBody(id string, count int, url string) string {
	return fmt.Sprintf(`{"req_id":%q,"receive_count":%d,"receive_url":%q,"modality":"IMAGE"}`, id, count, url)
}

// envelope is the expected error envelope for a string req_id.
func envelope(msg, id string) string {
	b, _ := json.Marshal(msg)
	return fmt.Sprintf(`{"status":"error","message":%s,"req_id":%q}`, b, id)
}

// expect checks a reply's status and exact body.
func expect(t *testing.T, r reply, status int, body string) {
	t.Helper()
	if r.err != nil {
		t.Fatalf("transport error: %v", r.err)
	}
	if r.status != status || r.body != body {
		t.Fatalf("got %d %q, want %d %q", r.status, r.body, status, body)
	}
}

// expectErr checks an error envelope reply.
func expectErr(t *testing.T, r reply, status int, msg, id string) {
	t.Helper()
	expect(t, r, status, envelope(msg, id))
	if r.ctype != "application/json" {
		t.Fatalf("content type %q, want application/json", r.ctype)
	}
}
