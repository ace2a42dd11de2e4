package gateway

// heldState is the client side of a parked exchange (park.go) as a state
// machine: which of its events have come, and what each asks to be done.
// It does no I/O, so that every order of its events can be driven by a
// fuzz target (FuzzHeldState); held applies its actions under its mutex.
//
// The events:
//   - attach: fasthttp handed the client's connection over (the hijack
//     handler, after the request's handler returned);
//   - finish: the exchange ended (on the goroutine that resumed it);
//   - client: the client's watch fired: hangup (it closed or reset the
//     connection) or readable (it sent more: a pipelined request, left
//     unread for the server to serve once the answer is out);
//   - stopped: what disarming the client's watch found (finish disarms it:
//     false means it fired meanwhile, and its event is on its way).
//
// Whatever the order, the connection ends exactly once, answered (write)
// or closed, and the exchange's resources are released exactly once
// (release), once both the exchange has ended and the connection was
// handed over.
type heldState struct {
	attached bool // the connection was handed over
	watching bool // the client's watch is armed
	ended    bool // the exchange ended: its result waits to be written
	gone     bool // the client hung up; its connection is closed
	done     bool // written or closed, and released: nothing more happens
}

// heldAction is what an event asks of held, as bits.
type heldAction uint8

const (
	actWatch   heldAction = 1 << iota // arm the client's watch
	actStop                           // disarm it, then tell stopped what that found
	actWrite                          // write the answer, then keep the connection or close it
	actClose                          // close the connection: the client hung up
	actRelease                        // release the exchange's resources
)

func (s *heldState) attach() heldAction {
	if s.attached || s.done {
		return 0
	}
	s.attached = true
	if s.ended {
		return s.answer()
	}
	s.watching = true
	return actWatch
}

func (s *heldState) finish() heldAction {
	if s.ended || s.done {
		return 0
	}
	s.ended = true
	switch {
	case s.gone:
		s.done = true
		return actRelease
	case !s.attached:
		return 0 // attach writes it
	case s.watching:
		return actStop
	}
	return s.answer() // the client sent more earlier: its watch is not armed
}

func (s *heldState) stopped(ok bool) heldAction {
	if !ok || !s.watching || s.done {
		return 0 // the watch fired: client answers
	}
	s.watching = false
	return s.answer()
}

func (s *heldState) client(hangup bool) heldAction {
	if !s.watching || s.done {
		return 0
	}
	s.watching = false
	if hangup {
		s.gone = true
		if s.ended {
			s.done = true
			return actClose | actRelease
		}
		return actClose
	}
	if s.ended {
		return s.answer()
	}
	return 0 // not re-armed: the bytes wait for the server, after the answer
}

func (s *heldState) answer() heldAction {
	s.done = true
	return actWrite | actRelease
}
