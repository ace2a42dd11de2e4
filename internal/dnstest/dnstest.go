// Package dnstest runs an authoritative DNS server on loopback for tests
// (github.com/miekg/dns): the answers for each name are set by the test,
// and a name can be made to fail (SERVFAIL, REFUSED), time out or not
// exist.
package dnstest

import (
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/miekg/dns"
)

// Server is an authoritative DNS server on loopback, UDP and TCP on one
// port, answering A and AAAA queries from a set the test changes. A UDP
// answer too big for the client's buffer is truncated, so the client
// retries over TCP, as with a large headless Service.
type Server struct {
	addr string // host:port of both the UDP and the TCP socket

	mu      sync.Mutex
	records map[string][]net.IP // fqdn (lower case) → addresses; present and empty: NODATA
	rcode   map[string]int      // fqdn → rcode to answer instead (SERVFAIL, REFUSED)
	drop    map[string]bool     // fqdn → never answer (a timeout)
	queries map[string]int      // fqdn → queries seen
	dropped chan string         // gets the name of each dropped query, if anyone listens

	tcpQueries atomic.Int64
	servers    []*dns.Server
}

// Start starts a Server; the test's cleanup stops it.
func Start(t testing.TB) *Server {
	t.Helper()
	s := &Server{
		records: map[string][]net.IP{},
		rcode:   map[string]int{},
		drop:    map[string]bool{},
		queries: map[string]int{},
		dropped: make(chan string, 64),
	}
	var pc net.PacketConn
	var ln net.Listener
	for attempt := 0; ; attempt++ { // the UDP port may be taken for TCP
		var err error
		if pc, err = net.ListenPacket("udp", "127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
		if ln, err = net.Listen("tcp", pc.LocalAddr().String()); err == nil {
			break
		}
		pc.Close()
		if attempt == 20 {
			t.Fatalf("no port free for both UDP and TCP: %v", err)
		}
	}
	s.addr = pc.LocalAddr().String()
	for _, srv := range []*dns.Server{{PacketConn: pc, Handler: s}, {Listener: ln, Handler: s}} {
		started := make(chan struct{})
		srv.NotifyStartedFunc = func() { close(started) }
		served := make(chan struct{})
		go func() {
			defer close(served)
			_ = srv.ActivateAndServe() // ends with Shutdown
		}()
		select {
		case <-started:
		case <-served:
			t.Fatal("dns server did not start")
		}
		s.servers = append(s.servers, srv)
		t.Cleanup(func() { _ = srv.Shutdown(); <-served })
	}
	return s
}

// Set makes name answer ips (none: NOERROR without addresses) and clears
// any failure set for it.
func (s *Server) Set(name string, ips ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	fq := dns.Fqdn(strings.ToLower(name))
	s.records[fq] = []net.IP{}
	for _, ip := range ips {
		s.records[fq] = append(s.records[fq], net.ParseIP(ip))
	}
	delete(s.rcode, fq)
	delete(s.drop, fq)
}

// NXDomain makes name not exist.
func (s *Server) NXDomain(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	fq := dns.Fqdn(strings.ToLower(name))
	delete(s.records, fq)
	delete(s.rcode, fq)
	delete(s.drop, fq)
}

// Fail makes name answer rcode.
func (s *Server) Fail(name string, rcode int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rcode[dns.Fqdn(strings.ToLower(name))] = rcode
}

// Silence makes name's queries go unanswered.
func (s *Server) Silence(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.drop[dns.Fqdn(strings.ToLower(name))] = true
}

// Stop shuts the server down: its port is closed, so queries are refused.
func (s *Server) Stop() {
	for _, srv := range s.servers {
		_ = srv.Shutdown()
	}
}

// QueryCount is how many queries name got.
func (s *Server) QueryCount(name string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.queries[dns.Fqdn(strings.ToLower(name))]
}

// ServeDNS answers one query.
func (s *Server) ServeDNS(w dns.ResponseWriter, r *dns.Msg) {
	_, udp := w.RemoteAddr().(*net.UDPAddr)
	if !udp {
		s.tcpQueries.Add(1)
	}
	m := new(dns.Msg)
	m.SetReply(r)
	m.Authoritative = true // else Go's resolver takes an empty answer for a lame referral
	if len(r.Question) != 1 {
		m.Rcode = dns.RcodeFormatError
		_ = w.WriteMsg(m)
		return
	}
	q := r.Question[0]
	fq := strings.ToLower(q.Name)
	s.mu.Lock()
	s.queries[fq]++
	ips, exists := s.records[fq]
	rcode, failing := s.rcode[fq]
	drop := s.drop[fq]
	s.mu.Unlock()
	switch {
	case drop:
		select {
		case s.dropped <- fq:
		default:
		}
		return
	case failing:
		m.Rcode = rcode
	case !exists:
		m.Rcode = dns.RcodeNameError
	default:
		hdr := dns.RR_Header{Name: q.Name, Class: dns.ClassINET, Ttl: 5}
		for _, ip := range ips {
			v4 := ip.To4()
			switch {
			case v4 != nil && q.Qtype == dns.TypeA:
				hdr.Rrtype = dns.TypeA
				m.Answer = append(m.Answer, &dns.A{Hdr: hdr, A: v4})
			case v4 == nil && q.Qtype == dns.TypeAAAA:
				hdr.Rrtype = dns.TypeAAAA
				m.Answer = append(m.Answer, &dns.AAAA{Hdr: hdr, AAAA: ip})
			}
		}
	}
	if udp {
		size := dns.MinMsgSize
		if opt := r.IsEdns0(); opt != nil {
			size = int(opt.UDPSize())
		}
		m.Truncate(size)
	}
	_ = w.WriteMsg(m)
}

// Addr is the server's host:port, UDP and TCP.
func (s *Server) Addr() string { return s.addr }

// TCPQueries is how many queries came over TCP.
func (s *Server) TCPQueries() int64 { return s.tcpQueries.Load() }

// Dropped gets the name of each query a Silence dropped, while someone
// listens.
func (s *Server) Dropped() <-chan string { return s.dropped }
