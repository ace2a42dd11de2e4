package fakeencoder

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/encgate/encgate/gpuagent/acktest"
)

// startSink starts an acktest PULL endpoint, closed at test end.
func startSink(t *testing.T) *acktest.Sink {
	t.Helper()
	s, err := acktest.Start(acktest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// sinkURL is the receive_url of s.
func sinkURL(s *acktest.Sink) string { return fmt.Sprintf("127.0.0.1:%d", s.Port()) }

// nextMessage waits for s's next message.
func nextMessage(t *testing.T, s *acktest.Sink) [][]byte {
	t.Helper()
	select {
	case m := <-s.Messages():
		return m
	case <-time.After(10 * time.Second):
		t.Fatalf("no ZMQ message at %s within 10s", sinkURL(s))
	}
	return nil
}

// refusedPort is a loopback port nothing listens on.
func refusedPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()
	return port
}

// pushOptions are testOptions in zmq mode with PushFrames for gen.
func pushOptions(gen Generation) Options {
	o := testOptions()
	o.Mode = ModeZMQ
	o.Generation = gen
	o.PushFrames = true
	return o
}

// withPort is encodeBody for id with prefill_host 127.0.0.1 and the raw
// embedding_port given.
func withPort(id, port string, items ...string) string {
	body := strings.Replace(encodeBody(id, items...), `"embedding_port":null`, `"embedding_port":`+port, 1)
	return strings.Replace(body, `"prefill_host":"10.0.0.1"`, `"prefill_host":"127.0.0.1"`, 1)
}

func TestFailedEncodePushesErrorFrameToEachRank(t *testing.T) {
	for _, gen := range []Generation{Gen0, GenNew, Gen1} {
		t.Run(gen.String(), func(t *testing.T) {
			e := start(t, pushOptions(gen))
			const msg = "Failed to process mm items: cannot identify image file"
			// The error envelope comes at once; the error frame is pushed in
			// the background to each URL as it is registered.
			expectErr(t, post(t, e, RouteEncode, encodeBody("zf", "fail:400:"+msg)), http.StatusBadRequest, msg, "zf")
			sinks := []*acktest.Sink{startSink(t), startSink(t), startSink(t)}
			want := `{"req_id":"zf","num_parts":1,"part_idx":0,"error_msg":"` + msg + `","error_code":400}`
			for _, s := range sinks {
				expect(t, post(t, e, RouteRegister, registerBody("zf", len(sinks), sinkURL(s))), http.StatusOK, "null")
				m := nextMessage(t, s)
				if len(m) != 1 || string(m[0]) != want {
					t.Fatalf("message at %s: %q, want one frame %s", sinkURL(s), m, want)
				}
			}
			waitFor(t, "three error pushes and the release", func() bool {
				st := e.Stats()
				return len(st.Pushes) == len(sinks) && st.Staged == 0
			})
			st := e.Stats()
			for _, s := range sinks {
				key := "zf|" + sinkURL(s)
				if st.Registrations[key] != 1 || !slices.Equal(st.Pushes[key], []string{PushError}) {
					t.Fatalf("%s: registrations %v, pushes %v", key, st.Registrations, st.Pushes)
				}
				if n := len(s.Frames()); n != 1 {
					t.Fatalf("%s got %d messages", sinkURL(s), n)
				}
			}
			if len(st.Registrations) != len(sinks) || st.PushFailures != nil {
				t.Fatalf("registrations %v, failures %v", st.Registrations, st.PushFailures)
			}
		})
	}
}

func TestSuccessfulEncodePushesTwoFrames(t *testing.T) {
	for _, gen := range []Generation{Gen0, GenNew, Gen1} {
		t.Run(gen.String(), func(t *testing.T) {
			e := start(t, pushOptions(gen))
			sinks := []*acktest.Sink{startSink(t), startSink(t)}
			enc := postAsync(e, RouteEncode, encodeBody("zs", "a", "b"))
			waitWaiting(t, e, RouteEncode, 1)
			for _, s := range sinks {
				expect(t, post(t, e, RouteRegister, registerBody("zs", len(sinks), sinkURL(s))), http.StatusOK, "null")
			}
			expect(t, recv(t, enc), http.StatusOK, "null")
			st := e.Stats()
			for _, s := range sinks {
				m := nextMessage(t, s)
				if len(m) != 2 || len(m[1]) != 2*524288 {
					t.Fatalf("message at %s: %d frames, %v", sinkURL(s), len(m), frameSizes(m))
				}
				if want := `{"req_id":"zs","num_parts":1,"part_idx":0,"error_msg":null,"error_code":null}`; string(m[0]) != want {
					t.Fatalf("frame 0 %s, want %s", m[0], want)
				}
				if p := st.Pushes["zs|"+sinkURL(s)]; !slices.Equal(p, []string{PushEmbedding}) {
					t.Fatalf("pushes %v", st.Pushes)
				}
			}
			if st.Staged != 0 {
				t.Fatalf("staged %d", st.Staged)
			}
		})
	}
}

// frameSizes is the length of each frame.
func frameSizes(m [][]byte) []int {
	var n []int
	for _, f := range m {
		n = append(n, len(f))
	}
	return n
}

func TestEncodeWithEmbeddingPortPushesThere(t *testing.T) {
	for _, gen := range []Generation{Gen0, GenNew} {
		t.Run(gen.String(), func(t *testing.T) {
			e := start(t, pushOptions(gen))
			a, b := startSink(t), startSink(t)
			// zmq_to_tokenizer: one port.
			expect(t, post(t, e, RouteEncode, withPort("p1", fmt.Sprint(a.Port()))), http.StatusOK, "null")
			if m := nextMessage(t, a); len(m) != 2 {
				t.Fatalf("%d frames", len(m))
			}
			// zmq_to_scheduler's legacy path: a list of ports.
			expect(t, post(t, e, RouteEncode, withPort("p2", fmt.Sprintf("[%d,%d]", a.Port(), b.Port()))), http.StatusOK, "null")
			for _, s := range []*acktest.Sink{a, b} {
				if m := nextMessage(t, s); len(m) != 2 || !strings.Contains(string(m[0]), `"req_id":"p2"`) {
					t.Fatalf("message %q", m[0])
				}
			}
			// A failure with a list of ports pushes the error frame before
			// answering.
			expectErr(t, post(t, e, RouteEncode, withPort("p3", fmt.Sprintf("[%d]", b.Port()), "fail:400:bad")), http.StatusBadRequest, "bad", "p3")
			if got := e.Stats().Pushes["p3|"+sinkURL(b)]; !slices.Equal(got, []string{PushError}) {
				t.Fatalf("pushes %v", e.Stats().Pushes)
			}
			if m := nextMessage(t, b); len(m) != 1 {
				t.Fatalf("%d frames", len(m))
			}
			// With one port (zmq_to_tokenizer) GEN0 answers the error
			// without pushing it; NEW pushes it.
			expectErr(t, post(t, e, RouteEncode, withPort("p4", fmt.Sprint(a.Port()), "fail:400:bad")), http.StatusBadRequest, "bad", "p4")
			got := e.Stats().Pushes["p4|"+sinkURL(a)]
			if want := gen == GenNew; (len(got) == 1) != want {
				t.Fatalf("%s: pushes %v", gen, e.Stats().Pushes)
			}
			if s := e.Stats(); s.Staged != 0 {
				t.Fatalf("staged %d", s.Staged)
			}
		})
	}
}

func TestPushToRefusedPortDoesNotHang(t *testing.T) {
	e := start(t, pushOptions(Gen0))
	port := refusedPort(t)
	url := fmt.Sprintf("127.0.0.1:%d", port)
	expect(t, recv(t, postAsync(e, RouteEncode, withPort("rp", fmt.Sprint(port)))), http.StatusOK, "null")

	enc := postAsync(e, RouteEncode, encodeBody("ru"))
	waitWaiting(t, e, RouteEncode, 1)
	expect(t, post(t, e, RouteRegister, registerBody("ru", 1, url)), http.StatusOK, "null")
	expect(t, recv(t, enc), http.StatusOK, "null")

	expectErr(t, post(t, e, RouteEncode, encodeBody("rf", "fail:500:boom")), http.StatusInternalServerError, "boom", "rf")
	expect(t, post(t, e, RouteRegister, registerBody("rf", 1, url)), http.StatusOK, "null")
	waitFor(t, "the background push to give up", func() bool { return e.Stats().PushFailures["rf|"+url] == 1 })

	st := e.Stats()
	if st.Pushes != nil {
		t.Fatalf("pushes %v", st.Pushes)
	}
	want := map[string]int64{"rp|" + url: 1, "ru|" + url: 1, "rf|" + url: 1}
	if fmt.Sprint(st.PushFailures) != fmt.Sprint(want) {
		t.Fatalf("failures %v, want %v", st.PushFailures, want)
	}
	waitFor(t, "the release", func() bool { return e.Stats().Staged == 0 })
}

func TestPushFramesStatsJSON(t *testing.T) {
	e := start(t, pushOptions(GenNew))
	s := startSink(t)
	expect(t, post(t, e, RouteEncode, withPort("j", fmt.Sprint(s.Port()))), http.StatusOK, "null")
	var got map[string]json.RawMessage
	if err := json.Unmarshal([]byte(get(t, e, RouteStats).body), &got); err != nil {
		t.Fatal(err)
	}
	if want := `{"j|` + sinkURL(s) + `":["embedding"]}`; string(got["pushes"]) != want {
		t.Fatalf("pushes %s, want %s", got["pushes"], want)
	}
	if _, ok := got["registrations"]; ok {
		t.Fatalf("registrations shown with none: %s", got["registrations"])
	}
}

func TestCloseEndsPushesAndPushLoops(t *testing.T) {
	e := New(pushOptions(Gen0))
	if err := e.Start("127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	held, err := acktest.Start(acktest.Options{Hold: true}) // keeps the push in its linger
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	lingering := postAsync(e, RouteEncode, withPort("c1", fmt.Sprint(held.Port())))
	nextMessage(t, held)
	expectErr(t, post(t, e, RouteEncode, encodeBody("c2", "fail:400:bad")), http.StatusBadRequest, "bad", "c2")
	waiting := postAsync(e, RouteEncode, encodeBody("c3"))
	waitWaiting(t, e, RouteEncode, 2) // c2's background push loop and c3
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	recv(t, lingering)
	recv(t, waiting)
	held.Release()
}
