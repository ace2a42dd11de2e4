package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/encgate/encgate/internal/cuda"
	"github.com/encgate/encgate/internal/cuda/cudatest"
	"github.com/encgate/encgate/internal/testtool"
)

// These tests run gpucheck's whole flow, the one bench/gpu/run.sh runs on a
// GPU machine, against the fake CUDA driver (internal/cuda/testdata/
// fakecuda.c: device memory is POSIX shared memory, IPC handles cross
// processes, streams copy on worker threads). Real encgate and cudaexport
// binaries are built and started; only the driver is fake, because no GPU
// is here. FAKECUDA_COPY_DELAY_US makes every asynchronous copy slow, so a
// chunk's copy is still in flight while the chunks before it are written.

func TestMain(m *testing.M) { cudatest.Main(m) }

// binsEnv passes the directory with the built binaries to the children
// cudatest.InChild starts, so that they do not build again.
const binsEnv = "GPUCHECK_TEST_BINS"

func buildBins(t *testing.T) string {
	t.Helper()
	testtool.Need(t, "go", "golang-go") // to build encgate and cudaexport for the check
	dir := t.TempDir()
	for name, pkg := range map[string]string{
		"encgate":    "github.com/encgate/encgate",
		"cudaexport": "github.com/encgate/encgate/internal/cuda/cudaexport",
	} {
		// CGO_ENABLED=0, as bench/gpu/prepare.sh builds what the GPU machine runs.
		cmd := exec.Command("go", "build", "-o", filepath.Join(dir, name), pkg)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("go build %s: %v\n%s", pkg, err, out)
		}
	}
	return dir
}

// gpucheck runs the program's run with args after the binaries' flags.
func gpucheck(t *testing.T, lib string, args ...string) (code int, output string) {
	t.Helper()
	dir := os.Getenv(binsEnv)
	all := append([]string{"--encgate", filepath.Join(dir, "encgate"), "--exporter", filepath.Join(dir, "cudaexport"),
		"--library", lib}, args...)
	var stdout, stderr bytes.Buffer
	code = run(t.Context(), all, &stdout, &stderr)
	output = stdout.String() + stderr.String()
	t.Logf("gpucheck %s: exit %d\n%s", strings.Join(args, " "), code, output)
	return code, output
}

func TestGPUCheckAgainstTheFakeDriver(t *testing.T) {
	lib := cudatest.Fake(t)
	dir := os.Getenv(binsEnv)
	if dir == "" {
		dir = buildBins(t)
	}
	env := []string{"FAKECUDA_COPY_DELAY_US=300", binsEnv + "=" + dir}

	// 1 MiB and an odd size (3 MiB + 5 bytes: a one-byte dtype, and a last
	// chunk of 5 bytes), 64 KiB chunks triple-buffered: 16 and 49 chunks.
	t.Run("every-byte-verified", func(t *testing.T) {
		if !cudatest.InChild(t, env...) {
			return
		}
		out := filepath.Join(t.TempDir(), "results", "gpu.md")
		code, output := gpucheck(t, lib, "--sizes", "1MiB,3MiB+5", "--rounds", "2", "--chunks", "64KiB", "--buffers", "3", "--out", out)
		if code != 0 {
			t.Fatalf("gpucheck exited %d", code)
		}
		if !strings.Contains(output, "gpucheck: every byte verified: 2 end-to-end transfers (4194309 bytes)") {
			t.Errorf("the output does not say every byte of both transfers was verified")
		}
		for _, line := range []string{"size 1MiB, chunk 64KiB × 3: all 1048576 bytes", "size 3145733 B, chunk 64KiB × 3: all 3145733 bytes"} {
			if !strings.Contains(output, "verified: end to end (exporter → agent stage by handle → /send → receiver), "+line+" at the receiver match pattern 7\n") {
				t.Errorf("the output has no verified line for %q", line)
			}
		}
		results, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		// | size | chunk × buffers | DtoH chunked | DtoH whole | TCP | e2e | ratio | target | verified | rounds |
		num := `[0-9]+\.[0-9]{2}`
		for _, size := range []string{"1MiB", "3145733 B"} {
			row := regexp.MustCompile(`(?m)^\| ` + regexp.QuoteMeta(size) + ` \| 64KiB × 3 \| (` + num + ` \| ){5}(met|missed) \| yes \| ` + num + `, ` + num + ` \|$`)
			if n := len(row.FindAllString(string(results), -1)); n != 1 {
				t.Errorf("the results have %d rows for %s, want 1:\n%s", n, size, results)
			}
		}
		if !strings.Contains(output, string(results)) {
			t.Errorf("stdout does not hold the results file")
		}
	})

	// The exporter fills with seed 7 and gpucheck checks against 8: the
	// first byte where the two patterns differ must be named.
	t.Run("another-pattern-fails", func(t *testing.T) {
		if !cudatest.InChild(t, env...) {
			return
		}
		const size = 1 << 20
		first := int64(-1)
		for i := range int64(size) {
			if cuda.PatternByte(7, i) != cuda.PatternByte(8, i) {
				first = i
				break
			}
		}
		out := filepath.Join(t.TempDir(), "gpu.md")
		code, output := gpucheck(t, lib, "--sizes", "1MiB", "--rounds", "2", "--chunks", "64KiB", "--buffers", "3",
			"--pattern", "7", "--verify-seed", "8", "--out", out)
		if code == 0 {
			t.Fatal("gpucheck exited 0 with the exporter's pattern other than the one it checks against")
		}
		want := fmt.Sprintf("VERIFICATION FAILED: end to end (exporter → agent stage by handle → /send → receiver), size 1MiB, chunk 64KiB × 3: first bad byte at offset %d of %d", first, size)
		if !strings.Contains(output, want) {
			t.Errorf("the output does not say %q", want)
		}
		if strings.Contains(output, "gpucheck: every byte verified") {
			t.Error("the output says every byte was verified")
		}
		// What was measured before the wrong byte is still written, marked.
		results, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(results), "**The check FAILED.**") || !strings.Contains(string(results), want[len("VERIFICATION FAILED: "):]) ||
			!regexp.MustCompile(`(?m)^\| 1MiB \| 64KiB × 3 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| — \| — \| — \| no \|  \|$`).Match(results) {
			t.Errorf("the results do not show the failure:\n%s", results)
		}
	})

	// An agent that cannot start fails its pairs, not the run: the other
	// measurements still come back, and the exit status says it failed.
	t.Run("agent-fails-the-rest-is-measured", func(t *testing.T) {
		if !cudatest.InChild(t, env...) {
			return
		}
		broken := filepath.Join(t.TempDir(), "encgate")
		if err := os.WriteFile(broken, []byte("#!/bin/sh\necho 'no agent today' >&2\nexit 3\n"), 0o755); err != nil {
			t.Fatal(err)
		}
		out := filepath.Join(t.TempDir(), "gpu.md")
		code, output := gpucheck(t, lib, "--sizes", "1MiB", "--rounds", "1", "--chunks", "64KiB", "--buffers", "2,3", "--out", out, "--encgate", broken)
		if code != 1 {
			t.Fatalf("gpucheck exited %d, want 1", code)
		}
		if !strings.Contains(output, "FAILED: 2 step(s) failed") {
			t.Errorf("the output does not count the failed steps")
		}
		results, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range []string{"2", "3"} {
			row := regexp.MustCompile(`(?m)^\| 1MiB \| 64KiB × ` + b + ` \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| — \| — \| — \| no \|  \|$`)
			if !row.Match(results) {
				t.Errorf("no row for 64KiB × %s with the in-process figures and no end-to-end one:\n%s", b, results)
			}
		}
		if n := strings.Count(string(results), "the agent exited before listening: exit status 3"); n != 2 {
			t.Errorf("the results name the agent's failure %d times, want 2:\n%s", n, results)
		}
		if !strings.Contains(string(results), "no agent today") {
			t.Errorf("the results do not quote the agent's log")
		}
	})
}

func TestFlags(t *testing.T) {
	var stderr bytes.Buffer
	if code := run(context.Background(), []string{"--sizes", "0", "--buffers", "1", "--chunks", "1KiB"}, &stderr, &stderr); code != 2 {
		t.Fatalf("bad flags: exit %d, want 2", code)
	}
	for _, want := range []string{"--encgate is required", "--exporter is required", `"0": a size must be > 0`,
		"1KiB is outside transfer.chunk_bytes' range", `"1" is not an integer in transfer.buffers' range`} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("the complaint %q is missing from:\n%s", want, stderr.String())
		}
	}
	stderr.Reset()
	if code := run(context.Background(), []string{"-h"}, &stderr, &stderr); code != 2 {
		t.Fatalf("-h: exit %d", code)
	}
	if u := stderr.String(); strings.Contains(u, "verify-seed") || !strings.Contains(u, "--sizes") {
		t.Errorf("the usage text should list --sizes and not the hidden --verify-seed:\n%s", u)
	}

	o, err := parseFlags([]string{"--encgate", "e", "--exporter", "x", "--sizes", "3MiB+5, 8MiB", "--chunks", "1MiB,4MiB", "--buffers", "2,3"}, &stderr)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(o.sizes) != "[3145733 8388608]" || len(o.pairs) != 4 || o.verifySeed != o.seed {
		t.Errorf("parsed %+v", o)
	}
	for _, c := range []struct {
		size              int64
		tokens, dim, elem int64
		dtype             string
	}{
		{8 << 20, 1024, 4096, 2, "bfloat16"},
		{3<<20 + 5, 3<<20 + 5, 1, 1, "float8_e4m3fn"},
		{6, 3, 1, 2, "bfloat16"},
	} {
		tokens, dim, dtype := dims(c.size)
		if tokens != c.tokens || dim != c.dim || dtype != c.dtype || tokens*dim*c.elem != c.size {
			t.Errorf("dims(%d) = %d, %d, %s", c.size, tokens, dim, dtype)
		}
	}
}
