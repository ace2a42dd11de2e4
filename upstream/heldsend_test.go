package upstream

import (
	"bufio"
	"net"
	"net/http"
	"net/url"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
)

// keepOpenServer answers every request on a connection and, when the
// client half-closes it, keeps its own side open: a probe of the client's
// idle connection finds nothing to read, not the EOF of a closed one.
func keepOpenServer(t *testing.T) (addr string, requests *atomic.Int32) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { close(done); ln.Close() })
	requests = &atomic.Int32{}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						<-done // the client's half-close: stay open
						return
					}
					req.Body.Close()
					requests.Add(1)
					_, _ = c.Write([]byte("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 4\r\n\r\nnull"))
				}
			}()
		}
	}()
	return ln.Addr().String(), requests
}

// A request a parkable attempt sends through its grace wait (the read
// that waits for the answer sends it) and whose send fails before any
// byte left is not delivered, and goes again on another connection, as
// when a write fails: here the pooled connection was shut for writing on
// the gateway's side, which its idle probe cannot see (the encoder keeps
// its side open), so the send is what finds it.
func TestHeldSendThatFailsIsSentAgain(t *testing.T) {
	addr, requests := keepOpenServer(t)
	u, err := url.Parse("http://" + addr)
	if err != nil {
		t.Fatal(err)
	}
	hc := newClient("e", u, DefaultClient())
	t.Cleanup(hc.CloseIdleConnections)
	dial := hc.Dial
	var conns []net.Conn
	hc.Dial = func(a string) (net.Conn, error) {
		c, err := dial(a)
		if err == nil {
			conns = append(conns, c)
		}
		return c, err
	}
	exchange := func(i int) {
		t.Helper()
		req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
		defer fasthttp.ReleaseRequest(req)
		defer fasthttp.ReleaseResponse(resp)
		req.Header.SetMethod("POST")
		req.SetRequestURI("/scheduler_receive_meta_data")
		req.SetBodyString(`{"req_id":"x"}`)
		s, begun, err := sendRequest(new(sentRequest), hc, u.Host, "http", req, resp, 5*time.Second, time.Hour)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if !begun {
			t.Fatalf("request %d: the answer did not begin within an hour's grace", i)
		}
		if err := s.receive(resp); err != nil {
			t.Fatalf("request %d: receive: %v", i, err)
		}
		if resp.StatusCode() != 200 || string(resp.Body()) != "null" {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode(), resp.Body())
		}
	}
	exchange(0)
	if len(conns) != 1 {
		t.Fatalf("%d connections dialled for one request", len(conns))
	}
	fd, ok := conns[0].(fder).Fd()
	if !ok {
		t.Fatal("the pooled connection has no descriptor")
	}
	if err := syscall.Shutdown(fd, syscall.SHUT_WR); err != nil {
		t.Fatal(err)
	}
	exchange(1)
	if got := requests.Load(); got != 2 {
		t.Fatalf("server handled %d requests for 2 calls", got)
	}
	if len(conns) != 2 {
		t.Fatalf("%d connections dialled, want 2 (the second request sent again on a new one)", len(conns))
	}
}
