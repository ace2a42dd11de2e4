package gateway

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/listener"
)

// patient makes the gateway wait on a request for an hour: a request the
// gateway waits on instead of answering hangs the test (until the client's
// own deadline fails it) rather than passing as a late 408. Health checks
// are off, so that what the encoder received is only what was forwarded.
func patient(c *Config) {
	c.Limits.ReadHeaderTimeout = configfile.Duration(time.Hour)
	c.Limits.ReadTimeout = configfile.Duration(time.Hour)
	c.Affinity.UnknownWait = 0
	c.Health.Disabled = true
}

// rawClient is one client connection written with raw bytes.
type rawClient struct {
	t  *testing.T
	c  net.Conn
	br *bufio.Reader
}

// dialRaw connects to addr. The connection's deadline is the test's
// patience: an answer that does not come fails the read, it is not timed.
func dialRaw(t *testing.T, addr string) *rawClient {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	return &rawClient{t: t, c: c, br: bufio.NewReader(c)}
}

// send writes raw as it is; the connection stays open for writing, so an
// answer comes from the bytes alone, never from the client's EOF.
func (r *rawClient) send(raw string) {
	r.t.Helper()
	if _, err := io.WriteString(r.c, raw); err != nil {
		r.t.Fatal(err)
	}
}

// read reads the next answer.
func (r *rawClient) read() answer {
	r.t.Helper()
	resp, err := http.ReadResponse(r.br, nil)
	if err != nil {
		r.t.Fatalf("reading the answer: %v", err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		r.t.Fatalf("reading the answer's body: %v", err)
	}
	if resp.Close {
		resp.Header.Set("Connection", "close") // net/http moves it to resp.Close
	}
	return answer{resp.StatusCode, resp.Header, string(b)}
}

// wantClosed checks that the gateway closed the connection after its last
// answer: the next read ends, with nothing more sent.
func (r *rawClient) wantClosed() {
	r.t.Helper()
	b, err := r.br.ReadByte()
	if err == nil {
		r.t.Fatalf("the gateway sent %q after its last answer; want the connection closed", b)
	}
	if !errors.Is(err, io.EOF) {
		r.t.Fatalf("after the last answer: %v; want the connection closed (EOF)", err)
	}
}

// wantRefused checks a's 400 envelope, that its message gives reason and
// that the gateway closed the connection after it.
func (r *rawClient) wantRefused(a answer, reason string) {
	r.t.Helper()
	msg := wantEnvelope(r.t, a, http.StatusBadRequest, nil)
	if !strings.HasPrefix(msg, "encgate: malformed HTTP request: ") || !strings.Contains(msg, reason) {
		r.t.Fatalf("message %q, want one giving %q", msg, reason)
	}
	if a.header.Get("Connection") != "close" {
		r.t.Errorf("a 400 without Connection: close (%v)", a.header)
	}
	r.wantClosed()
}

// head is a POST /encode request head for body, with extra header lines
// (each ending in its own line ending) spliced in before Content-Length.
func encodeRequest(body, extra string) string {
	return "POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n" + extra +
		fmt.Sprintf("Content-Length: %d\r\n\r\n", len(body)) + body
}

func TestObsFoldIsRefusedAtOnce(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), patient)
	body := encodeBody("fold_local_part_0")
	tests := map[string]string{
		"folded header, SP":     encodeRequest(body, "X-Note: one\r\n two\r\n"),
		"folded header, HTAB":   encodeRequest(body, "X-Note: one\r\n\ttwo\r\n"),
		"folded Content-Length": fmt.Sprintf("POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length:\r\n %d\r\n\r\n%s", len(body), body),
		// fasthttp read this one as "Content-Length: 0 <n>" and refused it
		// as not a number; the fold is named now.
		"folded Content-Length, value on both lines": fmt.Sprintf("POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Length: 0\r\n %d\r\n\r\n%s", len(body), body),
		"whitespace before the first header": "POST /encode HTTP/1.1\r\n Host: gw\r\nContent-Type: application/json\r\n" +
			fmt.Sprintf("Content-Length: %d\r\n\r\n%s", len(body), body),
	}
	for name, raw := range tests {
		t.Run(name, func(t *testing.T) {
			r := dialRaw(t, g.Addr())
			r.send(raw)
			r.wantRefused(r.read(), "obs-fold")
		})
	}
	t.Run("after a request kept alive", func(t *testing.T) {
		r := dialRaw(t, g.Addr())
		r.send("GET /health HTTP/1.1\r\nHost: gw\r\n\r\n" + tests["folded Content-Length"])
		if a := r.read(); a.status != 200 {
			t.Fatalf("the well-formed request before the fold: %d %q", a.status, a.body)
		}
		r.wantRefused(r.read(), "obs-fold")
	})
	if seen := routesSeen(encs); len(seen) != 0 {
		t.Fatalf("obs-folded requests reached the encoder: %v", seen)
	}
	// The same request unfolded is forwarded: the refusals above are the
	// fold's alone.
	r := dialRaw(t, g.Addr())
	r.send(encodeRequest(body, "X-Note: one two\r\n"))
	if a := r.read(); a.status != 200 {
		t.Fatalf("the request unfolded: %d %q", a.status, a.body)
	}
	if seen := routesSeen(encs); seen["/encode"] != 1 || len(seen) != 1 {
		t.Fatalf("the encoder received %v, want the one unfolded /encode", seen)
	}
}

func TestBareLFIsRefusedAtOnce(t *testing.T) {
	encs := startFakes(t, 1, nil)
	// read_header_timeout is an hour: a gateway that waited for a CRLFCRLF
	// would hang this test, not answer it late.
	g := startGateway(t, fakeURLs(encs), patient)
	body := encodeBody("lf_local_part_0")
	crlf := encodeRequest(body, "")
	tests := map[string]string{
		"every line":            strings.ReplaceAll(crlf, "\r\n", "\n"),
		"the request line only": strings.Replace(crlf, "\r\n", "\n", 1),
		"one header line":       strings.Replace(crlf, "Host: gw\r\n", "Host: gw\n", 1),
		"the empty line":        strings.Replace(crlf, "\r\n\r\n", "\r\n\n", 1),
		"before the request":    "\n" + crlf,
		"chunk size line": "POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" +
			fmt.Sprintf("%x\n%s\r\n0\r\n\r\n", len(body), body),
		"trailer line": "POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" +
			fmt.Sprintf("%x\r\n%s\r\n0\r\nX-Trailer: t\n\r\n", len(body), body),
	}
	for name, raw := range tests {
		t.Run(name, func(t *testing.T) {
			r := dialRaw(t, g.Addr())
			r.send(raw)
			r.wantRefused(r.read(), "bare LF")
		})
	}
	t.Run("after a request kept alive", func(t *testing.T) {
		r := dialRaw(t, g.Addr())
		r.send("GET /health HTTP/1.1\r\nHost: gw\r\n\r\n" + tests["every line"])
		if a := r.read(); a.status != 200 {
			t.Fatalf("the well-formed request before the bare LFs: %d %q", a.status, a.body)
		}
		r.wantRefused(r.read(), "bare LF")
	})
	if seen := routesSeen(encs); len(seen) != 0 {
		t.Fatalf("bare-LF requests reached the encoder: %v", seen)
	}
}

// TestFramingDecisions is each framing case the gateway decides, and what
// it decides: refused with 400 at once (nothing forwarded, the connection
// closed), or accepted as fasthttp reads it.
func TestFramingDecisions(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), patient)
	body := encodeBody("dec_local_part_0")
	n := len(body)
	post := "POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
	chunked := fmt.Sprintf("%x\r\n%s\r\n0\r\n\r\n", n, body)
	refused := []struct{ name, raw, reason string }{
		{"Content-Length then Transfer-Encoding", post + fmt.Sprintf("Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n", n) + chunked, "both Content-Length and Transfer-Encoding"},
		{"Transfer-Encoding then Content-Length", post + fmt.Sprintf("Transfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n", n) + chunked, "both Content-Length and Transfer-Encoding"},
		{"two Content-Lengths, different", post + fmt.Sprintf("Content-Length: %d\r\nContent-Length: 5\r\n\r\n", n) + body, "more than one Content-Length"},
		{"two Content-Lengths, equal", post + fmt.Sprintf("Content-Length: %d\r\nContent-Length: %d\r\n\r\n", n, n) + body, "more than one Content-Length"},
		{"a Content-Length list", post + fmt.Sprintf("Content-Length: %d, %d\r\n\r\n", n, n) + body, "not one non-negative decimal integer"},
		{"a signed Content-Length", post + fmt.Sprintf("Content-Length: +%d\r\n\r\n", n) + body, "not one non-negative decimal integer"},
		{"Content-Length past int64", post + "Content-Length: 99999999999999999999\r\n\r\n", "not one non-negative decimal integer"},
		{"space before the colon", post + fmt.Sprintf("Content-Length : %d\r\n\r\n", n) + body, "whitespace before its colon"},
		{"HTAB before the colon", post + fmt.Sprintf("Content-Length\t: %d\r\n\r\n", n) + body, "whitespace before its colon"},
		{"space inside a name", post + "X Note: a\r\n" + fmt.Sprintf("Content-Length: %d\r\n\r\n", n) + body, "not a token character"},
		{"NUL in a value", post + "X-Note: a\x00b\r\n" + fmt.Sprintf("Content-Length: %d\r\n\r\n", n) + body, "control byte"},
		{"NUL in a name", post + "X-No\x00te: a\r\n" + fmt.Sprintf("Content-Length: %d\r\n\r\n", n) + body, "control byte"},
		{"NUL in the target", "POST /enc\x00ode HTTP/1.1\r\nHost: gw\r\n" + fmt.Sprintf("Content-Length: %d\r\n\r\n", n) + body, "control byte"},
		{"bare CR ending the request line", "POST /encode HTTP/1.1\rHost: gw\r\n" + fmt.Sprintf("Content-Length: %d\r\n\r\n", n) + body, "CR not followed by LF"},
		{"bare CR in the target", "POST /enc\rode HTTP/1.1\r\nHost: gw\r\n\r\n", "request line"},
		{"bare CR in a value", post + "X-Note: a\rb\r\n" + fmt.Sprintf("Content-Length: %d\r\n\r\n", n) + body, "CR not followed by LF"},
		{"Transfer-Encoding: identity", post + "Transfer-Encoding: identity\r\n" + fmt.Sprintf("Content-Length: %d\r\n\r\n", n) + body, "single coding chunked"},
		{"Transfer-Encoding: gzip, chunked", post + "Transfer-Encoding: gzip, chunked\r\n\r\n" + chunked, "single coding chunked"},
		{"two Transfer-Encodings", post + "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked, "single coding chunked"},
		{"Transfer-Encoding on HTTP/1.0", "POST /encode HTTP/1.0\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked, "HTTP/1.0"},
		{"HTTP/1.2", "GET /health HTTP/1.2\r\nHost: gw\r\n\r\n", "HTTP version"},
		{"HTTP/0.9 request line", "GET /health\r\n\r\n", "request line"},
		{"two spaces in the request line", "GET  /health HTTP/1.1\r\nHost: gw\r\n\r\n", "request line"},
		{"chunk size over 15 hex digits", post + "Transfer-Encoding: chunked\r\n\r\n0000000000000001\r\nx\r\n0\r\n\r\n", "chunked framing"},
		{"chunk data without its CRLF", post + "Transfer-Encoding: chunked\r\n\r\n" + fmt.Sprintf("%x\r\n%sXX0\r\n\r\n", n, body), "chunked framing"},
		{"extension after whitespace", post + "Transfer-Encoding: chunked\r\n\r\n" + fmt.Sprintf("%x ;x=1\r\n%s\r\n0\r\n\r\n", n, body), "chunked framing"},
		// Refused by fasthttp, with the gateway's words.
		{"HTTP/1.1 without Host", "POST /encode HTTP/1.1\r\n" + fmt.Sprintf("Content-Length: %d\r\n\r\n", n) + body, "without Host"},
		{"a target that is not a path", "POST encode HTTP/1.1\r\nHost: gw\r\n" + fmt.Sprintf("Content-Length: %d\r\n\r\n", n) + body, "invalid request target"},
	}
	for _, tc := range refused {
		t.Run(tc.name, func(t *testing.T) {
			r := dialRaw(t, g.Addr())
			r.send(tc.raw)
			r.wantRefused(r.read(), tc.reason)
		})
	}
	if seen := routesSeen(encs); len(seen) != 0 {
		t.Fatalf("refused requests reached the encoder: %v", seen)
	}

	// Accepted, and framed as fasthttp frames them.
	accepted := []struct{ name, raw string }{
		{"Content-Length", post + fmt.Sprintf("Content-Length: %d\r\n\r\n", n) + body},
		{"Content-Length with leading zeros and whitespace", post + fmt.Sprintf("Content-Length:   000%d \t\r\n\r\n", n) + body},
		{"chunked, in two chunks, with extensions and a trailer", post + "Transfer-Encoding: Chunked\r\n\r\n" +
			fmt.Sprintf("%x;a=b\r\n%s\r\n%X;c\r\n%s\r\n0;last\r\nX-Trailer: t\r\n\r\n", 10, body[:10], n-10, body[10:])},
		{"chunked with whitespace after the size", post + "Transfer-Encoding: chunked\r\n\r\n" + fmt.Sprintf("%x \t\r\n%s\r\n0\r\n\r\n", n, body)},
		{"empty lines before the request line", "\r\n\r\n" + post + fmt.Sprintf("Content-Length: %d\r\n\r\n", n) + body},
		{"HTTP/1.0 with Content-Length", "POST /encode HTTP/1.0\r\nHost: gw\r\nConnection: keep-alive\r\nContent-Type: application/json\r\n" + fmt.Sprintf("Content-Length: %d\r\n\r\n", n) + body},
		{"obs-text in a value", post + "X-Note: caf\xc3\xa9\r\n" + fmt.Sprintf("Content-Length: %d\r\n\r\n", n) + body},
	}
	for i, tc := range accepted {
		t.Run(tc.name, func(t *testing.T) {
			r := dialRaw(t, g.Addr())
			// Pipelined behind a well-formed request, and followed by one:
			// the framing of each ends where fasthttp's does.
			r.send("GET /health HTTP/1.1\r\nHost: gw\r\n\r\n" + tc.raw + "GET /health_generate HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
			for j, want := range []int{200, 200, 200} {
				if a := r.read(); a.status != want {
					t.Fatalf("answer %d: %d %q, want %d", j, a.status, a.body, want)
				}
			}
			r.wantClosed()
			if got := encs[0].Stats().Routes["/encode"]; got != int64(i+1) {
				t.Fatalf("the encoder received %d /encodes, want %d", got, i+1)
			}
		})
	}
}

// TestMalformedRequestsAreLoggedSampledAndNeverEchoed sends 1,000 malformed
// requests from one client, each carrying a marker of its own in the bytes
// that make it malformed: the gateway's log keeps a bounded number of lines
// (listener.LogSampleFirst per message while the clock stands still, a few
// messages), none of them, and none of the 400s, with a marker.
func TestMalformedRequestsAreLoggedSampledAndNeverEchoed(t *testing.T) {
	encs := startFakes(t, 1, nil)
	core, logs := observer.New(zapcore.DebugLevel)
	clk := clock.NewFake(time.Now())
	g := startGatewayDeps(t, fakeURLs(encs), patient, zap.New(core), clk)
	startLines := logs.Len()
	// Each kind is refused by a different check: the framing check (the
	// first three), fasthttp's own parser (the rest).
	kinds := []func(mark string) string{
		func(m string) string {
			return "GET /health HTTP/1.1\r\nHost: gw\r\nX-A: " + m + "\r\n " + m + "\r\n\r\n"
		},
		func(m string) string { return "GET /health HTTP/1.1\nHost: gw\nX-" + m + ": " + m + "\n\n" },
		func(m string) string { return "GET /health HTTP/1.1\r\nHost: gw\r\nX-" + m + " : v\r\n\r\n" },
		func(m string) string { return "GET " + m + " HTTP/1.1\r\nHost: gw\r\n\r\n" },
		func(m string) string { return "GET /health HTTP/1.1\r\nX-" + m + ": " + m + "\r\n\r\n" },
	}
	const total = 1000
	echoed, example := 0, ""
	send := func(from, to int) {
		for i := from; i < to; i++ {
			mark := fmt.Sprintf("mk%04dmk", i)
			r := dialRaw(t, g.Addr())
			r.send(kinds[i%len(kinds)](mark))
			a := r.read()
			if a.status != http.StatusBadRequest {
				t.Fatalf("request %d: %d %q, want a 400", i, a.status, a.body)
			}
			if strings.Contains(a.body, "mk") {
				echoed, example = echoed+1, a.body
			}
			r.wantClosed()
		}
	}
	send(0, total)
	if echoed > 0 {
		t.Errorf("%d of %d 400s echo the request's bytes, e.g. %s", echoed, total, example)
	}
	// fasthttp logs the error after the connection is closed: wait for the
	// last connection to be counted closed, then read the log.
	eventually(t, "every connection closed", func() bool { return g.conns.Open() == 0 })
	lines := logs.All()[startLines:]
	perMessage := map[string]int{}
	echoed, example = 0, ""
	for _, e := range lines {
		perMessage[e.Message]++
		if text := e.Message + " " + fmt.Sprint(e.ContextMap()); strings.Contains(text, "mk") {
			echoed, example = echoed+1, text
		}
	}
	if echoed > 0 {
		t.Errorf("%d of %d log lines echo the request's bytes, e.g. %s", echoed, len(lines), example)
	}
	if len(lines) > len(kinds)*listener.LogSampleFirst {
		t.Errorf("%d log lines from %d malformed requests in one sampling tick, want at most %d (%d messages, %d lines each)",
			len(lines), total, len(kinds)*listener.LogSampleFirst, len(kinds), listener.LogSampleFirst)
	}
	for msg, n := range perMessage {
		if n > listener.LogSampleFirst {
			t.Errorf("%d lines of %q from %d malformed requests in one sampling tick, want at most %d", n, msg, total, listener.LogSampleFirst)
		}
	}
	if len(perMessage) > len(kinds) {
		t.Errorf("%d distinct messages from %d kinds of malformed request: the sampler counts by message, so a message must not carry the request",
			len(perMessage), len(kinds))
	}
	if len(lines) == 0 {
		t.Fatal("no line logged at all: the refusals must still be logged, sampled")
	}
	// Sampling is a rate, not a cap: the next tick logs again.
	clk.Advance(listener.LogSampleTick)
	before := logs.Len()
	send(total, total+len(kinds))
	eventually(t, "every connection closed", func() bool { return g.conns.Open() == 0 })
	if logs.Len() == before {
		t.Error("nothing logged in the next sampling tick")
	}
	if n := metricValue(t, g, "encgate_requests_total"); n != total+float64(len(kinds)) {
		t.Errorf("encgate_requests_total = %v, want every refusal counted (%d)", n, total+len(kinds))
	}
}

// TestAnswersBeforeARefusalAreKept: a refusal that ends the connection (a
// 413, a 431, a framing 400) comes after the answers to the requests
// pipelined before it, none lost.
func TestAnswersBeforeARefusalAreKept(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		patient(c)
		c.Limits.MaxBodyBytes = 1 << 10
		c.Limits.MaxHeaderBytes = 4 << 10
	})
	ok := "GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"
	for _, tc := range []struct {
		name, raw string
		status    int
	}{
		{"413", "POST /encode HTTP/1.1\r\nHost: gw\r\nContent-Length: 2048\r\n\r\n", 413},
		{"431", "GET /health HTTP/1.1\r\nHost: gw\r\nX-A: " + strings.Repeat("a", 5<<10) + "\r\n\r\n", 431},
		{"400", "GET /health HTTP/1.1\nHost: gw\n\n", 400},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := dialRaw(t, g.Addr())
			r.send(ok + ok + tc.raw)
			for i := 0; i < 2; i++ {
				if a := r.read(); a.status != 200 {
					t.Fatalf("answer %d, to a well-formed request: %d %q", i, a.status, a.body)
				}
			}
			if a := r.read(); a.status != tc.status || a.header.Get("Connection") != "close" {
				t.Fatalf("the refusal: %d %v %q", a.status, a.header, a.body)
			}
			r.wantClosed()
		})
	}
}
