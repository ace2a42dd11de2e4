package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/encgate/encgate/fakeencoder"
)

// gatewayProc is an `encgate gateway` process whose log the test reads.
type gatewayProc struct {
	cmd    *exec.Cmd
	base   string // encoder-facing listener, http://host:port
	admin  string // admin listener, http://host:port
	boot   string // bootstrap listener, http://host:port ("" when off)
	exited chan struct{}

	mu    sync.Mutex
	lines []string // stderr, one JSON log line each
}

// startGatewayProc runs `encgate gateway --config path` and waits for its
// listening line; its stderr is kept until it exits.
func startGatewayProc(t *testing.T, path string) *gatewayProc {
	t.Helper()
	cmd := exec.Command(encgateBin, "gateway", "--config", path)
	cmd.SysProcAttr = dieWithTest
	return runGatewayProc(t, cmd)
}

// runGatewayProc starts cmd, a gateway process, and returns once it says it
// is listening; its log is kept, and it is stopped at cleanup.
func runGatewayProc(t *testing.T, cmd *exec.Cmd) *gatewayProc {
	t.Helper()
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &gatewayProc{cmd: cmd, exited: make(chan struct{})}
	listening := make(chan [3]string, 1)
	go func() {
		defer close(p.exited)
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			p.mu.Lock()
			p.lines = append(p.lines, sc.Text())
			p.mu.Unlock()
			var line struct {
				Msg             string `json:"msg"`
				Listen          string `json:"listen"`
				AdminListen     string `json:"admin_listen"`
				BootstrapListen string `json:"bootstrap_listen"`
			}
			if json.Unmarshal(sc.Bytes(), &line) == nil && line.Msg == "gateway listening" {
				listening <- [3]string{line.Listen, line.AdminListen, line.BootstrapListen}
			}
		}
		_, _ = io.Copy(io.Discard, stderr)
		_ = cmd.Wait() // after every read from the pipe
	}()
	t.Cleanup(func() {
		select {
		case <-p.exited:
			return
		default:
		}
		_ = cmd.Process.Signal(os.Interrupt)
		select {
		case <-p.exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-p.exited
		}
	})
	select {
	case addrs := <-listening:
		p.base, p.admin = "http://"+addrs[0], "http://"+addrs[1]
		if addrs[2] != "" {
			p.boot = "http://" + addrs[2]
		}
		return p
	case <-p.exited:
		t.Fatalf("gateway process exited before listening:\n%s", p.log())
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		t.Fatalf("gateway process never said it was listening:\n%s", p.log())
	}
	return nil
}

func (p *gatewayProc) log() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Join(p.lines, "\n")
}

// logLine returns the fields of the n-th (0-based) log line with msg, if
// there is one yet.
func (p *gatewayProc) logLine(msg string, n int) (map[string]any, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	seen := 0
	for _, l := range p.lines {
		var fields map[string]any
		if json.Unmarshal([]byte(l), &fields) != nil || fields["msg"] != msg {
			continue
		}
		if seen == n {
			return fields, true
		}
		seen++
	}
	return nil, false
}

// poll waits for cond, a state of the process the test is waiting for.
func poll(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func getBody(client *http.Client, url string) (int, string) {
	resp, err := client.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// upstreams returns the name and URL of each row of /admin/upstreams.
func upstreams(t *testing.T, client *http.Client, p *gatewayProc) [][2]string {
	t.Helper()
	status, body := getBody(client, p.admin+"/admin/upstreams")
	if status != 200 {
		t.Fatalf("/admin/upstreams: %d %s", status, body)
	}
	var rows []struct {
		Name string `json:"name"`
		URL  string `json:"url"`
	}
	if err := json.Unmarshal([]byte(body), &rows); err != nil {
		t.Fatalf("decoding /admin/upstreams %s: %v", body, err)
	}
	var out [][2]string
	for _, r := range rows {
		out = append(out, [2]string{r.Name, r.URL})
	}
	return out
}

func metricsHave(t *testing.T, client *http.Client, p *gatewayProc, line string) bool {
	t.Helper()
	status, body := getBody(client, p.admin+"/metrics")
	if status != 200 {
		t.Fatalf("/metrics: %d %s", status, body)
	}
	return slices.Contains(strings.Split(body, "\n"), line)
}

func problemsOf(fields map[string]any) []string {
	var out []string
	arr, _ := fields["problems"].([]any)
	for _, x := range arr {
		out = append(out, fmt.Sprint(x))
	}
	return out
}

func reloadConfig(encoders ...string) string {
	return `listen: "127.0.0.1:0"
admin_listen: "127.0.0.1:0"
encoders:
` + strings.Join(encoders, "") + `affinity:
  unknown_wait: 0s
upstream:
  timeout: 5s
log:
  level: info
`
}

func encoderEntry(name, url string) string {
	return fmt.Sprintf("  - {name: %s, url: %q}\n", name, url)
}

// TestSIGHUPReload runs a gateway process under steady load, adds an
// encoder with a valid file and SIGHUP, then sends invalid files: the valid
// change is applied, the invalid ones are refused with their field paths
// in the log, and no request is lost or fails meanwhile.
func TestSIGHUPReload(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a gateway process")
	}
	var encs []*fakeencoder.Encoder
	for _, name := range []string{"enc-a", "enc-b"} {
		e := fakeencoder.New(fakeencoder.Options{Name: name, Mode: fakeencoder.ModeMooncake})
		if err := e.Start("127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		encs = append(encs, e)
	}
	path := writeTemp(t, "gw.yaml", reloadConfig(encoderEntry("enc-a", encs[0].URL())))
	p := startGatewayProc(t, path)
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 16}}
	defer client.CloseIdleConnections()

	// Steady load for the whole test: fresh req_ids through
	// /encode, metadata and /send, every answer counted.
	var sent, answered, ok atomic.Int64
	var failMu sync.Mutex
	var failures []string
	stop := make(chan struct{})
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
				id := fmt.Sprintf("hup-w%d-%d_local_part_0", w, i)
				for _, step := range []struct{ path, body string }{
					{"/encode", fmt.Sprintf(`{"req_id":%q,"mm_items":["x"],"modality":"IMAGE","num_parts":1,"part_idx":0,"prefill_host":"10.0.0.1","embedding_port":null}`, id)},
					{"/scheduler_receive_meta_data", fmt.Sprintf(`{"req_id":%q,"part_idx":0}`, id)},
					{"/send", fmt.Sprintf(`{"req_id":%q,"part_idx":0,"prefill_host":"10.0.0.1","embedding_port":40000,`+
						`"session_id":"10.0.0.1:17000","buffer_address":18446744073709551615,"receive_count":1}`, id)},
				} {
					sent.Add(1)
					r := postTo(client, p.base+step.path, step.body)
					if r.err == nil {
						answered.Add(1)
					}
					if r.err != nil || r.status != 200 {
						failMu.Lock()
						failures = append(failures, fmt.Sprintf("%s %s: %d %s %v", step.path, id, r.status, r.body, r.err))
						failMu.Unlock()
						continue
					}
					ok.Add(1)
				}
			}
		}()
	}
	stopped := false
	stopLoad := func() {
		if !stopped {
			stopped = true
			close(stop)
			wg.Wait()
		}
	}
	defer stopLoad()
	// progress waits until n more requests than now were answered 200.
	progress := func(what string, n int64) {
		t.Helper()
		base := ok.Load()
		poll(t, what, func() bool { return ok.Load() >= base+n })
	}
	progress("load before the first reload", 30)

	// A valid change: a second encoder.
	if err := os.WriteFile(path, []byte(reloadConfig(encoderEntry("enc-a", encs[0].URL()), encoderEntry("enc-b", encs[1].URL()))), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	want := [][2]string{{"enc-a", encs[0].URL()}, {"enc-b", encs[1].URL()}}
	poll(t, "/admin/upstreams to list 2 encoders", func() bool { return len(upstreams(t, client, p)) == 2 })
	if got := upstreams(t, client, p); !slices.Equal(got, want) {
		t.Fatalf("/admin/upstreams lists %v, want %v", got, want)
	}
	poll(t, "the added encoder to receive /encodes", func() bool { return encs[1].Stats().Routes["/encode"] > 0 })
	var applied map[string]any
	poll(t, `the "config reloaded" log line`, func() bool {
		var found bool
		applied, found = p.logLine("config reloaded", 0)
		return found
	})
	if added := fmt.Sprint(applied["encoders_added"]); added != "[enc-b]" {
		t.Errorf("encoders_added = %s, want [enc-b]", added)
	}
	progress("load after the valid reload", 30)

	// An invalid file: refused with every field path, the running config stays.
	bad := reloadConfig(encoderEntry("enc-a", encs[0].URL()), encoderEntry("enc-b", "ftp://x")) +
		"retry:\n  metadata:\n    max_attempts: 0\n"
	if err := os.WriteFile(path, []byte(bad), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	poll(t, "one refused reload in /metrics", func() bool {
		return metricsHave(t, client, p, `encgate_config_reloads_total{result="refused"} 1`)
	})
	const refusedMsg = "config reload refused; the running config stays"
	var refused map[string]any
	poll(t, "the refusal's log line", func() bool {
		var found bool
		refused, found = p.logLine(refusedMsg, 0)
		return found
	})
	problems := problemsOf(refused)
	for _, prefix := range []string{`encoders[1].url: scheme must be http or https, got "ftp"`, "retry.metadata.max_attempts: "} {
		if !slices.ContainsFunc(problems, func(p string) bool { return strings.HasPrefix(p, prefix) }) {
			t.Errorf("the refusal's problems %q lack %q", problems, prefix)
		}
	}
	if refused["level"] != "error" || refused["config"] != path || refused["stacktrace"] != nil {
		t.Errorf("refusal log line: %v", refused)
	}

	// A file with an unknown key (and a bad URL): refused, naming the key.
	typo := bad + "bogus_key: 1\n"
	if err := os.WriteFile(path, []byte(typo), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	poll(t, "two refused reloads in /metrics", func() bool {
		return metricsHave(t, client, p, `encgate_config_reloads_total{result="refused"} 2`)
	})
	poll(t, "the second refusal's log line", func() bool {
		var found bool
		refused, found = p.logLine(refusedMsg, 1)
		return found
	})
	if problems := problemsOf(refused); !slices.ContainsFunc(problems, func(p string) bool { return strings.Contains(p, "bogus_key") }) {
		t.Errorf("the refusal's problems %q do not name the unknown key bogus_key", problems)
	}

	// The running config stays and the process serves on.
	if got := upstreams(t, client, p); !slices.Equal(got, want) {
		t.Fatalf("/admin/upstreams after the refusals lists %v, want %v", got, want)
	}
	if !metricsHave(t, client, p, `encgate_config_reloads_total{result="applied"} 1`) {
		t.Errorf(`metrics lack encgate_config_reloads_total{result="applied"} 1`)
	}
	select {
	case <-p.exited:
		t.Fatalf("the gateway exited after an invalid reload:\n%s", p.log())
	default:
	}
	progress("load after the refused reloads", 30)

	stopLoad()
	failMu.Lock()
	if len(failures) > 0 {
		t.Errorf("%d of %d requests failed while reloading; first: %s", len(failures), sent.Load(), failures[0])
	}
	failMu.Unlock()
	if answered.Load() != sent.Load() || ok.Load() != sent.Load() {
		t.Errorf("sent %d, answered %d, 200 %d", sent.Load(), answered.Load(), ok.Load())
	}
	if sent.Load() == 0 {
		t.Fatal("no load was sent")
	}

	client.CloseIdleConnections()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		t.Fatalf("the gateway did not exit after SIGTERM:\n%s", p.log())
	}
	if code := p.cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("exit code %d after SIGTERM, want 0:\n%s", code, p.log())
	}
	t.Logf("%d requests, all answered 200, across one applied and two refused reloads", sent.Load())
}

// TestSIGHUPRereadsTheAdminTokenFile: a gateway process whose admin token
// is in admin.token_file takes a rewritten file at the next SIGHUP, with
// the config file itself unchanged: the old token is then refused on
// /admin/... and the new one accepted.
func TestSIGHUPRereadsTheAdminTokenFile(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a gateway process")
	}
	const first, second = "sighup-admin-token-first-01", "sighup-admin-token-second-01"
	tokenFile := writeTemp(t, "admin.token", first+"\n")
	p := startGatewayProc(t, writeTemp(t, "gw.yaml", reloadConfig(encoderEntry("enc-a", "http://127.0.0.1:1"))+
		fmt.Sprintf("admin:\n  token_file: %q\n", tokenFile)))
	client := &http.Client{Timeout: 10 * time.Second}
	defer client.CloseIdleConnections()
	get := func(token string) int {
		t.Helper()
		req, err := http.NewRequest(http.MethodGet, p.admin+"/admin/upstreams", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if a, b := get(first), get(second); a != 200 || b != http.StatusUnauthorized {
		t.Fatalf("before the rotation: the file's token %d, the next one %d", a, b)
	}
	if err := os.WriteFile(tokenFile, []byte(second+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	poll(t, `the "config reloaded" log line`, func() bool { _, ok := p.logLine("config reloaded", 0); return ok })
	if a, b := get(first), get(second); a != http.StatusUnauthorized || b != 200 {
		t.Fatalf("after the rotation and SIGHUP: the old token %d (want 401), the new one %d (want 200)", a, b)
	}
	if strings.Contains(p.log(), first) || strings.Contains(p.log(), second) {
		t.Errorf("the log shows a token:\n%s", p.log())
	}
}
