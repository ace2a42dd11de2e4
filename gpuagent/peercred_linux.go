package gpuagent

import "syscall"

// peerOf is the process at the other end of the Unix socket fd
// (SO_PEERCRED: as it was when it connected).
func peerOf(fd int) (stager, error) {
	cred, err := syscall.GetsockoptUcred(fd, syscall.SOL_SOCKET, syscall.SO_PEERCRED)
	if err != nil {
		return stager{}, err
	}
	return stager{PID: cred.Pid, UID: cred.Uid}, nil
}
