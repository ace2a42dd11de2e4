package upstream

import (
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/sglang"
)

// authRecorder is a server that answers 200 and records the Authorization
// header ("" when absent) of every request, by path.
type authRecorder struct {
	*httptest.Server
	mu   sync.Mutex
	auth map[string][]string
}

func newAuthRecorder(t *testing.T) *authRecorder {
	t.Helper()
	r := &authRecorder{auth: map[string][]string{}}
	r.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.mu.Lock()
		r.auth[req.URL.Path] = append(r.auth[req.URL.Path], req.Header.Get("Authorization"))
		r.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte("null"))
	}))
	t.Cleanup(r.Close)
	return r
}

// last is the Authorization header of the latest request to path.
func (r *authRecorder) last(t *testing.T, path string) string {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	a := r.auth[path]
	if len(a) == 0 {
		t.Fatalf("%s received no %s", r.URL, path)
	}
	return a[len(a)-1]
}

func writeTokenFile(t *testing.T, path, token string, mode os.FileMode) {
	t.Helper()
	if err := os.WriteFile(path, []byte(token+"\n"), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
}

// The agent gets agent_token_file's token on every /send; the encoder never
// gets one. A reload after the file is rewritten sends the new token,
// keeping the encoder (its pins) in place; a reload whose file cannot be
// read changes nothing; one without the file stops sending a token.
func TestAgentTokenGoesToTheAgentOnly(t *testing.T) {
	enc, agent := newAuthRecorder(t), newAuthRecorder(t)
	file := filepath.Join(t.TempDir(), "agent.token")
	writeTokenFile(t, file, "first-token-0123456789", 0o600)
	set := testSettings("a", enc.URL)
	set.Encoders[0].Agent, set.Encoders[0].AgentTokenFile = agent.URL, file
	p := newTestPool(t, set, prometheus.NewRegistry())

	exchange := func(rt *sglang.Route, id string) {
		t.Helper()
		if res := p.Exchange(newCall(rt, id)); res.Verdict.Kind != KindAnswered || res.Verdict.Status != 200 {
			t.Fatalf("%s %s: %+v", rt.Path, id, res.Verdict)
		}
	}
	exchange(sglang.RouteEncode, "r1")
	exchange(sglang.RouteMetadata, "r1")
	exchange(sglang.RouteSend, "r1")
	if got := agent.last(t, "/send"); got != "Bearer first-token-0123456789" {
		t.Errorf("the agent's /send carried Authorization %q", got)
	}
	for _, path := range []string{"/encode", "/scheduler_receive_meta_data"} {
		if got := enc.last(t, path); got != "" {
			t.Errorf("the encoder's %s carried Authorization %q", path, got)
		}
	}

	before, _ := p.Lookup("a")
	writeTokenFile(t, file, "second-token-0123456789", 0o600)
	if added, removed, err := p.Reload(set); err != nil || len(added)+len(removed) != 0 {
		t.Fatalf("Reload: added %v removed %v: %v", added, removed, err)
	}
	if after, _ := p.Lookup("a"); after != before || p.pins.CountByEncoder()["a"] != 1 {
		t.Fatalf("the token's reload rebuilt the encoder or lost its pin (%v)", p.pins.CountByEncoder())
	}
	exchange(sglang.RouteSend, "r1")
	if got := agent.last(t, "/send"); got != "Bearer second-token-0123456789" {
		t.Errorf("after the reload the agent's /send carried Authorization %q", got)
	}

	writeTokenFile(t, file, "third-token-0123456789", 0o644)
	if _, _, err := p.Reload(set); err == nil || !strings.Contains(err.Error(), "encoder a: agent_token_file: token file "+file+" has mode 0644") ||
		strings.Contains(err.Error(), "third-token") {
		t.Fatalf("Reload with an open token file: %v", err)
	}
	exchange(sglang.RouteSend, "r1")
	if got := agent.last(t, "/send"); got != "Bearer second-token-0123456789" {
		t.Errorf("a refused reload changed the token: %q", got)
	}

	none := testSettings("a", enc.URL)
	none.Encoders[0].Agent = agent.URL
	if _, _, err := p.Reload(none); err != nil {
		t.Fatal(err)
	}
	exchange(sglang.RouteSend, "r1")
	if got := agent.last(t, "/send"); got != "" {
		t.Errorf("without agent_token_file the agent's /send carried Authorization %q", got)
	}
}

func TestNewPoolRefusesAnUnreadableAgentTokenFile(t *testing.T) {
	set := testSettings("a", "http://127.0.0.1:1")
	set.Encoders[0].Agent = "http://127.0.0.1:2"
	set.Encoders[0].AgentTokenFile = filepath.Join(t.TempDir(), "missing")
	if _, err := NewPool(set, DefaultAffinity(), Deps{Registry: prometheus.NewRegistry()}); err == nil ||
		!strings.Contains(err.Error(), "encoder a: agent_token_file: open ") {
		t.Fatalf("NewPool = %v", err)
	}
}

func TestValidateAgentTokenFile(t *testing.T) {
	dir := t.TempDir()
	good, open := filepath.Join(dir, "good"), filepath.Join(dir, "open")
	writeTokenFile(t, good, "valid-token-0123456789", 0o640)
	writeTokenFile(t, open, "valid-token-0123456789", 0o604)
	missing := filepath.Join(dir, "missing")
	encs := []EncoderConfig{
		{Name: "ok", URL: "http://h:1", Agent: "http://h:7401", AgentTokenFile: good},
		{Name: "noagent", URL: "http://h:2", AgentTokenFile: good},
		{Name: "missing", URL: "http://h:3", Agent: "http://h:7401", AgentTokenFile: missing},
		{Name: "open", URL: "http://h:4", Agent: "http://h:7401", AgentTokenFile: open},
	}
	var p configfile.Problems
	ValidateEncoders(&p, "encoders", encs)
	err := p.Err()
	if err == nil {
		t.Fatal("no problem")
	}
	for _, w := range []string{
		"encoders[1].agent_token_file: needs agent",
		"encoders[2].agent_token_file: open " + missing + ": no such file or directory",
		"encoders[3].agent_token_file: token file " + open + " has mode 0604, which grants others access: chmod 600 (or 640) it",
	} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%q missing from:\n%v", w, err)
		}
	}
	if strings.Contains(err.Error(), "encoders[0]") || strings.Contains(err.Error(), "valid-token") {
		t.Errorf("unexpected problem:\n%v", err)
	}
}

// An encoder or agent URL written as host:port gets a hint with the URL
// probably meant; a wrong scheme keeps its own problem.
func TestValidateEncodersHintsAMissingScheme(t *testing.T) {
	var p configfile.Problems
	ValidateEncoders(&p, "encoders", []EncoderConfig{
		{Name: "a", URL: "10.0.0.5:30000"},
		{Name: "b", URL: "http://enc-1:30000", Agent: "enc-1:7401"},
		{Name: "c", URL: "ftp://enc-2:30000"},
	})
	err := p.Err()
	if err == nil {
		t.Fatal("no problem")
	}
	for _, w := range []string{
		`encoders[0].url: "10.0.0.5:30000" has no scheme; did you mean "http://10.0.0.5:30000"?`,
		`encoders[1].agent: "enc-1:7401" has no scheme; did you mean "http://enc-1:7401"?`,
		`encoders[2].url: scheme must be http or https, got "ftp"`,
	} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%q missing from:\n%v", w, err)
		}
	}
}
