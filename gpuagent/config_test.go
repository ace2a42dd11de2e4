package gpuagent

import (
	"os"
	"path/filepath"
	"reflect"
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
		c.Staging.MaxStageBytes != 1<<30 || len(c.Transfer.AllowNetworks) != 4 ||
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
		{"max stage", func(c *Config) { c.Staging.MaxStageBytes = -1 }, "staging.max_stage_bytes: must be > 0"},
		{"connect timeout", func(c *Config) { c.Transfer.ConnectTimeout = 0 }, "transfer.connect_timeout: must be > 0"},
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
