//go:build !linux

package main

import "syscall"

// dieWithTest: only Linux can tie a child's life to its parent's.
var dieWithTest *syscall.SysProcAttr
