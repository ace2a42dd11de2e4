// Package acktest is a ZMQ PULL endpoint for tests of the gpuagent's
// completion acks. It speaks ZMTP through go-zeromq/zmq4's connection API,
// one connection at a time as a PULL peer, and records each message before
// it closes that connection. The agent waits for that close after writing
// its frame, so once a /send has returned, every ack it sent is in Frames:
// a test can count acks, and see that none came, without waiting.
//
// With Hold, the endpoint keeps each connection open after its messages
// until Release, which keeps the agent's /send in flight (in its ack's
// linger) for as long as a test needs.
package acktest

import (
	"net"
	"sync"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// Sink is a PULL endpoint on a loopback port.
type Sink struct {
	ln       net.Listener
	hold     chan struct{} // closed by Release; nil without Hold
	released sync.Once
	msgs     chan [][]byte
	wg       sync.WaitGroup

	mu     sync.Mutex // protects frames and conns
	frames [][][]byte
	conns  map[net.Conn]struct{}
	closed bool
}

// Options shape a Sink.
type Options struct {
	// Hold keeps each connection open after its last message until Release
	// (or Close).
	Hold bool
}

// Start listens on 127.0.0.1 on a free port.
func Start(opts Options) (*Sink, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &Sink{ln: ln, msgs: make(chan [][]byte, 1024), conns: map[net.Conn]struct{}{}}
	if opts.Hold {
		s.hold = make(chan struct{})
	}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// Port is the port the endpoint listens on: the /send's embedding_port.
func (s *Sink) Port() int { return s.ln.Addr().(*net.TCPAddr).Port }

// Frames returns every message recorded so far, each as its frames.
func (s *Sink) Frames() [][][]byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([][][]byte(nil), s.frames...)
}

// Messages delivers each message as it is recorded (up to 1024 unread).
func (s *Sink) Messages() <-chan [][]byte { return s.msgs }

// Release lets held connections close.
func (s *Sink) Release() {
	if s.hold != nil {
		s.released.Do(func() { close(s.hold) })
	}
}

// Close stops listening, closes every connection and waits for them.
func (s *Sink) Close() error {
	err := s.ln.Close()
	s.mu.Lock()
	s.closed = true
	for c := range s.conns {
		_ = c.Close()
	}
	s.mu.Unlock()
	s.Release()
	s.wg.Wait()
	return err
}

func (s *Sink) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			_ = c.Close()
			return
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.serve(c)
	}
}

// serve reads one peer's messages until it closes its side, then (after
// Release, with Hold) closes.
func (s *Sink) serve(c net.Conn) {
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		_ = c.Close()
	}()
	zc, err := zmq4.Open(c, null.Security(), zmq4.Pull, nil, true, nil)
	if err != nil {
		return
	}
	for {
		msg, err := zc.RecvMsg()
		if err != nil {
			break
		}
		if msg.Type != zmq4.UsrMsg {
			continue
		}
		s.mu.Lock()
		s.frames = append(s.frames, msg.Frames)
		s.mu.Unlock()
		select {
		case s.msgs <- msg.Frames:
		default:
		}
	}
	if s.hold != nil {
		<-s.hold
	}
}
