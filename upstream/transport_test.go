package upstream

import (
	"bufio"
	"errors"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/configfile"
)

// recordingConn is one end of a pipe that records the order of the
// transport's calls on it: writes, Await, reads.
type recordingConn struct {
	net.Conn
	mu    sync.Mutex
	calls []string
}

func (c *recordingConn) note(s string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n := len(c.calls); n == 0 || c.calls[n-1] != s {
		c.calls = append(c.calls, s)
	}
}

func (c *recordingConn) Write(b []byte) (int, error) { c.note("write"); return c.Conn.Write(b) }
func (c *recordingConn) Read(b []byte) (int, error)  { c.note("read"); return c.Conn.Read(b) }
func (c *recordingConn) Await()                      { c.note("await") }

// The transport takes its response reader only after Await: a request the
// encoder holds waits in Await, with no read buffer taken.
func TestTransportAwaitsBeforeItReads(t *testing.T) {
	client, server := net.Pipe()
	defer server.Close()
	rc := &recordingConn{Conn: client}
	hc := newClient("e", &url.URL{Scheme: "http", Host: "encoder:1"}, DefaultClient())
	hc.Dial = func(string) (net.Conn, error) { return rc, nil }
	go func() {
		br := bufio.NewReader(server)
		var req fasthttp.Request
		if err := req.Read(br); err != nil {
			return
		}
		_, _ = server.Write([]byte("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"))
	}()
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI("http://encoder:1/scheduler_receive_meta_data")
	req.Header.SetMethod("POST")
	req.SetBodyString(`{"req_id":"a"}`)
	if err := hc.DoTimeout(req, resp, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode() != 200 || string(resp.Body()) != "ok" {
		t.Fatalf("answer %d %q", resp.StatusCode(), resp.Body())
	}
	rc.mu.Lock()
	got := strings.Join(rc.calls, ",")
	rc.mu.Unlock()
	if got != "write,await,read" {
		t.Fatalf("calls on the connection: %s; want write,await,read", got)
	}
}

// A request whose deadline passes while the encoder holds it fails as a
// timeout, as with fasthttp's own transport.
func TestTransportDeadlineIsATimeout(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	hc := newClient("e", &url.URL{Scheme: "http", Host: ln.Addr().String()}, DefaultClient())
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI("http://" + ln.Addr().String() + "/scheduler_receive_meta_data")
	req.Header.SetMethod("POST")
	err = hc.DoTimeout(req, resp, 50*time.Millisecond)
	if c := <-accepted; c != nil {
		c.Close()
	}
	if !errors.Is(err, fasthttp.ErrTimeout) {
		t.Fatalf("err = %v, want fasthttp.ErrTimeout", err)
	}
}

// A dial that finds every turn taken waits for one within the connect
// timeout, then fails as a timeout that says why; with a turn free it
// connects.
func TestDialWaitsForATurnWithinTheConnectTimeout(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	cc := DefaultClient()
	cc.ConnectTimeout, cc.MaxDialsPerEncoder = configfile.Duration(20*time.Millisecond), 1
	d := newDialer(cc)
	d.turns <- struct{}{} // a dial in progress holds the only turn
	_, err = d.dial(ln.Addr().String())
	var ne net.Error
	if !errors.Is(err, errDialQueue) || !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("dial with no turn free: %v; want a timeout wrapping errDialQueue", err)
	}
	if !strings.Contains(err.Error(), "upstream.max_dials_per_encoder") {
		t.Fatalf("the error does not name the setting: %v", err)
	}
	released := make(chan error, 1)
	go func() {
		c, err := d.dial(ln.Addr().String())
		if err == nil {
			c.Close()
		}
		released <- err
	}()
	<-d.turns // the dial in progress ends: the waiting one gets the turn
	if err := <-released; err != nil {
		t.Fatalf("dial after a turn was freed: %v", err)
	}
	if len(d.turns) != 0 {
		t.Fatalf("%d turns still taken after every dial ended", len(d.turns))
	}
}
