package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"
)

// DefaultLibrary is the driver library that Open loads when given "".
const DefaultLibrary = "libcuda.so.1"

// DevPtr is a device address (CUdeviceptr, an unsigned long long).
type DevPtr uint64

// IPCHandle is a CUipcMemHandle: the 64 opaque bytes that cuIpcGetMemHandle
// (or the runtime's cudaIpcGetMemHandle) writes for a device allocation.
type IPCHandle [64]byte

// ipcMemHandle is CUipcMemHandle as C declares it, struct { char
// reserved[64]; }, so that purego passes it by value as the C ABI passes a
// 64-byte struct: in memory, on the stack, on amd64; through a pointer to a
// caller-made copy on arm64. (An array argument would not be a struct.)
type ipcMemHandle struct{ reserved IPCHandle }

// Values from cuda.h.
const (
	cudaSuccess       = 0
	cudaErrorNotReady = 600

	ipcMemLazyEnablePeerAccess = 0x1 // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
	memHostAllocPortable       = 0x1 // CU_MEMHOSTALLOC_PORTABLE
	streamNonBlocking          = 0x1 // CU_STREAM_NON_BLOCKING
	eventDisableTiming         = 0x2 // CU_EVENT_DISABLE_TIMING
)

// UnavailableError says that CUDA cannot be used here: the driver library is
// missing (Reason quotes dlopen's message) or lacks a symbol, cuInit failed
// (CUDA_ERROR_NO_DEVICE, ...), the device ordinal does not exist, or this
// build has no loader at all.
type UnavailableError struct {
	Reason string
}

func (e *UnavailableError) Error() string { return "cuda: " + e.Reason }

// Error is a failed driver call: Call is the function's name in cuda.h
// (without a _v2 suffix), Code its CUresult and Name what cuGetErrorName says
// of it.
type Error struct {
	Call string
	Code int
	Name string
}

func (e *Error) Error() string {
	name := e.Name
	if name == "" {
		name = "unknown CUresult"
	}
	return fmt.Sprintf("cuda: %s: %s (%d)", e.Call, name, e.Code)
}

// lib holds the driver's entry points; the loader fills in every one of them
// (with the exported symbol named in the comment) or fails.
type lib struct {
	path string

	cuInit                    func(flags uint32) int32                                         // cuInit
	cuDriverGetVersion        func(v *int32) int32                                             // cuDriverGetVersion
	cuGetErrorName            func(code int32, s **byte) int32                                 // cuGetErrorName
	cuDeviceGetCount          func(n *int32) int32                                             // cuDeviceGetCount
	cuDeviceGet               func(dev *int32, ordinal int32) int32                            // cuDeviceGet
	cuDevicePrimaryCtxRetain  func(ctx *uintptr, dev int32) int32                              // cuDevicePrimaryCtxRetain
	cuDevicePrimaryCtxRelease func(dev int32) int32                                            // cuDevicePrimaryCtxRelease_v2, or the plain name
	cuCtxSetCurrent           func(ctx uintptr) int32                                          // cuCtxSetCurrent
	cuCtxSynchronize          func() int32                                                     // cuCtxSynchronize
	cuMemAlloc                func(p *uint64, n uintptr) int32                                 // cuMemAlloc_v2
	cuMemFree                 func(p uint64) int32                                             // cuMemFree_v2
	cuMemGetAddressRange      func(base *uint64, size *uintptr, p uint64) int32                // cuMemGetAddressRange_v2
	cuMemHostAlloc            func(pp *unsafe.Pointer, n uintptr, flags uint32) int32          // cuMemHostAlloc
	cuMemFreeHost             func(p unsafe.Pointer) int32                                     // cuMemFreeHost
	cuIpcGetMemHandle         func(h *IPCHandle, p uint64) int32                               // cuIpcGetMemHandle
	cuIpcOpenMemHandle        func(p *uint64, h ipcMemHandle, flags uint32) int32              // cuIpcOpenMemHandle_v2, or the plain name
	cuIpcCloseMemHandle       func(p uint64) int32                                             // cuIpcCloseMemHandle
	cuMemcpyHtoD              func(dst uint64, src unsafe.Pointer, n uintptr) int32            // cuMemcpyHtoD_v2
	cuMemcpyDtoH              func(dst unsafe.Pointer, src uint64, n uintptr) int32            // cuMemcpyDtoH_v2
	cuMemcpyDtoDAsync         func(dst, src uint64, n uintptr, s uintptr) int32                // cuMemcpyDtoDAsync_v2
	cuMemcpyDtoHAsync         func(dst unsafe.Pointer, src uint64, n uintptr, s uintptr) int32 // cuMemcpyDtoHAsync_v2
	cuStreamCreate            func(s *uintptr, flags uint32) int32                             // cuStreamCreate
	cuStreamSynchronize       func(s uintptr) int32                                            // cuStreamSynchronize
	cuStreamDestroy           func(s uintptr) int32                                            // cuStreamDestroy_v2, or the plain name
	cuEventCreate             func(e *uintptr, flags uint32) int32                             // cuEventCreate
	cuEventRecord             func(e, s uintptr) int32                                         // cuEventRecord
	cuEventQuery              func(e uintptr) int32                                            // cuEventQuery
	cuEventSynchronize        func(e uintptr) int32                                            // cuEventSynchronize
	cuEventDestroy            func(e uintptr) int32                                            // cuEventDestroy_v2, or the plain name
}

// errName is cuGetErrorName's name for code, "" when it has none.
func (l *lib) errName(code int32) string {
	var s *byte
	if l.cuGetErrorName(code, &s) != cudaSuccess || s == nil {
		return ""
	}
	n := 0
	for *(*byte)(unsafe.Add(unsafe.Pointer(s), n)) != 0 {
		n++
	}
	return string(unsafe.Slice(s, n))
}

// check is nil for CUDA_SUCCESS, else an *Error for call.
func (l *lib) check(call string, code int32) error {
	if code == cudaSuccess {
		return nil
	}
	return &Error{Call: call, Code: int(code), Name: l.errName(code)}
}

// describe is "NAME (code)" for a CUresult.
func (l *lib) describe(code int32) string {
	name := l.errName(code)
	if name == "" {
		name = "unknown CUresult"
	}
	return fmt.Sprintf("%s (%d)", name, code)
}

// Driver is a loaded CUDA driver.
type Driver struct {
	lib *lib

	mu     sync.Mutex
	pinned map[uintptr]uintptr // HostAlloc'd memory: base -> length
}

var openMu sync.Mutex // dlerror is process-wide: one Open at a time

// Open loads the driver library (library "" means DefaultLibrary, found the
// way dlopen searches), resolves every entry point this package uses up
// front and calls cuInit(0). A library that cannot be loaded, lacks a symbol
// or whose cuInit fails is an *UnavailableError.
//
// Open may be called more than once, also concurrently: dlopen hands back the
// already loaded library and cuInit does nothing the second time. The
// library is never unloaded (the driver does not support it); a Driver needs
// no closing.
func Open(library string) (*Driver, error) {
	if library == "" {
		library = DefaultLibrary
	}
	openMu.Lock()
	defer openMu.Unlock()
	l, err := load(library)
	if err != nil {
		return nil, err
	}
	if rc := l.cuInit(0); rc != cudaSuccess {
		return nil, &UnavailableError{Reason: fmt.Sprintf("cuInit failed in %s: %s", library, l.describe(rc))}
	}
	return &Driver{lib: l, pinned: map[uintptr]uintptr{}}, nil
}

// DriverVersion is cuDriverGetVersion: 1000*major + 10*minor of the newest
// CUDA version the driver supports (12040 for 12.4).
func (d *Driver) DriverVersion() (int, error) {
	var v int32
	if err := d.lib.check("cuDriverGetVersion", d.lib.cuDriverGetVersion(&v)); err != nil {
		return 0, err
	}
	return int(v), nil
}

// DeviceCount is cuDeviceGetCount: how many devices this process sees.
func (d *Driver) DeviceCount() (int, error) {
	var n int32
	if err := d.lib.check("cuDeviceGetCount", d.lib.cuDeviceGetCount(&n)); err != nil {
		return 0, err
	}
	return int(n), nil
}

// Device returns device ordinal with its primary context retained
// (cuDeviceGet, cuDevicePrimaryCtxRetain). An ordinal the driver does not
// have is an *UnavailableError. Each Device holds its own retain: Close
// every one.
func (d *Driver) Device(ordinal int) (*Device, error) {
	n, err := d.DeviceCount()
	if err != nil {
		return nil, err
	}
	if ordinal < 0 || ordinal >= n {
		return nil, &UnavailableError{Reason: fmt.Sprintf("there is no CUDA device %d: the driver sees %d device(s)", ordinal, n)}
	}
	var dev int32
	if rc := d.lib.cuDeviceGet(&dev, int32(ordinal)); rc != cudaSuccess {
		return nil, &UnavailableError{Reason: fmt.Sprintf("cuDeviceGet(%d): %s", ordinal, d.lib.describe(rc))}
	}
	var ctx uintptr
	if err := d.lib.check("cuDevicePrimaryCtxRetain", d.lib.cuDevicePrimaryCtxRetain(&ctx, dev)); err != nil {
		return nil, err
	}
	return &Device{drv: d, lib: d.lib, ordinal: ordinal, dev: dev, ctx: ctx}, nil
}

func (d *Driver) addPinned(p unsafe.Pointer, n int) {
	d.mu.Lock()
	d.pinned[uintptr(p)] = uintptr(n)
	d.mu.Unlock()
}

func (d *Driver) removePinned(p unsafe.Pointer) {
	d.mu.Lock()
	delete(d.pinned, uintptr(p))
	d.mu.Unlock()
}

// isPinned reports whether b lies inside one HostAlloc'd buffer.
func (d *Driver) isPinned(b []byte) bool {
	p, n := uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b))
	d.mu.Lock()
	defer d.mu.Unlock()
	for base, size := range d.pinned {
		if p >= base && p-base <= size && n <= size-(p-base) {
			return true
		}
	}
	return false
}

// Device is one device's primary context, retained.
type Device struct {
	drv     *Driver
	lib     *lib
	ordinal int
	dev     int32   // CUdevice
	ctx     uintptr // CUcontext, the primary context

	mu     sync.RWMutex // held shared by calls, exclusively by Close
	closed bool
}

// Ordinal is the device's ordinal, as given to Driver.Device.
func (dev *Device) Ordinal() int { return dev.ordinal }

// do runs f on a locked OS thread with the device's context current; f's
// CUresult is checked as call's.
func (dev *Device) do(call string, f func() int32) error {
	dev.mu.RLock()
	defer dev.mu.RUnlock()
	if dev.closed {
		return fmt.Errorf("cuda: %s: device %d is closed", call, dev.ordinal)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := dev.lib.check("cuCtxSetCurrent", dev.lib.cuCtxSetCurrent(dev.ctx)); err != nil {
		return err
	}
	return dev.lib.check(call, f())
}

// Close releases the primary context (cuDevicePrimaryCtxRelease). Closing
// again does nothing.
func (dev *Device) Close() error {
	dev.mu.Lock()
	defer dev.mu.Unlock()
	if dev.closed {
		return nil
	}
	dev.closed = true
	return dev.lib.check("cuDevicePrimaryCtxRelease", dev.lib.cuDevicePrimaryCtxRelease(dev.dev))
}

// Synchronize waits for all work queued in the device's context
// (cuCtxSynchronize).
func (dev *Device) Synchronize() error {
	return dev.do("cuCtxSynchronize", func() int32 { return dev.lib.cuCtxSynchronize() })
}

func badSize(what string, n int64) error {
	return fmt.Errorf("cuda: %s: the size must be positive, not %d", what, n)
}

// Alloc allocates n bytes of device memory (cuMemAlloc).
func (dev *Device) Alloc(n int64) (DevPtr, error) {
	if n <= 0 {
		return 0, badSize("cuMemAlloc", n)
	}
	var p uint64
	err := dev.do("cuMemAlloc", func() int32 { return dev.lib.cuMemAlloc(&p, uintptr(n)) })
	return DevPtr(p), err
}

// Free frees device memory from Alloc (cuMemFree).
func (dev *Device) Free(p DevPtr) error {
	return dev.do("cuMemFree", func() int32 { return dev.lib.cuMemFree(uint64(p)) })
}

// HostAlloc allocates n bytes of pinned (page-locked) host memory,
// portable to every context (cuMemHostAlloc with CU_MEMHOSTALLOC_PORTABLE),
// as a slice over it. Free it with HostFree, not by dropping it: the Go
// garbage collector does not know this memory.
func (dev *Device) HostAlloc(n int) ([]byte, error) {
	if n <= 0 {
		return nil, badSize("cuMemHostAlloc", int64(n))
	}
	var p unsafe.Pointer
	if err := dev.do("cuMemHostAlloc", func() int32 { return dev.lib.cuMemHostAlloc(&p, uintptr(n), memHostAllocPortable) }); err != nil {
		return nil, err
	}
	dev.drv.addPinned(p, n)
	return unsafe.Slice((*byte)(p), n), nil
}

// HostFree frees memory from HostAlloc (cuMemFreeHost); b must start where
// HostAlloc's slice started. b must not be used afterwards.
func (dev *Device) HostFree(b []byte) error {
	p := unsafe.Pointer(unsafe.SliceData(b))
	err := dev.do("cuMemFreeHost", func() int32 { return dev.lib.cuMemFreeHost(p) })
	if err == nil {
		dev.drv.removePinned(p)
	}
	return err
}

// OpenIPC maps an allocation exported by another process
// (cuIpcOpenMemHandle with CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) and returns
// its base in this process. CUDA refuses a handle exported by this very
// process. Opening a handle that this context has open already returns the
// same address and counts one more open: CloseIPC each open.
func (dev *Device) OpenIPC(h IPCHandle) (DevPtr, error) {
	var p uint64
	err := dev.do("cuIpcOpenMemHandle", func() int32 {
		return dev.lib.cuIpcOpenMemHandle(&p, ipcMemHandle{reserved: h}, ipcMemLazyEnablePeerAccess)
	})
	return DevPtr(p), err
}

// CloseIPC unmaps an address from OpenIPC (cuIpcCloseMemHandle).
func (dev *Device) CloseIPC(p DevPtr) error {
	return dev.do("cuIpcCloseMemHandle", func() int32 { return dev.lib.cuIpcCloseMemHandle(uint64(p)) })
}

// ExportIPC returns the IPC handle of an allocation (cuIpcGetMemHandle); p
// must be the base of an allocation from Alloc.
func (dev *Device) ExportIPC(p DevPtr) (IPCHandle, error) {
	var h IPCHandle
	err := dev.do("cuIpcGetMemHandle", func() int32 { return dev.lib.cuIpcGetMemHandle(&h, uint64(p)) })
	return h, err
}

// AddressRange returns the base and size of the allocation (or IPC mapping)
// that holds p (cuMemGetAddressRange).
func (dev *Device) AddressRange(p DevPtr) (base DevPtr, size int64, err error) {
	var b uint64
	var n uintptr
	err = dev.do("cuMemGetAddressRange", func() int32 { return dev.lib.cuMemGetAddressRange(&b, &n, uint64(p)) })
	return DevPtr(b), int64(n), err
}

// CopyHtoD copies src to dst (cuMemcpyHtoD). It is synchronous: src may be
// reused when it returns.
func (dev *Device) CopyHtoD(dst DevPtr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	return dev.do("cuMemcpyHtoD", func() int32 {
		return dev.lib.cuMemcpyHtoD(uint64(dst), unsafe.Pointer(unsafe.SliceData(src)), uintptr(len(src)))
	})
}

// CopyDtoH copies len(dst) bytes from src to dst (cuMemcpyDtoH); it returns
// once the bytes are in dst.
func (dev *Device) CopyDtoH(dst []byte, src DevPtr) error {
	if len(dst) == 0 {
		return nil
	}
	return dev.do("cuMemcpyDtoH", func() int32 {
		return dev.lib.cuMemcpyDtoH(unsafe.Pointer(unsafe.SliceData(dst)), uint64(src), uintptr(len(dst)))
	})
}

// Stream is a CUDA stream of one device.
type Stream struct {
	dev *Device
	h   atomic.Uintptr // CUstream; 0 once closed
}

// NewStream creates a stream that does not synchronise with the legacy
// default stream (cuStreamCreate with CU_STREAM_NON_BLOCKING).
func (dev *Device) NewStream() (*Stream, error) {
	var h uintptr
	if err := dev.do("cuStreamCreate", func() int32 { return dev.lib.cuStreamCreate(&h, streamNonBlocking) }); err != nil {
		return nil, err
	}
	s := &Stream{dev: dev}
	s.h.Store(h)
	return s, nil
}

var errClosedStream = errors.New("the stream is closed")

// do runs f with the stream's handle; a closed stream is an error, never the
// legacy default stream (handle 0).
func (s *Stream) do(call string, f func(h uintptr) int32) error {
	h := s.h.Load()
	if h == 0 {
		return fmt.Errorf("cuda: %s: %w", call, errClosedStream)
	}
	return s.dev.do(call, func() int32 { return f(h) })
}

// CopyDtoDAsync queues a copy of n bytes from src to dst on the stream
// (cuMemcpyDtoDAsync).
func (s *Stream) CopyDtoDAsync(dst, src DevPtr, n int64) error {
	if n < 0 {
		return badSize("cuMemcpyDtoDAsync", n)
	}
	if n == 0 {
		return nil
	}
	return s.do("cuMemcpyDtoDAsync", func(h uintptr) int32 {
		return s.dev.lib.cuMemcpyDtoDAsync(uint64(dst), uint64(src), uintptr(n), h)
	})
}

// CopyDtoHAsync queues a copy of len(dst) bytes from src into dst on the
// stream (cuMemcpyDtoHAsync); the bytes are there once an event recorded
// after it completes, or the stream is synchronised. dst must lie in memory
// from HostAlloc (of a Device of the same Driver), else it is an error: the driver would go on writing into
// memory the Go garbage collector may free, and with pageable memory real
// CUDA makes the copy synchronous anyway.
func (s *Stream) CopyDtoHAsync(dst []byte, src DevPtr) error {
	if len(dst) == 0 {
		return nil
	}
	if !s.dev.drv.isPinned(dst) {
		return errors.New("cuda: cuMemcpyDtoHAsync: the destination is not memory from HostAlloc")
	}
	return s.do("cuMemcpyDtoHAsync", func(h uintptr) int32 {
		return s.dev.lib.cuMemcpyDtoHAsync(unsafe.Pointer(unsafe.SliceData(dst)), uint64(src), uintptr(len(dst)), h)
	})
}

// Synchronize waits for everything queued on the stream
// (cuStreamSynchronize).
func (s *Stream) Synchronize() error {
	return s.do("cuStreamSynchronize", func(h uintptr) int32 { return s.dev.lib.cuStreamSynchronize(h) })
}

// Close destroys the stream (cuStreamDestroy); work queued on it still
// completes. Closing again does nothing.
func (s *Stream) Close() error {
	h := s.h.Swap(0)
	if h == 0 {
		return nil
	}
	return s.dev.do("cuStreamDestroy", func() int32 { return s.dev.lib.cuStreamDestroy(h) })
}

// Event is a CUDA event of one device, without timing.
type Event struct {
	dev *Device
	h   atomic.Uintptr // CUevent; 0 once closed
}

// NewEvent creates an event (cuEventCreate with CU_EVENT_DISABLE_TIMING).
func (dev *Device) NewEvent() (*Event, error) {
	var h uintptr
	if err := dev.do("cuEventCreate", func() int32 { return dev.lib.cuEventCreate(&h, eventDisableTiming) }); err != nil {
		return nil, err
	}
	e := &Event{dev: dev}
	e.h.Store(h)
	return e, nil
}

func (e *Event) do(call string, f func(h uintptr) int32) error {
	h := e.h.Load()
	if h == 0 {
		return fmt.Errorf("cuda: %s: the event is closed", call)
	}
	return e.dev.do(call, func() int32 { return f(h) })
}

// Record queues the event on s (cuEventRecord): it completes once all work
// queued on s before it has. s must be a stream of the event's device.
func (e *Event) Record(s *Stream) error {
	if s.dev != e.dev {
		return fmt.Errorf("cuda: cuEventRecord: the event is device %d's, the stream device %d's", e.dev.ordinal, s.dev.ordinal)
	}
	sh := s.h.Load()
	if sh == 0 {
		return fmt.Errorf("cuda: cuEventRecord: %w", errClosedStream)
	}
	return e.do("cuEventRecord", func(h uintptr) int32 { return e.dev.lib.cuEventRecord(h, sh) })
}

// Synchronize waits until the event's last Record has completed
// (cuEventSynchronize); an event never recorded is complete.
func (e *Event) Synchronize() error {
	return e.do("cuEventSynchronize", func(h uintptr) int32 { return e.dev.lib.cuEventSynchronize(h) })
}

// Query reports whether the event's last Record has completed (cuEventQuery;
// CUDA_ERROR_NOT_READY is false, nil).
func (e *Event) Query() (done bool, err error) {
	var rc int32
	err = e.do("cuEventQuery", func(h uintptr) int32 {
		rc = e.dev.lib.cuEventQuery(h)
		if rc == cudaErrorNotReady {
			return cudaSuccess
		}
		return rc
	})
	return err == nil && rc == cudaSuccess, err
}

// Close destroys the event (cuEventDestroy). Closing again does nothing.
func (e *Event) Close() error {
	h := e.h.Swap(0)
	if h == 0 {
		return nil
	}
	return e.dev.do("cuEventDestroy", func() int32 { return e.dev.lib.cuEventDestroy(h) })
}
