//go:build !linux

package main

import "syscall"

// childAttr is nil: only Linux has a parent-death signal.
func childAttr() *syscall.SysProcAttr { return nil }
