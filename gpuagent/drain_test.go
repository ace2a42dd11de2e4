package gpuagent

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/encgate/encgate/internal/configfile"
)

// signalOn replaces a's logger (before Start) with one that closes the
// returned channel the first time it logs msg.
func signalOn(a *Agent, msg string) <-chan struct{} {
	ch := make(chan struct{})
	var once sync.Once
	core := zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.AddSync(io.Discard), zap.InfoLevel)
	a.log = zap.New(core, zap.Hooks(func(e zapcore.Entry) error {
		if e.Message == msg {
			once.Do(func() { close(ch) })
		}
		return nil
	}))
	return ch
}

// drainSetup stages a part with its ack and starts its /send towards a sink
// that holds the ack's connection, so the /send stays in flight (in the
// ack's linger) until the sink is released.
func drainSetup(t *testing.T) (a *testAgent, stopped <-chan struct{}, sink interface{ Release() }, answer <-chan reply, data []byte) {
	t.Helper()
	recv := startReceiver(t)
	a = startAgent(t, func(c *Config) { c.Ack.Linger = configfile.Duration(time.Minute) }, nil, func(ag *Agent) {
		stopped = signalOn(ag, "stopped accepting; finishing in-flight requests")
	})
	data = a.stageAcked(t, "drain", 4, 4)
	s := startAckSink(t, true)
	ans := make(chan reply, 1)
	go func() {
		ans <- a.sendNoFatal(sendReq{id: "drain", port: s.Port(), session: recv.SessionID(), addr: base(t, recv), count: 1})
	}()
	<-s.Messages() // the ack arrived: the /send now waits for the sink to close
	if got, _ := recv.Bytes(base(t, recv), len(data)); !bytes.Equal(got, data) {
		t.Fatal("bytes not in place")
	}
	return a, stopped, s, ans, data
}

// sendNoFatal is send for a goroutine other than the test's: a transport
// error comes back as status 0 with the error as body.
func (a *testAgent) sendNoFatal(s sendReq) reply {
	req, err := http.NewRequest(http.MethodPost, a.base+"/send", bytes.NewReader([]byte(s.body())))
	if err != nil {
		return reply{body: err.Error()}
	}
	req.Header.Set("Authorization", "Bearer "+testToken)
	resp, err := client.Do(req)
	if err != nil {
		return reply{body: err.Error()}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return reply{status: resp.StatusCode, ctype: resp.Header.Get("Content-Type"), body: string(b)}
}

func TestShutdownDrainsAnInFlightSend(t *testing.T) {
	a, stopped, sink, answer, _ := drainSetup(t)
	shut := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		shut <- a.Shutdown(ctx)
	}()
	<-stopped
	// Not ready (the admin listener stays up to say so), and not accepting.
	expect(t, do(t, http.MethodGet, a.admin+"/readyz", nil), http.StatusServiceUnavailable, "not ready\n")
	if c, err := net.Dial("tcp", a.Addr()); err == nil {
		c.Close()
		t.Fatal("the control listener still accepts while draining")
	}
	select {
	case r := <-answer:
		t.Fatalf("the /send was answered while its ack was held: %+v", r)
	case err := <-shut:
		t.Fatalf("Shutdown returned while a /send was in flight: %v", err)
	default:
	}
	sink.Release()
	expect(t, <-answer, http.StatusOK, "null")
	if err := <-shut; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
}

func TestShutdownPastGraceCutsTheSend(t *testing.T) {
	a, stopped, _, answer, _ := drainSetup(t)
	ctx, cancel := context.WithCancel(context.Background())
	shut := make(chan error, 1)
	go func() { shut <- a.Shutdown(ctx) }()
	<-stopped
	cancel() // shutdown.grace is over
	if err := <-shut; !errors.Is(err, context.Canceled) {
		t.Fatalf("Shutdown = %v, want the grace's end", err)
	}
	// The connection was closed under the /send: no answer reached it.
	if r := <-answer; r.status != 0 {
		t.Fatalf("the cut /send was answered %+v", r)
	}
	// The cut /send ends soon (its context is cancelled), and frees what
	// it still used.
	a.sends.Wait()
	if held, n := a.store.usage(); held != 0 || n != 0 {
		t.Fatalf("held %d bytes in %d entries after the cut /send returned", held, n)
	}
}
