package listener

import (
	"errors"
	"net"
	"os"
	"time"

	"github.com/valyala/fasthttp"
)

// LastAnswer makes the error answer in ctx the connection's last and its
// close gentle: fasthttp writes the answer (within writeTimeout) after
// every answer still buffered for requests pipelined before this one, then
// closes the connection, and the close half-closes it and discards what
// the client still sends for a moment (up to lingerTimeout and
// lingerBytes), as net/http does after an answer it cut short
// (framingConn.Close). Closing
// a socket with unread input resets the connection: a client still sending
// an oversized body or header would then see the reset instead of the 413
// or 431. Writing the answer here instead would put it before the buffered
// ones, which the close would then lose.
func LastAnswer(ctx *fasthttp.RequestCtx, writeTimeout time.Duration) {
	c := ctx.Conn()
	ctx.SetConnectionClose()
	_ = c.SetWriteDeadline(time.Now().Add(writeTimeout))
	LingerOnClose(c)
}

// IsReadTimeout reports whether reading a request failed on its deadline.
func IsReadTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, fasthttp.ErrTimeout) || errors.Is(err, os.ErrDeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}
