package mooncake

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"
)

// Defaults for InitiatorConfig's zero values.
const (
	DefaultConnectTimeout = 5 * time.Second  // MC_HANDSHAKE_CONNECT_TIMEOUT
	DefaultTimeout        = 30 * time.Second // MC_TRANSFER_TIMEOUT, MC_TCP_STATUS_TIMEOUT_SEC
	DefaultMaxIdlePerPeer = 4                // MC_TCP_LANES_PER_PEER
	DefaultMaxSessions    = 1024             // sessions (descriptor and idle connections) cached at most
)

// InitiatorConfig configures an Initiator. The zero value is usable.
type InitiatorConfig struct {
	// ConnectTimeout bounds each dial (handshake and data). Default 5s.
	ConnectTimeout time.Duration
	// Timeout bounds each handshake, and each transfer attempt from the
	// header to its confirmation (status frame or EOF). A ctx deadline that is
	// earlier wins. Default 30s.
	Timeout time.Duration
	// MaxIdlePerPeer is how many idle data connections to one v2 peer are
	// kept for reuse. 0 means 4; a negative value disables pooling.
	MaxIdlePerPeer int
	// MaxSessions is how many sessions (each a cached descriptor and its idle
	// data connections) are kept; past it the least recently used one is
	// dropped and its idle connections closed. 0 (or less) means 1024.
	MaxSessions int
	// Dial opens every connection the Initiator makes, handshake and data
	// alike ("tcp", "host:port"), so it is the place to enforce an allow-list
	// (the data host comes from the peer's descriptor, not from the caller).
	// nil means a net.Dialer. The context carries ConnectTimeout.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
}

// Result describes one completed Write.
type Result struct {
	Bytes     int  // payload bytes confirmed
	Version   int  // 1 (half-close + EOF) or 2 (status frame)
	Reused    bool // the transfer went over a pooled connection
	Handshake bool // this call fetched the descriptor (first use or refresh)
}

// Initiator writes into Mooncake TCP receivers (reference §1.8). It caches one
// descriptor per session ID and pools data connections to v2 peers. It is safe
// for concurrent use.
type Initiator struct {
	cfg InitiatorConfig

	// mu protects sessions (a simplelru, which does no locking of its own, so
	// its eviction callback runs with mu held), closed, and every session's
	// desc, gen and idle.
	mu       sync.Mutex
	sessions *simplelru.LRU[string, *session]
	closed   bool
}

// session is the cached state for one session ID.
type session struct {
	id    string
	fetch chan struct{} // one handshake at a time per session (a 1-slot semaphore)

	desc     *Descriptor // nil until fetched, and after an invalidation
	gen      uint64      // incremented each time desc is replaced
	idle     []net.Conn  // pooled connections to idleAddr (LIFO)
	idleAddr string
}

// NewInitiator returns an Initiator with cfg's zero values defaulted.
func NewInitiator(cfg InitiatorConfig) *Initiator {
	if cfg.ConnectTimeout <= 0 {
		cfg.ConnectTimeout = DefaultConnectTimeout
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.MaxIdlePerPeer == 0 {
		cfg.MaxIdlePerPeer = DefaultMaxIdlePerPeer
	}
	if cfg.MaxSessions <= 0 {
		cfg.MaxSessions = DefaultMaxSessions
	}
	if cfg.Dial == nil {
		d := &net.Dialer{}
		cfg.Dial = d.DialContext
	}
	// Called with mu held (Add, Purge): an evicted session's pooled
	// connections are closed, and putIdle closes the ones that a Write still
	// in flight on it returns later (the session is no longer in the cache).
	sessions, err := simplelru.NewLRU(cfg.MaxSessions, func(_ string, s *session) { s.closeIdleLocked() })
	if err != nil {
		panic(err) // only for a size <= 0, excluded above
	}
	return &Initiator{cfg: cfg, sessions: sessions}
}

// Write moves payload to [addr, addr+len(payload)) in the peer named by
// sessionID ("host:rpc_port"), following reference §1.8:
//
//  1. the segment descriptor comes from the cache, or from a Metadata
//     handshake on sessionID (one at a time per session; the handshake
//     connection is closed as soon as the reply is read);
//  2. the peer must list "tcp" (else ErrNotTCP) and the range must lie inside
//     one advertised buffer (else *RangeError); in both cases nothing is sent;
//  3. a data connection to host(desc.Name):tcp_data_port (TCP_NODELAY) gets
//     the 24-byte header (opcode 0x01, or 0x81 when tcp_proto_version >= 2)
//     and the payload, written from the slice without a copy;
//  4. v2: the 8-byte status frame is read after the body (and also when the
//     body failed to send: a peer rejects a range right after the header and
//     closes); OK confirms, ADDR_REJECTED is *RejectedError, and the
//     connection goes back to the pool. v1: CloseWrite, then EOF confirms (a v1 server closes
//     only after applying every byte), and the connection is closed.
//
// When an attempt that used a cached descriptor or a pooled connection fails
// (other than by a timeout or ctx), the descriptor is fetched again and the
// transfer is retried once on a new connection; rewriting the same bytes to
// the same range is harmless. payload is not used after Write returns.
//
// An empty payload is a *RangeError (a size of 0 lies inside no buffer).
// Errors other than *RangeError and *RejectedError name the session and wrap
// the cause; a ctx that ends the call is reported as ctx.Err() (errors.Is).
func (i *Initiator) Write(ctx context.Context, sessionID string, addr uint64, payload []byte) (Result, error) {
	return i.WriteFrom(ctx, sessionID, addr, bytesPayload(payload))
}

// Payload is what WriteFrom sends: Len bytes that Send writes in order. Send
// is called once per attempt (twice when a stale descriptor or pooled
// connection is retried), each time from the first byte; it must write
// exactly Len bytes or fail, and stop when ctx ends or w fails.
type Payload interface {
	Len() int64
	Send(ctx context.Context, w io.Writer) error
}

// bytesPayload is a payload in memory: header and bytes go out in one
// writev, without a copy.
type bytesPayload []byte

func (b bytesPayload) Len() int64 { return int64(len(b)) }

func (b bytesPayload) Send(_ context.Context, w io.Writer) error {
	_, err := w.Write(b)
	return err
}

// WriteFrom is Write for a payload that is produced while it is sent (a
// chunked copy out of device memory, for one). Everything Write says holds.
func (i *Initiator) WriteFrom(ctx context.Context, sessionID string, addr uint64, payload Payload) (Result, error) {
	s, err := i.session(sessionID)
	if err != nil {
		return Result{}, err
	}
	desc, gen, hs, err := i.descriptor(ctx, s)
	if err != nil {
		return Result{Handshake: hs}, err
	}
	res, retry, err := i.attempt(ctx, s, desc, addr, payload, !hs)
	res.Handshake = hs
	if err == nil || !retry || ctx.Err() != nil {
		return res, err
	}
	i.invalidate(s, gen)
	desc, _, hs2, derr := i.descriptor(ctx, s)
	if derr != nil {
		// The peer's present state wins over a verdict on stale data.
		return Result{Handshake: hs || hs2}, fmt.Errorf("%w (refreshing the descriptor after: %v)", derr, err)
	}
	res, _, err = i.attempt(ctx, s, desc, addr, payload, false)
	res.Handshake = hs || hs2
	return res, err
}

// Descriptor returns the session's segment descriptor, from the cache or by a
// Metadata handshake.
func (i *Initiator) Descriptor(ctx context.Context, sessionID string) (Descriptor, error) {
	s, err := i.session(sessionID)
	if err != nil {
		return Descriptor{}, err
	}
	d, _, _, err := i.descriptor(ctx, s)
	return d, err
}

// Close closes the pooled connections. Writes in flight finish; later ones
// fail with ErrClosed.
func (i *Initiator) Close() error {
	i.mu.Lock()
	defer i.mu.Unlock()
	i.closed = true
	i.sessions.Purge() // the eviction callback closes each session's idle connections
	return nil
}

// session returns the cache entry for id, creating it (and evicting the least
// recently used entry when the cache is full).
func (i *Initiator) session(id string) (*session, error) {
	if _, _, err := ParseSessionID(id); err != nil {
		return nil, err
	}
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.closed {
		return nil, ErrClosed
	}
	if s, ok := i.sessions.Get(id); ok {
		return s, nil
	}
	s := &session{id: id, fetch: make(chan struct{}, 1)}
	i.sessions.Add(id, s)
	return s, nil
}

// descriptor returns s's descriptor and its generation; hs reports whether
// this call did the handshake.
func (i *Initiator) descriptor(ctx context.Context, s *session) (d Descriptor, gen uint64, hs bool, err error) {
	if d, gen, ok := i.cached(s); ok {
		return d, gen, false, nil
	}
	select {
	case s.fetch <- struct{}{}:
	case <-ctx.Done():
		return Descriptor{}, 0, false, fmt.Errorf("mooncake: waiting for the handshake with %s: %w", s.id, ctx.Err())
	}
	defer func() { <-s.fetch }()
	if d, gen, ok := i.cached(s); ok { // another caller fetched it meanwhile
		return d, gen, false, nil
	}
	d, err = i.handshake(ctx, s.id)
	if err != nil {
		return Descriptor{}, 0, true, err
	}
	i.mu.Lock()
	defer i.mu.Unlock()
	s.gen++
	s.desc = &d
	return d, s.gen, true, nil
}

func (i *Initiator) cached(s *session) (Descriptor, uint64, bool) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if s.desc == nil {
		return Descriptor{}, 0, false
	}
	return *s.desc, s.gen, true
}

// invalidate drops s's descriptor and pooled connections, unless another
// caller has already replaced generation gen.
func (i *Initiator) invalidate(s *session, gen uint64) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if s.gen == gen {
		s.desc = nil
		s.closeIdleLocked()
	}
}

func (s *session) closeIdleLocked() {
	for _, c := range s.idle {
		_ = c.Close()
	}
	s.idle = nil
}

// handshake fetches the peer's descriptor with a Metadata frame (reference
// §2.2) and closes the connection as soon as the reply is read: the peer's
// handshake listener serves one connection at a time until the client closes.
func (i *Initiator) handshake(ctx context.Context, sessionID string) (Descriptor, error) {
	host, port, err := ParseSessionID(sessionID)
	if err != nil {
		return Descriptor{}, err
	}
	conn, err := i.dial(ctx, net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil {
		return Descriptor{}, fmt.Errorf("mooncake: handshake with %s: %w", sessionID, err)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(aLongTimeAgo) })
	typ, body, legacy, err := i.exchangeFrame(ctx, conn)
	_ = conn.Close()
	stop()
	// Nothing that the peer sent is quoted from here on: a /send aimed at
	// another service must not read its banner back (ErrNotHandshakePeer).
	switch {
	case errors.Is(err, ErrFrameTooLarge) || errors.Is(err, errEmptyFrame):
		return Descriptor{}, notPeer(sessionID, "", err)
	case err != nil:
		return Descriptor{}, fmt.Errorf("mooncake: handshake with %s: %w", sessionID, ctxErr(ctx, err))
	case legacy: // the first body byte is above 3: "SSH-2.0-...", or an old peer's '{'
		return Descriptor{}, notPeer(sessionID, "", nil)
	case typ != HSMetadata: // typ is 0-3 here
		return Descriptor{}, notPeer(sessionID, fmt.Sprintf("a reply of type %d to a Metadata request", typ), nil)
	}
	d, err := DecodeDescriptor(body)
	switch {
	case errors.Is(err, errDescNotJSON) || errors.Is(err, errDescNotObject) || errors.Is(err, errDescTrailing):
		return Descriptor{}, notPeer(sessionID, "", err)
	case err != nil:
		// A JSON object that fails a field check; DecodeDescriptor's text
		// names the field, never its value.
		return Descriptor{}, notPeer(sessionID, strings.TrimPrefix(err.Error(), "mooncake: "), err)
	}
	return d, nil
}

// notPeer is the handshake error for a reply that failed a check: see
// notPeerError. reason must quote nothing of the peer's bytes.
func notPeer(sessionID, reason string, cause error) error {
	return fmt.Errorf("mooncake: handshake with %s: %w", sessionID, &notPeerError{reason: reason, cause: cause})
}

func (i *Initiator) exchangeFrame(ctx context.Context, conn net.Conn) (uint8, []byte, bool, error) {
	_ = conn.SetDeadline(i.deadline(ctx))
	if err := WriteFrame(conn, HSMetadata, []byte("{}")); err != nil {
		return 0, nil, false, err
	}
	return readFrame(conn, MaxHandshakeFrame)
}

// attempt runs one transfer. retry reports whether a failure may be due to
// stale state (a cached descriptor, a pooled connection).
func (i *Initiator) attempt(ctx context.Context, s *session, desc Descriptor, addr uint64, payload Payload, cached bool) (res Result, retry bool, err error) {
	size := uint64(payload.Len())
	version := 1
	if desc.TCPProtoVersion >= 2 {
		version = 2
	}
	res = Result{Version: version}
	switch {
	case !desc.HasTCP():
		// The peer's protocol names are not quoted (they are its bytes).
		return res, cached, fmt.Errorf("mooncake: session %s: %w", s.id, ErrNotTCP)
	case !desc.Contains(addr, size):
		return res, cached, &RangeError{Session: s.id, Addr: addr, Size: size}
	case desc.TCPDataPort <= 0:
		return res, cached, fmt.Errorf("mooncake: session %s: descriptor has no tcp_data_port", s.id)
	}
	dataAddr := net.JoinHostPort(dataHost(s.id, desc), strconv.Itoa(desc.TCPDataPort))

	var conn net.Conn
	if version == 2 && cached {
		conn = i.takeIdle(s, dataAddr)
	}
	res.Reused = conn != nil
	if conn == nil {
		if conn, err = i.dial(ctx, dataAddr); err != nil {
			return res, cached, fmt.Errorf("mooncake: session %s: data connection to %s: %w", s.id, dataAddr, err)
		}
	}

	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(aLongTimeAgo) })
	_ = conn.SetDeadline(i.deadline(ctx))
	hdr := Header{Size: size, Addr: addr, Opcode: OpWrite}
	if version == 2 {
		hdr.Opcode |= FlagV2
		err = writeV2(ctx, conn, AppendHeader(make([]byte, 0, HeaderSize), hdr), payload)
	} else {
		err = writeV1(ctx, conn, AppendHeader(make([]byte, 0, HeaderSize), hdr), payload)
	}
	interrupted := !stop()

	if err == errRejected {
		_ = conn.Close()
		return res, cached, &RejectedError{Session: s.id, Addr: addr, Size: size}
	}
	if err != nil {
		_ = conn.Close()
		err = ctxErr(ctx, err)
		var pe *PayloadError
		retry = (cached || res.Reused) && ctx.Err() == nil && !isTimeout(err) && !errors.As(err, &pe)
		return res, retry, fmt.Errorf("mooncake: session %s: writing %d bytes to %s (v%d): %w", s.id, size, dataAddr, version, err)
	}
	if version == 2 && !interrupted {
		i.putIdle(s, dataAddr, conn)
	} else {
		_ = conn.Close()
	}
	res.Bytes = int(size)
	return res, false, nil
}

// statusGrace is how long writeV2 still waits for a status frame after the
// body failed to send (a rejection may be on its way).
const statusGrace = time.Second

// errRejected is writeV2's ADDR_REJECTED outcome.
var errRejected = errors.New("ADDR_REJECTED")

// writeV2 sends header and payload, then reads the status frame, all on the
// calling goroutine (a writer goroutine beside a reader cost 4-7% of an
// 8 MiB loopback transfer in hand-offs). A real v2 server answers
// ADDR_REJECTED after the header and closes, so a large body then fails to
// send (reset) while the frame waits in the receive queue (§9): after a
// failed send the frame is still read, for statusGrace, unless the payload
// itself failed (the peer waits for the rest and will not answer) or ctx
// ended.
func writeV2(ctx context.Context, conn net.Conn, hdr []byte, payload Payload) error {
	werr := sendPayload(ctx, conn, hdr, payload)
	var pe *PayloadError
	if werr != nil && (errors.As(werr, &pe) || ctx.Err() != nil) {
		return fmt.Errorf("sending: %w", werr)
	}
	if werr != nil {
		_ = conn.SetReadDeadline(time.Now().Add(statusGrace))
	}
	var st [StatusFrameSize]byte
	if _, rerr := io.ReadFull(conn, st[:]); rerr != nil {
		switch {
		case werr != nil:
			return fmt.Errorf("sending: %w", werr)
		case rerr == io.EOF || rerr == io.ErrUnexpectedEOF:
			return fmt.Errorf("connection closed before the status frame: %w", rerr)
		}
		return fmt.Errorf("reading the status frame: %w", rerr)
	}
	status, perr := ParseStatus(st[:])
	switch {
	case perr != nil:
		return perr
	case status == StatusAddrRejected:
		return errRejected
	case status != StatusOK:
		return errors.New("unknown status in the status frame") // not printed: it failed its check
	case werr != nil:
		// OK is sent only after the server applied every byte, so this
		// cannot be; the send's failure wins.
		return fmt.Errorf("sending: %w", werr)
	}
	return nil
}

// writeV1 sends header and payload, half-closes, and waits for EOF: a v1
// server reads the next header (and so sees our FIN) only after the body is in
// memory, and then closes (reference §1.6).
func writeV1(ctx context.Context, conn net.Conn, hdr []byte, payload Payload) error {
	if err := sendPayload(ctx, conn, hdr, payload); err != nil {
		return fmt.Errorf("sending: %w", err)
	}
	cw, ok := conn.(interface{ CloseWrite() error })
	if !ok {
		return fmt.Errorf("connection %T cannot half-close, so a v1 transfer cannot be confirmed", conn)
	}
	if err := cw.CloseWrite(); err != nil {
		return fmt.Errorf("half-close: %w", err)
	}
	var b [64]byte
	for {
		n, err := conn.Read(b[:])
		if n > 0 {
			return errors.New("v1 peer sent unexpected bytes after a write")
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("waiting for the peer to close: %w", err)
		}
	}
}

// sendPayload writes the header and the payload, which must send exactly
// its Len bytes. The header goes out in one writev with the payload's first
// write (for bytes in memory, the whole payload), so the peer gets no
// header-only segment to wake up for, and nothing is copied. A failure of
// the payload's own (not of a write to conn) is a *PayloadError.
func sendPayload(ctx context.Context, conn net.Conn, hdr []byte, payload Payload) error {
	w := &payloadWriter{conn: conn, hdr: hdr, left: payload.Len()}
	err := payload.Send(ctx, w)
	switch {
	case w.err != nil:
		return w.err // the connection failed; what the payload made of it does not matter
	case err != nil:
		return &PayloadError{Err: err}
	case w.left > 0:
		return &PayloadError{Err: fmt.Errorf("it sent %d of its %d bytes", payload.Len()-w.left, payload.Len())}
	}
	return nil
}

// PayloadError is a WriteFrom that failed because its payload did (the
// source of the bytes), not the connection or the peer. It is not retried.
type PayloadError struct{ Err error }

func (e *PayloadError) Error() string { return "payload: " + e.Err.Error() }
func (e *PayloadError) Unwrap() error { return e.Err }

// payloadWriter is the connection as a Payload sees it: the request header
// goes out with the first write, writes past Len are refused (the peer
// would read them as the next header), and the first write error is kept.
type payloadWriter struct {
	conn net.Conn
	hdr  []byte // not sent yet
	left int64
	err  error
}

func (w *payloadWriter) Write(p []byte) (int, error) {
	if int64(len(p)) > w.left {
		return 0, fmt.Errorf("mooncake: a write of %d bytes past the payload's end (%d left)", len(p), w.left)
	}
	if w.err != nil {
		return 0, w.err
	}
	var n int
	var err error
	if w.hdr != nil {
		bufs := net.Buffers{w.hdr, p}
		var m int64
		m, err = bufs.WriteTo(w.conn) // one writev on a TCP connection
		n = max(int(m)-len(w.hdr), 0)
		w.hdr = nil
	} else {
		n, err = w.conn.Write(p)
	}
	w.left -= int64(n)
	if err != nil {
		w.err = err
	}
	return n, err
}

func (i *Initiator) takeIdle(s *session, dataAddr string) net.Conn {
	i.mu.Lock()
	defer i.mu.Unlock()
	if s.idleAddr != dataAddr || len(s.idle) == 0 {
		return nil
	}
	c := s.idle[len(s.idle)-1]
	s.idle = s.idle[:len(s.idle)-1]
	return c
}

func (i *Initiator) putIdle(s *session, dataAddr string, c net.Conn) {
	i.mu.Lock()
	defer i.mu.Unlock()
	// Peek: returning a connection is not a use of the session, and a session
	// evicted (or replaced under its id) while this Write was in flight must
	// not keep connections that nothing would close.
	if cur, ok := i.sessions.Peek(s.id); i.closed || !ok || cur != s || i.cfg.MaxIdlePerPeer < 0 {
		_ = c.Close()
		return
	}
	if s.idleAddr != dataAddr {
		s.closeIdleLocked()
		s.idleAddr = dataAddr
	}
	if len(s.idle) >= i.cfg.MaxIdlePerPeer {
		_ = c.Close()
		return
	}
	s.idle = append(s.idle, c)
}

// dial opens a TCP connection with ConnectTimeout and TCP_NODELAY.
func (i *Initiator) dial(ctx context.Context, addr string) (net.Conn, error) {
	dctx, cancel := context.WithTimeout(ctx, i.cfg.ConnectTimeout)
	defer cancel()
	c, err := i.cfg.Dial(dctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	if nd, ok := c.(interface{ SetNoDelay(bool) error }); ok {
		_ = nd.SetNoDelay(true)
	}
	return c, nil
}

func (i *Initiator) deadline(ctx context.Context) time.Time {
	d := time.Now().Add(i.cfg.Timeout)
	if cd, ok := ctx.Deadline(); ok && cd.Before(d) {
		return cd
	}
	return d
}

// dataHost is the host to dial for data: host(desc.Name) in P2P mode (the
// name is "host:rpc_port"); the session's own host when the name is not of
// that form.
func dataHost(sessionID string, desc Descriptor) string {
	if h, _, err := ParseSessionID(desc.Name); err == nil {
		return h
	}
	h, _, _ := ParseSessionID(sessionID)
	return h
}

// aLongTimeAgo is a deadline in the past, to abort blocked I/O.
var aLongTimeAgo = time.Unix(1, 0)

// ctxErr reports the context's error in place of the deadline error that
// cancelling it provoked.
func ctxErr(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("%w (%v)", cerr, err)
	}
	return err
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
