package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/redistest"
)

// replica is an `encgate gateway` process.
type replica struct {
	cmd   *exec.Cmd
	base  string
	admin string // http://admin_listen
}

// startReplica runs a gateway process and waits for its listening line.
func startReplica(t *testing.T, config string) *replica {
	t.Helper()
	cmd := exec.Command(encgateBin, "gateway", "--config", writeTemp(t, "gw.yaml", config))
	cmd.SysProcAttr = dieWithTest
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
	})
	// A replica that never says it is listening is killed, so Scan ends.
	stuck := time.AfterFunc(30*time.Second, func() { _ = cmd.Process.Kill() })
	defer stuck.Stop()
	sc := bufio.NewScanner(stderr)
	for sc.Scan() {
		var line struct {
			Msg    string `json:"msg"`
			Listen string `json:"listen"`
			Admin  string `json:"admin_listen"`
		}
		if json.Unmarshal(sc.Bytes(), &line) == nil && line.Msg == "gateway listening" {
			go func() { _, _ = io.Copy(io.Discard, stderr) }()
			return &replica{cmd: cmd, base: "http://" + line.Listen, admin: "http://" + line.Admin}
		}
	}
	t.Fatalf("gateway process exited before listening: %v", sc.Err())
	return nil
}

func replicaConfig(encoderURL, redisAddr string) string {
	return fmt.Sprintf(`listen: "127.0.0.1:0"
admin_listen: "127.0.0.1:0"
encoders:
  - {name: enc-a, url: %q}
affinity:
  unknown_wait: 0s
upstream:
  timeout: 5s
idempotency:
  store: redis
redis:
  addr: %q
  timeout: 500ms
  dial_timeout: 500ms
log:
  level: info
`, encoderURL, redisAddr)
}

type reply struct {
	status   int
	body     string
	replayed bool
	err      error
}

func postTo(client *http.Client, url, body string) reply {
	resp, err := client.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		return reply{err: err}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return reply{status: resp.StatusCode, body: string(b), replayed: resp.Header.Get("X-Encgate-Replayed") == "true"}
}

func sendJSON(id string) string {
	return fmt.Sprintf(`{"req_id":%q,"part_idx":0,"prefill_host":"10.0.0.1","embedding_port":40000,`+
		`"session_id":"10.0.0.1:17000","buffer_address":18446744073709551615,"receive_count":2}`, id)
}

func TestTwoReplicasShareOneRedis(t *testing.T) {
	if testing.Short() {
		t.Skip("starts redis-server and two gateway processes")
	}
	rd := redistest.Start(t)
	enc := fakeencoder.New(fakeencoder.Options{Name: "enc-a", Mode: fakeencoder.ModeMooncake,
		Faults: fakeencoder.Faults{Latency: 150 * time.Millisecond}})
	if err := enc.Start("127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	defer enc.Close()
	cfg := replicaConfig(enc.URL(), rd.Addr())
	gws := []*replica{startReplica(t, cfg), startReplica(t, cfg)}
	client := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 64}}

	const id = "replicas_local_part_0"
	encode := fmt.Sprintf(`{"req_id":%q,"mm_items":["x"],"modality":"IMAGE","num_parts":1,"part_idx":0,"prefill_host":"10.0.0.1","embedding_port":null}`, id)
	if r := postTo(client, gws[0].base+"/encode", encode); r.status != 200 {
		t.Fatalf("encode: %+v", r)
	}

	const n = 64
	replies := make([]reply, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			replies[i] = postTo(client, gws[i%2].base+"/send", sendJSON(id))
		}()
	}
	close(start)
	wg.Wait()
	if got := enc.Stats().Sends[id+"|10.0.0.1:40000"]; got != 1 {
		t.Fatalf("the encoder received %d /sends from two replicas, want exactly 1", got)
	}
	replayed := 0
	for i, r := range replies {
		if r.err != nil || r.status != replies[0].status || r.body != replies[0].body {
			t.Fatalf("caller %d: %+v; caller 0: %+v", i, r, replies[0])
		}
		if r.replayed {
			replayed++
		}
	}
	if replies[0].status != 200 || replies[0].body != "null" || replayed != n-1 {
		t.Fatalf("answer %d %q, %d replayed", replies[0].status, replies[0].body, replayed)
	}

	// Redis dies: every /send gets an envelope within its deadline, nothing
	// reaches the encoder without dedupe, and the processes stay up.
	rd.Kill()
	for i, gw := range gws {
		began := time.Now()
		r := postTo(client, gw.base+"/send", sendJSON(fmt.Sprintf("after-kill-%d", i)))
		if r.err != nil {
			t.Fatalf("replica %d: no answer with Redis down (after %s): %v", i, time.Since(began), r.err)
		}
		if r.status != 503 || !strings.Contains(r.body, `"message":"encgate: idempotency store unavailable`) {
			t.Fatalf("replica %d with Redis down: %d %s", i, r.status, r.body)
		}
		if h := postTo(client, gw.base+"/scheduler_receive_url", `{"req_id":"`+id+`","receive_count":2,"receive_url":"10.0.0.1:1"}`); h.err != nil || h.status != 200 {
			t.Fatalf("replica %d stopped serving other routes: %+v", i, h)
		}
	}
	for key, c := range enc.Stats().Sends {
		if strings.HasPrefix(key, "after-kill") {
			t.Fatalf("%s reached the encoder (%d) while the store was down", key, c)
		}
	}
	// Back again (empty: the test's Redis keeps nothing on disk), the
	// replicas dedupe once more without a restart of their own.
	rd.Restart()
	const id2 = "after-restart_local_part_0"
	if r := postTo(client, gws[0].base+"/encode", strings.Replace(encode, id, id2, 1)); r.status != 200 {
		t.Fatalf("encode after restart: %+v", r)
	}
	first := postTo(client, gws[1].base+"/send", sendJSON(id2))
	again := postTo(client, gws[0].base+"/send", sendJSON(id2))
	if first.status != 200 || first.replayed || again.status != 200 || !again.replayed {
		t.Fatalf("after Redis restarted: first %+v, again %+v", first, again)
	}
	if got := enc.Stats().Sends[id2+"|10.0.0.1:40000"]; got != 1 {
		t.Fatalf("after restart the encoder received %d /sends", got)
	}
}

// metric reads an unlabelled sample of r's /metrics (-1 when absent).
func (r *replica) metric(t *testing.T, name string) float64 {
	t.Helper()
	resp, err := http.Get(r.admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	text, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return metricValue(t, string(text), name)
}

// Pulls that reach one gateway process before their part's /encode,
// which goes to another process on the same Redis, wait for the pin
// parked; a Redis restart while they wait loses none of them (a placement
// published before this replica subscribed again is found by its poll),
// and each is answered by the encoder with its part, well before
// affinity.unknown_wait (an hour here: the client's guard would fire).
func TestParkedPinWaitsFollowAnotherProcessAcrossARedisRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("starts redis-server and two gateway processes")
	}
	rd := redistest.Start(t)
	enc := fakeencoder.New(fakeencoder.Options{Name: "enc-a", Mode: fakeencoder.ModeMooncake})
	if err := enc.Start("127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	defer enc.Close()
	cfg := strings.Replace(replicaConfig(enc.URL(), rd.Addr()), "unknown_wait: 0s", "unknown_wait: 1h", 1)
	placing, waiting := startReplica(t, cfg), startReplica(t, cfg)
	client := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 64}}

	const n = 8
	replies := make([]chan reply, n)
	for i := range replies {
		replies[i] = make(chan reply, 1)
		go func() {
			replies[i] <- postTo(client, waiting.base+"/scheduler_receive_meta_data",
				fmt.Sprintf(`{"req_id":"restart-wait-%d_local_part_0","part_idx":0}`, i))
		}()
	}
	deadline := time.Now().Add(20 * time.Second)
	for waiting.metric(t, "encgate_pin_waiters") != n {
		if time.Now().After(deadline) {
			t.Fatalf("encgate_pin_waiters %v, want %d", waiting.metric(t, "encgate_pin_waiters"), n)
		}
		time.Sleep(20 * time.Millisecond) // another process: its metrics are the only signal
	}
	rd.Kill()
	rd.Restart()
	for i := range n {
		body := fmt.Sprintf(`{"req_id":"restart-wait-%d_local_part_0","mm_items":["x"],"modality":"IMAGE","num_parts":1,"part_idx":0,"prefill_host":"10.0.0.1","embedding_port":null}`, i)
		if r := postTo(client, placing.base+"/encode", body); r.status != 200 {
			t.Fatalf("/encode %d on the other process: %+v", i, r)
		}
	}
	for i, ch := range replies {
		r := <-ch
		if r.err != nil || r.status != 200 || !strings.Contains(r.body, fmt.Sprintf("restart-wait-%d_local_part_0", i)) {
			t.Fatalf("pull %d: %+v", i, r)
		}
	}
	if got := waiting.metric(t, "encgate_pin_waiters"); got != 0 {
		t.Fatalf("encgate_pin_waiters %v after the answers", got)
	}
}
