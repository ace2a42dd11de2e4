package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func runCmd(args ...string) (code int, stdout, stderr string) {
	var out, errb bytes.Buffer
	code = run(args, &out, &errb)
	return code, out.String(), errb.String()
}

// Every example config must load and validate with its role's --check:
// gateway*.yaml with `encgate gateway`, agent*.yaml with `encgate agent`.
// A file for an unknown role fails here until its check is added.
func TestEveryExampleConfigLoads(t *testing.T) {
	entries, err := os.ReadDir("configs")
	if err != nil {
		t.Fatal(err)
	}
	roles := map[string]int{}
	for _, e := range entries {
		name := e.Name()
		path := filepath.Join("configs", name)
		if e.IsDir() {
			t.Errorf("%s: unexpected directory in configs/", path)
			continue
		}
		role := ""
		for _, r := range []string{"gateway", "agent"} {
			if strings.HasPrefix(name, r) && filepath.Ext(name) == ".yaml" {
				role = r
			}
		}
		if role == "" {
			t.Errorf("%s: not a gateway*.yaml or agent*.yaml config; add a check for its role to this test", path)
			continue
		}
		roles[role]++
		t.Run(name, func(t *testing.T) {
			code, stdout, stderr := runCmd(role, "--config", path, "--check")
			if code != 0 {
				t.Fatalf("exit %d, stderr:\n%s", code, stderr)
			}
			if !strings.Contains(stdout, path+": valid") {
				t.Fatalf("stdout %q does not report the config valid", stdout)
			}
		})
	}
	for _, r := range []string{"gateway", "agent"} {
		if roles[r] == 0 {
			t.Errorf("configs/ has no %s config", r)
		}
	}
}

func writeTemp(t *testing.T, name, text string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestInvalidConfigListsEveryProblem(t *testing.T) {
	path := writeTemp(t, "bad.yaml", `
encoders:
  - name: enc-a
    url: "ftp://127.0.0.1:30001"
  - name: enc-b
    url: "http://127.0.0.1:30002"
affinity:
  pin_ttl: 0
limits:
  max_conns: 0
`)
	code, stdout, stderr := runCmd("gateway", "--config", path, "--check")
	if code != 2 {
		t.Fatalf("exit %d, want 2; stdout %q stderr %q", code, stdout, stderr)
	}
	if !strings.Contains(stderr, path+": invalid config") {
		t.Errorf("stderr does not name the file:\n%s", stderr)
	}
	for _, want := range []string{"  encoders[0].url: ", "  affinity.pin_ttl: ", "  limits.max_conns: "} {
		if !strings.Contains(stderr, want) {
			t.Errorf("stderr lacks %q:\n%s", want, stderr)
		}
	}
	if strings.Contains(stderr, "encoders[1]") {
		t.Errorf("stderr blames the valid encoders[1]:\n%s", stderr)
	}
	if stdout != "" {
		t.Errorf("stdout %q, want nothing for an invalid config", stdout)
	}
}

func TestUnknownConfigKeyIsNamed(t *testing.T) {
	path := writeTemp(t, "typo.yaml", `
encoders:
  - name: enc-a
    url: "http://127.0.0.1:30001"
affinity:
  pin_tll: 240s
`)
	code, _, stderr := runCmd("gateway", "--config", path, "--check")
	if code != 2 {
		t.Fatalf("exit %d, want 2; stderr %q", code, stderr)
	}
	if !strings.Contains(stderr, "pin_tll") {
		t.Fatalf("stderr does not name the unknown key pin_tll:\n%s", stderr)
	}
}

func TestCommandLineErrors(t *testing.T) {
	tests := []struct {
		name   string
		args   []string
		stderr string
	}{
		{"no command", nil, "usage:"},
		{"unknown command", []string{"frobnicate"}, `unknown command "frobnicate"`},
		{"gateway without --config", []string{"gateway", "--check"}, "--config is required"},
		{"gateway with an unknown flag", []string{"gateway", "--nope"}, "-nope"},
		{"missing config file", []string{"gateway", "--config", filepath.Join(t.TempDir(), "absent.yaml"), "--check"}, "absent.yaml"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, _, stderr := runCmd(tc.args...)
			if code != 2 {
				t.Fatalf("exit %d, want 2; stderr %q", code, stderr)
			}
			if !strings.Contains(stderr, tc.stderr) {
				t.Fatalf("stderr %q lacks %q", stderr, tc.stderr)
			}
		})
	}
}

func TestVersion(t *testing.T) {
	code, stdout, _ := runCmd("version")
	if code != 0 || !strings.HasPrefix(stdout, "encgate ") {
		t.Fatalf("exit %d, stdout %q", code, stdout)
	}
}

func TestDemo(t *testing.T) {
	code, stdout, stderr := runCmd("demo")
	if code != 0 {
		t.Fatalf("exit %d, stderr:\n%s", code, stderr)
	}
	if !strings.Contains(stdout, "affinity: 120 of 120") {
		t.Fatalf("demo output lacks full affinity:\n%s", stdout)
	}
	if !strings.Contains(stdout, "every /send with the gateway's agent token (0 refused)") {
		t.Fatalf("demo output lacks the agents' token line:\n%s", stdout)
	}
	for _, line := range []string{"registered itself through the bootstrap API", "0 of 24 new /encodes sent to it", "after its last req_id was released"} {
		if !strings.Contains(stdout, line) {
			t.Fatalf("demo output lacks the fleet phase (%q):\n%s", line, stdout)
		}
	}
}
