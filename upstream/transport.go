package upstream

import (
	"time"

	"github.com/valyala/fasthttp"
)

// awaiter is a connection that can wait for an answer to begin without a
// read buffer of its caller's (tcpconn.Conn, through probedConn).
type awaiter interface{ Await() }

// awaitTransport is the round trip of fasthttp's default transport for the
// requests the pool sends (no streamed bodies, no connection lifetime
// limit, no client-side timeouts beyond the request's own), with one
// change: the response reader, a pooled 4 KiB buffer, is taken only once
// the answer has begun. The default takes it as soon as the request is
// written, so a pull the encoder holds for up to 180 s holds a buffer the
// whole time; with thousands held in a 504 storm that was the largest part
// of what the gateway kept per held request (bench/held.sh).
//
// Await keeps whatever it finds instead of bytes for the Read that follows,
// so errors, timeouts and the unsent verdict are what the default
// transport's would be.
type awaitTransport struct{}

func (awaitTransport) RoundTrip(hc *fasthttp.HostClient, req *fasthttp.Request, resp *fasthttp.Response) (retry bool, err error) {
	// One deadline for the whole exchange, waiting for a connection
	// included, as the default transport's; none clears the last one.
	timeout := req.GetTimeOut()
	var deadline time.Time
	if timeout > 0 {
		deadline = time.Now().Add(timeout)
	}
	cc, err := hc.AcquireConn(timeout, req.ConnectionClose())
	if err != nil {
		return false, err
	}
	conn := cc.Conn()
	resp.ParseNetConn(conn)
	if err := conn.SetDeadline(deadline); err != nil {
		hc.CloseConn(cc)
		return true, err
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
		return true, err
	}
	if req.Header.IsHead() {
		resp.SkipBody = true
	}
	if a, ok := conn.(awaiter); ok {
		a.Await()
	}
	br := hc.AcquireReader(conn)
	err = resp.ReadLimitBody(br, hc.MaxResponseBodySize)
	hc.ReleaseReader(br)
	if err != nil {
		hc.CloseConn(cc)
		return err != fasthttp.ErrBodyTooLarge, err
	}
	if req.ConnectionClose() || resp.ConnectionClose() {
		hc.CloseConn(cc)
	} else {
		hc.ReleaseConn(cc)
	}
	return false, nil
}
