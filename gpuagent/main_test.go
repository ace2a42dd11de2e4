package gpuagent

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"go.uber.org/zap"

	"github.com/encgate/encgate/gpuagent/mooncake"
	"github.com/encgate/encgate/internal/clock"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(removeAfter{m})
}

// removeAfter runs the tests, then removes the exporter this test binary
// built (cuda_fake_test.go).
type removeAfter struct{ m *testing.M }

func (r removeAfter) Run() int {
	code := r.m.Run()
	if exporterPath != "" {
		_ = os.RemoveAll(filepath.Dir(exporterPath))
	}
	return code
}

// client never keeps connections alive, so no client goroutine outlives a
// test. A URL whose host is a socketHost dials that agent's Unix socket.
var client = &http.Client{
	Timeout: 30 * time.Second,
	Transport: &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		if path, ok := sockets.Load(addr); ok {
			return (&net.Dialer{}).DialContext(ctx, "unix", path.(string))
		}
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}},
}

// sockets maps a socketHost's host:port to the Unix socket it stands for.
var (
	sockets  sync.Map
	sockSeen atomic.Int64
)

// socketHost registers path and returns a host:port for URLs that reach it.
func socketHost(path string) string {
	host := fmt.Sprintf("agent-%d.sock:80", sockSeen.Add(1))
	sockets.Store(host, path)
	return host
}

// testToken is the control token of every test agent; do sends it.
const testToken = "test-token-0123456789"

// socketPath is a fresh path for an agent's Unix socket, short enough for
// sun_path whatever the test's name, removed at test end.
func socketPath(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "ag")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return filepath.Join(dir, "agent.sock")
}

// testAgent is a started agent with its addresses and registry: base is the
// TCP door (/send), ctl the Unix socket (staging), admin the admin listener.
type testAgent struct {
	*Agent
	base  string
	ctl   string
	admin string
	reg   *prometheus.Registry
}

// startAgent runs an agent on loopback ports; mutate changes the config,
// before (when set) the Agent before Start. Shut down at test end.
func startAgent(t *testing.T, mutate func(*Config), clk clock.Clock, before func(*Agent)) *testAgent {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Control.Socket, cfg.Control.Token = socketPath(t), testToken
	cfg.Transfer.Timeout = 10e9
	if mutate != nil {
		mutate(&cfg)
	}
	reg := prometheus.NewRegistry()
	a, err := New(cfg, Deps{Log: zap.NewNop(), Registry: reg, Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	if before != nil {
		before(a)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := a.Shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
		if held, n := a.store.usage(); held != 0 || n != 0 {
			t.Errorf("after shutdown %d bytes in %d entries still held", held, n)
		}
	})
	return &testAgent{Agent: a, base: "http://" + a.Addr(), ctl: "http://" + socketHost(a.SocketPath()),
		admin: "http://" + a.AdminAddr(), reg: reg}
}

// startReceiver runs a Mooncake TCP receiver with one 1MiB buffer.
func startReceiver(t *testing.T) *mooncake.Receiver {
	t.Helper()
	return startReceiverOf(t, 1<<20)
}

// startReceiverOf runs a Mooncake TCP receiver with one buffer of n bytes.
func startReceiverOf(t *testing.T, n int) *mooncake.Receiver {
	t.Helper()
	r, err := mooncake.NewReceiver(mooncake.ReceiverConfig{
		HandshakeListen: "127.0.0.1:0", DataListen: "127.0.0.1:0", AdvertiseHost: "127.0.0.1",
		Buffers: []int{n}, ProtoVersion: 2,
	}, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r
}

// base is the receiver's first buffer address.
func base(t *testing.T, r *mooncake.Receiver) uint64 {
	t.Helper()
	bufs := r.Buffers()
	if len(bufs) == 0 {
		t.Fatal("receiver has no buffers")
	}
	return bufs[0].Addr
}

// reply is a received response.
type reply struct {
	status int
	ctype  string
	body   string
}

// do sends a request with the test agents' control token.
func do(t *testing.T, method, url string, body io.Reader) reply {
	t.Helper()
	return doAs(t, method, url, body, "Bearer "+testToken)
}

// doAs sends a request with authorization as its Authorization header
// (none when empty).
func doAs(t *testing.T, method, url string, body io.Reader, authorization string) reply {
	t.Helper()
	req, err := http.NewRequest(method, url, body)
	if err != nil {
		t.Fatal(err)
	}
	if authorization != "" {
		req.Header.Set("Authorization", authorization)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return reply{status: resp.StatusCode, ctype: resp.Header.Get("Content-Type"), body: string(b)}
}

// stage posts raw bytes for id as [tokens, dim] of dtype.
func (a *testAgent) stage(t *testing.T, id string, tokens, dim int, dtype string, data []byte) reply {
	t.Helper()
	return do(t, http.MethodPost, fmt.Sprintf("%s/v1/stage?req_id=%s&tokens=%d&dim=%d&dtype=%s", a.ctl, id, tokens, dim, dtype),
		bytes.NewReader(data))
}

// stageOK stages a bfloat16 [tokens, dim] embedding of pattern bytes and
// returns them.
func (a *testAgent) stageOK(t *testing.T, id string, tokens, dim int) []byte {
	t.Helper()
	data := pattern(tokens*dim*2, byte(len(id)))
	r := a.stage(t, id, tokens, dim, "bfloat16", data)
	want := fmt.Sprintf(`{"req_id":%q,"embedding_size":%d,"embedding_len":%d,"embedding_dim":%d}`, id, len(data), tokens, dim)
	expect(t, r, http.StatusOK, want)
	return data
}

// ackFrameOf is the ack frame the tests stage for id (the agent treats it as
// opaque bytes; sglang's is a pickled EmbeddingData).
func ackFrameOf(id string) []byte { return []byte("ack-frame-for:" + id) }

// ackOK stages id's ack frame and returns it.
func (a *testAgent) ackOK(t *testing.T, id string) []byte {
	t.Helper()
	frame := ackFrameOf(id)
	r := do(t, http.MethodPost, a.ctl+"/v1/ack?req_id="+id, bytes.NewReader(frame))
	expect(t, r, http.StatusOK, fmt.Sprintf(`{"req_id":%q,"ack_frame_bytes":%d}`, id, len(frame)))
	return frame
}

// stageAcked stages an embedding as stageOK does, and its ack frame, as an
// encoder wired to the agent does before publishing the part's metadata.
func (a *testAgent) stageAcked(t *testing.T, id string, tokens, dim int) []byte {
	t.Helper()
	data := a.stageOK(t, id, tokens, dim)
	a.ackOK(t, id)
	return data
}

// ackSink is a ZMQ PULL socket of go-zeromq/zmq4 bound on a loopback port:
// what an sglang receiver rank binds for its acks. frames gets each message
// received, in order.
type ackSink struct {
	port   int
	frames chan [][]byte
}

// startSink binds a PULL socket, closed at test end.
func startSink(t *testing.T) *ackSink {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	pull := zmq4.NewPull(ctx, zmq4.WithLogger(log.New(io.Discard, "", 0)))
	if err := pull.Listen("tcp://127.0.0.1:0"); err != nil {
		cancel()
		t.Fatal(err)
	}
	s := &ackSink{port: pull.Addr().(*net.TCPAddr).Port, frames: make(chan [][]byte, 64)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			msg, err := pull.Recv()
			if ctx.Err() != nil {
				return
			}
			if err != nil { // a peer closed its connection (zmq4 reports each)
				continue
			}
			select {
			case s.frames <- msg.Frames:
			case <-ctx.Done():
				return
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		_ = pull.Close()
		<-done
	})
	return s
}

// next returns the next message's single frame, failing the test if the
// message has another number of frames or none comes.
func (s *ackSink) next(t *testing.T) []byte {
	t.Helper()
	select {
	case frames := <-s.frames:
		if len(frames) != 1 {
			t.Fatalf("ack on port %d has %d frames, want 1", s.port, len(frames))
		}
		return frames[0]
	case <-time.After(10 * time.Second):
		t.Fatalf("no ack reached port %d", s.port)
		return nil
	}
}

// expectAck fails unless the next message on s is exactly want.
func (s *ackSink) expectAck(t *testing.T, want []byte) {
	t.Helper()
	if got := s.next(t); !bytes.Equal(got, want) {
		t.Fatalf("ack on port %d is %.80q (%d bytes), want %.80q (%d bytes)", s.port, got, len(got), want, len(want))
	}
}

// sendReq is a /send body.
type sendReq struct {
	id      string
	host    string // prefill_host; 127.0.0.1 when empty
	port    int    // embedding_port
	session string
	addr    uint64
	count   int // receive_count; omitted when < 0
}

func (s sendReq) body() string {
	host := s.host
	if host == "" {
		host = "127.0.0.1"
	}
	b := fmt.Sprintf(`{"req_id":%q,"part_idx":0,"embedding_size":0,"embedding_len":0,"embedding_dim":0,"prefill_host":%q,"embedding_port":%d,"session_id":%q,"buffer_address":%d`,
		s.id, host, s.port, s.session, s.addr)
	if s.count >= 0 {
		b += fmt.Sprintf(`,"receive_count":%d`, s.count)
	}
	return b + "}"
}

func (a *testAgent) send(t *testing.T, s sendReq) reply {
	t.Helper()
	return do(t, http.MethodPost, a.base+"/send", strings.NewReader(s.body()))
}

// staged is GET /admin/staged.
func (a *testAgent) staged(t *testing.T) []StagedEntry {
	t.Helper()
	r := do(t, http.MethodGet, a.admin+"/admin/staged", nil)
	if r.status != http.StatusOK {
		t.Fatalf("/admin/staged: %d %s", r.status, r.body)
	}
	var out []StagedEntry
	if err := json.Unmarshal([]byte(r.body), &out); err != nil {
		t.Fatal(err)
	}
	return out
}

// pattern is n non-zero bytes that differ from their neighbours.
func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7) + seed | 1
	}
	return b
}

// expect checks status and exact body.
func expect(t *testing.T, r reply, status int, body string) {
	t.Helper()
	if r.status != status || r.body != body {
		t.Fatalf("got %d %s\nwant %d %s", r.status, r.body, status, body)
	}
}

// expectErr checks an error envelope whose message contains every part.
func expectErr(t *testing.T, r reply, status int, id string, parts ...string) {
	t.Helper()
	var env struct {
		Status  string  `json:"status"`
		Message string  `json:"message"`
		ReqID   *string `json:"req_id"`
	}
	if err := json.Unmarshal([]byte(r.body), &env); err != nil || r.status != status || env.Status != "error" {
		t.Fatalf("got %d %s, want a %d envelope", r.status, r.body, status)
	}
	if r.ctype != "application/json" {
		t.Fatalf("content type %q", r.ctype)
	}
	if (id == "") != (env.ReqID == nil) || (env.ReqID != nil && *env.ReqID != id) {
		t.Fatalf("req_id in %s, want %q", r.body, id)
	}
	for _, p := range parts {
		if !strings.Contains(env.Message, p) {
			t.Fatalf("message %q lacks %q", env.Message, p)
		}
	}
}

// zeros fails unless the receiver's bytes at [addr, addr+n) are all zero.
func zeros(t *testing.T, r *mooncake.Receiver, addr uint64, n int) {
	t.Helper()
	b, err := r.Bytes(addr, n)
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range b {
		if c != 0 {
			t.Fatalf("byte %#x is %#x, want 0", addr+uint64(i), c)
		}
	}
}
