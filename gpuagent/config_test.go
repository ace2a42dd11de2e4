package gpuagent

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/encgate/encgate/internal/configfile"
)

func TestDefaultConfigIsValid(t *testing.T) {
	c := DefaultConfig()
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if c.Receiver != nil || c.Notify.HTTPURL != "" || c.Staging.CapacityBytes != 4<<30 || c.Staging.TTL.D() != 180*time.Second ||
		c.Staging.MaxStageBytes != 0 || c.Staging.MaxStage() != 1<<30 || c.Staging.MaxConcurrent != 64 || len(c.Transfer.AllowNetworks) != 4 ||
		c.Control != (ControlConfig{Socket: "/run/encgate/agent.sock", SocketMode: "0660",
			ReadHeaderTimeout: configfile.Duration(10 * time.Second), BodyTimeout: configfile.Duration(10 * time.Second)}) ||
		c.Ack != (AckConfig{Mode: AckRequired, MaxFrameBytes: 1 << 20, ConnectTimeout: configfile.Duration(5 * time.Second),
			SendTimeout: configfile.Duration(10 * time.Second), Linger: configfile.Duration(time.Second)}) {
		t.Fatalf("defaults %+v", c)
	}
}

// configs/agent.yaml documents every key with its default: loaded, it must
// equal DefaultConfig.
func TestExampleConfigShowsTheDefaults(t *testing.T) {
	cfg, err := LoadConfig(filepath.Join("..", "configs", "agent.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if want := DefaultConfig(); !reflect.DeepEqual(cfg, want) {
		got, _ := yaml.Marshal(cfg)
		exp, _ := yaml.Marshal(want)
		t.Fatalf("configs/agent.yaml differs from DefaultConfig:\n--- example\n%s\n--- defaults\n%s", got, exp)
	}
}

func writeConfig(t *testing.T, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "agent.yaml")
	if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestLoadConfigEveryKey(t *testing.T) {
	c, err := LoadConfig(writeConfig(t, `
listen: "127.0.0.1:7401"
admin_listen: "127.0.0.1:7501"
staging:
  capacity_bytes: 8GiB
  ttl: 200s
  max_stage_bytes: 512MiB
transfer:
  allow_networks: ["10.0.0.0/8", "fd00::/8"]
  connect_timeout: 2s
  timeout: 20s
receiver:
  handshake_listen: "127.0.0.1:15001"
  data_listen: "127.0.0.1:16001"
  advertise_host: "127.0.0.1"
  buffers: [64MiB, 1GiB]
ack:
  mode: optional
  max_frame_bytes: 64KiB
  connect_timeout: 1s
  send_timeout: 3s
  linger: 0s
notify:
  http_url: "http://10.0.0.5:9000/done"
log: {level: debug}
shutdown: {grace: 10s}
`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Staging.CapacityBytes != 8<<30 || c.Staging.TTL.D() != 200*time.Second || c.Staging.MaxStageBytes != 512<<20 ||
		len(c.Transfer.AllowNetworks) != 2 || c.Transfer.ConnectTimeout.D() != 2*time.Second ||
		c.Receiver == nil || c.Receiver.AdvertiseHost != "127.0.0.1" || len(c.Receiver.Buffers) != 2 || c.Receiver.Buffers[1] != 1<<30 ||
		c.Notify.HTTPURL != "http://10.0.0.5:9000/done" || c.Log.Level != "debug" || c.Shutdown.Grace.D() != 10*time.Second ||
		c.Ack != (AckConfig{Mode: AckOptional, MaxFrameBytes: 64 << 10, ConnectTimeout: configfile.Duration(time.Second),
			SendTimeout: configfile.Duration(3 * time.Second)}) {
		t.Fatalf("loaded %+v", c)
	}
}

func TestLoadConfigReceiverNullAndDefaults(t *testing.T) {
	c, err := LoadConfig(writeConfig(t, "receiver: null\nstaging:\n  ttl: 60s\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.Receiver != nil || c.Staging.TTL.D() != time.Minute || c.Staging.CapacityBytes != 4<<30 || c.Listen != "127.0.0.1:7401" {
		t.Fatalf("loaded %+v", c)
	}
}

func TestLoadConfigReportsEveryProblem(t *testing.T) {
	_, err := LoadConfig(writeConfig(t, `
listen: nowhere
staging:
  capacity_bytes: 1KiB
  ttl: 0s
  max_stage_bytes: 2KiB
  extra: 1
transfer:
  allow_networks: ["10.0.0.0/8", "not-a-cidr"]
  timeout: soon
receiver:
  handshake_listen: "127.0.0.1:15001"
  buffers: [0]
ack:
  mode: always
  max_frame_bytes: 0
  send_timeout: 0s
  linger: -1s
notify:
  http_url: "ftp://x"
log: {level: loud}
`))
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{
		`listen: must be host:port, got "nowhere"`,
		"staging.extra: unknown key",
		`transfer.timeout: "soon" is not a duration`,
		"staging.ttl: must be > 0",
		"staging.max_stage_bytes: must be <= capacity_bytes (1KiB), got 2KiB",
		`transfer.allow_networks[1]: must be a CIDR such as 10.0.0.0/8, got "not-a-cidr"`,
		`receiver.data_listen: must be host:port, got ""`,
		"receiver.advertise_host: must be set",
		"receiver.buffers[0]: must be > 0",
		`notify.http_url: must be an http(s) URL or empty, got "ftp://x"`,
		`ack.mode: must be required, optional or off, got "always"`,
		"ack.max_frame_bytes: must be > 0 and <= 64MiB",
		"ack.send_timeout: must be > 0",
		"ack.linger: must be >= 0",
		`log.level: must be debug, info, warn or error, got "loud"`,
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*Config)
		want   string // "" = valid
	}{
		{"defaults", func(*Config) {}, ""},
		{"same listeners", func(c *Config) { c.AdminListen = c.Listen }, "admin_listen: must differ from listen"},
		{"port 0 twice", func(c *Config) { c.Listen, c.AdminListen = "127.0.0.1:0", "127.0.0.1:0" }, ""},
		{"no networks", func(c *Config) { c.Transfer.AllowNetworks = nil }, "transfer.allow_networks: must list at least one CIDR"},
		{"capacity", func(c *Config) { c.Staging.CapacityBytes = 0 }, "staging.capacity_bytes: must be > 0"},
		{"max stage", func(c *Config) { c.Staging.MaxStageBytes = -1 }, "staging.max_stage_bytes: must be >= 0"},
		{"connect timeout", func(c *Config) { c.Transfer.ConnectTimeout = 0 }, "transfer.connect_timeout: must be > 0"},
		{"chunk small", func(c *Config) { c.Transfer.ChunkBytes = 4095 }, "transfer.chunk_bytes: must be between 4KiB and 256MiB, got 4095"},
		{"chunk large", func(c *Config) { c.Transfer.ChunkBytes = 256<<20 + 1 }, "transfer.chunk_bytes: must be between 4KiB and 256MiB"},
		{"one buffer", func(c *Config) { c.Transfer.Buffers = 1 }, "transfer.buffers: must be between 2 and 16, got 1"},
		{"cuda mode", func(c *Config) { c.CUDA.Mode = "on" }, `cuda.mode: must be auto, off or required, got "on"`},
		{"cuda capacity", func(c *Config) { c.CUDA.CapacityBytes = 0 }, "cuda.capacity_bytes: must be > 0"},
		{"cuda lanes", func(c *Config) { c.CUDA.Lanes = 65 }, "cuda.lanes: must be between 1 and 64, got 65"},
		{"receiver ok", func(c *Config) {
			c.Receiver = &ReceiverConfig{HandshakeListen: ":1", DataListen: ":2", AdvertiseHost: "h", Buffers: []configfile.ByteSize{1}}
		}, ""},
		{"receiver no buffers", func(c *Config) {
			c.Receiver = &ReceiverConfig{HandshakeListen: ":1", DataListen: ":2", AdvertiseHost: "h"}
		}, "receiver.buffers: must list at least one"},
		{"receiver same ports", func(c *Config) {
			c.Receiver = &ReceiverConfig{HandshakeListen: ":1", DataListen: ":1", AdvertiseHost: "h", Buffers: []configfile.ByteSize{1}}
		}, "receiver.data_listen: must differ"},
		{"notify no host", func(c *Config) { c.Notify.HTTPURL = "http://" }, "notify.http_url"},
		{"grace", func(c *Config) { c.Shutdown.Grace = 0 }, "shutdown.grace: must be > 0"},
		{"ack off", func(c *Config) { c.Ack.Mode = AckOff }, ""},
		{"ack mode empty", func(c *Config) { c.Ack.Mode = "" }, `ack.mode: must be required, optional or off, got ""`},
		{"ack frame too big", func(c *Config) { c.Ack.MaxFrameBytes = 65 << 20 }, "ack.max_frame_bytes: must be > 0 and <= 64MiB, got 65MiB"},
		{"ack connect timeout", func(c *Config) { c.Ack.ConnectTimeout = 0 }, "ack.connect_timeout: must be > 0"},
		{"ack linger 0", func(c *Config) { c.Ack.Linger = 0 }, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := DefaultConfig()
			tc.mutate(&c)
			err := c.Validate()
			if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("Validate = %v, want %q", err, tc.want)
			}
		})
	}
}

func TestNewRefusesAnInvalidConfig(t *testing.T) {
	c := DefaultConfig()
	c.Staging.TTL = 0
	if _, err := New(c, Deps{}); err == nil || !strings.Contains(err.Error(), "staging.ttl") {
		t.Fatalf("New = %v", err)
	}
}

// TestEachKeyAloneLoads sets every key of configs/agent.yaml alone, to
// values other than its default, on top of the defaults: a default that
// contradicts another key's value (max_stage_bytes above a smaller
// capacity_bytes, say) fails here. A key the table lacks fails too, so a
// new key cannot skip the check.
func TestEachKeyAloneLoads(t *testing.T) {
	tokenFile := filepath.Join(t.TempDir(), "agent.token")
	if err := os.WriteFile(tokenFile, []byte("a-token-from-a-file-0123\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	values := map[string][]string{
		"listen":                      {`"10.0.0.1:7401"`, `":0"`},
		"admin_listen":                {`"10.0.0.1:7501"`},
		"control.socket":              {`/var/run/encgate.sock`},
		"control.socket_mode":         {`"0600"`, `"0640"`},
		"control.socket_group":        {`"encoders"`, `"1000"`},
		"control.token":               {`"an-inline-token-0123456789"`},
		"control.token_file":          {strconv.Quote(tokenFile)},
		"control.insecure":            {`true`},
		"control.read_header_timeout": {`1s`},
		"control.body_timeout":        {`100ms`, `10m`},
		"admin.token":                 {`"an-admin-token-0123456789"`},
		"staging.capacity_bytes":      {`256MiB`, `1KiB`, `64GiB`},
		"staging.ttl":                 {`1s`, `1h`},
		"staging.max_stage_bytes":     {`1KiB`, `4GiB`},
		"staging.max_concurrent":      {`1`, `4096`},
		"transfer.allow_networks":     {`["0.0.0.0/0", "::/0"]`},
		"transfer.connect_timeout":    {`100ms`},
		"transfer.timeout":            {`1s`, `10m`},
		"transfer.chunk_bytes":        {`4KiB`, `256MiB`},
		"transfer.buffers":            {`2`, `16`},
		"cuda.mode":                   {`off`, `required`},
		"cuda.library":                {`/usr/lib/x86_64-linux-gnu/libcuda.so.1`},
		"cuda.capacity_bytes":         {`1KiB`, `80GiB`},
		"cuda.lanes":                  {`1`, `64`},
		"receiver":                    {`{handshake_listen: "127.0.0.1:0", data_listen: "127.0.0.1:0", advertise_host: "127.0.0.1", buffers: [1MiB]}`},
		"ack.mode":                    {`optional`, `off`},
		"ack.max_frame_bytes":         {`1KiB`, `64MiB`},
		"ack.connect_timeout":         {`100ms`},
		"ack.send_timeout":            {`100ms`},
		"ack.linger":                  {`0s`, `1m`},
		"notify.http_url":             {`"http://10.0.0.5:9000/done"`},
		"log.level":                   {`debug`, `error`},
		"shutdown.grace":              {`1s`},
	}
	raw, err := os.ReadFile(filepath.Join("..", "configs", "agent.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	var keys []string
	var walk func(n *yaml.Node, prefix string)
	walk = func(n *yaml.Node, prefix string) {
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := prefix+n.Content[i].Value, n.Content[i+1]
			if v.Kind == yaml.MappingNode {
				walk(v, k+".")
				continue
			}
			keys = append(keys, k)
		}
	}
	walk(doc.Content[0], "")
	if len(keys) != len(values) {
		t.Errorf("configs/agent.yaml has %d keys, the table %d", len(keys), len(values))
	}
	for _, key := range keys {
		vals, ok := values[key]
		if !ok {
			t.Errorf("%s: no value in this test's table; add one", key)
			continue
		}
		for _, v := range vals {
			// a.b.c: v  becomes  a: {b: {c: v}}
			parts := strings.Split(key, ".")
			text := v
			for i := len(parts) - 1; i >= 0; i-- {
				text = fmt.Sprintf("{%s: %s}", parts[i], text)
			}
			if _, err := LoadConfig(writeConfig(t, text)); err != nil {
				t.Errorf("%s: %s alone does not load: %v", key, v, err)
			}
		}
	}
}

// An agent config that sets only capacity_bytes below 1GiB starts, and its
// stage bound follows the capacity.
func TestOnlyCapacityBytesStarts(t *testing.T) {
	cfg, err := LoadConfig(writeConfig(t, "staging:\n  capacity_bytes: 256MiB\n"))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Staging.MaxStage() != 256<<20 {
		t.Fatalf("max stage %s", cfg.Staging.MaxStage())
	}
	a := startAgent(t, func(c *Config) { c.Staging = cfg.Staging }, nil, nil)
	expectErr(t, do(t, http.MethodPost, a.ctl+"/v1/stage?req_id=big&tokens=65537&dim=1024&dtype=float32", nil),
		http.StatusRequestEntityTooLarge, "big", "over staging.max_stage_bytes (256MiB)")
	a.stageOK(t, "fits", 4, 8)
	// A value set above the capacity is still refused.
	_, err = LoadConfig(writeConfig(t, "staging:\n  capacity_bytes: 256MiB\n  max_stage_bytes: 1GiB\n"))
	if err == nil || !strings.Contains(err.Error(), "staging.max_stage_bytes: must be <= capacity_bytes (256MiB), got 1GiB") {
		t.Fatalf("LoadConfig = %v", err)
	}
}

func TestValidateControl(t *testing.T) {
	open := filepath.Join(t.TempDir(), "open.token")
	if err := os.WriteFile(open, []byte("a-token-from-a-file-0123\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		mutate func(*Config)
		want   string
	}{
		{"relative socket", func(c *Config) { c.Control.Socket = "agent.sock" }, `control.socket: must be an absolute path, got "agent.sock"`},
		{"no socket", func(c *Config) { c.Control.Socket = "" }, "control.socket: must be set"},
		{"long socket", func(c *Config) { c.Control.Socket = "/" + strings.Repeat("s", 120) }, "control.socket: must be at most 107 bytes"},
		{"mode not octal", func(c *Config) { c.Control.SocketMode = "rw-rw----" }, "control.socket_mode: must be octal permission bits"},
		{"mode for others", func(c *Config) { c.Control.SocketMode = "0666" }, `control.socket_mode: "0666" lets every user on the node stage`},
		{"mode for others, insecure", func(c *Config) { c.Control.SocketMode, c.Control.Insecure = "0666", true }, ""},
		{"mode without the owner", func(c *Config) { c.Control.SocketMode = "0060" }, "must give the agent's own user read and write"},
		{"short token", func(c *Config) { c.Control.Token = "short" }, "control.token: must be at least 16 characters"},
		{"both tokens", func(c *Config) { c.Control.Token, c.Control.TokenFile = "an-inline-token-0123456789", open }, "control.token_file: set at most one"},
		{"token file for others", func(c *Config) { c.Control.TokenFile = open }, "control.token_file: token file " + open + " has mode 0644"},
		{"insecure with a token", func(c *Config) { c.Control.Token, c.Control.Insecure = "an-inline-token-0123456789", true }, "control.insecure: cannot be true with a token"},
		{"body timeout", func(c *Config) { c.Control.BodyTimeout = 0 }, "control.body_timeout: must be > 0"},
		{"concurrent stages", func(c *Config) { c.Staging.MaxConcurrent = 0 }, "staging.max_concurrent: must be between 1 and 4096, got 0"},
		{"admin token", func(c *Config) { c.Admin.Token = "short" }, "admin.token: must be at least 16 characters"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := DefaultConfig()
			tc.mutate(&c)
			err := c.Validate()
			if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("Validate = %v, want %q", err, tc.want)
			}
			if err != nil && strings.Contains(err.Error(), "0123456789") {
				t.Fatalf("a problem quotes the token: %v", err)
			}
		})
	}
}

func TestNotifyURLWithoutSchemeIsHinted(t *testing.T) {
	_, err := LoadConfig(writeConfig(t, "notify:\n  http_url: \"10.0.0.5:9000\"\n"))
	want := `notify.http_url: "10.0.0.5:9000" has no scheme; did you mean "http://10.0.0.5:9000"?`
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("LoadConfig = %v, want %q", err, want)
	}
}
