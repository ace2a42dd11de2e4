// Command cudaexport is the exporting end of a CUDA IPC check. It allocates
// --bytes of device memory on --device, fills it with the test pattern for
// --pattern (cuda.FillPattern: byte i is byte i%8 of the i/8-th SplitMix64
// output for the seed, little-endian), exports the allocation's IPC handle,
// prints one JSON line to stdout
//
//	{"handle":"<128 hex digits>","device":0,"bytes":N,"base":<device address>,"pattern":SEED,"pid":PID}
//
// and then keeps the memory alive until its stdin closes, when it frees it
// and exits 0. The importing process must close the handle before closing
// cudaexport's stdin: CUDA leaves freeing memory that another process has
// open undefined. Errors go to stderr, with exit status 1 (2 for bad flags).
package main

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/encgate/encgate/internal/cuda"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}

// Exported is the JSON line cudaexport prints.
type Exported struct {
	Handle  string `json:"handle"`
	Device  int    `json:"device"`
	Bytes   int64  `json:"bytes"`
	Base    uint64 `json:"base"`
	Pattern uint64 `json:"pattern"`
	PID     int    `json:"pid"`
}

// chunkBytes is how much of the pattern is copied to the device at a time.
const chunkBytes = 8 << 20

func run(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("cudaexport", flag.ContinueOnError)
	fs.SetOutput(stderr)
	library := fs.String("library", "", "the CUDA driver library to load (default "+cuda.DefaultLibrary+")")
	device := fs.Int("device", 0, "the device ordinal to allocate on")
	size := fs.Int64("bytes", 1<<20, "how many bytes to allocate and fill")
	seed := fs.Uint64("pattern", 1, "the seed of the fill pattern")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "cudaexport: unexpected arguments %q\n", fs.Args())
		return 2
	}
	if *size <= 0 {
		fmt.Fprintf(stderr, "cudaexport: --bytes must be positive, not %d\n", *size)
		return 2
	}
	if err := export(*library, *device, *size, *seed, stdin, stdout); err != nil {
		fmt.Fprintf(stderr, "cudaexport: %v\n", err)
		return 1
	}
	return 0
}

func export(library string, ordinal int, size int64, seed uint64, stdin io.Reader, stdout io.Writer) (err error) {
	drv, err := cuda.Open(library)
	if err != nil {
		return err
	}
	dev, err := drv.Device(ordinal)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, dev.Close()) }()
	p, err := dev.Alloc(size)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, dev.Free(p)) }()

	buf := make([]byte, min(size, chunkBytes))
	for off := int64(0); off < size; off += int64(len(buf)) {
		b := buf[:min(int64(len(buf)), size-off)]
		cuda.FillPattern(b, seed, off)
		if err := dev.CopyHtoD(p+cuda.DevPtr(off), b); err != nil {
			return err
		}
	}
	// A copy from pageable memory may return before its DMA is done: make
	// sure every byte is in place before another process reads them.
	if err := dev.Synchronize(); err != nil {
		return err
	}
	h, err := dev.ExportIPC(p)
	if err != nil {
		return err
	}
	line, err := json.Marshal(Exported{Handle: hex.EncodeToString(h[:]), Device: ordinal, Bytes: size, Base: uint64(p), Pattern: seed, PID: os.Getpid()})
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintf(stdout, "%s\n", line); err != nil {
		return err
	}
	// Hold the memory until the importer is done.
	if _, err := io.Copy(io.Discard, stdin); err != nil {
		return fmt.Errorf("reading stdin: %w", err)
	}
	return nil
}
