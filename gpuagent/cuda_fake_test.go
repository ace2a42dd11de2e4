package gpuagent

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/encgate/encgate/internal/cuda"
	"github.com/encgate/encgate/internal/cuda/cudatest"
)

// These tests stage by CUDA IPC handle for real against the fake CUDA
// driver (internal/cuda/testdata/fakecuda.c: device memory is POSIX shared
// memory, IPC handles cross processes, streams copy on worker threads, so
// an event waited for too early reads stale bytes). There is no GPU here:
// the fake is the mock, said so; bench/gpu/run.sh runs the same path on a
// real device.

var (
	exporterOnce sync.Once
	exporterPath string
	exporterErr  error
)

// exporterBin builds internal/cuda/cudaexport once per test binary.
func exporterBin(t *testing.T) string {
	t.Helper()
	exporterOnce.Do(func() {
		dir, err := os.MkdirTemp("", "cudaexport")
		if err != nil {
			exporterErr = err
			return
		}
		exporterPath = filepath.Join(dir, "cudaexport")
		out, err := exec.Command("go", "build", "-o", exporterPath, "../internal/cuda/cudaexport").CombinedOutput()
		if err != nil {
			exporterErr = fmt.Errorf("go build cudaexport: %v\n%s", err, out)
		}
	})
	if exporterErr != nil {
		t.Fatal(exporterErr)
	}
	return exporterPath
}

// exported is device memory another process allocated, filled with the
// pattern for seed and exported; free ends that process, freeing it.
type exported struct {
	handle string
	bytes  int64
	seed   uint64
	free   func()
}

func exportMemory(t *testing.T, lib string, n int64, seed uint64) *exported {
	t.Helper()
	cmd := exec.Command(exporterBin(t), "--library", lib, "--bytes", fmt.Sprint(n), "--pattern", fmt.Sprint(seed))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	free := func() {
		once.Do(func() {
			stdin.Close()
			if err := cmd.Wait(); err != nil {
				t.Errorf("the exporter: %v", err)
			}
		})
	}
	t.Cleanup(free)
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("reading the exporter's handle: %v", err)
	}
	var x struct {
		Handle string `json:"handle"`
		Bytes  int64  `json:"bytes"`
	}
	if err := json.Unmarshal([]byte(line), &x); err != nil || x.Bytes != n || len(x.Handle) != 128 {
		t.Fatalf("the exporter said %q (%v)", line, err)
	}
	go func() { _, _ = io.Copy(io.Discard, stdout) }()
	return &exported{handle: x.Handle, bytes: n, seed: seed, free: free}
}

// cudaAgent is an agent on the fake driver with small chunks, so a transfer
// runs through many pipeline slots.
func cudaAgent(t *testing.T, lib string, mutate func(*Config)) *testAgent {
	return startAgent(t, func(c *Config) {
		c.CUDA.Mode, c.CUDA.Library = CUDARequired, lib
		c.Ack.Mode = AckOff
		c.Transfer.ChunkBytes, c.Transfer.Buffers = 64<<10, 3
		if mutate != nil {
			mutate(c)
		}
	}, nil, nil)
}

func checkReceived(t *testing.T, got []byte, seed uint64, offset int64) {
	t.Helper()
	if err := cuda.CheckPattern(got, seed, offset); err != nil {
		t.Fatalf("the receiver's bytes: %v", err)
	}
}

// The whole path: another process's device memory staged by handle, the
// exporter then gone (its memory freed: the agent holds its own copy), the
// bytes sent through the pipeline into a Mooncake receiver, every byte as
// the exporter wrote it; the device memory freed once the part is released.
// Run with the fake's copies slowed, so each chunk's copy is still in
// flight while earlier chunks are written.
func TestStageByHandleSendsTheDeviceBytes(t *testing.T) {
	lib := cudatest.Fake(t)
	if !cudatest.InChild(t, "FAKECUDA_COPY_DELAY_US=300", cudatest.NoRaceExitSleep) {
		return
	}
	const tokens, dim = 300, 1001 // 600,600 bytes of bfloat16: 9 full chunks and a partial one
	n := int64(tokens * dim * 2)
	recv := startReceiverOf(t, int(n)+4096)
	x := exportMemory(t, lib, n+4096, 11)
	a := cudaAgent(t, lib, nil)

	want := fmt.Sprintf(`{"req_id":"gpu-1","embedding_size":%d,"embedding_len":%d,"embedding_dim":%d}`, n, tokens, dim)
	expect(t, a.stageCUDA(t, "gpu-1", tokens, dim, 0, x.handle, 4096), http.StatusOK, want)
	x.free() // the encoder may free its tensor once it has the answer

	rows := a.staged(t)
	if len(rows) != 1 || rows[0].Source != sourceCUDA || rows[0].Registration != regDevice || rows[0].Bytes != n {
		t.Fatalf("/admin/staged = %+v", rows)
	}
	if held, _ := a.store.usage(); held != 0 {
		t.Fatalf("a device stage holds %d bytes of staging.capacity_bytes", held)
	}
	gpu, _ := a.gpus.device(0)
	if gpu.heldBytes() != n || testutil.ToFloat64(a.metrics.deviceBytes.WithLabelValues("0")) != float64(n) {
		t.Fatalf("device 0 holds %d bytes (encgate_agent_staged_device_bytes %v), want %d",
			gpu.heldBytes(), testutil.ToFloat64(a.metrics.deviceBytes.WithLabelValues("0")), n)
	}
	addr := base(t, recv) + 1000
	expect(t, a.send(t, sendReq{id: "gpu-1", port: 9, session: recv.SessionID(), addr: addr, count: 2}), http.StatusOK, "null")
	got, _ := recv.Bytes(addr, int(n))
	checkReceived(t, got, 11, 4096)
	// A second destination: the staged copy is read again from the start.
	zeroRecv := startReceiverOf(t, int(n))
	addr2 := base(t, zeroRecv)
	expect(t, a.send(t, sendReq{id: "gpu-1", port: 10, session: zeroRecv.SessionID(), addr: addr2, count: 2}), http.StatusOK, "null")
	got, _ = zeroRecv.Bytes(addr2, int(n))
	checkReceived(t, got, 11, 4096)
	if gpu.heldBytes() != 0 || testutil.ToFloat64(a.metrics.deviceBytes.WithLabelValues("0")) != 0 {
		t.Fatalf("after the part's release device 0 still holds %d bytes", gpu.heldBytes())
	}
	gpu.mu.Lock()
	open := len(gpu.opened)
	gpu.mu.Unlock()
	if open != 0 {
		t.Fatalf("%d IPC handles left open after the stage", open)
	}
}

// Concurrent /sends of one device stage share a single lane (cuda.lanes 1)
// one after the other; stages of several parts of one allocation (one
// handle, several offsets, as PyTorch's allocator hands out) open the handle
// once between them and each get their own bytes.
func TestStageByHandleConcurrency(t *testing.T) {
	lib := cudatest.Fake(t)
	const parts, tokens, dim = 6, 64, 512 // 64 KiB each
	size := int64(tokens * dim * 2)
	x := exportMemory(t, lib, parts*size, 5)
	a := cudaAgent(t, lib, func(c *Config) { c.CUDA.Lanes = 1; c.Transfer.ChunkBytes = 16 << 10 })
	var wg sync.WaitGroup
	errs := make(chan string, 2*parts)
	for i := range parts {
		wg.Go(func() {
			r := a.stageCUDA(t, fmt.Sprintf("part-%d", i), tokens, dim, 0, x.handle, int64(i)*size)
			if r.status != http.StatusOK {
				errs <- fmt.Sprintf("stage part-%d: %d %s", i, r.status, r.body)
			}
		})
	}
	wg.Wait()
	x.free()
	recv := startReceiverOf(t, parts*int(size))
	for i := range parts {
		wg.Go(func() {
			r := a.send(t, sendReq{id: fmt.Sprintf("part-%d", i), port: 9, session: recv.SessionID(),
				addr: base(t, recv) + uint64(int64(i)*size), count: 1})
			if r.status != http.StatusOK {
				errs <- fmt.Sprintf("send part-%d: %d %s", i, r.status, r.body)
			}
		})
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	got, _ := recv.Bytes(base(t, recv), parts*int(size))
	checkReceived(t, got, 5, 0)
}

// What a stage by handle can get wrong is refused before anything is
// kept: a range past the allocation's end, a handle nothing exported, a
// device that is not there, more than cuda.capacity_bytes.
func TestStageByHandleRefusals(t *testing.T) {
	lib := cudatest.Fake(t)
	x := exportMemory(t, lib, 1<<20, 3)
	a := cudaAgent(t, lib, func(c *Config) { c.CUDA.CapacityBytes = 1 << 20 })
	expectErr(t, a.stageCUDA(t, "past", 512, 1024, 0, x.handle, 4096), http.StatusBadRequest, "past",
		"the allocation behind the handle holds 1048576 bytes, fewer than offset 4096 + 1048576")
	expectErr(t, a.stageCUDA(t, "unknown", 4, 8, 0, handleHex, 0), http.StatusBadRequest, "unknown",
		"cannot open the CUDA IPC handle on device 0", "CUDA_ERROR_INVALID_VALUE")
	expectErr(t, a.stageCUDA(t, "nodev", 4, 8, 3, x.handle, 0), http.StatusNotImplemented, "nodev",
		"on device 3")
	expect(t, a.stageCUDA(t, "fits", 512, 1024, 0, x.handle, 0), http.StatusOK,
		`{"req_id":"fits","embedding_size":1048576,"embedding_len":512,"embedding_dim":1024}`)
	expectErr(t, a.stageCUDA(t, "over", 4, 8, 0, x.handle, 0), http.StatusInsufficientStorage, "over",
		"would exceed cuda.capacity_bytes on device 0 (1048576 bytes held)")
	if rows := a.staged(t); len(rows) != 1 {
		t.Fatalf("refused stages left entries: %+v", rows)
	}
	expectErr(t, a.stageCUDA(t, "fits", 4, 8, 0, x.handle, 0), http.StatusConflict, "fits", "already staged")
}
