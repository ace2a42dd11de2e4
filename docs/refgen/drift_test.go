package main

import (
	"os"
	"path/filepath"
	"testing"
)

// The committed references are what the code generates now: a config key
// or a metric added, changed or removed without regenerating them fails
// here, and so does a config field without a doc comment.
func TestReferencesUpToDate(t *testing.T) {
	root, mod, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	files, err := generate(root, mod)
	if err != nil {
		t.Errorf("the references cannot be generated:\n%v", err)
	}
	for _, f := range files {
		committed, err := os.ReadFile(filepath.Join(root, f.path))
		if err != nil {
			t.Errorf("%s: %v: run `%s`", f.path, err, command)
			continue
		}
		if d := diff(string(committed), string(f.text)); d != "" {
			t.Errorf("%s is stale: run `%s`\n--- committed\n+++ generated\n%s", f.path, command, d)
		}
	}
}
