// Package redisclient is the gateway's one way to reach Redis: the `redis:`
// config section and the go-redis UniversalClient built from it. Every Redis
// user of a gateway (the /send store, the bootstrap registry, the shared pin
// table) takes the one client built here, so the replicas of a gateway share
// their state through one server, one Sentinel-managed master or one
// Cluster, over TLS where configured.
//
// Three shapes, chosen by mode:
//
//   - standalone: one server at addr;
//   - sentinel: the master that the Sentinels at sentinel_addrs name for
//     master_name; after a failover the client asks them again and follows
//     the new master, with no config change;
//   - cluster: a Redis Cluster reached through any of cluster_addrs. Every
//     Lua script of encgate keeps all its keys in one hash slot (each user's
//     keys share a hash tag), which a cluster needs.
package redisclient

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/secretfile"
)

// Modes.
const (
	Standalone = "standalone"
	Sentinel   = "sentinel"
	Cluster    = "cluster"
)

// Config is the `redis:` section.
type Config struct {
	// Mode is standalone (default), sentinel or cluster.
	Mode string `yaml:"mode"`
	// Addr is the standalone server, host:port (default 127.0.0.1:6379).
	// Only standalone reads it.
	Addr string `yaml:"addr"`
	// MasterName and SentinelAddrs: sentinel mode's master name and the
	// Sentinels (host:port each) to ask for it.
	MasterName    string   `yaml:"master_name"`
	SentinelAddrs []string `yaml:"sentinel_addrs"`
	// SentinelUsername and SentinelPasswordFile authenticate to the
	// Sentinels themselves (their requirepass / ACL), which may differ from
	// the data servers'. The file follows secretfile's rules.
	SentinelUsername     string `yaml:"sentinel_username"`
	SentinelPasswordFile string `yaml:"sentinel_password_file"`
	// ClusterAddrs: cluster mode's seed nodes (host:port each); the client
	// learns the rest of the cluster from them.
	ClusterAddrs []string `yaml:"cluster_addrs"`
	// Username is the ACL user (default none).
	Username string `yaml:"username"`
	// Password (default none); prefer PasswordFile, which holds it instead
	// (secretfile.Read: mode 0600 or 0640, surrounding whitespace dropped)
	// so that the config need not be secret. At most one of the two. Read
	// when the client is built, at start (the section needs a restart).
	Password     string `yaml:"password"`
	PasswordFile string `yaml:"password_file"`
	// DB is the database number (default 0; a cluster has only 0).
	DB int `yaml:"db"`
	// KeyPrefix starts every key and channel (default "encgate:").
	KeyPrefix string `yaml:"key_prefix"`
	// TLS configures TLS to every server (Sentinels included).
	TLS TLSConfig `yaml:"tls"`
	// DialTimeout bounds one connect (default 1s).
	DialTimeout configfile.Duration `yaml:"dial_timeout"`
	// Timeout bounds one command's read or write (default 1s).
	Timeout configfile.Duration `yaml:"timeout"`
	// PoolSize is the connections per server (default 64).
	PoolSize int `yaml:"pool_size"`
	// PollInterval is how often a replica waiting on another's work (a
	// /send in flight there, a pin not yet written) re-reads Redis besides
	// the pub/sub wake-ups (default 100ms).
	PollInterval configfile.Duration `yaml:"poll_interval"`
}

// TLSConfig is redis.tls.
type TLSConfig struct {
	// Enabled turns TLS on. With no CAFile the system's roots verify the
	// server (a managed Redis or Valkey with a public certificate).
	Enabled bool `yaml:"enabled"`
	// CAFile holds the PEM certificates that verify the servers.
	CAFile string `yaml:"ca_file"`
	// CertFile and KeyFile, both or neither: the client certificate for
	// servers that require one (tls-auth-clients yes).
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
	// ServerName is the name the servers' certificates must carry (default:
	// the host of the address dialed).
	ServerName string `yaml:"server_name"`
}

// Default returns the section's defaults.
func Default() Config {
	return Config{
		Mode:          Standalone,
		Addr:          "127.0.0.1:6379",
		SentinelAddrs: []string{},
		ClusterAddrs:  []string{},
		KeyPrefix:     "encgate:",
		DialTimeout:   configfile.Duration(1e9),
		Timeout:       configfile.Duration(1e9),
		PoolSize:      64,
		PollInterval:  configfile.Duration(100e6),
	}
}

// Validate checks the section; path is its field path ("redis"). It reads
// the password and TLS files, so a file that cannot be used is named here
// rather than at the first command.
func (c Config) Validate(p *configfile.Problems, path string) {
	switch c.Mode {
	case Standalone:
		checkHostPort(p, path+".addr", c.Addr)
	case Sentinel:
		if c.MasterName == "" {
			p.Addf(path+".master_name", "is required with mode: sentinel (the name the Sentinels monitor the master by)")
		}
		if len(c.SentinelAddrs) == 0 {
			p.Addf(path+".sentinel_addrs", "is required with mode: sentinel (host:port of each Sentinel)")
		}
		checkList(p, path+".sentinel_addrs", c.SentinelAddrs)
	case Cluster:
		if len(c.ClusterAddrs) == 0 {
			p.Addf(path+".cluster_addrs", "is required with mode: cluster (host:port of one or more nodes)")
		}
		checkList(p, path+".cluster_addrs", c.ClusterAddrs)
		if c.DB != 0 {
			p.Addf(path+".db", "must be 0 with mode: cluster (a Redis Cluster has database 0 only), got %d", c.DB)
		}
	default:
		p.Addf(path+".mode", "must be standalone, sentinel or cluster, got %q", c.Mode)
	}
	if c.Mode != Sentinel {
		for field, set := range map[string]bool{
			"master_name": c.MasterName != "", "sentinel_addrs": len(c.SentinelAddrs) > 0,
			"sentinel_username": c.SentinelUsername != "", "sentinel_password_file": c.SentinelPasswordFile != "",
		} {
			if set {
				p.Addf(path+"."+field, "is read only with mode: sentinel (mode is %q)", c.Mode)
			}
		}
	}
	if c.Mode != Cluster && len(c.ClusterAddrs) > 0 {
		p.Addf(path+".cluster_addrs", "is read only with mode: cluster (mode is %q)", c.Mode)
	}
	switch {
	case c.Password != "" && c.PasswordFile != "":
		p.Addf(path+".password_file", "set at most one of password and password_file")
	case c.PasswordFile != "":
		if _, err := secretfile.Read(c.PasswordFile, "password file"); err != nil {
			p.Addf(path+".password_file", "%v", err)
		}
	}
	if c.SentinelPasswordFile != "" {
		if _, err := secretfile.Read(c.SentinelPasswordFile, "password file"); err != nil {
			p.Addf(path+".sentinel_password_file", "%v", err)
		}
	}
	if c.DB < 0 {
		p.Addf(path+".db", "must be >= 0, got %d", c.DB)
	}
	if c.KeyPrefix == "" {
		p.Addf(path+".key_prefix", "must not be empty (keys would collide with other users of the database)")
	}
	c.TLS.validate(p, path+".tls")
	p.Positive(path+".dial_timeout", c.DialTimeout)
	p.Positive(path+".timeout", c.Timeout)
	p.Positive(path+".poll_interval", c.PollInterval)
	if c.PoolSize < 1 {
		p.Addf(path+".pool_size", "must be >= 1, got %d", c.PoolSize)
	}
}

func checkHostPort(p *configfile.Problems, path, addr string) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil || host == "" || port == "" {
		p.Addf(path, "must be host:port, got %q", addr)
	}
}

func checkList(p *configfile.Problems, path string, addrs []string) {
	for i, a := range addrs {
		checkHostPort(p, fmt.Sprintf("%s[%d]", path, i), a)
		if slices.Index(addrs, a) < i {
			p.Addf(fmt.Sprintf("%s[%d]", path, i), "%s is listed twice", a)
		}
	}
}

func (t TLSConfig) validate(p *configfile.Problems, path string) {
	set := t.CAFile != "" || t.CertFile != "" || t.KeyFile != "" || t.ServerName != ""
	if set && !t.Enabled {
		p.Addf(path+".enabled", "must be true when ca_file, cert_file, key_file or server_name is set")
		return
	}
	if !t.Enabled {
		return
	}
	if _, err := t.config(); err != nil {
		var fe *fieldError
		if errors.As(err, &fe) {
			p.Addf(path+"."+fe.field, "%v", fe.err)
		} else {
			p.Addf(path, "%v", err)
		}
	}
}

// fieldError is a problem with one field of the tls section.
type fieldError struct {
	field string
	err   error
}

func (e *fieldError) Error() string { return e.field + ": " + e.err.Error() }
func (e *fieldError) Unwrap() error { return e.err }

// config builds the tls.Config, reading the files.
func (t TLSConfig) config() (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: t.ServerName}
	if t.CAFile != "" {
		pem, err := os.ReadFile(t.CAFile)
		if err != nil {
			return nil, &fieldError{"ca_file", err}
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, &fieldError{"ca_file", fmt.Errorf("%s holds no PEM certificate", t.CAFile)}
		}
		cfg.RootCAs = pool
	}
	switch {
	case (t.CertFile == "") != (t.KeyFile == ""):
		field := "key_file"
		if t.CertFile == "" {
			field = "cert_file"
		}
		return nil, &fieldError{field, errors.New("set both cert_file and key_file, or neither")}
	case t.CertFile != "":
		if fi, err := os.Stat(t.KeyFile); err == nil && fi.Mode().Perm()&0o007 != 0 {
			return nil, &fieldError{"key_file", fmt.Errorf("%s has mode %04o, which grants others access: chmod 600 (or 640) it", t.KeyFile, fi.Mode().Perm())}
		}
		cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
		if err != nil {
			return nil, &fieldError{"cert_file", err}
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

// Options is how a user of the client sizes it beyond the section.
func (c Config) options() (*redis.UniversalOptions, error) {
	var pw, spw string
	var err error
	if c.PasswordFile != "" {
		if pw, err = secretfile.Read(c.PasswordFile, "password file"); err != nil {
			return nil, fmt.Errorf("redis.password_file: %w", err)
		}
	} else {
		pw = c.Password
	}
	if c.SentinelPasswordFile != "" {
		if spw, err = secretfile.Read(c.SentinelPasswordFile, "password file"); err != nil {
			return nil, fmt.Errorf("redis.sentinel_password_file: %w", err)
		}
	}
	o := &redis.UniversalOptions{
		Username:              c.Username,
		Password:              pw,
		DB:                    c.DB,
		DialTimeout:           c.DialTimeout.D(),
		ReadTimeout:           c.Timeout.D(),
		WriteTimeout:          c.Timeout.D(),
		ContextTimeoutEnabled: true,
		PoolSize:              c.PoolSize,
		// One retry replaces a pooled connection that died with a restart
		// or a failover; every script of encgate is safe to repeat.
		MaxRetries:      1,
		DialerRetries:   1,
		DisableIdentity: true,
	}
	switch c.Mode {
	case Sentinel:
		o.MasterName = c.MasterName
		o.Addrs = slices.Clone(c.SentinelAddrs)
		o.SentinelUsername, o.SentinelPassword = c.SentinelUsername, spw
	case Cluster:
		o.Addrs = slices.Clone(c.ClusterAddrs)
		o.IsClusterMode = true
		// A moved slot or a failed-over node costs a redirect each.
		o.MaxRedirects = 3
	default:
		o.Addrs = []string{c.Addr}
	}
	if c.TLS.Enabled {
		tc, err := c.TLS.config()
		if err != nil {
			return nil, fmt.Errorf("redis.tls.%w", err)
		}
		o.TLSConfig = tc
	}
	return o, nil
}

// New builds the client the section describes. It reads the password and
// TLS files (its errors name the field path) but does not contact Redis.
func New(c Config) (redis.UniversalClient, error) {
	o, err := c.options()
	if err != nil {
		return nil, err
	}
	return redis.NewUniversalClient(o), nil
}

// Where says where the client connects, for logs: the address, the
// Sentinels and master name, or the cluster's seeds.
func (c Config) Where() string {
	switch c.Mode {
	case Sentinel:
		return fmt.Sprintf("master %q of sentinels %s", c.MasterName, strings.Join(c.SentinelAddrs, ","))
	case Cluster:
		return "cluster " + strings.Join(c.ClusterAddrs, ",")
	}
	return c.Addr
}

// Check pings Redis once and sorts a failure: nil when it answers; a
// *RefusedError when Redis answers but refuses this client for good (its
// credentials, a TLS certificate of the server's that does not verify, or
// the server refusing the client's certificate), which waiting will not
// fix; any other error is an outage a later try may not see.
func Check(ctx context.Context, c redis.UniversalClient) error {
	err := c.Ping(ctx).Err()
	if err == nil {
		return nil
	}
	var unknownCA x509.UnknownAuthorityError
	var hostname x509.HostnameError
	var invalid x509.CertificateInvalidError
	var verify *tls.CertificateVerificationError
	var op *net.OpError
	switch {
	case redis.IsAuthError(err):
		return &RefusedError{Reason: RefusedCredentials, Err: err}
	case errors.As(err, &unknownCA), errors.As(err, &hostname), errors.As(err, &invalid), errors.As(err, &verify):
		return &RefusedError{Reason: RefusedServerCert, Err: err}
	case errors.As(err, &op) && op.Op == "remote error" && op.Err != nil && certificateAlerts[op.Err.Error()]:
		return &RefusedError{Reason: RefusedClientCert, Err: err}
	}
	return err
}

// certificateAlerts are the TLS alerts (as crypto/tls writes them) by
// which a server refuses the client's certificate: none sent where one is
// required, or one it does not accept.
var certificateAlerts = map[string]bool{
	"tls: certificate required":          true,
	"tls: bad certificate":               true,
	"tls: unsupported certificate":       true,
	"tls: revoked certificate":           true,
	"tls: expired certificate":           true,
	"tls: unknown certificate":           true,
	"tls: unknown certificate authority": true,
	"tls: access denied":                 true,
}

// Reasons of a RefusedError.
const (
	RefusedCredentials = "credentials" // username, password
	RefusedServerCert  = "tls"         // the server's certificate does not verify
	RefusedClientCert  = "tls_client"  // the server refuses the client's certificate (or its lack)
)

// RefusedError is a Redis that answers but will not take this client.
type RefusedError struct {
	Reason string // RefusedCredentials, RefusedServerCert or RefusedClientCert
	Err    error
}

func (e *RefusedError) Error() string {
	switch e.Reason {
	case RefusedServerCert:
		return "redis's TLS certificate does not verify against redis.tls (ca_file, server_name): " + e.Err.Error()
	case RefusedClientCert:
		return "redis refuses the gateway's TLS client certificate (redis.tls.cert_file, key_file): " + e.Err.Error()
	}
	return "redis refuses the gateway's credentials (redis.username, password or password_file): " + e.Err.Error()
}

// TLS reports whether the refusal is TLS's (either certificate), which a
// gateway does not start with: only a change of its config or of the
// servers' certificates ends it.
func (e *RefusedError) TLS() bool {
	return e.Reason == RefusedServerCert || e.Reason == RefusedClientCert
}

func (e *RefusedError) Unwrap() error { return e.Err }

// EscapeTag is a hash tag's content for s, the part of a key between
// { and } that decides its cluster slot, so that every key of one req_id
// (its /send records, its pin) shares a slot. It writes '%' as %25 and
// '}' as %7D, and the empty string as a lone '%' (which no other input
// yields): an injective encoding whose
// output holds no '}' and is never empty, so it is always the whole hash
// tag (Redis hashes the whole key for an empty one). Real req_ids have
// neither byte and come back unchanged, without an allocation.
func EscapeTag(s string) string {
	if s == "" {
		return "%"
	}
	if !strings.ContainsAny(s, "%}") {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 8)
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '%':
			b.WriteString("%25")
		case '}':
			b.WriteString("%7D")
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}
