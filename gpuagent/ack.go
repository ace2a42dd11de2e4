package gpuagent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/sglang"
)

// The completion ack. sglang's receiver rank binds a PULL socket per
// request, sends its port as /send's embedding_port, and marks a part ready
// only when a single-frame message arrives there: the encoder's pickled
// EmbeddingData without the tensor (protocol reference §4 step 6, §6
// "Mooncake"). The pickle may hold torch objects, so the agent never builds
// one: the encoder stages its ready-made frame with POST /v1/ack, and the
// agent pushes those bytes after each confirmed transfer.
//
// The push uses go-zeromq/zmq4's connection API (zmq4.Open, Conn.SendMsg)
// over a connection the agent dials itself, rather than a zmq4 Socket: the
// dial goes through the allow_networks check and every step has a deadline
// (a Socket's Dial has none on the ZMTP handshake, retries a refused
// connect with sleeps nothing can cut short, and uses its own dialer), and
// no goroutine is started, so none outlives an ack.

// ackAnswer is the 200 body of POST /v1/ack.
type ackAnswer struct {
	ReqID         string `json:"req_id"`
	AckFrameBytes int    `json:"ack_frame_bytes"`
}

// serveAck is POST /v1/ack?req_id=R with the raw frame as body, on the Unix
// socket: it stages R's ack frame, before or after R's embedding, for the
// process that staged (or will stage) R alone.
func (a *Agent) serveAck(w http.ResponseWriter, r *http.Request) {
	conn, _ := stagerOf(r)
	id, err := parseAckQuery(r.URL.RawQuery)
	if err != nil {
		writeEnvelope(w, http.StatusBadRequest, err.Error(), queryReqID(r.URL.RawQuery))
		return
	}
	limit := int64(a.cfg.Ack.MaxFrameBytes)
	tooBig := func() {
		writeEnvelope(w, http.StatusRequestEntityTooLarge, fmt.Sprintf(
			"encgate: ack frame for req_id=%s is over ack.max_frame_bytes (%s)", id, a.cfg.Ack.MaxFrameBytes), id)
	}
	if r.ContentLength > limit {
		tooBig()
		return
	}
	frame, err := io.ReadAll(a.body(w, http.MaxBytesReader(w, r.Body, limit)))
	if err != nil {
		var mbe *http.MaxBytesError
		switch {
		case errors.As(err, &mbe):
			tooBig()
		case stalled(err):
			writeEnvelope(w, http.StatusRequestTimeout, fmt.Sprintf(
				"encgate: the ack frame for req_id=%s sent nothing for control.body_timeout (%s)", id, a.cfg.Control.BodyTimeout), id)
		default:
			writeEnvelope(w, http.StatusBadRequest, fmt.Sprintf("encgate: reading the ack frame for req_id=%s: %v", id, err), id)
		}
		return
	}
	if len(frame) == 0 {
		writeEnvelope(w, http.StatusBadRequest, fmt.Sprintf(
			"encgate: empty ack frame for req_id=%s (the body must be the encoder's pickled EmbeddingData)", id), id)
		return
	}
	same, err := a.store.putAck(id, frame, a.clk.Now(), conn.peer)
	var owned *ownedError
	switch {
	case errors.As(err, &owned):
		a.ownerConflict(w, id, conn.peer, owned.owner)
		return
	case errors.Is(err, errExists):
		writeEnvelope(w, http.StatusConflict, fmt.Sprintf("encgate: req_id=%s already has a different ack frame", id), id)
		return
	case errors.Is(err, errCapacity):
		held, _ := a.store.usage()
		writeEnvelope(w, http.StatusInsufficientStorage, fmt.Sprintf(
			"encgate: staging an ack frame of %d bytes for req_id=%s would exceed staging.capacity_bytes (%s; %d bytes held)",
			len(frame), id, a.cfg.Staging.CapacityBytes, held), id)
		return
	}
	if c := a.log.Check(zap.DebugLevel, "ack frame staged"); c != nil {
		c.Write(zap.String("req_id", id), zap.Int("bytes", len(frame)), zap.Bool("repeat", same))
	}
	writeJSON(w, http.StatusOK, ackAnswer{ReqID: id, AckFrameBytes: len(frame)})
}

// parseAckQuery reads req_id, the only key of a /v1/ack query. Errors are
// *badRequest.
func parseAckQuery(raw string) (string, error) {
	q, err := url.ParseQuery(raw)
	if err != nil {
		return "", badf("encgate: invalid ack query: %v", err)
	}
	for k, v := range q {
		if k != "req_id" {
			return "", badf("encgate: unknown ack parameter %q (only req_id)", k)
		}
		if len(v) != 1 {
			return "", badf("encgate: ack parameter %q given %d times", k, len(v))
		}
	}
	id := q.Get("req_id")
	if id == "" {
		return "", badf("missing or invalid req_id")
	}
	return id, nil
}

// ackFrameFor returns the frame to push after req's transfer: nil when
// ack.mode is off or (optional) none is staged. In required mode a missing
// frame refuses the /send before any byte moves.
func (a *Agent) ackFrameFor(req sglang.Send) ([]byte, *sendError) {
	if a.cfg.Ack.Mode == AckOff {
		return nil, nil
	}
	frame := a.store.ackFrame(req.ReqID)
	if frame == nil && a.cfg.Ack.Mode == AckRequired {
		a.log.Warn("refusing a /send with no ack frame staged (ack.mode is required)", zap.String("req_id", req.ReqID))
		return nil, &sendError{status: http.StatusInternalServerError, msg: fmt.Sprintf(
			"encgate: no ack frame staged for req_id=%s and ack.mode is required: the encoder must POST /v1/ack?req_id=%s "+
				"with its ack frame before the part's metadata is published; nothing was sent", req.ReqID, req.ReqID)}
	}
	return frame, nil
}

// ackEndpoint is the receiver rank's PULL socket, host:port.
func ackEndpoint(req sglang.Send) string {
	return net.JoinHostPort(req.PrefillHost, strconv.Itoa(req.EmbeddingPort))
}

// ack pushes frame to req's destination after its transfer was confirmed,
// once per destination of e. A nil frame, or a destination already acked,
// is skipped.
func (a *Agent) ack(ctx context.Context, e *entry, req sglang.Send, frame []byte, nbytes int) *sendError {
	if frame == nil || !a.store.claimAck(e, req.Dest()) {
		a.metrics.acks.WithLabelValues(ackSkipped).Inc()
		return nil
	}
	endpoint := ackEndpoint(req)
	start := a.clk.Now()
	err := a.pushAck(ctx, endpoint, frame)
	a.metrics.ackTime.Observe(a.clk.Now().Sub(start).Seconds())
	if err != nil {
		a.metrics.acks.WithLabelValues(ackFailed).Inc()
		return &sendError{status: http.StatusInternalServerError, msg: fmt.Sprintf(
			"encgate: %d bytes for %s reached session=%s, but the ack to tcp://%s (prefill_host:embedding_port) failed, "+sglang.ReceiverNotTold+": %v",
			nbytes, req.ReqID, req.SessionID, endpoint, err)}
	}
	a.metrics.acks.WithLabelValues(ackSent).Inc()
	if c := a.log.Check(zap.DebugLevel, "acked"); c != nil {
		c.Write(zap.String("req_id", req.ReqID), zap.String("endpoint", endpoint), zap.Int("frame_bytes", len(frame)))
	}
	return nil
}

// pushAck sends frame as one ZMQ message to the PULL socket at addr: a TCP
// connect within ack.connect_timeout (checked against allow_networks), the
// ZMTP 3 greeting and NULL handshake as a PUSH peer, the frame, all within
// ack.send_timeout; then it closes its side and waits up to ack.linger for
// the receiver to close, which libzmq does once it has read the frame. ctx
// ending cuts every step short (the linger then counts as done: the frame
// was written).
func (a *Agent) pushAck(ctx context.Context, addr string, frame []byte) error {
	cfg := a.cfg.Ack
	conn, err := a.dialer(cfg.ConnectTimeout.D()).DialContext(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close()
	// Network deadlines are wall-clock times whatever clock the agent has.
	deadline := time.Now().Add(cfg.SendTimeout.D())
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	_ = conn.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	cut := func(step string, err error) error {
		if cerr := context.Cause(ctx); cerr != nil {
			return fmt.Errorf("%s cut short: %w", step, cerr)
		}
		return fmt.Errorf("%s: %w", step, err)
	}
	zc, err := zmq4.Open(conn, null.Security(), zmq4.Push, nil, false, nil)
	if err != nil {
		return cut("ZMTP handshake", err)
	}
	if err := zc.SendMsg(zmq4.NewMsg(frame)); err != nil {
		return cut("sending the frame", err)
	}
	// The frame is written. Linger, unless that is off or ctx has ended
	// (ctx ending during the linger ends it too: the AfterFunc's deadline
	// then wins, whichever order the two deadlines were set in).
	linger := cfg.Linger.D()
	if linger <= 0 {
		return nil
	}
	_ = conn.SetDeadline(time.Now().Add(linger))
	if ctx.Err() != nil {
		return nil
	}
	if tc, ok := conn.(*net.TCPConn); ok {
		_ = tc.CloseWrite()
	}
	_, err = io.Copy(io.Discard, conn) // until the receiver closes (nil), or linger passes
	var ne net.Error
	if err != nil && !(errors.As(err, &ne) && ne.Timeout()) {
		return fmt.Errorf("the receiver broke the connection after the frame was written, so it may not have read it: %w", err)
	}
	if err != nil {
		a.log.Debug("the ack's receiver did not close within ack.linger; the frame was written", zap.String("endpoint", addr))
	}
	return nil
}
