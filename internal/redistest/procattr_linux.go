package redistest

import "syscall"

// dieWithParent kills redis-server when the test binary dies, even by a
// panic (a test timeout) that skips t.Cleanup.
var dieWithParent = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
