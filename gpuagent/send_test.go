package gpuagent

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestSendWritesExactBytesIntoTheReceiver(t *testing.T) {
	recv := startReceiver(t)
	a := startAgent(t, nil, nil, nil)
	data := a.stageAcked(t, "req-1", 4, 8) // 64 bytes
	addr := base(t, recv) + 100
	sink := startSink(t)

	r := a.send(t, sendReq{id: "req-1", port: sink.port, session: recv.SessionID(), addr: addr, count: 1})
	expect(t, r, http.StatusOK, "null")
	sink.expectAck(t, ackFrameOf("req-1"))
	if r.ctype != "application/json" {
		t.Fatalf("content type %q", r.ctype)
	}
	got, err := recv.Bytes(addr, len(data))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatalf("receiver holds %x, want %x", got, data)
	}
	zeros(t, recv, base(t, recv), 100)
	zeros(t, recv, addr+uint64(len(data)), 4096)

	if v := testutil.ToFloat64(a.metrics.transfers.WithLabelValues(resultOK)); v != 1 {
		t.Errorf("transfers{ok} = %v", v)
	}
	if v := testutil.ToFloat64(a.metrics.transferBytes); v != 64 {
		t.Errorf("transfer bytes = %v", v)
	}
	if v := testutil.ToFloat64(a.metrics.requests.WithLabelValues("send", "200")); v != 1 {
		t.Errorf("requests{send,200} = %v", v)
	}
	if n := testutil.CollectAndCount(a.metrics.transferTime); n != 1 {
		t.Errorf("transfer_seconds series = %d", n)
	}
	if v := testutil.ToFloat64(a.metrics.acks.WithLabelValues(ackSent)); v != 1 {
		t.Errorf("acks{sent} = %v", v)
	}
	// receive_count 1 reached: released and freed.
	if v := testutil.ToFloat64(a.metrics.stagedEntries); v != 0 {
		t.Errorf("staged entries = %v after release", v)
	}
	expectErr(t, a.send(t, sendReq{id: "req-1", port: 9002, session: recv.SessionID(), addr: addr, count: 1}),
		http.StatusInternalServerError, "req-1", "no staged embedding for req_id=req-1 (already released)")
}

func TestSendRefcountsDistinctDestinations(t *testing.T) {
	recv := startReceiver(t)
	a := startAgent(t, nil, nil, nil)
	data := a.stageAcked(t, "tp", 16, 16) // 512 bytes
	b := base(t, recv)
	rank := func(port int, addr uint64) reply {
		return a.send(t, sendReq{id: "tp", port: port, session: recv.SessionID(), addr: addr, count: 2})
	}
	r1, r2 := startSink(t), startSink(t)
	expect(t, rank(r1.port, b), http.StatusOK, "null")
	// The same rank again re-sends but does not advance the count, nor ack
	// again.
	expect(t, rank(r1.port, b), http.StatusOK, "null")
	st := a.staged(t)
	dest1 := fmt.Sprintf("127.0.0.1:%d", r1.port)
	if len(st) != 1 || len(st[0].Destinations) != 1 || st[0].Destinations[0] != dest1 || st[0].ReceiveCount != 2 ||
		len(st[0].AcksSent) != 1 || st[0].AcksSent[0] != dest1 || !st[0].AckFrame {
		t.Fatalf("staged = %+v", st)
	}
	expect(t, rank(r2.port, b+4096), http.StatusOK, "null")
	r1.expectAck(t, ackFrameOf("tp"))
	r2.expectAck(t, ackFrameOf("tp"))
	if v := testutil.ToFloat64(a.metrics.acks.WithLabelValues(ackSkipped)); v != 1 {
		t.Errorf("acks{skipped} = %v, want 1 (the repeated destination)", v)
	}
	if st := a.staged(t); len(st) != 0 {
		t.Fatalf("still staged after 2 of 2 destinations: %+v", st)
	}
	for _, at := range []uint64{b, b + 4096} {
		got, _ := recv.Bytes(at, len(data))
		if !bytes.Equal(got, data) {
			t.Fatalf("bytes at %#x differ", at)
		}
	}
	expectErr(t, rank(7003, b+8192), http.StatusInternalServerError, "tp", "no staged embedding for req_id=tp (already released)")
	zeros(t, recv, b+8192, len(data))
	if held, n := a.store.usage(); held != 0 || n != 0 {
		t.Fatalf("held %d bytes in %d entries after release", held, n)
	}
}

func TestSendWithoutReceiveCountLeavesTheEntry(t *testing.T) {
	recv := startReceiver(t)
	a := startAgent(t, nil, nil, nil)
	a.stageAcked(t, "nocount", 2, 2)
	for range 3 {
		sink := startSink(t)
		expect(t, a.send(t, sendReq{id: "nocount", port: sink.port, session: recv.SessionID(), addr: base(t, recv), count: -1}),
			http.StatusOK, "null")
		sink.expectAck(t, ackFrameOf("nocount"))
	}
	if st := a.staged(t); len(st) != 1 || len(st[0].Destinations) != 3 {
		t.Fatalf("staged = %+v", st)
	}
}

func TestSendErrors(t *testing.T) {
	recv := startReceiver(t)
	session := recv.SessionID()
	b := base(t, recv)
	a := startAgent(t, nil, nil, nil)
	released := func(t *testing.T, id string) {
		t.Helper()
		expectErr(t, a.send(t, sendReq{id: id, port: 1, session: session, addr: b, count: 1}),
			http.StatusInternalServerError, id, fmt.Sprintf("no staged embedding for req_id=%s (already released)", id))
	}

	t.Run("unknown", func(t *testing.T) {
		released(t, "never-staged")
	})
	t.Run("failed encode", func(t *testing.T) {
		r := do(t, http.MethodPost, a.ctl+"/v1/stage?req_id=bad&error=Internal+encoding+error%3A+oom", nil)
		expect(t, r, http.StatusOK, `{"req_id":"bad","error":"Internal encoding error: oom"}`)
		if st := a.staged(t); len(st) != 1 || st[0].State != "failed" || st[0].Error != "Internal encoding error: oom" {
			t.Fatalf("staged = %+v", st)
		}
		expectErr(t, a.send(t, sendReq{id: "bad", port: 1, session: session, addr: b, count: 2}),
			http.StatusInternalServerError, "bad", "No embedding available for Mooncake GPU-direct transfer: bad")
		released(t, "bad") // released on the error, as sglang's newer encoder does
	})
	t.Run("out of range", func(t *testing.T) {
		a.stageAcked(t, "far", 4, 4)
		far := b + 1<<20 - 16 // the last 16 bytes of the buffer: 32 do not fit
		r := a.send(t, sendReq{id: "far", port: 1, session: session, addr: far, count: 1})
		expectErr(t, r, http.StatusBadRequest, "far", fmt.Sprintf("[%#x, %#x)", far, far+32), "session "+session, "nothing was sent")
		zeros(t, recv, b, 1<<20)
		released(t, "far")
		if v := testutil.ToFloat64(a.metrics.transfers.WithLabelValues(resultRejected)); v != 1 {
			t.Errorf("transfers{rejected} = %v", v)
		}
	})
	t.Run("prefill_host not allowed", func(t *testing.T) {
		a.stageOK(t, "pub", 4, 4)
		r := a.send(t, sendReq{id: "pub", host: "8.8.8.8", port: 1, session: session, addr: b, count: 1})
		expectErr(t, r, http.StatusForbidden, "pub", "prefill_host", "8.8.8.8", "transfer.allow_networks")
		zeros(t, recv, b, 1<<20)
		released(t, "pub")
	})
	t.Run("missing field releases", func(t *testing.T) {
		a.stageOK(t, "nosession", 4, 4)
		r := do(t, http.MethodPost, a.base+"/send", strings.NewReader(`{"req_id":"nosession","prefill_host":"127.0.0.1","embedding_port":1,"buffer_address":1}`))
		expectErr(t, r, http.StatusBadRequest, "nosession", "session_id")
		released(t, "nosession")
	})
	t.Run("invalid bodies", func(t *testing.T) {
		for _, body := range []string{``, `[]`, `{"req_id":5}`, `{"req_id":"x"`, strings.Repeat(" ", 70<<10)} {
			r := do(t, http.MethodPost, a.base+"/send", strings.NewReader(body))
			if r.status != http.StatusBadRequest && r.status != http.StatusRequestEntityTooLarge {
				t.Errorf("body %.20q: %d %s", body, r.status, r.body)
			}
		}
	})
	t.Run("size mismatch", func(t *testing.T) {
		a.stageOK(t, "shape", 4, 4)
		// Cannot happen through the API; corrupt the recorded shape to check
		// the invariant is enforced as sglang does.
		a.store.mu.Lock()
		a.store.entries["shape"].tokens = 5
		a.store.mu.Unlock()
		r := a.send(t, sendReq{id: "shape", port: 1, session: session, addr: b, count: 1})
		expectErr(t, r, http.StatusInternalServerError, "shape", "Embedding size mismatch for shape: actual=32, expected=40")
		zeros(t, recv, b, 1<<20)
		released(t, "shape")
	})
	t.Run("invalid session_id", func(t *testing.T) {
		a.stageOK(t, "sid", 4, 4)
		expectErr(t, a.send(t, sendReq{id: "sid", port: 1, session: "no-port", addr: b, count: 1}),
			http.StatusBadRequest, "sid", "invalid session_id")
		released(t, "sid")
	})
	// None of these errors opened a data connection, let alone wrote.
	if st := recv.Stats(); st.DataConns != 0 || st.Writes != 0 {
		t.Fatalf("receiver saw %+v", st)
	}
}

func TestSendSessionOutsideAllowNetworksIsRefused(t *testing.T) {
	recv := startReceiver(t)
	a := startAgent(t, func(c *Config) { c.Transfer.AllowNetworks = []string{"10.0.0.0/8"} }, nil, nil)
	a.stageOK(t, "lan", 8, 8)
	r := a.send(t, sendReq{id: "lan", host: "10.1.2.3", port: 1, session: recv.SessionID(), addr: base(t, recv), count: 1})
	expectErr(t, r, http.StatusForbidden, "lan", "session_id", "127.0.0.1", "transfer.allow_networks", "nothing was sent")
	zeros(t, recv, base(t, recv), 1<<20)
	if st := recv.Stats(); st.DataConns != 0 || st.Writes != 0 {
		t.Fatalf("receiver saw %+v", st)
	}
	if v := testutil.ToFloat64(a.metrics.transfers.WithLabelValues(resultNotAllowed)); v != 1 {
		t.Errorf("transfers{not_allowed} = %v", v)
	}
	if st := a.staged(t); len(st) != 0 {
		t.Fatalf("not released on error: %+v", st)
	}
}

func TestSendDialTimeCheckRefusesWhatTheNameResolvesTo(t *testing.T) {
	recv := startReceiver(t)
	// A name passes the pre-check as an address inside allow_networks, but
	// every connection is checked again at the address actually dialled.
	a := startAgent(t, func(c *Config) { c.Transfer.AllowNetworks = []string{"10.0.0.0/8"} }, nil, func(a *Agent) {
		a.lookupIP = func(context.Context, string) ([]netip.Addr, error) {
			return []netip.Addr{netip.MustParseAddr("10.9.9.9")}, nil
		}
	})
	a.stageAcked(t, "name", 2, 2)
	_, port, _ := strings.Cut(recv.SessionID(), ":")
	r := a.send(t, sendReq{id: "name", host: "10.1.1.1", port: 1, session: "localhost:" + port, addr: base(t, recv), count: 1})
	expectErr(t, r, http.StatusForbidden, "name", "transfer.allow_networks", "nothing was sent")
	zeros(t, recv, base(t, recv), 1<<20)
	if st := recv.Stats(); st.DataConns != 0 || st.Writes != 0 {
		t.Fatalf("receiver saw %+v", st)
	}
}

func TestSendTransferFailure(t *testing.T) {
	recv := startReceiver(t)
	session, b := recv.SessionID(), base(t, recv)
	if err := recv.Close(); err != nil {
		t.Fatal(err)
	}
	a := startAgent(t, nil, nil, nil)
	a.stageAcked(t, "gone", 4, 4)
	r := a.send(t, sendReq{id: "gone", port: 1, session: session, addr: b, count: 2})
	expectErr(t, r, http.StatusInternalServerError, "gone",
		fmt.Sprintf("Mooncake transfer_sync failed for gone (session=%s, nbytes=32, ret=-1): ", session))
	if v := testutil.ToFloat64(a.metrics.transfers.WithLabelValues(resultFailed)); v != 1 {
		t.Errorf("transfers{failed} = %v", v)
	}
	expectErr(t, a.send(t, sendReq{id: "gone", port: 2, session: session, addr: b, count: 2}),
		http.StatusInternalServerError, "gone", "already released")
}

func TestSendErrorReleasesForSiblings(t *testing.T) {
	recv := startReceiver(t)
	a := startAgent(t, nil, nil, nil)
	a.stageAcked(t, "sib", 4, 4)
	b := base(t, recv)
	sink := startSink(t)
	expect(t, a.send(t, sendReq{id: "sib", port: sink.port, session: recv.SessionID(), addr: b, count: 3}), http.StatusOK, "null")
	sink.expectAck(t, ackFrameOf("sib"))
	expectErr(t, a.send(t, sendReq{id: "sib", port: 2, session: recv.SessionID(), addr: b + 1<<30, count: 3}),
		http.StatusBadRequest, "sib")
	expectErr(t, a.send(t, sendReq{id: "sib", port: 3, session: recv.SessionID(), addr: b + 64, count: 3}),
		http.StatusInternalServerError, "sib", "no staged embedding for req_id=sib (already released)")
	zeros(t, recv, b+64, 64)
}

func TestSendConcurrentRanks(t *testing.T) {
	recv := startReceiver(t)
	a := startAgent(t, nil, nil, nil)
	data := a.stageAcked(t, "many", 64, 64) // 8KiB
	b := base(t, recv)
	const ranks = 8
	var wg sync.WaitGroup
	replies := make([]reply, ranks)
	sinks := make([]*ackSink, ranks)
	for i := range sinks {
		sinks[i] = startSink(t)
	}
	for i := range ranks {
		wg.Go(func() {
			replies[i] = a.send(t, sendReq{id: "many", port: sinks[i].port, session: recv.SessionID(), addr: b + uint64(i*len(data)), count: ranks})
		})
	}
	wg.Wait()
	for i, r := range replies {
		expect(t, r, http.StatusOK, "null")
		sinks[i].expectAck(t, ackFrameOf("many"))
		got, _ := recv.Bytes(b+uint64(i*len(data)), len(data))
		if !bytes.Equal(got, data) {
			t.Fatalf("rank %d bytes differ", i)
		}
	}
	if held, n := a.store.usage(); held != 0 || n != 0 {
		t.Fatalf("held %d bytes in %d entries", held, n)
	}
}

func TestSendNotifiesAfterTheTransfer(t *testing.T) {
	recv := startReceiver(t)
	var mu sync.Mutex
	var got []Completion
	fail := false
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var c Completion
		body, _ := io.ReadAll(r.Body)
		if err := json.Unmarshal(body, &c); err != nil {
			t.Errorf("notice %s: %v", body, err)
		}
		mu.Lock()
		defer mu.Unlock()
		got = append(got, c)
		if fail {
			w.WriteHeader(http.StatusBadGateway)
		}
	}))
	defer hook.Close()
	a := startAgent(t, func(c *Config) { c.Notify.HTTPURL = hook.URL + "/done" }, nil, nil)
	a.stageAcked(t, "note", 3, 5)
	b := base(t, recv)
	r1, r2 := startSink(t), startSink(t)
	expect(t, a.send(t, sendReq{id: "note", port: r1.port, session: recv.SessionID(), addr: b, count: 2}), http.StatusOK, "null")
	r1.expectAck(t, ackFrameOf("note"))
	mu.Lock()
	if len(got) != 1 {
		t.Fatalf("notices: %+v", got)
	}
	c := got[0]
	if c.ReqID != "note" || c.PartIdx == nil || *c.PartIdx != 0 || c.PrefillHost != "127.0.0.1" || c.EmbeddingPort != int64(r1.port) ||
		c.EmbeddingSize != 30 || c.EmbeddingLen != 3 || c.EmbeddingDim != 5 || c.Dtype != "bfloat16" ||
		c.SessionID != recv.SessionID() || c.BufferAddress != b {
		t.Fatalf("notice %+v", c)
	}
	fail = true
	mu.Unlock()

	// The ack goes first; the notice fails after it.
	r := a.send(t, sendReq{id: "note", port: r2.port, session: recv.SessionID(), addr: b + 64, count: 2})
	expectErr(t, r, http.StatusInternalServerError, "note", "completion notice failed", hook.URL+"/done", "status 502")
	r2.expectAck(t, ackFrameOf("note"))
	if st := a.staged(t); len(st) != 0 {
		t.Fatalf("not released after a failed notice: %+v", st)
	}
}
