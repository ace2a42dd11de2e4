// Package tcpconn provides a TCP connection tuned for a proxy's request and
// response exchanges: reads and writes are issued as raw non-blocking
// syscalls on the connection's own poller registration, and, on a client
// connection, a small request is held until the caller reads the answer so
// that it is written and then waited for without a read that could only
// find nothing.
//
// Why: on a busy proxy most of a request's cost is syscalls. The standard
// net.Conn tries every read before it parks, so each exchange pays for a
// read that returns EAGAIN; and each syscall goes through the scheduler's
// entersyscall/exitsyscall, which lets sysmon hand the P to another thread
// when a loopback write spends tens of microseconds delivering to its peer.
// The sockets are non-blocking, so neither guard buys anything here.
//
// A Conn behaves as the net.Conn it wraps for callers that write a message
// and then read (HTTP/1.1 clients and servers): deadlines, Close and
// addresses are the wrapped connection's.
package tcpconn

import (
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"
	"unsafe"
)

// MaxHeld is the largest write a client Conn holds until the next Read;
// larger writes go out at once.
const MaxHeld = 16 << 10

// Conn is a TCP connection with raw-syscall reads and writes. Build it with
// Client or Server.
type Conn struct {
	*net.TCPConn
	rc syscall.RawConn

	hold    bool    // client: hold small writes until the next Read
	fd      int     // the socket's descriptor (Fd); -1 when Control failed
	held    []byte  // bytes written by Write and not yet sent
	heldBox *[]byte // held's pool entry (nil when none is taken)

	// Server: a small Read reads a pooled buffer's worth (aheadBox), so a
	// request whose first byte a caller asks for alone (fasthttp does, to
	// borrow its read buffer only once a request has begun) costs one read,
	// not two. ahead is what is left for the next Reads; the buffer goes
	// back to the pool once they have taken it, and is never held while a
	// Read waits.
	ahead    []byte
	aheadBox *[]byte
	aheadFn  func(fd uintptr) bool

	// Client: what Await found that is not bytes (an error, EOF), kept for
	// the next Read to return as it would have found it itself.
	awaited error
	// recvFn is what sendThenRead reads with once the request is out:
	// readFn for a Read, aheadFn for an Await.
	recvFn func(fd uintptr) bool

	// What left since the last answer: bytes put on the wire by writes since
	// a read last returned bytes, and whether a write failed since. Unsent
	// reads them; only the goroutine using the connection touches them.
	outSinceRead int
	writeFailed  bool

	// State of the read or write in progress, passed to the callbacks
	// below (allocated once per Conn) instead of through closures, which
	// would allocate on every call.
	buf     []byte
	n       int
	err     error
	errOp   string // the syscall that failed: "read" or "write"
	sent    bool
	readFn  func(fd uintptr) bool
	sendFn  func(fd uintptr) bool
	writeFn func(fd uintptr) bool
	tryFn   func(fd uintptr) bool

	// Deadlines are recorded when set and given to the socket's poller
	// only when they matter (see SetReadDeadline, SetWriteDeadline): a
	// proxy sets four or five per request, and each costs a clock read
	// and a runtime timer update.
	dl         sync.Mutex
	rdl        time.Time // read deadline as last set
	rdlApplied time.Time // read deadline the poller has
	wdl        time.Time // write deadline as last set
	reading    bool      // a Read is in progress
	writeWaits bool      // a write is waiting for buffer space under wdl
}

// Client wraps a dialled connection: small writes are held until the next
// Read (see the package comment). It returns c unchanged when c is not a
// *net.TCPConn.
func Client(c net.Conn) net.Conn { return wrap(c, true) }

// Server wraps an accepted connection: raw-syscall reads and writes, no
// holding (a server must read what a pipelining client already sent before
// it waits). It returns c unchanged when c is not a *net.TCPConn.
func Server(c net.Conn) net.Conn { return wrap(c, false) }

func wrap(c net.Conn, hold bool) net.Conn {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return c
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return c
	}
	cc := &Conn{TCPConn: tc, rc: rc, hold: hold, fd: -1}
	_ = rc.Control(func(f uintptr) { cc.fd = int(f) })
	if hold {
		// The first request's buffer is taken here, where the connection is
		// made (on the dialling goroutine), rather than at its first Write,
		// on the request's own.
		cc.heldBox = heldBufs.Get().(*[]byte)
		cc.held = (*cc.heldBox)[:0]
	}
	cc.readFn = cc.read
	cc.aheadFn = cc.readAhead
	cc.recvFn = cc.readFn
	cc.sendFn = cc.sendThenRead
	cc.writeFn = cc.write
	cc.tryFn = cc.tryWrite
	return cc
}

// Unsent reports whether the request being sent provably never left: a
// write failed, and no byte was put on the wire since the last answer byte
// was read. A held request whose send fails at its first byte is unsent;
// one that failed after some of its bytes left is not (they may have
// reached the peer).
func (c *Conn) Unsent() bool { return c.writeFailed && c.outSinceRead == 0 }

// SetReadDeadline records t; it reaches the poller when the next Read
// starts (at once while a Read is in progress, so that a waiting Read
// sees it). A read deadline the poller already has is not set again.
func (c *Conn) SetReadDeadline(t time.Time) error {
	c.dl.Lock()
	defer c.dl.Unlock()
	c.rdl = t
	if c.reading {
		return c.applyReadLocked()
	}
	return nil
}

// SetWriteDeadline records t. It bounds waiting for socket buffer space:
// a write the socket takes at once succeeds even past its deadline, and a
// write that must wait is bounded by it (as net.Conn's).
func (c *Conn) SetWriteDeadline(t time.Time) error {
	c.dl.Lock()
	defer c.dl.Unlock()
	c.wdl = t
	if c.writeWaits {
		return c.TCPConn.SetWriteDeadline(t)
	}
	return nil
}

// SetDeadline records both deadlines.
func (c *Conn) SetDeadline(t time.Time) error {
	if err := c.SetReadDeadline(t); err != nil {
		return err
	}
	return c.SetWriteDeadline(t)
}

func (c *Conn) applyReadLocked() error {
	if c.rdl.Equal(c.rdlApplied) {
		return nil
	}
	if err := c.TCPConn.SetReadDeadline(c.rdl); err != nil {
		return err
	}
	c.rdlApplied = c.rdl
	return nil
}

// beginRead gives the poller the read deadline as last set.
func (c *Conn) beginRead() error {
	c.dl.Lock()
	defer c.dl.Unlock()
	c.reading = true
	return c.applyReadLocked()
}

func (c *Conn) endRead() {
	c.dl.Lock()
	c.reading = false
	c.dl.Unlock()
}

// Read reads into p. On a client with a held request, the request is sent
// first and the answer awaited before the first read attempt: the poller
// registration is reset before the request leaves, so an answer arriving at
// any time after it is seen.
func (c *Conn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if len(c.ahead) > 0 {
		n := copy(p, c.ahead)
		c.ahead = c.ahead[n:]
		if len(c.ahead) == 0 {
			c.releaseAhead()
		}
		return n, nil
	}
	if err := c.awaited; err != nil {
		c.awaited = nil
		return 0, err
	}
	return c.readRaw(p, len(p) < minDirectRead && !c.hold)
}

// Await sends a held request and waits for the first bytes of its answer
// without a caller's buffer: they are read into a pooled buffer, taken only
// once the socket has them, that the next Reads drain. So a caller that
// would otherwise wait inside Read on a buffer of its own (an HTTP client's
// response reader) can take that buffer after Await returns, and holds none
// while the peer takes its time: a pull the encoder holds for minutes costs
// no read buffer. What a Read would have returned instead of bytes (an
// error, EOF, a deadline passing) is kept and returned by the next Read, so
// Await followed by Read is the same exchange as Read alone, Unsent
// included. Await returns at once when bytes or an outcome are already
// waiting.
func (c *Conn) Await() {
	if len(c.ahead) > 0 || c.awaited != nil {
		return
	}
	if _, err := c.readRaw(nil, true); err != nil {
		c.awaited = err
	}
}

// AwaitUntil is Await, given up at t when that comes before the read
// deadline: true when the answer has begun, or an outcome is waiting
// (what Await keeps for the next Read: an error, EOF, the connection's own
// deadline passing); false when t passed first, and then nothing is kept
// and the read deadline is the one last set, as if AwaitUntil had not run
// (a request still held, not flushed, is then still held too).
// A caller that would otherwise hand the wait elsewhere (a parked
// exchange) gives an answer that comes at once the chance to be read on
// its own goroutine.
func (c *Conn) AwaitUntil(t time.Time) bool {
	if len(c.ahead) > 0 || c.awaited != nil {
		return true
	}
	c.dl.Lock()
	set := c.rdl
	early := set.IsZero() || t.Before(set)
	if early {
		c.rdl = t
	}
	c.dl.Unlock()
	_, err := c.readRaw(nil, true)
	if early {
		c.dl.Lock()
		c.rdl = set // reaches the poller at the next Read (beginRead)
		c.dl.Unlock()
	}
	if err != nil {
		if early && errors.Is(err, os.ErrDeadlineExceeded) {
			return false
		}
		c.awaited = err
	}
	return true
}

// minDirectRead is the smallest server Read that reads into the caller's
// buffer; a smaller one reads ahead into a pooled buffer.
const minDirectRead = 512

// aheadBufs pools server read-ahead buffers.
var aheadBufs = sync.Pool{New: func() any { b := make([]byte, 4096); return &b }}

// releaseAhead gives the read-ahead buffer back to the pool.
func (c *Conn) releaseAhead() {
	if c.aheadBox != nil {
		aheadBufs.Put(c.aheadBox)
		c.aheadBox, c.ahead = nil, nil
	}
}

// readAhead is the RawConn callback of a small server read and of a
// client's Await: it reads into a buffer taken from the pool for the
// attempt and given back when the socket has nothing (false: wait), so none
// is held while waiting.
func (c *Conn) readAhead(fd uintptr) bool {
	box := aheadBufs.Get().(*[]byte)
	for {
		n, errno := rawRead(fd, *box)
		switch {
		case errno == syscall.EINTR:
			continue
		case errno == syscall.EAGAIN:
			aheadBufs.Put(box)
			return false
		case errno != 0:
			aheadBufs.Put(box)
			c.err, c.errOp = os.NewSyscallError("read", errno), "read"
		case n == 0:
			aheadBufs.Put(box)
			c.err = io.EOF
		default:
			k := copy(c.buf, (*box)[:n])
			c.n = k
			c.outSinceRead, c.writeFailed = 0, false
			if k < n {
				c.aheadBox, c.ahead = box, (*box)[k:n]
			} else {
				aheadBufs.Put(box)
			}
		}
		return true
	}
}

// readRaw reads from the socket (sending a held request first), into p
// directly or, when ahead is set, through a pooled read-ahead buffer.
func (c *Conn) readRaw(p []byte, ahead bool) (int, error) {
	if err := c.beginRead(); err != nil {
		c.endRead()
		return 0, c.opError("read", err)
	}
	c.buf, c.n, c.err, c.sent = p, 0, nil, false
	fn := c.readFn
	c.recvFn = c.readFn
	if ahead {
		fn = c.aheadFn
		c.recvFn = c.aheadFn
	}
	if len(c.held) > 0 {
		fn = c.sendFn
	}
	rerr := c.rc.Read(fn)
	c.endRead()
	n, err := c.n, c.err
	c.buf, c.err = nil, nil
	if len(c.held) > 0 && err == nil && rerr == nil {
		// The held bytes did not all fit in the socket buffer: send the
		// rest the ordinary way (honouring the write deadline), then read.
		if werr := c.flush(); werr != nil {
			return 0, werr
		}
		return c.readRaw(p, ahead)
	}
	if rerr != nil {
		return 0, c.opError("read", rerr)
	}
	if err != nil {
		if err == io.EOF {
			return 0, io.EOF
		}
		return n, c.opError(c.errOp, err)
	}
	return n, nil
}

// read is the RawConn callback of a plain read; false means wait.
func (c *Conn) read(fd uintptr) bool {
	for {
		n, errno := rawRead(fd, c.buf)
		switch {
		case errno == syscall.EINTR:
			continue
		case errno == syscall.EAGAIN:
			return false
		case errno != 0:
			c.err, c.errOp = os.NewSyscallError("read", errno), "read"
		case n == 0:
			c.err = io.EOF
		default:
			c.n = n
			c.outSinceRead, c.writeFailed = 0, false // an answer: a new exchange starts
		}
		return true
	}
}

// sendThenRead sends the held bytes on its first call and waits for the
// answer; later calls read. When the socket buffer cannot take all the
// held bytes it returns true with them still held (Read finishes the send).
func (c *Conn) sendThenRead(fd uintptr) bool {
	if c.sent {
		return c.recvFn(fd)
	}
	c.sent = true
	off := 0
	for off < len(c.held) {
		n, errno := rawWrite(fd, c.held[off:])
		switch {
		case errno == syscall.EINTR:
			continue
		case errno == syscall.EAGAIN:
			// Keep the unsent rest at the front of the buffer.
			c.held = c.held[:copy(c.held, c.held[off:])]
			return true
		case errno != 0:
			c.err, c.errOp = os.NewSyscallError("write", errno), "write"
			c.writeFailed = true
			c.releaseHeld()
			return true
		}
		off += n
		c.outSinceRead += n
	}
	c.releaseHeld()
	return false // the request is out: wait for its answer
}

// heldBufs pools the buffers of held requests: a connection holds one
// only from its request's first Write until the request is out, not
// while it waits for the answer (a pull the encoder holds for minutes).
var heldBufs = sync.Pool{New: func() any { b := make([]byte, 0, 1024); return &b }}

// releaseHeld gives the held buffer back to the pool.
func (c *Conn) releaseHeld() {
	box := c.heldBox
	if box == nil {
		return
	}
	*box = c.held[:0] // append may have grown it
	c.held, c.heldBox = nil, nil
	heldBufs.Put(box)
}

// Write sends b, or on a client holds it until the next Read when it is
// small. A held write always reports success; a failure to send it is
// reported by the Read that sends it, and Unsent then tells whether any of
// it left.
func (c *Conn) Write(b []byte) (int, error) {
	if c.hold && len(c.held)+len(b) <= MaxHeld {
		if c.heldBox == nil {
			c.heldBox = heldBufs.Get().(*[]byte)
			c.held = (*c.heldBox)[:0]
		}
		c.held = append(c.held, b...)
		return len(b), nil
	}
	if err := c.flush(); err != nil {
		return 0, err
	}
	return c.send(b)
}

// Flush sends the held bytes now, for a caller that waits for the answer
// elsewhere than in Read: a parked exchange, whose socket a poller watches
// (internal/poller). A failure, and Unsent after it, are what the Read that
// would have sent them reports.
func (c *Conn) Flush() error { return c.flush() }

// Fd returns the socket's descriptor, for a poller's watch. It is valid
// until Close; false once the connection is closed.
func (c *Conn) Fd() (fd int, ok bool) {
	if c.fd < 0 {
		return 0, false
	}
	// Control fails once the connection is closed; the descriptor itself
	// was read when the connection was wrapped (a closure per call would
	// allocate, and a parkable request asks for it twice).
	if err := c.rc.Control(noop); err != nil {
		return 0, false
	}
	return c.fd, true
}

func noop(uintptr) {}

// flush sends the held bytes now.
func (c *Conn) flush() error {
	if len(c.held) == 0 {
		return nil
	}
	_, err := c.send(c.held)
	c.releaseHeld()
	return err
}

// send writes all of b with raw syscalls. The poller's write deadline is
// none except while a write waits for buffer space: then it is the one
// last set, and none again after.
func (c *Conn) send(b []byte) (int, error) {
	c.buf, c.n, c.err = b, 0, nil
	werr := c.rc.Write(c.tryFn)
	if werr == nil && c.err == nil && c.n < len(b) {
		werr = c.sendWaiting()
	}
	n, err := c.n, c.err
	c.buf, c.err = nil, nil
	if werr != nil {
		return n, c.opError("write", werr)
	}
	if err != nil {
		return n, c.opError("write", err)
	}
	return n, nil
}

// sendWaiting finishes a send that found the socket buffer full, under the
// write deadline.
func (c *Conn) sendWaiting() error {
	c.dl.Lock()
	c.writeWaits = true
	err := c.TCPConn.SetWriteDeadline(c.wdl)
	c.dl.Unlock()
	if err == nil {
		err = c.rc.Write(c.writeFn)
	}
	c.dl.Lock()
	c.writeWaits = false
	if derr := c.TCPConn.SetWriteDeadline(time.Time{}); err == nil {
		err = derr
	}
	c.dl.Unlock()
	return err
}

// tryWrite is the RawConn callback of send's first pass: it never waits.
func (c *Conn) tryWrite(fd uintptr) bool {
	c.write(fd)
	return true
}

// write is the RawConn callback of send; false means wait for space.
func (c *Conn) write(fd uintptr) bool {
	for c.n < len(c.buf) {
		n, errno := rawWrite(fd, c.buf[c.n:])
		switch {
		case errno == syscall.EINTR:
			continue
		case errno == syscall.EAGAIN:
			return false
		case errno != 0:
			c.err = os.NewSyscallError("write", errno)
			c.writeFailed = true
			return true
		}
		c.n += n
		c.outSinceRead += n
	}
	return true
}

// ReadFrom sends what is held, then copies r to the connection the
// standard way (which may use splice or sendfile).
func (c *Conn) ReadFrom(r io.Reader) (int64, error) {
	if err := c.flush(); err != nil {
		return 0, err
	}
	n, err := c.TCPConn.ReadFrom(r)
	c.outSinceRead += int(n)
	if err != nil {
		c.writeFailed = true
	}
	return n, err
}

// WriteTo sends what is held, hands w what was read ahead, then copies
// the connection to w.
func (c *Conn) WriteTo(w io.Writer) (int64, error) {
	if err := c.flush(); err != nil {
		return 0, err
	}
	var n int64
	if len(c.ahead) > 0 {
		m, err := w.Write(c.ahead)
		n = int64(m)
		c.ahead = c.ahead[m:]
		if len(c.ahead) == 0 {
			c.releaseAhead()
		}
		if err != nil {
			return n, err
		}
	}
	m, err := c.TCPConn.WriteTo(w)
	return n + m, err
}

// Close closes the connection. Bytes still held are dropped, not sent: they
// belong to a request whose caller gave up before reading its answer (a
// deadline that could not be set, say), and a request nobody waits for must
// not reach the peer after its caller was told it failed.
// (Close may run on another goroutine than the connection's reads and
// writes, as a server's shutdown closes idle connections, so it touches no
// state of theirs.)
func (c *Conn) Close() error { return c.TCPConn.Close() }

// opError shapes err as the net package does for a TCP connection, so
// callers' timeout and error checks see what they would see from net.
func (c *Conn) opError(op string, err error) error {
	if oe, ok := err.(*net.OpError); ok {
		err = oe.Err // RawConn wraps its own errors as "raw-read"/"raw-write"
	}
	return &net.OpError{Op: op, Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
}

func rawRead(fd uintptr, p []byte) (int, syscall.Errno) {
	n, _, errno := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	return int(n), errno
}

func rawWrite(fd uintptr, p []byte) (int, syscall.Errno) {
	n, _, errno := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	return int(n), errno
}

// Listener wraps accepted TCP connections with Server.
type Listener struct{ net.Listener }

// Accept waits for the next connection and wraps it.
func (l Listener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return Server(c), nil
}
