package gpuagent

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/encgate/encgate/gpuagent/acktest"
	"github.com/encgate/encgate/gpuagent/mooncake"
	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
)

// startAckSink runs an acktest.Sink, closed at test end.
func startAckSink(t *testing.T, hold bool) *acktest.Sink {
	t.Helper()
	s, err := acktest.Start(acktest.Options{Hold: hold})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// expectMarker shows that nothing but what a test already took reached
// sink: it sends a fresh part with its own ack frame to the same port and
// fails unless that frame is the next to arrive. An ack of an earlier
// /send would have been read before that /send returned (the agent waits
// for the receiver to close after its frame), so it would come first.
func (a *testAgent) expectMarker(t *testing.T, sink *ackSink, recv *mooncake.Receiver, addr uint64) {
	t.Helper()
	id := fmt.Sprintf("marker-%d", sink.port)
	a.stageAcked(t, id, 1, 1)
	expect(t, a.send(t, sendReq{id: id, port: sink.port, session: recv.SessionID(), addr: addr, count: 1}), http.StatusOK, "null")
	sink.expectAck(t, ackFrameOf(id))
}

// allBytes is a frame over 255 bytes (a ZMTP long frame) holding every byte
// value, zero included.
func allBytes() []byte {
	b := make([]byte, 1000)
	for i := range b {
		b[i] = byte(i)
	}
	return b
}

func (a *testAgent) postAck(t *testing.T, id string, frame []byte) reply {
	t.Helper()
	return do(t, http.MethodPost, a.ctl+"/v1/ack?req_id="+id, bytes.NewReader(frame))
}

func TestAckReachesAZMQPullSocketOncePerDestination(t *testing.T) {
	recv := startReceiver(t)
	a := startAgent(t, nil, nil, nil)
	b := base(t, recv)
	frame := allBytes()
	// The ack frame may come before the embedding.
	expect(t, a.postAck(t, "tp", frame), http.StatusOK, `{"req_id":"tp","ack_frame_bytes":1000}`)
	data := a.stageOK(t, "tp", 16, 16)
	r1, r2 := startSink(t), startSink(t)

	expect(t, a.send(t, sendReq{id: "tp", port: r1.port, session: recv.SessionID(), addr: b, count: 2}), http.StatusOK, "null")
	r1.expectAck(t, frame)
	// The same rank again: written again (as sglang does), but not acked
	// again (sglang's receiver fails a request on a second ack).
	expect(t, a.send(t, sendReq{id: "tp", port: r1.port, session: recv.SessionID(), addr: b, count: 2}), http.StatusOK, "null")
	expect(t, a.send(t, sendReq{id: "tp", port: r2.port, session: recv.SessionID(), addr: b + 4096, count: 2}), http.StatusOK, "null")
	r2.expectAck(t, frame)
	for _, at := range []uint64{b, b + 4096} {
		if got, _ := recv.Bytes(at, len(data)); !bytes.Equal(got, data) {
			t.Fatalf("bytes at %#x differ", at)
		}
	}
	// Released with its entry: the ack frame is no longer held.
	if held, n := a.store.usage(); held != 0 || n != 0 {
		t.Fatalf("held %d bytes in %d entries after release", held, n)
	}
	a.expectMarker(t, r1, recv, b+8192)
	a.expectMarker(t, r2, recv, b+8192)
	for result, want := range map[string]float64{ackSent: 4, ackSkipped: 1, ackFailed: 0} {
		if v := testutil.ToFloat64(a.metrics.acks.WithLabelValues(result)); v != want {
			t.Errorf("acks{%s} = %v, want %v", result, v, want)
		}
	}
}

func TestAckNotSentWhenTheTransferFails(t *testing.T) {
	recv := startReceiver(t)
	a := startAgent(t, nil, nil, nil)
	b := base(t, recv)
	sink := startSink(t)

	// Rejected: the range is outside the receiver's buffer.
	a.stageAcked(t, "far", 4, 4)
	expectErr(t, a.send(t, sendReq{id: "far", port: sink.port, session: recv.SessionID(), addr: b + 1<<20 - 16, count: 1}),
		http.StatusBadRequest, "far", "nothing was sent")

	// Failed: the receiver is gone.
	gone := startReceiver(t)
	session, gb := gone.SessionID(), base(t, gone)
	if err := gone.Close(); err != nil {
		t.Fatal(err)
	}
	a.stageAcked(t, "gone", 4, 4)
	expectErr(t, a.send(t, sendReq{id: "gone", port: sink.port, session: session, addr: gb, count: 1}),
		http.StatusInternalServerError, "gone", "Mooncake transfer_sync failed for gone")

	a.expectMarker(t, sink, recv, b)
	if v := testutil.ToFloat64(a.metrics.acks.WithLabelValues(ackSent)); v != 1 {
		t.Errorf("acks{sent} = %v, want 1 (the marker)", v)
	}
}

// gatedPeer is a Mooncake TCP receiver written for this test: it answers
// the Metadata handshake with a descriptor of one buffer, reads one write,
// reports it on arrived, and confirms it (v1: closing the connection; v2:
// the OK status frame) only when gate is closed.
type gatedPeer struct {
	hs, data net.Listener
	base     uint64
	arrived  chan []byte
	gate     chan struct{}
	wg       sync.WaitGroup
}

func startGatedPeer(t *testing.T, version int) *gatedPeer {
	t.Helper()
	p := &gatedPeer{base: 0x7f00_0000_0000, arrived: make(chan []byte, 1), gate: make(chan struct{})}
	var err error
	if p.hs, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	if p.data, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	desc := mooncake.Descriptor{Name: p.hs.Addr().String(), Protocols: []string{"tcp"},
		TCPDataPort: p.data.Addr().(*net.TCPAddr).Port, TCPProtoVersion: version,
		Buffers: []mooncake.Buffer{{Name: p.hs.Addr().String(), Addr: p.base, Length: 4096}}}
	p.wg.Add(2)
	go func() {
		defer p.wg.Done()
		for {
			c, err := p.hs.Accept()
			if err != nil {
				return
			}
			if typ, _, err := mooncake.ReadFrame(c, mooncake.MaxHandshakeFrame); err == nil {
				_ = mooncake.WriteFrame(c, typ, desc.EncodeJSON())
				_ = c.(*net.TCPConn).CloseWrite()
				_, _ = io.Copy(io.Discard, c)
			}
			_ = c.Close()
		}
	}()
	go func() {
		defer p.wg.Done()
		c, err := p.data.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		var hb [mooncake.HeaderSize]byte
		if _, err := io.ReadFull(c, hb[:]); err != nil {
			return
		}
		h, _ := mooncake.ParseHeader(hb[:])
		payload := make([]byte, h.Size)
		if _, err := io.ReadFull(c, payload); err != nil {
			return
		}
		p.arrived <- payload
		<-p.gate
		if version >= 2 {
			_, _ = c.Write(mooncake.AppendStatus(nil, mooncake.StatusOK))
			_, _ = io.Copy(io.Discard, c) // until the initiator closes its pooled connection
		}
	}()
	t.Cleanup(func() {
		select {
		case <-p.gate:
		default:
			close(p.gate)
		}
		_ = p.hs.Close()
		_ = p.data.Close()
		p.wg.Wait()
	})
	return p
}

func TestAckOnlyAfterTheTransferIsConfirmed(t *testing.T) {
	for _, version := range []int{1, 2} {
		t.Run(fmt.Sprintf("v%d", version), func(t *testing.T) {
			peer := startGatedPeer(t, version)
			a := startAgent(t, nil, nil, nil)
			data := a.stageAcked(t, "gated", 4, 4)
			sink := startAckSink(t, false)
			answer := make(chan reply, 1)
			go func() {
				answer <- a.send(t, sendReq{id: "gated", port: sink.Port(), session: peer.hs.Addr().String(), addr: peer.base, count: 1})
			}()
			if got := <-peer.arrived; !bytes.Equal(got, data) {
				t.Fatalf("peer got %x, want %x", got, data)
			}
			// The bytes are at the peer but not confirmed: no ack yet. (Had
			// the agent acked first, the sink would have recorded the frame
			// before the transfer even started.)
			if f := sink.Frames(); len(f) != 0 {
				t.Fatalf("acked before the transfer was confirmed: %q", f)
			}
			close(peer.gate)
			expect(t, <-answer, http.StatusOK, "null")
			if f := sink.Frames(); len(f) != 1 || len(f[0]) != 1 || !bytes.Equal(f[0][0], ackFrameOf("gated")) {
				t.Fatalf("sink recorded %q, want one ack", f)
			}
		})
	}
}

func TestAckRequiredWithoutAFrameFailsBeforeAnyByte(t *testing.T) {
	recv := startReceiver(t)
	a := startAgent(t, nil, nil, nil) // ack.mode: required is the default
	a.stageOK(t, "noack", 4, 4)
	sink := startAckSink(t, false)
	r := a.send(t, sendReq{id: "noack", port: sink.Port(), session: recv.SessionID(), addr: base(t, recv), count: 1})
	expectErr(t, r, http.StatusInternalServerError, "noack",
		"no ack frame staged for req_id=noack and ack.mode is required", "POST /v1/ack?req_id=noack", "nothing was sent")
	if st := recv.Stats(); st.DataConns != 0 || st.Writes != 0 {
		t.Fatalf("receiver saw %+v", st)
	}
	zeros(t, recv, base(t, recv), 1<<20)
	if f := sink.Frames(); len(f) != 0 {
		t.Fatalf("sink recorded %q", f)
	}
	// Released, as any /send error releases.
	expectErr(t, a.send(t, sendReq{id: "noack", port: sink.Port(), session: recv.SessionID(), addr: base(t, recv), count: 1}),
		http.StatusInternalServerError, "noack", "already released")
}

func TestAckOptionalAndOff(t *testing.T) {
	recv := startReceiver(t)
	b := base(t, recv)
	for _, tc := range []struct {
		mode      string
		withFrame bool
		acks      int
	}{
		{AckOptional, false, 0},
		{AckOptional, true, 1},
		{AckOff, true, 0},
	} {
		t.Run(fmt.Sprintf("%s frame=%v", tc.mode, tc.withFrame), func(t *testing.T) {
			a := startAgent(t, func(c *Config) { c.Ack.Mode = tc.mode }, nil, nil)
			data := a.stageOK(t, "opt", 4, 4)
			if tc.withFrame {
				a.ackOK(t, "opt")
			}
			sink := startAckSink(t, false)
			expect(t, a.send(t, sendReq{id: "opt", port: sink.Port(), session: recv.SessionID(), addr: b, count: 1}), http.StatusOK, "null")
			if got, _ := recv.Bytes(b, len(data)); !bytes.Equal(got, data) {
				t.Fatal("bytes not in place")
			}
			if f := sink.Frames(); len(f) != tc.acks {
				t.Fatalf("sink recorded %q, want %d acks", f, tc.acks)
			}
			sent := testutil.ToFloat64(a.metrics.acks.WithLabelValues(ackSent))
			skipped := testutil.ToFloat64(a.metrics.acks.WithLabelValues(ackSkipped))
			if sent != float64(tc.acks) || skipped != float64(1-tc.acks) {
				t.Fatalf("acks sent %v skipped %v", sent, skipped)
			}
		})
	}
}

func TestAckUndeliverableFailsTheSend(t *testing.T) {
	recv := startReceiver(t)
	b := base(t, recv)

	t.Run("refused", func(t *testing.T) {
		a := startAgent(t, nil, nil, nil)
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		ln.Close() // nothing listens there now
		data := a.stageAcked(t, "refused", 4, 4)
		r := a.send(t, sendReq{id: "refused", port: port, session: recv.SessionID(), addr: b, count: 2})
		expectErr(t, r, http.StatusInternalServerError, "refused",
			fmt.Sprintf("32 bytes for refused reached session=%s, but the ack to tcp://127.0.0.1:%d (prefill_host:embedding_port) failed", recv.SessionID(), port),
			"connect: ", "connection refused")
		// The bytes are in place; the receiver just will not know.
		if got, _ := recv.Bytes(b, len(data)); !bytes.Equal(got, data) {
			t.Fatal("bytes not in place")
		}
		if v := testutil.ToFloat64(a.metrics.acks.WithLabelValues(ackFailed)); v != 1 {
			t.Errorf("acks{failed} = %v", v)
		}
		if n := testutil.CollectAndCount(a.metrics.ackTime); n != 1 {
			t.Errorf("ack_seconds series = %d", n)
		}
		// Released, as any /send error releases.
		expectErr(t, a.send(t, sendReq{id: "refused", port: port, session: recv.SessionID(), addr: b, count: 2}),
			http.StatusInternalServerError, "refused", "already released")
	})

	t.Run("connect timeout", func(t *testing.T) {
		const connectTimeout = 200 * time.Millisecond
		a := startAgent(t, func(c *Config) {
			c.Ack.ConnectTimeout = configfile.Duration(connectTimeout)
			c.Ack.SendTimeout = configfile.Duration(10 * time.Minute)
		}, nil, nil)
		port := blackhole(t)
		a.stageAcked(t, "slow", 4, 4)
		start := time.Now()
		r := a.send(t, sendReq{id: "slow", port: port, session: recv.SessionID(), addr: b, count: 1})
		took := time.Since(start)
		expectErr(t, r, http.StatusInternalServerError, "slow",
			fmt.Sprintf("the ack to tcp://127.0.0.1:%d (prefill_host:embedding_port) failed", port), "connect: ", "timeout")
		// Bounded by ack.connect_timeout (plus generous slack for a loaded
		// machine), far below ack.send_timeout.
		if took > connectTimeout+20*time.Second {
			t.Fatalf("the /send took %v with ack.connect_timeout %v", took, connectTimeout)
		}
	})

	t.Run("not a PULL socket", func(t *testing.T) {
		// Something that accepts and never speaks ZMTP: send_timeout bounds
		// the handshake.
		a := startAgent(t, func(c *Config) { c.Ack.SendTimeout = configfile.Duration(200 * time.Millisecond) }, nil, nil)
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		var held []net.Conn
		var mu sync.Mutex
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				mu.Lock()
				held = append(held, c)
				mu.Unlock()
			}
		}()
		t.Cleanup(func() {
			ln.Close()
			<-done
			mu.Lock()
			for _, c := range held {
				c.Close()
			}
			mu.Unlock()
		})
		a.stageAcked(t, "mute", 4, 4)
		r := a.send(t, sendReq{id: "mute", port: ln.Addr().(*net.TCPAddr).Port, session: recv.SessionID(), addr: b, count: 1})
		expectErr(t, r, http.StatusInternalServerError, "mute", "ZMTP handshake: ", "timeout")
	})
}

// blackhole returns a loopback port where a TCP connect hangs: a socket
// listening with a backlog of 0 whose only queue slot is taken and which
// never accepts, so the kernel drops further SYNs.
func blackhole(t *testing.T) int {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	port := sa.(*syscall.SockaddrInet4).Port
	filler, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = filler.Close() })
	return port
}

func TestAckStaging(t *testing.T) {
	a := startAgent(t, func(c *Config) {
		c.Ack.MaxFrameBytes = 64
		c.Staging.CapacityBytes = 200
		c.Staging.MaxStageBytes = 128
	}, nil, nil)
	url := func(q string) string { return a.ctl + "/v1/ack?" + q }
	frame := []byte("\x80\x04\x95pickled EmbeddingData")

	expect(t, a.postAck(t, "r", frame), http.StatusOK, fmt.Sprintf(`{"req_id":"r","ack_frame_bytes":%d}`, len(frame)))
	// The same bytes again (an encoder retrying its call) are accepted.
	expect(t, a.postAck(t, "r", frame), http.StatusOK, fmt.Sprintf(`{"req_id":"r","ack_frame_bytes":%d}`, len(frame)))
	expectErr(t, a.postAck(t, "r", []byte("other")), http.StatusConflict, "r", "req_id=r already has a different ack frame")
	expectErr(t, a.postAck(t, "big", make([]byte, 65)), http.StatusRequestEntityTooLarge, "big", "ack.max_frame_bytes (64)")
	// Without a Content-Length the body is counted as it is read.
	expectErr(t, do(t, http.MethodPost, url("req_id=chunk"), io.MultiReader(bytes.NewReader(make([]byte, 100)))),
		http.StatusRequestEntityTooLarge, "chunk", "ack.max_frame_bytes")
	expectErr(t, a.postAck(t, "empty", nil), http.StatusBadRequest, "empty", "empty ack frame for req_id=empty")
	expectErr(t, do(t, http.MethodPost, url("req_id=x&tokens=1"), bytes.NewReader(frame)), http.StatusBadRequest, "x", `unknown ack parameter "tokens"`)
	expectErr(t, do(t, http.MethodPost, url("req_id=x&req_id=y"), bytes.NewReader(frame)), http.StatusBadRequest, "x", "given 2 times")
	expectErr(t, do(t, http.MethodPost, url(""), bytes.NewReader(frame)), http.StatusBadRequest, "", "missing or invalid req_id")
	if r := do(t, http.MethodGet, url("req_id=r"), nil); r.status != http.StatusMethodNotAllowed {
		t.Errorf("GET /v1/ack: %d", r.status)
	}

	// Ack frames count against staging.capacity_bytes.
	a.stageOK(t, "emb", 4, 16) // 128 bytes; 128+24 held
	expectErr(t, a.postAck(t, "full", make([]byte, 49)), http.StatusInsufficientStorage, "full",
		"would exceed staging.capacity_bytes", "152 bytes held")
	expect(t, a.postAck(t, "emb", make([]byte, 48)), http.StatusOK, `{"req_id":"emb","ack_frame_bytes":48}`)
	st := a.staged(t)
	if len(st) != 2 || st[0].ReqID != "emb" || !st[0].AckFrame || st[0].AckFrameBytes != 48 ||
		st[1].ReqID != "r" || st[1].State != "ack_only" || st[1].AckFrameBytes != len(frame) {
		t.Fatalf("staged = %+v", st)
	}
	if v := testutil.ToFloat64(a.metrics.stagedBytes); v != 200 {
		t.Fatalf("staged_bytes = %v", v)
	}
	if v := testutil.ToFloat64(a.metrics.requests.WithLabelValues("ack", "413")); v != 2 {
		t.Errorf("requests{ack,413} = %v", v)
	}
	// A stage that fails keeps the ack frame staged before it (the encoder
	// may stage again); a release takes it.
	expectErr(t, a.stage(t, "r", 4, 8, "bfloat16", make([]byte, 3)), http.StatusBadRequest, "r", "body has 3 bytes")
	if st := a.staged(t); len(st) != 2 || st[1].ReqID != "r" || !st[1].AckFrame {
		t.Fatalf("staged = %+v", st)
	}
	a.store.releaseID("emb")
	if held, n := a.store.usage(); held != int64(len(frame)) || n != 0 {
		t.Fatalf("held %d bytes in %d entries, want only r's ack frame", held, n)
	}
}

func TestAckFramesWithoutEmbeddingAreSwept(t *testing.T) {
	clk := clock.NewFake(time.Unix(1_000_000, 0))
	armed := clk.TimerCreated()
	a := startAgent(t, func(c *Config) { c.Staging.TTL = 180e9 }, clk, nil)
	<-armed
	a.ackOK(t, "lonely")
	next := clk.TimerCreated()
	clk.Advance(200 * time.Second)
	<-next // the sweeper swept and armed its next timer
	if st := a.staged(t); len(st) != 0 {
		t.Fatalf("staged = %+v", st)
	}
	if held, _ := a.store.usage(); held != 0 {
		t.Fatalf("held %d", held)
	}
}
