package mooncake

import (
	"errors"
	"fmt"
)

var (
	// ErrNotTCP means the peer's segment descriptor does not list the "tcp"
	// protocol (for example a receiver with an RDMA HCA that was not started
	// with MC_FORCE_TCP=1), so it publishes no TCP data port.
	ErrNotTCP = errors.New("mooncake: peer does not speak the tcp transport")
	// ErrBadMagic means an 8-byte status frame did not end in "VTCM": the peer
	// is a legacy (v1) one, or the stream is out of step.
	ErrBadMagic = errors.New("mooncake: status frame has the wrong magic (legacy peer)")
	// ErrFrameTooLarge means a handshake frame announced a length above the
	// limit; its body is not read.
	ErrFrameTooLarge = errors.New("mooncake: handshake frame too large")
	// ErrClosed is returned by an Initiator after Close.
	ErrClosed = errors.New("mooncake: initiator closed")
	// ErrNotHandshakePeer means the handshake destination answered the
	// Metadata request with something that is not a Mooncake reply: a length
	// of 0 or above the limit (ErrFrameTooLarge, which it also matches), a
	// frame of another type or of the old untyped form, or a body that is not
	// a segment descriptor. Its text quotes nothing of what the peer sent, so
	// a /send aimed at another service (an HTTP or SSH server) learns nothing
	// of it.
	ErrNotHandshakePeer = errors.New("not a Mooncake handshake peer (reply not in the expected form)")

	errEmptyFrame = errors.New("mooncake: handshake frame of length 0")
)

// notPeerError is a handshake reply that failed a check. Its text is
// ErrNotHandshakePeer's, followed by reason when there is one (a fixed text,
// or numbers that passed their checks); it matches ErrNotHandshakePeer and
// cause (errors.Is), whose own text is not shown.
type notPeerError struct {
	reason string
	cause  error
}

func (e *notPeerError) Error() string {
	if e.reason == "" {
		return ErrNotHandshakePeer.Error()
	}
	return ErrNotHandshakePeer.Error() + ": " + e.reason
}

func (e *notPeerError) Unwrap() []error {
	if e.cause == nil {
		return []error{ErrNotHandshakePeer}
	}
	return []error{ErrNotHandshakePeer, e.cause}
}

// RangeError is returned by Initiator.Write, before anything is sent, when
// [Addr, Addr+Size) does not lie inside one buffer of the session's descriptor.
type RangeError struct {
	Session    string
	Addr, Size uint64
}

func (e *RangeError) Error() string {
	return fmt.Sprintf("range %s of %d bytes is not inside one buffer of session %s",
		formatRange(e.Addr, e.Size), e.Size, e.Session)
}

// RejectedError is returned by Initiator.Write when a v2 peer answered
// ADDR_REJECTED: the receiver itself found [Addr, Addr+Size) outside its
// registered buffers and wrote nothing.
type RejectedError struct {
	Session    string
	Addr, Size uint64
}

func (e *RejectedError) Error() string {
	return fmt.Sprintf("session %s rejected range %s of %d bytes (ADDR_REJECTED)",
		e.Session, formatRange(e.Addr, e.Size), e.Size)
}

// formatRange writes [addr,end) in hex; an end past 2^64-1 is shown as such.
func formatRange(addr, size uint64) string {
	end := addr + size
	if end < addr {
		return fmt.Sprintf("[%#x,2^64+%#x)", addr, end)
	}
	return fmt.Sprintf("[%#x,%#x)", addr, end)
}
