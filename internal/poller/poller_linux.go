//go:build linux

package poller

import (
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// Poller is one epoll instance and the goroutine that waits on it. The
// goroutine does not sit in epoll_wait: the epoll descriptor itself is
// registered with the runtime's poller (an epoll instance is readable
// while events wait in it), and each wake-up collects them with a
// non-blocking epoll_wait. So no thread is blocked in a system call
// holding a P (with GOMAXPROCS=1, everything else would wait for sysmon
// to take it back), and Close ends the wait by closing the file.
type Poller struct {
	epfd int
	file *os.File        // epfd, for the runtime's poller
	raw  syscall.RawConn // file's

	mu     sync.Mutex
	slots  []entry
	free   []int32
	closed bool
	active int // armed watches
	done   chan struct{}
}

// entry is a watch's record, indexed by the slot carried in the epoll
// event's data; gen tells a reused slot from the watch an event was for.
type entry struct {
	fd  int
	gen uint32
	fn  func(Event)
}

// New starts a poller.
func New() (*Poller, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	// Non-blocking, so that os.NewFile hands it to the runtime's poller.
	if err := unix.SetNonblock(epfd, true); err != nil {
		unix.Close(epfd)
		return nil, err
	}
	f := os.NewFile(uintptr(epfd), "epoll")
	raw, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	p := &Poller{epfd: epfd, file: f, raw: raw, done: make(chan struct{})}
	go p.loop()
	return p, nil
}

// Watch arms a one-shot watch of fd: once fd is readable or hung up, fn
// runs on a new goroutine with what was seen, unless Stop disarmed the
// watch first. fd must stay open until fn runs or Stop returns true: the
// caller owns the descriptor while it is watched.
func (p *Poller) Watch(fd int, fn func(Event)) (Watch, error) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return Watch{}, ErrClosed
	}
	var slot int32
	if n := len(p.free); n > 0 {
		slot = p.free[n-1]
		p.free = p.free[:n-1]
	} else {
		slot = int32(len(p.slots))
		p.slots = append(p.slots, entry{})
	}
	e := &p.slots[slot]
	e.gen++
	e.fd, e.fn = fd, fn
	w := Watch{slot: slot, gen: e.gen}
	p.active++
	// Armed under the lock, so that an event for it finds its entry.
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLONESHOT, Fd: slot, Pad: int32(w.gen)}
	err := unix.EpollCtl(p.epfd, unix.EPOLL_CTL_ADD, fd, &ev)
	if err != nil {
		p.release(slot)
	}
	p.mu.Unlock()
	return w, err
}

// Stop disarms w. It reports true when the watch had not fired: its
// function will not run. False means it fired (its function runs or ran)
// or was stopped already.
func (p *Poller) Stop(w Watch) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if int(w.slot) >= len(p.slots) {
		return false
	}
	e := &p.slots[w.slot]
	if e.fn == nil || e.gen != w.gen {
		return false
	}
	if !p.closed { // after Close the descriptor's number may be another file's
		_ = unix.EpollCtl(p.epfd, unix.EPOLL_CTL_DEL, e.fd, nil)
	}
	p.release(w.slot)
	return true
}

// release frees slot; p.mu is held.
func (p *Poller) release(slot int32) {
	e := &p.slots[slot]
	e.fd, e.fn = -1, nil
	p.free = append(p.free, slot)
	p.active--
}

// Armed returns how many watches are armed (for tests and metrics).
func (p *Poller) Armed() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.active
}

// Close ends the poller's goroutine; armed watches never fire. It returns
// once the goroutine has stopped.
func (p *Poller) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		<-p.done
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	err := p.file.Close() // ends the wait in loop
	<-p.done
	return err
}

func (p *Poller) loop() {
	defer close(p.done)
	var events [128]unix.EpollEvent
	var n int
	collect := func(fd uintptr) bool {
		for {
			k, err := unix.EpollWait(int(fd), events[:], 0)
			if err == unix.EINTR {
				continue
			}
			n = max(k, 0)
			return n > 0 // none yet: wait for the runtime's poller to say so
		}
	}
	for {
		if err := p.raw.Read(collect); err != nil {
			return // closed
		}
		for i := range n {
			p.fire(&events[i])
		}
	}
}

// fire runs the watch an event is for, once: the entry is released (and
// the descriptor taken out of the set, so that it can be watched again)
// before its function starts.
func (p *Poller) fire(ev *unix.EpollEvent) {
	p.mu.Lock()
	if int(ev.Fd) >= len(p.slots) {
		p.mu.Unlock()
		return
	}
	e := &p.slots[ev.Fd]
	if e.fn == nil || e.gen != uint32(ev.Pad) {
		p.mu.Unlock()
		return // stopped meanwhile
	}
	fn := e.fn
	_ = unix.EpollCtl(p.epfd, unix.EPOLL_CTL_DEL, e.fd, nil)
	p.release(ev.Fd)
	p.mu.Unlock()
	var what Event
	if ev.Events&unix.EPOLLIN != 0 {
		what |= Readable
	}
	if ev.Events&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		what |= Hangup
	}
	go fn(what)
}
