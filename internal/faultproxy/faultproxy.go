// Package faultproxy puts a TCP proxy on loopback between clients and a
// server (Redis, in the tests that use it) and injects one fault on demand:
// a lost reply followed by an outage. The next command whose bytes contain
// a given string goes through to the server, which applies it; the server's
// reply is dropped; and the link is cut at once. Every connection through
// the proxy is closed, and connections accepted during the outage are reset
// as soon as they open. When the outage ends, after a set duration or when
// the test calls Heal, the proxy forwards again. CutBefore cuts the link
// before the command reaches the server instead: a command lost on its
// way.
//
// The client cannot tell whether its command was applied, though it was.
// That is the ambiguous failure a lost reply is, and what a Redis blip does
// to a client. A connection refused during the outage is accepted and then
// reset, not refused at connect. That keeps the port and avoids go-redis's
// pause after a run of refused dials, and the client's command fails all the
// same.
//
// It is test infrastructure: Start ties the proxy to a test and closes it
// when the test ends, after waiting for every goroutine it started.
package faultproxy

import (
	"bytes"
	"net"
	"sync"
	"testing"
	"time"
)

// Proxy forwards connections from its loopback address to a target.
type Proxy struct {
	target string
	ln     net.Listener

	mu     sync.Mutex // protects links, armed, down and closed
	links  map[*link]struct{}
	armed  *Fault // waiting for its command
	down   *Fault // the outage in progress
	closed bool

	wg sync.WaitGroup // the accept loop and every pump
}

// Fault is one lost reply and the outage after it.
type Fault struct {
	match  []byte
	outage time.Duration
	before bool // cut before the command reaches the target (CutBefore)

	cut    chan struct{} // closed when the reply was dropped and the link cut
	healed chan struct{} // closed when the outage ended
	once   sync.Once     // closes healed
	timer  *time.Timer   // ends a timed outage; set under Proxy.mu
}

// Cut is closed once the command went through, its reply was dropped and
// every connection was closed.
func (f *Fault) Cut() <-chan struct{} { return f.cut }

// Healed is closed once the outage ended and the proxy forwards again.
func (f *Fault) Healed() <-chan struct{} { return f.healed }

// link is one client connection and its connection to the target.
type link struct {
	client, server net.Conn
	drop           *Fault // set before the matched command is written: its reply is dropped
	closeOnce      sync.Once
}

func (l *link) close() {
	l.closeOnce.Do(func() {
		_ = l.client.Close()
		_ = l.server.Close()
	})
}

// Start runs a proxy to target (host:port) on a free loopback port and
// closes it when t ends.
func Start(t testing.TB, target string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("faultproxy: %v", err)
	}
	p := &Proxy{target: target, ln: ln, links: make(map[*link]struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.Close)
	return p
}

// Addr is the proxy's host:port: point the client here.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// DropReplyAndCut arms a fault. The next command a client sends whose bytes
// contain match reaches the target. The proxy drops the target's reply to
// it and cuts the link, which stays cut for outage, or until Heal when
// outage is 0. Arming again before the fault hits replaces the armed fault.
//
// The match is looked for in each chunk read from a client: a command that
// a client writes in one write, as go-redis does, is found whole (a
// command split across two writes might not be).
func (p *Proxy) DropReplyAndCut(match string, outage time.Duration) *Fault {
	f := &Fault{match: []byte(match), outage: outage, cut: make(chan struct{}), healed: make(chan struct{})}
	p.mu.Lock()
	p.armed = f
	p.mu.Unlock()
	return f
}

// CutBefore arms a fault like DropReplyAndCut's, except that the matched
// command never reaches the target: the link is cut as it arrives. The
// client cannot tell this from a lost reply either.
func (p *Proxy) CutBefore(match string, outage time.Duration) *Fault {
	f := p.DropReplyAndCut(match, outage)
	p.mu.Lock()
	f.before = true
	p.mu.Unlock()
	return f
}

// Heal ends the outage in progress, if any: the proxy forwards again.
func (p *Proxy) Heal() {
	p.mu.Lock()
	f := p.down
	p.mu.Unlock()
	if f != nil {
		p.heal(f)
	}
}

// heal ends f's outage if it is the one in progress.
func (p *Proxy) heal(f *Fault) {
	p.mu.Lock()
	if p.down != f {
		p.mu.Unlock()
		return
	}
	p.down = nil
	if f.timer != nil {
		f.timer.Stop()
	}
	p.mu.Unlock()
	f.once.Do(func() { close(f.healed) })
}

// Close stops the proxy, closes every connection and waits for its
// goroutines. An outage in progress stays unhealed.
func (p *Proxy) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	links := p.takeLinks()
	if p.down != nil && p.down.timer != nil {
		p.down.timer.Stop()
	}
	p.mu.Unlock()
	_ = p.ln.Close()
	for _, l := range links {
		l.close()
	}
	p.wg.Wait()
}

// takeLinks empties the link set and returns what it held. p.mu is held.
func (p *Proxy) takeLinks() []*link {
	out := make([]*link, 0, len(p.links))
	for l := range p.links {
		out = append(out, l)
	}
	clear(p.links)
	return out
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		p.mu.Lock()
		down := p.down != nil || p.closed
		p.mu.Unlock()
		if down {
			reset(c)
			continue
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			reset(c) // the target is gone: so is the link
			continue
		}
		l := &link{client: c, server: s}
		p.mu.Lock()
		if p.down != nil || p.closed {
			p.mu.Unlock()
			l.close()
			continue
		}
		p.links[l] = struct{}{}
		p.wg.Add(2)
		p.mu.Unlock()
		go p.toServer(l)
		go p.toClient(l)
	}
}

// reset closes c with an RST, as a cut link does.
func reset(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}

// toServer copies the client's bytes to the target, watching for the
// armed fault's command.
func (p *Proxy) toServer(l *link) {
	defer p.wg.Done()
	defer p.drop(l)
	buf := make([]byte, 32<<10)
	for {
		n, err := l.client.Read(buf)
		if n > 0 {
			p.mu.Lock()
			f := p.armed
			if f != nil && l.drop == nil && bytes.Contains(buf[:n], f.match) {
				// Before the write: the reply cannot come back unseen.
				p.armed, l.drop = nil, f
			} else {
				f = nil
			}
			p.mu.Unlock()
			if f != nil && f.before {
				p.cut(f)
				return
			}
			if _, werr := l.server.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// toClient copies the target's bytes to the client. The first bytes to come
// back after the matched command are its reply: they are dropped and the
// link is cut.
func (p *Proxy) toClient(l *link) {
	defer p.wg.Done()
	defer p.drop(l)
	buf := make([]byte, 32<<10)
	for {
		n, err := l.server.Read(buf)
		if n > 0 {
			p.mu.Lock()
			f := l.drop
			p.mu.Unlock()
			if f != nil {
				p.cut(f)
				return
			}
			if _, werr := l.client.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return // EOF, a reset, or the link closed: the other pump ends too
		}
	}
}

// drop closes l and forgets it.
func (p *Proxy) drop(l *link) {
	p.mu.Lock()
	delete(p.links, l)
	p.mu.Unlock()
	l.close()
}

// cut starts f's outage: every link is closed (the client's with an RST),
// and new ones are reset until it heals.
func (p *Proxy) cut(f *Fault) {
	p.mu.Lock()
	p.down = f
	links := p.takeLinks()
	if f.outage > 0 && !p.closed {
		f.timer = time.AfterFunc(f.outage, func() { p.heal(f) })
	}
	p.mu.Unlock()
	// Before any client can see the cut, so a test that got a client's
	// error finds Cut closed.
	close(f.cut)
	for _, l := range links {
		if tc, ok := l.client.(*net.TCPConn); ok {
			_ = tc.SetLinger(0)
		}
		l.close()
	}
}
