package gateway

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
)

// markedEncoder is the fuzz target's encoder: it answers every request 200
// with a body naming the request's arrival number, {"fz":N}, and keeps the
// numbers, so that each request that reached it can be matched with an
// answer a client got.
type markedEncoder struct {
	*httptest.Server
	mu sync.Mutex
	n  int
}

func newMarkedEncoder(tb testing.TB) *markedEncoder {
	m := &markedEncoder{}
	m.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		m.mu.Lock()
		m.n++
		n := m.n
		m.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = fmt.Fprintf(w, `{"fz":%d}`, n)
	}))
	tb.Cleanup(m.Close)
	return m
}

func (m *markedEncoder) count() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.n
}

// goRequests reads data as net/http's server would, as a reference: the
// requests in it, and whether it is exactly a sequence of complete ones.
func goRequests(data []byte) (reqs []*http.Request, complete bool) {
	br := bufio.NewReader(bytes.NewReader(data))
	for {
		if _, err := br.Peek(1); err == io.EOF {
			return reqs, true
		}
		req, err := http.ReadRequest(br)
		if err != nil {
			return reqs, false
		}
		if _, err := io.Copy(io.Discard, req.Body); err != nil {
			return reqs, false
		}
		reqs = append(reqs, req)
	}
}

// frontEndSeeds are the fuzz target's seeds, and the cases its seed run
// checks: framing the gateway refuses (obs-fold, bare LF, smuggling
// shapes), limits, and well-formed requests alone, chunked and pipelined.
func frontEndSeeds() []string {
	enc := encodeBody("fz_local_part_0")
	post := func(path, body string) string {
		return fmt.Sprintf("POST %s HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", path, len(body), body)
	}
	chunked := fmt.Sprintf("POST /encode HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n%x;ext=1\r\n%s\r\n0\r\nX-T: 1\r\n\r\n",
		10, enc[:10], len(enc)-10, enc[10:])
	return []string{
		post("/encode", enc),
		post("/send", sendBody("fz_local_part_0", 40000)),
		post("/scheduler_receive_meta_data", metaBody("fz_local_part_0")),
		"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n" + post("/encode", enc) + "GET /health_generate HTTP/1.1\r\nHost: gw\r\n\r\n",
		chunked,
		chunked + post("/scheduler_receive_meta_data", metaBody("fz_local_part_0")),
		"POST /start_profile HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n{}",
		"POST /encode HTTP/1.0\r\nHost: gw\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\n{}GET /health HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n",
		// obs-fold, a folded Content-Length included
		"POST /encode HTTP/1.1\r\nHost: gw\r\nX-A: a\r\n b\r\n\r\n",
		fmt.Sprintf("POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Length:\r\n %d\r\n\r\n%s", len(enc), enc),
		// bare LF, bare CR
		strings.ReplaceAll(post("/encode", enc), "\r\n", "\n"),
		strings.Replace(post("/encode", enc), "\r\n", "\n", 1),
		"GET /health HTTP/1.1\rHost: gw\r\n\r\n",
		// smuggling shapes: CL and TE, two CLs, TE variants, a request in a body
		fmt.Sprintf("POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n%s", post("/encode", enc)),
		fmt.Sprintf("POST /encode HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\n%s", post("/encode", enc)),
		"POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\n{}",
		"POST /encode HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
		"POST /encode HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
		fmt.Sprintf("POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n%s", len(post("/encode", enc)), post("/encode", enc)),
		"GET /health HTTP/1.1\r\nHost: gw\r\nX-A: a\x00b\r\n\r\n",
		// limits: a head over limits.max_header_bytes, a body over max_body_bytes
		"GET /health HTTP/1.1\r\nHost: gw\r\nX-A: " + strings.Repeat("a", 9<<10) + "\r\n\r\n",
		fmt.Sprintf("POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n", 1<<20),
		"", "\r\n", "GET", "GET / HTTP/1.1\r\n",
	}
}

// FuzzFrontEnd feeds raw bytes to the gateway's client port, one
// connection per input, in front of an encoder that marks its answers,
// and checks: every answer is a valid HTTP/1.1 response; after a 400 for
// a request it could not read, a 408, 413 or 431 (and any answer with
// Connection: close) the gateway closes the connection; a connection whose requests were all answered
// and kept alive still serves a well-formed request; and every request
// that reached the encoder has its answer in what the client read, so
// nothing of a request the gateway refused reached it.
//
// Where net/http reads the input as a sequence of complete requests, the
// input is sent alone and the connection kept open, so each answer comes
// from the bytes; otherwise the client half-closes after the input. The
// reference is only used to know when to stop writing: the gateway may
// refuse more than net/http does, never frame the bytes differently, or
// the test waits for an answer that does not come.
func FuzzFrontEnd(f *testing.F) {
	for _, s := range frontEndSeeds() {
		f.Add([]byte(s))
	}
	enc := newMarkedEncoder(f)
	g := startGatewayDeps(f, []string{enc.URL}, func(c *Config) {
		patient(c)
		c.Health.Disabled = true
		c.Limits.MaxHeaderBytes = 8 << 10
		c.Limits.MaxBodyBytes = 64 << 10
		c.Affinity.MaxPins = 1000
		c.Idempotency.Capacity = 1000
		for _, p := range []*configfile.Duration{&c.Retry.Encode.PerTryTimeout, &c.Retry.Metadata.PerTryTimeout,
			&c.Retry.ReceiveURL.PerTryTimeout, &c.Retry.Send.PerTryTimeout} {
			*p = configfile.Duration(10 * time.Second)
		}
	}, zap.NewNop(), clock.Real{})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 16<<10 {
			return // larger inputs add no framing and slow the run
		}
		if bytes.Contains(data, []byte("HEAD")) {
			// A HEAD's answer has a Content-Length and no body; which
			// answer is a HEAD's cannot be told from the answers alone.
			return
		}
		checkFrontEnd(t, g.Addr(), enc, data)
	})
}

// mustClose reports an answer after which the gateway must close the
// connection: a request it could not read (400 for its framing, 408, 413,
// 431). A 400 for a body that is read but refused (a field missing) keeps
// the connection: the stream is still in step.
func mustClose(status int, body string) bool {
	switch status {
	case 408, 413, 431:
		return true
	case 400:
		return strings.Contains(body, `"message":"encgate: malformed HTTP request`)
	}
	return false
}

func checkFrontEnd(t *testing.T, addr string, enc *markedEncoder, data []byte) {
	reqs, complete := goRequests(data)
	before := enc.count()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// The test's patience, not a measurement: the gateway's own read
	// timeouts are an hour, so an answer that does not come fails here.
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write(data); err != nil {
		t.Fatalf("writing the input: %v", err)
	}
	if !complete {
		_ = c.(*net.TCPConn).CloseWrite()
	}
	br := bufio.NewReader(c)
	var bodies []string
	// read reads the next final answer to req (nil: unknown), skipping
	// 100 Continue; ok is false at a clean end of the connection.
	read := func(req *http.Request) (resp *http.Response, ok bool) {
		for {
			if _, err := br.Peek(1); errors.Is(err, io.EOF) {
				return nil, false
			}
			resp, err := http.ReadResponse(br, req)
			if err != nil {
				t.Fatalf("not a valid HTTP response after %d answers: %v\ninput %q", len(bodies), err, data)
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil {
				t.Fatalf("answer %d (%d): its body: %v\ninput %q", len(bodies), resp.StatusCode, err, data)
			}
			if resp.ProtoMajor != 1 || resp.ProtoMinor != 1 || resp.StatusCode < 100 || resp.StatusCode > 599 {
				t.Fatalf("answer %d: %s %d\ninput %q", len(bodies), resp.Proto, resp.StatusCode, data)
			}
			if resp.StatusCode == http.StatusContinue {
				continue
			}
			bodies = append(bodies, string(b))
			return resp, true
		}
	}
	wantEOF := func(after *http.Response) {
		if b, err := br.ReadByte(); err == nil || !errors.Is(err, io.EOF) {
			t.Fatalf("after answer %d (%d, close %v): read %q, %v; want the connection closed\ninput %q",
				len(bodies), after.StatusCode, after.Close, b, err, data)
		}
	}
	alive := true
	for i := 0; ; i++ {
		if complete && i == len(reqs) {
			break
		}
		var req *http.Request
		if i < len(reqs) {
			req = reqs[i]
		}
		resp, ok := read(req)
		if !ok {
			if complete {
				t.Fatalf("the connection ended after %d answers; net/http reads %d requests in\n%q", i, len(reqs), data)
			}
			alive = false
			break
		}
		if mustClose(resp.StatusCode, bodies[len(bodies)-1]) && !resp.Close {
			t.Fatalf("a %d without Connection: close\ninput %q\nbody %q", resp.StatusCode, data, bodies[len(bodies)-1])
		}
		if resp.Close {
			wantEOF(resp)
			alive = false
			break
		}
	}
	if complete && alive {
		// Every request was answered and the connection kept: it still
		// serves a well-formed one.
		if _, err := io.WriteString(c, "GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"); err != nil {
			t.Fatalf("writing the probe: %v", err)
		}
		resp, ok := read(nil)
		if !ok || resp.StatusCode != 200 {
			t.Fatalf("the probe after %d answered requests: %v %v\ninput %q", len(reqs), ok, resp, data)
		}
		_ = c.(*net.TCPConn).CloseWrite()
		wantEOF(resp)
	}
	// The connection is done, so every exchange it started is too.
	after := enc.count()
	all := strings.Join(bodies, "\n")
	for n := before + 1; n <= after; n++ {
		if !strings.Contains(all, fmt.Sprintf(`{"fz":%d}`, n)) {
			t.Fatalf("request %d reached the encoder, and no answer the client read is its answer\ninput %q\nanswers %q", n, data, bodies)
		}
	}
}
