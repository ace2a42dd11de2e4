package listener

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/sglang"
)

// Limiter is a listener of the gateway's (the encoder-facing one,
// bounded at limits.max_conns, and the admin one, at admin.max_conns). It
// returns accepted connections unwrapped, and its server's ConnState hook
// tells it when one closes. The connection one too many is answered with a
// 503 envelope and closed, so that it holds no descriptor for long.
//
// Accept never hands a temporary error to its server: both fasthttp's
// Serve (which stops on any error but a timeout) and net/http's (which
// retries only what net.Error.Temporary says, not ENOBUFS or ENOMEM, and
// logs every failure) would otherwise take it. acceptRetry waits it out.
type Limiter struct {
	net.Listener
	max        int64
	open       atomic.Int64
	accepted   atomic.Uint64
	rejected   atomic.Uint64
	refusal    []byte // the whole 503 response
	refusedMsg string
	log        *zap.Logger
	clk        clock.Clock
	lastLog    atomic.Int64 // unix second of the last refusal logged

	lingering chan struct{} // bounds refused connections being closed
	wg        sync.WaitGroup

	retry acceptRetry
}

// For a refused connection: how long the 503 may take to write, and how long
// (and how much of) the client's unread request is drained before the close,
// so that the close does not reset the connection before the client has read
// the answer (net/http does the same after an answer it cut short).
const (
	refuseWriteTimeout = time.Second
	lingerTimeout      = 500 * time.Millisecond
	lingerBytes        = 256 << 10
)

// At most this many refused connections linger at once (MaxLingering on
// the encoder-facing listener, AdminMaxLingering on the admin one, and
// never more than the listener's own limit); past it a refused connection
// is closed at once. With the one being answered, each listener holds at
// most LingerCap+1 descriptors for refusals: Config.descriptorParts counts
// them.
const (
	MaxLingering      = 128
	AdminMaxLingering = 8
)

func LingerCap(max, bound int) int { return min(max, bound) }

// Options describe one of the gateway's listeners.
type Options struct {
	Name    string // listener label of encgate_accept_errors_total: "main" or "admin"
	Max     int    // open connections
	Linger  int    // refused connections lingering at once
	Key     string // the config key of max, named in the refusal
	What    string // what is refused, plural, for the refusal: "connections"
	One     string // the same, singular, for its log line: "connection"
	Counter string // the metric that counts refusals, named in the log line
}

func NewLimiter(o Options, clk clock.Clock, log *zap.Logger, acceptErrors *prometheus.CounterVec) *Limiter {
	msg := fmt.Sprintf("encgate: too many %s (%s is %d); try again later", o.What, o.Key, o.Max)
	body := sglang.AppendEnvelope(nil, msg, nil)
	head := fmt.Sprintf("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"+
		"Retry-After: 1\r\nConnection: close\r\n\r\n", len(body))
	return &Limiter{max: int64(o.Max), refusal: append([]byte(head), body...), log: log, clk: clk,
		refusedMsg: fmt.Sprintf("%s refused: %s reached (logged at most once a minute; %s counts them)", o.One, o.Key, o.Counter),
		lingering:  make(chan struct{}, LingerCap(o.Max, o.Linger)),
		retry:      acceptRetry{listener: o.Name, clk: clk, log: log, errors: acceptErrors, closed: make(chan struct{})}}
}

// Accept returns the next connection within the limit, refusing the others.
// It is called by one goroutine, its server's accept loop.
func (l *Limiter) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			if l.retry.wait(err) {
				continue
			}
			return nil, err
		}
		l.retry.accepted()
		if l.open.Add(1) <= l.max {
			l.accepted.Add(1)
			return c, nil
		}
		l.open.Add(-1)
		l.rejected.Add(1)
		l.refuse(c)
	}
}

// Close closes the listener and ends a backoff in progress, so that the
// accept loop returns at once.
func (l *Limiter) Close() error {
	l.retry.close()
	return l.Listener.Close()
}

// ConnState counts a connection closed (its server's ConnState hook). A
// hijacked connection is still open: the gateway's are parked exchanges'
// (gateway/park.go), which end either given back to the server, which
// closes them in the end, or closed by whoever holds them, which calls
// ConnState(c, StateClosed) then.
func (l *Limiter) ConnState(_ net.Conn, st fasthttp.ConnState) {
	if st == fasthttp.StateClosed {
		l.open.Add(-1)
	}
}

// HTTPConnState is ConnState for net/http (the admin listener), whose
// connections end in StateClosed or StateHijacked as well.
func (l *Limiter) HTTPConnState(_ net.Conn, st http.ConnState) {
	if st == http.StateClosed || st == http.StateHijacked {
		l.open.Add(-1)
	}
}

func (l *Limiter) refuse(c net.Conn) {
	if now := l.clk.Now().Unix(); l.lastLog.Load() < now-60 {
		l.lastLog.Store(now)
		l.log.Warn(l.refusedMsg, zap.Int64("max_conns", l.max), zap.Stringer("remote", c.RemoteAddr()))
	}
	// Deadlines on a socket are wall-clock times, whatever l.clk says.
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

// Wait returns once every refused connection is closed.
func (l *Limiter) Wait() { l.wg.Wait() }

// Backoff after a temporary accept error: 5ms, doubling to 1s, and back to
// 5ms once a connection is accepted, as net/http's Server does. The wait
// is what keeps a process out of descriptors from spinning on accept4; the
// connections meanwhile wait in the kernel's backlog, and each is taken
// once a descriptor frees.
const (
	acceptBackoffMin = 5 * time.Millisecond
	acceptBackoffMax = time.Second
)

// acceptWarnEvery bounds the warnings about accept errors on one listener:
// a burst (errors until the next accepted connection) is logged when it
// starts and when it ends, but under a pressure that lets a connection
// through now and then, a burst starts after each; those within this long
// of the last warning are only counted (encgate_accept_errors_total), and
// the next warning says how many went unlogged.
const acceptWarnEvery = time.Minute

// acceptRetry waits out temporary accept errors for a Limiter.
type acceptRetry struct {
	listener string
	clk      clock.Clock
	log      *zap.Logger
	errors   *prometheus.CounterVec // listener, errno

	closed    chan struct{} // closed by close: ends a backoff at once
	closeOnce sync.Once

	// The accept loop's own state (one goroutine calls Accept).
	delay      time.Duration // the last backoff; 0 after an accepted connection
	burst      uint64        // errors since the last accepted connection
	burstStart time.Time
	warned     bool      // the burst in progress was logged
	lastWarn   time.Time // when a burst was last logged
	unlogged   uint64    // resource errors since lastWarn in bursts that were not logged
}

// acceptErrorKind is what an accept error says about the next accept.
type acceptErrorKind int

const (
	acceptPermanent  acceptErrorKind = iota // the listener is broken or closed: stop
	acceptResource                          // the process or the kernel is out of something: wait, it frees
	acceptConnection                        // the one connection failed before it was accepted: take the next
)

// acceptErrnos are the accept errors worth waiting out, by errno, with the
// errno label of encgate_accept_errors_total. Resource: out of descriptors
// (EMFILE: this process; ENFILE: the whole system) or of kernel memory.
// Connection: errors of the pending connection itself that Linux reports
// from accept(2) ("treat them like EAGAIN by retrying", its man page says;
// Go's poller retries only ECONNABORTED), and interruptions. Both back off,
// which costs a lone connection error 5ms at most.
var acceptErrnos = map[syscall.Errno]struct {
	label string
	kind  acceptErrorKind
}{
	syscall.EMFILE:       {"EMFILE", acceptResource},
	syscall.ENFILE:       {"ENFILE", acceptResource},
	syscall.ENOBUFS:      {"ENOBUFS", acceptResource},
	syscall.ENOMEM:       {"ENOMEM", acceptResource},
	syscall.ECONNABORTED: {"ECONNABORTED", acceptConnection},
	syscall.ECONNRESET:   {"ECONNRESET", acceptConnection},
	syscall.EPROTO:       {"EPROTO", acceptConnection},
	syscall.ENETDOWN:     {"ENETDOWN", acceptConnection},
	syscall.ENETUNREACH:  {"ENETUNREACH", acceptConnection},
	syscall.EHOSTDOWN:    {"EHOSTDOWN", acceptConnection},
	syscall.EHOSTUNREACH: {"EHOSTUNREACH", acceptConnection},
	syscall.ENOPROTOOPT:  {"ENOPROTOOPT", acceptConnection},
	syscall.EOPNOTSUPP:   {"EOPNOTSUPP", acceptConnection},
	syscall.EPERM:        {"EPERM", acceptConnection}, // Linux: firewall rules forbid the connection
	syscall.ETIMEDOUT:    {"ETIMEDOUT", acceptConnection},
	syscall.EINTR:        {"EINTR", acceptConnection},
	syscall.EAGAIN:       {"EAGAIN", acceptConnection},
}

// acceptErrnoLabels are the errno labels created for each listener at start,
// so that an alert on the rate of descriptor exhaustion has a series to
// watch before the first one.
var acceptErrnoLabels = []string{"EMFILE", "ENFILE", "ENOBUFS", "ENOMEM"}

// classifyAcceptError says whether err is worth waiting out, and its label.
// An error no errno explains but that net/http would retry (a net.Error
// that is a timeout or temporary, such as a deadline on the listener) is a
// resource error labelled "other".
func classifyAcceptError(err error) (string, acceptErrorKind) {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		if e, ok := acceptErrnos[errno]; ok {
			return e.label, e.kind
		}
		return "", acceptPermanent
	}
	var ne interface {
		Timeout() bool
		Temporary() bool
	}
	if errors.As(err, &ne) && (ne.Timeout() || ne.Temporary()) {
		return "other", acceptResource
	}
	return "", acceptPermanent
}

// nextAcceptBackoff is the backoff after one of the last delay.
func nextAcceptBackoff(last time.Duration) time.Duration {
	if last <= 0 {
		return acceptBackoffMin
	}
	return min(2*last, acceptBackoffMax)
}

// wait counts err and, for a temporary error, waits the backoff (or until
// the listener is closed: the next accept then returns that) and reports
// true; for a permanent one, it reports false at once.
func (r *acceptRetry) wait(err error) bool {
	label, kind := classifyAcceptError(err)
	if kind == acceptPermanent {
		return false
	}
	r.errors.WithLabelValues(r.listener, label).Inc()
	r.delay = nextAcceptBackoff(r.delay)
	now := r.clk.Now()
	if r.burst == 0 {
		r.burstStart = now
	}
	r.burst++
	switch {
	case kind == acceptConnection:
		r.log.Debug("accept: the pending connection failed; taking the next", zap.String("listener", r.listener),
			zap.String("errno", label), zap.Error(err))
	case r.warned:
	case !r.lastWarn.IsZero() && now.Sub(r.lastWarn) < acceptWarnEvery:
		r.unlogged++
	default:
		r.log.Warn("accept failed; retrying with backoff until it succeeds (logged once per burst; encgate_accept_errors_total counts every error)",
			zap.String("listener", r.listener), zap.String("errno", label), zap.Error(err),
			zap.Duration("retry_in", r.delay), zap.Uint64("unlogged_since_last_warning", r.unlogged))
		r.warned, r.lastWarn, r.unlogged = true, now, 0
	}
	t := r.clk.NewTimer(r.delay)
	select {
	case <-t.C():
	case <-r.closed:
		t.Stop()
	}
	return true
}

// accepted ends a burst of errors: the backoff starts over.
func (r *acceptRetry) accepted() {
	if r.burst == 0 {
		return
	}
	if r.warned {
		r.log.Info("accepting again after accept errors", zap.String("listener", r.listener),
			zap.Uint64("errors", r.burst), zap.Duration("for", r.clk.Now().Sub(r.burstStart)))
	}
	r.burst, r.delay, r.warned = 0, 0, false
}

func (r *acceptRetry) close() { r.closeOnce.Do(func() { close(r.closed) }) }

// NewAcceptErrors is encgate_accept_errors_total, registered on reg.
func NewAcceptErrors(reg prometheus.Registerer) *prometheus.CounterVec {
	v := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "encgate_accept_errors_total",
		Help: "Temporary accept errors on a listener (main: encoder-facing, admin), by errno (EMFILE: out of descriptors); " +
			"each is retried with backoff, the connection waiting in the kernel's backlog.",
	}, []string{"listener", "errno"})
	reg.MustRegister(v)
	for _, l := range []string{"main", "admin"} {
		for _, e := range acceptErrnoLabels {
			v.WithLabelValues(l, e)
		}
	}
	return v
}

// RegisterAdminConnMetrics registers the admin listener's connection
// counts (the encoder-facing listener's are in newMetrics).
func RegisterAdminConnMetrics(reg prometheus.Registerer, l *Limiter) {
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "encgate_admin_connections_open",
			Help: "Open connections on the admin listener (bounded by admin.max_conns).",
		}, func() float64 { return float64(l.open.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "encgate_admin_connections_rejected_total",
			Help: "Admin connections answered 503 and closed because admin.max_conns were open.",
		}, func() float64 { return float64(l.rejected.Load()) }))
}

// Open is the number of connections open now.
func (l *Limiter) Open() int64 { return l.open.Load() }

// Accepted counts the connections accepted within the limit.
func (l *Limiter) Accepted() uint64 { return l.accepted.Load() }

// Rejected counts the connections refused with the 503.
func (l *Limiter) Rejected() uint64 { return l.rejected.Load() }
