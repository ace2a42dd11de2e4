// Command gpucheck is the device check of stage by CUDA IPC handle: the one
// program bench/gpu/run.sh runs on a GPU machine, and that main_test.go runs
// here, the same way, against the fake driver (internal/cuda/cudatest).
//
// For each --sizes value it
//
//  1. measures device-to-host copies in this process through internal/cuda:
//     the range copied chunk by chunk into one pinned buffer of chunk ×
//     depth bytes, with cuMemcpyDtoHAsync on one stream and an event per
//     slot, driven by gpuagent/pipeline.Send as the agent drives it (for
//     each --chunks × --buffers pair), and the whole range in one copy into
//     a pinned buffer of the full size; the first pass of each is checked
//     byte for byte;
//  2. measures loopback TCP: one 127.0.0.1 connection in this process, the
//     writer writes size bytes, the reader reads them into one buffer and
//     answers one byte;
//  3. starts cudaexport (--exporter), which fills size bytes of device
//     memory with the test pattern (cuda.FillPattern) and prints its IPC
//     handle, then for each (chunk, buffers) pair starts a real agent
//     (--encgate BIN agent --config F: cuda.mode required, ack.mode off, its
//     own Mooncake receiver with one buffer of size bytes), stages the
//     exporter's memory by handle over the agent's Unix socket, POSTs
//     sglang's /send on the agent's TCP door aimed at its receiver, reads
//     the receiver's buffer back through GET /v1/receiver/bytes and checks
//     every byte against the pattern, and then times --rounds more /sends
//     of the same entry (no receive_count, so it stays staged);
//
// and writes a markdown table (--out, and stdout): per size and pair, the
// device-to-host rates, the loopback TCP rate, the end-to-end rate (size /
// the median wall time of a /send, seen from the client) and its ratio to
// min(device-to-host chunked at the same chunk and depth, TCP), against the
// target 0.9.
//
// A byte that differs anywhere stops the run and makes it exit 1, naming
// the first bad offset. Any other failure of a step (an agent that does not
// start, a stage the driver refuses) is recorded, the other steps still
// run, and the exit status is 1; bad flags exit 2. Whatever was measured is
// written, a failed run marked so. Every listener is on port 0 of
// 127.0.0.1: the agent's addresses come from its "agent listening" log
// line, the receiver's session from GET /v1/receiver. Every child process
// is stopped on every way out (SIGTERM and SIGINT included: the results so
// far are still written), and on Linux dies with gpucheck should gpucheck
// be killed.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/cuda"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// target is the end-to-end rate's least ratio to min(DtoH, TCP).
const target = 0.9

// options are the parsed flags.
type options struct {
	encgate    string
	exporter   string
	library    string
	device     int
	sizes      []int64
	rounds     int
	out        string
	pairs      []pair
	seed       uint64 // the exporter's pattern
	verifySeed uint64 // the pattern gpucheck checks against (hidden flag; default seed)
	buildInfo  string
}

// pair is one agent configuration of the sweep.
type pair struct {
	chunk   int // transfer.chunk_bytes
	buffers int // transfer.buffers
}

func (p pair) String() string {
	return fmt.Sprintf("chunk %s × %d", sizeName(int64(p.chunk)), p.buffers)
}

// hiddenFlags are left out of the usage text: they exist for the tests.
var hiddenFlags = map[string]bool{"verify-seed": true}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("gpucheck", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.encgate, "encgate", "", "a built encgate `binary` (required)")
	fs.StringVar(&o.exporter, "exporter", "", "a built internal/cuda/cudaexport `binary` (required)")
	fs.StringVar(&o.library, "library", cuda.DefaultLibrary, "the CUDA driver `library`, for the agent, the exporter and this process")
	fs.IntVar(&o.device, "device", 0, "the CUDA device `ordinal`")
	sizes := fs.String("sizes", "8MiB,64MiB,256MiB", "embedding sizes, comma-separated (8MiB, 1048576, 3MiB+5)")
	fs.IntVar(&o.rounds, "rounds", 5, "timed rounds per measurement (the median is reported)")
	fs.StringVar(&o.out, "out", "", "write the markdown results to this `file` (they go to stdout too)")
	chunks := fs.String("chunks", "1MiB,4MiB,16MiB", "transfer.chunk_bytes values to sweep, comma-separated")
	buffers := fs.String("buffers", "2,3", "transfer.buffers values to sweep, comma-separated")
	fs.Uint64Var(&o.seed, "pattern", 7, "the `seed` of the exporter's fill pattern")
	verifySeed := fs.String("verify-seed", "", "check against this pattern seed instead of --pattern's (tests)")
	fs.StringVar(&o.buildInfo, "build-info", "", "a line about the binaries, copied into the results")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: gpucheck --encgate BIN --exporter BIN [flags]\n")
		fs.VisitAll(func(f *flag.Flag) {
			if hiddenFlags[f.Name] {
				return
			}
			name, usage := flag.UnquoteUsage(f)
			fmt.Fprintf(stderr, "  --%s %s\n    \t%s", f.Name, name, usage)
			if f.DefValue != "" {
				fmt.Fprintf(stderr, " (default %q)", f.DefValue)
			}
			fmt.Fprintln(stderr)
		})
	}
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	var problems []string
	bad := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	if fs.NArg() > 0 {
		bad("unexpected arguments %q", fs.Args())
	}
	if o.encgate == "" {
		bad("--encgate is required")
	}
	if o.exporter == "" {
		bad("--exporter is required")
	}
	var err error
	if o.sizes, err = byteList(*sizes); err != nil {
		bad("--sizes: %v", err)
	}
	cs, err := byteList(*chunks)
	if err != nil {
		bad("--chunks: %v", err)
	}
	for _, c := range cs {
		if c < 4<<10 || c > 256<<20 {
			bad("--chunks: %s is outside transfer.chunk_bytes' range [4KiB, 256MiB]", sizeName(c))
		}
	}
	var bs []int
	for _, f := range strings.Split(*buffers, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 2 || n > 16 {
			bad("--buffers: %q is not an integer in transfer.buffers' range [2, 16]", f)
			continue
		}
		bs = append(bs, n)
	}
	for _, c := range cs {
		for _, b := range bs {
			o.pairs = append(o.pairs, pair{chunk: int(c), buffers: b})
		}
	}
	if o.rounds < 1 {
		bad("--rounds must be at least 1, got %d", o.rounds)
	}
	if o.device < 0 {
		bad("--device must be >= 0, got %d", o.device)
	}
	o.verifySeed = o.seed
	if *verifySeed != "" {
		if o.verifySeed, err = strconv.ParseUint(*verifySeed, 10, 64); err != nil {
			bad("--verify-seed: %q is not an unsigned integer", *verifySeed)
		}
	}
	if len(problems) > 0 {
		for _, p := range problems {
			fmt.Fprintln(stderr, "gpucheck:", p)
		}
		return o, errors.New("bad flags")
	}
	return o, nil
}

// byteList parses "8MiB, 64MiB,3MiB+5": sizes > 0, each a sum of byte sizes.
func byteList(s string) ([]int64, error) {
	var out []int64
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		var n int64
		for _, term := range strings.Split(f, "+") {
			b, err := configfile.ParseByteSize(term)
			if err != nil {
				return nil, err
			}
			n += int64(b)
		}
		if n <= 0 {
			return nil, fmt.Errorf("%q: a size must be > 0", f)
		}
		out = append(out, n)
	}
	return out, nil
}

// sizeName is n with the largest binary unit dividing it, else "N B".
func sizeName(n int64) string {
	s := configfile.ByteSize(n).String()
	if _, err := strconv.ParseInt(s, 10, 64); err == nil {
		return s + " B"
	}
	return s
}

// run is the program; it returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return 2
	}
	c := &check{o: o, stdout: stdout, stderr: stderr}
	if err := c.run(ctx); err != nil {
		var bad *mismatchError
		switch {
		case errors.As(err, &bad):
			// The mismatch says where it was found; what wraps it says so again.
			fmt.Fprintf(stdout, "gpucheck: VERIFICATION FAILED: %v\n", bad)
			fmt.Fprintf(stderr, "gpucheck: VERIFICATION FAILED: %v\n", bad)
		case ctx.Err() != nil:
			fmt.Fprintf(stderr, "gpucheck: interrupted (%v); every child process was stopped: %v\n", context.Cause(ctx), err)
		default:
			fmt.Fprintf(stderr, "gpucheck: FAILED: %v\n", err)
		}
		return 1
	}
	return 0
}

// check is one run.
type check struct {
	o      options
	stdout io.Writer
	stderr io.Writer
	tmp    string

	drv *cuda.Driver
	dev *cuda.Device

	machine  machineInfo
	results  []sizeResult
	verified struct {
		transfers int
		bytes     int64
		dtoh      int64 // bytes checked after in-process device-to-host copies
	}
	agents int // agents started, for directory names
}

// sizeResult is everything measured for one size. A step that failed
// leaves its measurements empty and says why in failures.
type sizeResult struct {
	size       int64
	dtohWhole  []time.Duration
	dtohChunk  map[pair][]time.Duration
	tcp        []time.Duration
	endToEnd   map[pair][]time.Duration
	verifiedAt map[pair]bool
	failures   []string
}

func (c *check) logf(format string, args ...any) {
	fmt.Fprintf(c.stderr, "gpucheck: "+format+"\n", args...)
}

// fatal reports whether err ends the whole run: a wrong byte (nothing after
// it can be trusted) or the run interrupted. Any other failure of a step is
// recorded and the next step runs, so that one try on a GPU machine brings
// back every figure that could be measured.
func fatal(ctx context.Context, err error) bool {
	var bad *mismatchError
	return errors.As(err, &bad) || ctx.Err() != nil
}

func (c *check) run(ctx context.Context) (err error) {
	start := time.Now()
	for _, p := range []*string{&c.o.encgate, &c.o.exporter} {
		if *p, err = filepath.Abs(*p); err != nil {
			return err
		}
		if st, err := os.Stat(*p); err != nil {
			return err
		} else if st.IsDir() || st.Mode()&0o111 == 0 {
			return fmt.Errorf("%s is not an executable file", *p)
		}
	}
	if c.tmp, err = os.MkdirTemp("", "gpucheck-"); err != nil {
		return err
	}
	defer os.RemoveAll(c.tmp)

	if c.drv, err = cuda.Open(c.o.library); err != nil {
		return fmt.Errorf("loading the CUDA driver in gpucheck: %w", err)
	}
	if c.dev, err = c.drv.Device(c.o.device); err != nil {
		return fmt.Errorf("opening device %d in gpucheck: %w", c.o.device, err)
	}
	defer func() { err = errors.Join(err, c.dev.Close()) }()
	c.machine = probeMachine(ctx, c.drv, c.o)
	c.logf("%s", c.machine.oneLine())

	var stop error // a wrong byte, or the run interrupted
	for _, size := range c.o.sizes {
		r, err := c.measureSize(ctx, size)
		c.results = append(c.results, r)
		if err != nil {
			stop = fmt.Errorf("size %s: %w", sizeName(size), err)
			break
		}
	}
	failed := 0
	for _, r := range c.results {
		failed += len(r.failures)
	}
	report := c.report(time.Since(start), stop)
	if _, err := io.WriteString(c.stdout, report); err != nil {
		return errors.Join(stop, err)
	}
	if c.o.out != "" {
		if err := os.MkdirAll(filepath.Dir(c.o.out), 0o755); err != nil {
			return errors.Join(stop, err)
		}
		if err := os.WriteFile(c.o.out, []byte(report), 0o644); err != nil {
			return errors.Join(stop, err)
		}
		c.logf("results written to %s", c.o.out)
	}
	switch {
	case stop != nil:
		return stop
	case failed > 0:
		return fmt.Errorf("%d step(s) failed (listed under the results); the bytes of the %d end-to-end transfer(s) that ran all matched", failed, c.verified.transfers)
	}
	fmt.Fprintf(c.stdout, "gpucheck: every byte verified: %d end-to-end transfers (%d bytes) read back from the receiver, and %d bytes of in-process device-to-host copies, all match pattern %d\n",
		c.verified.transfers, c.verified.bytes, c.verified.dtoh, c.o.verifySeed)
	return nil
}

// measureSize runs the three measurements for one size. It returns an
// error only when the run must stop (see fatal); other failures are in
// r.failures.
func (c *check) measureSize(ctx context.Context, size int64) (r sizeResult, err error) {
	r = sizeResult{size: size, dtohChunk: map[pair][]time.Duration{}, endToEnd: map[pair][]time.Duration{}, verifiedAt: map[pair]bool{}}
	step := func(what string, err error) error {
		if err == nil {
			return nil
		}
		if fatal(ctx, err) {
			var bad *mismatchError
			if errors.As(err, &bad) {
				return err // it says where
			}
			return fmt.Errorf("%s: interrupted (%v): %w", what, context.Cause(ctx), err)
		}
		msg := fmt.Sprintf("size %s: %s: %v", sizeName(size), what, err)
		c.logf("FAILED: %s", msg)
		r.failures = append(r.failures, msg)
		return nil
	}
	c.logf("size %s: device-to-host in this process", sizeName(size))
	if err := step("device-to-host", c.benchDtoH(ctx, &r)); err != nil {
		return r, err
	}
	c.logf("size %s: loopback TCP", sizeName(size))
	tcp, err := benchTCP(ctx, size, c.o.rounds)
	if err := step("loopback TCP", err); err != nil {
		return r, err
	}
	r.tcp = tcp
	if len(tcp) > 0 {
		c.logf("size %s: loopback TCP %.2f GB/s", sizeName(size), rate(size, r.tcp))
	}

	x, err := startExporter(ctx, c.o, size, c.stderr)
	if err := step("cudaexport", err); err != nil || x == nil {
		return r, err
	}
	defer func() {
		if serr := step("cudaexport", x.stop()); err == nil {
			err = serr
		}
	}()
	for _, p := range c.o.pairs {
		d, err := c.endToEnd(ctx, x, size, p, func() { r.verifiedAt[p] = true })
		if err := step(fmt.Sprintf("end to end, %s", p), err); err != nil {
			return r, err
		}
		if len(d) == 0 {
			continue
		}
		r.endToEnd[p] = d
		c.logf("size %s, %s: end to end %.2f GB/s", sizeName(size), p, rate(size, d))
	}
	return r, nil
}
