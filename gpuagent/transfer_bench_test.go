package gpuagent

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/encgate/encgate/gpuagent/mooncake"
)

// The transfer benchmarks move the same embedding sizes over loopback three
// ways, so bench/transfer.sh can put them side by side:
//
//   - BenchmarkAgentTransfer: the gpuagent path. One bfloat16 embedding is
//     staged once over POST /v1/stage on its Unix socket; every iteration is a POST /send over a
//     keep-alive HTTP connection, which runs the agent's checks (staged,
//     encode ok, size, allow_networks on session_id and prefill_host), writes
//     the bytes with the Mooncake TCP initiator into a separate Mooncake
//     receiver (v2: pooled connection, status frame), and answers 200 null.
//     The /send carries no receive_count, so the entry is never released.
//     The client is a fasthttp.HostClient, as the gateway's (upstream.newClient)
//     is: it writes the request and reads the answer on the calling
//     goroutine. net/http's Transport hands each request to a writer
//     goroutine and each answer back from a reader goroutine, two wake-ups
//     per /send that the gateway does not make.
//   - BenchmarkInitiatorWrite: mooncake.Initiator.Write alone into the same
//     kind of receiver (no HTTP, no checks), to show what the /send costs.
//   - BenchmarkNetConnLoop: a plain net.Conn pair. The sender writes N bytes,
//     the receiver reads all N into one buffer and answers a 1-byte ack, which
//     the sender waits for: one confirmed message per iteration, as a
//     Mooncake v2 write is.
//
// Each reports throughput through b.SetBytes (MB/s = 10^6 bytes/s), and
// checks afterwards that the receiving side holds the bytes and took every
// transfer. BenchmarkTransferSideBySide runs the three op by op in turn.

var transferSizes = []struct {
	name   string
	tokens int // bfloat16 [tokens, 4096]
}{
	{"1MiB", 128},
	{"8MiB", 1024},
	{"64MiB", 8192},
}

const transferDim = 4096

// benchPattern is n bytes that differ from their neighbours.
func benchPattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*13) + seed
	}
	return b
}

// benchReceiver starts a Mooncake TCP receiver (v2) with one buffer of n bytes.
func benchReceiver(b *testing.B, n int) *mooncake.Receiver {
	b.Helper()
	r, err := mooncake.NewReceiver(mooncake.ReceiverConfig{
		HandshakeListen: "127.0.0.1:0", DataListen: "127.0.0.1:0", AdvertiseHost: "127.0.0.1",
		Buffers: []int{n}, ProtoVersion: 2,
	}, zap.NewNop())
	if err != nil {
		b.Fatal(err)
	}
	if err := r.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = r.Close() })
	return r
}

// benchPost posts body and fails unless the answer is 200 with want (when
// want is not empty); the response body is drained so the connection stays.
func benchPost(b *testing.B, c *http.Client, url, ctype string, body []byte, want string) {
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		b.Fatal(err)
	}
	req.Header.Set("Content-Type", ctype)
	req.Header.Set("Authorization", "Bearer "+testToken)
	resp, err := c.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		b.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK || (want != "" && string(got) != want) {
		b.Fatalf("POST %s: %d %s", url, resp.StatusCode, got)
	}
}

// benchSend posts a /send body as the gateway does (fasthttp, keep-alive)
// and fails unless the answer is 200 null.
func benchSend(b *testing.B, c *fasthttp.HostClient, url string, body []byte) {
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI(url)
	req.Header.SetMethod(http.MethodPost)
	req.Header.SetContentType("application/json")
	req.Header.Set("Authorization", "Bearer "+testToken)
	req.SetBodyRaw(body)
	if err := c.DoTimeout(req, resp, time.Minute); err != nil {
		b.Fatal(err)
	}
	if resp.StatusCode() != http.StatusOK || string(resp.Body()) != "null" {
		b.Fatalf("POST %s: %d %s", url, resp.StatusCode(), resp.Body())
	}
}

// benchSocket is a fresh short path for an agent's Unix socket.
func benchSocket(b *testing.B) string {
	dir, err := os.MkdirTemp("", "ag")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = os.RemoveAll(dir) })
	return filepath.Join(dir, "agent.sock")
}

// transferPath is one way of moving n bytes, set up and warmed by one
// untimed transfer: op moves the bytes once and returns when the receiving
// side has confirmed them; check, called once after the ops, verifies that
// the receiving side holds the bytes and took ops+1 transfers.
type transferPath struct {
	op    func()
	check func(ops int)
}

// agentPath is the agent's POST /send (see the top of this file); reg is
// the agent's metrics registry.
func agentPath(b *testing.B, tokens int) (p transferPath, reg *prometheus.Registry) {
	n := tokens * transferDim * 2
	recv := benchReceiver(b, n)
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Control.Socket, cfg.Control.Token = benchSocket(b), testToken
	// The transfer alone: with acks on, only the first /send to a
	// destination is acked, so the timed ones would not ack anyway.
	cfg.Ack.Mode = AckOff
	reg = prometheus.NewRegistry()
	a, err := New(cfg, Deps{Log: zap.NewNop(), Registry: reg})
	if err != nil {
		b.Fatal(err)
	}
	if err := a.Start(); err != nil {
		b.Fatal(err)
	}
	c := &fasthttp.HostClient{
		Addr: a.Addr(), MaxConns: 1, NoDefaultUserAgentHeader: true,
		// Short, so that its cleaner goroutine ends soon after the
		// connection is closed (goleak); no /send waits this long.
		MaxIdleConnDuration: 500 * time.Millisecond,
		Dial:                func(addr string) (net.Conn, error) { return net.DialTimeout("tcp", addr, 5*time.Second) },
	}
	b.Cleanup(func() {
		c.CloseIdleConnections()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := a.Shutdown(ctx); err != nil {
			b.Errorf("shutdown: %v", err)
		}
	})
	url := "http://" + a.Addr() + "/send"
	id := fmt.Sprintf("9f1c2d3e4b5a69788796a5b4c3d2e1f0_local_part_%d", tokens)
	data := benchPattern(n, 7)
	// Staged once over the Unix socket, as the node's encoder does.
	benchPost(b, client, fmt.Sprintf("http://%s/v1/stage?req_id=%s&tokens=%d&dim=%d&dtype=bfloat16",
		socketHost(a.SocketPath()), id, tokens, transferDim),
		"application/octet-stream", data, "")
	addr := recv.Buffers()[0].Addr
	send := []byte(fmt.Sprintf(`{"req_id":%q,"part_idx":0,"embedding_size":%d,"embedding_len":%d,"embedding_dim":%d,"prefill_host":"127.0.0.1","embedding_port":41001,"session_id":%q,"buffer_address":%d}`,
		id, n, tokens, transferDim, recv.SessionID(), addr))
	// One untimed /send: the handshake and the pooled data connection.
	benchSend(b, c, url, send)
	return transferPath{
		op:    func() { benchSend(b, c, url, send) },
		check: func(ops int) { checkReceiver(b, recv, addr, data, ops+1) },
	}, reg
}

// initiatorPath is mooncake.Initiator.Write alone into the same kind of
// receiver: no HTTP, no checks.
func initiatorPath(b *testing.B, n int) transferPath {
	recv := benchReceiver(b, n)
	ini := mooncake.NewInitiator(mooncake.InitiatorConfig{})
	b.Cleanup(func() { _ = ini.Close() })
	data := benchPattern(n, 9)
	addr := recv.Buffers()[0].Addr
	ctx := context.Background()
	write := func() {
		if _, err := ini.Write(ctx, recv.SessionID(), addr, data); err != nil {
			b.Fatal(err)
		}
	}
	write() // the handshake and the pooled data connection, untimed
	return transferPath{op: write, check: func(ops int) { checkReceiver(b, recv, addr, data, ops+1) }}
}

// checkReceiver fails unless the receiver's buffer at addr holds data and
// the receiver took writes transfers.
func checkReceiver(b *testing.B, recv *mooncake.Receiver, addr uint64, data []byte, writes int) {
	got, err := recv.Bytes(addr, len(data))
	if err != nil {
		b.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		b.Fatal("the receiver's buffer does not hold the sent bytes")
	}
	if w := recv.Stats().Writes; w != uint64(writes) {
		b.Fatalf("receiver took %d writes, want %d", w, writes)
	}
}

// netConnPath is a plain net.Conn pair: the sender writes n bytes, the
// receiver reads all n into one buffer and answers a 1-byte ack, which the
// sender waits for. check closes the connection.
func netConnPath(b *testing.B, n int) transferPath {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	type result struct {
		msgs int
		last []byte
		err  error
	}
	served := make(chan result, 1)
	go func() {
		c, err := ln.Accept()
		ln.Close()
		if err != nil {
			served <- result{err: err}
			return
		}
		defer c.Close()
		buf := make([]byte, n)
		ack := []byte{1}
		for msgs := 0; ; msgs++ {
			if _, err := io.ReadFull(c, buf); err != nil {
				if err == io.EOF {
					err = nil
				}
				served <- result{msgs: msgs, last: buf, err: err}
				return
			}
			if _, err := c.Write(ack); err != nil {
				served <- result{err: err}
				return
			}
		}
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	closed := false
	b.Cleanup(func() {
		if !closed {
			c.Close()
		}
	})
	data := benchPattern(n, 11)
	var ack [1]byte
	roundTrip := func() {
		if _, err := c.Write(data); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, ack[:]); err != nil {
			b.Fatal(err)
		}
	}
	roundTrip() // warm the connection, as the others are
	return transferPath{op: roundTrip, check: func(ops int) {
		closed = true
		c.Close()
		r := <-served
		switch {
		case r.err != nil:
			b.Fatal(r.err)
		case r.msgs != ops+1:
			b.Fatalf("the receiver read %d messages, want %d", r.msgs, ops+1)
		case !bytes.Equal(r.last, data):
			b.Fatal("the receiver's buffer does not hold the sent bytes")
		}
	}}
}

func BenchmarkAgentTransfer(b *testing.B) {
	for _, sz := range transferSizes {
		b.Run(sz.name, func(b *testing.B) {
			p, reg := agentPath(b, sz.tokens)
			b.SetBytes(int64(sz.tokens * transferDim * 2))
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				p.op()
			}
			b.StopTimer()
			p.check(b.N)
			// Which registration the staged region got: mlock needs CAP_IPC_LOCK
			// or RLIMIT_MEMLOCK room; without it every /send locks and unlocks
			// the region (0 here means the shared registration held).
			b.ReportMetric(counterValue(reg, "encgate_agent_registrations_total", "kind", regPerSend)/float64(b.N+1), "persend-mlocks/op")
		})
	}
}

func BenchmarkInitiatorWrite(b *testing.B) {
	for _, sz := range transferSizes {
		b.Run(sz.name, func(b *testing.B) {
			p := initiatorPath(b, sz.tokens*transferDim*2)
			b.SetBytes(int64(sz.tokens * transferDim * 2))
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				p.op()
			}
			b.StopTimer()
			p.check(b.N)
		})
	}
}

func BenchmarkNetConnLoop(b *testing.B) {
	for _, sz := range transferSizes {
		b.Run(sz.name, func(b *testing.B) {
			p := netConnPath(b, sz.tokens*transferDim*2)
			b.SetBytes(int64(sz.tokens * transferDim * 2))
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				p.op()
			}
			b.StopTimer()
			p.check(b.N)
		})
	}
}

// BenchmarkTransferSideBySide runs the three paths op by op in turn (agent,
// initiator, Go loop; the next iteration starts one further along), so that
// a change in the machine's load between seconds falls on all three alike,
// and reports each one's throughput over its own ops (MB/s = 10^6 bytes/s)
// and the agent's time per op against the Go loop's.
func BenchmarkTransferSideBySide(b *testing.B) {
	for _, sz := range transferSizes {
		b.Run(sz.name, func(b *testing.B) {
			n := sz.tokens * transferDim * 2
			agent, _ := agentPath(b, sz.tokens)
			paths := []struct {
				name string
				p    transferPath
			}{{"agent", agent}, {"initiator", initiatorPath(b, n)}, {"goloop", netConnPath(b, n)}}
			spent := make([]time.Duration, len(paths))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				for j := range paths {
					k := (i + j) % len(paths)
					start := time.Now()
					paths[k].p.op()
					spent[k] += time.Since(start)
				}
			}
			b.StopTimer()
			for k, p := range paths {
				p.p.check(b.N)
				b.ReportMetric(float64(n)*float64(b.N)/spent[k].Seconds()/1e6, p.name+"-MB/s")
			}
			b.ReportMetric(spent[2].Seconds()/spent[0].Seconds(), "agent/goloop")
		})
	}
}

// counterValue is the value of a counter with label name=value, or 0.
func counterValue(reg *prometheus.Registry, metric, name, value string) float64 {
	mfs, err := reg.Gather()
	if err != nil {
		return 0
	}
	for _, mf := range mfs {
		if mf.GetName() != metric {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == name && l.GetValue() == value {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}
