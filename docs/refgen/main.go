// Command refgen writes the configuration and metrics references,
// docs/reference/configuration.md and docs/reference/metrics.md, from the
// code: the config structs of the gateway and the agent (their yaml tags,
// DefaultConfig and the fields' doc comments) and the metrics both register
// on a fresh registry. Run it from anywhere in the module:
//
//	go run ./docs/refgen
//
// or `go generate ./docs/refgen`. TestReferencesUpToDate fails when the
// committed files differ from what it writes, and when a config field has
// no doc comment.
//
// Only this command imports gateway and gpuagent for the purpose; no library
// package imports it.
package main

//go:generate go run .

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// The references, relative to the module root.
const (
	configFile  = "docs/reference/configuration.md"
	metricsFile = "docs/reference/metrics.md"
)

// command is how to regenerate the references, as the drift test says.
const command = "go run ./docs/refgen"

func main() {
	root, mod, err := moduleRoot()
	if err != nil {
		fail(err)
	}
	files, err := generate(root, mod)
	if err != nil {
		// Nothing is written: the references would miss what is wrong.
		fail(err)
	}
	for _, f := range files {
		path := filepath.Join(root, f.path)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			fail(err)
		}
		if err := os.WriteFile(path, f.text, 0o644); err != nil {
			fail(err)
		}
		fmt.Printf("wrote %s\n", f.path)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "refgen:", err)
	os.Exit(1)
}

// file is one generated reference.
type file struct {
	path string // relative to the module root
	text []byte
}

// generate builds both references. Its error lists every config field
// without a doc comment, or what kept the metrics from being listed; the
// references come with it, as far as they could be built.
func generate(root, mod string) ([]file, error) {
	docs := newDocIndex(root, mod)
	cfg, cerr := configReference(docs)
	met, merr := metricsReference()
	return []file{{configFile, cfg}, {metricsFile, met}}, errors.Join(cerr, merr)
}

// moduleRoot finds the directory of go.mod above the working directory and
// the module path it declares.
func moduleRoot() (dir, mod string, err error) {
	dir, err = os.Getwd()
	if err != nil {
		return "", "", err
	}
	for {
		data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil {
			for line := range strings.SplitSeq(string(data), "\n") {
				if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "module "); ok {
					return dir, strings.Trim(strings.TrimSpace(rest), `"`), nil
				}
			}
			return "", "", fmt.Errorf("%s/go.mod declares no module", dir)
		}
		up := filepath.Dir(dir)
		if up == dir {
			return "", "", errors.New("no go.mod above the working directory")
		}
		dir = up
	}
}
