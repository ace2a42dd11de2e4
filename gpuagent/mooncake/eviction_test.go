package mooncake

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// closeRecorder is a Dial hook whose connections record their Close, by the
// address dialed.
type closeRecorder struct {
	mu    sync.Mutex
	conns map[string][]*recordedConn
	// hold, when set, is called before dialing addr (to stall a Write).
	hold func(addr string)
}

type recordedConn struct {
	net.Conn
	closed atomic.Bool
}

func (c *recordedConn) Close() error {
	c.closed.Store(true)
	return c.Conn.Close()
}

func (r *closeRecorder) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	if r.hold != nil {
		r.hold(addr)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	rc := &recordedConn{Conn: c}
	r.mu.Lock()
	if r.conns == nil {
		r.conns = make(map[string][]*recordedConn)
	}
	r.conns[addr] = append(r.conns[addr], rc)
	r.mu.Unlock()
	return rc, nil
}

// open returns how many of the connections dialed to addr are not closed, and
// how many were dialed.
func (r *closeRecorder) open(addr string) (open, dialed int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range r.conns[addr] {
		if !c.closed.Load() {
			open++
		}
	}
	return open, len(r.conns[addr])
}

// With MaxSessions 2, a third session evicts the least recently used one, and
// the eviction closes that session's pooled data connection; Close closes the
// rest.
func TestSessionEvictionClosesPooledConns(t *testing.T) {
	var rs [3]*Receiver
	for k := range rs {
		rs[k] = startReceiver(t, ReceiverConfig{Buffers: []int{4096}}, nil)
	}
	rec := &closeRecorder{}
	ini := newInitiator(t, InitiatorConfig{MaxSessions: 2, Dial: rec.dial})
	ctx := testCtx(t)
	write := func(k int) Result {
		t.Helper()
		res, err := ini.Write(ctx, rs[k].SessionID(), rs[k].Buffers()[0].Addr, []byte("abc"))
		if err != nil {
			t.Fatal(err)
		}
		if res.Version != 2 {
			t.Fatalf("session %d: version %d, want 2 (pooled)", k, res.Version)
		}
		return res
	}
	check := func(k, wantOpen, wantDialed int) {
		t.Helper()
		if open, dialed := rec.open(dataAddrOf(rs[k])); open != wantOpen || dialed != wantDialed {
			t.Fatalf("session %d: %d of %d data connections open, want %d of %d", k, open, dialed, wantOpen, wantDialed)
		}
	}

	write(0)
	write(1)
	check(0, 1, 1) // pooled, not closed
	check(1, 1, 1)
	write(2) // evicts session 0, the least recently used
	check(0, 0, 1)
	check(1, 1, 1)
	check(2, 1, 1)
	ini.mu.Lock()
	_, cached0 := ini.sessions.Peek(rs[0].SessionID())
	n := ini.sessions.Len()
	ini.mu.Unlock()
	if cached0 || n != 2 {
		t.Fatalf("session 0 cached %t, %d sessions; want it evicted and 2 left", cached0, n)
	}

	// Use refreshes: session 1 is now the most recent, so session 0's return
	// evicts session 2.
	if res := write(1); !res.Reused || res.Handshake {
		t.Fatalf("session 1 again: %+v, want the cached descriptor and pooled connection", res)
	}
	if res := write(0); res.Reused || !res.Handshake {
		t.Fatalf("evicted session 0 again: %+v, want a new handshake and connection", res)
	}
	check(2, 0, 1)
	check(0, 1, 2)
	check(1, 1, 1)

	if err := ini.Close(); err != nil {
		t.Fatal(err)
	}
	for k := range rs {
		if open, _ := rec.open(dataAddrOf(rs[k])); open != 0 {
			t.Fatalf("session %d: %d data connections open after Close", k, open)
		}
	}
}

// A session evicted while its Write is in flight: the Write succeeds, and the
// connection it would have pooled is closed, not kept where nothing closes it.
func TestSessionEvictedDuringWrite(t *testing.T) {
	r0 := startReceiver(t, ReceiverConfig{Buffers: []int{4096}}, nil)
	r1 := startReceiver(t, ReceiverConfig{Buffers: []int{4096}}, nil)
	stalled, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	rec := &closeRecorder{hold: func(addr string) {
		if addr == dataAddrOf(r0) {
			once.Do(func() {
				close(stalled)
				<-release
			})
		}
	}}
	ini := newInitiator(t, InitiatorConfig{MaxSessions: 1, Dial: rec.dial})
	ctx := testCtx(t)
	done := make(chan error, 1)
	go func() {
		_, err := ini.Write(ctx, r0.SessionID(), r0.Buffers()[0].Addr, []byte("abc"))
		done <- err
	}()
	<-stalled // session 0 has its descriptor and is dialing for data
	if _, err := ini.Write(ctx, r1.SessionID(), r1.Buffers()[0].Addr, []byte("def")); err != nil {
		t.Fatal(err)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got, err := r0.Bytes(r0.Buffers()[0].Addr, 3); err != nil || string(got) != "abc" {
		t.Fatalf("session 0 holds %q, %v", got, err)
	}
	if open, dialed := rec.open(dataAddrOf(r0)); open != 0 || dialed != 1 {
		t.Fatalf("evicted session: %d of %d data connections open, want 0 of 1", open, dialed)
	}
	if open, _ := rec.open(dataAddrOf(r1)); open != 1 {
		t.Fatalf("cached session: %d data connections open, want 1 (pooled)", open)
	}
}
