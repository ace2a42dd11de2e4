//go:build linux

package main

import (
	"net"
	"os"
	"runtime"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// end is one side of a connection pair: a client's connection or the
// upstream connection opened for it.
type end struct {
	fd   int
	peer *end
	in   []byte // bytes read that are not a whole message yet
}

// loop is the floor's one goroutine and what it owns.
type loop struct {
	mode    waitMode
	ep, lfd int
	up      unix.Sockaddr
	ends    map[int]*end
	evs     [128]unix.EpollEvent
	buf     []byte
	n       int             // events the last wait returned
	epf     *os.File        // ep, for the runtime's poller (netpoll)
	rc      syscall.RawConn // epf's
	waitFn  func(fd uintptr) bool
	stopped atomic.Bool
}

// serve runs the loop until stop (given to ready with the bound address)
// is called; ready may be nil.
func serve(listen, upstream string, mode waitMode, ready func(addr string, stop func())) error {
	ua, err := net.ResolveTCPAddr("tcp", upstream)
	if err != nil {
		return err
	}
	l := &loop{mode: mode, ends: map[int]*end{}, buf: make([]byte, maxMessage), up: sockaddr(ua)}
	la, err := net.ResolveTCPAddr("tcp", listen)
	if err != nil {
		return err
	}
	if l.lfd, err = unix.Socket(domain(la), unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0); err != nil {
		return err
	}
	defer unix.Close(l.lfd)
	_ = unix.SetsockoptInt(l.lfd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	if err := unix.Bind(l.lfd, sockaddr(la)); err != nil {
		return os.NewSyscallError("bind", err)
	}
	if err := unix.Listen(l.lfd, 1024); err != nil {
		return os.NewSyscallError("listen", err)
	}
	if l.ep, err = unix.EpollCreate1(unix.EPOLL_CLOEXEC); err != nil {
		return err
	}
	if mode == waitNetpoll {
		// Non-blocking, so that os.NewFile hands it to the runtime's poller.
		if err := unix.SetNonblock(l.ep, true); err != nil {
			unix.Close(l.ep)
			return err
		}
		l.epf = os.NewFile(uintptr(l.ep), "epoll")
		if l.rc, err = l.epf.SyscallConn(); err != nil {
			l.epf.Close()
			return err
		}
		l.waitFn = l.collect
		defer l.epf.Close()
	} else {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		defer unix.Close(l.ep)
	}
	defer l.closeAll()
	if err := l.add(l.lfd); err != nil {
		return err
	}
	if ready != nil {
		sa, _ := unix.Getsockname(l.lfd)
		ready(addrString(sa), l.stop)
	}
	for !l.stopped.Load() {
		if err := l.wait(); err != nil {
			if l.stopped.Load() {
				return nil
			}
			return err
		}
		for i := range l.n {
			l.event(&l.evs[i])
		}
	}
	return nil
}

// stop ends the loop: at its next wake-up (10 ms at most) for raw and
// blocking; at once for netpoll, whose wait a passed deadline ends.
func (l *loop) stop() {
	if l.stopped.Swap(true) {
		return
	}
	if l.epf != nil {
		_ = l.epf.SetReadDeadline(time.Unix(1, 0)) // a deadline passed ends the wait
	}
}

// wait waits for events (l.n of them in l.evs) as -wait says.
func (l *loop) wait() error {
	l.n = 0
	switch l.mode {
	case waitRaw:
		// Not syscall.Syscall: the scheduler is not told of the wait.
		k, _, errno := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT, uintptr(l.ep), uintptr(unsafe.Pointer(&l.evs[0])), uintptr(len(l.evs)), 10, 0, 0)
		if errno != 0 && errno != unix.EINTR {
			return os.NewSyscallError("epoll_pwait", errno)
		}
		if errno == 0 {
			l.n = int(k)
		}
	case waitBlocking:
		k, err := unix.EpollWait(l.ep, l.evs[:], 10)
		if err != nil && err != unix.EINTR {
			return os.NewSyscallError("epoll_pwait", err)
		}
		l.n = max(k, 0)
	case waitNetpoll:
		return l.rc.Read(l.waitFn)
	}
	return nil
}

// collect is the netpoll wait's callback: a non-blocking epoll_pwait;
// false (nothing yet) parks the goroutine until the runtime's poller says
// the epoll descriptor is readable.
func (l *loop) collect(fd uintptr) bool {
	k, _, errno := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT, fd, uintptr(unsafe.Pointer(&l.evs[0])), uintptr(len(l.evs)), 0, 0, 0)
	if errno != 0 {
		return errno != unix.EINTR && errno != unix.EAGAIN
	}
	l.n = int(k)
	return l.n > 0
}

func (l *loop) add(fd int) error {
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd)}
	return os.NewSyscallError("epoll_ctl", unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, fd, &ev))
}

func (l *loop) event(ev *unix.EpollEvent) {
	fd := int(ev.Fd)
	if fd == l.lfd {
		l.accept()
		return
	}
	if e := l.ends[fd]; e != nil {
		l.read(e)
	}
}

// accept takes every waiting connection and opens its upstream one.
func (l *loop) accept() {
	for {
		cfd, _, err := unix.Accept4(l.lfd, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
		if err != nil {
			return // EAGAIN: none left (or a failed accept: the client retries)
		}
		ufd, err := l.dial()
		if err != nil {
			unix.Close(cfd)
			continue
		}
		c, u := &end{fd: cfd}, &end{fd: ufd}
		c.peer, u.peer = u, c
		l.ends[cfd], l.ends[ufd] = c, u
		for _, fd := range []int{cfd, ufd} {
			_ = unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
			if l.add(fd) != nil {
				l.closePair(c)
				break
			}
		}
	}
}

// dial connects to the upstream (a blocking connect: loopback answers at
// once), then makes the socket non-blocking.
func (l *loop) dial() (int, error) {
	fd, err := unix.Socket(domainOf(l.up), unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	if err := unix.Connect(fd, l.up); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// read drains e's socket (edge-triggered: a read shorter than the buffer
// emptied it) and forwards every whole message to e's peer.
func (l *loop) read(e *end) {
	for {
		k, err := unix.Read(e.fd, l.buf)
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			return
		}
		if err != nil || k == 0 {
			l.closePair(e)
			return
		}
		b := l.buf[:k]
		if len(e.in) > 0 {
			e.in = append(e.in, b...)
			b = e.in
		}
		rest, ok := l.forward(e, b)
		if !ok {
			l.closePair(e)
			return
		}
		e.in = append(e.in[:0], rest...)
		if k < len(l.buf) {
			return
		}
	}
}

// forward writes b's whole messages to e's peer and returns what is left.
func (l *loop) forward(e *end, b []byte) ([]byte, bool) {
	for {
		n := frameLen(b)
		switch {
		case n < 0:
			return nil, false
		case n == 0:
			return b, true
		}
		if !writeAll(e.peer.fd, b[:n]) {
			return nil, false
		}
		b = b[n:]
	}
}

// writeAll writes b, waiting (poll, up to 1 s at a time) when the socket
// buffer is full: messages here are small, and a floor need not be fair.
func writeAll(fd int, b []byte) bool {
	for len(b) > 0 {
		n, err := unix.Write(fd, b)
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
			if k, _ := unix.Poll(pfd, 1000); k <= 0 {
				return false
			}
			continue
		case err != nil:
			return false
		}
		b = b[n:]
	}
	return true
}

// closePair closes e and its peer (closing takes them out of the epoll set).
func (l *loop) closePair(e *end) {
	for _, x := range []*end{e, e.peer} {
		if l.ends[x.fd] == x {
			delete(l.ends, x.fd)
			unix.Close(x.fd)
		}
	}
}

func (l *loop) closeAll() {
	for _, e := range l.ends {
		l.closePair(e)
	}
}

func sockaddr(a *net.TCPAddr) unix.Sockaddr {
	if ip4 := a.IP.To4(); ip4 != nil || a.IP == nil {
		sa := &unix.SockaddrInet4{Port: a.Port}
		copy(sa.Addr[:], ip4)
		return sa
	}
	sa := &unix.SockaddrInet6{Port: a.Port}
	copy(sa.Addr[:], a.IP.To16())
	return sa
}

func domain(a *net.TCPAddr) int { return domainOf(sockaddr(a)) }

func domainOf(sa unix.Sockaddr) int {
	if _, ok := sa.(*unix.SockaddrInet6); ok {
		return unix.AF_INET6
	}
	return unix.AF_INET
}

func addrString(sa unix.Sockaddr) string {
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return (&net.TCPAddr{IP: a.Addr[:], Port: a.Port}).String()
	case *unix.SockaddrInet6:
		return (&net.TCPAddr{IP: a.Addr[:], Port: a.Port}).String()
	}
	return ""
}
