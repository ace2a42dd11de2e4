//go:build linux && !nocuda

package cuda

import (
	"fmt"
	"strings"

	"github.com/ebitengine/purego"
)

// load dlopens path and resolves every entry point of lib.
func load(path string) (*lib, error) {
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return nil, &UnavailableError{Reason: fmt.Sprintf("cannot load the CUDA driver library %s: dlopen: %v", path, err)}
	}
	l := &lib{path: path}
	// Each entry lists the names to try, best first. The _v2 names are the
	// ones cuda.h #defines the plain names to. Where the plain symbol has the
	// same signature (the _v2 came with CUDA 4.0 or 11.0 for other reasons)
	// an older driver's plain symbol will do; the plain memory functions
	// (cuMemAlloc, cuMemcpyHtoD, ...) are the CUDA 2.x ones with 32-bit
	// CUdeviceptr and sizes, so those have no fallback.
	syms := []struct {
		fptr  any
		names []string
	}{
		{&l.cuInit, []string{"cuInit"}},
		{&l.cuDriverGetVersion, []string{"cuDriverGetVersion"}},
		{&l.cuGetErrorName, []string{"cuGetErrorName"}},
		{&l.cuDeviceGetCount, []string{"cuDeviceGetCount"}},
		{&l.cuDeviceGet, []string{"cuDeviceGet"}},
		{&l.cuDevicePrimaryCtxRetain, []string{"cuDevicePrimaryCtxRetain"}},
		{&l.cuDevicePrimaryCtxRelease, []string{"cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"}},
		{&l.cuCtxSetCurrent, []string{"cuCtxSetCurrent"}},
		{&l.cuCtxSynchronize, []string{"cuCtxSynchronize"}},
		{&l.cuMemAlloc, []string{"cuMemAlloc_v2"}},
		{&l.cuMemFree, []string{"cuMemFree_v2"}},
		{&l.cuMemGetAddressRange, []string{"cuMemGetAddressRange_v2"}},
		{&l.cuMemHostAlloc, []string{"cuMemHostAlloc"}},
		{&l.cuMemFreeHost, []string{"cuMemFreeHost"}},
		{&l.cuIpcGetMemHandle, []string{"cuIpcGetMemHandle"}},
		{&l.cuIpcOpenMemHandle, []string{"cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"}},
		{&l.cuIpcCloseMemHandle, []string{"cuIpcCloseMemHandle"}},
		{&l.cuMemcpyHtoD, []string{"cuMemcpyHtoD_v2"}},
		{&l.cuMemcpyDtoH, []string{"cuMemcpyDtoH_v2"}},
		{&l.cuMemcpyDtoDAsync, []string{"cuMemcpyDtoDAsync_v2"}},
		{&l.cuMemcpyDtoHAsync, []string{"cuMemcpyDtoHAsync_v2"}},
		{&l.cuStreamCreate, []string{"cuStreamCreate"}},
		{&l.cuStreamSynchronize, []string{"cuStreamSynchronize"}},
		{&l.cuStreamDestroy, []string{"cuStreamDestroy_v2", "cuStreamDestroy"}},
		{&l.cuEventCreate, []string{"cuEventCreate"}},
		{&l.cuEventRecord, []string{"cuEventRecord"}},
		{&l.cuEventQuery, []string{"cuEventQuery"}},
		{&l.cuEventSynchronize, []string{"cuEventSynchronize"}},
		{&l.cuEventDestroy, []string{"cuEventDestroy_v2", "cuEventDestroy"}},
	}
	var missing []string
	for _, s := range syms {
		var addr uintptr
		for _, name := range s.names {
			if a, err := purego.Dlsym(h, name); err == nil && a != 0 {
				addr = a
				break
			}
		}
		if addr == 0 {
			missing = append(missing, strings.Join(s.names, " or "))
			continue
		}
		purego.RegisterFunc(s.fptr, addr)
	}
	if len(missing) > 0 {
		// The library stays loaded: unloading a driver is not safe.
		return nil, &UnavailableError{Reason: fmt.Sprintf("the CUDA driver library %s lacks %s (too old a driver?)", path, strings.Join(missing, ", "))}
	}
	return l, nil
}
