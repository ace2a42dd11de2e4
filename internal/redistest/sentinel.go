package redistest

import (
	"crypto/tls"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// SentinelBinary is the sentinel StartSentinel runs, looked up on PATH.
const SentinelBinary = "redis-sentinel"

// The sentinel set's shape. down-after-milliseconds and failover-timeout are
// short so that a failover ends within a few seconds: a sentinel calls the
// master down after 500 ms without an answer, and a failover that stalls is
// given up (and may be retried, after twice the timeout) after 3 s.
const (
	sentinelMasterName = "encgate"
	sentinelCount      = 3
	sentinelQuorum     = 2
	downAfterMillis    = 500
	failoverTimeoutMs  = 3000
)

// failoverWait bounds WaitFailover.
const failoverWait = 30 * time.Second

// Sentinel is a sentinel set for one test: a master, a replica of it, and
// three sentinels monitoring it under MasterName with quorum 2.
type Sentinel struct {
	t         testing.TB
	sh        *shape
	data      []*Server // the first master, then its replica
	sentinels []*Server
}

// StartSentinel runs a master, a replica of it and three redis-sentinel
// processes on free loopback ports, and returns once the replica is in sync
// and every sentinel knows the replica and the two other sentinels (so that
// a failover can start at once). Everything is stopped in t.Cleanup; the
// test is skipped when redis-server or redis-sentinel is not installed.
//
// Options: WithPassword (every data node requires it, the replica and the
// sentinels use it), WithSentinelPassword (the sentinels require it),
// WithTLS and WithMutualTLS (every process, sentinels included, speaks TLS
// only, replication too).
func StartSentinel(t testing.TB, opts ...Option) *Sentinel {
	t.Helper()
	sh := newShape(t, opts, Binary, SentinelBinary)
	s := &Sentinel{t: t, sh: sh}

	master := sh.newNode(t, Binary)
	if err := master.launch(freePort); err != nil {
		t.Fatalf("redistest: StartSentinel: master: %v", err)
	}
	replica := sh.newNode(t, Binary)
	replica.argv = func(port int) ([]string, error) {
		return append(replica.baseArgs(port), "--replicaof", "127.0.0.1", strconv.Itoa(master.port)), nil
	}
	if err := replica.launch(freePort); err != nil {
		t.Fatalf("redistest: StartSentinel: replica: %v", err)
	}
	s.data = []*Server{master, replica}
	if err := waitFor(readyTimeout, func() error { return replicaInSync(replica) }); err != nil {
		t.Fatalf("redistest: StartSentinel: the replica did not sync with the master within %v: %v\nreplica log: %s\nmaster log: %s",
			readyTimeout, err, replica.logTail(), master.logTail())
	}

	for i := range sentinelCount {
		n := sh.newNode(t, SentinelBinary)
		n.password = sh.cfg.sentinelPassword
		n.argv = func(port int) ([]string, error) {
			conf := filepath.Join(n.dir, "sentinel.conf")
			// A sentinel rewrites its config file (its id, the replicas and
			// sentinels it found, a new master): it must be writable.
			if err := os.WriteFile(conf, []byte(s.sentinelConf(port, master.port)), 0o600); err != nil {
				return nil, err
			}
			return []string{conf}, nil
		}
		if err := n.launch(freePort); err != nil {
			t.Fatalf("redistest: StartSentinel: sentinel %d: %v", i, err)
		}
		s.sentinels = append(s.sentinels, n)
	}
	for _, n := range s.sentinels {
		if err := waitFor(readyTimeout, func() error { return s.sentinelReady(n) }); err != nil {
			t.Fatalf("redistest: StartSentinel: sentinel %s did not find the replica and the other sentinels within %v: %v\n%s",
				n.Addr(), readyTimeout, err, s.logs())
		}
	}
	return s
}

// sentinelConf is a sentinel's whole config file.
func (s *Sentinel) sentinelConf(port, masterPort int) string {
	var b strings.Builder
	line := func(words ...string) {
		for i, w := range words {
			if i > 0 {
				b.WriteByte(' ')
			}
			b.WriteString(confQuote(w))
		}
		b.WriteByte('\n')
	}
	line("bind", "127.0.0.1")
	line("daemonize", "no")
	line("logfile", "")
	if s.sh.tls != nil {
		args := s.sh.tls.args(port)
		for i := 0; i+1 < len(args); i += 2 {
			line(strings.TrimPrefix(args[i], "--"), args[i+1])
		}
	} else {
		line("port", strconv.Itoa(port))
	}
	if pw := s.sh.cfg.sentinelPassword; pw != "" {
		line("requirepass", pw)
	}
	name := sentinelMasterName
	line("sentinel", "monitor", name, "127.0.0.1", strconv.Itoa(masterPort), strconv.Itoa(sentinelQuorum))
	line("sentinel", "down-after-milliseconds", name, strconv.Itoa(downAfterMillis))
	line("sentinel", "failover-timeout", name, strconv.Itoa(failoverTimeoutMs))
	line("sentinel", "parallel-syncs", name, "1")
	if pw := s.sh.cfg.password; pw != "" {
		line("sentinel", "auth-pass", name, pw)
	}
	return b.String()
}

// confQuote writes w as one word of a Redis config line: quoted, with the
// escapes Redis's config parser reads back.
func confQuote(w string) string {
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(w); i++ {
		switch c := w[i]; {
		case c == '"' || c == '\\':
			b.WriteByte('\\')
			b.WriteByte(c)
		case c < 0x20 || c == 0x7f:
			fmt.Fprintf(&b, "\\x%02x", c)
		default:
			b.WriteByte(c)
		}
	}
	b.WriteByte('"')
	return b.String()
}

// replicaInSync is nil once the replica's link to its master is up.
func replicaInSync(r *Server) error {
	info, err := queryString(r.Addr(), r.password, r.tls.clientConfig(), "INFO", "replication")
	if err != nil {
		return err
	}
	if v, _ := infoField(info, "master_link_status"); v != "up" {
		return fmt.Errorf("master_link_status:%s", v)
	}
	return nil
}

// sentinelReady is nil once sentinel n monitors a master it sees up, with
// one replica it sees up and in sync, and knows the two other sentinels.
func (s *Sentinel) sentinelReady(n *Server) error {
	conf := n.tls.clientConfig()
	m, err := queryMap(n.Addr(), n.password, conf, "SENTINEL", "MASTER", sentinelMasterName)
	if err != nil {
		return err
	}
	want := map[string]string{
		"flags":                   "master",
		"num-slaves":              "1",
		"num-other-sentinels":     strconv.Itoa(sentinelCount - 1),
		"quorum":                  strconv.Itoa(sentinelQuorum),
		"role-reported":           "master",
		"down-after-milliseconds": strconv.Itoa(downAfterMillis),
	}
	for k, v := range want {
		if m[k] != v {
			return fmt.Errorf("SENTINEL MASTER %s: %s is %q, want %q", sentinelMasterName, k, m[k], v)
		}
	}
	v, err := query(n.Addr(), n.password, conf, "SENTINEL", "REPLICAS", sentinelMasterName)
	if err != nil {
		return err
	}
	reps, _ := v.([]any)
	if len(reps) != 1 {
		return fmt.Errorf("SENTINEL REPLICAS: %d replicas, want 1", len(reps))
	}
	r := pairs(reps[0])
	if r["flags"] != "slave" || r["master-link-status"] != "ok" {
		return fmt.Errorf("SENTINEL REPLICAS: flags %q, master-link-status %q; want slave, ok", r["flags"], r["master-link-status"])
	}
	return nil
}

// queryMap runs a command that answers a flat field/value array.
func queryMap(addr, password string, conf *tls.Config, args ...string) (map[string]string, error) {
	v, err := query(addr, password, conf, args...)
	if err != nil {
		return nil, err
	}
	if _, ok := v.([]any); !ok {
		return nil, fmt.Errorf("%s answered %T, not an array", strings.Join(args, " "), v)
	}
	return pairs(v), nil
}

// pairs reads a flat field/value array; anything else gives an empty map.
func pairs(v any) map[string]string {
	a, _ := v.([]any)
	m := make(map[string]string, len(a)/2)
	for i := 0; i+1 < len(a); i += 2 {
		k, _ := a[i].(string)
		v, _ := a[i+1].(string)
		m[k] = v
	}
	return m
}

// MasterName is the name the sentinels monitor the master under.
func (s *Sentinel) MasterName() string { return sentinelMasterName }

// SentinelAddrs are the sentinels' host:port addresses.
func (s *Sentinel) SentinelAddrs() []string {
	out := make([]string, len(s.sentinels))
	for i, n := range s.sentinels {
		out[i] = n.Addr()
	}
	return out
}

// Password is what the data nodes require (WithPassword), "" for none.
func (s *Sentinel) Password() string { return s.sh.cfg.password }

// SentinelPassword is what the sentinels require (WithSentinelPassword), ""
// for none.
func (s *Sentinel) SentinelPassword() string { return s.sh.cfg.sentinelPassword }

// TLS is the certificate files every process of the set uses, nil without
// WithTLS.
func (s *Sentinel) TLS() *TLSFiles { return s.data[0].TLS() }

// ClientTLSConfig is a new client config for any process of the set (see
// Server.ClientTLSConfig); nil without WithTLS.
func (s *Sentinel) ClientTLSConfig() *tls.Config { return s.sh.tls.clientConfig() }

// Nodes are the data nodes: the first master, then the first replica. After
// a failover their roles have swapped; Node finds one by address.
func (s *Sentinel) Nodes() []*Server { return append([]*Server(nil), s.data...) }

// Node is the data node at addr (as MasterAddr gives it), nil if none.
func (s *Sentinel) Node(addr string) *Server {
	for _, n := range s.data {
		if n.Addr() == addr {
			return n
		}
	}
	return nil
}

// MasterAddr asks the sentinels, in order, for the master's address
// (SENTINEL GET-MASTER-ADDR-BY-NAME) and returns the first answer. It fails
// the test when no sentinel answers.
func (s *Sentinel) MasterAddr() string {
	s.t.Helper()
	var errs []string
	for _, n := range s.sentinels {
		addr, err := s.askMaster(n)
		if err == nil {
			return addr
		}
		errs = append(errs, n.Addr()+": "+err.Error())
	}
	s.t.Fatalf("redistest: MasterAddr: no sentinel answered: %s", strings.Join(errs, "; "))
	return ""
}

func (s *Sentinel) askMaster(n *Server) (string, error) {
	v, err := query(n.Addr(), n.password, n.tls.clientConfig(), "SENTINEL", "GET-MASTER-ADDR-BY-NAME", sentinelMasterName)
	if err != nil {
		return "", err
	}
	a, _ := v.([]any)
	if len(a) != 2 {
		return "", fmt.Errorf("GET-MASTER-ADDR-BY-NAME answered %v", v)
	}
	host, _ := a[0].(string)
	port, _ := a[1].(string)
	return net.JoinHostPort(host, port), nil
}

// KillMaster ends the current master (as MasterAddr names it) with SIGKILL,
// as a crash would, and returns its address, for WaitFailover.
func (s *Sentinel) KillMaster() string {
	s.t.Helper()
	addr := s.MasterAddr()
	n := s.Node(addr)
	if n == nil {
		s.t.Fatalf("redistest: KillMaster: the sentinels name %s, which is none of the set's data nodes", addr)
	}
	n.Kill()
	return addr
}

// WaitFailover waits until every sentinel names the same master, other than
// old, and that node reports role:master; it returns the new master's
// address. It fails the test, with the sentinels' logs, when that does not
// happen within 30 s.
func (s *Sentinel) WaitFailover(old string) string {
	s.t.Helper()
	var addr string
	err := waitFor(failoverWait, func() error {
		addr = ""
		for _, n := range s.sentinels {
			a, err := s.askMaster(n)
			if err != nil {
				return fmt.Errorf("sentinel %s: %w", n.Addr(), err)
			}
			if a == old {
				return fmt.Errorf("sentinel %s still names %s", n.Addr(), old)
			}
			if addr != "" && a != addr {
				return fmt.Errorf("sentinels name %s and %s", addr, a)
			}
			addr = a
		}
		node := s.Node(addr)
		if node == nil {
			return fmt.Errorf("the sentinels name %s, which is none of the set's data nodes", addr)
		}
		info, err := queryString(addr, node.password, node.tls.clientConfig(), "INFO", "replication")
		if err != nil {
			return fmt.Errorf("new master %s: %w", addr, err)
		}
		if role, _ := infoField(info, "role"); role != "master" {
			return fmt.Errorf("new master %s reports role:%s", addr, role)
		}
		return nil
	})
	if err != nil {
		s.t.Fatalf("redistest: WaitFailover: no failover away from %s within %v: %v\n%s", old, failoverWait, err, s.logs())
	}
	return addr
}

// logs is every process's log tail, for a failure message.
func (s *Sentinel) logs() string {
	var b strings.Builder
	for _, n := range append(append([]*Server(nil), s.data...), s.sentinels...) {
		fmt.Fprintf(&b, "--- %s %s:\n%s\n", filepath.Base(n.bin), n.Addr(), n.logTail())
	}
	return b.String()
}
