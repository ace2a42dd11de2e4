package gateway

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/upstream"
)

func strp(s string) *string { return &s }

// wantEnvelope checks that a is an error envelope with status and req_id
// (nil: JSON null), byte for byte in the encoder's shape and key order, and
// returns its message.
func wantEnvelope(t *testing.T, a answer, status int, reqID *string) string {
	t.Helper()
	if a.status != status {
		t.Fatalf("status %d, want %d (body %q)", a.status, status, a.body)
	}
	if got := a.header.Get("Content-Type"); got != "application/json" {
		t.Fatalf("Content-Type %q, want application/json (body %q)", got, a.body)
	}
	var env map[string]json.RawMessage
	if err := json.Unmarshal([]byte(a.body), &env); err != nil {
		t.Fatalf("body %q is not a JSON object: %v", a.body, err)
	}
	var msg string
	if err := json.Unmarshal(env["message"], &msg); err != nil {
		t.Fatalf("message of %q is not a string: %v", a.body, err)
	}
	quote := func(s string) string { // as orjson writes it: no HTML escaping
		var b strings.Builder
		enc := json.NewEncoder(&b)
		enc.SetEscapeHTML(false)
		_ = enc.Encode(s)
		return strings.TrimSuffix(b.String(), "\n")
	}
	id := "null"
	if reqID != nil {
		id = quote(*reqID)
	}
	want := `{"status":"error","message":` + quote(msg) + `,"req_id":` + id + `}`
	if a.body != want {
		t.Fatalf("body %s\nwant %s", a.body, want)
	}
	return msg
}

// wantEnvelopeMsg is wantEnvelope with an exact message.
func wantEnvelopeMsg(t *testing.T, a answer, status int, msg string, reqID *string) {
	t.Helper()
	if got := wantEnvelope(t, a, status, reqID); got != msg {
		t.Fatalf("message %q, want %q", got, msg)
	}
}

// routesSeen sums what the fakes received, per route.
func routesSeen(encs []*fakeencoder.Encoder) map[string]int64 {
	out := map[string]int64{}
	for _, e := range encs {
		for r, n := range e.Stats().Routes {
			out[r] += n
		}
	}
	return out
}

// ownedBy returns a req_id whose rendezvous owner in g is the encoder name.
func ownedBy(t *testing.T, g *gw, name, prefix string) string {
	t.Helper()
	for i := 0; i < 10000; i++ {
		id := fmt.Sprintf("%s-%d_local_part_0", prefix, i)
		if e, err := g.Pool().Owner(id); err == nil && e.Name == name {
			return id
		}
	}
	t.Fatalf("no req_id owned by %s", name)
	return ""
}

func TestNoUsableEncoderIs503(t *testing.T) {
	encs := startFakes(t, 2, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Affinity.UnknownWait = 0 })
	for _, path := range []string{"/health", "/health_generate"} {
		if a := do(t, http.MethodGet, g.base+path, ""); a.status != 200 || a.body != "" {
			t.Fatalf("GET %s with usable encoders: %d %q, want 200 and an empty body", path, a.status, a.body)
		}
	}
	for _, e := range g.Pool().Encoders() {
		e.SetUsable(false)
	}
	for _, path := range []string{"/health", "/health_generate"} {
		if a := do(t, http.MethodGet, g.base+path, ""); a.status != 503 || a.body != "" {
			t.Fatalf("GET %s with no usable encoder: %d %q, want 503 and an empty body", path, a.status, a.body)
		}
	}
	wantEnvelopeMsg(t, post(t, g.base+"/encode", encodeBody("n1")), 503, "encgate: no usable encoder", strp("n1"))
	// A follow-up with no pin routes by rendezvous order and finds nothing.
	wantEnvelopeMsg(t, post(t, g.base+"/send", sendBody("n2", 1)), 503, "encgate: no usable encoder", strp("n2"))
	if seen := routesSeen(encs); len(seen) != 0 {
		t.Fatalf("encoders received %v", seen)
	}
	g.Pool().Encoders()[1].SetUsable(true)
	if a := do(t, http.MethodGet, g.base+"/health", ""); a.status != 200 || a.body != "" {
		t.Fatalf("GET /health with one usable encoder again: %d %q", a.status, a.body)
	}
}

func TestDialFailureIs502NamingTheEncoder(t *testing.T) {
	dead := "http://" + deadAddr(t)
	g := startGateway(t, []string{dead}, func(c *Config) { c.Affinity.UnknownWait = 0 })
	msg := wantEnvelope(t, post(t, g.base+"/encode", encodeBody("d1")), 502, strp("d1"))
	for _, part := range []string{"cannot connect", "enc-0", dead, "connection refused"} {
		if !strings.Contains(msg, part) {
			t.Errorf("message %q does not contain %q", msg, part)
		}
	}
	// A follow-up without a pin also dials, and fails the same way.
	msg = wantEnvelope(t, post(t, g.base+"/scheduler_receive_meta_data", metaBody("d2")), 502, strp("d2"))
	if !strings.Contains(msg, "enc-0") || !strings.Contains(msg, "cannot connect") {
		t.Errorf("follow-up message %q does not name the dial failure on enc-0", msg)
	}
}

func TestUpstreamTimeoutIs504(t *testing.T) {
	encs := startFakes(t, 1, func(_ int, o *fakeencoder.Options) { o.Faults.Hang = true })
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		for _, pol := range []*upstream.RetryPolicy{&c.Retry.Encode, &c.Retry.Metadata, &c.Retry.ReceiveURL, &c.Retry.Send} {
			pol.PerTryTimeout, pol.MaxAttempts = 200e6, 1 // 200ms, no retry
		}
	})
	msg := wantEnvelope(t, post(t, g.base+"/encode", encodeBody("t1")), 504, strp("t1"))
	if !strings.Contains(msg, "encoder enc-0 did not answer in time") {
		t.Errorf("message %q does not say enc-0 timed out", msg)
	}
	if n := encs[0].Stats().Routes["/encode"]; n != 1 {
		t.Errorf("encoder received %d /encode, want 1 (no retry of a delivered request)", n)
	}
}

func TestBadRequestBodiesAre400AndStayInTheGateway(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Affinity.UnknownWait = 0 })
	const notJSON = "encgate: request body is not valid JSON: "
	const notObject = "encgate: request body must be a JSON object"
	const badID = "missing or invalid req_id"
	tests := []struct {
		name, body, msgPrefix string
		exact                 bool
	}{
		{"empty body", ``, notJSON, false},
		{"malformed", `{"req_id":"x",`, notJSON, false},
		{"trailing garbage", `{"req_id":"x"} {}`, notJSON, false},
		{"unquoted key", `{req_id:"x"}`, notJSON, false},
		{"array", `[1]`, notObject, true},
		{"string", `"x"`, notObject, true},
		{"number", `42`, notObject, true},
		{"null", `null`, notObject, true},
		{"missing req_id", `{"mm_items":["a"],"modality":"IMAGE"}`, badID, true},
		{"empty req_id", `{"req_id":""}`, badID, true},
		{"numeric req_id", `{"req_id":7}`, badID, true},
		{"null req_id", `{"req_id":null}`, badID, true},
		{"object req_id", `{"req_id":{"a":"b"}}`, badID, true},
		{"list req_id", `{"req_id":["a"]}`, badID, true},
	}
	for _, path := range []string{"/encode", "/scheduler_receive_meta_data", "/scheduler_receive_url", "/send"} {
		for _, tc := range tests {
			t.Run(path+"/"+tc.name, func(t *testing.T) {
				msg := wantEnvelope(t, post(t, g.base+path, tc.body), 400, nil)
				if tc.exact && msg != tc.msgPrefix || !strings.HasPrefix(msg, tc.msgPrefix) {
					t.Fatalf("message %q, want %q", msg, tc.msgPrefix)
				}
			})
		}
	}
	if seen := routesSeen(encs); len(seen) != 0 {
		t.Fatalf("bad requests reached the encoder: %v", seen)
	}
	if n := g.Pool().PinsHeld(); n != 0 {
		t.Fatalf("bad requests left %d pins", n)
	}
	// The gateway still serves the encoder afterwards.
	if a := post(t, g.base+"/encode", encodeBody("ok")); a.status != 200 {
		t.Fatalf("/encode after bad requests: %d %s", a.status, a.body)
	}
}

// rawExchange sends head on a fresh connection, streams body (ignoring
// write errors: the gateway may stop reading and close) while reading the
// answer, and returns it.
func rawExchange(t *testing.T, addr, head string, body func(w io.Writer) error) (*http.Response, string) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.WriteString(c, head); err != nil {
		t.Fatal(err)
	}
	wrote := make(chan error, 1)
	go func() { wrote <- body(c) }()
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatalf("reading the answer body: %v", err)
	}
	c.Close() // stop the writer if the gateway has not
	<-wrote
	return resp, string(b)
}

// zeros writes n bytes of JSON-ish filler in 64KiB writes.
func zeros(w io.Writer, n int) error {
	buf := make([]byte, 64<<10)
	for i := range buf {
		buf[i] = ' '
	}
	for n > 0 {
		k := min(n, len(buf))
		if _, err := w.Write(buf[:k]); err != nil {
			return err
		}
		n -= k
	}
	return nil
}

func TestOversizedBodyIs413(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), nil) // limits.max_body_bytes 8MiB
	const size = 20 << 20
	const wantMsg = "encgate: request body exceeds limits.max_body_bytes (8MiB)"
	check := func(t *testing.T, resp *http.Response, body string) {
		t.Helper()
		wantEnvelopeMsg(t, answer{resp.StatusCode, resp.Header, body}, 413, wantMsg, nil)
		if !resp.Close {
			t.Errorf("the gateway kept the connection open after a 413")
		}
	}
	t.Run("content-length", func(t *testing.T) {
		head := "POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n" +
			"Content-Length: " + strconv.Itoa(size) + "\r\n\r\n"
		resp, body := rawExchange(t, g.Addr(), head, func(w io.Writer) error { return zeros(w, size) })
		check(t, resp, body)
	})
	t.Run("chunked", func(t *testing.T) {
		head := "POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n" +
			"Transfer-Encoding: chunked\r\n\r\n"
		resp, body := rawExchange(t, g.Addr(), head, func(w io.Writer) error {
			const chunk = 1 << 20
			for sent := 0; sent < size; sent += chunk {
				if _, err := fmt.Fprintf(w, "%x\r\n", chunk); err != nil {
					return err
				}
				if err := zeros(w, chunk); err != nil {
					return err
				}
				if _, err := io.WriteString(w, "\r\n"); err != nil {
					return err
				}
			}
			_, err := io.WriteString(w, "0\r\n\r\n")
			return err
		})
		check(t, resp, body)
	})
	if seen := routesSeen(encs); len(seen) != 0 {
		t.Fatalf("oversized bodies reached the encoder: %v", seen)
	}
	if a := post(t, g.base+"/encode", encodeBody("after-413")); a.status != 200 {
		t.Fatalf("/encode after the 413s: %d %s", a.status, a.body)
	}
	body := do(t, http.MethodGet, g.admin+"/metrics", "").body
	if line := `encgate_requests_total{code="413",route="unknown"} 2`; !hasLine(body, line) {
		t.Errorf("metrics lack %q", line)
	}
}

// The registration alone may reach the encoder: the gateway does not know
// yet whether this encoder takes a registration for a failed part (GEN0,
// GEN1) or holds it (this one), so it forwards it within
// affinity.failed_registration_wait and then answers from the failure.
func TestFailedEncodeFromTheEncoderIsRemembered(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Affinity.FailedRegistrationWait = configfile.Duration(100 * time.Millisecond)
	})
	const id = "f_local_part_0"
	const msg = "Error while loading data x"
	body := fmt.Sprintf(`{"req_id":%q,"mm_items":["fail:400:%s"],"modality":"IMAGE","num_parts":1,"part_idx":0,"prefill_host":"10.0.0.1","embedding_port":null}`, id, msg)
	a := post(t, g.base+"/encode", body)
	// The encoder's own answer passes through untouched.
	wantEnvelopeMsg(t, a, 400, msg, strp(id))
	if got := a.header.Get("X-Encgate-Encoder"); got != "enc-0" {
		t.Fatalf("X-Encgate-Encoder %q", got)
	}
	follow := map[string]string{
		"/scheduler_receive_meta_data": metaBody(id),
		"/send":                        sendBody(id, 40000),
		"/scheduler_receive_url":       fmt.Sprintf(`{"req_id":%q,"receive_count":2,"receive_url":"10.0.0.1:5000"}`, id),
	}
	for path, b := range follow {
		a := post(t, g.base+path, b)
		wantEnvelopeMsg(t, a, 400, msg, strp(id))
		if got := a.header.Get("X-Encgate-Encoder"); got != "enc-0" {
			t.Errorf("%s: X-Encgate-Encoder %q, want the failed /encode's enc-0", path, got)
		}
	}
	seen := encs[0].Stats().Routes
	if seen["/encode"] != 1 || seen["/scheduler_receive_url"] != 1 || len(seen) != 2 {
		t.Fatalf("encoder received %v, want the one /encode and the one registration (forwarded, bounded)", seen)
	}
}

func TestFailedEncodeInTheGatewayIsRemembered(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, []string{"http://" + deadAddr(t), encs[0].URL()}, func(c *Config) { c.Retry.Encode.MaxAttempts = 1 })
	dead := g.Pool().Encoders()[0]
	id := ownedBy(t, g, dead.Name, "gone")
	msg := wantEnvelope(t, post(t, g.base+"/encode", encodeBody(id)), 502, strp(id))
	if !strings.Contains(msg, "cannot connect to encoder enc-0") {
		t.Fatalf("message %q does not name the dial failure on enc-0", msg)
	}
	for path, b := range map[string]string{
		"/scheduler_receive_meta_data": metaBody(id),
		"/send":                        sendBody(id, 40000),
	} {
		a := post(t, g.base+path, b)
		wantEnvelopeMsg(t, a, 502, msg, strp(id))
		if got := a.header.Get("X-Encgate-Encoder"); got != "enc-0" {
			t.Errorf("%s: X-Encgate-Encoder %q, want enc-0", path, got)
		}
	}
	if n := dead.Requests(); n != 1 {
		t.Errorf("the gateway tried enc-0 %d times, want once (the /encode only)", n)
	}
	if n := g.Pool().Encoders()[1].Requests(); n != 0 {
		t.Errorf("the gateway sent %d requests to enc-1", n)
	}
	if seen := encs[0].Stats().Routes; len(seen) != 0 {
		t.Errorf("enc-1 received %v: a follow-up left its failed pin", seen)
	}
}

func TestUnknownPathAndWrongMethod(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), nil)
	wantEnvelopeMsg(t, post(t, g.base+"/v1/chat/completions", `{}`), 404,
		"encgate: no route POST /v1/chat/completions", nil)
	wantEnvelopeMsg(t, do(t, http.MethodGet, g.base+"/", ""), 404, "encgate: no route GET /", nil)
	tests := []struct {
		method, path, allow string
	}{
		{http.MethodGet, "/encode", "POST"},
		{http.MethodPut, "/send", "POST"},
		{http.MethodDelete, "/scheduler_receive_meta_data", "POST"},
		{http.MethodPost, "/health", "GET, HEAD"},
		{http.MethodPut, "/start_profile", "GET, HEAD, POST"},
	}
	for _, tc := range tests {
		a := do(t, tc.method, g.base+tc.path, "")
		wantEnvelopeMsg(t, a, 405, "encgate: method "+tc.method+" not allowed on "+tc.path, nil)
		if got := a.header.Get("Allow"); got != tc.allow {
			t.Errorf("%s %s: Allow %q, want %q", tc.method, tc.path, got, tc.allow)
		}
	}
	if seen := routesSeen(encs); len(seen) != 0 {
		t.Fatalf("encoders received %v", seen)
	}
}

// hasLine reports whether text has line as one of its lines.
func hasLine(text, line string) bool {
	for _, l := range strings.Split(text, "\n") {
		if l == line {
			return true
		}
	}
	return false
}
