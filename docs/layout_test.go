package docs

import (
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// The house's floors (docs/development/layout.md): a package imports only
// from its own floor's tree and the floors below it, so no arrow runs back
// up. Tests may import anything (fakes, servers on loopback).
//
//	0  internal/...: the parts every floor uses
//	1  upstream, idempotency, discovery, gpuagent, fakeencoder: one concern each, never each other
//	2  fleet: the encoders of every source, feeding upstream's pool
//	3  gateway: the request path and its wiring
//	4  the binary (main), demo, e2e, bench, deploy, docs
var floors = []struct {
	prefix string
	floor  int
}{
	{"internal/", 0},
	{"upstream", 1}, {"idempotency", 1}, {"discovery", 1}, {"gpuagent", 1}, {"fakeencoder", 1},
	{"fleet", 2},
	{"gateway", 3},
	{"", 4}, // the module root and everything not named above
}

const module = "github.com/encgate/encgate"

// floorOf returns a package's floor and the tree it belongs to (the
// prefix that placed it; "" for the top floor).
func floorOf(pkg string) (int, string) {
	for _, f := range floors {
		if f.prefix == "" || pkg == f.prefix || strings.HasPrefix(pkg, strings.TrimSuffix(f.prefix, "/")+"/") {
			return f.floor, f.prefix
		}
	}
	return 4, ""
}

// allowed says whether pkg may import dep: a lower floor, its own tree, or
// on floor 0 any other internal package.
func allowed(pkg, dep string) bool {
	pf, ptree := floorOf(pkg)
	df, dtree := floorOf(dep)
	switch {
	case df < pf:
		return true
	case df > pf:
		return false
	case pf == 0 || pf == 4:
		return true
	}
	return ptree == dtree
}

func TestNoArrowRunsBackUp(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	cmd := exec.Command(goBin, "list", "-f", `{{.ImportPath}}{{range .Imports}} {{.}}{{end}}`, module+"/...")
	cmd.Dir = ".."
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	pkgs := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		pkg := strings.TrimPrefix(strings.TrimPrefix(f[0], module), "/")
		pkgs++
		for _, d := range f[1:] {
			if !strings.HasPrefix(d, module+"/") {
				continue
			}
			dep := strings.TrimPrefix(d, module+"/")
			if !allowed(pkg, dep) {
				pf, _ := floorOf(pkg)
				df, _ := floorOf(dep)
				t.Errorf("%s (floor %d) imports %s (floor %d): an arrow running back up or across", pkg, pf, dep, df)
			}
		}
	}
	if pkgs < 20 {
		t.Fatalf("go list named %d packages; the module has more", pkgs)
	}
}

func TestFloorRules(t *testing.T) {
	for _, c := range []struct {
		pkg, dep string
		ok       bool
	}{
		{"gateway", "upstream", true},
		{"gateway", "internal/listener", true},
		{"upstream", "gateway", false},
		{"upstream", "idempotency", false},
		{"internal/listener", "upstream", false},
		{"gpuagent", "gpuagent/mooncake", true},
		{"gpuagent/mooncake", "gpuagent", true},
		{"fleet", "discovery", true},
		{"discovery", "fleet", false},
		{"fleet", "gateway", false},
		{"demo", "gateway", true},
		{"", "gateway", true},
		{"internal/admin", "internal/sglang", true},
	} {
		if got := allowed(c.pkg, c.dep); got != c.ok {
			t.Errorf("allowed(%q, %q) = %v, want %v", c.pkg, c.dep, got, c.ok)
		}
	}
}
