package gpuagent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/bearer"
)

// The agent's two doors (ControlConfig). The node's encoder stages over a
// Unix socket: the socket file's permissions decide who may connect, the
// kernel's peer credentials say which process did (the stager that owns what
// it stages), and a stage may carry its embedding as a file descriptor
// (SCM_RIGHTS) instead of bytes, so no file path ever comes from a request.
// The gateway's /send comes over TCP with a bearer token.

// maxPassedFDs bounds the descriptors one connection may have waiting; more
// are closed on arrival.
const maxPassedFDs = 4

// stager is the process at the other end of a Unix socket connection, as the
// kernel reported it when the connection was accepted (SO_PEERCRED).
type stager struct {
	PID int32
	UID uint32
}

func (s stager) String() string { return fmt.Sprintf("pid %d (uid %d)", s.PID, s.UID) }

// unixConn is an accepted Unix socket connection that keeps the descriptors
// its peer passes with the bytes it sends (SCM_RIGHTS), and the peer's
// credentials.
type unixConn struct {
	*net.UnixConn
	peer stager

	oob []byte // the control buffer of one read

	mu     sync.Mutex
	fds    []int // received and not yet taken
	closed bool
	lost   bool // a control message was truncated: descriptors were lost
}

// Read reads bytes and any descriptors passed with them. Go asks the kernel
// for MSG_CMSG_CLOEXEC, so no passed descriptor leaks into a child process.
func (c *unixConn) Read(b []byte) (int, error) {
	n, oobn, flags, _, err := c.ReadMsgUnix(b, c.oob)
	n, oobn = max(n, 0), max(oobn, 0) // -1 with an error
	if (n == 0 && err == nil && len(b) > 0) || errors.Is(err, io.EOF) {
		// The peer's end: recvmsg's 0 on a stream, which ReadMsgUnix leaves
		// as is or wraps. Read reports it as a net.Conn does, a bare io.EOF.
		err = io.EOF
	}
	if oobn > 0 || flags&syscall.MSG_CTRUNC != 0 {
		c.keep(c.oob[:oobn], flags&syscall.MSG_CTRUNC != 0)
	}
	return n, err
}

// keep parses the descriptors of a control message into c.fds, closing any
// beyond maxPassedFDs (and any that came after Close).
func (c *unixConn) keep(oob []byte, truncated bool) {
	var fds []int
	if msgs, err := syscall.ParseSocketControlMessage(oob); err == nil {
		for i := range msgs {
			if got, err := syscall.ParseUnixRights(&msgs[i]); err == nil {
				fds = append(fds, got...)
			}
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lost = c.lost || truncated
	for _, fd := range fds {
		if c.closed || len(c.fds) >= maxPassedFDs {
			_ = syscall.Close(fd)
			c.lost = true
			continue
		}
		c.fds = append(c.fds, fd)
	}
}

// takeFD returns the oldest descriptor waiting, if any. The caller owns it.
func (c *unixConn) takeFD() (fd int, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.fds) == 0 {
		return -1, false
	}
	fd = c.fds[0]
	c.fds = c.fds[1:]
	return fd, true
}

// dropFDs closes the descriptors no request took, and forgets that some
// were lost; it runs after each request, so a descriptor passed with one
// request is never taken by the next.
func (c *unixConn) dropFDs() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, fd := range c.fds {
		_ = syscall.Close(fd)
	}
	c.fds, c.lost = nil, false
}

func (c *unixConn) Close() error {
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	c.dropFDs()
	return c.UnixConn.Close()
}

// unixListener accepts unixConns.
type unixListener struct {
	*net.UnixListener
	path string
	ino  uint64 // the socket file's inode, so Close removes only its own
}

func (l *unixListener) Accept() (net.Conn, error) {
	for {
		c, err := l.AcceptUnix()
		if err != nil {
			return nil, err
		}
		peer, err := peerCred(c)
		if err != nil { // the peer is already gone
			_ = c.Close()
			continue
		}
		return &unixConn{UnixConn: c, peer: peer, oob: make([]byte, syscall.CmsgSpace(4*maxPassedFDs))}, nil
	}
}

// Close stops accepting and removes the socket file if it is still this
// listener's.
func (l *unixListener) Close() error {
	err := l.UnixListener.Close()
	var st syscall.Stat_t
	if syscall.Lstat(l.path, &st) == nil && st.Ino == l.ino {
		_ = os.Remove(l.path)
	}
	return err
}

func peerCred(c *net.UnixConn) (stager, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return stager{}, err
	}
	var st stager
	var cerr error
	if err := raw.Control(func(fd uintptr) { st, cerr = peerOf(int(fd)) }); err != nil {
		return stager{}, err
	}
	return st, cerr
}

// listenUnix binds cfg.Socket with its mode and group. The socket is bound
// inside a fresh mode-0700 directory next to it, given its mode and group
// there, then renamed into place: no other process can connect in between
// with the process umask's permissions. A socket file no process listens on
// (left by a dead agent) is replaced; anything else at the path is an error.
func listenUnix(cfg ControlConfig) (*unixListener, error) {
	mode, err := cfg.socketMode()
	if err != nil {
		return nil, err
	}
	gid := -1
	if cfg.SocketGroup != "" {
		if gid, err = lookupGroup(cfg.SocketGroup); err != nil {
			return nil, err
		}
	}
	path := cfg.Socket
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	if err := clearStale(path); err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp(dir, ".encgate-agent-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	tmpPath := filepath.Join(tmp, "s")
	if len(tmpPath) > maxSocketPath {
		tmp2, err := os.MkdirTemp(dir, ".e")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(tmp2)
		tmpPath = filepath.Join(tmp2, "s")
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmpPath, Net: "unix"})
	if err != nil {
		return nil, err
	}
	ln.SetUnlinkOnClose(false) // the file moves; unixListener.Close removes it
	fail := func(err error) (*unixListener, error) {
		_ = ln.Close()
		return nil, err
	}
	if err := os.Chmod(tmpPath, mode); err != nil {
		return fail(err)
	}
	if gid >= 0 {
		if err := os.Lchown(tmpPath, -1, gid); err != nil {
			return fail(fmt.Errorf("giving the socket to group %s: %w", cfg.SocketGroup, err))
		}
	}
	if err := os.Rename(tmpPath, path); err != nil {
		return fail(err)
	}
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		return fail(err)
	}
	return &unixListener{UnixListener: ln, path: path, ino: st.Ino}, nil
}

// clearStale removes a socket file at path that no process listens on.
func clearStale(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode()&os.ModeSocket == 0 {
		return fmt.Errorf("%s exists and is not a socket; refusing to replace it", path)
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		_ = c.Close()
		return fmt.Errorf("another process is listening on %s (a second agent on this node?)", path)
	}
	return os.Remove(path)
}

// lookupGroup resolves a group name or numeric gid.
func lookupGroup(name string) (int, error) {
	if gid, err := strconv.Atoi(name); err == nil && gid >= 0 {
		return gid, nil
	}
	g, err := user.LookupGroup(name)
	if err != nil {
		return 0, fmt.Errorf("socket_group: %w", err)
	}
	return strconv.Atoi(g.Gid)
}

type connKey struct{}

// connContext puts the accepted connection in each request's context.
func connContext(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, connKey{}, c)
}

// stagerOf is the Unix socket peer a request came from; ok is false for a
// request that came over TCP.
func stagerOf(r *http.Request) (*unixConn, bool) {
	c, ok := r.Context().Value(connKey{}).(*unixConn)
	return c, ok
}

// socketMux serves the Unix socket: staging and ack frames only.
func (a *Agent) socketMux() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/stage", a.serveStage)
	mux.HandleFunc("POST /v1/ack", a.serveAck)
	mux.HandleFunc("POST /send", func(w http.ResponseWriter, r *http.Request) {
		writeEnvelope(w, http.StatusNotFound, fmt.Sprintf(
			"encgate: %s %s is not served on control.socket, which takes POST /v1/stage and POST /v1/ack (the gateway's /send comes over listen, with the token)",
			r.Method, r.URL.Path), "")
	})
	return a.counted(mux, func(r *http.Request) {
		if c, ok := stagerOf(r); ok {
			c.dropFDs()
		}
	})
}

// tcpMux serves the TCP door: /send and the receiver's routes, each with the
// bearer token; staging is refused here whatever the token.
func (a *Agent) tcpMux() http.Handler {
	mux := http.NewServeMux()
	refuse := func(w http.ResponseWriter, r *http.Request) {
		writeEnvelope(w, http.StatusForbidden, fmt.Sprintf(
			"encgate: %s is accepted only on control.socket (the node's encoder's Unix socket), never over TCP", r.URL.Path),
			queryReqID(r.URL.RawQuery))
	}
	mux.HandleFunc("POST /v1/stage", refuse)
	mux.HandleFunc("POST /v1/ack", refuse)
	mux.Handle("POST /send", a.requireToken(http.HandlerFunc(a.serveSend)))
	mux.Handle("GET /v1/receiver", a.requireToken(http.HandlerFunc(a.serveReceiver)))
	mux.Handle("GET /v1/receiver/bytes", a.requireToken(http.HandlerFunc(a.serveReceiverBytes)))
	return a.counted(mux, nil)
}

// requireToken lets a TCP request through when it carries control's token
// (or control.insecure is set), and answers 401 otherwise: with no token
// configured, the TCP door is closed.
func (a *Agent) requireToken(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if a.cfg.Control.Insecure {
			h.ServeHTTP(w, r)
			return
		}
		switch o := bearer.Authorize(r.Header.Get("Authorization"), a.token); {
		case a.token == "":
			a.unauthorized(w, r, "control", bearer.Missing, "encgate: this agent has no control.token_file (or control.token) configured, so its TCP door is closed")
		case o == bearer.Missing:
			a.unauthorized(w, r, "control", o, `encgate: this route needs "Authorization: Bearer <control token>" (the gateway's encoders[].agent_token_file)`)
		case o == bearer.Wrong:
			a.unauthorized(w, r, "control", o, "encgate: the bearer token is not this agent's control token")
		default:
			h.ServeHTTP(w, r)
		}
	})
}

// unauthorized answers 401 with a Bearer challenge (RFC 6750) and counts it.
func (a *Agent) unauthorized(w http.ResponseWriter, r *http.Request, door string, o bearer.Outcome, msg string) {
	a.metrics.unauthorized.WithLabelValues(door).Inc()
	if c := a.log.Check(zap.DebugLevel, "refused an unauthenticated request"); c != nil {
		c.Write(zap.String("door", door), zap.String("path", r.URL.Path), zap.String("remote", r.RemoteAddr))
	}
	w.Header().Set("WWW-Authenticate", bearer.Challenge("encgate agent "+door, o))
	writeEnvelope(w, http.StatusUnauthorized, msg, "")
}

// bodyReader reads a request body with control.body_timeout between reads:
// each read gets a fresh read deadline, cleared once the body ends, so a
// stalled body fails its read instead of holding what it reserved. (A
// deadline left on the connection would cut the request's context short
// once the server starts watching for the client going away.)
type bodyReader struct {
	r       io.Reader
	rc      *http.ResponseController
	timeout time.Duration
	err     error // the first error, returned from then on
}

func (a *Agent) body(w http.ResponseWriter, r io.Reader) *bodyReader {
	return &bodyReader{r: r, rc: http.NewResponseController(w), timeout: a.cfg.Control.BodyTimeout.D()}
}

func (b *bodyReader) Read(p []byte) (int, error) {
	if b.err != nil {
		return 0, b.err
	}
	// Network deadlines are wall-clock times whatever clock the agent has.
	_ = b.rc.SetReadDeadline(time.Now().Add(b.timeout))
	n, err := b.r.Read(p)
	if err != nil {
		b.err = err
		_ = b.rc.SetReadDeadline(time.Time{})
	}
	return n, err
}

// stalled reports whether err is a body read that hit control.body_timeout.
func stalled(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
