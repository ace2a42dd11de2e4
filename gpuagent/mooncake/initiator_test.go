package mooncake

import (
	"context"
	"errors"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestWriteV2Pooled(t *testing.T) {
	r := startReceiver(t, ReceiverConfig{Buffers: []int{64 << 10, 64 << 10}}, nil)
	ini := newInitiator(t, InitiatorConfig{})
	ctx := testCtx(t)
	b := r.Buffers()[1]

	fill := pattern(int(b.Length), 0xE0)
	res, err := ini.Write(ctx, r.SessionID(), b.Addr, fill)
	if err != nil {
		t.Fatal(err)
	}
	if res != (Result{Bytes: len(fill), Version: 2, Reused: false, Handshake: true}) {
		t.Fatalf("first write: %+v", res)
	}

	payload := pattern(1000, 0x11)
	const off = 12345
	res, err = ini.Write(ctx, r.SessionID(), b.Addr+off, payload)
	if err != nil {
		t.Fatal(err)
	}
	if res != (Result{Bytes: 1000, Version: 2, Reused: true, Handshake: false}) {
		t.Fatalf("second write: %+v (want a pooled connection, no handshake)", res)
	}
	checkBuffer(t, r, b, fill, off, payload)

	// The other buffer is untouched.
	other, _ := r.Bytes(r.Buffers()[0].Addr, int(r.Buffers()[0].Length))
	for _, c := range other {
		if c != 0 {
			t.Fatal("buffer 0 changed")
		}
	}
	if st := r.Stats(); st.Writes != 2 || st.Bytes != uint64(len(fill)+len(payload)) || st.Rejected != 0 || st.DataConns != 1 {
		t.Fatalf("stats %+v (want 2 writes over 1 connection)", st)
	}
}

func TestWriteV1OneRequestPerConn(t *testing.T) {
	// Mooncake <= v0.3.9: no tcp_proto_version, no status frame, one request per connection.
	r := startReceiver(t, ReceiverConfig{Buffers: []int{32 << 10}, ProtoVersion: 1, OneRequestPerConn: true}, nil)
	if r.Descriptor().TCPProtoVersion != 1 || strings.Contains(string(r.Descriptor().EncodeJSON()), "tcp_proto_version") {
		t.Fatal("a v1 receiver must publish no tcp_proto_version")
	}
	ini := newInitiator(t, InitiatorConfig{})
	ctx := testCtx(t)
	b := r.Buffers()[0]

	fill := pattern(int(b.Length), 0x5A)
	if res, err := ini.Write(ctx, r.SessionID(), b.Addr, fill); err != nil || res != (Result{Bytes: len(fill), Version: 1, Handshake: true}) {
		t.Fatalf("fill: %+v, %v", res, err)
	}
	payload := pattern(777, 0x01)
	const off = 4099
	res, err := ini.Write(ctx, r.SessionID(), b.Addr+off, payload)
	if err != nil || res != (Result{Bytes: 777, Version: 1}) {
		t.Fatalf("write: %+v, %v (v1 never reuses a connection)", res, err)
	}
	// EOF confirmed the write: the bytes are there without waiting.
	checkBuffer(t, r, b, fill, off, payload)
	if st := r.Stats(); st.Writes != 2 || st.DataConns != 2 {
		t.Fatalf("stats %+v", st)
	}
}

func TestWriteV1LoopingReceiver(t *testing.T) {
	// Mooncake v0.3.10-v0.3.11: v1, but the server loops until EOF; the
	// initiator's half-close ends the loop.
	r := startReceiver(t, ReceiverConfig{Buffers: []int{4096}, ProtoVersion: 1}, nil)
	ini := newInitiator(t, InitiatorConfig{})
	b := r.Buffers()[0]
	payload := pattern(100, 9)
	res, err := ini.Write(testCtx(t), r.SessionID(), b.Addr+50, payload)
	if err != nil || res.Version != 1 {
		t.Fatalf("%+v, %v", res, err)
	}
	checkBuffer(t, r, b, make([]byte, b.Length), 50, payload)
}

func TestWriteOutOfRange(t *testing.T) {
	r := startReceiver(t, ReceiverConfig{Buffers: []int{4096, 4096}}, nil)
	ini := newInitiator(t, InitiatorConfig{})
	ctx := testCtx(t)
	bufs := r.Buffers()
	b := bufs[0]

	cases := []struct {
		name string
		addr uint64
		size int
	}{
		{"past the end", b.Addr + b.Length - 10, 20},
		{"before the start", b.Addr - 1, 2},
		{"unknown address", 0x1000, 16},
		{"empty payload", b.Addr, 0},
		{"wraps past 2^64", 1<<64 - 8, 16},
	}
	if bufs[1].Addr == b.Addr+b.Length { // adjacent allocations: also try spanning both
		cases = append(cases, struct {
			name string
			addr uint64
			size int
		}{"spans two buffers", b.Addr + b.Length - 8, 16})
	}
	for n, tt := range cases {
		res, err := ini.Write(ctx, r.SessionID(), tt.addr, make([]byte, tt.size))
		var re *RangeError
		if !errors.As(err, &re) {
			t.Fatalf("%s: err = %v, want *RangeError", tt.name, err)
		}
		if re.Session != r.SessionID() || re.Addr != tt.addr || re.Size != uint64(tt.size) {
			t.Fatalf("%s: %+v", tt.name, re)
		}
		// The first call fetched the descriptor; later ones refreshed the
		// cached one once before refusing.
		if !res.Handshake || res.Bytes != 0 {
			t.Fatalf("%s (call %d): %+v", tt.name, n, res)
		}
	}
	if st := r.Stats(); st != (ReceiverStats{}) {
		t.Fatalf("the receiver saw data traffic: %+v", st)
	}
}

// lyingHandshake serves r's descriptor with buffer 0 grown by extra bytes, so
// the initiator's own check passes and the receiver has to reject.
func lyingHandshake(t *testing.T, r *Receiver, extra uint64) string {
	d := r.Descriptor()
	d.Buffers[0].Length += extra
	body := d.EncodeJSON()
	return fakeHandshake(t, func(int, uint8) (uint8, []byte) { return HSMetadata, body })
}

func TestWriteRejectedByReceiver(t *testing.T) {
	r := startReceiver(t, ReceiverConfig{Buffers: []int{4096}}, nil)
	b := r.Buffers()[0]
	fill := pattern(int(b.Length), 0x33)
	ini := newInitiator(t, InitiatorConfig{})
	ctx := testCtx(t)
	if _, err := ini.Write(ctx, r.SessionID(), b.Addr, fill); err != nil {
		t.Fatal(err)
	}

	liar := lyingHandshake(t, r, 16<<20)
	for _, size := range []int{100, 8 << 20} { // 8 MiB: rejected while the body is still being sent
		_, err := ini.Write(ctx, liar, b.Addr+b.Length-10, make([]byte, size))
		var rej *RejectedError
		if !errors.As(err, &rej) {
			t.Fatalf("size %d: err = %v, want *RejectedError", size, err)
		}
		if rej.Session != liar || rej.Addr != b.Addr+b.Length-10 || rej.Size != uint64(size) {
			t.Fatalf("%+v", rej)
		}
	}
	if st := r.Stats(); st.Rejected < 2 || st.Writes != 1 {
		t.Fatalf("stats %+v", st)
	}
	checkBuffer(t, r, b, fill, 0, nil)
}

func TestWriteRefreshesStaleDescriptor(t *testing.T) {
	r := startReceiver(t, ReceiverConfig{Buffers: []int{4096}}, nil)
	stale := r.Descriptor()
	stale.TCPDataPort = stalePort // as if the peer restarted on new ports
	staleJSON, freshJSON := stale.EncodeJSON(), r.Descriptor().EncodeJSON()
	sid := fakeHandshake(t, func(n int, _ uint8) (uint8, []byte) {
		if n == 0 {
			return HSMetadata, staleJSON
		}
		return HSMetadata, freshJSON
	})
	ini := newInitiator(t, InitiatorConfig{Dial: refusingDial})
	ctx := testCtx(t)
	if d, err := ini.Descriptor(ctx, sid); err != nil || d.TCPDataPort != stale.TCPDataPort {
		t.Fatalf("%+v, %v", d, err)
	}
	b := r.Buffers()[0]
	payload := pattern(64, 3)
	res, err := ini.Write(ctx, sid, b.Addr+8, payload)
	if err != nil {
		t.Fatal(err)
	}
	if !res.Handshake || res.Reused || res.Version != 2 {
		t.Fatalf("%+v: want a refresh and a new connection", res)
	}
	checkBuffer(t, r, b, make([]byte, b.Length), 8, payload)
	if d, _ := ini.Descriptor(ctx, sid); d.TCPDataPort != r.Descriptor().TCPDataPort {
		t.Fatal("the refreshed descriptor was not cached")
	}
}

func TestWriteFreshDescriptorFailureIsNotRetried(t *testing.T) {
	stale := Descriptor{Name: "127.0.0.1:1", Protocols: []string{"tcp"}, TCPDataPort: stalePort, TCPProtoVersion: 2,
		Buffers: []Buffer{{Name: "127.0.0.1:1", Addr: 4096, Length: 4096}}}
	var mu sync.Mutex
	calls := 0
	sid := fakeHandshake(t, func(int, uint8) (uint8, []byte) {
		mu.Lock()
		calls++
		mu.Unlock()
		return HSMetadata, stale.EncodeJSON()
	})
	ini := newInitiator(t, InitiatorConfig{Dial: refusingDial})
	_, err := ini.Write(testCtx(t), sid, 4096, []byte("x"))
	if err == nil || !strings.Contains(err.Error(), "data connection to 127.0.0.1:"+strconv.Itoa(stale.TCPDataPort)) {
		t.Fatalf("err = %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if calls != 1 {
		t.Fatalf("%d handshakes, want 1", calls)
	}
}

func TestWriteRetriesStalePooledConnection(t *testing.T) {
	// A v2 receiver that closes after each request: the pooled connection is
	// dead on the next Write, which then retries on a new one.
	r := startReceiver(t, ReceiverConfig{Buffers: []int{4096}, OneRequestPerConn: true}, nil)
	ini := newInitiator(t, InitiatorConfig{})
	ctx := testCtx(t)
	b := r.Buffers()[0]
	if _, err := ini.Write(ctx, r.SessionID(), b.Addr, pattern(10, 1)); err != nil {
		t.Fatal(err)
	}
	payload := pattern(20, 2)
	res, err := ini.Write(ctx, r.SessionID(), b.Addr+100, payload)
	if err != nil {
		t.Fatal(err)
	}
	if res.Reused || !res.Handshake {
		t.Fatalf("%+v: want the retry on a new connection after a refresh", res)
	}
	got, _ := r.Bytes(b.Addr+100, 20)
	if string(got) != string(payload) {
		t.Fatal("payload not applied")
	}
}

func TestWriteConcurrentOneHandshake(t *testing.T) {
	r := startReceiver(t, ReceiverConfig{Buffers: []int{1 << 20}}, nil)
	ini := newInitiator(t, InitiatorConfig{MaxIdlePerPeer: 2})
	ctx := testCtx(t)
	b := r.Buffers()[0]
	const n, size = 16, 4096
	var wg sync.WaitGroup
	results := make([]Result, n)
	errs := make([]error, n)
	for k := range n {
		wg.Go(func() {
			results[k], errs[k] = ini.Write(ctx, r.SessionID(), b.Addr+uint64(k*size), pattern(size, byte(k)))
		})
	}
	wg.Wait()
	handshakes := 0
	for k := range n {
		if errs[k] != nil {
			t.Fatal(errs[k])
		}
		if results[k].Handshake {
			handshakes++
		}
		got, _ := r.Bytes(b.Addr+uint64(k*size), size)
		if string(got) != string(pattern(size, byte(k))) {
			t.Fatalf("slot %d differs", k)
		}
	}
	if handshakes != 1 {
		t.Fatalf("%d handshakes for one session, want 1", handshakes)
	}
	ini.mu.Lock()
	s, _ := ini.sessions.Peek(r.SessionID())
	idle := len(s.idle)
	ini.mu.Unlock()
	if idle > 2 {
		t.Fatalf("%d idle connections, MaxIdlePerPeer is 2", idle)
	}
}

func TestWriteNotTCP(t *testing.T) {
	body := []byte(`{"name":"127.0.0.1:1","protocol":"rdma","devices":[],"buffers":[{"name":"cpu:0","addr":4096,"length":4096,"rkey":[1],"lkey":[1]}]}`)
	sid := fakeHandshake(t, func(int, uint8) (uint8, []byte) { return HSMetadata, body })
	ini := newInitiator(t, InitiatorConfig{})
	if _, err := ini.Write(testCtx(t), sid, 4096, []byte("x")); !errors.Is(err, ErrNotTCP) {
		t.Fatalf("err = %v, want ErrNotTCP", err)
	}
}

func TestWriteContextCancelled(t *testing.T) {
	// A data port that takes the request and never answers.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = io.ReadFull(c, make([]byte, HeaderSize+10))
		close(got)
		_, _ = io.Copy(io.Discard, c) // until the initiator closes
	})
	t.Cleanup(func() { _ = ln.Close(); wg.Wait() })
	d := Descriptor{Name: "127.0.0.1:1", Protocols: []string{"tcp"}, TCPDataPort: ln.Addr().(*net.TCPAddr).Port, TCPProtoVersion: 2,
		Buffers: []Buffer{{Name: "127.0.0.1:1", Addr: 4096, Length: 4096}}}
	sid := fakeHandshake(t, func(int, uint8) (uint8, []byte) { return HSMetadata, d.EncodeJSON() })

	ini := newInitiator(t, InitiatorConfig{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { <-got; cancel() }()
	_, err = ini.Write(ctx, sid, 4096, make([]byte, 10))
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
}

func TestWriteTimeout(t *testing.T) {
	// A handshake port that accepts and never answers: Timeout bounds it, and
	// the error is a net timeout the caller can classify.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		_, _ = io.Copy(io.Discard, c)
		_ = c.Close()
	})
	t.Cleanup(func() { _ = ln.Close(); wg.Wait() })
	ini := newInitiator(t, InitiatorConfig{Timeout: 50 * time.Millisecond})
	_, err = ini.Write(testCtx(t), ln.Addr().String(), 4096, []byte("x"))
	if !isTimeout(err) {
		t.Fatalf("err = %v, want a timeout", err)
	}
}

func TestInitiatorDialHookAndClose(t *testing.T) {
	r := startReceiver(t, ReceiverConfig{Buffers: []int{4096}}, nil)
	var mu sync.Mutex
	var dialed []string
	ini := NewInitiator(InitiatorConfig{Dial: func(ctx context.Context, network, addr string) (net.Conn, error) {
		mu.Lock()
		dialed = append(dialed, addr)
		mu.Unlock()
		var d net.Dialer
		return d.DialContext(ctx, network, addr)
	}})
	b := r.Buffers()[0]
	if _, err := ini.Write(testCtx(t), r.SessionID(), b.Addr, []byte("abc")); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	if len(dialed) != 2 || dialed[0] != r.SessionID() || dialed[1] != dataAddrOf(r) {
		t.Fatalf("dialed %q; want the handshake port, then the data port", dialed)
	}
	mu.Unlock()
	if err := ini.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := ini.Write(testCtx(t), r.SessionID(), b.Addr, []byte("abc")); !errors.Is(err, ErrClosed) {
		t.Fatalf("after Close: %v", err)
	}
	if _, err := ini.Write(testCtx(t), "no-port", b.Addr, []byte("abc")); err == nil {
		t.Fatal("a bad session id was accepted")
	}
}

func TestWriteIPv6(t *testing.T) {
	ln, err := net.Listen("tcp6", "[::1]:0")
	if err != nil {
		t.Skip("no IPv6 loopback:", err)
	}
	_ = ln.Close()
	r := startReceiver(t, ReceiverConfig{HandshakeListen: "[::1]:0", DataListen: "[::1]:0", Buffers: []int{4096}}, nil)
	if !strings.HasPrefix(r.SessionID(), "[::1]:") {
		t.Fatalf("session id %q", r.SessionID())
	}
	ini := newInitiator(t, InitiatorConfig{})
	b := r.Buffers()[0]
	if _, err := ini.Write(testCtx(t), r.SessionID(), b.Addr+1, []byte("v6")); err != nil {
		t.Fatal(err)
	}
	if got, _ := r.Bytes(b.Addr+1, 2); string(got) != "v6" {
		t.Fatal("bytes not applied")
	}
}
