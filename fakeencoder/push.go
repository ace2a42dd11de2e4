package fakeencoder

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
	"github.com/valyala/fastjson"
)

// ZMQ pushes (Options.PushFrames, zmq mode). sglang's encoder pushes each
// part to the receiver over ZMQ PUSH (protocol reference §6): to every URL
// registered through /scheduler_receive_url (send_with_url), or to
// prefill_host:embedding_port when /encode names a port. A success is two
// frames (the pickled EmbeddingData without its tensor, then the tensor's
// bytes), a failed encode one frame (the EmbeddingData carrying error_msg
// and error_code). The fake cannot build torch pickles, so its frame 0 is a
// small JSON object instead:
//
//	{"req_id":R,"num_parts":N,"part_idx":K,"error_msg":null|"...","error_code":null|400}
//
// and frame 1 is embedding_size zero bytes.
//
// Each push dials its own connection, as sglang opens a PUSH socket per
// send, and speaks ZMTP through go-zeromq/zmq4's connection API (zmq4.Open,
// Conn.SendMsg) the way gpuagent/ack.go does: every step has a deadline, no
// goroutine is started, and Close cuts a push short.

// The kinds of pushed message, as listed in Stats.Pushes.
const (
	PushEmbedding = "embedding" // two frames: metadata, embedding bytes
	PushError     = "error"     // one frame: metadata with error_msg and error_code
)

// Push timeouts: the TCP connect, the whole push (connect, ZMTP handshake,
// frames; also at most SendTimeout), and the wait after the frames for the
// receiver to close its side (libzmq does once it has read them).
const (
	pushConnectTimeout = 2 * time.Second
	pushTimeout        = 5 * time.Second
	pushLinger         = time.Second
)

// zmqMessage is one message to push.
type zmqMessage struct {
	kind   string // PushEmbedding or PushError
	frames [][]byte
}

// frameHeader is frame 0 of req's message: the JSON stand-in for the
// pickled EmbeddingData. errMsg and code are used when isErr.
func frameHeader(req *request, isErr bool, errMsg string, code int) []byte {
	b := append([]byte(`{"req_id":`), orNull(req.rawID)...)
	b = append(b, `,"num_parts":`...)
	b = appendField(b, req.field("num_parts"))
	b = append(b, `,"part_idx":`...)
	b = appendField(b, req.field("part_idx"))
	if !isErr {
		return append(b, `,"error_msg":null,"error_code":null}`...)
	}
	b = append(b, `,"error_msg":`...)
	b = appendJSONString(b, errMsg)
	b = append(b, `,"error_code":`...)
	b = strconv.AppendInt(b, int64(code), 10)
	return append(b, '}')
}

// orNull is raw, or null when it is empty.
func orNull(raw []byte) []byte {
	if len(raw) == 0 {
		return nullJSON
	}
	return raw
}

// appendField appends v as JSON, null when absent.
func appendField(b []byte, v *fastjson.Value) []byte {
	if v == nil {
		return append(b, nullJSON...)
	}
	return marshalValue(b, v)
}

// embeddingMessage is req's two-frame success message for an embedding of
// m's size.
func embeddingMessage(req *request, m metaEntry) *zmqMessage {
	return &zmqMessage{kind: PushEmbedding, frames: [][]byte{frameHeader(req, false, "", 0), make([]byte, m.size)}}
}

// errorMessage is req's one-frame error message for failure f.
func errorMessage(req *request, f *encodeFailure) *zmqMessage {
	return &zmqMessage{kind: PushError, frames: [][]byte{frameHeader(req, true, f.msg, f.status)}}
}

// portDestinations are the "prefill_host:port" destinations of an /encode
// that names embedding_port: one per element of a list (zmq_to_scheduler's
// legacy path), else the one port (zmq_to_tokenizer).
func portDestinations(req *request) []string {
	host, port := req.field("prefill_host"), req.field("embedding_port")
	if port.Type() != fastjson.TypeArray {
		return []string{destination(host, port)}
	}
	var dests []string
	for _, p := range port.GetArray() {
		dests = append(dests, destination(host, p))
	}
	return dests
}

// pushesErrorToPort reports whether a failed encode that names
// embedding_port pushes its error frame there: NEW does for both zmq
// backends; GEN0 only for zmq_to_scheduler's list of ports (its
// zmq_to_tokenizer error path answers without pushing).
func (e *Encoder) pushesErrorToPort(req *request) bool {
	return !e.gen0() || req.field("embedding_port").Type() == fastjson.TypeArray
}

// pushTo pushes msg to every destination at once and waits for them all
// (sglang's asyncio.gather over the ports).
func (e *Encoder) pushTo(id string, dests []string, msg *zmqMessage) {
	var wg sync.WaitGroup
	for _, d := range dests {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.push(id, d, msg)
		}()
	}
	wg.Wait()
}

// pushRegisteredLocked is sglang's send_with_url: it pushes msg to each URL
// registered for st as it is registered, until receive_count URLs got it,
// st's release was requested or SendTimeout passed (ctx ending or Close
// stop the wait too), then waits for the pushes it started. e.mu is held
// on entry and on return.
func (e *Encoder) pushRegisteredLocked(ctx context.Context, st *reqState, msg *zmqMessage) waitResult {
	sent := map[string]bool{}
	var wg sync.WaitGroup
	res := e.waitLocked(ctx, RouteEncode, st.id, e.opts.SendTimeout, func() bool {
		if st.releaseRequested {
			return true
		}
		reg := e.recv[st.id]
		if reg == nil {
			return false
		}
		for key, url := range reg.urls {
			if !sent[key] {
				sent[key] = true
				wg.Add(1)
				go func() {
					defer wg.Done()
					e.push(st.id, url, msg)
				}()
			}
		}
		return reg.count >= 0 && int64(len(sent)) >= reg.count
	})
	e.mu.Unlock()
	wg.Wait()
	e.mu.Lock()
	return res
}

// push pushes msg to url ("host:port", optionally "tcp://host:port") and
// records the outcome under "id|url" in Stats.Pushes or Stats.PushFailures.
// Close cuts it short.
func (e *Encoder) push(id, url string, msg *zmqMessage) {
	err := e.pushFrames(e.ctx, strings.TrimPrefix(url, "tcp://"), msg.frames)
	key := id + "|" + url
	e.mu.Lock()
	defer e.mu.Unlock()
	if err != nil {
		e.stats.pushFailed(key)
		return
	}
	e.stats.pushed(key, msg.kind)
}

// pushFrames sends frames as one ZMQ message to the PULL socket at addr: a
// TCP connect within pushConnectTimeout, the ZMTP 3 greeting and NULL
// handshake as a PUSH peer and the frames, all within min(SendTimeout,
// pushTimeout); then it half-closes and waits up to pushLinger for the
// receiver to close, so that a push counted as done has been read. A
// receiver that breaks the connection instead is an error.
func (e *Encoder) pushFrames(ctx context.Context, addr string, frames [][]byte) error {
	d := net.Dialer{Timeout: pushConnectTimeout}
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(min(e.opts.SendTimeout, pushTimeout)))
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	zc, err := zmq4.Open(conn, null.Security(), zmq4.Push, nil, false, nil)
	if err != nil {
		return fmt.Errorf("ZMTP handshake: %w", err)
	}
	if err := zc.SendMsg(zmq4.NewMsgFrom(frames...)); err != nil {
		return fmt.Errorf("sending: %w", err)
	}
	_ = conn.SetDeadline(time.Now().Add(pushLinger))
	if ctx.Err() != nil {
		return nil // the frames are written; Close does not wait for the reader
	}
	if tc, ok := conn.(*net.TCPConn); ok {
		_ = tc.CloseWrite()
	}
	_, err = io.Copy(io.Discard, conn) // until the receiver closes (nil), or the linger passes
	var ne net.Error
	if err != nil && !(errors.As(err, &ne) && ne.Timeout()) {
		return fmt.Errorf("the receiver broke the connection after the frames were written: %w", err)
	}
	return nil
}
