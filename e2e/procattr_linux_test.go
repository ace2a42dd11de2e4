package e2e

import "syscall"

// dieWithTest kills a gateway process started by a test when the test
// binary dies, even by a panic (a test timeout) that skips its cleanups.
var dieWithTest = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
