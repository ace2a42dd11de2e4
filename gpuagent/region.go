package gpuagent

import (
	"errors"
	"fmt"
	"os"
	"syscall"

	"github.com/encgate/encgate/gpuagent/pipeline"
)

// region is a staged embedding's memory: data is the embedding, mapping is
// what to unmap when it is released (anonymous memory for bytes that came in
// a body, a read-only mapping of a file whose descriptor the stager passed). Neither is Go heap, so
// the garbage collector never sees or moves the bytes, and pinning them
// (mlock) pins only them.
type region struct {
	data    []byte
	mapping []byte
	// file is the passed file (nil for anonymous memory), kept so a send can
	// see that its writer truncated it; need is offset+len(data).
	file *os.File
	need int64
	// device, when set, is a stage by CUDA IPC handle: the bytes are in
	// device memory (data is nil).
	device *deviceMem
}

// size is the embedding's size in bytes.
func (r region) size() int64 {
	if r.device != nil {
		return r.device.n
	}
	return int64(len(r.data))
}

// source is the region as the transfer pipeline reads it.
func (r region) source() pipeline.Source {
	if r.device != nil {
		return r.device
	}
	return pipeline.Host(r.data)
}

// allocRegion maps n bytes of anonymous private memory.
func allocRegion(n int64) (region, error) {
	m, err := syscall.Mmap(-1, 0, int(n), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return region{}, fmt.Errorf("allocating %d bytes: %w", n, err)
	}
	return region{data: m, mapping: m}, nil
}

// mapFD maps n bytes of the passed file fd from offset, read-only and shared
// with the writer (a memfd or a /dev/shm file the stager opened): the
// mapping starts at the page boundary below offset and data is sliced from
// it. The file must be a regular file holding at least offset+n bytes and
// readable through fd. mapFD owns fd: kept in the region, or closed. Errors
// are *badRequest when the stager passed something unusable.
func mapFD(fd int, offset, n int64) (reg region, err error) {
	f := os.NewFile(uintptr(fd), "passed file")
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return region{}, badf("encgate: cannot stat the passed file: %v", err)
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return region{}, badf("encgate: the passed descriptor is not a regular file (a memfd or a /dev/shm file)")
	}
	if st.Size < offset || st.Size-offset < n {
		return region{}, badf("encgate: the passed file holds %d bytes, fewer than offset %d + %d", st.Size, offset, n)
	}
	page := int64(os.Getpagesize())
	skip := offset % page
	m, err := syscall.Mmap(fd, offset-skip, int(n+skip), syscall.PROT_READ, syscall.MAP_SHARED)
	if errors.Is(err, syscall.EACCES) {
		return region{}, badf("encgate: the passed descriptor is not open for reading")
	}
	if err != nil {
		return region{}, fmt.Errorf("mapping the passed file: %w", err)
	}
	return region{data: m[skip : skip+n : skip+n], mapping: m, file: f, need: offset + n}, nil
}

// check reports a mapped file that no longer holds the staged range (its
// writer truncated it): sending would fault on the missing pages.
func (r region) check() error {
	if r.file == nil {
		return nil
	}
	st, err := r.file.Stat()
	if err != nil {
		return fmt.Errorf("cannot stat the staged file: %w", err)
	}
	if st.Size() < r.need {
		return fmt.Errorf("the staged file now holds %d bytes, fewer than the %d staged from it (truncated by its writer?)",
			st.Size(), r.need)
	}
	return nil
}

// free unmaps the region (and closes its file); a zero region is a no-op.
func (r region) free() error {
	var err error
	if r.device != nil {
		err = r.device.free()
	}
	if r.mapping != nil {
		err = syscall.Munmap(r.mapping)
	}
	if r.file != nil {
		err = errors.Join(err, r.file.Close())
	}
	return err
}
