package mooncake

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
)

// startReceiver starts a Receiver on 127.0.0.1 and closes it at cleanup.
// mutate, when set, runs between NewReceiver and Start (for test hooks).
func startReceiver(t *testing.T, cfg ReceiverConfig, mutate func(*Receiver)) *Receiver {
	t.Helper()
	r, err := NewReceiver(cfg, zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel)))
	if err != nil {
		t.Fatal(err)
	}
	if mutate != nil {
		mutate(r)
	}
	if err := r.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("receiver close: %v", err)
		}
	})
	return r
}

func newInitiator(t *testing.T, cfg InitiatorConfig) *Initiator {
	t.Helper()
	i := NewInitiator(cfg)
	t.Cleanup(func() { _ = i.Close() })
	return i
}

// testCtx bounds a test's network calls so that a bug fails instead of hanging.
func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// pattern returns n bytes derived from seed.
func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7)
	}
	return b
}

// fakeHandshake is a handshake server that answers each connection (one at a
// time, like Mooncake's) with reply(n, request type) and then waits for the
// client to close. It returns its session ID.
func fakeHandshake(t *testing.T, reply func(n int, typ uint8) (uint8, []byte)) string {
	t.Helper()
	return fakeHandshakeRaw(t, func(n int, typ uint8, w io.Writer) {
		rt, body := reply(n, typ)
		_ = WriteFrame(w, rt, body)
	})
}

// fakeHandshakeRaw is fakeHandshake with the reply written by respond.
func fakeHandshakeRaw(t *testing.T, respond func(n int, typ uint8, w io.Writer)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		for n := 0; ; n++ {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			if typ, _, err := ReadFrame(c, 0); err == nil {
				respond(n, typ, c)
				_ = c.(*net.TCPConn).CloseWrite()
				_, _ = io.Copy(io.Discard, c)
			}
			_ = c.Close()
		}
	})
	t.Cleanup(func() {
		_ = ln.Close()
		wg.Wait()
	})
	return ln.Addr().String()
}

// stalePort is the data port of stale descriptors; refusingDial refuses it
// (a listener closed for the purpose could get its port reused meanwhile).
const stalePort = 9

func refusingDial(ctx context.Context, network, addr string) (net.Conn, error) {
	if _, p, _ := net.SplitHostPort(addr); p == strconv.Itoa(stalePort) {
		return nil, &net.OpError{Op: "dial", Net: network, Err: errors.New("connection refused (test)")}
	}
	var d net.Dialer
	return d.DialContext(ctx, network, addr)
}

// rawDial connects to addr and closes the connection at cleanup.
func rawDial(t *testing.T, addr string) *net.TCPConn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return c.(*net.TCPConn)
}

func dataAddrOf(r *Receiver) string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(r.Descriptor().TCPDataPort))
}

// checkBuffer asserts that buffer b of r holds want at offset off and fill
// everywhere else.
func checkBuffer(t *testing.T, r *Receiver, b Buffer, fill []byte, off int, want []byte) {
	t.Helper()
	got, err := r.Bytes(b.Addr, int(b.Length))
	if err != nil {
		t.Fatal(err)
	}
	exp := append([]byte(nil), fill...)
	copy(exp[off:], want)
	if !bytes.Equal(got[off:off+len(want)], want) {
		t.Fatalf("bytes at offset %d differ from the payload", off)
	}
	if !bytes.Equal(got[:off], exp[:off]) {
		t.Fatalf("bytes before offset %d changed", off)
	}
	if !bytes.Equal(got[off+len(want):], exp[off+len(want):]) {
		t.Fatalf("bytes after offset %d+%d changed", off, len(want))
	}
}
