//go:build linux || darwin

package fdlimit

import "syscall"

// Process is this process's RLIMIT_NOFILE.
var Process Limits = process{}

type process struct{}

func (process) Get() (soft, hard uint64, err error) {
	var r syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &r); err != nil {
		return 0, 0, err
	}
	return r.Cur, r.Max, nil
}

func (process) Set(soft, hard uint64) error {
	return syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: soft, Max: hard})
}
