package redisclient

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/redistest"
	"github.com/encgate/encgate/internal/secretfile/secretfiletest"
)

func problems(c Config) string {
	var p configfile.Problems
	c.Validate(&p, "redis")
	if err := p.Err(); err != nil {
		return err.Error()
	}
	return ""
}

// Every shape validates with the field path of what is wrong, and each
// valid shape builds the client of its kind.
func TestValidateEveryShape(t *testing.T) {
	pw := secretfiletest.Write(t, "pw", "secret\n", 0o600)
	open := secretfiletest.Write(t, "pw", "secret\n", 0o644)
	notPEM := secretfiletest.Write(t, "ca.pem", "not a certificate\n", 0o644)
	for _, tc := range []struct {
		name string
		edit func(*Config)
		want []string // each in the problems; none: valid
	}{
		{"defaults", func(*Config) {}, nil},
		{"sentinel", func(c *Config) {
			c.Mode, c.MasterName, c.SentinelAddrs, c.SentinelPasswordFile = Sentinel, "m", []string{"s1:26379", "s2:26379"}, pw
		}, nil},
		{"cluster", func(c *Config) { c.Mode, c.ClusterAddrs = Cluster, []string{"n1:6379"} }, nil},
		{"tls with system roots", func(c *Config) { c.TLS.Enabled = true }, nil},
		{"unknown mode", func(c *Config) { c.Mode = "replicated" }, []string{`redis.mode: must be standalone, sentinel or cluster, got "replicated"`}},
		{"standalone without port", func(c *Config) { c.Addr = "redis" }, []string{`redis.addr: must be host:port, got "redis"`}},
		{"sentinel without its keys", func(c *Config) { c.Mode = Sentinel }, []string{
			"redis.master_name: is required with mode: sentinel", "redis.sentinel_addrs: is required with mode: sentinel"}},
		{"sentinel with a bad and a repeated address", func(c *Config) {
			c.Mode, c.MasterName, c.SentinelAddrs = Sentinel, "m", []string{"s1:26379", "s1", "s1:26379"}
		}, []string{`redis.sentinel_addrs[1]: must be host:port, got "s1"`, "redis.sentinel_addrs[2]: s1:26379 is listed twice"}},
		{"sentinel keys in standalone", func(c *Config) {
			c.MasterName, c.SentinelAddrs, c.SentinelUsername = "m", []string{"s:1"}, "u"
		}, []string{`redis.master_name: is read only with mode: sentinel (mode is "standalone")`,
			"redis.sentinel_addrs: is read only with mode: sentinel", "redis.sentinel_username: is read only with mode: sentinel"}},
		{"cluster without nodes, db 3", func(c *Config) { c.Mode, c.DB = Cluster, 3 }, []string{
			"redis.cluster_addrs: is required with mode: cluster", "redis.db: must be 0 with mode: cluster"}},
		{"cluster nodes in sentinel", func(c *Config) {
			c.Mode, c.MasterName, c.SentinelAddrs, c.ClusterAddrs = Sentinel, "m", []string{"s:1"}, []string{"n:1"}
		}, []string{`redis.cluster_addrs: is read only with mode: cluster (mode is "sentinel")`}},
		{"two passwords", func(c *Config) { c.Password, c.PasswordFile = "x", pw }, []string{"redis.password_file: set at most one of password and password_file"}},
		{"open password files", func(c *Config) {
			c.PasswordFile, c.Mode, c.MasterName, c.SentinelAddrs, c.SentinelPasswordFile = open, Sentinel, "m", []string{"s:1"}, open
		}, []string{"redis.password_file: password file " + open + " has mode 0644", "redis.sentinel_password_file: password file " + open + " has mode 0644"}},
		{"tls files without enabled", func(c *Config) { c.TLS.CAFile = notPEM }, []string{"redis.tls.enabled: must be true when ca_file"}},
		{"tls ca that is no certificate", func(c *Config) { c.TLS.Enabled, c.TLS.CAFile = true, notPEM }, []string{"redis.tls.ca_file: " + notPEM + " holds no PEM certificate"}},
		{"tls missing ca", func(c *Config) { c.TLS.Enabled, c.TLS.CAFile = true, "/nonexistent/ca.pem" }, []string{"redis.tls.ca_file: open /nonexistent/ca.pem: no such file or directory"}},
		{"tls cert without key", func(c *Config) { c.TLS.Enabled, c.TLS.CertFile = true, notPEM }, []string{"redis.tls.key_file: set both cert_file and key_file, or neither"}},
		{"tls key others may read", func(c *Config) { c.TLS.Enabled, c.TLS.CertFile, c.TLS.KeyFile = true, notPEM, open }, []string{"redis.tls.key_file: " + open + " has mode 0644"}},
		{"limits", func(c *Config) { c.PoolSize, c.Timeout, c.KeyPrefix, c.DB = 0, 0, "", -1 }, []string{
			"redis.pool_size: must be >= 1", "redis.timeout:", "redis.key_prefix: must not be empty", "redis.db: must be >= 0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Default()
			tc.edit(&c)
			got := problems(c)
			if len(tc.want) == 0 {
				if got != "" {
					t.Fatalf("refused: %s", got)
				}
				client, err := New(c)
				if err != nil {
					t.Fatal(err)
				}
				defer client.Close()
				var kind string
				switch client.(type) {
				case *redis.Client:
					kind = Standalone
				case *redis.ClusterClient:
					kind = Cluster
				}
				if c.Mode == Sentinel {
					// A failover client is a *redis.Client over the Sentinels.
					if _, ok := client.(*redis.Client); !ok {
						t.Fatalf("sentinel built a %T", client)
					}
				} else if kind != c.Mode {
					t.Fatalf("mode %s built a %T", c.Mode, client)
				}
				return
			}
			for _, w := range tc.want {
				if !strings.Contains(got, w) {
					t.Errorf("problems %q lack %q", got, w)
				}
			}
		})
	}
}

// New names the field of a file it cannot use, and never the secret.
func TestNewNamesTheFileField(t *testing.T) {
	c := Default()
	c.PasswordFile = secretfiletest.Write(t, "pw", "hunter2-secret\n", 0o644)
	_, err := New(c)
	if err == nil || !strings.HasPrefix(err.Error(), "redis.password_file: ") || strings.Contains(err.Error(), "hunter2") {
		t.Fatalf("New: %v", err)
	}
	c = Default()
	c.TLS.Enabled, c.TLS.CAFile = true, "/nonexistent/ca.pem"
	if _, err := New(c); err == nil || !strings.HasPrefix(err.Error(), "redis.tls.ca_file: ") {
		t.Fatalf("New: %v", err)
	}
}

// Check sorts a refusal from an outage.
func TestCheckSortsFailures(t *testing.T) {
	c := Default()
	c.Addr, c.DialTimeout = "127.0.0.1:1", configfile.Duration(1e8)
	client, err := New(c)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	err = Check(context.Background(), client)
	var refused *RefusedError
	if err == nil || errors.As(err, &refused) {
		t.Fatalf("nothing listening: %v, want an outage", err)
	}
}

// Check sorts TLS refusals from real servers: the server's certificate
// that does not verify (another CA, another name) and a client
// certificate the server refuses (none, or one of another CA) are
// refusals, each naming its fields; the right files pass.
func TestCheckSortsTLSRefusals(t *testing.T) {
	plain := redistest.Start(t, redistest.WithTLS())
	mutual := redistest.Start(t, redistest.WithMutualTLS())
	otherCert, otherKey := redistest.NewCA(t).IssueClient(t)
	for _, tc := range []struct {
		name   string
		addr   string
		tls    TLSConfig
		reason string // "" for none
		says   []string
	}{
		{"the CA", plain.Addr(), TLSConfig{CAFile: plain.TLS().CAFile}, "", nil},
		{"another CA", plain.Addr(), TLSConfig{CAFile: redistest.NewCA(t).CertFile}, RefusedServerCert,
			[]string{"does not verify against redis.tls (ca_file, server_name)", "certificate signed by unknown authority"}},
		{"another server_name", plain.Addr(), TLSConfig{CAFile: plain.TLS().CAFile, ServerName: "redis.example"}, RefusedServerCert,
			[]string{"does not verify against redis.tls (ca_file, server_name)", "not redis.example"}},
		{"the client certificate", mutual.Addr(), TLSConfig{CAFile: mutual.TLS().CAFile,
			CertFile: mutual.TLS().ClientCertFile, KeyFile: mutual.TLS().ClientKeyFile}, "", nil},
		{"no client certificate", mutual.Addr(), TLSConfig{CAFile: mutual.TLS().CAFile}, RefusedClientCert,
			[]string{"refuses the gateway's TLS client certificate (redis.tls.cert_file, key_file)", "certificate required"}},
		{"a client certificate of another CA", mutual.Addr(), TLSConfig{CAFile: mutual.TLS().CAFile,
			CertFile: otherCert, KeyFile: otherKey}, RefusedClientCert,
			[]string{"refuses the gateway's TLS client certificate (redis.tls.cert_file, key_file)", "unknown certificate authority"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Default()
			c.Addr, c.TLS = tc.addr, tc.tls
			c.TLS.Enabled = true
			client, err := New(c)
			if err != nil {
				t.Fatal(err)
			}
			defer client.Close()
			err = Check(context.Background(), client)
			var refused *RefusedError
			switch {
			case tc.reason == "":
				if err != nil {
					t.Fatalf("Check: %v", err)
				}
			case !errors.As(err, &refused) || refused.Reason != tc.reason || !refused.TLS():
				t.Fatalf("Check: %v, want a refusal (%s)", err, tc.reason)
			}
			for _, w := range tc.says {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Check: %q lacks %q", err, w)
				}
			}
		})
	}
}
