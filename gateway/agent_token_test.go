package gateway

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// header is the header set of the latest request s received on path.
func (s *scripted) header(path string) http.Header {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.headers[path]
}

// postAuth posts body to url with the given Authorization header.
func postAuth(t *testing.T, url, body, authorization string) answer {
	t.Helper()
	return doWith(t, http.MethodPost, url, body, http.Header{"Authorization": {authorization}})
}

func writeAgentToken(t *testing.T, path, token string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
}

// With encoders[].agent_token_file, the gateway's /sends to the agent carry
// the file's token as "Authorization: Bearer", in place of any the caller
// sent; the encoder never gets an Authorization header. Rewriting the file
// and reloading sends the new token; neither the admin view nor the log
// ever shows a token.
func TestAgentTokenFileAuthorizesSendsToTheAgent(t *testing.T) {
	const first, second = "agent-token-first-0123", "agent-token-second-0123"
	enc, agent := newScripted(t), newScripted(t)
	file := filepath.Join(t.TempDir(), "agent.token")
	writeAgentToken(t, file, first)
	g, logs := startGatewayLogged(t, []string{enc.URL}, func(c *Config) {
		c.Encoders[0].Agent, c.Encoders[0].AgentTokenFile = agent.URL, file
	})

	send := func(id, want string) {
		t.Helper()
		for path, body := range map[string]string{"/encode": encodeBody(id), "/scheduler_receive_meta_data": metaBody(id)} {
			if a := postAuth(t, g.base+path, body, "Bearer attacker"); a.status != 200 {
				t.Fatalf("%s %s: %d %s", path, id, a.status, a.body)
			}
			if h := enc.header(path).Values("Authorization"); len(h) != 0 {
				t.Errorf("the encoder's %s carried Authorization %q", path, h)
			}
		}
		if a := postAuth(t, g.base+"/send", tpSend(id, 0, 2), "Bearer attacker"); a.status != 200 {
			t.Fatalf("/send %s: %d %s", id, a.status, a.body)
		}
		if h := agent.header("/send").Values("Authorization"); len(h) != 1 || h[0] != "Bearer "+want {
			t.Errorf("the agent's /send of %s carried Authorization %q, want the file's token", id, h)
		}
	}
	send("tok1_local_part_0", first)
	pinsBefore := upstreamRows(t, g)[0].Pins

	writeAgentToken(t, file, second)
	if err := g.Reload(nextConfig(g)); err != nil {
		t.Fatalf("Reload: %v", err)
	}
	if p := upstreamRows(t, g)[0].Pins; p != pinsBefore || p == 0 {
		t.Errorf("the encoder's pins went from %d to %d over the token's reload", pinsBefore, p)
	}
	send("tok2_local_part_0", second)
	if n := len(agent.received("/send")); n != 2 {
		t.Errorf("the agent received %d /sends, want 2", n)
	}

	admin := do(t, http.MethodGet, g.admin+"/admin/upstreams", "")
	for _, tok := range []string{first, second} {
		if strings.Contains(admin.body, tok) {
			t.Errorf("/admin/upstreams shows the token: %s", admin.body)
		}
		for _, e := range logs.All() {
			if line := fmt.Sprint(e.Message, e.ContextMap()); strings.Contains(line, tok) {
				t.Errorf("the log shows the token: %s", line)
			}
		}
	}
}

// A reload whose token file became unreadable is refused; the running
// token stays.
func TestReloadRefusesAnOpenAgentTokenFile(t *testing.T) {
	enc, agent := newScripted(t), newScripted(t)
	file := filepath.Join(t.TempDir(), "agent.token")
	writeAgentToken(t, file, "agent-token-kept-0123")
	g := startGateway(t, []string{enc.URL}, func(c *Config) {
		c.Encoders[0].Agent, c.Encoders[0].AgentTokenFile = agent.URL, file
	})
	if err := os.Chmod(file, 0o644); err != nil {
		t.Fatal(err)
	}
	err := g.Reload(nextConfig(g))
	if err == nil || !strings.Contains(err.Error(), "encoders[0].agent_token_file: token file "+file+" has mode 0644") {
		t.Fatalf("Reload = %v", err)
	}
	if strings.Contains(err.Error(), "agent-token-kept") {
		t.Fatalf("the error shows the token: %v", err)
	}
	id := "kept_local_part_0"
	if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 {
		t.Fatalf("/encode: %d", a.status)
	}
	if a := post(t, g.base+"/send", tpSend(id, 0, 1)); a.status != 200 {
		t.Fatalf("/send: %d %s", a.status, a.body)
	}
	if h := agent.header("/send").Get("Authorization"); h != "Bearer agent-token-kept-0123" {
		t.Errorf("after the refused reload the agent got Authorization %q", h)
	}
}

func TestAgentTokenFileIsValidated(t *testing.T) {
	dir := t.TempDir()
	open := filepath.Join(dir, "open")
	if err := os.WriteFile(open, []byte("agent-token-0123456789\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o644); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing")
	c := validConfig()
	c.Encoders[0].AgentTokenFile = open // no agent
	c.Encoders[1].Agent, c.Encoders[1].AgentTokenFile = "http://127.0.0.1:7401", missing
	c.Encoders = append(c.Encoders, c.Encoders[1])
	c.Encoders[2].Name, c.Encoders[2].URL, c.Encoders[2].AgentTokenFile = "enc-c", "http://127.0.0.1:30003", open
	err := c.Validate()
	if err == nil {
		t.Fatal("valid")
	}
	for _, w := range []string{
		"encoders[0].agent_token_file: needs agent",
		"encoders[1].agent_token_file: open " + missing + ": no such file or directory",
		"encoders[2].agent_token_file: token file " + open + " has mode 0644, which grants others access: chmod 600 (or 640) it",
	} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%q missing from:\n%v", w, err)
		}
	}
	if strings.Contains(err.Error(), "agent-token-0123456789") {
		t.Errorf("a problem shows the token:\n%v", err)
	}

	// The key decodes from YAML and a valid file passes.
	if err := os.Chmod(open, 0o600); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "gateway.yaml")
	body := fmt.Sprintf("encoders:\n  - {name: a, url: \"http://127.0.0.1:30001\", agent: \"http://127.0.0.1:7401\", agent_token_file: %q}\n", open)
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(path)
	if err != nil || cfg.Encoders[0].AgentTokenFile != open {
		t.Fatalf("LoadConfig: %v (%+v)", err, cfg.Encoders)
	}
}
