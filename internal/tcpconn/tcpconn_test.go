package tcpconn

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// pair returns a dialled connection wrapped by wrap and the accepted raw
// end, both closed at cleanup.
func pair(t testing.TB, wrap func(net.Conn) net.Conn) (client net.Conn, peer net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	p, ok := <-accepted
	if !ok {
		t.Fatal("accept failed")
	}
	wc := wrap(c)
	t.Cleanup(func() { wc.Close(); p.Close() })
	return wc, p
}

// answer reads want bytes from peer and writes reply.
func answer(t testing.TB, peer net.Conn, want int, reply string) <-chan []byte {
	got := make(chan []byte, 1)
	go func() {
		buf := make([]byte, want)
		if _, err := io.ReadFull(peer, buf); err != nil {
			got <- nil
			return
		}
		got <- buf
		_, _ = peer.Write([]byte(reply))
	}()
	return got
}

func TestClientHoldsSmallWriteUntilRead(t *testing.T) {
	c, peer := pair(t, Client)
	if _, ok := c.(*Conn); !ok {
		t.Fatalf("Client returned %T", c)
	}
	req := "POST /x HTTP/1.1\r\nHost: h\r\n\r\n"
	if n, err := c.Write([]byte(req)); n != len(req) || err != nil {
		t.Fatalf("Write = %d, %v", n, err)
	}
	// Held: nothing has reached the peer yet.
	_ = peer.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	var one [1]byte
	if n, err := peer.Read(one[:]); n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("peer read before the client's Read: %d, %v; want nothing yet", n, err)
	}
	_ = peer.SetReadDeadline(time.Time{})
	got := answer(t, peer, len(req), "HTTP/1.1 200 OK\r\n\r\n")
	buf := make([]byte, 64)
	n, err := c.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	if string(buf[:n]) != "HTTP/1.1 200 OK\r\n\r\n" {
		t.Fatalf("read %q", buf[:n])
	}
	if g := <-got; string(g) != req {
		t.Fatalf("peer got %q, want %q", g, req)
	}
}

func TestClientManyExchangesKeepOrder(t *testing.T) {
	c, peer := pair(t, Client)
	go func() { // echo every message back
		buf := make([]byte, 4096)
		for {
			n, err := peer.Read(buf)
			if err != nil {
				return
			}
			if _, err := peer.Write(buf[:n]); err != nil {
				return
			}
		}
	}()
	for i := range 200 {
		msg := []byte(strings.Repeat(string(rune('a'+i%26)), 1+i*7%900))
		// Two writes make one held message, as bufio flushes can.
		half := len(msg) / 2
		if _, err := c.Write(msg[:half]); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write(msg[half:]); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(c, got); err != nil {
			t.Fatalf("exchange %d: %v", i, err)
		}
		if !bytes.Equal(got, msg) {
			t.Fatalf("exchange %d: got %q want %q", i, got, msg)
		}
	}
}

func TestLargeWriteGoesOutAtOnce(t *testing.T) {
	c, peer := pair(t, Client)
	big := bytes.Repeat([]byte("x"), MaxHeld+1)
	got := make(chan []byte, 1)
	go func() {
		buf := make([]byte, len(big))
		_, err := io.ReadFull(peer, buf)
		if err != nil {
			buf = nil
		}
		got <- buf
	}()
	if n, err := c.Write(big); n != len(big) || err != nil {
		t.Fatalf("Write = %d, %v", n, err)
	}
	// No Read: the bytes must arrive anyway.
	if g := <-got; !bytes.Equal(g, big) {
		t.Fatalf("peer got %d bytes, want %d", len(g), len(big))
	}
}

func TestHeldBytesLargerThanTheSocketBufferAreAllSent(t *testing.T) {
	c, peer := pair(t, Client)
	// A tiny send buffer and a peer that does not read yet: the held
	// write cannot go out in one syscall.
	if err := c.(*Conn).SetWriteBuffer(1); err != nil {
		t.Fatal(err)
	}
	if err := peer.(*net.TCPConn).SetReadBuffer(1); err != nil {
		t.Fatal(err)
	}
	msg := bytes.Repeat([]byte("0123456789abcdef"), MaxHeld/16)
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	got := answer(t, peer, len(msg), "ok")
	buf := make([]byte, 2)
	if _, err := io.ReadFull(c, buf); err != nil {
		t.Fatal(err)
	}
	if string(buf) != "ok" {
		t.Fatalf("read %q", buf)
	}
	if g := <-got; !bytes.Equal(g, msg) {
		t.Fatalf("peer got %d bytes in some other order or short, want %d", len(g), len(msg))
	}
}

// A request whose caller closes the connection before reading its answer
// never reaches the peer: the caller was told it failed.
func TestCloseDropsHeldBytes(t *testing.T) {
	c, peer := pair(t, Client)
	if _, err := c.Write([]byte("bye")); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(peer)
	if err != nil || len(got) != 0 {
		t.Fatalf("peer read %q, %v", got, err)
	}
}

// waitReset blocks until c's socket has seen its peer's RST (poll reports
// an error or hang-up), bounded by 10s.
func waitReset(t *testing.T, c net.Conn) {
	t.Helper()
	raw, err := c.(*Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var perr error
	var revents int16
	if err := raw.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		_, perr = unix.Poll(fds, 10_000)
		revents = fds[0].Revents
	}); err != nil || perr != nil {
		t.Fatal(err, perr)
	}
	if revents&(unix.POLLERR|unix.POLLHUP) == 0 {
		t.Fatalf("no reset seen (revents %#x)", revents)
	}
}

// A held request to a peer that has reset the connection fails at its
// first byte: nothing left, and Unsent says so.
func TestHeldRequestToAResetPeerIsUnsent(t *testing.T) {
	c, peer := pair(t, Client)
	_ = peer.(*net.TCPConn).SetLinger(0)
	peer.Close()
	waitReset(t, c)
	if _, err := c.Write([]byte("POST /send HTTP/1.1\r\n\r\n")); err != nil {
		t.Fatalf("a held write failed: %v", err)
	}
	if _, err := c.Read(make([]byte, 8)); err == nil {
		t.Fatal("the read after a reset succeeded")
	}
	if !c.(*Conn).Unsent() {
		t.Fatal("Unsent = false for a request that failed at its first byte")
	}
}

// A request the peer read before it reset the connection is not unsent,
// and an answer starts a new exchange.
func TestRequestThePeerReadIsNotUnsent(t *testing.T) {
	c, peer := pair(t, Client)
	got := answer(t, peer, 2, "ok")
	if _, err := c.Write([]byte("hi")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 2)); err != nil {
		t.Fatal(err)
	}
	<-got
	if c.(*Conn).Unsent() {
		t.Fatal("Unsent after an answer")
	}
	read := make(chan struct{})
	go func() {
		defer close(read)
		buf := make([]byte, 5)
		_, _ = io.ReadFull(peer, buf) // the second request arrives
		_ = peer.(*net.TCPConn).SetLinger(0)
		peer.Close()
	}()
	if _, err := c.Write([]byte("again")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Read(make([]byte, 8)); err == nil {
		t.Fatal("read after the reset succeeded")
	}
	<-read
	if c.(*Conn).Unsent() {
		t.Fatal("Unsent = true for a request the peer read")
	}
}

func TestReadDeadlineIsATimeout(t *testing.T) {
	for _, tc := range []struct {
		name string
		wrap func(net.Conn) net.Conn
		held bool
	}{{"client with a held request", Client, true}, {"server", Server, false}} {
		t.Run(tc.name, func(t *testing.T) {
			c, _ := pair(t, tc.wrap)
			if tc.held {
				if _, err := c.Write([]byte("GET / HTTP/1.1\r\n\r\n")); err != nil {
					t.Fatal(err)
				}
			}
			_ = c.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
			_, err := c.Read(make([]byte, 8))
			var ne net.Error
			if !errors.As(err, &ne) || !ne.Timeout() || !errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("err = %v (%T), want a net.Error timeout wrapping os.ErrDeadlineExceeded", err, err)
			}
			var oe *net.OpError
			if !errors.As(err, &oe) || oe.Op != "read" {
				t.Fatalf("err = %#v, want *net.OpError with Op read", err)
			}
		})
	}
}

func TestPeerCloseIsEOF(t *testing.T) {
	c, peer := pair(t, Server)
	peer.Close()
	if n, err := c.Read(make([]byte, 8)); n != 0 || err != io.EOF {
		t.Fatalf("Read = %d, %v; want 0, io.EOF", n, err)
	}
}

func TestWriteToAResetPeerFailsTheRead(t *testing.T) {
	c, peer := pair(t, Client)
	// RST instead of FIN: the client's write fails.
	_ = peer.(*net.TCPConn).SetLinger(0)
	peer.Close()
	var err error
	for range 4 { // the first write may still be accepted locally
		if _, err = c.Write([]byte("x")); err != nil {
			break
		}
		if _, err = c.Read(make([]byte, 1)); err != nil {
			break
		}
	}
	var oe *net.OpError
	if !errors.As(err, &oe) {
		t.Fatalf("err = %v (%T), want the reset as a *net.OpError", err, err)
	}
}

func TestServerReadsPipelinedBytesThatArrivedEarly(t *testing.T) {
	c, peer := pair(t, Server)
	// Two requests arrive before the server writes its first answer.
	if _, err := peer.Write([]byte("one;two;")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "one;" {
		t.Fatalf("first read %q, %v", buf, err)
	}
	if _, err := c.Write([]byte("A1")); err != nil {
		t.Fatal(err)
	}
	// The second request is already in the socket: this must not wait.
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "two;" {
		t.Fatalf("second read %q, %v", buf, err)
	}
	got := make([]byte, 2)
	if _, err := io.ReadFull(peer, got); err != nil || string(got) != "A1" {
		t.Fatalf("peer read %q, %v", got, err)
	}
}

func TestNonTCPConnIsReturnedUnchanged(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if Client(a) != a || Server(b) != b {
		t.Fatal("a net.Pipe conn was wrapped")
	}
}

func TestListenerWrapsAcceptedConns(t *testing.T) {
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := Listener{raw}
	defer ln.Close()
	done := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			done <- nil
			return
		}
		done <- c
	}()
	d, err := net.Dial("tcp", raw.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	c := <-done
	if c == nil {
		t.Fatal("accept failed")
	}
	defer c.Close()
	if cc, ok := c.(*Conn); !ok || cc.hold {
		t.Fatalf("accepted %T (hold=%v), want a server *Conn", c, ok && cc.hold)
	}
}

// BenchmarkExchange is one small request and answer over loopback with an
// echoing peer, through a plain *net.TCPConn and through a client Conn: the
// ratio is what holding the write and raw syscalls save per exchange.
func BenchmarkExchange(b *testing.B) {
	for _, bc := range []struct {
		name string
		wrap func(net.Conn) net.Conn
	}{{"net", func(c net.Conn) net.Conn { return c }}, {"tcpconn", Client}} {
		b.Run(bc.name, func(b *testing.B) {
			c, peer := pair(b, bc.wrap)
			go func() {
				buf := make([]byte, 512)
				for {
					n, err := peer.Read(buf)
					if err != nil {
						return
					}
					if _, err := peer.Write(buf[:n]); err != nil {
						return
					}
				}
			}()
			msg := []byte(`POST /scheduler_receive_meta_data HTTP/1.1` + "\r\n\r\n")
			got := make([]byte, len(msg))
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if _, err := c.Write(msg); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(c, got); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func TestReadFromSendsHeldBytesFirst(t *testing.T) {
	c, peer := pair(t, Client)
	if _, err := c.Write([]byte("head;")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.(io.ReaderFrom).ReadFrom(strings.NewReader("body")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len("head;body"))
	if _, err := io.ReadFull(peer, got); err != nil || string(got) != "head;body" {
		t.Fatalf("peer read %q, %v", got, err)
	}
}

func TestDeadlineSetWhileReadingWakesTheRead(t *testing.T) {
	c, _ := pair(t, Server)
	cc := c.(*Conn)
	errc := make(chan error, 1)
	go func() {
		_, err := c.Read(make([]byte, 8))
		errc <- err
	}()
	// Wait until the Read is in progress (it holds reading=true), then
	// set a deadline that has passed: the waiting Read must return.
	for {
		cc.dl.Lock()
		r := cc.reading
		cc.dl.Unlock()
		if r {
			break
		}
		time.Sleep(time.Millisecond) // polling a state, not synchronising on time
	}
	if err := c.SetReadDeadline(time.Now().Add(-time.Second)); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Read returned %v, want a deadline error", err)
	}
}

func TestPassedReadDeadlineFailsTheNextRead(t *testing.T) {
	c, peer := pair(t, Server)
	if _, err := peer.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(-time.Second))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Read = %v, want a deadline error as net.Conn gives", err)
	}
	_ = c.SetReadDeadline(time.Time{})
	if n, err := c.Read(make([]byte, 1)); n != 1 || err != nil {
		t.Fatalf("Read after clearing the deadline = %d, %v", n, err)
	}
}

func TestWriteThatMustWaitHonoursTheWriteDeadline(t *testing.T) {
	c, peer := pair(t, Server)
	_ = c.(*Conn).SetWriteBuffer(1)
	_ = peer.(*net.TCPConn).SetReadBuffer(1)
	// The peer never reads: a large write fills both buffers and waits.
	_ = c.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
	n, err := c.Write(make([]byte, 8<<20))
	if !errors.Is(err, os.ErrDeadlineExceeded) || n >= 8<<20 {
		t.Fatalf("Write = %d, %v; want a short write and a deadline error", n, err)
	}
	var oe *net.OpError
	if !errors.As(err, &oe) || oe.Op != "write" {
		t.Fatalf("err = %#v, want *net.OpError with Op write", err)
	}
}

// A server Read of one byte (fasthttp asks for a request's first byte
// alone) reads what has arrived in one go; the next Reads get the rest
// from memory, in order, and later bytes come from the socket again.
func TestServerSmallReadReadsAhead(t *testing.T) {
	c, peer := pair(t, Server)
	if _, err := io.WriteString(peer, "POST /a HTTP/1.1\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	one := make([]byte, 1)
	if n, err := c.Read(one); n != 1 || err != nil || one[0] != 'P' {
		t.Fatalf("Read = %d %q %v", n, one, err)
	}
	if len(c.(*Conn).ahead) == 0 {
		t.Fatal("nothing was read ahead")
	}
	rest := make([]byte, 64)
	n, err := c.Read(rest)
	if err != nil || string(rest[:n]) != "OST /a HTTP/1.1\r\n\r\n" {
		t.Fatalf("rest = %q, %v", rest[:n], err)
	}
	if cc := c.(*Conn); cc.aheadBox != nil || len(cc.ahead) != 0 {
		t.Fatal("the read-ahead buffer was kept after it was drained")
	}
	if _, err := io.WriteString(peer, "next"); err != nil {
		t.Fatal(err)
	}
	if n, err := io.ReadFull(c, rest[:4]); n != 4 || err != nil || string(rest[:4]) != "next" {
		t.Fatalf("next = %q, %v", rest[:n], err)
	}
}

// Bytes read ahead and not yet taken go to WriteTo first.
func TestServerWriteToHandsOverWhatWasReadAhead(t *testing.T) {
	c, peer := pair(t, Server)
	if _, err := io.WriteString(peer, "abcdef"); err != nil {
		t.Fatal(err)
	}
	one := make([]byte, 1)
	if _, err := c.Read(one); err != nil {
		t.Fatal(err)
	}
	peer.Close()
	var out bytes.Buffer
	if _, err := c.(*Conn).WriteTo(&out); err != nil {
		t.Fatal(err)
	}
	if out.String() != "bcdef" {
		t.Fatalf("WriteTo gave %q", out.String())
	}
}

// exchangeOutcome is what a caller of a client Conn saw of one exchange.
type exchangeOutcome struct {
	data    string
	err     string
	timeout bool
	unsent  bool
}

// Await followed by Reads is the same exchange as Reads alone, whatever
// the peer does: answers (small, or larger than the read-ahead buffer),
// closes, resets before or after reading the request, or never answers
// before the deadline.
func TestAwaitThenReadIsTheSameExchangeAsRead(t *testing.T) {
	const req = "POST /send HTTP/1.1\r\n\r\n"
	big := strings.Repeat("b", 6000) // more than the 4 KiB read-ahead buffer
	peers := map[string]func(t *testing.T, peer net.Conn){
		"answers": func(t *testing.T, peer net.Conn) { <-answer(t, peer, len(req), "HTTP/1.1 200 OK\r\n\r\n") },
		"answers more than a buffer": func(t *testing.T, peer net.Conn) {
			_, _ = io.ReadFull(peer, make([]byte, len(req)))
			_, _ = peer.Write([]byte(big))
			peer.Close()
		},
		"closes after reading": func(t *testing.T, peer net.Conn) {
			_, _ = io.ReadFull(peer, make([]byte, len(req)))
			peer.Close()
		},
		"resets after reading": func(t *testing.T, peer net.Conn) {
			_, _ = io.ReadFull(peer, make([]byte, len(req)))
			_ = peer.(*net.TCPConn).SetLinger(0)
			peer.Close()
		},
		"never answers": func(t *testing.T, peer net.Conn) {},
	}
	run := func(t *testing.T, name string, await bool) exchangeOutcome {
		c, peer := pair(t, Client)
		_ = c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		if _, err := c.Write([]byte(req)); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() { defer close(done); peers[name](t, peer) }()
		if await {
			c.(*Conn).Await()
		}
		var out exchangeOutcome
		buf := make([]byte, 1000)
		var data []byte
		for len(data) < len(big) {
			n, err := c.Read(buf)
			data = append(data, buf[:n]...)
			if err != nil {
				var ne net.Error
				out.err, out.timeout = err.Error(), errors.As(err, &ne) && ne.Timeout()
				out.err = strings.ReplaceAll(out.err, c.LocalAddr().String(), "LOCAL")
				out.err = strings.ReplaceAll(out.err, c.RemoteAddr().String(), "REMOTE")
				break
			}
			if name == "answers" {
				break
			}
		}
		<-done
		out.data, out.unsent = string(data), c.(*Conn).Unsent()
		return out
	}
	for name := range peers {
		t.Run(name, func(t *testing.T) {
			want, got := run(t, name, false), run(t, name, true)
			if got != want {
				t.Fatalf("with Await: %+v\nRead alone: %+v", got, want)
			}
		})
	}
	t.Run("reset before the request", func(t *testing.T) {
		for _, await := range []bool{false, true} {
			c, peer := pair(t, Client)
			_ = peer.(*net.TCPConn).SetLinger(0)
			peer.Close()
			waitReset(t, c)
			if _, err := c.Write([]byte(req)); err != nil {
				t.Fatal(err)
			}
			if await {
				c.(*Conn).Await()
			}
			if _, err := c.Read(make([]byte, 8)); err == nil || !strings.Contains(err.Error(), "write") {
				t.Fatalf("await %v: Read error %v, want the failed write", await, err)
			}
			if !c.(*Conn).Unsent() {
				t.Fatalf("await %v: Unsent = false for a request that failed at its first byte", await)
			}
		}
	})
}

// Await waits without a buffer: while it waits, none of the read-ahead
// pool's is taken, and what it read is handed over by the next Read.
func TestAwaitTakesNoBufferWhileWaiting(t *testing.T) {
	c, peer := pair(t, Client)
	cc := c.(*Conn)
	if _, err := c.Write([]byte("GET / HTTP/1.1\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	if cc.heldBox == nil {
		t.Fatal("no held buffer before the send")
	}
	awaited := make(chan struct{})
	go func() { defer close(awaited); cc.Await() }()
	// The request arrives: Await sent it, gave the held buffer back and is
	// now waiting, with no read-ahead buffer (readAhead takes one only
	// when the socket has bytes).
	if _, err := io.ReadFull(peer, make([]byte, len("GET / HTTP/1.1\r\n\r\n"))); err != nil {
		t.Fatal(err)
	}
	_, _ = peer.Write([]byte("HTTP/1.1 204 No Content\r\n\r\n"))
	<-awaited
	if cc.heldBox != nil {
		t.Fatal("the held buffer is still taken after the send")
	}
	if cc.aheadBox == nil || string(cc.ahead) != "HTTP/1.1 204 No Content\r\n\r\n" {
		t.Fatalf("ahead = %q, want the answer read ahead", cc.ahead)
	}
	buf := make([]byte, 64)
	n, err := c.Read(buf)
	if err != nil || string(buf[:n]) != "HTTP/1.1 204 No Content\r\n\r\n" {
		t.Fatalf("Read = %q, %v", buf[:n], err)
	}
	if cc.aheadBox != nil {
		t.Fatal("the read-ahead buffer is kept after its bytes were read")
	}
}

// AwaitUntil gives up at its own time without a trace (false, nothing
// kept, the read deadline as set), and otherwise is Await: the answer, or
// an outcome kept for the next Read, the connection's own deadline
// passing included.
func TestAwaitUntil(t *testing.T) {
	const req, ans = "GET / HTTP/1.1\r\n\r\n", "HTTP/1.1 204 No Content\r\n\r\n"
	t.Run("gives up", func(t *testing.T) {
		c, peer := pair(t, Client)
		cc := c.(*Conn)
		dl := time.Now().Add(time.Hour)
		_ = c.SetReadDeadline(dl)
		if _, err := c.Write([]byte(req)); err != nil {
			t.Fatal(err)
		}
		if err := cc.Flush(); err != nil { // as a parked exchange's request is
			t.Fatal(err)
		}
		if cc.AwaitUntil(time.Now().Add(-time.Second)) {
			t.Fatal("AwaitUntil of a passed time = true before any answer")
		}
		if cc.awaited != nil || len(cc.ahead) != 0 || !cc.rdl.Equal(dl) {
			t.Fatalf("after giving up: awaited %v, ahead %q, read deadline %v (want %v)", cc.awaited, cc.ahead, cc.rdl, dl)
		}
		<-answer(t, peer, len(req), ans)
		buf := make([]byte, 64)
		n, err := c.Read(buf)
		if err != nil || string(buf[:n]) != ans {
			t.Fatalf("Read after giving up = %q, %v", buf[:n], err)
		}
	})
	t.Run("answer", func(t *testing.T) {
		c, peer := pair(t, Client)
		if _, err := c.Write([]byte(req)); err != nil {
			t.Fatal(err)
		}
		go func() { <-answer(t, peer, len(req), ans) }()
		if !c.(*Conn).AwaitUntil(time.Now().Add(time.Hour)) {
			t.Fatal("AwaitUntil = false with an answer coming and an hour to wait")
		}
		buf := make([]byte, 64)
		n, err := c.Read(buf)
		if err != nil || string(buf[:n]) != ans {
			t.Fatalf("Read = %q, %v", buf[:n], err)
		}
	})
	t.Run("the connection's deadline first", func(t *testing.T) {
		c, _ := pair(t, Client)
		_ = c.SetReadDeadline(time.Now().Add(-time.Second))
		if _, err := c.Write([]byte(req)); err != nil {
			t.Fatal(err)
		}
		if !c.(*Conn).AwaitUntil(time.Now().Add(time.Hour)) {
			t.Fatal("AwaitUntil = false when the connection's own deadline passed")
		}
		var ne net.Error
		if _, err := c.Read(make([]byte, 8)); !errors.As(err, &ne) || !ne.Timeout() {
			t.Fatalf("Read error %v, want the connection's timeout kept", err)
		}
	})
	t.Run("close", func(t *testing.T) {
		c, peer := pair(t, Client)
		if _, err := c.Write([]byte(req)); err != nil {
			t.Fatal(err)
		}
		go func() { _, _ = io.ReadFull(peer, make([]byte, len(req))); peer.Close() }()
		if !c.(*Conn).AwaitUntil(time.Now().Add(time.Hour)) {
			t.Fatal("AwaitUntil = false for a peer that closed")
		}
		if _, err := c.Read(make([]byte, 8)); err != io.EOF {
			t.Fatalf("Read error %v, want EOF", err)
		}
	})
}
