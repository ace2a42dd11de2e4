//go:build !linux

package e2e

import "syscall"

// dieWithTest: only Linux can tie a child's life to its parent's.
var dieWithTest *syscall.SysProcAttr
