package main

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
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/encgate/encgate/internal/cuda"
)

// Bounds on the steps with a child at the other end. A real driver's cuInit
// takes seconds on some machines; every bound here is far above what a step
// takes, and only keeps a hung child from eating the device time.
const (
	childStartTimeout = 2 * time.Minute // the exporter's handle line, the agent's "agent listening"
	readyTimeout      = 30 * time.Second
	requestTimeout    = 2 * time.Minute
	stopTimeout       = 20 * time.Second // after SIGTERM (or stdin closed), before SIGKILL
	maxReceiverRead   = 64 << 20         // GET /v1/receiver/bytes' bound
)

// mismatchError is a byte that is not the pattern's.
type mismatchError struct {
	where       string
	offset      int64 // of the first bad byte, from the start of the embedding
	size        int64
	got, want   byte
	seed        uint64
	checkedFrom string
}

func (e *mismatchError) Error() string {
	return fmt.Sprintf("%s: first bad byte at offset %d of %d: %#02x, pattern %d has %#02x (%s)",
		e.where, e.offset, e.size, e.got, e.seed, e.want, e.checkedFrom)
}

// verify compares b, bytes off.. of an embedding of size bytes, with the
// pattern for seed, using scratch (len >= len(b)).
func verify(b, scratch []byte, seed uint64, off, size int64, where, from string) error {
	want := scratch[:len(b)]
	cuda.FillPattern(want, seed, off)
	if bytes.Equal(b, want) {
		return nil
	}
	i := 0
	for b[i] == want[i] {
		i++
	}
	return &mismatchError{where: where, offset: off + int64(i), size: size, got: b[i], want: want[i], seed: seed, checkedFrom: from}
}

// syncBuffer is a bytes.Buffer for several writers.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.Write(p)
}

// tail is the last n bytes written.
func (s *syncBuffer) tail(n int) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	b := s.buf.Bytes()
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// exporter is a running cudaexport holding size bytes of device memory.
type exporter struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stderr *syncBuffer
	handle string
	size   int64
	done   chan struct{}
	err    error // cmd.Wait's, once done
}

// startExporter runs cudaexport and reads its handle line.
func startExporter(ctx context.Context, o options, size int64, logTo io.Writer) (*exporter, error) {
	cmd := exec.CommandContext(ctx, o.exporter, "--library", o.library, "--device", strconv.Itoa(o.device),
		"--bytes", strconv.FormatInt(size, 10), "--pattern", strconv.FormatUint(o.seed, 10))
	cmd.SysProcAttr = childAttr()
	x := &exporter{cmd: cmd, stderr: &syncBuffer{}, size: size, done: make(chan struct{})}
	// Interrupted: close its stdin, so it frees its memory and exits; killed
	// stopTimeout later if it has not.
	cmd.Cancel = func() error { return x.stdin.Close() }
	cmd.WaitDelay = stopTimeout
	cmd.Stderr = io.MultiWriter(x.stderr, prefixed(logTo, "cudaexport: "))
	var err error
	if x.stdin, err = cmd.StdinPipe(); err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting the exporter: %w", err)
	}
	lines := make(chan string, 1)
	go func() {
		br := bufio.NewReader(stdout)
		line, _ := br.ReadString('\n')
		lines <- line
		_, _ = io.Copy(io.Discard, br)
		x.err = cmd.Wait()
		close(x.done)
	}()
	var line string
	select {
	case line = <-lines:
	case <-time.After(childStartTimeout):
		_ = x.stop()
		return nil, fmt.Errorf("the exporter printed no handle within %s; its stderr: %s", childStartTimeout, x.stderr.tail(4096))
	case <-ctx.Done():
		_ = x.stop()
		return nil, ctx.Err()
	}
	var e struct {
		Handle string `json:"handle"`
		Bytes  int64  `json:"bytes"`
	}
	if err := json.Unmarshal([]byte(line), &e); err != nil || len(e.Handle) != 2*len(cuda.IPCHandle{}) || e.Bytes != size {
		serr := x.stop()
		return nil, fmt.Errorf("the exporter said %q (%v), exit: %v; its stderr: %s", line, err, serr, x.stderr.tail(4096))
	}
	x.handle = e.Handle
	return x, nil
}

// stop closes the exporter's stdin (it frees its memory and exits 0), and
// kills it if it has not exited within stopTimeout.
func (x *exporter) stop() error {
	_ = x.stdin.Close()
	select {
	case <-x.done:
	case <-time.After(stopTimeout):
		_ = x.cmd.Process.Kill()
		<-x.done
		return fmt.Errorf("the exporter did not exit within %s of its stdin closing; killed", stopTimeout)
	}
	if x.err != nil && x.cmd.ProcessState != nil && !x.cmd.ProcessState.Success() {
		return fmt.Errorf("the exporter: %v; its stderr: %s", x.err, x.stderr.tail(4096))
	}
	return nil
}

// prefixWriter writes each complete line to w with prefix (what is left
// without a newline waits for the rest).
type prefixWriter struct {
	mu      sync.Mutex
	w       io.Writer
	prefix  string
	partial []byte
}

func prefixed(w io.Writer, prefix string) io.Writer { return &prefixWriter{w: w, prefix: prefix} }

func (p *prefixWriter) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.partial = append(p.partial, b...)
	for {
		i := bytes.IndexByte(p.partial, '\n')
		if i < 0 {
			break
		}
		fmt.Fprintf(p.w, "%s%s\n", p.prefix, p.partial[:i])
		p.partial = p.partial[i+1:]
	}
	return len(b), nil
}

// agent is a running `encgate agent`.
type agent struct {
	cmd    *exec.Cmd
	log    *syncBuffer // its stdout and stderr
	listen string      // the TCP door, host:port
	admin  string
	socket string
	done   chan struct{}
	err    error // cmd.Wait's, once done

	unix, tcp *http.Client
}

// agentConfig is the agent's YAML for one pair. Every listener is on port
// 0 of 127.0.0.1: the agent logs the addresses it got ("agent listening"),
// and GET /v1/receiver gives the receiver's session_id.
func agentConfig(o options, socket string, size int64, p pair) string {
	return fmt.Sprintf(`listen: "127.0.0.1:0"
admin_listen: "127.0.0.1:0"
control:
  socket: %q
  socket_mode: "0600"
  insecure: true                # loopback only: no token on the TCP door
staging:
  capacity_bytes: %d
  max_stage_bytes: %d
transfer:
  allow_networks: ["127.0.0.0/8"]
  timeout: 120s
  chunk_bytes: %d
  buffers: %d
cuda:
  mode: required
  library: %q
  capacity_bytes: %d
  lanes: 2
receiver:
  handshake_listen: "127.0.0.1:0"
  data_listen: "127.0.0.1:0"
  advertise_host: "127.0.0.1"
  buffers: [%d]
ack:
  mode: "off"
log:
  level: info
shutdown:
  grace: 5s
`, socket, max(2*size, 1<<30), size, p.chunk, p.buffers, o.library, 2*size, size)
}

// startAgent starts an agent for one pair and waits until /readyz says so.
func (c *check) startAgent(ctx context.Context, size int64, p pair) (*agent, error) {
	c.agents++
	dir := filepath.Join(c.tmp, fmt.Sprintf("agent%d", c.agents))
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, err
	}
	a := &agent{log: &syncBuffer{}, socket: filepath.Join(dir, "agent.sock"), done: make(chan struct{})}
	if len(a.socket) > 107 {
		return nil, fmt.Errorf("the socket path %s is longer than a Unix socket address allows; set TMPDIR to a shorter directory", a.socket)
	}
	config := filepath.Join(dir, "agent.yaml")
	if err := os.WriteFile(config, []byte(agentConfig(c.o, a.socket, size, p)), 0o600); err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, c.o.encgate, "agent", "--config", config)
	cmd.SysProcAttr = childAttr()
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = stopTimeout
	cmd.Stdout = a.log
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	a.cmd = cmd
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting the agent: %w", err)
	}
	listening := make(chan [2]string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			_, _ = a.log.Write(append(sc.Bytes(), '\n'))
			var line struct {
				Msg    string `json:"msg"`
				Listen string `json:"listen"`
				Admin  string `json:"admin_listen"`
			}
			if json.Unmarshal(sc.Bytes(), &line) == nil && line.Msg == "agent listening" {
				select {
				case listening <- [2]string{line.Listen, line.Admin}:
				default:
				}
			}
		}
		_, _ = io.Copy(io.Discard, stderr)
		a.err = cmd.Wait()
		close(a.done)
	}()
	fail := func(format string, args ...any) (*agent, error) {
		serr := a.stop()
		return nil, fmt.Errorf("%s (stop: %v); the agent's log:\n%s", fmt.Sprintf(format, args...), serr, a.log.tail(8192))
	}
	select {
	case addrs := <-listening:
		a.listen, a.admin = addrs[0], addrs[1]
	case <-a.done:
		return fail("the agent exited before listening: %v", a.err)
	case <-time.After(childStartTimeout):
		return fail("the agent did not log \"agent listening\" within %s", childStartTimeout)
	case <-ctx.Done():
		return fail("%v", ctx.Err())
	}
	a.unix = &http.Client{Timeout: requestTimeout, Transport: &http.Transport{
		DisableCompression: true,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", a.socket)
		},
	}}
	a.tcp = &http.Client{Timeout: requestTimeout, Transport: &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 4}}
	deadline := time.Now().Add(readyTimeout)
	for {
		status, _, err := a.do(ctx, a.tcp, http.MethodGet, "http://"+a.admin+"/readyz", nil)
		if err == nil && status == http.StatusOK {
			return a, nil
		}
		if time.Now().After(deadline) {
			return fail("/readyz did not answer 200 within %s (last: %d, %v)", readyTimeout, status, err)
		}
		select {
		case <-a.done:
			return fail("the agent exited before it was ready: %v", a.err)
		case <-ctx.Done():
			return fail("%v", ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// do makes one request and reads the whole answer.
func (a *agent) do(ctx context.Context, cl *http.Client, method, u string, body []byte) (int, []byte, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return 0, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := cl.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// stop sends SIGTERM (the agent drains, frees its device memory and exits)
// and kills the agent if it has not exited within stopTimeout.
func (a *agent) stop() error {
	if a.unix != nil {
		a.unix.CloseIdleConnections()
		a.tcp.CloseIdleConnections()
	}
	select {
	case <-a.done:
	default:
		_ = a.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-a.done:
		case <-time.After(stopTimeout):
			_ = a.cmd.Process.Kill()
			<-a.done
			return fmt.Errorf("the agent did not exit within %s of SIGTERM; killed", stopTimeout)
		}
	}
	var exit *exec.ExitError
	if errors.As(a.err, &exit) {
		return fmt.Errorf("the agent exited with %v", a.err)
	}
	return nil
}

// dims are a stage's tokens, dim and dtype for size bytes: bfloat16 when
// the size is even, else a one-byte dtype; dim the largest power of two up
// to 4096 that divides the elements.
func dims(size int64) (tokens, dim int64, dtype string) {
	elem, dtype := int64(2), "bfloat16"
	if size%2 != 0 {
		elem, dtype = 1, "float8_e4m3fn"
	}
	n := size / elem
	dim = 4096
	for n%dim != 0 {
		dim /= 2
	}
	return n / dim, dim, dtype
}

// endToEnd starts an agent for p, stages the exporter's memory by handle,
// sends it into the agent's own receiver, checks every byte there, and
// times c.o.rounds more /sends. verified is called once every byte matched.
func (c *check) endToEnd(ctx context.Context, x *exporter, size int64, p pair, verified func()) (times []time.Duration, err error) {
	a, err := c.startAgent(ctx, size, p)
	if err != nil {
		return nil, err
	}
	defer func() {
		if serr := a.stop(); serr != nil {
			err = errors.Join(err, fmt.Errorf("%w; the agent's log:\n%s", serr, a.log.tail(8192)))
		}
	}()
	withLog := func(err error) error {
		var bad *mismatchError
		if err == nil || errors.As(err, &bad) || ctx.Err() != nil {
			return err
		}
		return fmt.Errorf("%w; the agent's log:\n%s", err, a.log.tail(8192))
	}

	// The receiver: its session and buffer.
	status, body, err := a.do(ctx, a.tcp, http.MethodGet, "http://"+a.listen+"/v1/receiver", nil)
	if err != nil || status != http.StatusOK {
		return nil, withLog(fmt.Errorf("GET /v1/receiver: %d %s %v", status, body, err))
	}
	var recv struct {
		SessionID string `json:"session_id"`
		Buffers   []struct {
			Addr   uint64 `json:"addr"`
			Length uint64 `json:"length"`
		} `json:"buffers"`
	}
	if err := json.Unmarshal(body, &recv); err != nil || len(recv.Buffers) == 0 || recv.Buffers[0].Length < uint64(size) {
		return nil, withLog(fmt.Errorf("GET /v1/receiver said %s (%v): want a buffer of at least %d bytes", body, err, size))
	}
	addr := recv.Buffers[0].Addr

	// The receiver's buffer must not hold the pattern before the send, or
	// the check after it would prove nothing.
	head := min(size, 4096)
	before, err := c.receiverBytes(ctx, a, addr, 0, head)
	if err != nil {
		return nil, withLog(err)
	}
	if verify(before, make([]byte, head), c.o.verifySeed, 0, size, "", "") == nil {
		return nil, fmt.Errorf("the receiver's fresh buffer already holds the pattern's first %d bytes: the check would prove nothing", head)
	}

	// Stage by handle, over the Unix socket.
	tokens, dim, dtype := dims(size)
	id := fmt.Sprintf("gpucheck-%d-%d-%d", size, p.chunk, p.buffers)
	q := url.Values{"req_id": {id}, "tokens": {strconv.FormatInt(tokens, 10)}, "dim": {strconv.FormatInt(dim, 10)},
		"dtype": {dtype}, "source": {"cuda"}, "device": {strconv.Itoa(c.o.device)}, "handle": {x.handle}, "offset": {"0"}}
	t0 := time.Now()
	status, body, err = a.do(ctx, a.unix, http.MethodPost, "http://agent/v1/stage?"+q.Encode(), nil)
	c.logf("size %s, %s: stage by handle answered %d in %.2f ms", sizeName(size), p, status, float64(time.Since(t0).Microseconds())/1000)
	if err != nil || status != http.StatusOK {
		return nil, withLog(fmt.Errorf("POST /v1/stage (source=cuda): %d %s %v", status, body, err))
	}
	var staged struct {
		EmbeddingSize int64 `json:"embedding_size"`
	}
	if err := json.Unmarshal(body, &staged); err != nil || staged.EmbeddingSize != size {
		return nil, withLog(fmt.Errorf("POST /v1/stage answered %s (%v), want embedding_size %d", body, err, size))
	}

	// sglang's /send, aimed at the receiver; no receive_count, so the entry
	// stays staged for the timed rounds.
	send, err := json.Marshal(map[string]any{
		"req_id": id, "prefill_host": "127.0.0.1", "embedding_port": 9, "session_id": recv.SessionID,
		"buffer_address": addr, "part_idx": 0,
	})
	if err != nil {
		return nil, err
	}
	sendOnce := func() (time.Duration, error) {
		t0 := time.Now()
		status, body, err := a.do(ctx, a.tcp, http.MethodPost, "http://"+a.listen+"/send", send)
		d := time.Since(t0)
		if err != nil || status != http.StatusOK || string(body) != "null" {
			return d, withLog(fmt.Errorf("POST /send: %d %s %v", status, body, err))
		}
		return d, nil
	}
	if _, err := sendOnce(); err != nil {
		return nil, err
	}
	where := fmt.Sprintf("end to end (exporter → agent stage by handle → /send → receiver), size %s, %s", sizeName(size), p)
	scratch := make([]byte, min(size, maxReceiverRead))
	for off := int64(0); off < size; off += maxReceiverRead {
		n := min(maxReceiverRead, size-off)
		b, err := c.receiverBytes(ctx, a, addr, off, n)
		if err != nil {
			return nil, withLog(err)
		}
		if err := verify(b, scratch, c.o.verifySeed, off, size, where, "read back with GET /v1/receiver/bytes"); err != nil {
			return nil, err
		}
	}
	c.verified.transfers++
	c.verified.bytes += size
	verified()
	fmt.Fprintf(c.stdout, "verified: %s: all %d bytes at the receiver match pattern %d\n", where, size, c.o.verifySeed)

	for range c.o.rounds {
		d, err := sendOnce()
		if err != nil {
			return nil, err
		}
		times = append(times, d)
	}
	return times, nil
}

// receiverBytes is GET /v1/receiver/bytes for n bytes at addr+off.
func (c *check) receiverBytes(ctx context.Context, a *agent, addr uint64, off, n int64) ([]byte, error) {
	u := fmt.Sprintf("http://%s/v1/receiver/bytes?addr=%d&len=%d", a.listen, addr+uint64(off), n)
	status, body, err := a.do(ctx, a.tcp, http.MethodGet, u, nil)
	if err != nil || status != http.StatusOK {
		return nil, fmt.Errorf("GET /v1/receiver/bytes at offset %d: %d %.300s %v", off, status, body, err)
	}
	if int64(len(body)) != n {
		return nil, fmt.Errorf("GET /v1/receiver/bytes at offset %d gave %d bytes, want %d", off, len(body), n)
	}
	return body, nil
}
