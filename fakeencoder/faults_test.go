package fakeencoder

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"net"
	"net/http"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestHealthFaults(t *testing.T) {
	e := start(t, testOptions())
	for _, route := range []string{RouteHealth, RouteHealthGen} {
		expect(t, get(t, e, route), http.StatusOK, "")
	}
	e.SetFaults(Faults{HealthFail: true})
	expect(t, get(t, e, RouteHealth), http.StatusServiceUnavailable, "")
	expect(t, get(t, e, RouteHealthGen), http.StatusServiceUnavailable, "")

	e.SetFaults(Faults{HealthHang: true})
	ctx, cancel := context.WithCancel(context.Background())
	hung := doAsync(ctx, e, http.MethodGet, RouteHealth, "")
	waitWaiting(t, e, RouteHealth, 1)
	pending(t, hung, "hanging /health")
	cancel() // the client goes away: the handler is released
	if r := recv(t, hung); r.err == nil {
		t.Fatalf("hung /health answered %d", r.status)
	}
	waitWaiting(t, e, RouteHealth, 0)

	e.SetFaults(Faults{})
	r := post(t, e, RouteHealth, "")
	if r.status != http.StatusMethodNotAllowed || r.body != `{"detail":"Method Not Allowed"}` {
		t.Fatalf("POST /health: %d %s", r.status, r.body)
	}
}

func TestProfile(t *testing.T) {
	e := start(t, testOptions())
	text := func(r reply, status int, body string) {
		t.Helper()
		if !strings.HasPrefix(r.ctype, "text/plain") {
			t.Fatalf("content type %q", r.ctype)
		}
		expect(t, r, status, body)
	}
	text(post(t, e, RouteStopProfile, ""), http.StatusBadRequest, "profiling not initialized\n")
	r := get(t, e, RouteStartProfile)
	if r.status != http.StatusOK || !strings.HasPrefix(r.body, "Start profiling. output_dir=/tmp profile_id=") || !strings.HasSuffix(r.body, "\n") {
		t.Fatalf("start: %d %q", r.status, r.body)
	}
	text(post(t, e, RouteStartProfile, ""), http.StatusBadRequest, "profiling already running")
	text(get(t, e, RouteStopProfile), http.StatusOK, "Stop profiling.\n")
	text(get(t, e, RouteStopProfile), http.StatusBadRequest, "profiling not running")
	r = post(t, e, RouteStartProfile, `{"output_dir":"/data/prof","num_steps":3}`)
	if r.status != http.StatusOK || !strings.HasPrefix(r.body, "Start profiling. output_dir=/data/prof profile_id=") {
		t.Fatalf("start with body: %d %q", r.status, r.body)
	}
	if r := post(t, e, RouteStartProfile, `[1]`); r.status != http.StatusUnprocessableEntity {
		t.Fatalf("start with a list body: %d", r.status)
	}
}

func TestRefuseAndRecover(t *testing.T) {
	e := start(t, testOptions())
	addr := e.Addr()
	expect(t, get(t, e, RouteHealth), http.StatusOK, "")
	e.SetFaults(Faults{Refuse: true})
	if _, err := net.DialTimeout("tcp", addr, time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("dial while refusing: %v", err)
	}
	if r := do(context.Background(), e, http.MethodGet, RouteHealth, ""); r.err == nil {
		t.Fatalf("request while refusing answered %d", r.status)
	}
	e.SetFaults(Faults{})
	if e.Addr() != addr {
		t.Fatalf("address changed: %s -> %s", addr, e.Addr())
	}
	expect(t, get(t, e, RouteHealth), http.StatusOK, "")
}

func TestRefuseFromStart(t *testing.T) {
	opts := testOptions()
	opts.Faults.Refuse = true
	e := start(t, opts)
	if _, err := net.DialTimeout("tcp", e.Addr(), time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("dial: %v", err)
	}
	e.SetFaults(Faults{})
	expect(t, get(t, e, RouteHealth), http.StatusOK, "")
}

func TestHangReleasedByClose(t *testing.T) {
	opts := testOptions()
	opts.Faults.Hang = true
	e := New(opts)
	if err := e.Start("127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	hung := postAsync(e, RouteEncode, encodeBody("h1"))
	waitWaiting(t, e, RouteEncode, 1)
	pending(t, hung, "hanging /encode")
	if s := e.Stats(); s.Routes[RouteEncode] != 1 || s.ReqIDs["h1"][RouteEncode] != 1 {
		t.Fatalf("hung request not counted: %+v", s)
	}
	closed := make(chan error, 1)
	go func() { closed <- e.Close() }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not release the hung handler")
	}
	if r := recv(t, hung); r.err == nil {
		t.Fatalf("hung request answered %d", r.status)
	}
	if err := e.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestCloseReleasesBlockedWaits(t *testing.T) {
	opts := testOptions()
	opts.Mode = ModeZMQ
	e := New(opts)
	if err := e.Start(":0"); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(e.Addr(), "127.0.0.1:") {
		t.Fatalf("Addr %q", e.Addr())
	}
	waits := []<-chan reply{
		postAsync(e, RouteMetadata, metaBody("c1")),
		postAsync(e, RouteRegister, registerBody("c2", 1, "h:1")),
		postAsync(e, RouteEncode, encodeBody("c3")),
	}
	for _, route := range []string{RouteMetadata, RouteRegister, RouteEncode} {
		waitWaiting(t, e, route, 1)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	for _, ch := range waits {
		recv(t, ch)
	}
}

// seq returns the values in turn.
func seq(vals ...float64) func() float64 {
	i := 0
	return func() float64 {
		v := vals[i%len(vals)]
		i++
		return v
	}
}

func TestFailureRate(t *testing.T) {
	opts := testOptions()
	opts.Rand = seq(0.1, 0.9)
	opts.Faults.FailureRate = 0.5
	e := start(t, opts)
	expectErr(t, post(t, e, RouteSend, sendBody("fr", 1, 1)), http.StatusInternalServerError, DefaultFailMessage, "fr")
	expectErr(t, post(t, e, RouteSend, sendBody("fr", 1, 1)), http.StatusInternalServerError, alreadyReleased("fr"), "fr")
	expect(t, get(t, e, RouteHealth), http.StatusOK, "") // not a fail route; draws nothing
	if s := e.Stats(); s.Routes[RouteSend] != 2 || len(s.Sends) != 1 {
		t.Fatalf("stats %+v", s)
	}

	e.SetFaults(Faults{FailureRate: 1, FailStatus: 503, FailMessage: "All encoder DP workers are dead.", FailRoutes: []string{RouteEncode}})
	expectErr(t, post(t, e, RouteEncode, encodeBody("fr2")), http.StatusServiceUnavailable, "All encoder DP workers are dead.", "fr2")
	expect(t, post(t, e, RouteMetadata, `{"part_idx":0}`), http.StatusInternalServerError, "Internal Server Error")
}

func TestLatencyFault(t *testing.T) {
	e := start(t, testOptions())
	e.SetFaults(Faults{Latency: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	slow := doAsync(ctx, e, http.MethodGet, RouteHealth, "")
	waitWaiting(t, e, RouteHealth, 1)
	pending(t, slow, "delayed /health")
	cancel()
	recv(t, slow)
	waitWaiting(t, e, RouteHealth, 0)
	e.SetFaults(Faults{Latency: time.Millisecond})
	expect(t, get(t, e, RouteHealth), http.StatusOK, "")
}

func TestStatsAndControlRoutes(t *testing.T) {
	opts := testOptions()
	opts.Name = "enc-a"
	e := start(t, opts)
	post(t, e, RouteEncode, encodeBody("s1"))
	post(t, e, RouteMetadata, metaBody("s1"))
	expect(t, get(t, e, "/nope"), http.StatusNotFound, `{"detail":"Not Found"}`)
	r := get(t, e, RouteEncode)
	if r.status != http.StatusMethodNotAllowed || r.body != `{"detail":"Method Not Allowed"}` {
		t.Fatalf("GET /encode: %d %s", r.status, r.body)
	}
	var s Stats
	if err := json.Unmarshal([]byte(get(t, e, RouteStats).body), &s); err != nil {
		t.Fatal(err)
	}
	want := Stats{
		Name:         "enc-a",
		Routes:       map[string]int64{RouteEncode: 2, RouteMetadata: 1, "/nope": 1},
		ReqIDs:       map[string]map[string]int64{"s1": {RouteEncode: 1, RouteMetadata: 1}},
		Sends:        map[string]int64{},
		SendArrivals: map[string]int64{},
		Staged:       1,
		Waiting:      map[string]int{},
	}
	if !reflect.DeepEqual(s, want) {
		t.Fatalf("stats\n got %+v\nwant %+v", s, want)
	}
	expect(t, post(t, e, RouteReset, ""), http.StatusOK, "null")
	if s := e.Stats(); len(s.Routes) != 0 || len(s.ReqIDs) != 0 || s.Staged != 1 {
		t.Fatalf("after reset %+v", s)
	}

	expect(t, do(context.Background(), e, http.MethodPut, RouteFaults, `{"latency":"2ms","leading_504s":1,"health_fail":true}`), http.StatusOK, "null")
	if f := e.Faults(); f.Latency != 2*time.Millisecond || f.Leading504s != 1 || !f.HealthFail {
		t.Fatalf("faults %+v", f)
	}
	expect(t, get(t, e, RouteFaults), http.StatusOK, `{"latency":"2ms","leading_504s":1,"health_fail":true}`)
	if r := do(context.Background(), e, http.MethodPut, RouteFaults, `{"latency":"soon"}`); r.status != http.StatusBadRequest {
		t.Fatalf("bad faults: %d %s", r.status, r.body)
	}
}

func TestBindFlags(t *testing.T) {
	var o Options
	fs := flag.NewFlagSet("fake-encoder", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	o.BindFlags(fs)
	err := fs.Parse([]string{
		"--name=e1", "--mode=zmq", "--encode-latency=5ms", "--metadata-timeout=2s", "--sweep-after=1m",
		"--refcount-calls", "--latency=1ms", "--metadata-delay=3ms", "--leading-504s=2", "--failure-rate=0.25",
		"--fail-status=503", "--fail-message=boom", "--fail-routes=/send, /encode", "--hang", "--refuse", "--health-fail",
		"--health-flap=3", "--crash-at=2", "--crash-routes=/send", "--truncate", "--truncate-routes=/encode,/send",
	})
	if err != nil {
		t.Fatal(err)
	}
	want := Options{
		Name: "e1", Mode: ModeZMQ, EncodeLatency: 5 * time.Millisecond, MetadataTimeout: 2 * time.Second,
		RegisterTimeout: DefaultTimeout, SendTimeout: DefaultTimeout, SweepAfter: time.Minute, RefcountCalls: true,
		TokensPerItem: DefaultTokensPerItem, Dim: DefaultDim, ElementSize: DefaultElementSize, DPSize: 1, DPMappingWait: DefaultDPMappingWait,
		Faults: Faults{
			Latency: time.Millisecond, MetadataDelay: 3 * time.Millisecond, Leading504s: 2, FailureRate: 0.25,
			FailStatus: 503, FailMessage: "boom", FailRoutes: []string{RouteSend, RouteEncode},
			Hang: true, Refuse: true, HealthFail: true, HealthFlap: 3, CrashAt: 2, CrashRoutes: []string{RouteSend},
			Truncate: true, TruncateRoutes: []string{RouteEncode, RouteSend},
		},
	}
	if !reflect.DeepEqual(o, want) {
		t.Fatalf("options\n got %+v\nwant %+v", o, want)
	}
	if err := fs.Parse([]string{"--mode=grpc"}); err == nil {
		t.Fatal("--mode=grpc accepted")
	}
}
