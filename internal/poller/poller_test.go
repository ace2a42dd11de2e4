//go:build linux

package poller

import (
	"net"
	"sync"
	"testing"
)

// pair is a real loopback TCP connection: the watched end and its peer.
func pair(t *testing.T) (watched *net.TCPConn, peer net.Conn, fd int) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	acc := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		acc <- c
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	peer = <-acc
	if peer == nil {
		t.Fatal("accept failed")
	}
	watched = c.(*net.TCPConn)
	raw, err := watched.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	if err := raw.Control(func(f uintptr) { fd = int(f) }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { watched.Close(); peer.Close() })
	return watched, peer, fd
}

func newPoller(t *testing.T) *Poller {
	t.Helper()
	p, err := New()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func TestWatchFiresOnceWhenReadable(t *testing.T) {
	p := newPoller(t)
	_, peer, fd := pair(t)
	got := make(chan Event, 2)
	w, err := p.Watch(fd, func(e Event) { got <- e })
	if err != nil {
		t.Fatal(err)
	}
	if _, err := peer.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if e := <-got; e&Readable == 0 || e&Hangup != 0 {
		t.Fatalf("event = %b, want Readable only", e)
	}
	if p.Stop(w) {
		t.Fatal("Stop after the watch fired reported it disarmed")
	}
	if n := p.Armed(); n != 0 {
		t.Fatalf("armed after firing = %d, want 0", n)
	}
	// One-shot: more bytes do not fire it again; a new watch on the same
	// descriptor fires at once on the bytes still unread (level-triggered).
	if _, err := peer.Write([]byte("y")); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Watch(fd, func(e Event) { got <- e }); err != nil {
		t.Fatal(err)
	}
	if e := <-got; e&Readable == 0 {
		t.Fatalf("re-armed watch event = %b, want Readable", e)
	}
}

func TestWatchSeesThePeersClose(t *testing.T) {
	for _, how := range []string{"close", "reset"} {
		t.Run(how, func(t *testing.T) {
			p := newPoller(t)
			_, peer, fd := pair(t)
			got := make(chan Event, 1)
			if _, err := p.Watch(fd, func(e Event) { got <- e }); err != nil {
				t.Fatal(err)
			}
			if how == "reset" {
				peer.(*net.TCPConn).SetLinger(0)
			}
			peer.Close()
			if e := <-got; e&Hangup == 0 {
				t.Fatalf("event = %b, want Hangup", e)
			}
		})
	}
}

func TestStopBeforeFiringMeansItNeverRuns(t *testing.T) {
	p := newPoller(t)
	_, peer, fd := pair(t)
	ran := make(chan struct{}, 1)
	w, err := p.Watch(fd, func(Event) { ran <- struct{}{} })
	if err != nil {
		t.Fatal(err)
	}
	if !p.Stop(w) {
		t.Fatal("Stop of an armed watch reported it had fired")
	}
	if p.Stop(w) {
		t.Fatal("second Stop reported true")
	}
	// Bytes arriving now find no watch; a later watch on another
	// descriptor reusing the slot fires for itself only.
	if _, err := peer.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	_, peer2, fd2 := pair(t)
	got := make(chan Event, 1)
	w2, err := p.Watch(fd2, func(e Event) { got <- e })
	if err != nil {
		t.Fatal(err)
	}
	if w2.slot != w.slot || w2.gen == w.gen {
		t.Fatalf("slot reuse: %+v after %+v", w2, w)
	}
	if p.Stop(w) {
		t.Fatal("Stop of the old watch stopped the slot's new one")
	}
	peer2.Write([]byte("z"))
	<-got
	select {
	case <-ran:
		t.Fatal("a stopped watch ran")
	default:
	}
}

// TestRaceStopAndFire: for every watch, exactly one of "Stop returned
// true" and "its function ran" happens.
func TestRaceStopAndFire(t *testing.T) {
	p := newPoller(t)
	const n = 200
	var wg sync.WaitGroup
	var mu sync.Mutex
	ran, stopped := 0, 0
	for range n {
		_, peer, fd := pair(t)
		wg.Add(1)
		var once sync.Once
		done := func() { once.Do(wg.Done) }
		w, err := p.Watch(fd, func(Event) {
			mu.Lock()
			ran++
			mu.Unlock()
			done()
		})
		if err != nil {
			t.Fatal(err)
		}
		go peer.Write([]byte("x"))
		if p.Stop(w) {
			mu.Lock()
			stopped++
			mu.Unlock()
			done()
		}
	}
	wg.Wait()
	if ran+stopped != n {
		t.Fatalf("ran %d + stopped %d != %d watches", ran, stopped, n)
	}
	if a := p.Armed(); a != 0 {
		t.Fatalf("armed = %d after every watch ended", a)
	}
}

func TestWatchAfterCloseFails(t *testing.T) {
	p, err := New()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Watch(0, func(Event) {}); err != ErrClosed {
		t.Fatalf("Watch after Close: %v, want ErrClosed", err)
	}
}

func TestWatchOfABadDescriptorFailsAndHoldsNothing(t *testing.T) {
	p := newPoller(t)
	if _, err := p.Watch(-1, func(Event) {}); err == nil {
		t.Fatal("Watch(-1) succeeded")
	}
	if a := p.Armed(); a != 0 {
		t.Fatalf("armed = %d after a failed Watch", a)
	}
}
