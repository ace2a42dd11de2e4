// Package cuda reaches the CUDA driver API (libcuda.so.1) at run time,
// without cgo, through github.com/ebitengine/purego.
//
// It binds the driver API and not the runtime API: every machine with an
// NVIDIA driver has libcuda, while libcudart may be absent. A handle made by
// the runtime's cudaIpcGetMemHandle is the driver's CUipcMemHandle (64
// bytes), so [Device.OpenIPC] opens handles exported by PyTorch and friends.
//
// # Builds
//
// The loader is compiled on Linux only, and not with -tags nocuda: purego
// makes a Linux binary dynamically linked (it needs ld.so to dlopen), and the
// static scratch image is built with -tags nocuda. In every other build
// [Open] returns an [*UnavailableError] saying why, and the rest of the API
// exists so that callers compile everywhere.
//
// # Threads and contexts
//
// CUDA's current context is per OS thread. Every method of [Device],
// [Stream] and [Event] locks its goroutine to its thread, makes the device's
// primary context current, makes the call and unlocks the thread, so that a
// goroutine moving between threads never calls the driver with no context
// or another device's. All methods are safe for concurrent use, except that
// closing a [Device], [Stream] or [Event] must come after every other use of
// it (and of the streams and events of a device) has returned.
package cuda
