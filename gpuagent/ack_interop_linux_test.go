package gpuagent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/encgate/encgate/internal/testtool"
)

// pullPeer is the libzmq side of the interop test, run by Debian's python3
// with python3-zmq (pyzmq on libzmq). It binds a PULL socket on loopback,
// prints its port and the frame it expects (pickle.dumps of a small object
// shaped like sglang's EmbeddingData ack, over 255 bytes so ZMTP sends it
// as a long frame), waits for one message, and checks that pickle.loads of
// it equals the object and that nothing else arrived with it.
const pullPeer = `
import base64, pickle, sys, zmq
obj = {"req_id": "interop_local_part_0", "num_parts": 2, "part_idx": 1, "modality": "IMAGE",
       "shape": [64, 256], "dtype": "bfloat16", "send_time": 1718000000.25, "error_msg": None,
       "error_code": 0, "pad": bytes(range(256)) * 2}
frame = pickle.dumps(obj)
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL)
pull.setsockopt(zmq.RCVTIMEO, 30000)
pull.setsockopt(zmq.LINGER, 0)
port = pull.bind_to_random_port("tcp://127.0.0.1")
print(port, base64.b64encode(frame).decode(), flush=True)
try:
    parts = pull.recv_multipart()
except zmq.Again:
    print("no message within 30s", flush=True)
    sys.exit(1)
if len(parts) != 1:
    print("got %d frames, want 1" % len(parts), flush=True)
    sys.exit(1)
if parts[0] != frame:
    print("frame differs from the one staged", flush=True)
    sys.exit(1)
got = pickle.loads(parts[0])
if got != obj:
    print("unpickled %r, want %r" % (got, obj), flush=True)
    sys.exit(1)
print("ok", got["req_id"], flush=True)
pull.close()
ctx.term()
`

// pythonWithZMQ finds a python3 that imports zmq: Debian's /usr/bin/python3
// (where python3-zmq installs) first, then python3 on PATH.
func pythonWithZMQ() (string, bool) {
	cands := []string{"/usr/bin/python3"}
	if p, err := exec.LookPath("python3"); err == nil {
		cands = append(cands, p)
	}
	for _, p := range cands {
		if exec.Command(p, "-c", "import zmq").Run() == nil {
			return p, true
		}
	}
	return "", false
}

func TestAckInteropWithLibzmqPull(t *testing.T) {
	py, ok := pythonWithZMQ()
	if !ok {
		testtool.Missing(t, "python3 with the zmq module", "python3-zmq", "the libzmq interop test needs a real libzmq PULL peer")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, py, "-c", pullPeer)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waited := false
	defer func() {
		if !waited {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}()
	out := bufio.NewScanner(stdout)
	out.Buffer(nil, 1<<20)
	if !out.Scan() {
		t.Fatalf("the python peer printed nothing: %v\n%s", out.Err(), stderr.String())
	}
	portText, frameText, _ := strings.Cut(out.Text(), " ")
	port, err := strconv.Atoi(portText)
	if err != nil {
		t.Fatalf("python peer said %q", out.Text())
	}
	frame, err := base64.StdEncoding.DecodeString(frameText)
	if err != nil {
		t.Fatal(err)
	}

	recv := startReceiver(t)
	a := startAgent(t, nil, nil, nil)
	data := a.stageOK(t, "interop_local_part_0", 8, 8)
	expect(t, a.postAck(t, "interop_local_part_0", frame), http.StatusOK,
		fmt.Sprintf(`{"req_id":"interop_local_part_0","ack_frame_bytes":%d}`, len(frame)))
	expect(t, a.send(t, sendReq{id: "interop_local_part_0", port: port, session: recv.SessionID(), addr: base(t, recv), count: 1}),
		http.StatusOK, "null")
	if got, _ := recv.Bytes(base(t, recv), len(data)); !bytes.Equal(got, data) {
		t.Fatal("bytes not in place")
	}

	var rest []string
	for out.Scan() {
		rest = append(rest, out.Text())
	}
	err = cmd.Wait()
	waited = true
	if err != nil || len(rest) != 1 || rest[0] != "ok interop_local_part_0" {
		t.Fatalf("python peer: %v, said %q\n%s", err, rest, stderr.String())
	}
}
