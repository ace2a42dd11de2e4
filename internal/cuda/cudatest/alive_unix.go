//go:build unix

package cudatest

import (
	"errors"
	"syscall"
)

// alive reports whether process pid exists (one we may not signal does).
func alive(pid int) bool {
	return !errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
}
