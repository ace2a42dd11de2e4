package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/encgate/encgate/fakeencoder"
)

// TestSIGTERMUnderLoadLosesNoRequest drains a real gateway process while
// requests are held in flight by the encoder and a steady stream keeps
// coming: /readyz turns 503 first while the listener still serves (for
// shutdown.delay), then new connections are refused, the held requests all
// finish 200 once the encoder answers, and the process exits 0. Every
// request the encoder saw was answered 200; every request that failed
// failed at the connection and never reached the encoder.
func TestSIGTERMUnderLoadLosesNoRequest(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a gateway process under load")
	}
	const held = 8
	arrived := make(chan string, held)
	release := make(chan struct{})
	enc := fakeencoder.New(fakeencoder.Options{Name: "enc-a", Mode: fakeencoder.ModeMooncake,
		EncodeHook: func(ctx context.Context, id string) {
			if strings.HasPrefix(id, "held-") {
				arrived <- id
				select {
				case <-release:
				case <-ctx.Done():
				}
			}
		}})
	if err := enc.Start("127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = enc.Close() })
	p := startGatewayProc(t, writeTemp(t, "gw.yaml", fmt.Sprintf(`listen: "127.0.0.1:0"
admin_listen: "127.0.0.1:0"
encoders:
  - {name: enc-a, url: %q}
shutdown:
  delay: 2s
  grace: 60s
log:
  level: info
`, enc.URL())))
	var once sync.Once
	releaseHook := func() { once.Do(func() { close(release) }) }
	t.Cleanup(releaseHook) // runs before the process is stopped if the test fails early

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16}}
	defer client.CloseIdleConnections()
	// seq orders what the test observes across its goroutines.
	var seq atomic.Int64
	type outcome struct {
		id    string
		start int64 // seq when the request was sent
		reply reply
	}

	heldDone := make(chan outcome, held)
	for i := 0; i < held; i++ {
		id := fmt.Sprintf("held-%d_local_part_0", i)
		go func() { heldDone <- outcome{id: id, reply: postTo(client, p.base+"/encode", encodeJSON(id))} }()
	}
	for i := 0; i < held; i++ {
		<-arrived
	}

	// The steady stream: 4 workers, each sending one /encode after another.
	stop := make(chan struct{})
	var mu sync.Mutex
	var steady []outcome
	var served atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				id := fmt.Sprintf("steady-%d-%d_local_part_0", w, i)
				o := outcome{id: id, start: seq.Add(1)}
				o.reply = postTo(client, p.base+"/encode", encodeJSON(id))
				mu.Lock()
				steady = append(steady, o)
				mu.Unlock()
				if o.reply.err == nil && o.reply.status == 200 {
					served.Add(1)
				} else {
					time.Sleep(5 * time.Millisecond) // pace a client that meets a closed listener
				}
			}
		}()
	}
	poll(t, "the steady stream to be served", func() bool { return served.Load() >= 50 })

	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	admin := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	poll(t, "/readyz to answer 503", func() bool {
		status, _ := getBody(admin, p.admin+"/readyz")
		return status == http.StatusServiceUnavailable
	})
	notReady := seq.Add(1)
	poll(t, "new connections to be refused", func() bool {
		c, err := net.Dial("tcp", strings.TrimPrefix(p.base, "http://"))
		if err != nil {
			return errors.Is(err, syscall.ECONNREFUSED)
		}
		c.Close()
		return false
	})
	refused := seq.Add(1)

	// The listener is closed, the admin listener still answers, and the
	// held requests are still in flight: the process waits for them.
	if status, body := getBody(admin, p.admin+"/readyz"); status != http.StatusServiceUnavailable {
		t.Fatalf("/readyz while draining: %d %s", status, body)
	}
	select {
	case o := <-heldDone:
		t.Fatalf("a held /encode ended before the encoder answered: %+v", o)
	case <-p.exited:
		t.Fatalf("the process exited with requests in flight:\n%s", p.log())
	default:
	}

	releaseHook()
	for i := 0; i < held; i++ {
		o := <-heldDone
		if o.reply.err != nil || o.reply.status != 200 || !strings.Contains(o.reply.body, `"req_id":"`+o.id+`"`) {
			t.Errorf("held %s: %d %v %s", o.id, o.reply.status, o.reply.err, o.reply.body)
		}
	}
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		t.Fatalf("the process did not exit after its last request:\n%s", p.log())
	}
	if code := p.cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("exit code %d, want 0:\n%s", code, p.log())
	}
	close(stop)
	wg.Wait()

	// Nothing accepted was lost: the encoder saw exactly the requests that
	// were answered 200, and every failure was at the connection.
	seen := enc.Stats().ReqIDs
	ok, failed, servedAfterNotReady := 0, 0, 0
	firstFailure := int64(-1)
	for _, o := range steady {
		got := seen[o.id]["/encode"]
		switch {
		case o.reply.err == nil && o.reply.status == 200:
			ok++
			if got != 1 {
				t.Errorf("%s answered 200 but the encoder saw it %d times", o.id, got)
			}
			if o.start > notReady && o.start < refused {
				servedAfterNotReady++
			}
		case o.reply.err != nil:
			failed++
			if got != 0 {
				t.Errorf("%s reached the encoder but its caller got %v", o.id, o.reply.err)
			}
			if !connectionLevel(o.reply.err) {
				t.Errorf("%s failed with %v, not at the connection", o.id, o.reply.err)
			}
			if firstFailure < 0 || o.start < firstFailure {
				firstFailure = o.start
			}
		default:
			t.Errorf("%s answered %d %s", o.id, o.reply.status, o.reply.body)
		}
	}
	if total := enc.Stats().Routes["/encode"]; total != int64(held+ok) {
		t.Errorf("the encoder received %d /encode; %d held and %d steady were answered 200", total, held, ok)
	}
	if servedAfterNotReady == 0 {
		t.Errorf("no request was served between /readyz turning 503 and the listener closing")
	}
	if firstFailure >= 0 && firstFailure < notReady {
		t.Errorf("a request failed before the gateway went not-ready")
	}
	t.Logf("steady stream: %d served (%d after /readyz turned 503), %d refused at the connection; %d held, all served",
		ok, servedAfterNotReady, failed, held)

	// The log tells the same order.
	for _, msg := range []string{"draining: not ready", "draining: listener closed, finishing requests in flight", "stopped"} {
		if _, found := p.logLine(msg, 0); !found {
			t.Errorf("no %q log line:\n%s", msg, p.log())
		}
	}
}

func encodeJSON(id string) string {
	return fmt.Sprintf(`{"req_id":%q,"mm_items":["https://example.com/a.png"],"modality":"IMAGE","num_parts":1,"part_idx":0,"prefill_host":"10.0.0.1","embedding_port":null}`, id)
}

// connectionLevel reports whether err is a failure to connect, or a
// connection closed before any answer: what a client meets at a gateway
// that stopped accepting.
func connectionLevel(err error) bool {
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.EPIPE) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		strings.Contains(err.Error(), "server closed idle connection")
}
