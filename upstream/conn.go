package upstream

import (
	"errors"
	"net"
	"syscall"
	"time"
	"unsafe"

	"github.com/valyala/fasthttp"
)

// errStaleConn means a pooled connection turned out to be closed by the
// encoder before the request was written: nothing was delivered.
var errStaleConn = errors.New("upstream: the encoder had closed the connection before the request was written; nothing was sent")

// StaleConnError wraps errStaleConn with the probe's cause.
type StaleConnError struct{ Err error }

func (e *StaleConnError) Error() string { return errStaleConn.Error() + ": " + e.Err.Error() }

// Unwrap returns the cause.
func (e *StaleConnError) Unwrap() []error { return []error{errStaleConn, e.Err} }

// isStale reports whether err proves nothing was written because the
// connection was already closed by the encoder.
func isStale(err error) bool { return errors.Is(err, errStaleConn) }

// probedConn checks, before a request is written on a connection that has
// already carried one, whether the encoder closed it while it sat idle in
// the pool. Encoders behind uvicorn close idle keep-alive connections after
// 5 s, and an encoder that crashes or restarts closes or resets all of them
// at once; writing a request into such a socket would make "was it
// delivered?" unanswerable, and /send must never be sent twice.
//
// Every reused connection is probed, however recently it carried an
// answer: a crash can close it a microsecond after the last one. The probe
// is one non-blocking peek (nginx pays the same with a getsockopt of
// SO_ERROR on each kept-alive upstream connection).
type probedConn struct {
	net.Conn
	raw     syscall.RawConn
	used    bool // a response was read since the last write
	peekFn  func(fd uintptr)
	peekErr error
	peekBuf [1]byte
	local   exchangeAddr // what LocalAddr returns: the local address, and a way back here
}

// unsenter is a connection that can tell whether the request it was
// sending provably never left (tcpconn.Conn).
type unsenter interface{ Unsent() bool }

// exchangeAddr is a probedConn's local address. fasthttp records it in the
// Response of every exchange (Response.LocalAddr) before it writes the
// request, so after a failed exchange the caller can reach the connection
// that carried it and ask whether any byte left (unsentOn).
type exchangeAddr struct {
	net.Addr
	conn unsenter // nil when the connection cannot tell
}

// LocalAddr returns the local address, carrying the way back to c.
func (c *probedConn) LocalAddr() net.Addr {
	if c.local.Addr == nil {
		c.local.Addr = c.Conn.LocalAddr()
	}
	return &c.local
}

// unsentOn reports whether the failed exchange whose Response is resp went
// over a connection on which no byte of its request left: the write failed
// at its first byte (a connection the encoder had reset). Such a request
// may be sent again, as a stale pooled connection's is.
func unsentOn(resp *fasthttp.Response) bool {
	a, ok := resp.LocalAddr().(*exchangeAddr)
	return ok && a.conn != nil && a.conn.Unsent()
}

func newProbedConn(c net.Conn) net.Conn {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return c
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return c
	}
	pc := &probedConn{Conn: c, raw: raw}
	pc.peekFn = pc.peek
	if u, ok := c.(unsenter); ok {
		pc.local.conn = u
	}
	return pc
}

// Read marks the connection as having carried an answer.
func (c *probedConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 {
		c.used = true
	}
	return n, err
}

// Write probes a connection that carried an answer before the first write
// of the next request.
func (c *probedConn) Write(b []byte) (int, error) {
	if c.used {
		c.used = false
		if err := c.probe(); err != nil {
			return 0, &StaleConnError{Err: err}
		}
	}
	return c.Conn.Write(b)
}

// errEOFWhileIdle is the probe's finding for a connection the encoder
// closed while it sat in the pool.
var errEOFWhileIdle = errors.New("EOF while idle")

// probe peeks without blocking: EOF or an error means the peer closed. It
// goes around the poller (Control, not Read), so a read deadline left from
// the last exchange cannot fail it and no readiness is consumed; and it is
// a raw syscall (MSG_DONTWAIT never blocks), so the scheduler does not hand
// the P to another thread around it.
func (c *probedConn) probe() error {
	c.peekErr = nil
	if err := c.raw.Control(c.peekFn); err != nil {
		return err
	}
	return c.peekErr
}

// peek is probe's Control callback, a method value made once per
// connection so the probe does not allocate.
func (c *probedConn) peek(fd uintptr) {
	for {
		n, _, errno := syscall.RawSyscall6(syscall.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&c.peekBuf[0])), 1,
			syscall.MSG_PEEK|syscall.MSG_DONTWAIT, 0, 0)
		switch {
		case errno == syscall.EINTR:
			continue
		case errno == syscall.EAGAIN:
		case errno != 0:
			c.peekErr = errno
		case n == 0:
			c.peekErr = errEOFWhileIdle
		}
		return
	}
}

// Await passes on the wrapped connection's Await (awaitTransport).
func (c *probedConn) Await() {
	if a, ok := c.Conn.(awaiter); ok {
		a.Await()
	}
}

// untilAwaiter is a connection that can wait for an answer to begin up to
// a time of the caller's (tcpconn.Conn).
type untilAwaiter interface{ AwaitUntil(t time.Time) bool }

// AwaitUntil passes on the wrapped connection's AwaitUntil; a connection
// without one gives up at once.
func (c *probedConn) AwaitUntil(t time.Time) bool {
	if a, ok := c.Conn.(untilAwaiter); ok {
		return a.AwaitUntil(t)
	}
	return false
}

// flusher and fder are what a parked exchange needs of its connection
// (tcpconn.Conn): send a held request now, and the descriptor to watch.
type flusher interface{ Flush() error }
type fder interface{ Fd() (int, bool) }

// Flush passes on the wrapped connection's Flush; a connection that holds
// nothing has nothing to send.
func (c *probedConn) Flush() error {
	if f, ok := c.Conn.(flusher); ok {
		return f.Flush()
	}
	return nil
}

// Fd passes on the wrapped connection's Fd.
func (c *probedConn) Fd() (int, bool) {
	if f, ok := c.Conn.(fder); ok {
		return f.Fd()
	}
	return 0, false
}
