package gpuagent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/encgate/encgate/internal/cuda/cudatest"
	"github.com/encgate/encgate/internal/sglang"
	"github.com/encgate/encgate/internal/testtool"
)

// The tests of integrations/sglang/encgate_agent.py, the module an sglang
// encoder imports to stage with the agent: python3 runs scripts that use it
// against a real agent, as the node's encoder would.

// pyHelperCommon is the start of every script: the module, the agent at
// argv[1], and the helpers the scripts share.
const pyHelperCommon = `
import base64, os, pickle, sys
import encgate_agent as ea

agent = ea.Agent(sys.argv[1], timeout=20)

def pattern(n, seed):
    return bytes((i * 7 + seed) % 256 for i in range(n))

def frame_of(req_id):
    return ("ack-frame-of:%s;" % req_id).encode() * 20

def expect_error(status, part, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except ea.AgentError as e:
        assert e.status == status and part in e.message, (status, part, e.status, e.message)
        return e
    raise AssertionError("%s%r did not raise AgentError %d" % (fn.__name__, args, status))

def expect_value_error(part, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except ValueError as e:
        assert part in str(e), (part, str(e))
        return
    raise AssertionError("%s%r did not raise ValueError" % (fn.__name__, args))
`

// pyStager stages one part each way the module offers, a failure and ack
// frames, checks the errors it must see, and prints "ok <pid>".
const pyStager = pyHelperCommon + `
# r-bytes: the request body, from a 2-D view of another format.
data = pattern(8 * 64 * 2, 1)
got = agent.stage_bytes("r-bytes", memoryview(data).cast("H", [8, 64]), 8, 64, "bfloat16")
assert got == {"req_id": "r-bytes", "embedding_size": 1024, "embedding_len": 8, "embedding_dim": 64}, got

# r-memfd: through a memfd the module makes.
mem = bytearray(pattern(16 * 32 * 4, 3))
got = agent.stage_memfd("r-memfd", memoryview(mem).cast("f"), 16, 32, "float32")
assert got == {"req_id": "r-memfd", "embedding_size": 2048, "embedding_len": 16, "embedding_dim": 32}, got

# r-fd: the caller's own file, at an offset that is not page-aligned.
fd = os.memfd_create("caller", os.MFD_CLOEXEC)
os.write(fd, bytes(4101) + pattern(4 * 16 * 2, 5) + bytes(10))
got = agent.stage_fd("r-fd", fd, 4, 16, "float16", offset=4101)
assert got == {"req_id": "r-fd", "embedding_size": 128, "embedding_len": 4, "embedding_dim": 16}, got
# The agent checks the file's size: a 400 answer, with a descriptor passed.
e = expect_error(400, "fewer than offset 4101 + 256", agent.stage_fd, "r-short-fd", fd, 8, 16, "float16", offset=4101)
assert e.req_id == "r-short-fd" and e.retry_after is None, vars(e)
os.close(fd)

got = agent.fail("r-fail", "CUDA out of memory")
assert got == {"req_id": "r-fail", "error": "CUDA out of memory"}, got

for rid in ("r-bytes", "r-memfd", "r-fd"):
    f = frame_of(rid)
    got = agent.stage_ack(rid, f)
    assert got == {"req_id": rid, "ack_frame_bytes": len(f)}, got

# Staged already: 409, with the req_id.
e = expect_error(409, "req_id=r-bytes is already staged", agent.stage_bytes, "r-bytes", data, 8, 64, "bfloat16")
assert e.req_id == "r-bytes" and e.retry_after is None, vars(e)
# The same with a body far larger than the socket's buffers: the agent
# answers without reading it, and the module reports that answer, not the
# broken pipe.
expect_error(409, "req_id=r-bytes is already staged", agent.stage_bytes, "r-bytes", bytes(16 << 20), 8192, 1024, "bfloat16")
expect_error(409, "already has a different ack frame", agent.stage_ack, "r-bytes", b"another frame")

# Refused before anything is sent.
expect_value_error("data has 1023 bytes, want tokens*dim*element_size = 8*64*2 = 1024", agent.stage_bytes, "r-short", data[:-1], 8, 64, "bfloat16")
expect_value_error("data has 1023 bytes", agent.stage_memfd, "r-short", data[:-1], 8, 64, "bfloat16")
expect_value_error("unsupported dtype 'int8'", agent.stage_bytes, "r-short", data, 8, 128, "int8")
expect_value_error("tokens must be", agent.stage_bytes, "r-short", b"", 0, 64, "bfloat16")
expect_value_error("empty ack frame", agent.stage_ack, "r-short", b"")
expect_value_error("message must be", agent.fail, "r-short", "")
expect_value_error("req_id must be", agent.fail, "", "x")
print("ok", os.getpid(), flush=True)
`

// pyBusy expects its stage refused with 503 and Retry-After (the agent's
// one stage slot is held by the Go test), then checks the module's errors
// when no agent answers, and prints "ok".
const pyBusy = pyHelperCommon + `
import socket, tempfile
e = expect_error(503, "stages are already in progress (staging.max_concurrent); retry req_id=busy",
                 agent.stage_bytes, "busy", pattern(64, 1), 4, 8, "bfloat16")
assert e.retry_after == 1.0 and e.req_id == "busy", vars(e)
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "mute.sock")
    try:
        ea.Agent(path).fail("x", "y")
        raise AssertionError("no agent, yet no error")
    except FileNotFoundError:
        pass
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(path)
    mute.listen(1)  # never accepts, never answers
    try:
        ea.Agent(path, timeout=0.2).fail("x", "y")
        raise AssertionError("a mute agent, yet no timeout")
    except socket.timeout:
        pass
    mute.close()
print("ok", flush=True)
`

// pyPart is the part and ack frame of TestASecondStagerCannotTakeThePart:
// an object shaped like sglang's EmbeddingData ack, pickled by the encoder
// and unpickled by the libzmq PULL peer.
const pyPart = `
OBJ = {"req_id": "P", "num_parts": 1, "part_idx": 0, "modality": "IMAGE", "shape": [4, 32],
       "dtype": "bfloat16", "send_time": 1718000000.5, "error_msg": None, "error_code": 0,
       "pad": bytes(range(256))}
`

// pyEncoder stages P and its ack frame, prints "staged <pid> <frame in
// base64>", and waits for "go" on stdin; then, Q's ack frame having been
// staged by its parent (the Go test), it checks that each of its stages of
// Q is refused naming the parent, and prints "refused".
const pyEncoder = pyHelperCommon + pyPart + `
frame = pickle.dumps(OBJ)
agent.stage_bytes("P", pattern(4 * 32 * 2, 1), 4, 32, "bfloat16")
agent.stage_ack("P", frame)
print("staged", os.getpid(), base64.b64encode(frame).decode(), flush=True)
if sys.stdin.readline().strip() != "go":
    sys.exit("no go")
other = "req_id=Q was staged by another process (pid %d (uid %d))" % (os.getppid(), os.getuid())
for e in (expect_error(409, other, agent.stage_bytes, "Q", pattern(256, 1), 4, 32, "bfloat16"),
          expect_error(409, other, agent.fail, "Q", "encode failed"),
          expect_error(409, other, agent.stage_ack, "Q", frame)):
    assert e.req_id == "Q", vars(e)
print("refused", flush=True)
`

// pyPullPeer is a libzmq PULL socket (python3-zmq) on loopback: it prints
// its port, takes one message and checks that it is a single frame that
// unpickles to the encoder's object, then prints "ok <req_id>".
const pyPullPeer = pyPart + `
import pickle, sys, zmq
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL)
pull.setsockopt(zmq.RCVTIMEO, 30000)
pull.setsockopt(zmq.LINGER, 0)
print(pull.bind_to_random_port("tcp://127.0.0.1"), flush=True)
try:
    parts = pull.recv_multipart()
except zmq.Again:
    sys.exit("no message within 30s")
if len(parts) != 1:
    sys.exit("got %d frames, want 1" % len(parts))
got = pickle.loads(parts[0])
if got != OBJ:
    sys.exit("unpickled %r, want %r" % (got, OBJ))
print("ok", got["req_id"], flush=True)
pull.close()
ctx.term()
`

// python3 finds a python3 (>= 3.9, for socket.send_fds) for the helper's
// tests, skipping the test when there is none.
func python3(t *testing.T) string {
	t.Helper()
	var cands []string
	if p, err := exec.LookPath("python3"); err == nil {
		cands = append(cands, p)
	}
	cands = append(cands, "/usr/bin/python3")
	for _, p := range cands {
		if exec.Command(p, "-c", "import sys; sys.exit(sys.version_info < (3, 9))").Run() == nil {
			return p
		}
	}
	testtool.Missing(t, "python3 >= 3.9 (on PATH or /usr/bin/python3)", "python3", "the tests of integrations/sglang/encgate_agent.py need one")
	return ""
}

// pyProc is a running python script whose stdout lines are its signals.
type pyProc struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	out    *bufio.Scanner
	stderr *bytes.Buffer
	waited bool
}

// startPy runs script with py, with integrations/sglang on PYTHONPATH, for
// at most a minute; it is killed at test end if still running.
func startPy(t *testing.T, py, script string, args ...string) *pyProc {
	t.Helper()
	return startPyAs(t, nil, py, script, args...)
}

// startPyAs is startPy as the user cred names (nil: this process's).
func startPyAs(t *testing.T, cred *syscall.Credential, py, script string, args ...string) *pyProc {
	t.Helper()
	dir, err := filepath.Abs("../integrations/sglang")
	if err != nil {
		t.Fatal(err)
	}
	module, err := os.ReadFile(filepath.Join(dir, "encgate_agent.py"))
	if err != nil {
		t.Fatal(err)
	}
	if cred != nil { // another user may not reach the checkout: give it a copy
		dir = publicDir(t)
		if err := os.WriteFile(filepath.Join(dir, "encgate_agent.py"), module, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	cmd := exec.CommandContext(ctx, py, append([]string{"-c", script}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Credential: cred}
	cmd.WaitDelay = 5 * time.Second
	path := dir
	if old := os.Getenv("PYTHONPATH"); old != "" {
		path += string(os.PathListSeparator) + old
	}
	cmd.Env = append(os.Environ(), "PYTHONPATH="+path, "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1")
	p := &pyProc{cmd: cmd, stderr: &bytes.Buffer{}}
	cmd.Stderr = p.stderr
	if p.stdin, err = cmd.StdinPipe(); err != nil {
		cancel()
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatal(err)
	}
	p.out = bufio.NewScanner(stdout)
	p.out.Buffer(nil, 1<<20)
	t.Cleanup(func() {
		if !p.waited {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		cancel()
	})
	return p
}

// publicDir is a fresh directory every user can enter, removed at test end.
func publicDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "encgate-pub-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// line returns the script's next stdout line, failing the test (with its
// stderr) if it ends first.
func (p *pyProc) line(t *testing.T) string {
	t.Helper()
	if p.out.Scan() {
		return p.out.Text()
	}
	err := p.cmd.Wait()
	p.waited = true
	t.Fatalf("the python script ended (%v) without its line: %v\n%s", err, p.out.Err(), p.stderr.String())
	return ""
}

// say writes a line to the script's stdin.
func (p *pyProc) say(t *testing.T, s string) {
	t.Helper()
	if _, err := io.WriteString(p.stdin, s+"\n"); err != nil {
		t.Fatalf("telling the python script %q: %v\n%s", s, err, p.stderr.String())
	}
}

// wait fails unless the script exits 0 with nothing more on stdout.
func (p *pyProc) wait(t *testing.T) {
	t.Helper()
	_ = p.stdin.Close()
	var rest []string
	for p.out.Scan() {
		rest = append(rest, p.out.Text())
	}
	err := p.cmd.Wait()
	p.waited = true
	if err != nil || len(rest) != 0 {
		t.Fatalf("python script: %v, then said %q\n%s", err, rest, p.stderr.String())
	}
}

// pyPattern is the scripts' pattern(n, seed).
func pyPattern(n, seed int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte((i*7 + seed) % 256)
	}
	return b
}

// pyFrameOf is the scripts' frame_of(req_id).
func pyFrameOf(id string) []byte { return bytes.Repeat([]byte("ack-frame-of:"+id+";"), 20) }

// stagedBy returns /admin/staged's rows by req_id.
func stagedBy(t *testing.T, a *testAgent) map[string]StagedEntry {
	t.Helper()
	rows := map[string]StagedEntry{}
	for _, e := range a.staged(t) {
		rows[e.ReqID] = e
	}
	return rows
}

func TestPythonHelperAgainstTheAgent(t *testing.T) {
	py := python3(t)
	recv := startReceiver(t)
	a := startAgent(t, nil, nil, nil)

	p := startPy(t, py, pyStager, a.SocketPath())
	line := p.line(t)
	pid, err := strconv.Atoi(strings.TrimPrefix(line, "ok "))
	if err != nil || !strings.HasPrefix(line, "ok ") {
		t.Fatalf("the script said %q\n%s", line, p.stderr.String())
	}
	if pid != p.cmd.Process.Pid {
		t.Fatalf("the script says pid %d, started as %d", pid, p.cmd.Process.Pid)
	}
	p.wait(t) // what it staged outlives it: the agent holds it

	owner := fmt.Sprintf("pid %d (uid %d)", pid, os.Getuid())
	rows := stagedBy(t, a)
	want := map[string]struct {
		state, source string
		bytes         int64
		ack           bool
	}{
		"r-bytes": {"staged", "body", 1024, true},
		"r-memfd": {"staged", "fd", 2048, true},
		"r-fd":    {"staged", "fd", 128, true},
		"r-fail":  {"failed", "", 0, false},
	}
	if len(rows) != len(want) {
		t.Fatalf("staged %+v, want only %v", rows, want)
	}
	for id, w := range want {
		r, ok := rows[id]
		if !ok || r.State != w.state || r.Source != w.source || r.Bytes != w.bytes || r.AckFrame != w.ack || r.StagedBy != owner {
			t.Fatalf("%s staged as %+v, want %+v staged by %s", id, r, w, owner)
		}
		if w.ack && r.AckFrameBytes != len(pyFrameOf(id)) {
			t.Fatalf("%s has a %d-byte ack frame, want %d", id, r.AckFrameBytes, len(pyFrameOf(id)))
		}
	}
	if r := rows["r-fail"]; r.Error != "CUDA out of memory" {
		t.Fatalf("r-fail recorded %q", r.Error)
	}

	sink := startSink(t)
	b := base(t, recv)
	for i, part := range []struct {
		id   string
		data []byte
	}{
		{"r-bytes", pyPattern(1024, 1)},
		{"r-memfd", pyPattern(2048, 3)},
		{"r-fd", pyPattern(128, 5)},
	} {
		at := b + uint64(i)*4096
		expect(t, a.send(t, sendReq{id: part.id, port: sink.port, session: recv.SessionID(), addr: at, count: 1}), http.StatusOK, "null")
		if got, _ := recv.Bytes(at, len(part.data)); !bytes.Equal(got, part.data) {
			t.Fatalf("%s: the receiver got %x..., want %x...", part.id, got[:16], part.data[:16])
		}
		sink.expectAck(t, pyFrameOf(part.id))
	}
	expectErr(t, a.send(t, sendReq{id: "r-fail", port: sink.port, session: recv.SessionID(), addr: b + 3*4096, count: 1}),
		http.StatusInternalServerError, "r-fail", sglang.NoEmbedding)
	zeros(t, recv, b+3*4096, 4096)
	if held, n := a.store.usage(); held != 0 || n != 0 {
		t.Fatalf("after the sends %d bytes in %d entries are still held", held, n)
	}
}

func TestPythonHelperReportsBusy(t *testing.T) {
	py := python3(t)
	reserved := make(chan string, 8)
	a := startAgent(t, func(c *Config) { c.Staging.MaxConcurrent = 1 }, nil,
		func(a *Agent) { a.reserved = func(id string) { reserved <- id } })
	// A stage whose body stalls holds the only slot.
	c := a.dialSocket(t)
	if _, err := io.WriteString(c, "POST /v1/stage?req_id=stall&tokens=1&dim=512&dtype=float32 HTTP/1.1\r\nHost: agent\r\nContent-Length: 2048\r\n\r\n0123"); err != nil {
		t.Fatal(err)
	}
	if id := <-reserved; id != "stall" {
		t.Fatalf("reserved %q", id)
	}
	p := startPy(t, py, pyBusy, a.SocketPath())
	if got := p.line(t); got != "ok" {
		t.Fatalf("the script said %q\n%s", got, p.stderr.String())
	}
	p.wait(t)
	if v := testutil.ToFloat64(a.metrics.stagesCut.WithLabelValues(cutBusy)); v != 1 {
		t.Fatalf("stages cut busy = %v, want 1", v)
	}
	// The stalled stage ends with its connection; nothing is left staged.
	_ = c.Close()
	a.stageWait(t)
	if held, n := a.store.usage(); held != 0 || n != 0 {
		t.Fatalf("held %d bytes in %d entries after the stalled stager left", held, n)
	}
}

func TestASecondStagerCannotTakeThePart(t *testing.T) {
	py, ok := pythonWithZMQ()
	if !ok {
		testtool.Missing(t, "python3 with the zmq module", "python3-zmq", "this test's ack goes to a real libzmq PULL peer")
	}
	python3(t) // and one new enough for the module
	recv := startReceiver(t)
	a := startAgent(t, nil, nil, nil)
	b := base(t, recv)

	// The encoder stages P and its ack frame.
	enc := startPy(t, py, pyEncoder, a.SocketPath())
	fields := strings.Fields(enc.line(t))
	if len(fields) != 3 || fields[0] != "staged" {
		t.Fatalf("the encoder said %q\n%s", fields, enc.stderr.String())
	}
	pid, err := strconv.Atoi(fields[1])
	if err != nil || pid != enc.cmd.Process.Pid {
		t.Fatalf("the encoder says pid %q, started as %d", fields[1], enc.cmd.Process.Pid)
	}
	frame, err := base64.StdEncoding.DecodeString(fields[2])
	if err != nil {
		t.Fatal(err)
	}
	owner := fmt.Sprintf("pid %d (uid %d)", pid, os.Getuid())

	// This process is another stager: it may neither replace P's ack frame,
	// nor record P as failed, nor stage P's embedding.
	taken := "req_id=P was staged by another process (" + owner + "); only it may stage"
	expectErr(t, a.postAck(t, "P", []byte("the attacker's pickle")), http.StatusConflict, "P", taken)
	expectErr(t, do(t, http.MethodPost, a.ctl+"/v1/stage?req_id=P&error=attacker", nil), http.StatusConflict, "P", taken)
	expectErr(t, a.stage(t, "P", 4, 32, "bfloat16", make([]byte, 256)), http.StatusConflict, "P", taken)
	if r := stagedBy(t, a)["P"]; r.State != "staged" || r.StagedBy != owner || r.AckFrameBytes != len(frame) || r.Error != "" {
		t.Fatalf("P after the attempts: %+v", r)
	}

	// The reverse: this process stages Q's ack frame first; the encoder's
	// stages of Q are refused, naming this process.
	attack := []byte("the attacker's pickle for Q")
	expect(t, a.postAck(t, "Q", attack), http.StatusOK, fmt.Sprintf(`{"req_id":"Q","ack_frame_bytes":%d}`, len(attack)))
	enc.say(t, "go")
	if got := enc.line(t); got != "refused" {
		t.Fatalf("the encoder said %q\n%s", got, enc.stderr.String())
	}
	enc.wait(t)
	if v := testutil.ToFloat64(a.metrics.ownerConflicts); v != 6 {
		t.Fatalf("owner conflicts = %v, want 6", v)
	}

	// P's /send: its bytes, and exactly the encoder's frame at the libzmq
	// receiver.
	pull := startPy(t, py, pyPullPeer)
	port, err := strconv.Atoi(pull.line(t))
	if err != nil {
		t.Fatalf("the PULL peer: %v\n%s", err, pull.stderr.String())
	}
	expect(t, a.send(t, sendReq{id: "P", port: port, session: recv.SessionID(), addr: b, count: 1}), http.StatusOK, "null")
	if got, _ := recv.Bytes(b, 256); !bytes.Equal(got, pyPattern(256, 1)) {
		t.Fatal("P's bytes are not in place")
	}
	if got := pull.line(t); got != "ok P" {
		t.Fatalf("the PULL peer said %q\n%s", got, pull.stderr.String())
	}
	pull.wait(t)

	// Q has no embedding: its /send is refused and the attacker's frame is
	// never pushed.
	sent := testutil.ToFloat64(a.metrics.acks.WithLabelValues(ackSent))
	if sent != 1 {
		t.Fatalf("acks{sent} = %v after P, want 1", sent)
	}
	sink := startSink(t)
	expectErr(t, a.send(t, sendReq{id: "Q", port: sink.port, session: recv.SessionID(), addr: b + 4096, count: 1}),
		http.StatusInternalServerError, "Q", sglang.AlreadyReleasedMessage("Q"))
	zeros(t, recv, b+4096, 4096)
	if v := testutil.ToFloat64(a.metrics.acks.WithLabelValues(ackSent)); v != sent {
		t.Fatalf("acks{sent} = %v after Q's /send, want %v", v, sent)
	}
	select {
	case f := <-sink.frames:
		t.Fatalf("an ack reached Q's destination: %q", f)
	default:
	}
}

// pyCUDA stages through stage_cuda a "tensor" whose memory it allocated on
// the fake CUDA driver ($ENCGATE_CUDA_LIBRARY, through the module's own
// ctypes binding), at an offset inside the allocation as PyTorch's caching
// allocator hands out, then frees it once the agent answered; and checks
// the module's refusals.
const pyCUDA = pyHelperCommon + `
import ctypes
lib = ea._cuda_driver()
def check(rc):
    assert rc == 0, rc
check(lib.cuInit(0))
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
check(lib.cuDeviceGet(ctypes.byref(dev), 0))
check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
check(lib.cuCtxSetCurrent(ctx))
tokens, dim, offset = 64, 100, 8192
n = tokens * dim * 2
base = ctypes.c_uint64()
lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]
lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
check(lib.cuMemAlloc_v2(ctypes.byref(base), offset + n + 4096))
check(lib.cuMemcpyHtoD_v2(base.value + offset, pattern(n, 9), n))

class Device:
    index = 0
class Tensor:
    is_cuda = True
    dtype = "torch.bfloat16"
    shape = (tokens, dim)
    device = Device()
    def __init__(self, ptr): self.ptr = ptr
    def dim(self): return 2
    def is_contiguous(self): return True
    def data_ptr(self): return self.ptr

answer = agent.stage_cuda("py-gpu", Tensor(base.value + offset))
assert answer == {"req_id": "py-gpu", "embedding_size": n, "embedding_len": tokens, "embedding_dim": dim}, answer
check(lib.cuMemFree_v2(base))  # the agent holds its own copy now

class Host(Tensor):
    is_cuda = False
    device = "cpu"
expect_value_error("stage_cuda wants a CUDA tensor", agent.stage_cuda, "py-cpu", Host(0))
expect_value_error("handle must be the 64 bytes", agent.stage_cuda_handle, "py-h", b"short", 0, 4, 8, "bfloat16")
expect_error(400, "cannot open the CUDA IPC handle", agent.stage_cuda_handle, "py-h", b"\x01" * 64, 0, 4, 8, "bfloat16")
print("ok")
`

// The module's stage_cuda against a real agent on the fake driver: the
// bytes a Python process put in device memory reach the receiver, after
// that process freed them.
func TestPythonHelperStagesCUDAMemory(t *testing.T) {
	py := python3(t)
	lib := cudatest.Fake(t)
	t.Setenv("ENCGATE_CUDA_LIBRARY", lib)
	recv := startReceiver(t)
	a := startAgent(t, func(c *Config) {
		c.CUDA.Mode, c.CUDA.Library, c.Ack.Mode = CUDARequired, lib, AckOff
	}, nil, nil)
	p := startPy(t, py, pyCUDA, a.SocketPath())
	if line := p.line(t); line != "ok" {
		t.Fatalf("the script said %q\n%s", line, p.stderr.String())
	}
	p.wait(t)
	at := base(t, recv)
	expect(t, a.send(t, sendReq{id: "py-gpu", port: 9, session: recv.SessionID(), addr: at, count: 1}), http.StatusOK, "null")
	want := pyPattern(64*100*2, 9)
	if got, _ := recv.Bytes(at, len(want)); !bytes.Equal(got, want) {
		t.Fatalf("the receiver got %x..., want %x...", got[:16], want[:16])
	}
}

// On an agent without CUDA, stage_cuda_handle raises AgentError 501 with
// the agent's reason.
func TestPythonHelperCUDAOnAnAgentWithoutCUDA(t *testing.T) {
	py := python3(t)
	a := startAgent(t, func(c *Config) { c.CUDA.Mode = CUDAOff }, nil, nil)
	p := startPy(t, py, pyHelperCommon+`
expect_error(501, "cuda.mode is off in this agent's config", agent.stage_cuda_handle, "py-h", b"\x01" * 64, 0, 4, 8, "bfloat16")
print("ok")
`, a.SocketPath())
	if line := p.line(t); line != "ok" {
		t.Fatalf("the script said %q\n%s", line, p.stderr.String())
	}
	p.wait(t)
}
