//go:build linux && !nocuda

package cuda

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/encgate/encgate/internal/cuda/cudatest"
)

func TestMain(m *testing.M) { cudatest.Main(m) }

// fake is the fake driver's test-only entry points.
type fake struct {
	lastIPCOpen func(out *IPCHandle, flags *uint32)
	legacyCalls func() int64
	streamFlags func(s uintptr) int32
	eventFlags  func(e uintptr) int32
	hostFlags   func(p unsafe.Pointer) int32
	live        func(kind int32) int32
	ctxRefs     func(ordinal int32) int32
}

// Kinds for fake.live, as fakecuda.c numbers them.
const (
	liveAlloc = 0
	liveIPC   = 1
	liveHost  = 2
)

func fakeOf(t *testing.T, path string) *fake {
	t.Helper()
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		t.Fatal(err)
	}
	f := &fake{}
	purego.RegisterLibFunc(&f.lastIPCOpen, h, "fakecuda_last_ipc_open")
	purego.RegisterLibFunc(&f.legacyCalls, h, "fakecuda_legacy_calls")
	purego.RegisterLibFunc(&f.streamFlags, h, "fakecuda_stream_flags")
	purego.RegisterLibFunc(&f.eventFlags, h, "fakecuda_event_flags")
	purego.RegisterLibFunc(&f.hostFlags, h, "fakecuda_host_flags")
	purego.RegisterLibFunc(&f.live, h, "fakecuda_live")
	purego.RegisterLibFunc(&f.ctxRefs, h, "fakecuda_ctx_refs")
	return f
}

// open loads the fake driver and opens device 0, closed at cleanup.
func open(t *testing.T) (*Driver, *Device, *fake) {
	t.Helper()
	path := cudatest.Fake(t)
	d, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	dev, err := d.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := dev.Close(); err != nil {
			t.Error(err)
		}
	})
	return d, dev, fakeOf(t, path)
}

// wantError checks that err is an *Error for call with code and its name.
func wantError(t *testing.T, err error, call string, code int, name string) {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("got %v (%T), want an *Error from %s", err, err, call)
	}
	if e.Call != call || e.Code != code || e.Name != name {
		t.Fatalf("got %+v, want {Call:%s Code:%d Name:%s}", *e, call, code, name)
	}
}

func wantUnavailable(t *testing.T, err error, substrs ...string) {
	t.Helper()
	var u *UnavailableError
	if !errors.As(err, &u) {
		t.Fatalf("got %v (%T), want an *UnavailableError", err, err)
	}
	for _, s := range substrs {
		if !strings.Contains(u.Reason, s) {
			t.Errorf("reason %q does not say %q", u.Reason, s)
		}
	}
}

func TestErrorText(t *testing.T) {
	e := &Error{Call: "cuIpcOpenMemHandle", Code: 1, Name: "CUDA_ERROR_INVALID_VALUE"}
	if got, want := e.Error(), "cuda: cuIpcOpenMemHandle: CUDA_ERROR_INVALID_VALUE (1)"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	u := &UnavailableError{Reason: "why"}
	if got, want := u.Error(), "cuda: why"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestOpenMissingLibrary(t *testing.T) {
	_, err := Open("/nonexistent/libcuda.so.1")
	// dlopen's own message, quoted.
	wantUnavailable(t, err, "/nonexistent/libcuda.so.1", "cannot open shared object file")
}

func TestOpenMissingSymbol(t *testing.T) {
	_, err := Open(cudatest.FakeVariant(t, "FAKECUDA_OMIT_EVENT_QUERY"))
	wantUnavailable(t, err, "lacks cuEventQuery")
}

func TestOpenNoDevice(t *testing.T) {
	path := cudatest.Fake(t)
	if !cudatest.InChild(t, "FAKECUDA_DEVICES=0") {
		return
	}
	_, err := Open(path)
	wantUnavailable(t, err, "cuInit", "CUDA_ERROR_NO_DEVICE (100)")
}

func TestOpenTwiceAndDriver(t *testing.T) {
	path := cudatest.Fake(t)
	for range 2 {
		d, err := Open(path)
		if err != nil {
			t.Fatal(err)
		}
		if v, err := d.DriverVersion(); err != nil || v != 12080 {
			t.Errorf("DriverVersion = %d, %v; want 12080", v, err)
		}
		if n, err := d.DeviceCount(); err != nil || n != 1 {
			t.Errorf("DeviceCount = %d, %v; want 1", n, err)
		}
	}
}

func TestDeviceOrdinals(t *testing.T) {
	d, dev, f := open(t)
	if dev.Ordinal() != 0 {
		t.Errorf("Ordinal = %d", dev.Ordinal())
	}
	for _, o := range []int{1, -1, 7} {
		_, err := d.Device(o)
		wantUnavailable(t, err, "no CUDA device", "1 device")
	}
	// Each Device is a retain of the primary context; Close releases it once.
	before := f.ctxRefs(0)
	dev2, err := d.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	if got := f.ctxRefs(0); got != before+1 {
		t.Errorf("retains = %d, want %d", got, before+1)
	}
	if err := dev2.Close(); err != nil {
		t.Fatal(err)
	}
	if err := dev2.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if got := f.ctxRefs(0); got != before {
		t.Errorf("retains = %d after Close, want %d", got, before)
	}
	if _, err := dev2.Alloc(1); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Errorf("Alloc on a closed device: %v", err)
	}
	if p, err := dev.Alloc(1); err != nil { // the other Device still works
		t.Error(err)
	} else if err := dev.Free(p); err != nil {
		t.Error(err)
	}
}

func TestContextIsRequired(t *testing.T) {
	// The fake refuses calls on a thread without a current context, so the
	// other tests show that every method sets it.
	d, _, _ := open(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if rc := d.lib.cuCtxSetCurrent(0); rc != 0 {
		t.Fatal(rc)
	}
	var p uint64
	if rc := d.lib.cuMemAlloc(&p, 16); rc != 201 {
		t.Errorf("cuMemAlloc with no context = %d, want 201", rc)
	}
	var s uintptr
	if rc := d.lib.cuStreamCreate(&s, 1); rc != 201 {
		t.Errorf("cuStreamCreate with no context = %d, want 201", rc)
	}
}

func TestMemory(t *testing.T) {
	_, dev, f := open(t)
	const n = 1<<20 + 3
	p, err := dev.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []DevPtr{p, p + 1, p + n - 1} {
		base, size, err := dev.AddressRange(q)
		if err != nil || base != p || size != n {
			t.Errorf("AddressRange(base+%d) = %#x, %d, %v; want %#x, %d", q-p, base, size, err, p, n)
		}
	}
	src := make([]byte, n)
	FillPattern(src, 7, 0)
	if err := dev.CopyHtoD(p, src); err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, n-10)
	if err := dev.CopyDtoH(dst, p+10); err != nil {
		t.Fatal(err)
	}
	if err := CheckPattern(dst, 7, 10); err != nil {
		t.Error(err)
	}
	// One byte past the end: the size arrived as given.
	wantError(t, dev.CopyHtoD(p+n-1, []byte{1, 2}), "cuMemcpyHtoD", 1, "CUDA_ERROR_INVALID_VALUE")
	wantError(t, dev.CopyDtoH(make([]byte, 2), p+n-1), "cuMemcpyDtoH", 1, "CUDA_ERROR_INVALID_VALUE")
	if err := dev.CopyHtoD(p, nil); err != nil {
		t.Errorf("empty copy: %v", err)
	}
	if _, err := dev.Alloc(0); err == nil {
		t.Error("Alloc(0) did not fail")
	}
	live := f.live(liveAlloc)
	if err := dev.Free(p); err != nil {
		t.Fatal(err)
	}
	if got := f.live(liveAlloc); got != live-1 {
		t.Errorf("live allocations %d, want %d", got, live-1)
	}
	wantError(t, dev.Free(p), "cuMemFree", 1, "CUDA_ERROR_INVALID_VALUE")
	_, _, err = dev.AddressRange(p)
	wantError(t, err, "cuMemGetAddressRange", 500, "CUDA_ERROR_NOT_FOUND")
}

func TestHostAlloc(t *testing.T) {
	_, dev, f := open(t)
	b, err := dev.HostAlloc(10000)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) != 10000 || cap(b) != 10000 {
		t.Fatalf("len %d cap %d", len(b), cap(b))
	}
	if got := f.hostFlags(unsafe.Pointer(&b[0])); got != 1 {
		t.Errorf("cuMemHostAlloc flags %d, want CU_MEMHOSTALLOC_PORTABLE (1)", got)
	}
	FillPattern(b, 3, 0) // writable
	if err := dev.HostFree(b); err != nil {
		t.Fatal(err)
	}
	wantError(t, dev.HostFree(b), "cuMemFreeHost", 1, "CUDA_ERROR_INVALID_VALUE")
	if _, err := dev.HostAlloc(0); err == nil {
		t.Error("HostAlloc(0) did not fail")
	}
}

func TestIPCInOwnProcess(t *testing.T) {
	_, dev, _ := open(t)
	p, err := dev.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Free(p)
	h, err := dev.ExportIPC(p)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(h[:], []byte("FAKECUDA")) {
		t.Fatalf("handle %x", h)
	}
	if h2, err := dev.ExportIPC(p); err != nil || h2 != h {
		t.Errorf("second export %x, %v", h2, err)
	}
	_, err = dev.ExportIPC(p + 1)
	wantError(t, err, "cuIpcGetMemHandle", 1, "CUDA_ERROR_INVALID_VALUE")
	// CUDA refuses to open a handle in the process that exported it.
	_, err = dev.OpenIPC(h)
	wantError(t, err, "cuIpcOpenMemHandle", 201, "CUDA_ERROR_INVALID_CONTEXT")
}

func TestIPCHandleArrivesByValue(t *testing.T) {
	_, dev, f := open(t)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range 20 {
		var h IPCHandle
		for j := range h {
			h[j] = byte(r.Uint32())
		}
		switch i {
		case 0:
			h = IPCHandle{}
		case 1:
			for j := range h {
				h[j] = 0xff
			}
		case 2:
			for j := range h {
				h[j] = byte(j + 1)
			}
		}
		_, err := dev.OpenIPC(h)
		wantError(t, err, "cuIpcOpenMemHandle", 1, "CUDA_ERROR_INVALID_VALUE") // no magic
		var got IPCHandle
		var flags uint32
		f.lastIPCOpen(&got, &flags)
		if got != h {
			t.Fatalf("the driver received\n%x\nfor\n%x", got, h)
		}
		if flags != 1 {
			t.Fatalf("flags %d, want CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS (1)", flags)
		}
	}
}

func TestStreamsAndEvents(t *testing.T) {
	_, dev, f := open(t)
	const n = 300000
	src, err := dev.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Free(src)
	mid, err := dev.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Free(mid)
	b := make([]byte, n)
	FillPattern(b, 11, 0)
	if err := dev.CopyHtoD(src, b); err != nil {
		t.Fatal(err)
	}
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	if got := f.streamFlags(s.h.Load()); got != 1 {
		t.Errorf("stream flags %d, want CU_STREAM_NON_BLOCKING (1)", got)
	}
	e, err := dev.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	if got := f.eventFlags(e.h.Load()); got != 2 {
		t.Errorf("event flags %d, want CU_EVENT_DISABLE_TIMING (2)", got)
	}
	if done, err := e.Query(); !done || err != nil {
		t.Errorf("an event never recorded: Query = %v, %v", done, err)
	}
	pinned, err := dev.HostAlloc(n)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.CopyDtoDAsync(mid, src, n); err != nil {
		t.Fatal(err)
	}
	if err := s.CopyDtoHAsync(pinned[100:], mid+100); err != nil {
		t.Fatal(err)
	}
	if err := e.Record(s); err != nil {
		t.Fatal(err)
	}
	if err := e.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if done, err := e.Query(); !done || err != nil {
		t.Errorf("Query after Synchronize = %v, %v", done, err)
	}
	if err := CheckPattern(pinned[100:], 11, 100); err != nil {
		t.Error(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Error(err)
	}
	if err := s.CopyDtoHAsync(make([]byte, 10), src); err == nil || !strings.Contains(err.Error(), "HostAlloc") {
		t.Errorf("CopyDtoHAsync into Go memory: %v", err)
	}
	wantError(t, s.CopyDtoDAsync(mid+1, src, n), "cuMemcpyDtoDAsync", 1, "CUDA_ERROR_INVALID_VALUE")
	if err := dev.HostFree(pinned); err != nil {
		t.Error(err)
	}
	for range 2 {
		if err := e.Close(); err != nil {
			t.Error(err)
		}
		if err := s.Close(); err != nil {
			t.Error(err)
		}
	}
	if f.streamFlags(s.h.Load()) != -1 || s.h.Load() != 0 {
		t.Error("the stream was not destroyed")
	}
	if err := s.Synchronize(); err == nil {
		t.Error("Synchronize on a closed stream did not fail")
	}
	if err := e.Record(s); err == nil {
		t.Error("Record on a closed stream did not fail")
	}
	if _, err := e.Query(); err == nil {
		t.Error("Query on a closed event did not fail")
	}
	if n := f.legacyCalls(); n != 0 {
		t.Errorf("%d calls of a plain name that has a _v2", n)
	}
}

// TestAsyncCopies shows the copies are asynchronous and the events tell when
// they are done: with every copy delayed, bytes are not there before the
// event completes, and are after.
func TestAsyncCopies(t *testing.T) {
	cudatest.Fake(t)
	if !cudatest.InChild(t, "FAKECUDA_COPY_DELAY_US=400000") {
		return
	}
	_, dev, _ := open(t)
	const n = 65536
	src, err := dev.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Free(src)
	b := make([]byte, n)
	FillPattern(b, 5, 0)
	if err := dev.CopyHtoD(src, b); err != nil {
		t.Fatal(err)
	}
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	e, err := dev.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	pinned, err := dev.HostAlloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.HostFree(pinned)

	start := time.Now()
	if err := s.CopyDtoHAsync(pinned, src); err != nil {
		t.Fatal(err)
	}
	if err := e.Record(s); err != nil {
		t.Fatal(err)
	}
	if time.Since(start) > 300*time.Millisecond {
		t.Fatal("the async copy and record blocked")
	}
	if done, err := e.Query(); done || err != nil {
		t.Fatalf("Query before the copy ran = %v, %v; want false, nil", done, err)
	}
	if !bytes.Equal(pinned, make([]byte, n)) {
		t.Fatal("the bytes arrived before the copy ran")
	}
	if err := e.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if done, err := e.Query(); !done || err != nil {
		t.Fatalf("Query after Synchronize = %v, %v", done, err)
	}
	if err := CheckPattern(pinned, 5, 0); err != nil {
		t.Fatal(err)
	}

	// Device to device, then Stream.Synchronize.
	dst, err := dev.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Free(dst)
	if err := s.CopyDtoDAsync(dst, src, n); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, n)
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if err := dev.CopyDtoH(got, dst); err != nil {
		t.Fatal(err)
	}
	if err := CheckPattern(got, 5, 0); err != nil {
		t.Fatal(err)
	}
}

// TestConcurrent runs many goroutines on two devices at once, while other
// goroutines keep clearing the current context of whatever thread they run
// on, and cuCtxSetCurrent is slow enough that goroutines come back from it
// on other threads: every call must set its device's context itself, on a
// thread it stays on. Run with -race.
func TestConcurrent(t *testing.T) {
	path := cudatest.Fake(t)
	if !cudatest.InChild(t, "FAKECUDA_DEVICES=2", "FAKECUDA_SETCURRENT_DELAY_US=50") {
		return
	}
	d, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	f := fakeOf(t, path)
	var devs [2]*Device
	for i := range devs {
		if devs[i], err = d.Device(i); err != nil {
			t.Fatal(err)
		}
	}

	// The fake would catch a stream used under another device's context.
	s1, err := devs[1].NewStream()
	if err != nil {
		t.Fatal(err)
	}
	e0, err := devs[0].NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	if err := e0.Record(s1); err == nil {
		t.Error("recording device 0's event on device 1's stream did not fail")
	}
	err = devs[0].do("cuStreamSynchronize", func() int32 { return d.lib.cuStreamSynchronize(s1.h.Load()) })
	wantError(t, err, "cuStreamSynchronize", 400, "CUDA_ERROR_INVALID_HANDLE")
	s1.Close()
	e0.Close()

	stop := make(chan struct{})
	var clobber sync.WaitGroup
	for range 4 {
		clobber.Add(1)
		go func() {
			defer clobber.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				runtime.LockOSThread()
				d.lib.cuCtxSetCurrent(0)
				runtime.UnlockOSThread()
				runtime.Gosched()
			}
		}()
	}

	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dev := devs[g%2]
			if err := work(dev, uint64(g)); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(stop)
	clobber.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for i, dev := range devs {
		if err := dev.Close(); err != nil {
			t.Error(err)
		}
		if n := f.ctxRefs(int32(i)); n != 0 {
			t.Errorf("device %d: %d retains left", i, n)
		}
	}
	for _, k := range []int32{liveAlloc, liveIPC, liveHost} {
		if n := f.live(k); n != 0 {
			t.Errorf("%d allocations of kind %d left", n, k)
		}
	}
}

func work(dev *Device, seed uint64) error {
	const n = 8192
	s, err := dev.NewStream()
	if err != nil {
		return err
	}
	defer s.Close()
	e, err := dev.NewEvent()
	if err != nil {
		return err
	}
	defer e.Close()
	pinned, err := dev.HostAlloc(n)
	if err != nil {
		return err
	}
	defer dev.HostFree(pinned)
	b := make([]byte, n)
	for i := range 40 {
		seed := seed*1000 + uint64(i)
		src, err := dev.Alloc(n)
		if err != nil {
			return err
		}
		dst, err := dev.Alloc(n)
		if err != nil {
			return err
		}
		FillPattern(b, seed, 0)
		if err := dev.CopyHtoD(src, b); err != nil {
			return err
		}
		if err := s.CopyDtoDAsync(dst, src, n); err != nil {
			return err
		}
		if err := s.CopyDtoHAsync(pinned, dst); err != nil {
			return err
		}
		if err := e.Record(s); err != nil {
			return err
		}
		for {
			done, err := e.Query()
			if err != nil {
				return err
			}
			if done {
				break
			}
			runtime.Gosched()
		}
		if err := CheckPattern(pinned, seed, 0); err != nil {
			return err
		}
		if _, _, err := dev.AddressRange(dst + 5); err != nil {
			return err
		}
		if err := dev.Free(src); err != nil {
			return err
		}
		if err := dev.Free(dst); err != nil {
			return err
		}
	}
	return nil
}

// TestLegacyNames loads a driver that has only the plain names where an old
// driver lacks the _v2 of the same signature.
func TestLegacyNames(t *testing.T) {
	path := cudatest.FakeVariant(t, "FAKECUDA_LEGACY_NAMES")
	f := fakeOf(t, path)
	d, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	before := f.legacyCalls()
	dev, err := d.Device(0)
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
	_, err = dev.OpenIPC(IPCHandle{})
	wantError(t, err, "cuIpcOpenMemHandle", 1, "CUDA_ERROR_INVALID_VALUE")
	for _, err := range []error{e.Close(), s.Close(), dev.Close()} {
		if err != nil {
			t.Error(err)
		}
	}
	if n := f.legacyCalls() - before; n != 4 {
		t.Errorf("%d calls of the plain names, want 4", n)
	}
}

func TestPattern(t *testing.T) {
	// SplitMix64 seeded with 0 starts 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4.
	want := []byte{0xaf, 0xcd, 0x1d, 0x7b, 0x39, 0xa8, 0x20, 0xe2, 0xf4, 0x65, 0xb9, 0xa1}
	got := make([]byte, len(want))
	FillPattern(got, 0, 0)
	if !bytes.Equal(got, want) {
		t.Fatalf("got %x, want %x", got, want)
	}
	b := make([]byte, 1000)
	FillPattern(b, 42, 0)
	for _, off := range []int64{0, 1, 7, 8, 13, 999} {
		for _, n := range []int{0, 1, 5, 8, 9, 100} {
			if int(off)+n > len(b) {
				continue
			}
			c := make([]byte, n)
			FillPattern(c, 42, off)
			if !bytes.Equal(c, b[off:int(off)+n]) {
				t.Fatalf("offset %d, %d bytes: %x, want %x", off, n, c, b[off:int(off)+n])
			}
			if err := CheckPattern(b[off:int(off)+n], 42, off); err != nil {
				t.Fatal(err)
			}
			if PatternByte(42, off) != b[off] {
				t.Fatalf("PatternByte(%d)", off)
			}
		}
	}
	b[500] ^= 1
	if err := CheckPattern(b[3:], 42, 3); err == nil || !strings.Contains(err.Error(), "offset 500") {
		t.Errorf("CheckPattern of a changed byte: %v", err)
	}
	if CheckPattern(b, 43, 0) == nil {
		t.Error("another seed's bytes passed")
	}
}

func TestNoLeftoverShm(t *testing.T) {
	// Device memory is shared memory objects; freed ones are gone.
	_, dev, _ := open(t)
	p, err := dev.Alloc(100)
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.Free(p); err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir("/dev/shm")
	prefix := "fakecuda." + strconv.Itoa(os.Getpid()) + "."
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), prefix) {
			// Other tests of this process may hold allocations right now only
			// if run in parallel, which these are not.
			t.Errorf("left over: /dev/shm/%s", e.Name())
		}
	}
}
