//go:build linux && !nocuda

package main

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/encgate/encgate/internal/cuda"
	"github.com/encgate/encgate/internal/cuda/cudatest"
)

// asMain makes this test binary run as cudaexport, for the exporting process.
const asMain = "CUDAEXPORT_AS_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(asMain) == "1" {
		os.Exit(run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
	}
	cudatest.Main(m)
}

func shmObjects(t *testing.T, pid int) []string {
	t.Helper()
	m, err := filepath.Glob("/dev/shm/fakecuda." + strconv.Itoa(pid) + ".*")
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestCrossProcessIPC starts cudaexport in another process, opens its
// handle here and reads the pattern back, synchronously and through a
// stream.
func TestCrossProcessIPC(t *testing.T) {
	lib := cudatest.Fake(t)
	const size, seed = 3<<20 + 17, 99
	cmd := exec.Command(os.Args[0], "--library", lib, "--device", "0", "--bytes", strconv.Itoa(size), "--pattern", strconv.Itoa(seed))
	cmd.Env = append(os.Environ(), asMain+"=1", cudatest.NoRaceExitSleep)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := false
	defer func() {
		if !exited {
			stdin.Close()
			cmd.Wait()
		}
	}()
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("reading the exporter's line: %v; stderr:\n%s", err, stderr.String())
	}
	var x Exported
	if err := json.Unmarshal([]byte(line), &x); err != nil {
		t.Fatalf("%q: %v", line, err)
	}
	if x.Bytes != size || x.Device != 0 || x.Pattern != seed || x.PID != cmd.Process.Pid || x.Base == 0 || len(x.Handle) != 128 {
		t.Fatalf("exporter said %+v", x)
	}
	var h cuda.IPCHandle
	if n, err := hex.Decode(h[:], []byte(x.Handle)); err != nil || n != 64 {
		t.Fatalf("handle %q: %d, %v", x.Handle, n, err)
	}
	if len(shmObjects(t, x.PID)) != 1 {
		t.Fatalf("the exporter's memory: %v", shmObjects(t, x.PID))
	}

	drv, err := cuda.Open(lib)
	if err != nil {
		t.Fatal(err)
	}
	dev, err := drv.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	p, err := dev.OpenIPC(h)
	if err != nil {
		t.Fatal(err)
	}
	base, n, err := dev.AddressRange(p + 12345)
	if err != nil || base != p || n != size {
		t.Fatalf("AddressRange = %#x, %d, %v; want %#x, %d", base, n, err, p, size)
	}
	got := make([]byte, size)
	if err := dev.CopyDtoH(got, p); err != nil {
		t.Fatal(err)
	}
	if err := cuda.CheckPattern(got, seed, 0); err != nil {
		t.Fatal(err)
	}

	// As the agent stages: device to device out of the mapping, then to
	// pinned memory on a stream, waited for with an event.
	const off, k = 1<<20 + 5, 1 << 20
	dst, err := dev.Alloc(k)
	if err != nil {
		t.Fatal(err)
	}
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	e, err := dev.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	pinned, err := dev.HostAlloc(k)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.CopyDtoDAsync(dst, p+off, k); err != nil {
		t.Fatal(err)
	}
	if err := s.CopyDtoHAsync(pinned, dst); err != nil {
		t.Fatal(err)
	}
	if err := e.Record(s); err != nil {
		t.Fatal(err)
	}
	if err := e.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if err := cuda.CheckPattern(pinned, seed, off); err != nil {
		t.Fatal(err)
	}
	for _, err := range []error{e.Close(), s.Close(), dev.HostFree(pinned), dev.Free(dst)} {
		if err != nil {
			t.Fatal(err)
		}
	}

	// Opening again in this context counts another open of the same mapping.
	p2, err := dev.OpenIPC(h)
	if err != nil || p2 != p {
		t.Fatalf("second open = %#x, %v; want %#x", p2, err, p)
	}
	for range 2 {
		if err := dev.CloseIPC(p); err != nil {
			t.Fatal(err)
		}
	}
	var ce *cuda.Error
	if err := dev.CloseIPC(p); !errors.As(err, &ce) || ce.Name != "CUDA_ERROR_INVALID_VALUE" {
		t.Fatalf("a third close: %v", err)
	}

	stdin.Close()
	err = cmd.Wait()
	exited = true
	if err != nil {
		t.Fatalf("exporter: %v; stderr:\n%s", err, stderr.String())
	}
	if left := shmObjects(t, x.PID); len(left) != 0 {
		t.Errorf("the exporter left %v", left)
	}
	// The memory is gone with it.
	if _, err := dev.OpenIPC(h); !errors.As(err, &ce) {
		t.Errorf("opening the handle of freed memory: %v", err)
	}
}

func TestFlagsAndErrors(t *testing.T) {
	lib := cudatest.Fake(t)
	for _, c := range []struct {
		args []string
		code int
		says string
	}{
		{[]string{"--bytes", "0"}, 2, "--bytes must be positive"},
		{[]string{"--nope"}, 2, "flag provided but not defined"},
		{[]string{"extra"}, 2, "unexpected arguments"},
		{[]string{"--library", "/nonexistent/libcuda.so.1"}, 1, "cannot open shared object file"},
		{[]string{"--library", lib, "--device", "3"}, 1, "no CUDA device 3"},
	} {
		var out, errb bytes.Buffer
		if code := run(c.args, strings.NewReader(""), &out, &errb); code != c.code || !strings.Contains(errb.String(), c.says) {
			t.Errorf("%q: exit %d, stderr %q; want %d and %q", c.args, code, errb.String(), c.code, c.says)
		}
		if out.Len() != 0 {
			t.Errorf("%q: stdout %q", c.args, out.String())
		}
	}
}

// TestInProcess runs the exporter in this process (stdin already closed):
// its line names its memory, which it frees when done.
func TestInProcess(t *testing.T) {
	lib := cudatest.Fake(t)
	var out, errb bytes.Buffer
	if code := run([]string{"--library", lib, "--bytes", "100", "--pattern", "3"}, strings.NewReader(""), &out, &errb); code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	var x Exported
	if err := json.Unmarshal(out.Bytes(), &x); err != nil || x.Bytes != 100 || x.Pattern != 3 || x.PID != os.Getpid() {
		t.Fatalf("%q: %+v, %v", out.String(), x, err)
	}
	if !strings.HasSuffix(out.String(), "}\n") || strings.Count(out.String(), "\n") != 1 {
		t.Errorf("not one line: %q", out.String())
	}
	if left := shmObjects(t, os.Getpid()); len(left) != 0 {
		t.Errorf("left %v", left)
	}
}
