package gpuagent

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/encgate/encgate/internal/testtool"
)

// dialSocket connects to a's Unix socket as a stager would; the connection
// is closed at test end (or earlier by the test).
func (a *testAgent) dialSocket(t *testing.T) *net.UnixConn {
	t.Helper()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: a.SocketPath(), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// rawUnix sends one HTTP request over the agent's Unix socket, passing f's
// descriptor (when f is not nil) with the request's first bytes, as an
// encoder does for source=fd, and returns the answer.
func (a *testAgent) rawUnix(t *testing.T, head string, body []byte, f *os.File) reply {
	t.Helper()
	c := a.dialSocket(t)
	var oob []byte
	if f != nil {
		oob = syscall.UnixRights(int(f.Fd()))
	}
	if _, _, err := c.WriteMsgUnix([]byte(head), oob, nil); err != nil {
		t.Fatal(err)
	}
	if len(body) > 0 {
		if _, err := c.Write(body); err != nil {
			t.Fatal(err)
		}
	}
	return readReply(t, c)
}

func readReply(t *testing.T, c net.Conn) reply {
	t.Helper()
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return reply{status: resp.StatusCode, ctype: resp.Header.Get("Content-Type"), body: string(b)}
}

// stageFD stages with query, passing f's descriptor.
func (a *testAgent) stageFD(t *testing.T, query string, f *os.File) reply {
	t.Helper()
	return a.rawUnix(t, "POST /v1/stage?"+query+" HTTP/1.1\r\nHost: agent\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", nil, f)
}

func TestStagingIsRefusedOverTCP(t *testing.T) {
	a := startAgent(t, nil, nil, nil)
	// Even with the token: staging is the node's encoder's, over the socket.
	expectErr(t, do(t, http.MethodPost, a.base+"/v1/stage?req_id=tcp&tokens=1&dim=1&dtype=float32", bytes.NewReader(make([]byte, 4))),
		http.StatusForbidden, "tcp", "/v1/stage is accepted only on control.socket", "never over TCP")
	expectErr(t, do(t, http.MethodPost, a.base+"/v1/ack?req_id=tcp", strings.NewReader("attacker's pickle")),
		http.StatusForbidden, "tcp", "/v1/ack is accepted only on control.socket")
	expectErr(t, do(t, http.MethodPost, a.base+"/v1/stage?req_id=tcp&error=x", nil), http.StatusForbidden, "tcp", "only on control.socket")
	if st := a.staged(t); len(st) != 0 {
		t.Fatalf("staged over TCP: %+v", st)
	}
	// And the socket serves nothing but staging.
	expectErr(t, do(t, http.MethodPost, a.ctl+"/send", strings.NewReader(sendReq{id: "x", port: 1, session: "127.0.0.1:1"}.body())),
		http.StatusNotFound, "", "POST /send is not served on control.socket")
}

func TestTheTCPDoorNeedsTheToken(t *testing.T) {
	recv := startReceiver(t)
	a := startAgent(t, nil, nil, nil)
	a.stageAcked(t, "tok", 4, 8)
	sink := startSink(t)
	req := sendReq{id: "tok", port: sink.port, session: recv.SessionID(), addr: base(t, recv), count: 1}
	for _, tc := range []struct{ name, authorization, want string }{
		{"none", "", `needs "Authorization: Bearer <control token>"`},
		{"wrong", "Bearer " + strings.Repeat("x", len(testToken)), "is not this agent's control token"},
		{"one byte off", "Bearer " + testToken[:len(testToken)-1] + "0", "is not this agent's control token"},
		{"another scheme", "Basic " + testToken, `needs "Authorization: Bearer`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			expectErr(t, doAs(t, http.MethodPost, a.base+"/send", strings.NewReader(req.body()), tc.authorization),
				http.StatusUnauthorized, "", tc.want)
			expectErr(t, doAs(t, http.MethodGet, a.base+"/v1/receiver", nil, tc.authorization), http.StatusUnauthorized, "", tc.want)
		})
	}
	if v := testutil.ToFloat64(a.metrics.unauthorized.WithLabelValues("control")); v != 8 {
		t.Fatalf("unauthorized{control} = %v, want 8", v)
	}
	if st := recv.Stats(); st.DataConns != 0 {
		t.Fatalf("a refused /send reached the receiver: %+v", st)
	}
	// The refused /sends released nothing: with the token it goes through.
	expect(t, a.send(t, req), http.StatusOK, "null")
	sink.expectAck(t, ackFrameOf("tok"))
}

func TestNoTokenClosesTheTCPDoorAndInsecureOpensIt(t *testing.T) {
	closed := startAgent(t, func(c *Config) { c.Control.Token = "" }, nil, nil)
	expectErr(t, do(t, http.MethodPost, closed.base+"/send", strings.NewReader(sendReq{id: "x", port: 1, session: "127.0.0.1:1"}.body())),
		http.StatusUnauthorized, "", "no control.token_file (or control.token) configured, so its TCP door is closed")
	open := startAgent(t, func(c *Config) { c.Control.Token, c.Control.Insecure = "", true }, nil, nil)
	expectErr(t, doAs(t, http.MethodPost, open.base+"/send", strings.NewReader(sendReq{id: "x", port: 1, session: "127.0.0.1:1"}.body()), ""),
		http.StatusInternalServerError, "x", "already released")
}

func TestTokenFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "agent.token")
	if err := os.WriteFile(path, []byte("from-a-file-0123456789\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	a := startAgent(t, func(c *Config) { c.Control.Token, c.Control.TokenFile = "", path }, nil, nil)
	expectErr(t, do(t, http.MethodPost, a.base+"/send", strings.NewReader(sendReq{id: "x", port: 1, session: "127.0.0.1:1"}.body())),
		http.StatusUnauthorized, "", "is not this agent's control token")
	expectErr(t, doAs(t, http.MethodPost, a.base+"/send", strings.NewReader(sendReq{id: "x", port: 1, session: "127.0.0.1:1"}.body()),
		"Bearer from-a-file-0123456789"), http.StatusInternalServerError, "x", "already released")
}

func TestAdminToken(t *testing.T) {
	const admin = "admin-token-0123456789"
	a := startAgent(t, func(c *Config) { c.Admin.Token = admin }, nil, nil)
	for _, path := range []string{"/admin/staged", "/debug/pprof/", "/debug/pprof/cmdline"} {
		expectErr(t, doAs(t, http.MethodGet, a.admin+path, nil, ""), http.StatusUnauthorized, "", `needs "Authorization: Bearer <admin.token>"`)
		// The control token is not the admin token.
		expectErr(t, do(t, http.MethodGet, a.admin+path, nil), http.StatusUnauthorized, "", "is not admin.token")
		if r := doAs(t, http.MethodGet, a.admin+path, nil, "Bearer "+admin); r.status != http.StatusOK {
			t.Fatalf("%s with the admin token: %d %s", path, r.status, r.body)
		}
	}
	for _, path := range []string{"/healthz", "/readyz", "/metrics"} {
		if r := doAs(t, http.MethodGet, a.admin+path, nil, ""); r.status != http.StatusOK {
			t.Fatalf("%s is for probes and scrapers: %d", path, r.status)
		}
	}
	if v := testutil.ToFloat64(a.metrics.unauthorized.WithLabelValues("admin")); v != 6 {
		t.Fatalf("unauthorized{admin} = %v", v)
	}
}

func TestTheSocketFile(t *testing.T) {
	a := startAgent(t, func(c *Config) { c.Control.SocketMode = "0600" }, nil, nil)
	fi, err := os.Lstat(a.SocketPath())
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket file %v", fi.Mode())
	}
	// A second agent on the same socket is refused while the first lives.
	cfg := a.cfg
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	b, err := New(cfg, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Start(); err == nil || !strings.Contains(err.Error(), "another process is listening on") {
		t.Fatalf("second agent: %v", err)
	}

	// A stale socket (nobody listening) is replaced; anything else is not.
	stale := socketPath(t)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: stale, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	c := startAgent(t, func(c *Config) { c.Control.Socket = stale }, nil, nil)
	c.stageOK(t, "after-stale", 1, 1)

	notSock := socketPath(t)
	if err := os.WriteFile(notSock, []byte("precious"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg = DefaultConfig()
	cfg.Listen, cfg.AdminListen, cfg.Control.Socket = "127.0.0.1:0", "127.0.0.1:0", notSock
	d, err := New(cfg, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(); err == nil || !strings.Contains(err.Error(), "exists and is not a socket") {
		t.Fatalf("start over a file: %v", err)
	}
	if b, _ := os.ReadFile(notSock); string(b) != "precious" {
		t.Fatal("the file was touched")
	}
}

func TestDescriptorsNotTakenAreClosed(t *testing.T) {
	a := startAgent(t, nil, nil, nil)
	f := memfd(t, 0, make([]byte, 16))
	// A descriptor passed with a body stage is not used, and not kept for
	// the connection's next request.
	c := a.dialSocket(t)
	head := "POST /v1/stage?req_id=body&tokens=2&dim=2&dtype=float32 HTTP/1.1\r\nHost: agent\r\nContent-Length: 16\r\n\r\n"
	if _, _, err := c.WriteMsgUnix(append([]byte(head), make([]byte, 16)...), syscall.UnixRights(int(f.Fd())), nil); err != nil {
		t.Fatal(err)
	}
	expect(t, readReply(t, c), http.StatusOK, `{"req_id":"body","embedding_size":16,"embedding_len":2,"embedding_dim":2}`)
	if _, err := io.WriteString(c, "POST /v1/stage?req_id=fd&tokens=2&dim=2&dtype=float32&source=fd HTTP/1.1\r\nHost: agent\r\nContent-Length: 0\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	expectErr(t, readReply(t, c), http.StatusBadRequest, "fd", "no file descriptor came with the request")
}

// TestStalledStagesAreReleased is the starvation attack: four stages that
// declare 1GiB each and send ten bytes hold the whole capacity until
// control.body_timeout passes; then each gets 408, its reservation goes, and
// a legitimate stage succeeds.
func TestStalledStagesAreReleased(t *testing.T) {
	reserved := make(chan string, 8)
	a := startAgent(t, func(c *Config) {
		c.Staging.CapacityBytes = 4 << 30
		c.Control.BodyTimeout = 300e6
	}, nil, func(a *Agent) { a.reserved = func(id string) { reserved <- id } })
	const gib = 1 << 30
	var conns []*net.UnixConn
	for i := range 4 {
		c := a.dialSocket(t)
		head := fmt.Sprintf("POST /v1/stage?req_id=stall-%d&tokens=%d&dim=1024&dtype=bfloat16 HTTP/1.1\r\nHost: agent\r\nContent-Length: %d\r\n\r\n0123456789",
			i, gib/2048, gib)
		if _, err := io.WriteString(c, head); err != nil {
			t.Fatal(err)
		}
		<-reserved
		conns = append(conns, c)
	}
	// While they stall, they hold everything, and they are visible.
	if held, _ := a.store.usage(); held != 4*gib {
		t.Fatalf("held %d", held)
	}
	st := a.staged(t)
	if len(st) != 4 || st[0].State != "staging" || st[0].StagedBy == "" {
		t.Fatalf("staged = %+v", st)
	}
	expectErr(t, a.stage(t, "starved", 1, 1, "float32", make([]byte, 4)), http.StatusInsufficientStorage, "starved", "capacity_bytes")
	<-reserved // the refused stage's attempt
	for i, c := range conns {
		expectErr(t, readReply(t, c), http.StatusRequestTimeout, fmt.Sprintf("stall-%d", i), "sent nothing for control.body_timeout (300ms)")
	}
	if held, n := a.store.usage(); held != 0 || n != 0 {
		t.Fatalf("after the stalls %d bytes in %d entries", held, n)
	}
	a.stageOK(t, "legit", 4, 8)
	<-reserved
	if v := testutil.ToFloat64(a.metrics.stagesCut.WithLabelValues(cutStalled)); v != 4 {
		t.Fatalf("stages_abandoned{stalled} = %v", v)
	}
}

func TestConcurrentStagesAreBounded(t *testing.T) {
	reserved := make(chan string, 8)
	a := startAgent(t, func(c *Config) { c.Staging.MaxConcurrent = 2 }, nil, func(a *Agent) { a.reserved = func(id string) { reserved <- id } })
	var conns []*net.UnixConn
	for i := range 2 {
		c := a.dialSocket(t)
		if _, err := fmt.Fprintf(c, "POST /v1/stage?req_id=slow-%d&tokens=1&dim=4&dtype=float32 HTTP/1.1\r\nHost: agent\r\nContent-Length: 16\r\n\r\n", i); err != nil {
			t.Fatal(err)
		}
		<-reserved
		conns = append(conns, c)
	}
	r := a.stage(t, "third", 1, 1, "float32", make([]byte, 4))
	expectErr(t, r, http.StatusServiceUnavailable, "third", "2 stages are already in progress (staging.max_concurrent)")
	// A failed encode holds no bytes and takes no slot.
	expect(t, do(t, http.MethodPost, a.ctl+"/v1/stage?req_id=failed&error=oom", nil), http.StatusOK, `{"req_id":"failed","error":"oom"}`)
	<-reserved
	for i, c := range conns { // the slow ones finish
		if _, err := c.Write(make([]byte, 16)); err != nil {
			t.Fatal(err)
		}
		expect(t, readReply(t, c), http.StatusOK, fmt.Sprintf(`{"req_id":"slow-%d","embedding_size":16,"embedding_len":1,"embedding_dim":4}`, i))
	}
	a.stageOK(t, "third", 1, 1)
	<-reserved
}

// A stage whose connection closes mid-body releases what it reserved.
func TestStageConnectionClosedMidBody(t *testing.T) {
	reserved := make(chan string, 1)
	a := startAgent(t, nil, nil, func(a *Agent) { a.reserved = func(id string) { reserved <- id } })
	c := a.dialSocket(t)
	if _, err := io.WriteString(c, "POST /v1/stage?req_id=gone&tokens=256&dim=1024&dtype=float32 HTTP/1.1\r\nHost: agent\r\nContent-Length: 1048576\r\n\r\nabc"); err != nil {
		t.Fatal(err)
	}
	<-reserved
	c.Close()
	a.stageWait(t)
	if held, n := a.store.usage(); held != 0 || n != 0 {
		t.Fatalf("held %d bytes in %d entries after the stager left", held, n)
	}
	if v := testutil.ToFloat64(a.metrics.stagesCut.WithLabelValues(cutClosed)); v != 1 {
		t.Fatalf("stages_abandoned{closed} = %v", v)
	}
}

// stageWait waits for every stage in progress to end: the agent's socket
// server drains them on shutdown, so a fresh slot for each of
// staging.max_concurrent means none is left.
func (a *testAgent) stageWait(t *testing.T) {
	t.Helper()
	for range cap(a.stages) {
		select {
		case a.stages <- struct{}{}:
		case <-time.After(10 * time.Second):
			t.Fatal("a stage is still in progress")
		}
	}
	for range cap(a.stages) {
		<-a.stages
	}
}

// pyThief runs as another user who may reach the agent's socket (it is in
// the socket's group) and wants a file only the agent's user can read: it
// cannot open the file itself, and the agent takes no path from a request.
const pyThief = `
import json, socket, sys
import encgate_agent as ea
sock, victim = sys.argv[1], sys.argv[2]
out = {}
try:
    open(victim, "rb")
    out["open"] = "opened"
except PermissionError:
    out["open"] = "denied"
s = socket.socket(socket.AF_UNIX)
s.connect(sock)
s.sendall(("POST /v1/stage?req_id=steal&tokens=4&dim=4&dtype=float32&shm=%s HTTP/1.1\r\n"
           "Host: agent\r\nContent-Length: 0\r\nConnection: close\r\n\r\n" % victim).encode())
out["path_form"] = s.recv(65536).decode()
try:
    ea.Agent(sock).stage_fd("steal-fd", 0, 4, 4, "float32")  # its own stdin: all it can pass
    out["fd"] = "staged"
except ea.AgentError as e:
    out["fd"] = "%d %s" % (e.status, e.message)
print(json.dumps(out))
`

func TestAnotherUsersFileCannotBeStaged(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root, to run the thief as another user (uid 65534)")
	}
	// Debian's python3: another user cannot run one under root's home.
	py := "/usr/bin/python3"
	if _, err := os.Stat(py); err != nil {
		testtool.Missing(t, py, "python3", err.Error())
	}
	const nobody = 65534
	a := startAgent(t, func(c *Config) { c.Control.SocketGroup = fmt.Sprint(nobody) }, nil, nil)
	if err := os.Chmod(filepath.Dir(a.SocketPath()), 0o755); err != nil { // the socket's group can reach it
		t.Fatal(err)
	}
	victim := filepath.Join(publicDir(t), "victim") // the directory is open; the file is the agent user's alone
	if err := os.WriteFile(victim, []byte(strings.Repeat("secret-embedding", 4)), 0o600); err != nil {
		t.Fatal(err)
	}
	p := startPyAs(t, &syscall.Credential{Uid: nobody, Gid: nobody}, py, pyThief, a.SocketPath(), victim)
	line := p.line(t)
	p.wait(t)
	var out struct{ Open, PathForm, FD string }
	if err := json.Unmarshal([]byte(strings.ReplaceAll(line, "path_form", "pathform")), &out); err != nil {
		t.Fatalf("thief said %q: %v", line, err)
	}
	if out.Open != "denied" {
		t.Fatalf("the thief could open the victim's file itself: %s", line)
	}
	if !strings.HasPrefix(out.PathForm, "HTTP/1.1 400 ") || !strings.Contains(out.PathForm, `unknown stage parameter \"shm\"`) ||
		strings.Contains(out.PathForm, "secret") {
		t.Fatalf("the path form: %q", out.PathForm)
	}
	if !strings.HasPrefix(out.FD, "400 ") || strings.Contains(out.FD, "secret") {
		t.Fatalf("its own descriptor: %q", out.FD)
	}
	if st := a.staged(t); len(st) != 0 {
		t.Fatalf("staged %+v", st)
	}
}

// A /send aimed at a service that is not a Mooncake peer tells the caller
// so, and nothing that service sent: /send is no banner grabber.
func TestSendQuotesNothingANonPeerSent(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	served := make(chan struct{})
	go func() {
		defer close(served)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nServer: secret-banner/9.9\r\n\r\n")
			c.Close()
		}
	}()
	a := startAgent(t, nil, nil, nil)
	a.stageAcked(t, "scan", 4, 8)
	r := a.send(t, sendReq{id: "scan", port: 1, session: ln.Addr().String(), addr: 4096, count: 1})
	expectErr(t, r, http.StatusInternalServerError, "scan", "not a Mooncake handshake peer (reply not in the expected form)")
	for _, leak := range []string{"HTTP", "secret", "banner", "3543824036068086856"} {
		if strings.Contains(r.body, leak) {
			t.Fatalf("the answer quotes the peer (%q): %s", leak, r.body)
		}
	}
	ln.Close()
	<-served
}
