package redistest

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

// A ClusterClient spreads keys over all three masters; a script whose keys
// share a hash tag runs, one whose keys hash to different slots is refused
// with CROSSSLOT.
func TestCluster(t *testing.T) {
	c := StartCluster(t)
	if len(c.Addrs()) != 3 {
		t.Fatalf("Addrs() = %v", c.Addrs())
	}
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), clientWait)
	defer cancel()

	const keys = 30
	for i := range keys {
		if err := cc.Set(ctx, fmt.Sprint("key", i), i, 0).Err(); err != nil {
			t.Fatalf("SET key%d: %v", i, err)
		}
	}
	total := int64(0)
	for _, addr := range c.Addrs() {
		v, err := query(addr, "", nil, "DBSIZE")
		n, _ := v.(int64)
		if err != nil || n == 0 {
			t.Errorf("node %s holds %v keys (%v): the keys did not spread over every master", addr, v, err)
		}
		total += n
	}
	if total != keys {
		t.Errorf("the nodes hold %d keys, want %d", total, keys)
	}

	const script = `redis.call('SET', KEYS[1], ARGV[1]); return redis.call('SET', KEYS[2], ARGV[1])`
	if err := cc.Eval(ctx, script, []string{"{x}a", "{x}b"}, "v").Err(); err != nil {
		t.Errorf("EVAL on two keys of hash tag {x}: %v", err)
	}
	if v, err := cc.Get(ctx, "{x}b").Result(); err != nil || v != "v" {
		t.Errorf("GET {x}b: %q, %v", v, err)
	}
	a, b := "key0", "key1"
	if sa, sb := cc.ClusterKeySlot(ctx, a).Val(), cc.ClusterKeySlot(ctx, b).Val(); sa == sb {
		t.Fatalf("%s and %s share slot %d", a, b, sa)
	}
	err := cc.Eval(ctx, script, []string{a, b}, "v").Err()
	if err == nil || !strings.Contains(err.Error(), "CROSSSLOT") {
		t.Errorf("EVAL on keys of two slots: %v, want CROSSSLOT", err)
	}
}

// A cluster with a password and TLS (the bus too): a ClusterClient given
// both writes; a node refuses a client without the password.
func TestClusterPasswordAndTLS(t *testing.T) {
	const pw = "cluster pass"
	c := StartCluster(t, WithPassword(pw), WithTLS())
	if c.Password() != pw || c.TLS() == nil {
		t.Fatalf("Password %q, TLS %v", c.Password(), c.TLS())
	}
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), Password: pw, TLSConfig: c.ClientTLSConfig()})
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), clientWait)
	defer cancel()
	for i := range 10 {
		if err := cc.Set(ctx, fmt.Sprint("key", i), i, 0).Err(); err != nil {
			t.Fatalf("SET key%d: %v", i, err)
		}
	}
	if err := pingTLS(c.Addrs()[0], "", c.ClientTLSConfig()); err == nil || !strings.Contains(err.Error(), "NOAUTH") {
		t.Errorf("PING without the password: %v, want NOAUTH", err)
	}
}
