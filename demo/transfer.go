package demo

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/gpuagent"
	"github.com/encgate/encgate/gpuagent/mooncake"
)

// nodes are the encoder nodes' gpuagents and the receiver they write into
// (one Mooncake TCP receiver standing in for a language-only server's ranks).
type nodes struct {
	agents  []*gpuagent.Agent
	regs    []*prometheus.Registry
	recv    *mooncake.Receiver
	clients []*http.Client // agent i's Unix socket, as its node's encoder reaches it
	dir     string         // the agents' sockets and the token file
	// tokenFile holds the bearer token every agent requires on /send; the
	// gateway's encoders[].agent_token_file names it.
	tokenFile string
	// bootToken is the gateway's bootstrap token (bootstrap.token_file is
	// bootTokenFile): the fleet phase's encoder registers under /t/<it>.
	bootToken, bootTokenFile string
}

func startNodes(n, receiverBytes int, log *zap.Logger) (*nodes, error) {
	recv, err := mooncake.NewReceiver(mooncake.ReceiverConfig{
		HandshakeListen: "127.0.0.1:0", DataListen: "127.0.0.1:0", AdvertiseHost: "127.0.0.1",
		Buffers: []int{receiverBytes},
	}, log)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "encgate-demo-")
	if err != nil {
		return nil, err
	}
	nd := &nodes{recv: recv, dir: dir, tokenFile: filepath.Join(dir, "agent.token"),
		bootToken: rand.Text() + rand.Text(), bootTokenFile: filepath.Join(dir, "bootstrap.token")}
	if err := recv.Start(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if err := os.WriteFile(nd.tokenFile, []byte(rand.Text()+"\n"), 0o600); err != nil {
		nd.close()
		return nil, err
	}
	if err := os.WriteFile(nd.bootTokenFile, []byte(nd.bootToken+"\n"), 0o600); err != nil {
		nd.close()
		return nil, err
	}
	for i := 0; i < n; i++ {
		cfg := gpuagent.DefaultConfig()
		cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
		cfg.Control.Socket = filepath.Join(dir, fmt.Sprintf("agent-%d.sock", i))
		cfg.Control.SocketMode = "0600"
		cfg.Control.TokenFile = nd.tokenFile
		reg := prometheus.NewRegistry()
		a, err := gpuagent.New(cfg, gpuagent.Deps{Log: log, Registry: reg})
		if err == nil {
			err = a.Start()
		}
		if err != nil {
			nd.close()
			return nil, err
		}
		nd.agents = append(nd.agents, a)
		nd.regs = append(nd.regs, reg)
		sock := cfg.Control.Socket
		nd.clients = append(nd.clients, &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, "unix", sock)
			},
		}})
	}
	return nd, nil
}

func (nd *nodes) agentURL(i int) string { return "http://" + nd.agents[i].Addr() }

// stager is the fake encoder i's Stage hook: it hands its node's agent the
// embedding, with content derived from the req_id, and then the part's ack
// frame, as an encoder wired to the agent does before it publishes the
// part's metadata.
func (nd *nodes) stager(i int) func(ctx context.Context, reqID string, tokens, dim, elem int) error {
	return func(ctx context.Context, reqID string, tokens, dim, elem int) error {
		url := fmt.Sprintf("http://agent/v1/stage?req_id=%s&tokens=%d&dim=%d&dtype=bfloat16", reqID, tokens, dim)
		if err := nd.post(ctx, i, url, embedding(reqID, tokens*dim*elem)); err != nil {
			return err
		}
		return nd.post(ctx, i, fmt.Sprintf("http://agent/v1/ack?req_id=%s", reqID), ackFrame(reqID, tokens, dim))
	}
}

// post sends body to agent i over its Unix socket.
func (nd *nodes) post(ctx context.Context, i int, url string, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	resp, err := nd.clients[i].Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("agent answered %d", resp.StatusCode)
	}
	return nil
}

// ackFrame is the demo's stand-in for the pickled EmbeddingData an sglang
// encoder stages as its ack frame: the agent treats it as opaque bytes.
func ackFrame(reqID string, tokens, dim int) []byte {
	return fmt.Appendf(nil, "EmbeddingData(req_id=%s, shape=[%d, %d], dtype=bfloat16)", reqID, tokens, dim)
}

// ackPort is a receiver rank's per-request PULL socket, bound before its
// /send as sglang's is; its port goes in the /send as embedding_port.
type ackPort struct {
	sock   zmq4.Socket
	cancel context.CancelFunc
	port   int
}

func listenAck(ctx context.Context) (*ackPort, error) {
	ctx, cancel := context.WithCancel(ctx)
	sock := zmq4.NewPull(ctx, zmq4.WithLogger(log.New(io.Discard, "", 0)))
	if err := sock.Listen("tcp://127.0.0.1:0"); err != nil {
		cancel()
		return nil, err
	}
	return &ackPort{sock: sock, cancel: cancel, port: sock.Addr().(*net.TCPAddr).Port}, nil
}

// wait returns the first message's frames, or an error when none comes
// within timeout.
func (p *ackPort) wait(timeout time.Duration) ([][]byte, error) {
	t := time.AfterFunc(timeout, p.cancel)
	defer t.Stop()
	for {
		msg, err := p.sock.Recv()
		if err == nil {
			return msg.Frames, nil
		}
		if errors.Is(err, context.Canceled) {
			return nil, fmt.Errorf("no ack within %v", timeout)
		}
		// Otherwise a peer closed its connection; keep waiting.
	}
}

func (p *ackPort) close() {
	p.cancel()
	_ = p.sock.Close()
}

// acks sums the agents' encgate_agent_acks_total by result.
func (nd *nodes) acks() map[string]float64 { return nd.sumBy("encgate_agent_acks_total", "result") }

// refused sums the agents' encgate_agent_unauthorized_total by door.
func (nd *nodes) refused() map[string]float64 {
	return nd.sumBy("encgate_agent_unauthorized_total", "door")
}

// sumBy sums the agents' counter name by the value of label.
func (nd *nodes) sumBy(name, label string) map[string]float64 {
	out := map[string]float64{}
	for _, reg := range nd.regs {
		mfs, _ := reg.Gather()
		for _, mf := range mfs {
			if mf.GetName() != name {
				continue
			}
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == label {
						out[l.GetValue()] += m.GetCounter().GetValue()
					}
				}
			}
		}
	}
	return out
}

func (nd *nodes) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for i, a := range nd.agents {
		_ = a.Shutdown(ctx)
		nd.clients[i].CloseIdleConnections()
	}
	_ = nd.recv.Close()
	_ = os.RemoveAll(nd.dir)
}

// transferred sums the agents' bytes moved and time spent moving them.
func (nd *nodes) transferred() (bytes, seconds float64) {
	for _, reg := range nd.regs {
		mfs, _ := reg.Gather()
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				switch mf.GetName() {
				case "encgate_agent_transfer_bytes_total":
					bytes += m.GetCounter().GetValue()
				case "encgate_agent_transfer_seconds":
					seconds += m.GetHistogram().GetSampleSum()
				}
			}
		}
	}
	return bytes, seconds
}

// embedding is the deterministic content of a part's embedding, so the
// receiver's bytes can be checked without keeping a copy.
func embedding(reqID string, n int) []byte {
	out := make([]byte, n)
	x := xxhash.Sum64String(reqID) | 1
	for i := range out {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		out[i] = byte(x)
	}
	return out
}

// landing hands out the receiver's buffer as sglang's EmbeddingPool does:
// each rank gets its own slot per part, and remembers what should land.
type landing struct {
	session string
	base    uint64
	size    uint64
	next    atomic.Uint64

	mu   sync.Mutex // protects sent
	sent map[uint64]landed
}

type landed struct {
	reqID string
	size  int
}

func newLanding(recv *mooncake.Receiver) *landing {
	b := recv.Buffers()[0]
	return &landing{session: recv.SessionID(), base: b.Addr, size: b.Length, sent: map[uint64]landed{}}
}

// alloc reserves size bytes; false when the buffer is full.
func (l *landing) alloc(size uint64) (uint64, bool) {
	end := l.next.Add(size)
	if end > l.size {
		return 0, false
	}
	return l.base + end - size, true
}

func (l *landing) record(reqID string, addr uint64, size int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.sent[addr] = landed{reqID, size}
}

// verify compares every recorded landing with its expected content.
func (l *landing) verify(recv *mooncake.Receiver) (ok, bad int, bytesOK int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for addr, w := range l.sent {
		got, err := recv.Bytes(addr, w.size)
		if err == nil && bytes.Equal(got, embedding(w.reqID, w.size)) {
			ok++
			bytesOK += int64(w.size)
		} else {
			bad++
		}
	}
	return ok, bad, bytesOK
}
