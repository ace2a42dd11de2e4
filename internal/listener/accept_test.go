package listener

import (
	"errors"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/encgate/encgate/internal/clock"
)

// acceptErr is an accept error as the net package returns it.
func acceptErr(errno syscall.Errno) error {
	return &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", errno)}
}

type timeoutErr struct{}

func (timeoutErr) Error() string   { return "i/o timeout" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

// Which accept errors are waited out, and which stop the listener. The
// resource errors are the ones a process out of descriptors or memory
// meets; the others are a listener that is closed or broken.
func TestAcceptErrorsAreClassified(t *testing.T) {
	for _, tc := range []struct {
		err   error
		label string
		kind  acceptErrorKind
	}{
		{acceptErr(syscall.EMFILE), "EMFILE", acceptResource},
		{acceptErr(syscall.ENFILE), "ENFILE", acceptResource},
		{acceptErr(syscall.ENOBUFS), "ENOBUFS", acceptResource},
		{acceptErr(syscall.ENOMEM), "ENOMEM", acceptResource},
		{acceptErr(syscall.ECONNABORTED), "ECONNABORTED", acceptConnection},
		{acceptErr(syscall.EPROTO), "EPROTO", acceptConnection},
		{&net.OpError{Op: "accept", Net: "tcp", Err: timeoutErr{}}, "other", acceptResource},
		{&net.OpError{Op: "accept", Net: "tcp", Err: net.ErrClosed}, "", acceptPermanent},
		{acceptErr(syscall.EBADF), "", acceptPermanent},
		{acceptErr(syscall.EINVAL), "", acceptPermanent},
		{errors.New("something else"), "", acceptPermanent},
	} {
		label, kind := classifyAcceptError(tc.err)
		if label != tc.label || kind != tc.kind {
			t.Errorf("%v: %q kind %d, want %q kind %d", tc.err, label, kind, tc.label, tc.kind)
		}
	}
}

// What net/http's Server retries by itself (net.Error.Temporary): EMFILE
// and ENFILE, but not ENOBUFS or ENOMEM, which would stop the admin
// listener as they would fasthttp's. So both listeners wait errors out in
// connLimiter, and net/http's own retry (which logs every error) never
// sees one.
func TestNetHTTPRetriesEMFILEButNotENOBUFS(t *testing.T) {
	temporary := func(err error) bool {
		var ne interface{ Temporary() bool }
		return errors.As(err, &ne) && ne.Temporary()
	}
	for errno, want := range map[syscall.Errno]bool{syscall.EMFILE: true, syscall.ENFILE: true, syscall.ENOBUFS: false, syscall.ENOMEM: false} {
		if got := temporary(acceptErr(errno)); got != want {
			t.Errorf("net/http's Temporary() for %v: %v, want %v", errno, got, want)
		}
	}
}

// scriptedListener returns the results the test sends it, one per Accept,
// and tells the test of each Accept call.
type scriptedListener struct {
	results chan error // nil: a connection
	calls   chan struct{}
	done    chan struct{}
	once    sync.Once
}

func newScriptedListener() *scriptedListener {
	return &scriptedListener{results: make(chan error), calls: make(chan struct{}), done: make(chan struct{})}
}

func (s *scriptedListener) Accept() (net.Conn, error) {
	closed := &net.OpError{Op: "accept", Net: "tcp", Err: net.ErrClosed}
	select {
	case s.calls <- struct{}{}:
	case <-s.done:
		return nil, closed
	}
	select {
	case err := <-s.results:
		if err != nil {
			return nil, err
		}
		c, peer := net.Pipe()
		_ = peer.Close()
		return c, nil
	case <-s.done:
		return nil, closed
	}
}

func (s *scriptedListener) Close() error   { s.once.Do(func() { close(s.done) }); return nil }
func (s *scriptedListener) Addr() net.Addr { return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)} }

type accepted struct {
	c   net.Conn
	err error
}

// acceptHarness runs a connLimiter's accept loop over a scriptedListener
// on a fake clock.
type acceptHarness struct {
	sl   *scriptedListener
	l    *Limiter
	clk  *clock.Fake
	errs *prometheus.CounterVec
	logs *observer.ObservedLogs
	out  chan accepted
}

func newAcceptHarness(t *testing.T) *acceptHarness {
	t.Helper()
	core, logs := observer.New(zapcore.DebugLevel)
	h := &acceptHarness{sl: newScriptedListener(), clk: clock.NewFake(time.Unix(1_000_000, 0)),
		errs: NewAcceptErrors(prometheus.NewRegistry()), logs: logs, out: make(chan accepted)}
	h.l = NewLimiter(Options{Name: "main", Max: 100, Linger: 1, Key: "limits.max_conns", What: "connections", One: "connection",
		Counter: "encgate_connections_rejected_total"}, h.clk, zap.New(core), h.errs)
	h.l.Listener = h.sl
	go func() {
		defer close(h.out)
		for {
			c, err := h.l.Accept()
			h.out <- accepted{c, err}
			if err != nil {
				return
			}
		}
	}()
	t.Cleanup(func() {
		_ = h.l.Close()
		ended := make(chan struct{})
		go func() {
			defer close(ended)
			for range h.out {
			}
		}()
		select {
		case <-ended:
		case <-time.After(5 * time.Second):
			t.Errorf("the accept loop did not end within %v of Close", 5*time.Second)
		}
	})
	<-h.sl.calls
	return h
}

// fail makes the pending Accept fail with err, then checks that the loop
// waits exactly backoff on the clock before it accepts again.
func (h *acceptHarness) fail(t *testing.T, err error, backoff time.Duration) {
	t.Helper()
	created := h.clk.TimerCreated()
	h.sl.results <- err
	select {
	case <-created:
	case a := <-h.out:
		t.Fatalf("Accept returned (%v, %v) for %v instead of waiting %v", a.c, a.err, err, backoff)
	}
	h.clk.Advance(backoff - time.Nanosecond)
	if h.clk.Pending() != 1 {
		t.Fatalf("after %v: the backoff timer already fired (want %v)", backoff-time.Nanosecond, backoff)
	}
	h.clk.Advance(time.Nanosecond)
	if h.clk.Pending() != 0 {
		t.Fatalf("after %v: the backoff timer has not fired", backoff)
	}
	<-h.sl.calls
}

// succeed lets the pending Accept through: the loop returns a connection.
func (h *acceptHarness) succeed(t *testing.T) {
	t.Helper()
	h.sl.results <- nil
	a := <-h.out
	if a.err != nil {
		t.Fatalf("accept: %v", a.err)
	}
	_ = a.c.Close()
	<-h.sl.calls
}

func (h *acceptHarness) messages(level zapcore.Level, msg string) []observer.LoggedEntry {
	return h.logs.FilterLevelExact(level).FilterMessageSnippet(msg).All()
}

// A temporary accept error is retried after 5ms, doubling to 1s, and the
// backoff starts over once a connection is accepted, as net/http does. Every
// error is counted; a burst is logged when it starts and when it ends, not
// per error, and a burst soon after a logged one is only counted.
func TestAcceptBackoffDoublesToOneSecondAndResets(t *testing.T) {
	h := newAcceptHarness(t)
	ms := time.Millisecond
	first := []time.Duration{5 * ms, 10 * ms, 20 * ms, 40 * ms, 80 * ms, 160 * ms, 320 * ms, 640 * ms, time.Second, time.Second, time.Second}
	for _, d := range first {
		h.fail(t, acceptErr(syscall.EMFILE), d)
	}
	h.succeed(t)
	if w := h.messages(zapcore.WarnLevel, "accept failed"); len(w) != 1 || w[0].ContextMap()["errno"] != "EMFILE" || w[0].ContextMap()["listener"] != "main" {
		t.Fatalf("warnings for the first burst: %+v, want one naming EMFILE on main", w)
	}
	if i := h.messages(zapcore.InfoLevel, "accepting again"); len(i) != 1 || i[0].ContextMap()["errors"] != uint64(len(first)) {
		t.Fatalf("recovery lines: %+v, want one counting %d errors", i, len(first))
	}

	// Reset: the next burst starts at 5ms again. It comes within a minute
	// of the last warning, so it is counted, not logged.
	h.fail(t, acceptErr(syscall.ENFILE), 5*ms)
	h.fail(t, acceptErr(syscall.EMFILE), 10*ms)
	h.succeed(t)
	if w, i := h.messages(zapcore.WarnLevel, "accept failed"), h.messages(zapcore.InfoLevel, "accepting again"); len(w) != 1 || len(i) != 1 {
		t.Fatalf("a burst within a minute of the last warning was logged: %d warnings, %d recoveries", len(w), len(i))
	}

	// A minute on, a burst is logged again, with what went unlogged.
	h.clk.Advance(acceptWarnEvery)
	h.fail(t, acceptErr(syscall.EMFILE), 5*ms)
	w := h.messages(zapcore.WarnLevel, "accept failed")
	if len(w) != 2 || w[1].ContextMap()["unlogged_since_last_warning"] != uint64(2) {
		t.Fatalf("warnings: %+v, want a second one saying 2 errors went unlogged", w)
	}
	h.succeed(t)

	if got := testutil.ToFloat64(h.errs.WithLabelValues("main", "EMFILE")); got != float64(len(first)+2) {
		t.Errorf("encgate_accept_errors_total{main,EMFILE} = %v, want %d", got, len(first)+2)
	}
	if got := testutil.ToFloat64(h.errs.WithLabelValues("main", "ENFILE")); got != 1 {
		t.Errorf("encgate_accept_errors_total{main,ENFILE} = %v, want 1", got)
	}
}

// Closing the listener during a backoff ends it at once: the accept loop
// returns the close, without waiting for the clock.
func TestAcceptBackoffEndsWhenTheListenerCloses(t *testing.T) {
	h := newAcceptHarness(t)
	created := h.clk.TimerCreated()
	h.sl.results <- acceptErr(syscall.EMFILE)
	select {
	case <-created:
	case a := <-h.out:
		t.Fatalf("Accept returned (%v, %v) for EMFILE instead of waiting", a.c, a.err)
	}
	if err := h.l.Close(); err != nil {
		t.Fatal(err)
	}
	if a := <-h.out; !errors.Is(a.err, net.ErrClosed) {
		t.Fatalf("accept after a close during a backoff: %v, want net.ErrClosed", a.err)
	}
}

// A permanent error is returned at once, uncounted, with no backoff.
func TestPermanentAcceptErrorIsReturned(t *testing.T) {
	h := newAcceptHarness(t)
	created := h.clk.TimerCreated()
	h.sl.results <- acceptErr(syscall.EBADF)
	select {
	case a := <-h.out:
		if !errors.Is(a.err, syscall.EBADF) {
			t.Fatalf("accept: %v, want EBADF", a.err)
		}
	case <-created:
		t.Fatalf("EBADF, a permanent error, started a backoff")
	}
	if n := testutil.CollectAndCount(h.errs); n != 2*len(acceptErrnoLabels) {
		t.Errorf("encgate_accept_errors_total has %d series, want only the %d made at start", n, 2*len(acceptErrnoLabels))
	}
}
