package redistest

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// CLIBinary is the client StartCluster runs to create the cluster
// (redis-cli --cluster create), looked up on PATH.
const CLIBinary = "redis-cli"

// The cluster's shape: three masters, no replicas, every slot assigned.
// cluster-node-timeout is short so that a test that kills a node sees the
// others call it failed (cluster_state:fail) in seconds, not in the default
// 15; long enough that a busy machine does not see a failure that is not.
const (
	clusterMasters       = 3
	clusterSlots         = 16384
	clusterNodeTimeoutMs = 3000
	clusterBusOffset     = 10000 // a node's bus port is its port + 10000
)

// Cluster is a Redis Cluster for one test: three masters on loopback that
// share the 16384 slots.
type Cluster struct {
	t     testing.TB
	sh    *shape
	nodes []*Server
}

// StartCluster runs three redis-server nodes with cluster-enabled yes (each
// with its nodes.conf in its own temp dir), creates the cluster with
// redis-cli --cluster create ... --cluster-replicas 0, and returns once
// every node says cluster_state:ok with all 16384 slots assigned and ok and
// knows the three nodes. Everything is stopped in t.Cleanup; the test is
// skipped when redis-server or redis-cli is not installed.
//
// Options: WithPassword (every node requires it), WithTLS and WithMutualTLS
// (clients and the cluster bus speak TLS only). WithSentinelPassword is
// refused.
func StartCluster(t testing.TB, opts ...Option) *Cluster {
	t.Helper()
	sh := newShape(t, opts, Binary, CLIBinary)
	if sh.cfg.sentinelPassword != "" {
		t.Fatal("redistest: StartCluster: WithSentinelPassword is for StartSentinel")
	}
	c := &Cluster{t: t, sh: sh}
	for i := range clusterMasters {
		n := sh.newNode(t, Binary)
		n.argv = func(port int) ([]string, error) {
			args := append(n.baseArgs(port),
				"--cluster-enabled", "yes",
				"--cluster-config-file", filepath.Join(n.dir, "nodes.conf"),
				"--cluster-node-timeout", strconv.Itoa(clusterNodeTimeoutMs),
			)
			if n.tls != nil {
				args = append(args, "--tls-cluster", "yes")
			}
			return args, nil
		}
		// The bus port must be free too; a node that cannot bind it exits,
		// and launch tries other ports.
		if err := n.launch(clusterPort); err != nil {
			t.Fatalf("redistest: StartCluster: node %d: %v", i, err)
		}
		c.nodes = append(c.nodes, n)
	}
	if err := c.create(); err != nil {
		t.Fatalf("redistest: StartCluster: %v\n%s", err, c.logs())
	}
	for _, n := range c.nodes {
		if err := waitFor(readyTimeout, func() error { return clusterOK(n) }); err != nil {
			t.Fatalf("redistest: StartCluster: node %s not ok within %v: %v\n%s", n.Addr(), readyTimeout, err, c.logs())
		}
	}
	return c
}

// create runs redis-cli --cluster create on the nodes, bounded by
// readyTimeout.
func (c *Cluster) create() error {
	args := []string{"--cluster", "create"}
	for _, n := range c.nodes {
		args = append(args, n.Addr())
	}
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if m := c.sh.tls; m != nil {
		args = append(args, "--tls", "--cacert", m.files.CAFile,
			"--cert", m.files.ClientCertFile, "--key", m.files.ClientKeyFile)
	}
	ctx, cancel := context.WithTimeout(context.Background(), readyTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, CLIBinary, args...)
	cmd.Dir = c.nodes[0].dir
	cmd.SysProcAttr = dieWithParent
	cmd.Env = os.Environ()
	if pw := c.sh.cfg.password; pw != "" {
		// From the environment, not -a: no warning, and not on a command line.
		cmd.Env = append(cmd.Env, "REDISCLI_AUTH="+pw)
	}
	out, err := cmd.CombinedOutput()
	if err == nil && !strings.Contains(string(out), "All 16384 slots covered") {
		err = errors.New("it did not say all 16384 slots are covered")
	}
	if err != nil {
		return fmt.Errorf("%s %s: %w\n%s", CLIBinary, strings.Join(args, " "), err, out)
	}
	return nil
}

// clusterOK is nil once node n says the cluster is ok, every slot assigned
// and ok, and all the nodes known.
func clusterOK(n *Server) error {
	info, err := queryString(n.Addr(), n.password, n.tls.clientConfig(), "CLUSTER", "INFO")
	if err != nil {
		return err
	}
	want := map[string]string{
		"cluster_state":          "ok",
		"cluster_slots_assigned": strconv.Itoa(clusterSlots),
		"cluster_slots_ok":       strconv.Itoa(clusterSlots),
		"cluster_known_nodes":    strconv.Itoa(clusterMasters),
		"cluster_size":           strconv.Itoa(clusterMasters),
	}
	for k, v := range want {
		if got, _ := infoField(info, k); got != v {
			return fmt.Errorf("CLUSTER INFO: %s:%s, want %s", k, got, v)
		}
	}
	return nil
}

// clusterPort is a free loopback port whose bus port (port+10000) is free
// too.
func clusterPort() (int, error) {
	for range 20 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		if port+clusterBusOffset > 65535 {
			l.Close()
			continue
		}
		bus, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port+clusterBusOffset)))
		l.Close()
		if err != nil {
			continue
		}
		bus.Close()
		return port, nil
	}
	return 0, errors.New("no free port with a free port 10000 above it in 20 tries")
}

// Addrs are the nodes' host:port addresses (their TLS ports WithTLS), for
// a cluster client's seed list.
func (c *Cluster) Addrs() []string {
	out := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		out[i] = n.Addr()
	}
	return out
}

// Nodes are the three masters, in the order of Addrs. A node killed and
// restarted keeps its id and slots (nodes.conf stays in its dir) but comes
// back empty.
func (c *Cluster) Nodes() []*Server { return append([]*Server(nil), c.nodes...) }

// Password is what every node requires (WithPassword), "" for none.
func (c *Cluster) Password() string { return c.sh.cfg.password }

// TLS is the certificate files every node uses, nil without WithTLS.
func (c *Cluster) TLS() *TLSFiles { return c.nodes[0].TLS() }

// ClientTLSConfig is a new client config for any node (see
// Server.ClientTLSConfig); nil without WithTLS.
func (c *Cluster) ClientTLSConfig() *tls.Config { return c.sh.tls.clientConfig() }

// logs is every node's log tail, for a failure message.
func (c *Cluster) logs() string {
	var b strings.Builder
	for _, n := range c.nodes {
		fmt.Fprintf(&b, "--- node %s:\n%s\n", n.Addr(), n.logTail())
	}
	return b.String()
}
