// Package cudatest builds the fake CUDA driver (internal/cuda/testdata/
// fakecuda.c) for tests of package cuda and its users, and runs a test in a
// child process where the fake's environment must be set before it loads.
package cudatest

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/encgate/encgate/internal/testtool"
)

// childEnv marks a child started by InChild; libEnv passes built libraries
// (variant=path;...) down to children so that they do not build again.
const (
	childEnv = "CUDATEST_CHILD"
	libEnv   = "CUDATEST_FAKECUDA"
)

var (
	mu    sync.Mutex
	built = map[string]string{} // variant key -> library path
	dirs  []string              // made by this process, removed by Main
)

// Fake returns the path of the fake driver, libcuda.so.1 in a temporary
// directory, built once per test binary with the C compiler ($CC, else cc,
// gcc or clang). Without a C compiler it skips the test, saying so.
func Fake(t testing.TB) string { return FakeVariant(t) }

// FakeVariant is Fake with preprocessor symbols defined (see fakecuda.c:
// "FAKECUDA_LEGACY_NAMES", "FAKECUDA_OMIT_EVENT_QUERY"); each variant is
// built once, in its own directory.
func FakeVariant(t testing.TB, defines ...string) string {
	t.Helper()
	defines = append([]string(nil), defines...)
	sort.Strings(defines)
	key := strings.Join(defines, ",")

	mu.Lock()
	defer mu.Unlock()
	if p, ok := built[key]; ok {
		return p
	}
	if p := inherited(key); p != "" {
		built[key] = p
		return p
	}
	cc := compiler()
	if cc == "" {
		testtool.Missing(t, "a C compiler ($CC, cc, gcc or clang on PATH)", "gcc libc6-dev", "cannot build the fake CUDA driver (internal/cuda/testdata/fakecuda.c)")
	}
	src, err := source()
	if err != nil {
		t.Fatalf("cudatest: %v", err)
	}
	sweepDead()
	dir, err := os.MkdirTemp("", "fakecuda-"+strconv.Itoa(os.Getpid())+"-")
	if err != nil {
		t.Fatalf("cudatest: %v", err)
	}
	dirs = append(dirs, dir)
	lib := filepath.Join(dir, "libcuda.so.1")
	args := []string{"-shared", "-fPIC", "-O2", "-pthread"}
	for _, d := range defines {
		args = append(args, "-D"+d)
	}
	args = append(args, "-o", lib, src)
	if out, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
		t.Fatalf("cudatest: building the fake CUDA driver: %s %s: %v\n%s", cc, strings.Join(args, " "), err, out)
	}
	built[key] = lib
	return lib
}

func compiler() string {
	if cc := os.Getenv("CC"); cc != "" {
		if p, err := exec.LookPath(strings.Fields(cc)[0]); err == nil {
			return p
		}
	}
	for _, cc := range []string{"cc", "gcc", "clang"} {
		if p, err := exec.LookPath(cc); err == nil {
			return p
		}
	}
	return ""
}

// source finds fakecuda.c: next to this file's package in the source tree,
// else relative to the test's directory (internal/cuda or below it).
func source() (string, error) {
	var tries []string
	if _, file, _, ok := runtime.Caller(0); ok {
		tries = append(tries, filepath.Join(filepath.Dir(file), "..", "testdata", "fakecuda.c"))
	}
	tries = append(tries, filepath.Join("testdata", "fakecuda.c"), filepath.Join("..", "testdata", "fakecuda.c"))
	for _, p := range tries {
		if _, err := os.Stat(p); err == nil {
			return filepath.Abs(p)
		}
	}
	return "", &os.PathError{Op: "find", Path: "internal/cuda/testdata/fakecuda.c", Err: os.ErrNotExist}
}

// inherited is the library a parent built for key, if it passed one down.
func inherited(key string) string {
	for _, kv := range strings.Split(os.Getenv(libEnv), ";") {
		k, p, ok := strings.Cut(kv, "=")
		if ok && k == key {
			if _, err := os.Stat(p); err == nil {
				return p
			}
		}
	}
	return ""
}

func builtEnv() string {
	mu.Lock()
	defer mu.Unlock()
	var kv []string
	for k, p := range built {
		kv = append(kv, k+"="+p)
	}
	return libEnv + "=" + strings.Join(kv, ";")
}

// NoRaceExitSleep is the environment entry that stops a program built with
// -race from sleeping a second when it exits (GORACE's atexit_sleep_ms);
// add it to the environment of children that are test binaries.
const NoRaceExitSleep = "GORACE=atexit_sleep_ms=0"

// sweepDead removes the build directories of test binaries that died
// before Main could remove them (fakecuda-<pid>-*, the pid gone).
func sweepDead() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), "fakecuda-*-*"))
	for _, d := range dirs {
		pid, err := strconv.Atoi(strings.SplitN(strings.TrimPrefix(filepath.Base(d), "fakecuda-"), "-", 2)[0])
		if err == nil && pid > 0 && pid != os.Getpid() && !alive(pid) {
			os.RemoveAll(d)
		}
	}
}

// Main runs the tests and then removes the libraries this process built;
// call it from TestMain.
func Main(m *testing.M) {
	code := m.Run()
	mu.Lock()
	for _, d := range dirs {
		os.RemoveAll(d)
	}
	mu.Unlock()
	os.Exit(code)
}

// InChild reports whether this is the child process running t. If not, it
// runs t again in a child (this test binary, -test.run selecting t only)
// with env (KEY=value...) added, fails t if the child fails, and returns
// false: the caller returns and lets the child do the work.
//
//	if !cudatest.InChild(t, "FAKECUDA_DEVICES=0") {
//		return
//	}
func InChild(t *testing.T, env ...string) bool {
	t.Helper()
	if os.Getenv(childEnv) == t.Name() {
		return true
	}
	parts := strings.Split(t.Name(), "/")
	for i, p := range parts {
		parts[i] = "^" + regexp.QuoteMeta(p) + "$"
	}
	args := []string{"-test.run=" + strings.Join(parts, "/"), "-test.count=1"}
	if testing.Verbose() {
		args = append(args, "-test.v")
	}
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), childEnv+"="+t.Name(), builtEnv())
	cmd.Env = append(cmd.Env, env...)
	if os.Getenv("GORACE") == "" {
		cmd.Env = append(cmd.Env, NoRaceExitSleep) // a child built with -race would idle a second at exit
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the child running %s with %s failed: %v\n%s", t.Name(), strings.Join(env, " "), err, out)
	}
	if strings.Contains(string(out), "no tests to run") {
		t.Fatalf("the child ran no test for %s:\n%s", t.Name(), out)
	}
	if testing.Verbose() {
		t.Logf("child output:\n%s", out)
	}
	return false
}
