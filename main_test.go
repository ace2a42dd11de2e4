package main

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/encgate/encgate/fakeencoder"
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
		{"agent with an unknown flag", []string{"agent", "--nope"}, "-nope"},
		{"fake-encoder with an unknown flag", []string{"fake-encoder", "--nope"}, "-nope"},
		{"demo with an unknown flag", []string{"demo", "--nope"}, "-nope"},
		{"demo with an argument", []string{"demo", "now"}, `unexpected argument "now"`},
		{"help for an unknown command", []string{"help", "frobnicate"}, `unknown command "frobnicate"`},
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

// -h and --help print the command's description and every flag to stdout
// and exit 0; they never run the command (demo's would run a whole fleet).
func TestHelp(t *testing.T) {
	tests := []struct {
		args []string
		want []string // in stdout
	}{
		{[]string{"help"}, []string{"usage:", "encgate gateway --config FILE"}},
		{[]string{"-h"}, []string{"usage:"}},
		{[]string{"--help"}, []string{"usage:"}},
		{[]string{"gateway", "--help"}, []string{"usage: encgate gateway", "-config file", "-check"}},
		{[]string{"gateway", "-h"}, []string{"usage: encgate gateway", "-config file", "-check"}},
		{[]string{"agent", "--help"}, []string{"usage: encgate agent", "-config file", "-check"}},
		{[]string{"fake-encoder", "--help"}, []string{"usage: encgate fake-encoder", "-listen address", "-register-url URL", "-failure-rate"}},
		{[]string{"demo", "--help"}, []string{"usage: encgate demo", "takes no flags"}},
		{[]string{"help", "gateway"}, []string{"usage: encgate gateway", "-config file"}},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			code, stdout, stderr := runCmd(tc.args...)
			if code != 0 {
				t.Fatalf("exit %d, want 0; stderr %q", code, stderr)
			}
			if stderr != "" {
				t.Errorf("stderr %q, want nothing", stderr)
			}
			for _, w := range tc.want {
				if !strings.Contains(stdout, w) {
					t.Errorf("stdout lacks %q:\n%s", w, stdout)
				}
			}
			if strings.Contains(stdout, "done in") {
				t.Errorf("the command ran:\n%s", stdout)
			}
		})
	}
}

// Every flag a command defines is described in its --help.
func TestHelpDescribesEveryFlag(t *testing.T) {
	for _, cmd := range []string{"gateway", "agent", "fake-encoder"} {
		t.Run(cmd, func(t *testing.T) {
			_, stdout, _ := runCmd(cmd, "--help")
			var fs *flag.FlagSet
			switch cmd {
			case "gateway":
				fs = newFlagSet(cmd, gatewayHelp)
				fs.String("config", "", "")
				fs.Bool("check", false, "")
			case "agent":
				fs = newFlagSet(cmd, agentHelp)
				fs.String("config", "", "")
				fs.Bool("check", false, "")
			case "fake-encoder":
				fs = newFlagSet(cmd, fakeEncoderHelp)
				fs.String("listen", "", "")
				var o fakeencoder.Options
				o.BindFlags(fs)
			}
			n := 0
			fs.VisitAll(func(f *flag.Flag) {
				n++
				if !strings.Contains(stdout, "  -"+f.Name+" ") && !strings.Contains(stdout, "  -"+f.Name+"\n") {
					t.Errorf("--help does not describe -%s:\n%s", f.Name, stdout)
				}
			})
			if n == 0 {
				t.Fatal("no flags visited")
			}
		})
	}
}

func TestVersion(t *testing.T) {
	code, stdout, _ := runCmd("version")
	if code != 0 || !strings.HasPrefix(stdout, "encgate ") || !strings.Contains(stdout, "\ngo: go1.") {
		t.Fatalf("exit %d, stdout %q", code, stdout)
	}
}

func TestVersionText(t *testing.T) {
	vcs := &debug.BuildInfo{
		GoVersion: "go1.26.1",
		Main:      debug.Module{Path: "github.com/encgate/encgate", Version: "v0.0.0-20261205183523-f4246caf115d+dirty"},
		Settings: []debug.BuildSetting{
			{Key: "GOOS", Value: "linux"}, {Key: "GOARCH", Value: "arm64"},
			{Key: "vcs", Value: "git"},
			{Key: "vcs.revision", Value: "f4246caf115d469b2b27b3a576b93f05172e8473"},
			{Key: "vcs.time", Value: "2026-12-05T18:35:23Z"},
			{Key: "vcs.modified", Value: "true"},
		},
	}
	clean := &debug.BuildInfo{
		GoVersion: "go1.26.1",
		Main:      debug.Module{Path: "github.com/encgate/encgate", Version: "(devel)"},
		Settings: []debug.BuildSetting{
			{Key: "GOOS", Value: "linux"}, {Key: "GOARCH", Value: "amd64"},
			{Key: "vcs.revision", Value: "0123456789abcdef0123456789abcdef01234567"},
			{Key: "vcs.modified", Value: "false"},
		},
	}
	tests := []struct {
		name, ldVersion string
		bi              *debug.BuildInfo
		want            string
	}{
		{"ldflags version wins", "v1.2.3", vcs,
			"encgate v1.2.3\ncommit: f4246caf115d469b2b27b3a576b93f05172e8473 (dirty) 2026-12-05T18:35:23Z\ngo: go1.26.1 linux/arm64\n"},
		{"module version without ldflags", "", vcs,
			"encgate v0.0.0-20261205183523-f4246caf115d+dirty\ncommit: f4246caf115d469b2b27b3a576b93f05172e8473 (dirty) 2026-12-05T18:35:23Z\ngo: go1.26.1 linux/arm64\n"},
		{"ldflags dev wins over the module version (the image builder's default)", "dev", vcs,
			"encgate dev\ncommit: f4246caf115d469b2b27b3a576b93f05172e8473 (dirty) 2026-12-05T18:35:23Z\ngo: go1.26.1 linux/arm64\n"},
		{"clean tree, no time, (devel)", "", clean,
			"encgate dev\ncommit: 0123456789abcdef0123456789abcdef01234567\ngo: go1.26.1 linux/amd64\n"},
		{"no VCS", "", &debug.BuildInfo{GoVersion: "go1.26.1", Settings: []debug.BuildSetting{{Key: "GOOS", Value: "linux"}, {Key: "GOARCH", Value: "amd64"}}},
			"encgate dev\ncommit: unknown (built without VCS information)\ngo: go1.26.1 linux/amd64\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := versionText(tc.ldVersion, tc.bi); got != tc.want {
				t.Fatalf("got\n%s\nwant\n%s", got, tc.want)
			}
		})
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
