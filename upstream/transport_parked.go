package upstream

import (
	"errors"
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
	cc        any // hc's connection (*fasthttp.clientConn, which is not exported): release gives it back
	conn      net.Conn
	head      bool
	connClose bool
	deadline  time.Time // the try's, set on the socket
}

// release gives the connection back to hc, or closes it.
func (s *sentRequest) release(close bool) {
	if close {
		callWith(s.hc.CloseConn, s.cc)
	} else {
		callWith(s.hc.ReleaseConn, s.cc)
	}
	s.cc, s.conn = nil, nil
}

// callWith calls f with cc, which holds f's argument type: the type of
// fasthttp's pooled connection is inferred from f, since it is not
// exported. (A closure over the connection, made per request, would
// allocate.)
func callWith[C any](f func(C), cc any) { f(cc.(C)) }

// fd is the descriptor a poller watches for the answer; false when the
// connection has none to offer (TLS), and the answer must be awaited.
func (s *sentRequest) fd() (int, bool) {
	if f, ok := s.conn.(fder); ok {
		return f.Fd()
	}
	return 0, false
}

// sendRequest is do up to the wait for the answer: host and scheme set,
// the client's preparation of the exchange (HostClient.Do's, for what the
// pool's clients use), and stale pooled connections retried as do retries
// them. The request is on the wire when it returns nil.
//
// wait, when positive, is how long the answer may take to begin for the
// caller to read it where it is (begun true) rather than hand the wait
// elsewhere: the request is then sent by the read that waits for it
// (tcpconn's held request), so an answer that is not there yet costs no
// read that finds nothing, as in awaitTransport.RoundTrip. A send that
// fails before any byte left is found there as well, and the request goes
// again, as when the write itself fails.
func sendRequest(dst *sentRequest, c *fasthttp.HostClient, host, scheme string, req *fasthttp.Request, resp *fasthttp.Response, timeout, wait time.Duration) (s *sentRequest, begun bool, err error) {
	req.Header.SetHost(host)
	req.URI().SetScheme(scheme)
	req.URI().DisablePathNormalizing = c.DisablePathNormalizing
	resp.Reset()
	resp.Header.SetNoDefaultContentType(true)
	if timeout <= 0 {
		return nil, false, fasthttp.ErrTimeout
	}
	at := time.Now()
	deadline := at.Add(timeout)
	for attempt := 0; ; attempt++ {
		if attempt > 0 {
			timeout = time.Until(deadline) // the re-sends share what is left
		}
		s, err = sendOnce(dst, c, req, resp, deadline, timeout)
		if err == nil {
			begun, err = s.out(at.Add(wait), wait > 0)
			if err == nil && begun && unsentOn(resp) {
				// The held request's send failed at its first byte: what
				// the read that sent it keeps is that failure.
				s.abandon()
				s, begun, err = nil, false, &StaleConnError{Err: errHeldUnsent}
			}
		}
		if err == io.EOF {
			err = fasthttp.ErrConnectionClosed // as HostClient.Do reports it
		}
		err = staleIfUnsent(err, resp)
		if err == nil || !isStale(err) || attempt == maxStaleRetries {
			return s, begun, err
		}
	}
}

// errHeldUnsent is the cause of a stale-connection error found by the
// read that sent a held request: the send failed before any byte left.
var errHeldUnsent = errors.New("the request's send failed before any byte left")

// out puts the request on the wire. With await, the read that waits up to
// until for the answer sends it (begun: the answer, or the exchange's
// outcome, came by then); otherwise, or when that wait gave up before it
// could send (until already passed), it is flushed. A flush that fails
// closes the connection.
func (s *sentRequest) out(until time.Time, await bool) (begun bool, err error) {
	if await {
		if a, ok := s.conn.(untilAwaiter); ok && a.AwaitUntil(until) {
			return true, nil
		}
	}
	if f, ok := s.conn.(flusher); ok {
		if err = f.Flush(); err != nil {
			s.abandon()
			if t, ok := err.(interface{ Timeout() bool }); ok && t.Timeout() {
				err = fasthttp.ErrTimeout
			}
			return false, err
		}
	}
	return false, nil
}

// sendOnce is awaitTransport.RoundTrip up to Await. A small request may
// still be held by the connection when it returns (tcpconn): out sends it.
// timeout is what is left until deadline (the caller read the clock).
// The exchange is kept in dst, which it returns.
func sendOnce(dst *sentRequest, hc *fasthttp.HostClient, req *fasthttp.Request, resp *fasthttp.Response, deadline time.Time, timeout time.Duration) (*sentRequest, error) {
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
	if err != nil {
		hc.CloseConn(cc)
		if t, ok := err.(interface{ Timeout() bool }); ok && t.Timeout() {
			err = fasthttp.ErrTimeout
		}
		return nil, err
	}
	*dst = sentRequest{hc: hc, cc: cc, conn: conn, head: req.Header.IsHead(), connClose: req.ConnectionClose(), deadline: deadline}
	return dst, nil
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
