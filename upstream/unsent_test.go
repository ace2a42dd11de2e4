package upstream

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
	"golang.org/x/sys/unix"

	"github.com/encgate/encgate/internal/sglang"
	"github.com/encgate/encgate/internal/tcpconn"
)

// resettingEncoder resets its first connection with RST: at once, or
// (read) after reading the request's first bytes, so that they reached
// it. It resets only once dialed is closed. Later connections get their request read and a 200 "null", counted
// in answered.
func resettingEncoder(t *testing.T, read bool, dialed <-chan struct{}) (addr string, reset <-chan struct{}, answered *atomic.Int32) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ch := make(chan struct{}, 1)
	answered = new(atomic.Int32)
	done := make(chan struct{})
	t.Cleanup(func() { ln.Close(); <-done })
	go func() {
		defer close(done)
		for first := true; ; first = false {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if first {
				<-dialed // a reset before the client's connect returned would fail the dial itself
				if read {
					_, _ = io.ReadFull(c, make([]byte, 4))
				}
				_ = c.(*net.TCPConn).SetLinger(0)
				c.Close() // RST
				ch <- struct{}{}
				continue
			}
			if req, err := http.ReadRequest(bufio.NewReader(c)); err == nil {
				_, _ = io.Copy(io.Discard, req.Body)
				answered.Add(1)
				_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 4\r\nContent-Type: application/json\r\n\r\nnull")
			}
			c.Close()
		}
	}()
	return ln.Addr().String(), ch, answered
}

// waitReset blocks until c's socket has seen its peer's RST (bounded).
func waitReset(t *testing.T, c net.Conn) {
	raw, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Error(err)
		return
	}
	_ = raw.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		_, _ = unix.Poll(fds, 10_000)
	})
}

// A request on a connection the encoder reset before its first byte left
// was not delivered: the exchange sends it again on a new connection (as
// for a stale pooled one) and the encoder answers it once. One whose bytes
// reached the encoder before the reset is "maybe sent": not sent again,
// and its verdict keeps a /send from being retried.
func TestARequestThatNeverLeftIsNotDelivered(t *testing.T) {
	for _, tc := range []struct {
		name string
		read bool
	}{
		{"reset before the first byte", false},
		{"reset after the encoder read it", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dialed := make(chan struct{})
			addr, reset, answered := resettingEncoder(t, tc.read, dialed)
			dials := 0
			hc := &fasthttp.HostClient{
				Addr: addr, MaxIdemponentCallAttempts: 1,
				RetryIfErr: func(*fasthttp.Request, int, error) (bool, bool) { return false, false },
				Dial: func(addr string) (net.Conn, error) {
					dials++
					c, err := net.Dial("tcp", addr)
					if err != nil {
						return nil, err
					}
					if dials == 1 {
						close(dialed)
					}
					if dials == 1 && !tc.read { // the write must find the reset already there
						<-reset
						waitReset(t, c)
					}
					return newProbedConn(tcpconn.Client(c)), nil
				},
			}
			req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
			defer fasthttp.ReleaseRequest(req)
			defer fasthttp.ReleaseResponse(resp)
			req.Header.SetMethod(fasthttp.MethodPost)
			req.SetRequestURI("/send")
			req.SetBodyString(`{"req_id":"r"}`)
			err := do(hc, addr, "http", req, resp, 10*time.Second)
			if !tc.read {
				if err != nil || string(resp.Body()) != "null" || dials != 2 || answered.Load() != 1 {
					t.Fatalf("err %v, body %q, %d dials, %d answered; want the request sent again once and answered",
						err, resp.Body(), dials, answered.Load())
				}
				// What the first try's failure alone would have been judged.
				v := Judge(sglang.Lookup([]byte("/send")), nil, nil, Target{Encoder: "enc"},
					Observation{Err: &StaleConnError{Err: errors.New("write: broken pipe")}})
				if v.Delivery != NotSent {
					t.Fatalf("delivery %v", v.Delivery)
				}
				return
			}
			if err == nil || isStale(err) || dials != 1 || answered.Load() != 0 {
				t.Fatalf("err %v (stale %v), %d dials, %d answered; want one maybe-delivered failure", err, isStale(err), dials, answered.Load())
			}
			if v := Judge(sglang.Lookup([]byte("/send")), nil, nil, Target{Encoder: "enc"}, Observation{Err: err}); v.Delivery != MaybeSent {
				t.Fatalf("delivery %v for %v, want MaybeSent", v.Delivery, err)
			}
		})
	}
}
