// Package gpuagent is encgate's per-node agent: it holds the embeddings the
// node's encoder stages (raw bytes over the local API, or a /dev/shm file it
// maps), and performs sglang's /send for them, writing the bytes into the
// receiver's registered buffer over Mooncake's TCP transport with the
// invariants of sglang's own _send: staged at all, encode succeeded, size
// matches, refcount by distinct destination, release on any send error, and
// a TTL sweep.
package gpuagent

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strings"

	"github.com/encgate/encgate/internal/configfile"
)

// Config is the agent's YAML file. DefaultConfig holds every default.
type Config struct {
	// Listen is the control API: staging, /send and /v1/receiver (default
	// 127.0.0.1:7401).
	Listen string `yaml:"listen"`
	// AdminListen serves /metrics, /healthz, /readyz and /admin/staged
	// (default 127.0.0.1:7501). It must differ from Listen.
	AdminListen string `yaml:"admin_listen"`
	// Staging bounds what the encoder may stage.
	Staging StagingConfig `yaml:"staging"`
	// Transfer controls the Mooncake TCP initiator.
	Transfer TransferConfig `yaml:"transfer"`
	// Receiver, when set, makes the agent a Mooncake TCP receiver too.
	// Absent or null (the default) means off; when present, all its keys
	// are required.
	Receiver *ReceiverConfig `yaml:"receiver"`
	// Ack delivers the encoder's ZMQ completion ack after a confirmed
	// transfer, as sglang's encoder does.
	Ack AckConfig `yaml:"ack"`
	// Notify is the completion notice sent after a confirmed transfer.
	Notify NotifyConfig `yaml:"notify"`
	// Log controls the zap logger.
	Log configfile.Log `yaml:"log"`
	// Shutdown controls draining.
	Shutdown configfile.Shutdown `yaml:"shutdown"`
}

// StagingConfig bounds staged embeddings.
type StagingConfig struct {
	// CapacityBytes bounds the bytes held for all staged embeddings together
	// (default 4GiB); a stage beyond it gets 507 and nothing is kept.
	CapacityBytes configfile.ByteSize `yaml:"capacity_bytes"`
	// TTL frees a staged embedding this long after it was staged when its
	// /sends never all came (default 180s, sglang's SEND_TIMEOUT).
	TTL configfile.Duration `yaml:"ttl"`
	// MaxStageBytes bounds one staged embedding (default 1GiB); larger gets
	// 413. It must not exceed CapacityBytes.
	MaxStageBytes configfile.ByteSize `yaml:"max_stage_bytes"`
}

// TransferConfig controls writes into receivers.
type TransferConfig struct {
	// AllowNetworks lists the CIDRs a destination (the session_id's host and
	// prefill_host) must be in (default loopback and the RFC 1918 ranges);
	// every connection the initiator opens is checked again at dial time.
	AllowNetworks []string `yaml:"allow_networks"`
	// ConnectTimeout bounds one TCP connect (default 5s).
	ConnectTimeout configfile.Duration `yaml:"connect_timeout"`
	// Timeout bounds one transfer, handshake included, and one completion
	// notice (default 30s, Mooncake's MC_TRANSFER_TIMEOUT).
	Timeout configfile.Duration `yaml:"timeout"`
}

// ReceiverConfig makes the agent a Mooncake TCP receiver (for Go receivers,
// tests, the demo and benchmarks). All keys are required.
type ReceiverConfig struct {
	// HandshakeListen is the P2P handshake (RPC) port; the session_id is
	// AdvertiseHost and this port.
	HandshakeListen string `yaml:"handshake_listen"`
	// DataListen is the TCP transport's data port.
	DataListen string `yaml:"data_listen"`
	// AdvertiseHost is the host peers reach this receiver at.
	AdvertiseHost string `yaml:"advertise_host"`
	// Buffers are the registered buffers' sizes, at least one.
	Buffers []configfile.ByteSize `yaml:"buffers"`
}

// Ack modes, the values of ack.mode.
const (
	// AckRequired refuses a /send whose req_id has no staged ack frame,
	// before any byte moves.
	AckRequired = "required"
	// AckOptional transfers, then acks when a frame is staged.
	AckOptional = "optional"
	// AckOff never acks.
	AckOff = "off"
)

// AckConfig controls the completion ack: the single-frame ZMQ message (the
// encoder's pickled EmbeddingData, staged with POST /v1/ack) that an sglang
// receiver rank waits for on its PULL socket at prefill_host:embedding_port
// before it reads its buffer.
type AckConfig struct {
	// Mode is required (the default), optional or off.
	Mode string `yaml:"mode"`
	// MaxFrameBytes bounds one staged ack frame (default 1MiB); larger gets
	// 413.
	MaxFrameBytes configfile.ByteSize `yaml:"max_frame_bytes"`
	// ConnectTimeout bounds the TCP connect to the receiver's PULL socket
	// (default 5s).
	ConnectTimeout configfile.Duration `yaml:"connect_timeout"`
	// SendTimeout bounds the ZMTP handshake and the frame's write (default
	// 10s).
	SendTimeout configfile.Duration `yaml:"send_timeout"`
	// Linger bounds the wait, after the frame is written and the agent has
	// closed its side, for the receiver to close its end, which libzmq does
	// once it has read everything (default 1s; 0 closes at once). A receiver
	// that has not closed by then still counts as sent.
	Linger configfile.Duration `yaml:"linger"`
}

// NotifyConfig chooses the completion notice.
type NotifyConfig struct {
	// HTTPURL, when set, receives a POST of the Completion JSON after every
	// confirmed transfer; empty (the default) sends none.
	HTTPURL string `yaml:"http_url"`
}

// DefaultConfig returns a Config with every default set and no receiver.
func DefaultConfig() Config {
	return Config{
		Listen:      "127.0.0.1:7401",
		AdminListen: "127.0.0.1:7501",
		Staging: StagingConfig{
			CapacityBytes: 4 << 30,
			TTL:           configfile.Duration(180e9),
			MaxStageBytes: 1 << 30,
		},
		Transfer: TransferConfig{
			AllowNetworks:  []string{"127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"},
			ConnectTimeout: configfile.Duration(5e9),
			Timeout:        configfile.Duration(30e9),
		},
		Ack: AckConfig{
			Mode:           AckRequired,
			MaxFrameBytes:  1 << 20,
			ConnectTimeout: configfile.Duration(5e9),
			SendTimeout:    configfile.Duration(10e9),
			Linger:         configfile.Duration(1e9),
		},
		Log:      configfile.Log{Level: "info"},
		Shutdown: configfile.Shutdown{Grace: configfile.Duration(30e9)},
	}
}

// LoadConfig reads path over the defaults and validates the result. It
// reports every problem at once: keys that could not be decoded and values
// that are out of range, each with its field path.
func LoadConfig(path string) (Config, error) {
	cfg := DefaultConfig()
	err := configfile.Load(path, &cfg)
	var partial *configfile.DecodeError
	if err != nil && !errors.As(err, &partial) {
		return cfg, err
	}
	return cfg, errors.Join(err, cfg.Validate())
}

// maxInt is the largest size a Go slice can have here.
const maxInt = int64(^uint(0) >> 1)

// Validate reports every problem, each with its field path.
func (c Config) Validate() error {
	var p configfile.Problems
	checkAddr(&p, "listen", c.Listen)
	checkAddr(&p, "admin_listen", c.AdminListen)
	if c.Listen != "" && c.Listen == c.AdminListen && !strings.HasSuffix(c.Listen, ":0") {
		p.Addf("admin_listen", "must differ from listen (%s)", c.Listen)
	}
	c.Staging.validate(&p, "staging")
	c.Transfer.validate(&p, "transfer")
	if c.Receiver != nil {
		c.Receiver.validate(&p, "receiver")
	}
	c.Ack.validate(&p, "ack")
	if u := c.Notify.HTTPURL; u != "" {
		if pu, err := url.Parse(u); err != nil || (pu.Scheme != "http" && pu.Scheme != "https") || pu.Host == "" {
			p.Addf("notify.http_url", "must be an http(s) URL or empty, got %q", u)
		}
	}
	c.Shutdown.Validate(&p, "shutdown")
	c.Log.Validate(&p, "log")
	return p.Err()
}

func (s StagingConfig) validate(p *configfile.Problems, path string) {
	if s.CapacityBytes <= 0 {
		p.Addf(path+".capacity_bytes", "must be > 0, got %s", s.CapacityBytes)
	}
	p.Positive(path+".ttl", s.TTL)
	switch {
	case s.MaxStageBytes <= 0:
		p.Addf(path+".max_stage_bytes", "must be > 0, got %s", s.MaxStageBytes)
	case int64(s.MaxStageBytes) > maxInt:
		p.Addf(path+".max_stage_bytes", "must fit in memory, got %s", s.MaxStageBytes)
	case s.CapacityBytes > 0 && s.MaxStageBytes > s.CapacityBytes:
		p.Addf(path+".max_stage_bytes", "must be <= capacity_bytes (%s), got %s", s.CapacityBytes, s.MaxStageBytes)
	}
}

func (t TransferConfig) validate(p *configfile.Problems, path string) {
	if len(t.AllowNetworks) == 0 {
		p.Addf(path+".allow_networks", "must list at least one CIDR (0.0.0.0/0 and ::/0 allow every destination)")
	}
	for i, n := range t.AllowNetworks {
		if _, err := netip.ParsePrefix(n); err != nil {
			p.Addf(fmt.Sprintf("%s.allow_networks[%d]", path, i), "must be a CIDR such as 10.0.0.0/8, got %q", n)
		}
	}
	p.Positive(path+".connect_timeout", t.ConnectTimeout)
	p.Positive(path+".timeout", t.Timeout)
}

// maxAckFrame caps ack.max_frame_bytes: sglang's frames are a few KiB.
const maxAckFrame = 64 << 20

func (a AckConfig) validate(p *configfile.Problems, path string) {
	switch a.Mode {
	case AckRequired, AckOptional, AckOff:
	default:
		p.Addf(path+".mode", "must be required, optional or off, got %q", a.Mode)
	}
	if a.MaxFrameBytes <= 0 || a.MaxFrameBytes > maxAckFrame {
		p.Addf(path+".max_frame_bytes", "must be > 0 and <= 64MiB, got %s", a.MaxFrameBytes)
	}
	p.Positive(path+".connect_timeout", a.ConnectTimeout)
	p.Positive(path+".send_timeout", a.SendTimeout)
	if a.Linger < 0 {
		p.Addf(path+".linger", "must be >= 0, got %s", a.Linger)
	}
}

func (r *ReceiverConfig) validate(p *configfile.Problems, path string) {
	checkAddr(p, path+".handshake_listen", r.HandshakeListen)
	checkAddr(p, path+".data_listen", r.DataListen)
	if r.HandshakeListen != "" && r.HandshakeListen == r.DataListen && !strings.HasSuffix(r.DataListen, ":0") {
		p.Addf(path+".data_listen", "must differ from handshake_listen (%s)", r.HandshakeListen)
	}
	if r.AdvertiseHost == "" {
		p.Addf(path+".advertise_host", "must be set (the host in this receiver's session_id)")
	}
	if len(r.Buffers) == 0 {
		p.Addf(path+".buffers", "must list at least one buffer size")
	}
	for i, b := range r.Buffers {
		if b <= 0 || int64(b) > maxInt {
			p.Addf(fmt.Sprintf("%s.buffers[%d]", path, i), "must be > 0, got %s", b)
		}
	}
}

// allowList parses AllowNetworks (already validated).
func (t TransferConfig) allowList() []netip.Prefix {
	var out []netip.Prefix
	for _, n := range t.AllowNetworks {
		if pfx, err := netip.ParsePrefix(n); err == nil {
			out = append(out, pfx.Masked())
		}
	}
	return out
}

func checkAddr(p *configfile.Problems, path, addr string) {
	if _, _, err := net.SplitHostPort(addr); err != nil {
		p.Addf(path, "must be host:port, got %q", addr)
	}
}
