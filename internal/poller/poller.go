// Package poller watches sockets for a gateway's parked exchanges: one
// goroutine waits on the kernel's readiness notification (epoll) for every
// watched descriptor, and each watch fires once, running its function on a
// goroutine of its own. While a descriptor is watched nothing of the
// caller's waits: no goroutine, no stack, no buffer, only the watch's small
// record.
//
// Why not the runtime's own poller: it wakes only a goroutine already
// blocked on the descriptor, and a goroutine per held request (its stack,
// the request's context and buffers kept alive with it) is what parking
// exists to remove (bench/held.sh). A descriptor the runtime also polls can
// be watched here as well: epoll keeps one registration per instance, and
// this one is level-triggered and one-shot, so it neither takes the
// runtime's edge-triggered wake-ups nor misses bytes that arrived before it
// was armed.
package poller

import "errors"

// Event says why a watch fired.
type Event uint8

const (
	// Readable: bytes (or a pending error or end of stream) wait on the
	// descriptor.
	Readable Event = 1 << iota
	// Hangup: the peer closed its side or reset the connection, or the
	// socket has an error.
	Hangup
)

// ErrClosed is returned by Watch after Close.
var ErrClosed = errors.New("poller: closed")

// ErrUnsupported is returned by New where the platform has no epoll.
var ErrUnsupported = errors.New("poller: not supported on this platform")

// A Watch is one armed watch; Stop disarms it.
type Watch struct {
	slot int32
	gen  uint32
}
