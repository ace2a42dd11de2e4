package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/testtool"
)

// prlimit is util-linux's prlimit(1), which starts a command under the
// given limits (and changes a running process's); Debian always has it.
func prlimit(t *testing.T) string {
	t.Helper()
	return testtool.Need(t, "prlimit", "util-linux") // to start a gateway under a small RLIMIT_NOFILE
}

// limitedCmd is `encgate ARGS` run by the test binary under RLIMIT_NOFILE
// soft:hard.
func limitedCmd(t *testing.T, nofile string, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(prlimit(t), append([]string{"--nofile=" + nofile, "--", encgateBin}, args...)...)
	cmd.SysProcAttr = dieWithTest
	return cmd
}

// startLimitedGateway is startGatewayProc under RLIMIT_NOFILE soft:hard.
func startLimitedGateway(t *testing.T, path, nofile string) *gatewayProc {
	t.Helper()
	return runGatewayProc(t, limitedCmd(t, nofile, "gateway", "--config", path))
}

// openFDsOf counts the descriptors process pid holds.
func openFDsOf(t *testing.T, pid int) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// flood opens n idle connections to addr (host:port) and closes them when
// the test ends.
func flood(t *testing.T, addr string, n int) []net.Conn {
	t.Helper()
	var out []net.Conn
	for range n {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("connection %d of %d to %s: %v", len(out)+1, n, addr, err)
		}
		out = append(out, c)
	}
	t.Cleanup(func() { closeAll(out) })
	return out
}

func closeAll(cs []net.Conn) {
	for _, c := range cs {
		_ = c.Close()
	}
}

func (p *gatewayProc) logLines(msg string, field, value string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, l := range p.lines {
		var fields map[string]any
		if json.Unmarshal([]byte(l), &fields) == nil && fields["msg"] == msg && fields[field] == value {
			n++
		}
	}
	return n
}

const (
	acceptFailedMsg   = "accept failed; retrying with backoff until it succeeds (logged once per burst; encgate_accept_errors_total counts every error)"
	acceptingAgainMsg = "accepting again after accept errors"
)

// TestGatewayProcessSurvivesDescriptorExhaustion starts a gateway process
// under RLIMIT_NOFILE 256 with a config that fits it (239 descriptors at
// most). First, more connections than the limit to the encoder-facing port
// are answered by limits.max_conns, never refused by the kernel. Then the
// process's soft limit is lowered below what it may hold (as an operator's
// prlimit, or files opened by code the config does not bound, would), and
// idle connections to both ports take every descriptor: each listener's
// accept meets EMFILE. The process does not exit; a request it had in
// flight is answered 200; once the idle connections close, a new request
// on a new connection is answered 200 and /readyz answers; the metric
// counted the refusals and the log said so once per listener.
func TestGatewayProcessSurvivesDescriptorExhaustion(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a gateway process out of descriptors")
	}
	arrived, release := make(chan string, 1), make(chan struct{})
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
	released := false
	t.Cleanup(func() {
		if !released {
			close(release)
		}
	})
	p := startLimitedGateway(t, writeTemp(t, "gw.yaml", fmt.Sprintf(`listen: "127.0.0.1:0"
admin_listen: "127.0.0.1:0"
encoders:
  - {name: enc-a, url: %q}
upstream:
  max_conns_per_encoder: 16
limits:
  max_conns: 64
  read_header_timeout: 60s   # the idle connections stay for the whole test
admin:
  max_conns: 16
  read_timeout: 60s
log:
  level: info
`, enc.URL())), "256:256")
	pid := p.cmd.Process.Pid
	fits, ok := p.logLine("descriptors: the config fits RLIMIT_NOFILE", 0)
	if !ok || fits["need"] != float64(239) || fits["soft_limit"] != float64(256) {
		t.Fatalf("descriptors line %v, want need 239 under 256:\n%s", fits, p.log())
	}
	mainAddr, adminAddr := strings.TrimPrefix(p.base, "http://"), strings.TrimPrefix(p.admin, "http://")
	admin := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	metrics := func() string {
		t.Helper()
		status, body := getBody(admin, p.admin+"/metrics")
		if status != http.StatusOK {
			t.Fatalf("/metrics: %d %s", status, body)
		}
		return body
	}

	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	held := make(chan reply, 1)
	go func() { held <- postTo(client, p.base+"/encode", encodeJSON("held-0_local_part_0")) }()
	<-arrived

	// The config fits: 300 connections to the encoder-facing port (the
	// limit is 256) are taken up to limits.max_conns and the rest are
	// answered 503; the kernel refuses nothing.
	over := flood(t, mainAddr, 300)
	poll(t, "the connections past limits.max_conns to be refused", func() bool {
		return metricValue(t, metrics(), "encgate_connections_rejected_total") == 300-63
	})
	m := metrics()
	if v := metricValue(t, m, `encgate_accept_errors_total{errno="EMFILE",listener="main"}`); v != 0 {
		t.Fatalf("accept errors with a config that fits: %v\n%s", v, p.log())
	}
	closeAll(over)
	poll(t, "the refused and closed connections to be gone", func() bool {
		return metricValue(t, metrics(), "encgate_connections_open") == 1
	})

	// Descriptors run out all the same: 16 above what is open now.
	base := openFDsOf(t, pid)
	if out, err := exec.Command(prlimit(t), "--pid", strconv.Itoa(pid), fmt.Sprintf("--nofile=%d:256", base+16)).CombinedOutput(); err != nil {
		t.Fatalf("prlimit: %v: %s", err, out)
	}
	alive := func() {
		t.Helper()
		select {
		case <-p.exited:
			t.Fatalf("the gateway exited (status %d) when descriptors ran out:\n%s", p.cmd.ProcessState.ExitCode(), p.log())
		default:
		}
	}
	mainFlood := flood(t, mainAddr, 40)
	poll(t, "the encoder-facing listener to meet EMFILE", func() bool {
		alive()
		return p.logLines(acceptFailedMsg, "listener", "main") > 0
	})
	adminFlood := flood(t, adminAddr, 8)
	poll(t, "the admin listener to meet EMFILE", func() bool {
		alive()
		return p.logLines(acceptFailedMsg, "listener", "admin") > 0
	})
	close(release)
	released = true
	if r := <-held; r.err != nil || r.status != http.StatusOK || !strings.Contains(r.body, `"req_id":"held-0_local_part_0"`) {
		t.Fatalf("the request in flight when descriptors ran out: %d %v %s", r.status, r.err, r.body)
	}

	// The idle connections close: descriptors free, and new connections
	// are served again.
	closeAll(mainFlood)
	closeAll(adminFlood)
	poll(t, "the gateway to give its descriptors back", func() bool { return openFDsOf(t, pid) <= base })
	fresh := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	if r := postTo(fresh, p.base+"/encode", encodeJSON("after-0_local_part_0")); r.err != nil || r.status != http.StatusOK {
		t.Fatalf("a new request on a new connection after the exhaustion: %d %v %s\n%s", r.status, r.err, r.body, p.log())
	}
	if status, body := getBody(admin, p.admin+"/readyz"); status != http.StatusOK {
		t.Fatalf("/readyz after the exhaustion: %d %s", status, body)
	}
	m = metrics()
	for _, l := range []string{"main", "admin"} {
		v := metricValue(t, m, `encgate_accept_errors_total{errno="EMFILE",listener="`+l+`"}`)
		if v < 1 {
			t.Errorf("encgate_accept_errors_total{%s,EMFILE} = %v, want the refusals counted", l, v)
		}
		if n := p.logLines(acceptFailedMsg, "listener", l); n != 1 {
			t.Errorf("%d warnings about accept errors on %s, want 1 (once per burst, at most once a minute)", n, l)
		}
		if n := p.logLines(acceptingAgainMsg, "listener", l); n != 1 {
			t.Errorf("%d recovery lines on %s, want 1", n, l)
		}
		t.Logf("%s listener: %v EMFILE accept errors", l, v)
	}
	alive()
}

// A config that needs exactly the hard limit starts: Go's runtime raised
// the soft limit to the hard one minus one before main (the limit found is
// 255), and the gateway raises it the rest of the way.
func TestGatewayProcessRaisesTheSoftLimitToFit(t *testing.T) {
	// 64 + 65 + 16 + 9 + 33 + 2 + 2 + 1 + 64 = 256 (the last 1: the parking poller)
	p := startLimitedGateway(t, writeTemp(t, "gw.yaml", `listen: "127.0.0.1:0"
admin_listen: "127.0.0.1:0"
encoders:
  - {name: enc-a, url: "http://127.0.0.1:1"}
upstream:
  max_conns_per_encoder: 33
limits:
  max_conns: 64
admin:
  max_conns: 16
health:
  disabled: true
log:
  level: info
`), "128:256")
	fits, ok := p.logLine("descriptors: the config fits RLIMIT_NOFILE", 0)
	if !ok || fits["need"] != float64(256) || fits["soft_limit_found"] != float64(255) || fits["soft_limit"] != float64(256) || fits["raised"] != true {
		t.Fatalf("descriptors line %v, want need 256 with the soft limit raised from 255 to 256:\n%s", fits, p.log())
	}
	var lim [2]int
	if out, err := exec.Command(prlimit(t), "--pid", strconv.Itoa(p.cmd.Process.Pid), "--nofile", "--noheadings", "--raw", "--output=SOFT,HARD").Output(); err != nil {
		t.Fatal(err)
	} else if _, err := fmt.Sscan(string(out), &lim[0], &lim[1]); err != nil || lim != [2]int{256, 256} {
		t.Fatalf("the process's RLIMIT_NOFILE: %q (%v), want 256 256", out, err)
	}
}

// A config that cannot fit RLIMIT_NOFILE's hard limit is refused at start
// with exit status 2 (a config error) and a message naming the numbers and
// the keys to change; --check says the same under the same limit.
func TestGatewayProcessRefusesAConfigThatCannotFit(t *testing.T) {
	path := writeTemp(t, "gw.yaml", `listen: "127.0.0.1:0"
admin_listen: "127.0.0.1:0"
encoders:
  - {name: enc-a, url: "http://127.0.0.1:1"}
log:
  level: info
`)
	// 10000 + 129 + 64 + 9 + 1024 + 2 + 2 + 64 with the defaults.
	const need = "11295"
	for _, args := range [][]string{{"gateway", "--config", path}, {"gateway", "--config", path, "--check"}} {
		cmd := limitedCmd(t, "256:256", args...)
		out := &watchedOutput{want: "gateway listening", seen: make(chan struct{})}
		cmd.Stdout, cmd.Stderr = out, out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		waited := make(chan error, 1)
		go func() { waited <- cmd.Wait() }()
		var err error
		select {
		case err = <-waited:
		case <-out.seen: // it started after all
			_ = cmd.Process.Kill()
			err = <-waited
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			err = <-waited
		}
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 2 {
			t.Errorf("%v under RLIMIT_NOFILE 256: %v, want exit status 2:\n%s", args, err, out.String())
			continue
		}
		for _, want := range []string{"the config can hold " + need + " descriptors open at once", "limits.max_conns 10000",
			"more than its hard limit 256 allows (soft 256)", "lower limits.max_conns, upstream.max_conns_per_encoder or admin.max_conns"} {
			if !strings.Contains(out.String(), want) {
				t.Errorf("%v: the output lacks %q:\n%s", args, want, out.String())
			}
		}
		if strings.Contains(out.String(), "gateway listening") {
			t.Errorf("%v: it listened before refusing:\n%s", args, out.String())
		}
	}
}

// watchedOutput keeps a process's output and closes seen once want is in it.
type watchedOutput struct {
	mu   sync.Mutex
	b    strings.Builder
	want string
	seen chan struct{}
	once sync.Once
}

func (w *watchedOutput) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.b.Write(p)
	if strings.Contains(w.b.String(), w.want) {
		w.once.Do(func() { close(w.seen) })
	}
	return len(p), nil
}

func (w *watchedOutput) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// --check prints what the config can hold open against this machine's
// RLIMIT_NOFILE, term by term.
func TestCheckPrintsTheDescriptorFigures(t *testing.T) {
	path := writeTemp(t, "gw.yaml", `encoders:
  - {name: enc-a, url: "http://127.0.0.1:1", agent: "http://127.0.0.1:2"}
limits:
  max_conns: 100
`)
	code, stdout, stderr := runCmd("gateway", "--config", path, "--check")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	// 100 + 101 + 64 + 9 + 1024 x 2 + 2 + 2 + 64
	for _, want := range []string{path + ": valid (1 encoders)\n", "descriptors: the config can hold 2391 open at once (limits.max_conns 100 + ",
		"upstream.max_conns_per_encoder 1024 x 2 (1 encoders, 1 agents) = 2048", "); RLIMIT_NOFILE here is "} {
		if !strings.Contains(stdout, want) {
			t.Errorf("stdout lacks %q:\n%s", want, stdout)
		}
	}
}
