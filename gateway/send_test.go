package gateway

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/configfile"
)

func tpSend(id string, rank, tp int) string {
	return fmt.Sprintf(`{"req_id":%q,"part_idx":0,"embedding_size":524288,"embedding_len":256,"embedding_dim":1024,`+
		`"prefill_host":"10.0.0.1","embedding_port":%d,"session_id":"10.0.0.1:17000","buffer_address":%d,"receive_count":%d}`,
		id, 40000+rank, 140737488355328+rank*524288, tp)
}

func sendsReceived(e *fakeencoder.Encoder, id string) int64 {
	var n int64
	for k, c := range e.Stats().Sends {
		if strings.HasPrefix(k, id+"|") {
			n += c
		}
	}
	return n
}

func TestConcurrentDuplicateSendsReachTheEncoderOnce(t *testing.T) {
	encs := startFakes(t, 1, func(_ int, o *fakeencoder.Options) { o.Faults.Latency = 100 * time.Millisecond })
	g := startGateway(t, fakeURLs(encs), nil)
	const id = "dup_local_part_0"
	if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 {
		t.Fatalf("encode %d %s", a.status, a.body)
	}
	const n = 64
	body := tpSend(id, 0, 2)
	answers := make([]answer, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			answers[i] = post(t, g.base+"/send", body)
		}()
	}
	close(start)
	wg.Wait()
	if got := sendsReceived(encs[0], id); got != 1 {
		t.Fatalf("encoder received %d /sends, want exactly 1", got)
	}
	replayed := 0
	for i, a := range answers {
		if a.status != answers[0].status || a.body != answers[0].body {
			t.Fatalf("caller %d got %d %q, caller 0 got %d %q", i, a.status, a.body, answers[0].status, answers[0].body)
		}
		if a.header.Get("X-Encgate-Replayed") == "true" {
			replayed++
		}
	}
	if answers[0].status != 200 || answers[0].body != "null" || replayed != n-1 {
		t.Fatalf("status %d body %q, %d replayed (want %d)", answers[0].status, answers[0].body, replayed, n-1)
	}
	fwd := metricValue(t, g, "encgate_send_forwarded_total")
	if fwd != 1 {
		t.Errorf("encgate_send_forwarded_total = %v", fwd)
	}
}

func TestReceiverTP4ReleasesAfterFourthDestination(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), nil)
	const id = "tp4_local_part_0"
	if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 {
		t.Fatalf("encode %d", a.status)
	}
	for rank := 0; rank < 4; rank++ {
		a := post(t, g.base+"/send", tpSend(id, rank, 4))
		if a.status != 200 || a.header.Get("X-Encgate-Replayed") != "" {
			t.Fatalf("rank %d: %d %s replayed=%q", rank, a.status, a.body, a.header.Get("X-Encgate-Replayed"))
		}
	}
	if _, pinned := g.Pool().Pin(id); pinned {
		t.Error("pin kept after release")
	}
	fifth := post(t, g.base+"/send", tpSend(id, 4, 4))
	want := `{"status":"error","message":"no staged embedding for req_id=tp4_local_part_0 (already released)","req_id":"tp4_local_part_0"}`
	if fifth.status != 500 || fifth.body != want || fifth.header.Get("X-Encgate-Replayed") != "" {
		t.Fatalf("fifth destination: %d %s", fifth.status, fifth.body)
	}
	again := post(t, g.base+"/send", tpSend(id, 2, 4))
	if again.status != 200 || again.body != "null" || again.header.Get("X-Encgate-Replayed") != "true" {
		t.Fatalf("repeat of a done destination: %d %s", again.status, again.body)
	}
	changed := strings.Replace(tpSend(id, 1, 4), `"buffer_address":`, `"buffer_address":1`, 1)
	conflict := post(t, g.base+"/send", changed)
	if conflict.status != 422 || !strings.Contains(conflict.body, "different buffer_address") {
		t.Fatalf("changed payload: %d %s", conflict.status, conflict.body)
	}
	if got := sendsReceived(encs[0], id); got != 4 {
		t.Fatalf("encoder received %d /sends, want 4", got)
	}
	a := do(t, "GET", g.admin+"/admin/sends/"+id, "")
	var view struct {
		Released     bool `json:"released"`
		Done         int  `json:"destinations_done"`
		Destinations []struct {
			State  string `json:"state"`
			Status int    `json:"status"`
		} `json:"destinations"`
	}
	if err := json.Unmarshal([]byte(a.body), &view); err != nil || !view.Released || view.Done != 4 || len(view.Destinations) != 4 {
		t.Fatalf("admin view %s (%v)", a.body, err)
	}
}

func TestSendIsNeverSentTwiceOnATimeout(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Retry.Send.PerTryTimeout = configfile.Duration(300 * time.Millisecond) })
	const id = "slow_local_part_0"
	if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 {
		t.Fatalf("encode %d", a.status)
	}
	f := encs[0].Faults()
	f.Hang = true
	encs[0].SetFaults(f)
	first := post(t, g.base+"/send", tpSend(id, 0, 2))
	second := post(t, g.base+"/send", tpSend(id, 0, 2))
	if first.status != 504 || second.status != 504 || second.body != first.body || second.header.Get("X-Encgate-Replayed") != "true" {
		t.Fatalf("first %d %s; second %d %s", first.status, first.body, second.status, second.body)
	}
	if got := sendsReceived(encs[0], id); got > 1 {
		t.Fatalf("encoder received %d /sends", got)
	}
	if got := encs[0].Stats().Routes["/send"]; got != 1 {
		t.Fatalf("encoder saw %d /send requests, want 1", got)
	}
}

func TestUndeliveredSendIsNotStored(t *testing.T) {
	encs := startFakes(t, 1, nil)
	// The fake closes its idle connections the moment it starts refusing; a
	// tiny idle_conn_timeout makes every reuse probed, as a connection quiet
	// for a second is in production (uvicorn closes after 5 s).
	g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Upstream.IdleConnTimeout = 4 })
	const id = "refused_local_part_0"
	if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 {
		t.Fatalf("encode %d", a.status)
	}
	f := encs[0].Faults()
	f.Refuse = true
	encs[0].SetFaults(f)
	if a := post(t, g.base+"/send", tpSend(id, 0, 2)); a.status != 502 {
		t.Fatalf("refused: %d %s", a.status, a.body)
	}
	f.Refuse = false
	encs[0].SetFaults(f)
	a := post(t, g.base+"/send", tpSend(id, 0, 2))
	if a.status != 200 || a.header.Get("X-Encgate-Replayed") != "" {
		t.Fatalf("after the encoder came back: %d %s replayed=%q", a.status, a.body, a.header.Get("X-Encgate-Replayed"))
	}
	if got := sendsReceived(encs[0], id); got != 1 {
		t.Fatalf("encoder received %d /sends", got)
	}
}

func TestMalformedSendIsRefusedBeforeTheEncoder(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), nil)
	for body, msg := range map[string]string{
		`{"req_id":"m","prefill_host":"h","embedding_port":1,"buffer_address":1}`:                    "needs session_id",
		`{"req_id":"m","embedding_port":1,"session_id":"s","buffer_address":1}`:                      "needs prefill_host",
		`{"prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1}`:                "missing or invalid req_id",
		`{"req_id":"m","prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1.5}`: "needs buffer_address",
	} {
		a := post(t, g.base+"/send", body)
		if a.status != 400 || !strings.Contains(a.body, msg) {
			t.Errorf("%s: %d %s", body, a.status, a.body)
		}
	}
	if got := encs[0].Stats().Routes["/send"]; got != 0 {
		t.Fatalf("encoder received %d malformed /sends", got)
	}
}

// metricValue sums every series of the named metric in the gateway's registry.
func metricValue(t *testing.T, g *gw, name string) float64 {
	t.Helper()
	mfs, err := g.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		sum := 0.0
		for _, m := range mf.GetMetric() {
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
		return sum
	}
	t.Fatalf("metric %s not registered", name)
	return 0
}
