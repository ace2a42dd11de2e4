//go:build !(linux || darwin)

package fdlimit

// Process is this process's RLIMIT_NOFILE: not known on this platform.
var Process Limits = process{}

type process struct{}

func (process) Get() (soft, hard uint64, err error) { return 0, 0, ErrUnsupported }

func (process) Set(soft, hard uint64) error { return ErrUnsupported }
