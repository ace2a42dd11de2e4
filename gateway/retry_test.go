package gateway

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/upstream"
)

func metadataCalls(e *fakeencoder.Encoder, id string) int64 {
	return e.Stats().ReqIDs[id]["/scheduler_receive_meta_data"]
}

func TestMetadataNotReadyIsRetriedUntilReady(t *testing.T) {
	encs := startFakes(t, 1, func(_ int, o *fakeencoder.Options) { o.Faults.Leading504s = 2 })
	g := startGateway(t, fakeURLs(encs), nil)
	const id = "lag_local_part_0"
	if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 || a.header.Get("X-Encgate-Attempts") != "1" {
		t.Fatalf("encode %d attempts=%q", a.status, a.header.Get("X-Encgate-Attempts"))
	}
	a := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id))
	if a.status != 200 || a.header.Get("X-Encgate-Attempts") != "3" {
		t.Fatalf("metadata %d %s attempts=%q", a.status, a.body, a.header.Get("X-Encgate-Attempts"))
	}
	if got := metadataCalls(encs[0], id); got != 3 {
		t.Fatalf("encoder got %d metadata calls, want 3", got)
	}
	if got := metricValue(t, g, "encgate_retries_total"); got != 2 {
		t.Errorf("encgate_retries_total = %v, want 2", got)
	}
}

func TestMetadataMaxAttemptsReturnsTheEncodersAnswer(t *testing.T) {
	encs := startFakes(t, 1, func(_ int, o *fakeencoder.Options) { o.Faults.Leading504s = 5 })
	g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Retry.Metadata.MaxAttempts = 2 })
	const id = "lag2_local_part_0"
	post(t, g.base+"/encode", encodeBody(id))
	a := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id))
	want := `{"status":"error","message":"encode metadata not ready","req_id":"lag2_local_part_0"}`
	if a.status != 504 || a.body != want || a.header.Get("X-Encgate-Attempts") != "2" {
		t.Fatalf("got %d %s attempts=%q", a.status, a.body, a.header.Get("X-Encgate-Attempts"))
	}
	if got := metadataCalls(encs[0], id); got != 2 {
		t.Fatalf("encoder got %d metadata calls, want 2", got)
	}
}

func TestRetryBudgetExhaustedReturnsTheLastAnswer(t *testing.T) {
	encs := startFakes(t, 1, func(_ int, o *fakeencoder.Options) { o.Faults.Leading504s = 5 })
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Retry.Budget.Ratio, c.Retry.Budget.MinPerSecond = 0, 0
	})
	const id = "budget_local_part_0"
	post(t, g.base+"/encode", encodeBody(id))
	a := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id))
	if a.status != 504 || a.header.Get("X-Encgate-Attempts") != "1" {
		t.Fatalf("got %d attempts=%q", a.status, a.header.Get("X-Encgate-Attempts"))
	}
	if got := metricValue(t, g, "encgate_retry_budget_exhausted_total"); got != 1 {
		t.Errorf("budget exhausted = %v, want 1", got)
	}
}

// An encoder that answers 500 to everything opens after
// consecutive_failures and receives no /encode after that.
func TestFailingEncoderOpensAndStopsGettingEncodes(t *testing.T) {
	encs := startFakes(t, 2, func(i int, o *fakeencoder.Options) {
		if i == 0 {
			o.Faults.FailureRate, o.Faults.FailStatus = 1, 500
			o.Faults.FailMessage = "Internal encoding error: CUDA error"
		}
	})
	g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Breaker.ConsecutiveFailures = 3 })
	bad := g.Pool().Encoders()[0]
	failures := 0
	for i := 0; i < 60; i++ {
		a := post(t, g.base+"/encode", encodeBody(fmt.Sprintf("cb-%d_local_part_0", i)))
		if a.status == 500 {
			failures++
		}
	}
	if failures != 3 {
		t.Fatalf("callers saw %d failures, want exactly 3 before the breaker opened", failures)
	}
	if got := encs[0].Stats().Routes["/encode"]; got != 3 {
		t.Fatalf("the failing encoder received %d /encodes, want 3", got)
	}
	if bad.Breaker.State() != upstream.BreakerOpen || bad.Usable() {
		t.Fatalf("breaker %v, usable %v", bad.Breaker.State(), bad.Usable())
	}
	if got := encs[1].Stats().Routes["/encode"]; got != 57 {
		t.Fatalf("the healthy encoder received %d /encodes, want 57", got)
	}
	if !strings.Contains(scrape(t, g), `encgate_breaker_state{encoder="enc-0"} 2`) {
		t.Error("encgate_breaker_state for enc-0 is not 2 (open)")
	}
}

func TestFourHundredsNeverOpenABreaker(t *testing.T) {
	encs := startFakes(t, 2, nil)
	g := startGateway(t, fakeURLs(encs), nil)
	for i := 0; i < 200; i++ {
		a := post(t, g.base+"/encode", fmt.Sprintf(`{"req_id":"bad-%d","mm_items":["x"],"num_parts":1,"part_idx":0}`, i))
		if a.status != 400 {
			t.Fatalf("request %d: %d %s", i, a.status, a.body)
		}
	}
	for _, e := range g.Pool().Encoders() {
		if e.Breaker.State() != upstream.BreakerClosed || e.Breaker.Counts().TotalFailures != 0 {
			t.Fatalf("%s: breaker %v, counts %+v", e.Name, e.Breaker.State(), e.Breaker.Counts())
		}
	}
	s := scrape(t, g)
	for _, name := range []string{"enc-0", "enc-1"} {
		if !strings.Contains(s, fmt.Sprintf(`encgate_breaker_state{encoder=%q} 0`, name)) {
			t.Errorf("encgate_breaker_state for %s is not 0", name)
		}
	}
}

func TestEncodeRetriesOnTheNextEncoderWhenNothingWasDelivered(t *testing.T) {
	encs := startFakes(t, 1, nil)
	dead := "http://" + deadAddr(t)
	// Find a req_id whose rendezvous owner is the dead encoder.
	g := startGateway(t, []string{dead, encs[0].URL()}, nil)
	var id string
	for i := 0; id == ""; i++ {
		cand := fmt.Sprintf("move-%d_local_part_0", i)
		if owner, _ := g.Pool().Owner(cand); owner.Name == "enc-0" {
			id = cand
		}
	}
	a := post(t, g.base+"/encode", encodeBody(id))
	if a.status != 200 || a.header.Get("X-Encgate-Attempts") != "2" || a.header.Get("X-Encgate-Encoder") != "enc-1" {
		t.Fatalf("got %d attempts=%q encoder=%q %s", a.status, a.header.Get("X-Encgate-Attempts"), a.header.Get("X-Encgate-Encoder"), a.body)
	}
	if pin, _ := g.Pool().Pin(id); pin.Encoder != "enc-1" {
		t.Fatalf("pinned to %q, want the encoder that took it", pin.Encoder)
	}
	if m := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id)); m.status != 200 {
		t.Fatalf("follow-up after re-pin: %d %s", m.status, m.body)
	}
}

func TestFollowUpToAnOpenEncoderFailsFast(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), nil)
	const id = "stuck_local_part_0"
	post(t, g.base+"/encode", encodeBody(id))
	g.Pool().Encoders()[0].SetUsable(false)
	a := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id))
	if a.status != 503 || !strings.Contains(a.body, "encoder enc-0 holding this req_id is disabled") {
		t.Fatalf("got %d %s", a.status, a.body)
	}
	if got := metadataCalls(encs[0], id); got != 0 {
		t.Fatalf("the encoder got %d metadata calls", got)
	}
}

func TestSendIsNotRetriedAfterATimeout(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Retry.Send.PerTryTimeout = configfile.Duration(200 * time.Millisecond)
		c.Retry.Send.MaxAttempts = 5
	})
	const id = "hang_local_part_0"
	post(t, g.base+"/encode", encodeBody(id))
	f := encs[0].Faults()
	f.Hang = true
	encs[0].SetFaults(f)
	a := post(t, g.base+"/send", tpSend(id, 0, 2))
	if a.status != 504 || a.header.Get("X-Encgate-Attempts") != "1" {
		t.Fatalf("got %d attempts=%q %s", a.status, a.header.Get("X-Encgate-Attempts"), a.body)
	}
	if got := encs[0].Stats().Routes["/send"]; got != 1 {
		t.Fatalf("the encoder received %d /sends", got)
	}
}

// A metadata pull being retried stops when its part's /encode fails
// meanwhile, and answers with that failure.
func TestMetadataRetryStopsWhenTheEncodeFails(t *testing.T) {
	encs := startFakes(t, 1, func(_ int, o *fakeencoder.Options) { o.Faults.Leading504s = 100 })
	clk := clock.NewFake(time.Now())
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Encoders = []upstream.EncoderConfig{{Name: "enc-0", URL: encs[0].URL()}}
	cfg.Affinity.UnknownWait = 0
	s, err := New(cfg, Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry(), Clock: clk,
		Rand: func() float64 { return 0.5 }})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Shutdown(context.Background()) })
	base := "http://" + s.Addr()
	const id = "doomed_local_part_0"
	sleeping := clk.TimerCreated()
	got := make(chan answer, 1)
	go func() { got <- post(t, base+"/scheduler_receive_meta_data", metaBody(id)) }()
	eventually(t, "the first metadata attempt", func() bool { return metadataCalls(encs[0], id) == 1 })
	<-sleeping // parked in its backoff before attempt 2
	failing := fmt.Sprintf(`{"req_id":%q,"mm_items":["fail:400:Error while loading data x"],"modality":"IMAGE","num_parts":1,"part_idx":0,"prefill_host":"h","embedding_port":null}`, id)
	if a := post(t, base+"/encode", failing); a.status != 400 {
		t.Fatalf("encode %d %s", a.status, a.body)
	}
	clk.Advance(time.Minute)
	a := <-got
	if a.status != 400 || !strings.Contains(a.body, "Error while loading data x") || a.header.Get("X-Encgate-Attempts") != "1" {
		t.Fatalf("got %d attempts=%q %s", a.status, a.header.Get("X-Encgate-Attempts"), a.body)
	}
	if n := metadataCalls(encs[0], id); n != 1 {
		t.Fatalf("the encoder got %d metadata pulls, want 1", n)
	}
}

// A pull the encoder holds past its per-try timeout goes on waiting
// whatever the retry budget: thousands held in a slow encode must not get
// 504 because each try ran out (bench/held.sh found 200 of 300 cut so).
func TestHeldPullsDoNotSpendTheRetryBudget(t *testing.T) {
	encs := startFakes(t, 1, func(_ int, o *fakeencoder.Options) { o.Faults.MetadataDelay = 900 * time.Millisecond })
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Retry.Budget.Ratio, c.Retry.Budget.MinPerSecond = 0, 0
		c.Retry.Metadata.PerTryTimeout = configfile.Duration(200 * time.Millisecond)
		c.Retry.Metadata.InitialBackoff = configfile.Duration(time.Millisecond)
		c.Retry.Metadata.MaxBackoff = configfile.Duration(time.Millisecond)
	})
	const id = "held_local_part_0"
	encoded := make(chan int, 1)
	go func() { // /encode answers once the metadata is out, 900ms on
		resp, err := client.Post(g.base+"/encode", "application/json", strings.NewReader(encodeBody(id)))
		if err != nil {
			encoded <- 0
			return
		}
		resp.Body.Close()
		encoded <- resp.StatusCode
	}()
	a := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id))
	if a.status != 200 {
		t.Fatalf("held pull got %d %s attempts=%q", a.status, a.body, a.header.Get("X-Encgate-Attempts"))
	}
	if n, _ := strconv.Atoi(a.header.Get("X-Encgate-Attempts")); n < 2 {
		t.Fatalf("attempts %q: the pull was not held past a try", a.header.Get("X-Encgate-Attempts"))
	}
	if got := metricValue(t, g, "encgate_retry_budget_exhausted_total"); got != 0 {
		t.Errorf("budget exhausted = %v, want 0", got)
	}
	if code := <-encoded; code != 200 {
		t.Fatalf("/encode: %d", code)
	}
}
