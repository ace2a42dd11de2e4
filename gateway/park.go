package gateway

import (
	"bufio"
	"bytes"
	"net"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/poller"
	"github.com/encgate/encgate/internal/sglang"
	"github.com/encgate/encgate/upstream"
)

// Parked exchanges. A long poll (a metadata pull, a registration) may be
// held by its encoder for up to 180 s, and sglang's receivers hold
// thousands at once in a 504 storm. Once its request is out, such an
// exchange parks (upstream.Pool.ExchangeParked): the request's handler
// returns, fasthttp hands the client's connection over (a hijack that
// writes nothing, and keeps the connection), and one poller
// (internal/poller) watches both the encoder's connection, for the answer,
// and the client's, for a hangup. No goroutine, request context, buffer or
// upstream request is kept meanwhile: a parked exchange is its call, its
// copied body and the two connections.
//
// When the exchange ends (its answer judged, retries and all, on the
// goroutine that resumed it), the answer is written on the client's
// connection here, and the connection goes back to fasthttp for its next
// request (Server.ServeConn), unless the client asked to close it or the
// gateway is draining. A client that hangs up while parked has its
// connection closed at once; the exchange goes on to its verdict as it
// would have with the client waiting (a pull's answer is shared with its
// part's other ranks, an /encode's failure is remembered), and its answer
// is dropped.

// parkable reports whether rt's calls may park on ctx's connection: a long
// poll, a poller running, and a client connection with a descriptor to
// watch (not TLS, not a test's fake).
func (s *Server) parkable(ctx *fasthttp.RequestCtx, rt *sglang.Route) bool {
	if s.poller == nil || !s.conf().Limits.ParkLongPolls {
		return false
	}
	// Long polls, and /encode: GEN1's answers once the part is encoded,
	// which may take a while. (/send goes through the dedupe store's
	// flight and keeps its goroutine.)
	if !(rt.Kind == sglang.KindFollowUp && rt.LongPoll || rt.Kind == sglang.KindEncode) {
		return false
	}
	f, ok := ctx.Conn().(fder)
	if !ok {
		return false
	}
	_, ok = f.Fd()
	return ok
}

type fder interface{ Fd() (int, bool) }

// held is one parked exchange's client side.
type held struct {
	s     *Server
	rt    *sglang.Route
	start time.Time
	call  upstream.Call
	close bool // the client asked to close after this answer (or spoke HTTP/1.0 without keep-alive)

	// Kept across uses while pooled (helds): the copy of what the call
	// borrowed from the request, and finish as a func value, made once.
	buf      []byte
	finishFn func(upstream.Result)

	mu    sync.Mutex
	st    heldState
	res   upstream.Result
	conn  net.Conn // the client's, once attached
	pre   []byte   // bytes the client sent past the request, read before parking
	watch poller.Watch
}

// exchangeParkable runs a long poll's exchange, parking it if its encoder
// holds it; true when it parked, and the answer is written later.
func (s *Server) exchangeParkable(ctx *fasthttp.RequestCtx, rt *sglang.Route, req *sglang.Request, start time.Time) bool {
	h := helds.Get().(*held)
	h.s, h.rt, h.start, h.close = s, rt, start, ctx.Request.Header.ConnectionClose()
	// The call may outlive the request's context: what it borrowed is
	// copied, into the pooled held's own buffer. (req.ReqID is a copy
	// already.)
	method, ctype, body := ctx.Method(), ctx.Request.Header.ContentType(), ctx.PostBody()
	buf := append(append(append(h.buf[:0], method...), ctype...), body...)
	h.buf = buf
	h.call = upstream.Call{Route: rt, ReqID: req.ReqID, Rank: req.Rank,
		Method: buf[:len(method):len(method)], ContentType: buf[len(method) : len(method)+len(ctype) : len(method)+len(ctype)],
		Body: buf[len(method)+len(ctype):], Start: start, Done: ctx.Done(), Stop: s.stopping, Resp: fasthttp.AcquireResponse(),
		Via: s.loop.Via(&ctx.Request.Header)}
	if mm := req.MMItems; len(mm) > 0 {
		// An /encode's placement key is a view of its body (mm_items):
		// the same bytes of the copy.
		body := h.call.Body
		if off := cap(ctx.PostBody()) - cap(mm); off >= 0 && off+len(mm) <= len(body) && bytes.Equal(body[off:off+len(mm)], mm) {
			h.call.PlaceKey = body[off : off+len(mm) : off+len(mm)]
		}
	}
	s.parked.Add(1)
	res, ended := s.pool.ExchangeParked(&h.call, h.finishFn)
	if ended {
		s.parked.Done()
		s.answer(ctx, rt, h.call.ReqID, res, h.call.Resp)
		fasthttp.ReleaseResponse(h.call.Resp)
		h.recycle()
		return false
	}
	ctx.HijackSetNoResponse(true)
	ctx.Hijack(h.attach)
	return true
}

// helds pools the client sides of calls that end without parking (most:
// an answer that comes at once); one that parked is left to the collector.
var helds = sync.Pool{New: func() any {
	h := new(held)
	h.finishFn = h.finish
	return h
}}

// maxPooledBuf bounds the copy buffer a pooled held keeps: a large body's
// is left to the collector rather than held by the pool.
const maxPooledBuf = 16 << 10

// recycle gives back a held whose call ended without parking.
func (h *held) recycle() {
	buf, fin := h.buf[:0], h.finishFn
	if cap(buf) > maxPooledBuf {
		buf = nil
	}
	*h = held{buf: buf, finishFn: fin}
	helds.Put(h)
}

// attach is the hijack handler: the client's connection, handed over once
// the request's handler returned. It runs on a goroutine fasthttp starts
// for it, which releases the request's context when it returns: it never
// stays.
func (h *held) attach(hc net.Conn) {
	raw := hc
	if u, ok := hc.(interface{ UnsafeConn() net.Conn }); ok {
		raw = u.UnsafeConn()
	}
	pre := takeBuffered(hc, raw)
	h.mu.Lock()
	h.conn, h.pre = raw, pre
	a := h.st.attach()
	if a&actWatch != 0 {
		h.arm()
	}
	h.mu.Unlock()
	h.do(a, true)
}

// arm watches the client's connection; h.mu is held. A connection whose
// watch cannot be armed is answered without one: it cannot be told from
// a client still waiting.
func (h *held) arm() {
	fd, _ := h.conn.(fder).Fd()
	w, err := h.s.poller.Watch(fd, h.client)
	if err != nil {
		h.st.watching = false // finish answers it
		return
	}
	h.watch = w
}

// finish is the exchange's end, on the goroutine that resumed it.
func (h *held) finish(res upstream.Result) {
	h.mu.Lock()
	h.res = res
	a := h.st.finish()
	if a&actStop != 0 {
		a = h.st.stopped(h.s.poller.Stop(h.watch))
	}
	h.mu.Unlock()
	h.do(a, false)
}

// client is the client watch's event.
func (h *held) client(ev poller.Event) {
	h.mu.Lock()
	a := h.st.client(ev&poller.Hangup != 0)
	h.mu.Unlock()
	h.do(a, false)
}

// do carries out a's actions, outside h.mu: nothing else touches the
// connection or the call once the state says done. fresh says this is
// the hijack handler's goroutine, which must not stay to serve the
// connection's next requests (it holds the request's context until it
// returns).
func (h *held) do(a heldAction, fresh bool) {
	s := h.s
	if a&actClose != 0 {
		h.closeConn()
		s.metrics.clientGone.Inc()
	}
	if a&actWrite != 0 {
		h.write(fresh)
	}
	if a&actRelease != 0 {
		fasthttp.ReleaseResponse(h.call.Resp)
		h.call.Resp = nil
		s.parked.Done()
	}
}

// write answers the client, then hands its connection back to the server
// or closes it.
func (h *held) write(fresh bool) {
	s := h.s
	out := fasthttp.AcquireResponse()
	defer fasthttp.ReleaseResponse(out)
	out.Header.SetNoDefaultContentType(true)
	s.answerTo(out, h.rt, h.call.ReqID, h.res, h.call.Resp)
	closeAfter := h.close || !s.ready.Load()
	if closeAfter {
		out.SetConnectionClose()
	}
	status := out.StatusCode()
	err := h.conn.SetWriteDeadline(time.Now().Add(s.conf().Limits.WriteTimeout.D()))
	if err == nil {
		bw := writers.Get().(*bufio.Writer)
		bw.Reset(h.conn)
		if err = out.Write(bw); err == nil {
			err = bw.Flush()
		}
		bw.Reset(nil)
		writers.Put(bw)
	}
	s.metrics.observe(h.rt, status, s.clk.Now().Sub(h.start))
	if err == nil {
		err = h.conn.SetWriteDeadline(time.Time{})
	}
	if err != nil || closeAfter {
		if err != nil {
			if ce := s.quiet.Check(zap.DebugLevel, "parked answer not written"); ce != nil {
				ce.Write(zap.String("route", h.rt.Path), zap.String("req_id", h.call.ReqID), zap.Error(err))
			}
		}
		h.closeConn()
		return
	}
	c := h.conn
	if len(h.pre) > 0 {
		c = &replayConn{Conn: c, pre: h.pre}
	}
	if fresh {
		go s.srv.ServeConn(c) //nolint:errcheck // ConnState counts its end
		return
	}
	_ = s.srv.ServeConn(c)
}

// closeConn closes the client's connection and counts it closed in
// limits.max_conns (a hijacked connection is counted until then).
func (h *held) closeConn() {
	h.conn.Close()
	h.s.conns.ConnState(h.conn, fasthttp.StateClosed)
}

var writers = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, 4096) }}

// takeBuffered returns what the client sent past the request that the
// server had already read (a pipelined request in fasthttp's reader, or in
// the connection's read-ahead): hc reads it first. It reads hc with a
// deadline already passed, so nothing waiting on the socket is taken,
// only bytes already read from it.
func takeBuffered(hc, raw net.Conn) []byte {
	if err := raw.SetReadDeadline(time.Unix(1, 0)); err != nil {
		return nil
	}
	var pre []byte
	var buf [512]byte
	for {
		n, err := hc.Read(buf[:])
		pre = append(pre, buf[:n]...)
		if err != nil || n == 0 {
			break
		}
	}
	_ = raw.SetReadDeadline(time.Time{})
	return pre
}

// replayConn is a client connection that reads pre before the socket:
// bytes the client sent past a parked request, which the server read
// before the exchange parked.
type replayConn struct {
	net.Conn
	pre []byte
}

// Fd is the connection's (a parked exchange's next request may park).
func (c *replayConn) Fd() (int, bool) {
	if f, ok := c.Conn.(fder); ok {
		return f.Fd()
	}
	return 0, false
}

// NetConn returns the connection under the replay (listener's framing
// checks look through it).
func (c *replayConn) NetConn() net.Conn { return c.Conn }

func (c *replayConn) Read(p []byte) (int, error) {
	if len(c.pre) > 0 {
		n := copy(p, c.pre)
		c.pre = c.pre[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}
