// Package redistest runs a real redis-server for tests: one per test, on a
// free loopback port, with no persistence, stopped when the test ends. Kill
// and Restart let a test simulate Redis dying mid-run and coming back (empty,
// as a server without persistence does).
package redistest

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Binary is the server the helper runs, looked up on PATH.
const Binary = "redis-server"

// startTimeout bounds how long a server may take to answer PING.
const startTimeout = 10 * time.Second

// Server is one redis-server process for one test.
type Server struct {
	t        testing.TB
	bin      string
	dir      string
	port     int
	password string // requirepass; "" for none

	mu   sync.Mutex // protects proc
	proc *process   // nil while stopped
}

type process struct {
	cmd    *exec.Cmd
	exited chan struct{} // closed once cmd.Wait returned
	log    string
}

// Option changes how Start runs the server.
type Option func(*Server)

// WithPassword makes the server require password (requirepass): a client
// that does not AUTH with it is refused (NOAUTH, or WRONGPASS for another
// password). Restart keeps it.
func WithPassword(password string) Option { return func(s *Server) { s.password = password } }

// Start runs a redis-server for t on a free loopback port and stops it in
// t.Cleanup. It skips the test when redis-server is not installed.
func Start(t testing.TB, opts ...Option) *Server {
	t.Helper()
	bin, err := exec.LookPath(Binary)
	if err != nil {
		t.Skipf("%s is not installed (apt-get install redis-server; .ci/run installs it): %v", Binary, err)
	}
	s := &Server{t: t, bin: bin, dir: t.TempDir()}
	for _, o := range opts {
		o(s)
	}
	t.Cleanup(s.stop)
	// A free port can be taken between probing and binding: try a few.
	var lastErr error
	for range 5 {
		if s.port, err = freePort(); err != nil {
			t.Fatalf("redistest: finding a free port: %v", err)
		}
		if lastErr = s.start(); lastErr == nil {
			return s
		}
	}
	t.Fatalf("redistest: %v", lastErr)
	return nil
}

// Addr is the server's host:port.
func (s *Server) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// Port is the server's port.
func (s *Server) Port() int { return s.port }

// Password is the password the server requires, "" for none.
func (s *Server) Password() string { return s.password }

// Kill ends the server with SIGKILL, as a crash would, and waits until it is
// gone. The port stops answering at once.
func (s *Server) Kill() {
	s.t.Helper()
	s.mu.Lock()
	p := s.proc
	s.proc = nil
	s.mu.Unlock()
	if p == nil {
		s.t.Fatal("redistest: Kill: server is not running")
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.exited
}

// Restart starts the server again on the same port (after Kill, or while it
// runs: then it is killed first) and waits until it answers PING. It comes
// back empty.
func (s *Server) Restart() {
	s.t.Helper()
	s.mu.Lock()
	running := s.proc != nil
	s.mu.Unlock()
	if running {
		s.Kill()
	}
	// The old process's socket may linger for a moment; redis-server binds
	// with SO_REUSEADDR, so one retry loop covers the rare EADDRINUSE.
	deadline := time.Now().Add(startTimeout)
	for {
		err := s.start()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("redistest: Restart: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// start runs redis-server on s.port and waits until it answers PING.
func (s *Server) start() error {
	logPath := filepath.Join(s.dir, "redis.log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	args := []string{
		"--port", strconv.Itoa(s.port),
		"--bind", "127.0.0.1",
		"--save", "",
		"--appendonly", "no",
		"--protected-mode", "yes",
		"--daemonize", "no",
		"--dir", s.dir,
		"--logfile", "",
	}
	if s.password != "" {
		// On the command line, as deploy/kubernetes/redis.yaml passes it;
		// only the test's own processes see it.
		args = append(args, "--requirepass", s.password)
	}
	cmd := exec.Command(s.bin, args...)
	cmd.Dir = s.dir
	cmd.SysProcAttr = dieWithParent // no orphan when a test timeout panics past cleanups
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", s.bin, err)
	}
	p := &process{cmd: cmd, exited: make(chan struct{}), log: logPath}
	go func() {
		_ = cmd.Wait()
		close(p.exited)
	}()
	deadline := time.Now().Add(startTimeout)
	for {
		select {
		case <-p.exited:
			return fmt.Errorf("redis-server on port %d exited at start: %s", s.port, tail(logPath))
		default:
		}
		if ping(s.Addr(), s.password) == nil {
			s.mu.Lock()
			s.proc = p
			s.mu.Unlock()
			return nil
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Signal(syscall.SIGKILL)
			<-p.exited
			return fmt.Errorf("redis-server on port %d did not answer PING within %v: %s", s.port, startTimeout, tail(logPath))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// stop ends a running server (SIGTERM, then SIGKILL if it lingers).
func (s *Server) stop() {
	s.mu.Lock()
	p := s.proc
	s.proc = nil
	s.mu.Unlock()
	if p == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(5 * time.Second):
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
		<-p.exited
	}
}

// ping sends PING over a fresh connection and expects +PONG; with a
// password it sends AUTH first and expects +OK.
func ping(addr, password string) error {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(time.Second))
	r := bufio.NewReader(c)
	if password != "" {
		if err := command(c, r, "+OK", "AUTH", password); err != nil {
			return err
		}
	}
	return command(c, r, "+PONG", "PING")
}

// command sends args as one RESP array (binary-safe, unlike an inline
// command) and expects the line want.
func command(c net.Conn, r *bufio.Reader, want string, args ...string) error {
	req := "*" + strconv.Itoa(len(args)) + "\r\n"
	for _, a := range args {
		req += "$" + strconv.Itoa(len(a)) + "\r\n" + a + "\r\n"
	}
	if _, err := c.Write([]byte(req)); err != nil {
		return err
	}
	line, err := r.ReadString('\n')
	if err != nil {
		return err
	}
	if strings.TrimSpace(line) != want {
		return errors.New("unexpected " + args[0] + " answer " + strconv.Quote(line))
	}
	return nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// tail returns the end of the server's log for an error message.
func tail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	const max = 2000
	if len(b) > max {
		b = b[len(b)-max:]
	}
	return strings.TrimSpace(string(b))
}
