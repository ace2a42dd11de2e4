//go:build unix

package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/gateway"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/upstream"
)

// fakeProc is an `encgate fake-encoder` process: a process of its own, so
// that SIGSTOP stops it as it would stop an encoder, while the kernel keeps
// completing connects to its listener and buffering what is sent to it.
type fakeProc struct {
	t      *testing.T
	cmd    *exec.Cmd
	url    string
	exited chan struct{}
	ctl    *http.Client // for /_fake/...: its own, bounded, so a call to a stopped process fails instead of hanging
}

var fakeListening = regexp.MustCompile(`^fake encoder ".*" listening on (http://\S+)$`)

// startFakeProc runs `encgate fake-encoder --name name` on a free port and
// waits for its listening line. Its cleanup continues it (a stopped process
// acts on nothing else) and interrupts it.
func startFakeProc(t *testing.T, name string) *fakeProc {
	t.Helper()
	cmd := exec.Command(encgateBin, "fake-encoder", "--listen", "127.0.0.1:0", "--name", name, "--mode", "mooncake")
	cmd.SysProcAttr = dieWithTest
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	f := &fakeProc{t: t, cmd: cmd, exited: make(chan struct{}), ctl: &http.Client{Transport: tr, Timeout: 10 * time.Second}}
	listening := make(chan string, 1)
	go func() {
		defer close(f.exited)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			if m := fakeListening.FindStringSubmatch(sc.Text()); m != nil {
				listening <- m[1]
			}
		}
		_, _ = io.Copy(io.Discard, stderr)
		_ = cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Signal(os.Interrupt)
		select {
		case <-f.exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-f.exited
		}
	})
	select {
	case f.url = <-listening:
		return f
	case <-f.exited:
		t.Fatalf("fake encoder %s exited before listening", name)
	case <-time.After(30 * time.Second):
		t.Fatalf("fake encoder %s never said it was listening", name)
	}
	return nil
}

func (f *fakeProc) signal(sig syscall.Signal) {
	f.t.Helper()
	if err := f.cmd.Process.Signal(sig); err != nil {
		f.t.Fatal(err)
	}
}

// stats reads GET /_fake/stats (the process must be running).
func (f *fakeProc) stats() fakeencoder.Stats {
	f.t.Helper()
	resp, err := f.ctl.Get(f.url + fakeencoder.RouteStats)
	if err != nil {
		f.t.Fatal(err)
	}
	defer resp.Body.Close()
	var s fakeencoder.Stats
	if err := json.NewDecoder(resp.Body).Decode(&s); err != nil {
		f.t.Fatal(err)
	}
	return s
}

// setFaults replaces the faults (PUT /_fake/faults).
func (f *fakeProc) setFaults(faults string) {
	f.t.Helper()
	req, _ := http.NewRequest(http.MethodPut, f.url+fakeencoder.RouteFaults, strings.NewReader(faults))
	resp, err := f.ctl.Do(req)
	if err != nil {
		f.t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		f.t.Fatalf("PUT %s: %d", fakeencoder.RouteFaults, resp.StatusCode)
	}
}

// stopCall is one caller's request and what it got.
type stopCall struct {
	route, id, body, dest string
	stage                 string

	status   int
	text     string
	encoder  string // X-Encgate-Encoder
	attempts string // X-Encgate-Attempts
	err      error
	took     time.Duration
}

func (c *stopCall) key() string { return c.id + "|" + c.dest }

func metaJSON(id string) string { return fmt.Sprintf(`{"req_id":%q,"part_idx":0}`, id) }

// sendTo is a /send of part id from the receiver rank at 10.0.0.1:port.
func sendTo(id string, port int) string {
	return fmt.Sprintf(`{"req_id":%q,"part_idx":0,"prefill_host":"10.0.0.1","embedding_port":%d,`+
		`"session_id":"10.0.0.1:17000","buffer_address":%d,"receive_count":2}`, id, port, 1<<40+port)
}

// TestStoppedEncoderIsBoundedAndRecovers stops (SIGSTOP) one of two fake
// encoder processes while /encodes, metadata pulls and /sends are held by it
// and more arrive, in front of a real gateway with short timeouts:
//
//   - every caller is answered, within its route's bound from the config
//     (the deadline, plus affinity.unknown_wait for a follow-up; checked
//     with half a per-try timeout of slack, as the chaos suite does);
//   - once the stopped encoder's in-flight count is at
//     limits.max_inflight_per_encoder, an /encode it owns is refused at once
//     with nothing sent and goes to the other encoder, as it does once its
//     breaker opened on the /encodes that timed out;
//   - no (req_id, destination) /send reaches an encoder twice, counted where
//     it arrives, after the stopped encoder has read everything the gateway
//     wrote to it; what the gateway said it did not send never arrives;
//   - after SIGCONT its breaker closes again and a whole part (/encode,
//     pull, both /sends) goes through it.
func TestStoppedEncoderIsBoundedAndRecovers(t *testing.T) {
	if testing.Short() {
		t.Skip("runs two fake encoder processes and stops one")
	}
	stopped, other := startFakeProc(t, "enc-0"), startFakeProc(t, "enc-1")

	const limit = 10 // limits.max_inflight_per_encoder
	cfg := gateway.DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Encoders = []upstream.EncoderConfig{{Name: "enc-0", URL: stopped.url}, {Name: "enc-1", URL: other.url}}
	cfg.Limits.MaxInflightPerEncoder = limit
	// Active health off: what moves work off the stopped encoder here is
	// its in-flight limit and its breaker (health would too, later).
	cfg.Health.Disabled = true
	cfg.Breaker.ConsecutiveFailures = 2
	// The gateway runs on the wall clock here (the processes do): one
	// short ejection, not growing, so that recovery comes within a second.
	cfg.Breaker.BaseEjectionTime = configfile.Duration(time.Second)
	cfg.Breaker.MaxEjectionTime = configfile.Duration(time.Second)
	cfg.Affinity.UnknownWait = configfile.Duration(time.Second)
	// One try per call, long enough that what fills the limit is still
	// held while the next stage runs.
	for _, p := range []*upstream.RetryPolicy{&cfg.Retry.Encode, &cfg.Retry.Metadata, &cfg.Retry.Send, &cfg.Retry.ReceiveURL} {
		p.PerTryTimeout = configfile.Duration(2 * time.Second)
		p.Deadline = configfile.Duration(2 * time.Second)
	}
	bound := func(route string) time.Duration {
		r := cfg.Retry
		switch route {
		case "/encode":
			return r.Encode.Deadline.D() + r.Encode.PerTryTimeout.D()/2
		case "/scheduler_receive_meta_data":
			return cfg.Affinity.UnknownWait.D() + r.Metadata.Deadline.D() + r.Metadata.PerTryTimeout.D()/2
		}
		return cfg.Affinity.UnknownWait.D() + r.Send.Deadline.D() + r.Send.PerTryTimeout.D()/2
	}
	reg := prometheus.NewRegistry()
	g, err := gateway.New(cfg, gateway.Deps{Log: zap.NewNop(), Registry: reg, Rand: func() float64 { return 0 }})
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = g.Shutdown(ctx)
	})
	base := "http://" + g.Addr()
	enc0, _ := g.Pool().Lookup("enc-0")
	tr := &http.Transport{MaxIdleConnsPerHost: 128}
	t.Cleanup(tr.CloseIdleConnections)
	client := &http.Client{Transport: tr, Timeout: time.Minute}

	// owned returns n req_ids whose rendezvous owner is name. Ask while
	// every encoder is usable: an open breaker takes enc-0 out of the order.
	owned := func(name, prefix string, n int) []string {
		t.Helper()
		var ids []string
		for i := 0; len(ids) < n && i < 100000; i++ {
			id := prefix + "-" + strconv.Itoa(i) + "_local_part_0"
			if e, err := g.Pool().Owner(id); err == nil && e.Name == name {
				ids = append(ids, id)
			}
		}
		if len(ids) < n {
			t.Fatalf("not %d req_ids owned by %s", n, name)
		}
		return ids
	}
	var (
		partIDs    = owned("enc-0", "part", 4)
		heldIDs    = owned("enc-0", "held", 2)
		limitIDs   = owned("enc-0", "limit", 12)
		controlIDs = owned("enc-1", "control", 4)
		openIDs    = owned("enc-0", "open", 4)
		recoverIDs = owned("enc-0", "recover", 100)
		afterID    = owned("enc-0", "after", 1)[0]
	)
	do := func(c *stopCall) *stopCall {
		began := time.Now()
		resp, err := client.Post(base+c.route, "application/json", strings.NewReader(c.body))
		c.took = time.Since(began)
		if err != nil {
			c.err = err
			return c
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		c.status, c.text, c.err = resp.StatusCode, string(b), err
		c.encoder, c.attempts = resp.Header.Get("X-Encgate-Encoder"), resp.Header.Get("X-Encgate-Attempts")
		return c
	}
	var mu sync.Mutex
	var calls []*stopCall
	var wg sync.WaitGroup
	sync1 := func(c *stopCall) {
		mu.Lock()
		calls = append(calls, c)
		mu.Unlock()
		do(c)
	}
	async := func(c *stopCall) {
		mu.Lock()
		calls = append(calls, c)
		mu.Unlock()
		wg.Add(1)
		go func() { defer wg.Done(); do(c) }()
	}
	encode := func(stage, id string) *stopCall {
		return &stopCall{stage: stage, route: "/encode", id: id, body: encodeJSON(id)}
	}
	pull := func(stage, id string) *stopCall {
		return &stopCall{stage: stage, route: "/scheduler_receive_meta_data", id: id, body: metaJSON(id)}
	}
	send := func(stage, id string, port int) *stopCall {
		return &stopCall{stage: stage, route: "/send", id: id, body: sendTo(id, port), dest: "10.0.0.1:" + strconv.Itoa(port)}
	}

	// Four parts encoded on enc-0 before anything goes wrong: their pulls
	// and /sends can only go there.
	parts := partIDs
	for _, id := range parts {
		if c := do(encode("setup", id)); c.err != nil || c.status != 200 || c.encoder != "enc-0" {
			t.Fatalf("setup /encode %s: %+v", id, c)
		}
	}

	// Held: from now on enc-0 reads each request and sits on it, so these
	// six are in flight, inside the process, when it stops.
	stopped.setFaults(`{"latency":"1h"}`)
	for i := 0; i < 2; i++ {
		async(encode("held", heldIDs[i]))
		async(pull("held", parts[i]))
		async(send("held", parts[i], 40000))
	}
	poll(t, "enc-0 to hold 6 requests", func() bool {
		n := 0
		for _, w := range stopped.stats().Waiting {
			n += w
		}
		return n == 6
	})
	stopped.signal(syscall.SIGSTOP)

	// Stage fill: four more exchanges reach the stopped process's socket
	// buffers, bringing its in-flight count to the limit.
	for i := 2; i < 4; i++ {
		async(pull("fill", parts[i]))
		async(send("fill", parts[i], 40000))
	}
	poll(t, "enc-0 at its in-flight limit", func() bool { return enc0.Inflight() == limit })

	// Stage limit: duplicates of every /send in flight arrive (coalesced,
	// or replayed once answered: never a second exchange), and a /send for
	// a new destination (refused with nothing sent); then, one after
	// another, /encodes owned by enc-0, each refused at once and answered by
	// enc-1 (one at a time, so that enc-1 stays below its own limit), and
	// /encodes for enc-1.
	for i := 0; i < 4; i++ {
		async(send("limit", parts[i], 40000))
		async(send("limit", parts[i], 40000))
		async(send("limit", parts[i], 40001))
	}
	for _, id := range limitIDs {
		sync1(encode("limit", id))
	}
	for _, id := range controlIDs {
		sync1(encode("control", id))
	}
	// Stage open: the held /encodes time out, two faults in a row: the
	// breaker opens and new /encodes owned by enc-0 skip it.
	poll(t, "enc-0's breaker to open", func() bool { return enc0.Breaker.State() == upstream.BreakerOpen })
	for _, id := range openIDs {
		sync1(encode("open", id))
	}
	wg.Wait()

	// Every caller was answered, within its bound, with its own req_id.
	moved, byAttempts := map[string]int{}, map[string]int{}
	for _, c := range calls {
		switch {
		case c.err != nil:
			t.Errorf("%s %s %s: no answer: %v", c.stage, c.route, c.id, c.err)
			continue
		case c.took > bound(c.route):
			t.Errorf("%s %s %s: answered after %s, past its bound %s: %d %s", c.stage, c.route, c.id, c.took, bound(c.route), c.status, c.text)
		case c.status != 200 && !strings.Contains(c.text, `"req_id":"`+c.id+`"`):
			t.Errorf("%s %s %s: %d %s does not name its req_id", c.stage, c.route, c.id, c.status, c.text)
		}
		timedOut := c.status == 504 && strings.Contains(c.text, "encoder enc-0 did not answer in time")
		switch {
		case c.stage == "control":
			if c.status != 200 || c.encoder != "enc-1" {
				t.Errorf("control /encode %s: %d from %q: %s", c.id, c.status, c.encoder, c.text)
			}
		case c.stage == "limit" && c.route == "/send":
			// A duplicate of a held /send waits for it and gets its 504
			// (or gives up at its own deadline, which may come first), or
			// replays the stored 504; a new destination is refused with
			// nothing sent, unless a try had ended meanwhile and freed a slot.
			refused := c.status == 503 && strings.Contains(c.text, "(limits.max_inflight_per_encoder)")
			waited := c.status == 504 && strings.Contains(c.text, "is still in flight past this call's deadline")
			if !timedOut && !(waited && c.dest == "10.0.0.1:40000") && !(refused && c.dest == "10.0.0.1:40001") {
				t.Errorf("/send %s at the limit: %d from %q: %s", c.key(), c.status, c.encoder, c.text)
			}
		case c.stage == "limit", c.stage == "open":
			// Moved: answered by enc-1, nothing having been sent to enc-0.
			// Or, had a try on enc-0 ended meanwhile and freed a slot (or
			// the breaker let a half-open probe through), timed out there.
			switch {
			case c.status == 200 && c.encoder == "enc-1" && (c.attempts == "2" || c.attempts == "1"):
				// 2: refused at enc-0, then enc-1; 1: enc-0 out of the
				// rendezvous order, its breaker open.
				moved[c.stage]++
				byAttempts[c.stage+" attempts="+c.attempts]++
			case timedOut && c.encoder == "enc-0":
			default:
				t.Errorf("%s /encode %s owned by the stopped enc-0: %d from %q (attempts %s): %s",
					c.stage, c.id, c.status, c.encoder, c.attempts, c.text)
			}
		default: // held, fill
			if !timedOut || c.encoder != "enc-0" {
				t.Errorf("%s %s %s held by the stopped enc-0: %d from %q: %s", c.stage, c.route, c.id, c.status, c.encoder, c.text)
			}
		}
	}
	if moved["limit"] == 0 {
		t.Errorf("no /encode owned by enc-0 went to enc-1 while enc-0 was at its in-flight limit")
	}
	if moved["open"] == 0 {
		t.Errorf("no /encode owned by enc-0 went to enc-1 while its breaker was open")
	}
	metrics := scrapeRegistry(t, reg)
	if n, refused := byAttempts["limit attempts=2"], metrics[`encgate_upstream_requests_total{code="refused",encoder="enc-0",route="encode"}`]; refused < float64(n) {
		t.Errorf("%d /encodes moved after a first attempt on enc-0, but only %g attempts were judged refused there", n, refused)
	}
	for _, line := range []string{
		// Each refusal is judged refused and not sent: a connect_failure to
		// the retry policy, so the /encode moved on.
		`encgate_upstream_refused_total{encoder="enc-0",reason="max_inflight"}`,
		`encgate_upstream_requests_total{code="refused",encoder="enc-0",route="encode"}`,
		`encgate_retries_total{reason="connect_failure",route="encode"}`,
		`encgate_breaker_transitions_total{encoder="enc-0",from="closed",to="open"}`,
	} {
		if metrics[line] < 1 {
			t.Errorf("%s is %g, want at least 1", line, metrics[line])
		}
	}

	// Recovery: enc-0 runs again; its breaker lets a trial /encode through
	// once its ejection ends, and new work reaches it.
	stopped.signal(syscall.SIGCONT)
	stopped.setFaults(`{}`)
	i := 0
	poll(t, "enc-0 to take /encodes again", func() bool {
		if enc0.Breaker.State() == upstream.BreakerOpen {
			return false
		}
		if i == len(recoverIDs) {
			t.Fatalf("%d /encodes owned by enc-0 did not bring it back", i)
		}
		c := do(encode("recover", recoverIDs[i]))
		i++
		return c.status == 200 && c.encoder == "enc-0" && enc0.Breaker.State() == upstream.BreakerClosed
	})
	part := afterID
	for _, c := range []*stopCall{encode("after", part), pull("after", part), send("after", part, 41000), send("after", part, 41001)} {
		if do(c); c.err != nil || c.status != 200 || c.encoder != "enc-0" {
			t.Errorf("after SIGCONT, %s %s: %d from %q: %v %s", c.route, c.id, c.status, c.encoder, c.err, c.text)
		}
	}

	// Delivery, counted at the encoders once enc-0 has read everything the
	// gateway wrote to it while it was stopped: each /send and /encode that
	// got enc-0's 504 (a try that timed out: maybe delivered).
	sentTo0 := map[string]bool{} // /send keys
	encTo0 := map[string]bool{}  // /encode req_ids
	notSent := map[string]bool{} // /send keys refused at the limit
	for _, c := range calls {
		// Replayed answers are left out: each key's first answer is here.
		timedOut := c.err == nil && c.status == 504 && c.encoder == "enc-0" && strings.Contains(c.text, "did not answer in time")
		switch {
		case c.route == "/send" && timedOut:
			sentTo0[c.key()] = true
		case c.route == "/send" && c.status == 503 && strings.Contains(c.text, "requests in flight (limits.max_inflight_per_encoder)"):
			notSent[c.key()] = true
		case c.route == "/encode" && timedOut:
			encTo0[c.id] = true
		}
	}
	if len(sentTo0) != 4 {
		t.Errorf("%d /send keys timed out on enc-0, want the 4 held and filled: %v", len(sentTo0), sentTo0)
	}
	var s0 fakeencoder.Stats
	poll(t, "enc-0 to read what was written to it while stopped", func() bool {
		s0 = stopped.stats()
		for k := range sentTo0 {
			if s0.SendArrivals[k] == 0 {
				return false
			}
		}
		for id := range encTo0 {
			if s0.ReqIDs[id]["/encode"] == 0 {
				return false
			}
		}
		return true
	})
	s1 := other.stats()
	for _, s := range []fakeencoder.Stats{s0, s1} {
		for k, n := range s.SendArrivals {
			if n > 1 {
				t.Errorf("/send %s reached %s %d times", k, s.Name, n)
			}
			if notSent[k] {
				t.Errorf("/send %s, refused with nothing sent, reached %s", k, s.Name)
			}
		}
	}
	for _, c := range calls {
		if (c.stage == "limit" || c.stage == "open") && c.status == 200 && s0.ReqIDs[c.id]["/encode"] != 0 {
			t.Errorf("/encode %s moved to enc-1 as not sent, but enc-0 received it", c.id)
		}
	}
	t.Logf("moved to enc-1: %d of 12 at the limit, %d of 4 with the breaker open (%v); %d /send keys timed out on enc-0, %d refused unsent",
		moved["limit"], moved["open"], byAttempts, len(sentTo0), len(notSent))
}

// scrapeRegistry returns every sample of reg as `name{labels}` → value,
// labels in the exposition's (sorted) order.
func scrapeRegistry(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, lp := range m.GetLabel() {
				labels = append(labels, fmt.Sprintf("%s=%q", lp.GetName(), lp.GetValue()))
			}
			v := m.GetCounter().GetValue() + m.GetGauge().GetValue()
			out[mf.GetName()+"{"+strings.Join(labels, ",")+"}"] = v
		}
	}
	return out
}
