package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/encgate/encgate/fakeencoder"
)

// stateConfig is a gateway with no static encoder that serves sglang's
// bootstrap API, keeping its registrations in state.
func stateConfig(state string) string {
	return fmt.Sprintf(`listen: "127.0.0.1:0"
admin_listen: "127.0.0.1:0"
bootstrap:
  listen: "127.0.0.1:0"
  insecure: true
  state_file: %q
  state_write_interval: 100ms
health:
  interval: 1s
  timeout: 500ms
  up_after: 1
affinity:
  unknown_wait: 0s
log:
  level: info
`, state)
}

// registeringFake starts a fake encoder that registers with boot as
// sglang's does (retrying until its first 200, then never again) and
// returns once it is registered.
func registeringFake(t *testing.T, name, boot string) *fakeencoder.Encoder {
	t.Helper()
	enc := fakeencoder.New(fakeencoder.Options{Name: name, Mode: fakeencoder.ModeMooncake,
		RegisterURLs: []string{boot}, RegistrationInterval: 10 * time.Millisecond})
	if err := enc.Start("127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = enc.Close() })
	<-enc.RegistrationDone()
	if st := enc.Stats(); st.RegistrationsOK != 1 {
		t.Fatalf("%s: registered %d times", name, st.RegistrationsOK)
	}
	return enc
}

// usableRegistered returns the URLs of the usable registered encoders of p.
func usableRegistered(t *testing.T, client *http.Client, p *gatewayProc) []string {
	t.Helper()
	status, body := getBody(client, p.admin+"/admin/upstreams")
	if status != 200 {
		t.Fatalf("/admin/upstreams: %d %s", status, body)
	}
	var rows []struct {
		URL    string `json:"url"`
		Source string `json:"source"`
		Usable bool   `json:"usable"`
	}
	if err := json.Unmarshal([]byte(body), &rows); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, r := range rows {
		if r.Source == "registered" && r.Usable {
			out = append(out, r.URL)
		}
	}
	slices.Sort(out)
	return out
}

// serveFrom polls until p's usable registered encoders are exactly encs,
// then sends /encodes (new req_ids) until each of encs has served one,
// failing on any answer but 200.
func serveFrom(t *testing.T, client *http.Client, p *gatewayProc, what string, encs ...*fakeencoder.Encoder) {
	t.Helper()
	var want []string
	for _, e := range encs {
		want = append(want, e.URL())
	}
	slices.Sort(want)
	poll(t, what+": the registered encoders usable", func() bool {
		return slices.Equal(usableRegistered(t, client, p), want)
	})
	served := map[string]bool{}
	for i := 0; len(served) < len(encs); i++ {
		if i == 64 {
			t.Fatalf("%s: 64 /encodes reached only %v of %v", what, served, want)
		}
		id := fmt.Sprintf("%s-%d_local_part_0", strings.ReplaceAll(what, " ", "-"), i)
		resp, err := client.Post(p.base+"/encode", "application/json", strings.NewReader(encodeJSON(id)))
		if err != nil {
			t.Fatalf("%s: /encode: %v", what, err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: /encode %s: %d", what, id, resp.StatusCode)
		}
		served[resp.Header.Get("X-Encgate-Encoder")] = true
	}
}

// stopProc stops p with sig and waits for it to exit.
func stopProc(t *testing.T, p *gatewayProc, sig syscall.Signal) {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.exited:
	case <-time.After(15 * time.Second):
		t.Fatalf("gateway did not exit on %v:\n%s", sig, p.log())
	}
}

// Issue 26, must-show "restart": with the memory store and
// bootstrap.state_file, an encoder that registered once (as sglang's do)
// is in the fleet of the next gateway process without registering again,
// and serves /encodes: after a graceful stop (SIGTERM, the file written at
// shutdown), and after a crash (SIGKILL: the file written on change
// suffices). A corrupt file is set aside with a warning, and the gateway
// starts with no registrations.
func TestRegistrationsSurviveARestart(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "registrations.json")
	cfg := writeTemp(t, "gw.yaml", stateConfig(state))
	client := &http.Client{Timeout: 10 * time.Second}

	p1 := startGatewayProc(t, cfg)
	a := registeringFake(t, "enc-a", p1.boot)
	serveFrom(t, client, p1, "before the restart", a)

	// Graceful: SIGTERM writes the file at shutdown.
	stopProc(t, p1, syscall.SIGTERM)
	if _, ok := p1.logLine("registrations written to bootstrap.state_file", 0); !ok {
		t.Fatalf("no final write at shutdown:\n%s", p1.log())
	}
	p2 := startGatewayProc(t, cfg)
	serveFrom(t, client, p2, "after a graceful restart", a)
	if line, ok := p2.logLine("restored registrations from bootstrap.state_file", 0); !ok || fmt.Sprint(line["urls"]) != fmt.Sprint([]any{a.URL()}) {
		t.Fatalf("restore line %v:\n%s", line, p2.log())
	}

	// Crash: an encoder registers with p2, the file written on change
	// holds it, and p2 is killed, with no last write.
	b := registeringFake(t, "enc-b", p2.boot)
	poll(t, "the state file holding enc-b", func() bool {
		body, _ := os.ReadFile(state)
		return strings.Contains(string(body), `"`+b.URL()+`"`)
	})
	stopProc(t, p2, syscall.SIGKILL)
	p3 := startGatewayProc(t, cfg)
	serveFrom(t, client, p3, "after a crash", a, b)
	for _, e := range []*fakeencoder.Encoder{a, b} {
		if st := e.Stats(); st.RegistrationsOK != 1 || st.RegistrationAttempts != 1 {
			t.Errorf("%s registered %d times in %d attempts, want once: it never had to again", e.URL(), st.RegistrationsOK, st.RegistrationAttempts)
		}
	}

	// Corrupt: the file is set aside, and the gateway starts empty.
	stopProc(t, p3, syscall.SIGKILL)
	if err := os.WriteFile(state, []byte("{\"version\":1,\"saved_at\":"), 0o600); err != nil {
		t.Fatal(err)
	}
	p4 := startGatewayProc(t, cfg)
	if _, ok := p4.logLine("bootstrap.state_file is not a state file; starting with no registrations, the file set aside", 0); !ok {
		t.Fatalf("no warning about the corrupt file:\n%s", p4.log())
	}
	if got := usableRegistered(t, client, p4); len(got) != 0 {
		t.Fatalf("registered encoders from a corrupt file: %v", got)
	}
	if body, err := os.ReadFile(state + ".corrupt"); err != nil || string(body) != "{\"version\":1,\"saved_at\":" {
		t.Fatalf("the corrupt file set aside: %q %v", body, err)
	}
	// It takes registrations again, and keeps them.
	c := registeringFake(t, "enc-c", p4.boot)
	serveFrom(t, client, p4, "after a corrupt file", c)
}

// TestStateFileWithRedisIsRefused: the Redis store keeps registrations
// itself, so a state file beside it is a config error naming the field.
func TestStateFileWithRedisIsRefused(t *testing.T) {
	cfg := writeTemp(t, "gw.yaml", stateConfig(filepath.Join(t.TempDir(), "s.json"))+
		"idempotency:\n  store: redis\nredis:\n  addr: 127.0.0.1:1\n")
	code, _, stderr := runCmd("gateway", "--config", cfg, "--check")
	if code == 0 || !strings.Contains(stderr, "bootstrap.state_file: is for the memory store") {
		t.Fatalf("--check: exit %d, stderr %s", code, stderr)
	}
}
