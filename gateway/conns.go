package gateway

import (
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/sglang"
)

// connLimiter bounds the encoder-facing listener at limits.max_conns open
// connections. It returns accepted connections unwrapped, and fasthttp's
// ConnState hook tells it when one closes. The connection one too many is
// answered with a 503 envelope and closed.
type connLimiter struct {
	net.Listener
	max      int64
	open     atomic.Int64
	accepted atomic.Uint64
	rejected atomic.Uint64
	refusal  []byte // the whole 503 response
	log      *zap.Logger
	lastLog  atomic.Int64 // unix second of the last refusal logged

	lingering chan struct{} // bounds refused connections being closed
	wg        sync.WaitGroup
}

// For a refused connection: how long the 503 may take to write, and how long
// (and how much of) the client's unread request is drained before the close,
// so that the close does not reset the connection before the client has read
// the answer (net/http does the same after an answer it cut short).
const (
	refuseWriteTimeout = time.Second
	lingerTimeout      = 500 * time.Millisecond
	lingerBytes        = 256 << 10
	maxLingering       = 128
)

func newConnLimiter(max int, log *zap.Logger) *connLimiter {
	msg := fmt.Sprintf("encgate: too many connections (limits.max_conns is %d); try again later", max)
	body := sglang.AppendEnvelope(nil, msg, nil)
	head := fmt.Sprintf("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"+
		"Retry-After: 1\r\nConnection: close\r\n\r\n", len(body))
	return &connLimiter{max: int64(max), refusal: append([]byte(head), body...), log: log,
		lingering: make(chan struct{}, maxLingering)}
}

// Accept returns the next connection within the limit, refusing the others.
func (l *connLimiter) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.open.Add(1) <= l.max {
			l.accepted.Add(1)
			return c, nil
		}
		l.open.Add(-1)
		l.rejected.Add(1)
		l.refuse(c)
	}
}

// connState counts a connection fasthttp is done with (its ConnState hook:
// every connection Accept returned ends in StateClosed or StateHijacked).
func (l *connLimiter) connState(_ net.Conn, st fasthttp.ConnState) {
	if st == fasthttp.StateClosed || st == fasthttp.StateHijacked {
		l.open.Add(-1)
	}
}

func (l *connLimiter) refuse(c net.Conn) {
	if now := time.Now().Unix(); l.lastLog.Load() < now-60 {
		l.lastLog.Store(now)
		l.log.Warn("connection refused: limits.max_conns reached (logged at most once a minute; encgate_connections_rejected_total counts them)",
			zap.Int64("max_conns", l.max), zap.Stringer("remote", c.RemoteAddr()))
	}
	_ = c.SetWriteDeadline(time.Now().Add(refuseWriteTimeout))
	if _, err := c.Write(l.refusal); err != nil {
		_ = c.Close()
		return
	}
	select {
	case l.lingering <- struct{}{}:
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			defer func() { <-l.lingering }()
			lingerClose(c, true)
		}()
	default:
		_ = c.Close()
	}
}

// lingerClose half-closes c and discards what the client still sends for
// a moment, then closes c when close is set.
func lingerClose(c net.Conn, close bool) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	_ = c.SetReadDeadline(time.Now().Add(lingerTimeout))
	_, _ = io.CopyN(io.Discard, c, lingerBytes)
	if close {
		_ = c.Close()
	}
}

// wait returns once every refused connection is closed.
func (l *connLimiter) wait() { l.wg.Wait() }
