package main

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

const sample = `# The file's own comment, which the header replaces.

groups:
  - name: g
    rules:
      # A comment on the rule stays.
      - alert: A
        expr: >-
          sum by (job) (x)

          > 0
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: "a {{ $labels.job }}"
          description: |
            Two lines,
              one indented.
`

func TestRenderMovesTheGroupsUnderSpec(t *testing.T) {
	out, err := Render([]byte(sample))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(out), header) {
		t.Errorf("the output does not begin with the header:\n%s", out)
	}
	if strings.Contains(string(out), "the header replaces") {
		t.Error("the rule file's own head comment was copied")
	}
	if !strings.Contains(string(out), "\n        # A comment on the rule stays.\n") {
		t.Errorf("the rule's comment is not kept, two spaces deeper:\n%s", out)
	}
	got, err := Groups(out, true)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := Groups([]byte(sample), false)
	if !reflect.DeepEqual(got, want) {
		t.Errorf("spec.groups %v, want %v", got, want)
	}
	again, err := Render([]byte(sample))
	if err != nil || !bytes.Equal(again, out) {
		t.Errorf("a second render differs: %v", err)
	}
}

func TestRenderRefusesWhatIsNotARuleFile(t *testing.T) {
	for name, src := range map[string]string{
		"no groups":        "# only a comment\n",
		"a key before":     "rules: []\ngroups: []\n",
		"a key after":      "groups:\n  - name: g\n    rules: []\nextra: 1\n",
		"a second doc":     "groups: []\n---\ngroups: []\n",
		"groups not a key": "groups: [{name: g, rules: []}] # inline\n",
	} {
		if _, err := Render([]byte(src)); err == nil {
			t.Errorf("%s: rendered without an error", name)
		}
	}
}

// TestCommittedRuleIsCurrent: the committed PrometheusRule is byte for byte
// what alerts.yaml gives.
func TestCommittedRuleIsCurrent(t *testing.T) {
	root := filepath.Join("..", "..")
	src, err := os.ReadFile(filepath.Join(root, alertsPath))
	if err != nil {
		t.Fatal(err)
	}
	want, err := Render(src)
	if err != nil {
		t.Fatal(err)
	}
	have, err := os.ReadFile(filepath.Join(root, rulePath))
	if err != nil {
		t.Fatalf("%v: run %s", err, Command)
	}
	if !bytes.Equal(have, want) {
		t.Errorf("%s is not what %s gives: run %s", rulePath, alertsPath, Command)
	}
}

func TestRunCheck(t *testing.T) {
	var stderr bytes.Buffer
	if code := run([]string{"-check"}, &stderr); code != 0 {
		t.Errorf("-check on the committed files: exit %d: %s", code, stderr.String())
	}
	if code := run([]string{"extra"}, &stderr); code != 2 {
		t.Errorf("an argument: exit %d, want 2", code)
	}
}
