package gpuagent

import "golang.org/x/sys/unix"

// peerOf is the process at the other end of the Unix socket fd
// (LOCAL_PEERCRED for the uid, LOCAL_PEERPID for the pid).
func peerOf(fd int) (stager, error) {
	cred, err := unix.GetsockoptXucred(fd, unix.SOL_LOCAL, unix.LOCAL_PEERCRED)
	if err != nil {
		return stager{}, err
	}
	pid, err := unix.GetsockoptInt(fd, unix.SOL_LOCAL, unix.LOCAL_PEERPID)
	if err != nil {
		return stager{}, err
	}
	return stager{PID: int32(pid), UID: cred.Uid}, nil
}
