package gateway

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/redisclient"
	"github.com/encgate/encgate/internal/secretfile/secretfiletest"
	"github.com/encgate/encgate/upstream"
)

func validConfig() Config {
	c := DefaultConfig()
	c.Encoders = []upstream.EncoderConfig{
		{Name: "enc-a", URL: "http://127.0.0.1:30001"},
		{Name: "enc-b", URL: "http://127.0.0.1:30002"},
	}
	return c
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*Config)
		want   []string // substrings, each must appear; empty = valid
	}{
		{"defaults plus encoders", func(*Config) {}, nil},
		{"no encoders", func(c *Config) { c.Encoders = nil }, []string{"encoders: at least one encoder is required"}},
		{"bad url scheme", func(c *Config) { c.Encoders[1].URL = "ftp://x:1" }, []string{`encoders[1].url: scheme must be http or https, got "ftp"`}},
		{"url without port", func(c *Config) { c.Encoders[0].URL = "http://host" }, []string{"encoders[0].url: must be http(s)://host:port"}},
		{"url with path", func(c *Config) { c.Encoders[0].URL = "http://h:1/v1" }, []string{"encoders[0].url: must be a base URL without path"}},
		{"empty name", func(c *Config) { c.Encoders[0].Name = "" }, []string{"encoders[0].name: must not be empty"}},
		{"duplicate name", func(c *Config) { c.Encoders[1].Name = "enc-a" }, []string{`encoders[1].name: "enc-a" is already used by encoders[0]`}},
		{"duplicate url", func(c *Config) { c.Encoders[1].URL = c.Encoders[0].URL }, []string{"encoders[1].url:", "already used by encoders[0]"}},
		{"listen", func(c *Config) { c.Listen = "8080" }, []string{`listen: must be host:port, got "8080"`}},
		{"admin same as listen", func(c *Config) { c.AdminListen = c.Listen }, []string{"admin_listen: must differ from listen"}},
		{"pin ttl", func(c *Config) { c.Affinity.PinTTL = 0 }, []string{"affinity.pin_ttl: must be > 0"}},
		{"unknown wait", func(c *Config) { c.Affinity.UnknownWait = -1 }, []string{"affinity.unknown_wait: must be >= 0"}},
		{"max pins", func(c *Config) { c.Affinity.MaxPins = 0 }, []string{"affinity.max_pins: must be >= 1"}},
		{"upstream timeout", func(c *Config) { c.Upstream.Timeout = 0 }, []string{"upstream.timeout: must be > 0"}},
		{"body limit", func(c *Config) { c.Limits.MaxBodyBytes = 10 }, []string{"limits.max_body_bytes: must be >= 1KiB"}},
		{"header limit", func(c *Config) { c.Limits.MaxHeaderBytes = 512 }, []string{"limits.max_header_bytes: must be between 1KiB and 1MiB"}},
		{"header limit too big", func(c *Config) { c.Limits.MaxHeaderBytes = 2 << 20 }, []string{"limits.max_header_bytes: must be between 1KiB and 1MiB", "got 2MiB"}},
		{"header timeout", func(c *Config) { c.Limits.ReadHeaderTimeout = 0 }, []string{"limits.read_header_timeout: must be > 0"}},
		{"max conns", func(c *Config) { c.Limits.MaxConns = 0 }, []string{"limits.max_conns: must be between 1 and"}},
		{"max inflight", func(c *Config) { c.Limits.MaxInflightPerEncoder = 0 }, []string{"limits.max_inflight_per_encoder: must be >= 1, got 0"}},
		{"poll share 1", func(c *Config) { c.Limits.PollShare = 1 }, []string{"limits.poll_share: must be above 0 and below 1 " +
			"(the share of limits.max_inflight_per_encoder long polls may hold), got 1"}},
		{"poll share 0", func(c *Config) { c.Limits.PollShare = 0 }, []string{"limits.poll_share: must be above 0 and below 1", "got 0"}},
		{"poll share NaN", func(c *Config) { c.Limits.PollShare = math.NaN() }, []string{"limits.poll_share: must be above 0 and below 1", "got NaN"}},
		{"poll share small", func(c *Config) { c.Limits.PollShare = 0.01 }, nil},
		{"shutdown delay", func(c *Config) { c.Shutdown.Delay = -1 }, []string{"shutdown.delay: must be >= 0"}},
		{"max orphaned claims", func(c *Config) { c.Idempotency.MaxOrphanedClaims = 0 },
			[]string{"idempotency.max_orphaned_claims: must be between 1 and 16777216, got 0"}},
		{"admin token", func(c *Config) { c.Admin.Token = "0123456789abcdef" }, nil},
		{"short admin token", func(c *Config) { c.Admin.Token = "hunter2" }, []string{"admin.token: must be at least 16 characters, got 7"}},
		{"admin token with a space", func(c *Config) { c.Admin.Token = "correct horse battery staple" },
			[]string{"admin.token: must use only letters, digits and -._~+/"}},
		{"session ttl", func(c *Config) { c.Admin.SessionTTL = 0 }, []string{"admin.session_ttl: must be between 1m and 720h0m0s, got 0s"}},
		{"long session ttl", func(c *Config) { c.Admin.SessionTTL = configfile.Duration(31 * 24 * time.Hour) },
			[]string{"admin.session_ttl: must be between 1m and 720h0m0s, got 744h0m0s"}},
		{"log level", func(c *Config) { c.Log.Level = "loud" }, []string{`log.level: must be debug, info, warn or error, got "loud"`}},
		{"several at once", func(c *Config) { c.Listen = ""; c.Shutdown.Grace = 0 }, []string{"listen:", "shutdown.grace: must be > 0"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := validConfig()
			tc.mutate(&c)
			err := c.Validate()
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("want errors %q, got none", tc.want)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
			if tok := c.Admin.Token; tok != "" && strings.Contains(err.Error(), tok) {
				t.Errorf("error %q shows the admin token", err)
			}
		})
	}
}

func TestLoadConfig(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	ok := write("ok.yaml", "encoders:\n  - {name: a, url: \"http://127.0.0.1:1\"}\naffinity:\n  unknown_wait: 250ms\nlimits:\n  max_body_bytes: 2MiB\n")
	cfg, err := LoadConfig(ok)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Affinity.UnknownWait.D().Milliseconds() != 250 || cfg.Limits.MaxBodyBytes != 2<<20 {
		t.Errorf("values not applied: %+v %+v", cfg.Affinity, cfg.Limits)
	}
	if cfg.Affinity.PinTTL != DefaultConfig().Affinity.PinTTL {
		t.Errorf("default pin_ttl lost: %v", cfg.Affinity.PinTTL)
	}
	for name, body := range map[string]string{
		"unknown key":  "encoders: []\nlisen: x\n",
		"bad duration": "affinity:\n  pin_ttl: forever\n",
		"bad size":     "limits:\n  max_body_bytes: lots\n",
	} {
		_, err := LoadConfig(write(strings.ReplaceAll(name, " ", "_")+".yaml", body))
		if err == nil {
			t.Errorf("%s: loaded", name)
		}
	}
	_, err = LoadConfig(write("typo.yaml", "encoders: []\nlisen: x\n"))
	if err == nil || !strings.Contains(err.Error(), "lisen") {
		t.Errorf("unknown key error does not name the key: %v", err)
	}
}

// configs/gateway.yaml documents every key with its default: loaded, it
// must equal DefaultConfig apart from its example encoders.
func TestExampleConfigShowsTheDefaults(t *testing.T) {
	cfg, err := LoadConfig(filepath.Join("..", "configs", "gateway.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.Encoders) == 0 {
		t.Fatal("the example has no encoders")
	}
	cfg.Encoders = nil
	if want := DefaultConfig(); !reflect.DeepEqual(cfg, want) {
		got, _ := yaml.Marshal(cfg)
		exp, _ := yaml.Marshal(want)
		t.Fatalf("configs/gateway.yaml differs from DefaultConfig:\n--- example\n%s\n--- defaults\n%s", got, exp)
	}
}

func TestLoadConfigReportsDecodeAndValidationProblemsTogether(t *testing.T) {
	path := filepath.Join(t.TempDir(), "bad.yaml")
	body := "encoders:\n  - {name: a, url: \"ftp://x\"}\naffinity:\n  pin_ttl: forever\nbogus_key: 1\n"
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := LoadConfig(path)
	if err == nil {
		t.Fatal("loaded")
	}
	for _, w := range []string{`affinity.pin_ttl: "forever" is not a duration`, "bogus_key: unknown key (line 5)",
		`encoders[0].url: scheme must be http or https, got "ftp"`} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%q missing from:\n%v", w, err)
		}
	}
}

// Top-level x- keys are ignored: they hold anchors that merge keys and
// aliases use elsewhere. A misspelt key names the key it is near.
func TestLoadConfigExtensionKeysAndSuggestions(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "anchors.yaml")
	body := `x-policy: &policy
  max_attempts: 4
  initial_backoff: 100ms
x-encoder: &enc {generation: gen1}
encoders:
  - {<<: *enc, name: a, url: "http://127.0.0.1:1"}
  - {<<: *enc, name: b, url: "http://127.0.0.1:2", generation: new}
retry:
  send: {<<: *policy, deadline: 30s}
  receive_url: *policy
`
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	if e := cfg.Encoders; len(e) != 2 || e[0].Generation != upstream.Gen1 || e[1].Generation != upstream.GenNew {
		t.Errorf("encoders = %+v", e)
	}
	def := DefaultConfig().Retry
	if s := cfg.Retry.Send; s.MaxAttempts != 4 || s.InitialBackoff.D() != 100*time.Millisecond || s.Deadline.D() != 30*time.Second ||
		s.MaxBackoff != def.Send.MaxBackoff {
		t.Errorf("send = %+v: want the merged keys over the defaults", s)
	}
	if r := cfg.Retry.ReceiveURL; r.MaxAttempts != 4 || r.PerTryTimeout != def.ReceiveURL.PerTryTimeout {
		t.Errorf("receive_url = %+v", r)
	}

	path = filepath.Join(dir, "typo.yaml")
	if err := os.WriteFile(path, []byte("encoders: [{name: a, url: \"http://x:1\"}]\naffinity:\n  unknwn_wait: 5s\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadConfig(path); err == nil || err.Error() != `affinity.unknwn_wait: unknown key, did you mean "unknown_wait"? (line 3)` {
		t.Errorf("err = %v", err)
	}
}

// Every key of the config says whether a reload applies it: a section is
// tagged reload:"live" or reload:"restart", or it is untagged and so is each
// of its fields.
func TestEveryConfigSectionDeclaresItsReload(t *testing.T) {
	var check func(typ reflect.Type, path string)
	check = func(typ reflect.Type, path string) {
		for i := 0; i < typ.NumField(); i++ {
			f := typ.Field(i)
			at := path + f.Name
			switch tag := f.Tag.Get("reload"); {
			case tag == "live" || tag == "restart":
			case tag == "" && f.Type.Kind() == reflect.Struct && path == "":
				check(f.Type, at+".")
			default:
				t.Errorf("%s: reload tag %q (want live or restart)", at, tag)
			}
		}
	}
	check(reflect.TypeOf(Config{}), "")
}

// admin.token_file and redis.password_file, through the real
// loader: each takes its secret from a file of mode 0600 or 0640, and is
// refused, with its field path, beside its inline key, on a file others
// may read, on a missing file, and (the token) on a token admin.token
// would refuse. No error quotes a secret.
func TestSecretFileKeysLoad(t *testing.T) {
	const token, password = "admin-token-from-a-file-0123", "redis password from a file"
	good := secretfiletest.Write(t, "token", token+"\n", 0o600)
	goodGroup := secretfiletest.Write(t, "token", token+"\n", 0o640)
	open := secretfiletest.Write(t, "token", token+"\n", 0o644)
	short := secretfiletest.Write(t, "token", "hunter2\n", 0o600)
	pwGood := secretfiletest.Write(t, "password", password+"\n", 0o640)
	pwOpen := secretfiletest.Write(t, "password", password+"\n", 0o604)
	missing := filepath.Join(t.TempDir(), "missing")
	load := func(admin, redis string) (Config, error) {
		t.Helper()
		body := "encoders:\n  - {name: a, url: \"http://127.0.0.1:30001\"}\nadmin:\n" + admin +
			"idempotency:\n  store: redis\nredis:\n" + redis
		return LoadConfig(secretfiletest.Write(t, "gateway.yaml", body, 0o600))
	}
	line := func(key, value string) string { return fmt.Sprintf("  %s: %q\n", key, value) }
	adminLine := line

	for _, file := range []string{good, goodGroup} {
		cfg, err := load(adminLine("token_file", file), line("password_file", pwGood))
		if err != nil {
			t.Fatalf("token_file %s: %v", file, err)
		}
		if cfg.Admin.TokenFile != file || cfg.Admin.Token != "" || cfg.Redis.PasswordFile != pwGood {
			t.Errorf("loaded %+v / %+v", cfg.Admin, cfg.Redis)
		}
		if tok := cfg.Admin.Required(); tok == "" || tok == token {
			t.Errorf("before the file is read the token in force is %q: want one that no request carries (closed, not open)", tok)
		}
		if err := cfg.Admin.ReadToken("admin"); err != nil || cfg.Admin.Required() != token {
			t.Errorf("the token in force is not the file's: %v", err)
		}
		if c, err := redisclient.New(cfg.Redis); err != nil {
			t.Errorf("the Redis client: %v", err)
		} else {
			_ = c.Close()
		}
	}

	for _, tc := range []struct {
		name         string
		admin, redis string
		want         string
	}{
		{"both tokens", adminLine("token", token) + adminLine("token_file", good), "",
			"admin.token_file: set at most one of token and token_file"},
		{"open token file", adminLine("token_file", open), "",
			"admin.token_file: token file " + open + " has mode 0644, which grants others access: chmod 600 (or 640) it"},
		{"missing token file", adminLine("token_file", missing), "",
			"admin.token_file: open " + missing + ": no such file or directory"},
		{"short token in the file", adminLine("token_file", short), "",
			"admin.token_file: token file " + short + ": the token must be at least 16 characters, got 7"},
		{"both passwords", "", line("password", password) + line("password_file", pwGood),
			"redis.password_file: set at most one of password and password_file"},
		{"open password file", "", line("password_file", pwOpen),
			"redis.password_file: password file " + pwOpen + " has mode 0604, which grants others access: chmod 600 (or 640) it"},
		{"missing password file", "", line("password_file", missing),
			"redis.password_file: open " + missing + ": no such file or directory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := load(tc.admin, tc.redis)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("LoadConfig: %v, want %q", err, tc.want)
			}
			for _, secret := range []string{token, password, "hunter2"} {
				if strings.Contains(err.Error(), secret) {
					t.Errorf("the error quotes a secret: %v", err)
				}
			}
		})
	}
}

// An old config with idempotency.redis is refused with where the section
// went, and a redis: section is validated only when a Redis store uses it.
func TestMovedRedisSectionIsNamed(t *testing.T) {
	enc := "encoders:\n  - {name: a, url: \"http://127.0.0.1:30001\"}\n"
	_, err := LoadConfig(secretfiletest.Write(t, "gateway.yaml", enc+
		"idempotency:\n  store: redis\n  redis:\n    addr: \"10.0.0.1:6379\"\n    fail_open: true\n", 0o600))
	if err == nil || !strings.Contains(err.Error(), "idempotency.redis: has moved: the connection (addr, username, password_file, db, key_prefix, timeouts, pool_size, poll_interval) is the top-level redis: section") ||
		!strings.Contains(err.Error(), "fail_open is idempotency.fail_open") {
		t.Fatalf("old section: %v", err)
	}
	bad := "redis:\n  mode: cluster\n"
	if _, err := LoadConfig(secretfiletest.Write(t, "gateway.yaml", enc+bad, 0o600)); err != nil {
		t.Fatalf("a redis: section no store reads was checked: %v", err)
	}
	_, err = LoadConfig(secretfiletest.Write(t, "gateway.yaml", enc+"idempotency:\n  store: redis\n"+bad, 0o600))
	if err == nil || !strings.Contains(err.Error(), "redis.cluster_addrs: is required with mode: cluster") {
		t.Fatalf("cluster without nodes: %v", err)
	}
}

// An old config with breaker.interval or breaker.open_timeout (the
// gobreaker keys) is refused with what replaced them, not as unknown keys.
func TestMovedBreakerKeysAreNamed(t *testing.T) {
	enc := "encoders:\n  - {name: a, url: \"http://127.0.0.1:30001\"}\n"
	_, err := LoadConfig(secretfiletest.Write(t, "gateway.yaml", enc+
		"breaker:\n  consecutive_failures: 5\n  interval: 10s\n  open_timeout: 30s\n", 0o600))
	if err == nil {
		t.Fatal("breaker.interval and breaker.open_timeout accepted")
	}
	for _, want := range []string{
		"breaker.interval: is gone: faults are no longer counted in a time window",
		"breaker.failure_ratio over the last breaker.min_requests outcomes",
		"breaker.open_timeout: is gone: an ejection lasts breaker.base_ejection_time times the encoder's trips, up to breaker.max_ejection_time",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
	if strings.Contains(err.Error(), "not found") || strings.Contains(err.Error(), "unknown") {
		t.Errorf("a moved key reads as unknown:\n%v", err)
	}
}
