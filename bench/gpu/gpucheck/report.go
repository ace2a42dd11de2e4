package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/encgate/encgate/internal/cuda"
)

// machineInfo describes where the check ran.
type machineInfo struct {
	nproc     int
	cpu       string
	kernel    string
	library   string
	driverAPI string // cuDriverGetVersion, as "13.0 (13000)"
	devices   string // cuDeviceGetCount
	gpu       string // nvidia-smi's name, memory and driver version, or why not
}

func (m machineInfo) oneLine() string {
	return fmt.Sprintf("%d CPUs (%s), Linux %s; GPU: %s; CUDA driver API %s, %s device(s), library %s",
		m.nproc, m.cpu, m.kernel, m.gpu, m.driverAPI, m.devices, m.library)
}

// probeMachine reads the machine: /proc, the driver, and nvidia-smi when it
// is there (internal/cuda does not bind cuDeviceGetName).
func probeMachine(ctx context.Context, drv *cuda.Driver, o options) machineInfo {
	m := machineInfo{nproc: runtime.NumCPU(), cpu: "unknown CPU", kernel: "?", library: o.library}
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				m.cpu = strings.TrimSpace(v)
				break
			}
		}
		f.Close()
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.kernel = strings.TrimSpace(string(b))
	}
	if v, err := drv.DriverVersion(); err == nil {
		m.driverAPI = fmt.Sprintf("%d.%d (%d)", v/1000, v%1000/10, v)
	} else {
		m.driverAPI = "? (" + err.Error() + ")"
	}
	if n, err := drv.DeviceCount(); err == nil {
		m.devices = strconv.Itoa(n)
	} else {
		m.devices = "?"
	}
	m.gpu = "name not reported (internal/cuda does not bind cuDeviceGetName, and nvidia-smi is not on PATH)"
	if smi, err := exec.LookPath("nvidia-smi"); err == nil {
		ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, smi, "--query-gpu=name,memory.total,driver_version",
			"--format=csv,noheader", "-i", strconv.Itoa(o.device)).Output()
		if f := strings.Split(strings.TrimSpace(string(out)), ","); err == nil && len(f) == 3 {
			m.gpu = fmt.Sprintf("%s, %s, driver %s (nvidia-smi, device %d)",
				strings.TrimSpace(f[0]), strings.TrimSpace(f[1]), strings.TrimSpace(f[2]), o.device)
		} else {
			m.gpu = fmt.Sprintf("nvidia-smi did not answer (%v: %q)", err, strings.TrimSpace(string(out)))
		}
	}
	return m
}

// ms formats durations as milliseconds.
func ms(ds []time.Duration) string {
	var s []string
	for _, d := range ds {
		s = append(s, strconv.FormatFloat(float64(d.Microseconds())/1000, 'f', 2, 64))
	}
	return strings.Join(s, ", ")
}

// gbps formats a rate, "—" when nothing was measured.
func gbps(size int64, ds []time.Duration) string {
	if len(ds) == 0 {
		return "—"
	}
	return strconv.FormatFloat(rate(size, ds), 'f', 2, 64)
}

// report is the markdown results; stop is what ended the run early, if
// anything did.
func (c *check) report(took time.Duration, stop error) string {
	var b strings.Builder
	m := c.machine
	fmt.Fprintf(&b, "## GPU check: stage by CUDA IPC handle, end to end\n\n")
	fmt.Fprintf(&b, "%s, by bench/gpu/gpucheck in %.1f s; %d timed rounds per measurement, medians; GB/s is 10^9 bytes/s.\n\n",
		time.Now().UTC().Format("2006-01-02 15:04 UTC"), took.Seconds(), c.o.rounds)
	fmt.Fprintf(&b, "| machine | |\n|---|---|\n")
	fmt.Fprintf(&b, "| CPUs (nproc) | %d (%s) |\n", m.nproc, m.cpu)
	fmt.Fprintf(&b, "| kernel | Linux %s |\n", m.kernel)
	fmt.Fprintf(&b, "| GPU | %s |\n", m.gpu)
	fmt.Fprintf(&b, "| CUDA driver API | %s (cuDriverGetVersion), %s device(s) (cuDeviceGetCount), device %d used |\n", m.driverAPI, m.devices, c.o.device)
	fmt.Fprintf(&b, "| driver library | %s |\n", m.library)
	if c.o.buildInfo != "" {
		fmt.Fprintf(&b, "| binaries | %s |\n", c.o.buildInfo)
	}
	fmt.Fprintf(&b, "\n| size | chunk × buffers | DtoH chunked GB/s | DtoH whole GB/s | loopback TCP GB/s | end-to-end GB/s | e2e ÷ min(DtoH chunked, TCP) | target ≥ %.1f | every byte verified | e2e rounds (ms) |\n", target)
	fmt.Fprintf(&b, "|---|---|---:|---:|---:|---:|---:|---|---|---|\n")
	var failures []string
	for _, r := range c.results {
		failures = append(failures, r.failures...)
		for _, p := range c.o.pairs {
			ratio, verdict := "—", "—"
			if chunked, tcp, e2e := r.dtohChunk[p], r.tcp, r.endToEnd[p]; len(chunked) > 0 && len(tcp) > 0 && len(e2e) > 0 {
				x := rate(r.size, e2e) / min(rate(r.size, chunked), rate(r.size, tcp))
				ratio, verdict = strconv.FormatFloat(x, 'f', 2, 64), "missed"
				if x >= target {
					verdict = "met"
				}
			}
			verified := "no"
			if r.verifiedAt[p] {
				verified = "yes"
			}
			fmt.Fprintf(&b, "| %s | %s × %d | %s | %s | %s | %s | %s | %s | %s | %s |\n",
				sizeName(r.size), sizeName(int64(p.chunk)), p.buffers, gbps(r.size, r.dtohChunk[p]), gbps(r.size, r.dtohWhole),
				gbps(r.size, r.tcp), gbps(r.size, r.endToEnd[p]), ratio, verdict, verified, ms(r.endToEnd[p]))
		}
	}
	if stop != nil || len(failures) > 0 {
		fmt.Fprintf(&b, "\n**The check FAILED.**\n\n")
		if stop != nil {
			var bad *mismatchError
			if errors.As(stop, &bad) {
				fmt.Fprintf(&b, "- Stopped at a wrong byte: %s\n", oneLine(bad.Error()))
			} else {
				fmt.Fprintf(&b, "- Stopped: %s\n", oneLine(stop.Error()))
			}
		}
		for _, f := range failures {
			fmt.Fprintf(&b, "- %s\n", oneLine(f))
		}
	}
	fmt.Fprintf(&b, "\n")
	fmt.Fprintf(&b, "- **DtoH chunked**: in gpucheck's own process, the device range copied chunk by chunk into one pinned buffer (cuMemHostAlloc) of chunk × buffers bytes with cuMemcpyDtoHAsync on one stream, an event recorded after each chunk and synchronised before its slot is reused, driven by gpuagent/pipeline.Send into io.Discard: the agent's device source without the socket. **DtoH whole**: one cuMemcpyDtoHAsync of the whole range into a pinned buffer of the full size, then cuStreamSynchronize. The first pass of each is checked byte for byte and not timed.\n")
	fmt.Fprintf(&b, "- **Loopback TCP**: one 127.0.0.1 connection in gpucheck's process; the writer writes size bytes in one Write, the reader reads them into one buffer and answers one byte; the time is the writer's, to the answer.\n")
	fmt.Fprintf(&b, "- **End to end**: cudaexport fills device memory with the pattern and exports its IPC handle; a real `encgate agent` (cuda.mode required, ack.mode off, its own Mooncake receiver with one buffer of the size, restarted for each chunk × buffers) stages it with POST /v1/stage?source=cuda on its Unix socket (a device-to-device copy into its own memory), then each POST /send (sglang's body, no receive_count) copies it out through its pinned buffers while it writes the chunks to the receiver over loopback TCP. The time is the client's wall time of one /send, HTTP included. Before timing, the first /send's bytes are read back with GET /v1/receiver/bytes and every byte is compared with the pattern.\n")
	fmt.Fprintf(&b, "- The ratio's bound is min(DtoH chunked at the same chunk and depth, loopback TCP): what the pipeline could reach if the copies and the writes overlapped perfectly.\n")
	return b.String()
}

// oneLine is s on one markdown line, cut to a readable length (the agent's
// log tails that errors carry are in the run's log).
func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > 1500 {
		s = string(r[:1500]) + " …"
	}
	return s
}
