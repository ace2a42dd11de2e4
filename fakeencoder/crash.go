package fakeencoder

import (
	"bufio"
	"errors"
	"net"
	"net/http"
	"slices"
	"strconv"
	"time"
)

// connState tracks the server's connections, so that a crash can reset
// them; a connection accepted while the encoder is down is reset at once.
func (e *Encoder) connState(c net.Conn, s http.ConnState) {
	e.connMu.Lock()
	defer e.connMu.Unlock()
	switch s {
	case http.StateNew:
		if e.down.Load() {
			resetConn(c)
			return
		}
		e.conns[c] = struct{}{}
	case http.StateClosed, http.StateHijacked:
		delete(e.conns, c)
	}
}

// resetConn closes c with SO_LINGER 0, so the peer gets a RST, as it does
// from the kernel when a process dies with the connection open.
func resetConn(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}

// OpenConns returns the number of client connections the encoder holds open.
func (e *Encoder) OpenConns() int {
	e.connMu.Lock()
	defer e.connMu.Unlock()
	return len(e.conns)
}

// Crashed reports whether the encoder is down after a crash.
func (e *Encoder) Crashed() bool { return e.down.Load() }

// Crash kills the encoder the way a killed process goes: the listener closes
// (connects are refused), every open connection is reset (SO_LINGER 0, then
// close), and requests in flight never get an answer. It returns once every
// request in flight has ended. The encoder stays down until Restart. A
// closed or already crashed encoder is left as it is.
func (e *Encoder) Crash() {
	e.kill()
	e.mu.Lock()
	down := e.down.Load() && !e.closed
	e.mu.Unlock()
	if down {
		e.inflight.Wait() // no handler enters while down: Add only happens under mu
	}
}

// kill takes the encoder down without waiting for its handlers (a handler
// that triggers Faults.CrashAt calls it).
func (e *Encoder) kill() {
	e.mu.Lock()
	if e.closed || e.down.Load() {
		e.mu.Unlock()
		return
	}
	e.down.Store(true)
	e.mu.Unlock()
	e.lnMu.Lock()
	if e.ln != nil {
		_ = e.ln.Close()
		e.ln = nil
	}
	e.lnMu.Unlock()
	e.connMu.Lock()
	conns := make([]net.Conn, 0, len(e.conns))
	for c := range e.conns {
		conns = append(conns, c)
	}
	e.connMu.Unlock()
	for _, c := range conns {
		resetConn(c)
	}
}

// Restart brings a crashed encoder back on the same address as a new
// process: every request's state (staged embeddings, metadata, /send
// refcounts, registrations, profiling) is gone; the counters behind Stats
// and the faults are kept. It waits for the crashed encoder's requests to
// end first. With Faults.Refuse set it stays refusing until that is turned
// off.
func (e *Encoder) Restart() error {
	e.mu.Lock()
	closed, down := e.closed, e.down.Load()
	e.mu.Unlock()
	switch {
	case closed:
		return errors.New("fakeencoder: closed")
	case !down:
		return errors.New("fakeencoder: not crashed")
	}
	e.inflight.Wait()
	e.mu.Lock()
	e.states = map[string]*reqState{}
	e.meta = map[string]*metaEntry{}
	e.sendDone = map[string]*sendCount{}
	e.recv = map[string]*recvReg{}
	e.lead504 = map[string]*lead504{}
	e.dedupe = map[string]*inflight{}
	e.dpRank, e.dpAt = map[string]int{}, map[string]time.Time{} // a restarted encoder's workers start empty
	e.profile = profileState{}
	refuse := e.faults.Refuse
	e.down.Store(false)
	e.mu.Unlock()
	e.lnMu.Lock()
	defer e.lnMu.Unlock()
	if e.srv == nil || refuse || e.ln != nil {
		return nil
	}
	e.srv.SetKeepAlivesEnabled(true)
	return e.relistenLocked()
}

// onRoutes reports whether route is in routes, or in the default fault
// routes when routes is empty (GEN0 has no /scheduler_receive_meta_data, so
// it is not a default fault route there).
func (e *Encoder) onRoutes(routes []string, route string) bool {
	if len(routes) == 0 {
		if e.gen0() && route == RouteMetadata {
			return false
		}
		routes = defaultFailRoutes
	}
	return slices.Contains(routes, route)
}

// crashDue counts a request towards Faults.CrashAt and reports whether it is
// the one that crashes the encoder (disarming CrashAt).
func (e *Encoder) crashDue(route string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.faults.CrashAt <= 0 || !e.onRoutes(e.faults.CrashRoutes, route) {
		return false
	}
	if e.crashN++; e.crashN < e.faults.CrashAt {
		return false
	}
	e.faults.CrashAt = 0
	return true
}

// healthFlapFails reports whether this /health answer is a failing one of
// Faults.HealthFlap.
func (e *Encoder) healthFlapFails() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.faults.HealthFlap <= 0 {
		return false
	}
	n := e.healthN
	e.healthN++
	return (n/e.faults.HealthFlap)%2 == 1
}

// truncates reports whether Faults.Truncate applies to route.
func (e *Encoder) truncates(route string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.faults.Truncate && e.onRoutes(e.faults.TruncateRoutes, route)
}

// recorder holds a handler's answer so that it can be sent truncated.
type recorder struct {
	header http.Header
	status int
	body   []byte
}

func newRecorder() *recorder { return &recorder{header: http.Header{}} }

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(status int) {
	if r.status == 0 {
		r.status = status
	}
}

func (r *recorder) Write(b []byte) (int, error) {
	r.WriteHeader(http.StatusOK)
	r.body = append(r.body, b...)
	return len(b), nil
}

// truncatedExtra is how many bytes more than it has a truncated answer
// announces.
const truncatedExtra = 16

// sendTruncated writes the recorded answer on w's connection with a
// Content-Length larger than the bytes that follow (half the body), then
// closes it. Nothing is sent when the handler answered nothing.
func (r *recorder) sendTruncated(w http.ResponseWriter) {
	if r.status == 0 {
		return
	}
	hj, ok := w.(http.Hijacker)
	if !ok {
		panic(http.ErrAbortHandler)
	}
	conn, buf, err := hj.Hijack()
	if err != nil {
		panic(http.ErrAbortHandler)
	}
	defer conn.Close()
	writeTruncated(buf.Writer, r)
	_ = buf.Flush()
}

func writeTruncated(w *bufio.Writer, r *recorder) {
	_, _ = w.WriteString("HTTP/1.1 " + strconv.Itoa(r.status) + " " + http.StatusText(r.status) + "\r\n")
	r.header.Del("Content-Length")
	_ = r.header.Write(w)
	_, _ = w.WriteString("Content-Length: " + strconv.Itoa(len(r.body)+truncatedExtra) + "\r\n\r\n")
	_, _ = w.Write(r.body[:len(r.body)/2])
}
