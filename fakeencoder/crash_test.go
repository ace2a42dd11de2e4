package fakeencoder

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"
)

// rawConn opens a TCP connection to e and waits until e tracks it.
func rawConn(t *testing.T, e *Encoder, want int) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", e.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	waitFor(t, "the connection to be tracked", func() bool { return e.OpenConns() == want })
	return c
}

func TestCrashResetsConnectionsAndRefusesUntilRestart(t *testing.T) {
	e := start(t, testOptions())
	addr := e.Addr()
	if r := post(t, e, RouteEncode, encodeBody("c1")); r.status != http.StatusOK {
		t.Fatalf("encode: %d %s", r.status, r.body)
	}
	idle := rawConn(t, e, 1)
	waiting := postAsync(e, RouteMetadata, metaBody("never-encoded"))
	waitWaiting(t, e, RouteMetadata, 1)

	e.Crash()
	if !e.Crashed() {
		t.Fatal("Crashed() is false after Crash")
	}
	if r := recv(t, waiting); r.err == nil {
		t.Fatalf("the request in flight was answered %d %q", r.status, r.body)
	}
	if _, err := idle.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("idle connection: read gave %v, want a reset", err)
	}
	if _, err := net.DialTimeout("tcp", addr, time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("dial while crashed: %v", err)
	}
	if n := e.Stats().Routes[RouteMetadata]; n != 1 {
		t.Fatalf("metadata arrivals %d, want 1", n)
	}

	if err := e.Restart(); err != nil {
		t.Fatal(err)
	}
	if e.Addr() != addr || e.Crashed() {
		t.Fatalf("after Restart: addr %s (was %s), crashed %v", e.Addr(), addr, e.Crashed())
	}
	if s := e.Stats(); s.Staged != 0 || s.Routes[RouteEncode] != 1 {
		t.Fatalf("after Restart: staged %d (want 0: the state died), encodes counted %d (want 1: stats are kept)", s.Staged, s.Routes[RouteEncode])
	}
	expectErr(t, post(t, e, RouteSend, sendBody("c1", 1, 1)), http.StatusInternalServerError, alreadyReleased("c1"), "c1")
	if err := e.Restart(); err == nil {
		t.Fatal("Restart of a running encoder succeeded")
	}
}

func TestCrashAtFiresOnceWithTheRequestInFlight(t *testing.T) {
	opts := testOptions()
	opts.EchoSend = true
	opts.Faults = Faults{CrashAt: 2, CrashRoutes: []string{RouteSend}}
	e := start(t, opts)
	post(t, e, RouteEncode, encodeBody("c1"))
	expect(t, post(t, e, RouteSend, sendBody("c1", 1, 3)), http.StatusOK, `{"req_id":"c1","destination":"10.0.0.1:1"}`)
	if r := do(context.Background(), e, http.MethodPost, RouteSend, sendBody("c1", 2, 3)); r.err == nil {
		t.Fatalf("the crashing /send was answered %d %q", r.status, r.body)
	}
	if !e.Crashed() {
		t.Fatal("not crashed after the CrashAt-th /send")
	}
	s := e.Stats()
	if s.SendArrivals["c1|10.0.0.1:1"] != 1 || s.SendArrivals["c1|10.0.0.1:2"] != 1 || len(s.SendArrivals) != 2 {
		t.Fatalf("send arrivals %v, want both destinations once", s.SendArrivals)
	}
	if s.Sends["c1|10.0.0.1:2"] != 0 {
		t.Fatalf("the crashing /send was handled: %v", s.Sends)
	}
	e.Crash() // already down: returns at once
	if err := e.Restart(); err != nil {
		t.Fatal(err)
	}
	if f := e.Faults(); f.CrashAt != 0 {
		t.Fatalf("CrashAt still armed after firing: %d", f.CrashAt)
	}
	expect(t, get(t, e, RouteHealth), http.StatusOK, "")
}

func TestTruncatedAnswerAfterTheWorkIsDone(t *testing.T) {
	e := start(t, testOptions())
	post(t, e, RouteEncode, encodeBody("t1"))
	e.SetFaults(Faults{Truncate: true, TruncateRoutes: []string{RouteSend}})
	body := sendBody("t1", 1, 2)
	c, err := net.Dial("tcp", e.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "POST /send HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || resp.ContentLength != int64(len("null")+truncatedExtra) ||
		string(got) != "nu" || !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("got %d, Content-Length %d, body %q, read error %v", resp.StatusCode, resp.ContentLength, got, err)
	}
	if s := e.Stats(); s.Sends["t1|10.0.0.1:1"] != 1 || s.SendArrivals["t1|10.0.0.1:1"] != 1 {
		t.Fatalf("the truncated /send was not handled once: %+v", s)
	}
	// Routes outside TruncateRoutes answer whole.
	expect(t, get(t, e, RouteHealth), http.StatusOK, "")
}

func TestHealthFlap(t *testing.T) {
	e := start(t, testOptions())
	e.SetFaults(Faults{HealthFlap: 2})
	var got []int
	for i := 0; i < 6; i++ {
		got = append(got, get(t, e, RouteHealth).status)
	}
	if want := "[200 200 503 503 200 200]"; fmt.Sprint(got) != want {
		t.Fatalf("statuses %v, want %s", got, want)
	}
	e.SetFaults(Faults{HealthFlap: 1}) // the count starts again
	if a, b := get(t, e, RouteHealthGen).status, get(t, e, RouteHealth).status; a != 200 || b != 503 {
		t.Fatalf("after SetFaults: %d %d", a, b)
	}
}

func TestOpenConns(t *testing.T) {
	e := start(t, testOptions())
	c := rawConn(t, e, 1)
	c.Close()
	waitFor(t, "the closed connection to be forgotten", func() bool { return e.OpenConns() == 0 })
	if r := get(t, e, RouteHealth); r.status != 200 || !strings.Contains(fmt.Sprint(e.Stats().Routes), "/health:1") {
		t.Fatalf("health %d, routes %v", r.status, e.Stats().Routes)
	}
}
