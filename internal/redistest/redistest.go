// Package redistest runs a real redis-server for tests: one per test, on a
// free loopback port, with no persistence, stopped when the test ends. Kill
// and Restart let a test simulate Redis dying mid-run and coming back (empty,
// as a server without persistence does).
//
// The same options give the Redis shapes a gateway meets in production, all
// on loopback: TLS (WithTLS, WithMutualTLS, with a CA made for the test),
// a sentinel set (StartSentinel: master, replica, three sentinels) and a
// cluster (StartCluster: three masters). Every process dies with the test
// binary (Pdeathsig) and is stopped in t.Cleanup.
package redistest

import (
	"crypto/tls"
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

	"github.com/encgate/encgate/internal/testtool"
)

// Binary is the server the helper runs, looked up on PATH.
const Binary = "redis-server"

// debianPackage is the Debian package of each program the helper runs.
var debianPackage = map[string]string{Binary: "redis-server", SentinelBinary: "redis-sentinel", CLIBinary: "redis-tools"}

// logName is the file in a server's dir that takes its stdout and stderr
// (its log: the server runs with logfile "").
const logName = "redis.log"

// startTimeout bounds how long a server may take to answer PING.
const startTimeout = 10 * time.Second

// readyTimeout bounds how long a shape may take to settle after its
// processes answer PING: a replica's first sync, the sentinels finding each
// other (their hello messages go every 2 s), a cluster's nodes agreeing on
// the slots.
const readyTimeout = 20 * time.Second

// pollEvery is how often the helper asks a Redis process again while it
// waits for a state no event announces to it (replica in sync, sentinels
// agreeing, cluster_state:ok).
const pollEvery = 50 * time.Millisecond

// Server is one redis-server process for one test (or one node of a
// sentinel or cluster set).
type Server struct {
	t        testing.TB
	bin      string
	dir      string
	port     int
	password string       // requirepass; "" for none
	tls      *tlsMaterial // nil: plain TCP
	// argv gives the process's arguments for a port: the node's role
	// (plain, replica, cluster node, sentinel) lives here.
	argv func(port int) ([]string, error)

	mu   sync.Mutex // protects proc
	proc *process   // nil while stopped
}

type process struct {
	cmd    *exec.Cmd
	exited chan struct{} // closed once cmd.Wait returned
	log    string
}

// config is what the options set; one config serves every node of a shape.
type config struct {
	password         string
	tls, mutualTLS   bool
	sentinelPassword string
}

// Option changes how Start, StartSentinel or StartCluster run their servers.
type Option func(*config)

// WithPassword makes the server require password (requirepass): a client
// that does not AUTH with it is refused (NOAUTH, or WRONGPASS for another
// password). Restart keeps it. In a sentinel or cluster set every data node
// requires it (and replicas and sentinels use it towards them).
func WithPassword(password string) Option { return func(c *config) { c.password = password } }

// WithTLS makes the server speak TLS only: port 0, tls-port on the port
// Addr gives, tls-auth-clients optional (a client certificate is checked
// when sent, not required). The CA and certificates are made for the test in
// its temp dir; TLS gives their files and ClientTLSConfig a client config
// that trusts them. In a sentinel or cluster set, every process (sentinels,
// replication, the cluster bus) speaks TLS.
func WithTLS() Option { return func(c *config) { c.tls = true } }

// WithMutualTLS is WithTLS with tls-auth-clients yes: a client without a
// certificate from the test's CA is refused.
func WithMutualTLS() Option { return func(c *config) { c.tls, c.mutualTLS = true, true } }

// WithSentinelPassword makes the sentinels of StartSentinel require
// password (requirepass; they use it towards each other too). Start and
// StartCluster refuse it.
func WithSentinelPassword(password string) Option {
	return func(c *config) { c.sentinelPassword = password }
}

// shape is what every Start* shares: the binaries' lookup, the options, and
// the TLS material when asked for.
type shape struct {
	cfg config
	tls *tlsMaterial
}

// newShape applies opts and makes the TLS material in dir; it skips t when
// a binary in bins is not installed (fails it under ENCGATE_TEST_STRICT=1:
// see testtool).
func newShape(t testing.TB, opts []Option, bins ...string) *shape {
	t.Helper()
	for _, b := range bins {
		testtool.Need(t, b, debianPackage[b])
	}
	sh := &shape{}
	for _, o := range opts {
		o(&sh.cfg)
	}
	if sh.cfg.tls {
		m, err := newTLSMaterial(t.TempDir(), sh.cfg.mutualTLS)
		if err != nil {
			t.Fatalf("redistest: making the TLS certificates: %v", err)
		}
		sh.tls = m
	}
	return sh
}

// newNode is a stopped Server of the shape with its own temp dir, stopped
// in t.Cleanup.
func (sh *shape) newNode(t testing.TB, bin string) *Server {
	t.Helper()
	path, err := exec.LookPath(bin)
	if err != nil {
		t.Fatalf("redistest: %v", err) // newShape checked it; PATH changed under the test
	}
	s := &Server{t: t, bin: path, dir: t.TempDir(), password: sh.cfg.password, tls: sh.tls}
	s.argv = func(port int) ([]string, error) { return s.baseArgs(port), nil }
	t.Cleanup(s.stop)
	return s
}

// Start runs a redis-server for t on a free loopback port and stops it in
// t.Cleanup. It skips the test when redis-server is not installed.
func Start(t testing.TB, opts ...Option) *Server {
	t.Helper()
	sh := newShape(t, opts, Binary)
	if sh.cfg.sentinelPassword != "" {
		t.Fatal("redistest: Start: WithSentinelPassword is for StartSentinel")
	}
	s := sh.newNode(t, Binary)
	if err := s.launch(freePort); err != nil {
		t.Fatalf("redistest: %v", err)
	}
	return s
}

// launch starts the server on a port from pick; a free port can be taken
// between probing and binding, so it tries a few.
func (s *Server) launch(pick func() (int, error)) error {
	var lastErr error
	for range 5 {
		port, err := pick()
		if err != nil {
			return fmt.Errorf("finding a free port: %w", err)
		}
		s.port = port
		if lastErr = s.start(); lastErr == nil {
			return nil
		}
	}
	return lastErr
}

// Addr is the server's host:port (its TLS port WithTLS).
func (s *Server) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// Port is the server's port.
func (s *Server) Port() int { return s.port }

// Password is the password the server requires, "" for none.
func (s *Server) Password() string { return s.password }

// TLS is the server's certificate files, nil without WithTLS.
func (s *Server) TLS() *TLSFiles {
	if s.tls == nil {
		return nil
	}
	f := s.tls.files
	return &f
}

// ClientTLSConfig is a new client config that trusts only the server's CA
// and presents the client certificate (so it passes WithMutualTLS too); nil
// without WithTLS.
func (s *Server) ClientTLSConfig() *tls.Config { return s.tls.clientConfig() }

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

// baseArgs are the flags of every data node: loopback only, no
// persistence, the log on stdout, the password and TLS when asked for.
func (s *Server) baseArgs(port int) []string {
	args := []string{
		"--bind", "127.0.0.1",
		"--save", "",
		"--appendonly", "no",
		"--protected-mode", "yes",
		"--daemonize", "no",
		"--dir", s.dir,
		"--logfile", "",
		// A replica's first sync starts at once, not after the 5 s that
		// Redis 7 waits by default for more replicas to share a diskless one.
		"--repl-diskless-sync-delay", "0",
	}
	if s.tls != nil {
		args = append(args, s.tls.args(port)...)
	} else {
		args = append(args, "--port", strconv.Itoa(port))
	}
	if s.password != "" {
		// On the command line, as deploy/kubernetes/redis.yaml passes it;
		// only the test's own processes see it. masterauth too, for a node
		// that is (or becomes, after a failover) a replica.
		args = append(args, "--requirepass", s.password, "--masterauth", s.password)
	}
	return args
}

// start runs the server on s.port and waits until it answers PING.
func (s *Server) start() error {
	logPath := filepath.Join(s.dir, logName)
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	args, err := s.argv(s.port)
	if err != nil {
		return err
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
			return fmt.Errorf("%s on port %d exited at start: %s", filepath.Base(s.bin), s.port, tail(logPath))
		default:
		}
		if pingTLS(s.Addr(), s.password, s.tls.clientConfig()) == nil {
			s.mu.Lock()
			s.proc = p
			s.mu.Unlock()
			return nil
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Signal(syscall.SIGKILL)
			<-p.exited
			return fmt.Errorf("%s on port %d did not answer PING within %v: %s", filepath.Base(s.bin), s.port, startTimeout, tail(logPath))
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

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// waitFor calls check until it returns nil or d has passed; then it returns
// check's last error. It polls: what it waits for lives in another process
// that sends no signal.
func waitFor(d time.Duration, check func() error) error {
	deadline := time.Now().Add(d)
	for {
		err := check()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(pollEvery)
	}
}

// logTail is the end of the server's log, for a failure message.
func (s *Server) logTail() string { return tail(filepath.Join(s.dir, logName)) }

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
