package main

import "syscall"

// childAttr makes a child die with gpucheck (SIGKILL when the thread that
// started it ends), should gpucheck be killed before it stops the child.
func childAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} }
