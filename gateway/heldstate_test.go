package gateway

import "testing"

// heldModel drives a heldState as park.go does, with a model of the
// poller's one-shot watch (armed, fired with an event on its way, or
// neither), and counts what the connection and the exchange went through.
type heldModel struct {
	st       heldState
	armed    bool // the client's watch is armed and has not fired
	pending  int  // 0 none; 1 readable, 2 hangup: fired, its function not yet run
	attached bool
	finished bool

	writes, closes, releases, watches int
	closedBeforeWrite                 bool
}

func (m *heldModel) apply(t *testing.T, a heldAction) {
	t.Helper()
	if a&actStop != 0 {
		ok := m.armed // Stop disarms only a watch that has not fired
		m.armed = false
		a = a&^actStop | m.st.stopped(ok)
	}
	if a&actWatch != 0 {
		if m.armed || m.pending != 0 {
			t.Fatal("a second watch armed on the client")
		}
		m.armed = true
		m.watches++
	}
	if a&actClose != 0 {
		m.closes++
	}
	if a&actWrite != 0 {
		if m.closes > 0 {
			m.closedBeforeWrite = true
		}
		m.writes++
	}
	if a&actRelease != 0 {
		m.releases++
	}
}

func (m *heldModel) step(t *testing.T, op byte) {
	switch op % 6 {
	case 0:
		if !m.attached {
			m.attached = true
			m.apply(t, m.st.attach())
		}
	case 1:
		if !m.finished {
			m.finished = true
			m.apply(t, m.st.finish())
		}
	case 2, 3: // the watch fires: readable, or hangup
		if m.armed {
			m.armed = false
			m.pending = 1 + int(op%6-2)
		}
	case 4, 5: // its function runs
		if m.pending != 0 {
			hangup := m.pending == 2
			m.pending = 0
			m.apply(t, m.st.client(hangup))
		}
	}
}

// FuzzHeldState drives the client side of a parked exchange through
// random orders of its events (the hijack's hand-over, the exchange's end,
// the client's watch firing, its function running late) and checks that
// the connection ends exactly once (written or closed, never written after
// it was closed), that the exchange's resources are released exactly
// once, and that no watch is left armed.
func FuzzHeldState(f *testing.F) {
	for _, seed := range [][]byte{
		{0, 1},          // attach, then the answer
		{1, 0},          // the answer before the hand-over
		{0, 3, 5, 1},    // the client hangs up, then the answer
		{0, 3, 1, 5},    // hangup fired, the answer comes before its function runs
		{0, 2, 4, 1},    // pipelined bytes, then the answer
		{0, 2, 1, 4},    // readable fired as the answer came
		{0, 1, 3, 5, 2}, // events after the end
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, ops []byte) {
		var m heldModel
		for _, op := range ops {
			m.step(t, op)
		}
		// However it went, the hand-over and the end come, and a fired
		// watch's function runs.
		for _, op := range []byte{0, 4, 1, 4} {
			m.step(t, op)
		}
		if m.releases != 1 {
			t.Fatalf("ops %v: released %d times", ops, m.releases)
		}
		if m.writes+m.closes != 1 {
			t.Fatalf("ops %v: %d writes and %d closes, want one of them once", ops, m.writes, m.closes)
		}
		if m.closedBeforeWrite {
			t.Fatalf("ops %v: written after the connection was closed", ops)
		}
		if m.armed || m.pending != 0 {
			t.Fatalf("ops %v: a watch is left armed (%v) or its event undelivered (%d)", ops, m.armed, m.pending)
		}
		if !m.st.done {
			t.Fatalf("ops %v: not done: %+v", ops, m.st)
		}
		if m.watches > 1 {
			t.Fatalf("ops %v: %d watches armed over the exchange, want at most 1", ops, m.watches)
		}
	})
}
