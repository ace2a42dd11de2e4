//go:build !linux

package redistest

import "syscall"

// dieWithParent: only Linux can tie a child's life to its parent's.
var dieWithParent *syscall.SysProcAttr
