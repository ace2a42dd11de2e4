package upstream

import (
	"io"
	"net"
	"time"

	"github.com/valyala/fasthttp"
)

// sentRequest is an exchange whose request is out and whose answer has not
// begun: what awaitTransport.RoundTrip does up to Await, kept so that the
// wait can happen elsewhere (a parked exchange, whose socket a poller
// watches) and the answer be read later, on another goroutine (receive).
type sentRequest struct {
	hc        *fasthttp.HostClient
	conn      net.Conn
	release   func(close bool) // gives the connection back to hc, or closes it
	head      bool
	connClose bool
	deadline  time.Time // the try's, set on the socket
	at        time.Time // when sendRequest read the clock, just before the send
}

// fd is the descriptor a poller watches for the answer; false when the
// connection has none to offer (TLS), and the answer must be awaited.
func (s *sentRequest) fd() (int, bool) {
	if f, ok := s.conn.(fder); ok {
		return f.Fd()
	}
	return 0, false
}

// begunWithin reports whether the answer began (or the exchange's outcome
// came: an error, the try's deadline) within d of now, waiting for it on
// the caller's goroutine; false, with nothing consumed, when d passed
// first or the connection cannot wait that way.
func (s *sentRequest) begunWithin(d time.Duration) bool {
	if d <= 0 {
		return false
	}
	a, ok := s.conn.(untilAwaiter)
	return ok && a.AwaitUntil(s.at.Add(d)) // from the send: no clock read of its own
}

// sendRequest is do up to the wait for the answer: host and scheme set,
// the client's preparation of the exchange (HostClient.Do's, for what the
// pool's clients use), and stale pooled connections retried as do retries
// them. The request is on the wire when it returns nil.
func sendRequest(c *fasthttp.HostClient, host, scheme string, req *fasthttp.Request, resp *fasthttp.Response, timeout time.Duration) (*sentRequest, error) {
	req.Header.SetHost(host)
	req.URI().SetScheme(scheme)
	req.URI().DisablePathNormalizing = c.DisablePathNormalizing
	resp.Reset()
	resp.Header.SetNoDefaultContentType(true)
	if timeout <= 0 {
		return nil, fasthttp.ErrTimeout
	}
	at := time.Now()
	deadline := at.Add(timeout)
	for attempt := 0; ; attempt++ {
		if attempt > 0 {
			timeout = time.Until(deadline) // the re-sends share what is left
		}
		s, err := sendOnce(c, req, resp, deadline, timeout)
		if s != nil {
			s.at = at
		}
		if err == io.EOF {
			err = fasthttp.ErrConnectionClosed // as HostClient.Do reports it
		}
		err = staleIfUnsent(err, resp)
		if err == nil || !isStale(err) || attempt == maxStaleRetries {
			return s, err
		}
	}
}

// sendOnce is awaitTransport.RoundTrip up to Await, with the held request
// flushed: nothing of the exchange waits on this goroutine afterwards.
// timeout is what is left until deadline (the caller read the clock).
func sendOnce(hc *fasthttp.HostClient, req *fasthttp.Request, resp *fasthttp.Response, deadline time.Time, timeout time.Duration) (*sentRequest, error) {
	if timeout <= 0 {
		return nil, fasthttp.ErrTimeout
	}
	cc, err := hc.AcquireConn(timeout, req.ConnectionClose())
	if err != nil {
		return nil, err
	}
	conn := cc.Conn()
	resp.ParseNetConn(conn)
	if err := conn.SetDeadline(deadline); err != nil {
		hc.CloseConn(cc)
		return nil, err
	}
	bw := hc.AcquireWriter(conn)
	err = req.Write(bw)
	if err == nil {
		err = bw.Flush()
	}
	hc.ReleaseWriter(bw)
	if err == nil {
		if f, ok := conn.(flusher); ok {
			err = f.Flush()
		}
	}
	if err != nil {
		hc.CloseConn(cc)
		if t, ok := err.(interface{ Timeout() bool }); ok && t.Timeout() {
			err = fasthttp.ErrTimeout
		}
		return nil, err
	}
	return &sentRequest{hc: hc, conn: conn, head: req.Header.IsHead(), connClose: req.ConnectionClose(), deadline: deadline,
		release: func(close bool) {
			if close {
				hc.CloseConn(cc)
			} else {
				hc.ReleaseConn(cc)
			}
		}}, nil
}

// receive reads the answer into resp (the Response sendRequest was given),
// as awaitTransport.RoundTrip does from Await on, then gives the
// connection back or closes it. Its errors are RoundTrip's under
// HostClient.Do and do.
func (s *sentRequest) receive(resp *fasthttp.Response) error {
	if s.head {
		resp.SkipBody = true
	}
	if a, ok := s.conn.(awaiter); ok {
		a.Await()
	}
	br := s.hc.AcquireReader(s.conn)
	err := resp.ReadLimitBody(br, s.hc.MaxResponseBodySize)
	s.hc.ReleaseReader(br)
	if err != nil {
		s.release(true)
		if err == io.EOF {
			err = fasthttp.ErrConnectionClosed
		}
		return staleIfUnsent(err, resp)
	}
	s.release(s.connClose || resp.ConnectionClose())
	return nil
}

// abandon closes the connection of a request whose answer nobody will
// read.
func (s *sentRequest) abandon() { s.release(true) }
