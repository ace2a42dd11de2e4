package docs

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/encgate/encgate/gateway"
)

// section returns the lines of README.md's "## title" section.
func section(t *testing.T, title string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	in := false
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "## ") {
			in = l == "## "+title
			continue
		}
		if in {
			out = append(out, l)
		}
	}
	if out == nil {
		t.Fatalf("README.md has no section %q", title)
	}
	return out
}

// firstBlock returns the first fenced code block of lang in lines.
func firstBlock(t *testing.T, lines []string, lang string) string {
	t.Helper()
	var b strings.Builder
	in := false
	for _, l := range lines {
		switch {
		case !in && l == "```"+lang:
			in = true
		case in && l == "```":
			return b.String()
		case in:
			b.WriteString(l + "\n")
		}
	}
	t.Fatalf("no ```%s block", lang)
	return ""
}

// TestReadmeMinimalConfigLoads: the README's minimal config is a valid
// gateway config.
func TestReadmeMinimalConfigLoads(t *testing.T) {
	text := firstBlock(t, section(t, "A minimal config"), "yaml")
	path := filepath.Join(t.TempDir(), "gateway.yaml")
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := gateway.LoadConfig(path)
	if err != nil {
		t.Fatalf("the README's minimal config does not load:\n%s\n%v", text, err)
	}
	if len(cfg.Encoders) == 0 {
		t.Error("the README's minimal config has no encoders")
	}
}

// TestReadmeTestCommandIsCIs: the test command the README gives is the one
// .ci/run runs, exactly.
func TestReadmeTestCommandIsCIs(t *testing.T) {
	ci, err := os.ReadFile(filepath.Join(root, ".ci", "run"))
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(ci), "\n")
	cmd := ""
	// The first "go test" line after the comment that names it (the
	// comment may go on, and variables may be set, in between).
	for i, l := range lines {
		if !strings.Contains(l, "The README's test command, exactly") {
			continue
		}
		for _, next := range lines[i+1:] {
			if strings.HasPrefix(strings.TrimSpace(next), "go test") {
				cmd = strings.TrimSpace(next)
				break
			}
		}
		break
	}
	if cmd == "" {
		t.Fatal(".ci/run has no go test line after \"# The README's test command, exactly\"")
	}
	block := firstBlock(t, section(t, "The two commands"), "sh")
	for _, l := range strings.Split(block, "\n") {
		if strings.HasPrefix(l, cmd+" ") || l == cmd {
			return
		}
	}
	t.Errorf("README.md's two commands do not include .ci/run's test command %q:\n%s", cmd, block)
}
