package upstream

import (
	"bufio"
	"net"
	"net/http"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/encgate/encgate/internal/sglang"

	"github.com/valyala/fasthttp"
)

// oneShotServer answers one request per connection and then closes it
// without a Connection: close header, like an encoder whose keep-alive
// timer fired while the connection sat idle in the gateway's pool.
func oneShotServer(t *testing.T) (addr string, requests *atomic.Int32, closed chan struct{}) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	requests = &atomic.Int32{}
	closed = make(chan struct{}, 16)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer func() { c.Close(); closed <- struct{}{} }()
				req, err := http.ReadRequest(bufio.NewReader(c))
				if err != nil {
					return
				}
				req.Body.Close()
				requests.Add(1)
				_, _ = c.Write([]byte("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 4\r\n\r\nnull"))
			}()
		}
	}()
	return ln.Addr().String(), requests, closed
}

func TestStalePooledConnectionIsNotWrittenTo(t *testing.T) {
	addr, requests, closed := oneShotServer(t)
	u, err := url.Parse("http://" + addr)
	if err != nil {
		t.Fatal(err)
	}
	cc := DefaultClient()
	cc.IdleConnTimeout = 4 // ns: every reuse is probed (the server closes at once)
	e := &Encoder{Name: "e", self: hostClient{host: u.Host, scheme: "http", url: u.String(), client: newClient("e", u, cc)}}
	defer e.self.client.CloseIdleConnections()
	tgt := e.targetFor(sglang.RouteSend, nil)
	for i := 0; i < 3; i++ {
		req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
		req.Header.SetMethod("POST")
		req.SetRequestURI("/send")
		req.SetBodyString(`{"req_id":"x"}`)
		if err := tgt.do(req, resp, 5*time.Second); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if resp.StatusCode() != 200 || string(resp.Body()) != "null" {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode(), resp.Body())
		}
		fasthttp.ReleaseRequest(req)
		fasthttp.ReleaseResponse(resp)
		<-closed // the server has closed this connection; it sits stale in the pool
	}
	if got := requests.Load(); got != 3 {
		t.Fatalf("server handled %d requests for 3 calls", got)
	}
}

func TestProbeSeesALiveConnection(t *testing.T) {
	a, b := net.Pipe() // no syscall.Conn: probing is skipped, not broken
	defer a.Close()
	defer b.Close()
	if _, ok := newProbedConn(a).(*probedConn); ok {
		t.Fatal("wrapped a conn without a file descriptor")
	}
}
