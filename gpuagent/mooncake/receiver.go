package mooncake

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"go.uber.org/zap"
)

// handshakeTimeout is Mooncake's SO_RCVTIMEO on a handshake connection.
const handshakeTimeout = 5 * time.Second

// Handshake replies, as the TCP engine sends them (reference §9), each with
// jsoncpp's trailing newline.
var (
	replyProbe      = []byte(`{"status":"success"}` + "\n")
	replyNotify     = []byte(`{"name":"","notify_msg":"success"}` + "\n")
	replyConnection = []byte(`{"local_gid":"","local_lid":0,"local_nic_path":"","payload":"","peer_nic_path":"","qp_num":[],"reply_msg":""}` + "\n")
)

// ReceiverConfig configures a Receiver.
type ReceiverConfig struct {
	// HandshakeListen is the handshake (RPC) port's address; default
	// "127.0.0.1:0".
	HandshakeListen string
	// DataListen is the data port's address; default "127.0.0.1:0".
	DataListen string
	// AdvertiseHost is the host in the session ID and the descriptor's name,
	// so initiators dial it for both ports. Default: HandshakeListen's host,
	// which must then not be a wildcard.
	AdvertiseHost string
	// Buffers are the sizes in bytes of the buffers to allocate and register.
	Buffers []int
	// ProtoVersion is the TCP protocol version: 2 (the default) behaves like
	// Mooncake v0.3.12: the descriptor says tcp_proto_version 2, a request
	// with FlagV2 gets status frames and a rejected one ADDR_REJECTED. 1
	// behaves like Mooncake <= v0.3.11: no tcp_proto_version in the
	// descriptor, no status frames, the opcode is not masked (0x81 reads).
	// Ranges are validated either way (the buffers are Go memory); a peer
	// that gets no status frame only sees the connection close.
	ProtoVersion int
	// OneRequestPerConn closes a data connection after one request, as
	// Mooncake <= v0.3.9 did; otherwise the connection loops until EOF.
	OneRequestPerConn bool
}

// ReceiverStats counts data-port activity.
type ReceiverStats struct {
	Writes    uint64 // WRITE requests applied
	Bytes     uint64 // bytes applied by those writes
	Rejected  uint64 // requests whose range was outside every buffer
	Reads     uint64 // READ requests accepted (counted before the data is sent)
	DataConns uint64 // data connections accepted
}

// hsEvent reports how one handshake connection ended (a test hook).
type hsEvent struct {
	Type         uint8
	Legacy       bool
	Err          error // reading the request or writing the reply
	ClientClosed bool  // after the reply, the client closed before the timeout
}

// Receiver is a Mooncake TCP receiver over Go-allocated buffers (reference
// §1.9): a handshake port that answers Metadata, Probe, Notify and Connection
// frames, and a data port that applies WRITE and serves READ requests after
// checking each range against the buffers.
type Receiver struct {
	cfg  ReceiverConfig
	log  *zap.Logger
	mem  [][]byte
	bufs []Buffer

	// Test hooks, set before Start.
	hsTimeout time.Duration
	hsHook    func(hsEvent)

	hsLn, dataLn net.Listener
	desc         Descriptor
	descJSON     []byte
	sessionID    string
	done         chan struct{}

	mu     sync.Mutex // protects conns, closed, started
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup

	writes, bytes, rejected, reads, dataConns atomic.Uint64

	// memEpoch is bumped after every applied write and loaded before every
	// access to the buffers. TCP already orders a transfer before the
	// initiator's confirmation and its next request, but the race detector
	// does not see that order through a close; this atomic makes it explicit.
	// Writes to overlapping ranges that are really concurrent stay racy, as
	// they are in Mooncake.
	memEpoch atomic.Uint64
}

// NewReceiver allocates the buffers. Their advertised addresses are the real
// addresses of the Go slices: the Go heap does not move objects, and the
// Receiver keeps them alive. log may be nil.
func NewReceiver(cfg ReceiverConfig, log *zap.Logger) (*Receiver, error) {
	if log == nil {
		log = zap.NewNop()
	}
	switch cfg.ProtoVersion {
	case 0:
		cfg.ProtoVersion = 2
	case 1, 2:
	default:
		return nil, fmt.Errorf("mooncake: receiver proto_version %d; must be 1 or 2", cfg.ProtoVersion)
	}
	if cfg.HandshakeListen == "" {
		cfg.HandshakeListen = "127.0.0.1:0"
	}
	if cfg.DataListen == "" {
		cfg.DataListen = "127.0.0.1:0"
	}
	if cfg.AdvertiseHost == "" {
		h, _, err := net.SplitHostPort(cfg.HandshakeListen)
		if err != nil {
			return nil, fmt.Errorf("mooncake: receiver handshake_listen: %w", err)
		}
		if ip := net.ParseIP(h); h == "" || (ip != nil && ip.IsUnspecified()) {
			return nil, fmt.Errorf("mooncake: receiver advertise_host is required when handshake_listen %q is a wildcard", cfg.HandshakeListen)
		}
		cfg.AdvertiseHost = h
	}
	if len(cfg.Buffers) == 0 {
		return nil, errors.New("mooncake: receiver needs at least one buffer")
	}
	r := &Receiver{
		cfg:       cfg,
		log:       log.Named("mooncake.receiver"),
		hsTimeout: handshakeTimeout,
		done:      make(chan struct{}),
		conns:     make(map[net.Conn]struct{}),
	}
	for i, n := range cfg.Buffers {
		if n <= 0 {
			return nil, fmt.Errorf("mooncake: receiver buffers[%d] = %d; must be > 0", i, n)
		}
		b := make([]byte, n)
		r.mem = append(r.mem, b)
		r.bufs = append(r.bufs, Buffer{
			Addr:   uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))),
			Length: uint64(n),
		})
	}
	return r, nil
}

// Start listens on both ports and serves them until Close.
func (r *Receiver) Start() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed || r.hsLn != nil {
		return errors.New("mooncake: receiver already started or closed")
	}
	hsLn, err := net.Listen("tcp", r.cfg.HandshakeListen)
	if err != nil {
		return fmt.Errorf("mooncake: receiver handshake listener: %w", err)
	}
	dataLn, err := net.Listen("tcp", r.cfg.DataListen)
	if err != nil {
		_ = hsLn.Close()
		return fmt.Errorf("mooncake: receiver data listener: %w", err)
	}
	r.hsLn, r.dataLn = hsLn, dataLn
	r.sessionID = net.JoinHostPort(r.cfg.AdvertiseHost, strconv.Itoa(hsLn.Addr().(*net.TCPAddr).Port))
	for i := range r.bufs {
		r.bufs[i].Name = r.sessionID
	}
	r.desc = Descriptor{
		Name:            r.sessionID,
		Protocols:       []string{"tcp"},
		TCPDataPort:     dataLn.Addr().(*net.TCPAddr).Port,
		TCPProtoVersion: r.cfg.ProtoVersion,
		Buffers:         append([]Buffer(nil), r.bufs...),
	}
	r.wg.Add(2)
	go r.acceptLoop(hsLn, r.serveHandshake)
	go r.acceptLoop(dataLn, r.serveData)
	r.log.Info("mooncake receiver started",
		zap.String("session_id", r.sessionID),
		zap.Int("data_port", r.desc.TCPDataPort),
		zap.Int("proto_version", r.cfg.ProtoVersion),
		zap.Int("buffers", len(r.bufs)))
	return nil
}

// SessionID is AdvertiseHost:<handshake port> (Mooncake's segment name in P2P
// mode), with an IPv6 host bracketed. Empty before Start.
func (r *Receiver) SessionID() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.sessionID
}

// Descriptor is what the handshake port answers to Metadata (valid after Start).
func (r *Receiver) Descriptor() Descriptor {
	r.mu.Lock()
	defer r.mu.Unlock()
	d := r.desc
	d.Protocols = append([]string(nil), d.Protocols...)
	d.Buffers = append([]Buffer(nil), d.Buffers...)
	return d
}

// Buffers lists the registered buffers (names are set by Start).
func (r *Receiver) Buffers() []Buffer {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Buffer(nil), r.bufs...)
}

// Bytes returns a copy of [addr, addr+n), which must lie inside one buffer.
// Call it once the transfer that wrote those bytes was confirmed: it does not
// lock out a transfer in flight.
func (r *Receiver) Bytes(addr uint64, n int) ([]byte, error) {
	if n <= 0 {
		return nil, fmt.Errorf("mooncake: receiver bytes: length %d; must be > 0", n)
	}
	_ = r.memEpoch.Load()
	dst, ok := r.region(addr, uint64(n))
	if !ok {
		return nil, fmt.Errorf("mooncake: receiver bytes: range %s is not inside one buffer", formatRange(addr, uint64(n)))
	}
	return append([]byte(nil), dst...), nil
}

// Stats returns the data-port counters.
func (r *Receiver) Stats() ReceiverStats {
	return ReceiverStats{
		Writes:    r.writes.Load(),
		Bytes:     r.bytes.Load(),
		Rejected:  r.rejected.Load(),
		Reads:     r.reads.Load(),
		DataConns: r.dataConns.Load(),
	}
}

// Close stops both listeners, closes every open connection and waits for the
// goroutines serving them.
func (r *Receiver) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	close(r.done)
	var err error
	if r.hsLn != nil {
		err = errors.Join(r.hsLn.Close(), r.dataLn.Close())
	}
	for c := range r.conns {
		_ = c.Close()
	}
	r.mu.Unlock()
	r.wg.Wait()
	return err
}

// region returns the buffer bytes for [addr, addr+size), if inside one buffer.
func (r *Receiver) region(addr, size uint64) ([]byte, bool) {
	i := findBuffer(r.bufs, addr, size)
	if i < 0 {
		return nil, false
	}
	off := addr - r.bufs[i].Addr
	return r.mem[i][off : off+size], true
}

func (r *Receiver) acceptLoop(ln net.Listener, serve func(net.Conn)) {
	defer r.wg.Done()
	backoff := 5 * time.Millisecond
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			r.log.Warn("accept failed", zap.Error(err), zap.Duration("retry_in", backoff))
			t := time.NewTimer(backoff)
			select {
			case <-r.done:
				t.Stop()
				return
			case <-t.C:
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		if !r.track(c) {
			_ = c.Close()
			return
		}
		go func() {
			defer r.wg.Done()
			defer r.untrack(c)
			serve(c)
		}()
	}
}

// track registers c and counts its goroutine; false once closed.
func (r *Receiver) track(c net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false
	}
	r.conns[c] = struct{}{}
	r.wg.Add(1)
	return true
}

func (r *Receiver) untrack(c net.Conn) {
	_ = c.Close()
	r.mu.Lock()
	delete(r.conns, c)
	r.mu.Unlock()
}

// serveHandshake answers one frame with a frame of the same type (a legacy
// frame without a type byte is answered without one), half-closes, and waits
// for the client to close, as Mooncake's SocketHandShakePlugin does. A frame
// of length 0 or above MaxHandshakeFrame is closed without a reply and
// without reading its body.
func (r *Receiver) serveHandshake(c net.Conn) {
	ev := hsEvent{}
	defer func() {
		if r.hsHook != nil {
			r.hsHook(ev)
		}
	}()
	_ = c.SetDeadline(time.Now().Add(r.hsTimeout))
	typ, _, legacy, err := readFrame(c, MaxHandshakeFrame)
	ev.Type, ev.Legacy = typ, legacy
	if err != nil {
		ev.Err = err
		r.log.Debug("handshake request refused", zap.Stringer("peer", c.RemoteAddr()), zap.Error(err))
		return
	}
	var reply []byte
	switch typ {
	case HSMetadata:
		reply = r.desc.EncodeJSON()
	case HSProbe:
		reply = replyProbe
	case HSNotify:
		reply = replyNotify
	default:
		reply = replyConnection
	}
	if legacy {
		err = writeLegacyFrame(c, reply)
	} else {
		err = WriteFrame(c, typ, reply)
	}
	if err != nil {
		ev.Err = err
		return
	}
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	_, err = io.Copy(io.Discard, io.LimitReader(c, MaxHandshakeFrame))
	ev.ClientClosed = err == nil || !isTimeout(err)
	if !ev.ClientClosed {
		r.log.Warn("handshake client did not close after the reply", zap.Stringer("peer", c.RemoteAddr()))
	}
}

// serveData loops over requests on one data connection (reference §1.4).
func (r *Receiver) serveData(c net.Conn) {
	r.dataConns.Add(1)
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetNoDelay(true)
	}
	var hb [HeaderSize]byte
	for {
		if _, err := io.ReadFull(c, hb[:]); err != nil {
			if err != io.EOF {
				r.log.Debug("data connection ended", zap.Stringer("peer", c.RemoteAddr()), zap.Error(err))
			}
			return
		}
		h, _ := ParseHeader(hb[:])
		if !r.serveRequest(c, h) || r.cfg.OneRequestPerConn {
			return
		}
	}
}

// serveRequest handles one request; false means the connection must close.
func (r *Receiver) serveRequest(c net.Conn, h Header) bool {
	op, v2 := h.Opcode, false
	if r.cfg.ProtoVersion >= 2 {
		v2 = op&FlagV2 != 0
		op &^= FlagV2
	}
	dst, ok := r.region(h.Addr, h.Size)
	if !ok {
		r.rejected.Add(1)
		r.log.Warn("request outside the registered buffers",
			zap.Stringer("peer", c.RemoteAddr()), zap.String("range", formatRange(h.Addr, h.Size)),
			zap.Uint8("opcode", h.Opcode))
		if v2 {
			_, _ = c.Write(AppendStatus(nil, StatusAddrRejected))
		}
		return false
	}
	_ = r.memEpoch.Load()
	if op != OpWrite {
		r.reads.Add(1) // counted before the reply, so a client that has it sees the count
		if v2 {
			if _, err := c.Write(AppendStatus(nil, StatusOK)); err != nil {
				return false
			}
		}
		_, err := c.Write(dst)
		return err == nil
	}
	if _, err := io.ReadFull(c, dst); err != nil { // straight into the buffer
		// The bytes that came are in the buffer as well: publish them as a
		// whole write's are, so a later write into the same range (the
		// sender trying again on another connection) follows them.
		r.memEpoch.Add(1)
		r.log.Debug("write body cut short", zap.Stringer("peer", c.RemoteAddr()), zap.Error(err))
		return false
	}
	r.memEpoch.Add(1)
	r.bytes.Add(h.Size)
	r.writes.Add(1)
	if v2 {
		if _, err := c.Write(AppendStatus(nil, StatusOK)); err != nil {
			return false
		}
	}
	return true
}
