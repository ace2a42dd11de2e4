package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/encgate/encgate/gpuagent/acktest"
	"github.com/encgate/encgate/gpuagent/mooncake"
)

// agentProc is an `encgate agent` process whose JSON log lines the test
// reads in order.
type agentProc struct {
	cmd    *exec.Cmd
	lines  chan map[string]any
	exited chan error
	log    bytes.Buffer // every line, for failure messages; read after exited
}

func startAgentProc(t *testing.T, config string) *agentProc {
	t.Helper()
	cmd := exec.Command(encgateBin, "agent", "--config", writeTemp(t, "agent.yaml", config))
	cmd.SysProcAttr = dieWithTest
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &agentProc{cmd: cmd, lines: make(chan map[string]any, 1024), exited: make(chan error, 1)}
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			p.log.Write(sc.Bytes())
			p.log.WriteByte('\n')
			var fields map[string]any
			if json.Unmarshal(sc.Bytes(), &fields) == nil {
				select {
				case p.lines <- fields:
				default:
				}
			}
		}
		_, _ = io.Copy(io.Discard, stderr)
		close(p.lines)
		p.exited <- cmd.Wait() // after every read from the pipe
	}()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
		}
	})
	return p
}

// waitLog returns the fields of the next log line with msg, failing the
// test if the process ends first.
func (p *agentProc) waitLog(t *testing.T, msg string) map[string]any {
	t.Helper()
	timeout := time.After(30 * time.Second)
	for {
		select {
		case fields, ok := <-p.lines:
			if !ok {
				err := <-p.exited
				t.Fatalf("agent exited (%v) before logging %q:\n%s", err, msg, p.log.String())
			}
			if fields["msg"] == msg {
				return fields
			}
		case <-timeout:
			t.Fatalf("agent never logged %q", msg)
		}
	}
}

// TestAgentSIGTERMDrainsAnInFlightSend runs `encgate agent`, holds one
// /send in flight (its ack's receiver keeps the connection open), and sends
// SIGTERM: the agent goes not-ready, stops accepting, finishes the /send
// with 200 once the receiver lets go, and exits 0.
func TestAgentSIGTERMDrainsAnInFlightSend(t *testing.T) {
	recv, err := mooncake.NewReceiver(mooncake.ReceiverConfig{
		HandshakeListen: "127.0.0.1:0", DataListen: "127.0.0.1:0", AdvertiseHost: "127.0.0.1",
		Buffers: []int{1 << 20}, ProtoVersion: 2,
	}, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	if err := recv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = recv.Close() })
	sink, err := acktest.Start(acktest.Options{Hold: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sink.Close() })

	const token = "drain-token-0123456789"
	sockDir, err := os.MkdirTemp("", "ag") // short: a socket path is at most 107 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(sockDir) })
	sock := filepath.Join(sockDir, "agent.sock")
	p := startAgentProc(t, fmt.Sprintf(`listen: "127.0.0.1:0"
admin_listen: "127.0.0.1:0"
control:
  socket: %q
  token_file: %q
ack:
  linger: 60s
shutdown:
  grace: 60s
`, sock, writeTemp(t, "agent.token", token+"\n")))
	ready := p.waitLog(t, "agent listening")
	base, admin := fmt.Sprintf("http://%s", ready["listen"]), fmt.Sprintf("http://%s", ready["admin_listen"])
	client := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	// The node's encoder stages over the agent's Unix socket.
	encoder := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{DisableKeepAlives: true,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		}}}
	post := func(c *http.Client, url string, body []byte) (int, string) {
		req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
		if err != nil {
			return 0, err.Error()
		}
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := c.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	data := bytes.Repeat([]byte{0xA5}, 4*8*2)
	if code, body := post(encoder, "http://agent/v1/stage?req_id=term&tokens=4&dim=8&dtype=bfloat16", data); code != 200 {
		t.Fatalf("stage: %d %s", code, body)
	}
	if code, body := post(encoder, "http://agent/v1/ack?req_id=term", []byte("ack frame")); code != 200 {
		t.Fatalf("ack: %d %s", code, body)
	}
	addr := recv.Buffers()[0].Addr
	type answer struct {
		code int
		body string
	}
	answered := make(chan answer, 1)
	go func() {
		code, body := post(client, base+"/send", []byte(fmt.Sprintf(
			`{"req_id":"term","part_idx":0,"prefill_host":"127.0.0.1","embedding_port":%d,"session_id":%q,"buffer_address":%d,"receive_count":1}`,
			sink.Port(), recv.SessionID(), addr)))
		answered <- answer{code, body}
	}()
	<-sink.Messages() // the ack arrived; the /send waits for the sink to close

	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	stopping := p.waitLog(t, "stopped accepting; finishing in-flight requests")
	if stopping["sends_in_flight"] != 1.0 {
		t.Errorf("draining with %v /sends in flight, want 1", stopping["sends_in_flight"])
	}
	if code, body := getBody(client, admin+"/readyz"); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz while draining: %d %s", code, body)
	}
	if c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://")); err == nil {
		c.Close()
		t.Error("the control listener still accepts while draining")
	}
	select {
	case a := <-answered:
		t.Fatalf("the /send was answered while its ack was held: %+v", a)
	default:
	}

	sink.Release()
	if a := <-answered; a.code != 200 || a.body != "null" {
		t.Fatalf("the in-flight /send got %d %s", a.code, a.body)
	}
	if got, _ := recv.Bytes(addr, len(data)); !bytes.Equal(got, data) {
		t.Fatal("bytes not in place")
	}
	for range p.lines { // the rest of the log, up to the exit
	}
	err = <-p.exited
	var exit *exec.ExitError
	if err != nil && errors.As(err, &exit) {
		t.Fatalf("agent exited %d after the drain:\n%s", exit.ExitCode(), p.log.String())
	} else if err != nil {
		t.Fatal(err)
	}
}
