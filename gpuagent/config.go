// Package gpuagent is encgate's per-node agent: it holds the embeddings the
// node's encoder stages over a Unix socket (raw bytes, or a memfd or
// /dev/shm file whose descriptor it passes, mapped read-only), and performs
// sglang's /send for them, over TCP with a bearer token, writing the bytes
// into the receiver's registered buffer over Mooncake's TCP transport with the
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
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/encgate/encgate/internal/bearer"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/urlhint"
)

// Config is the agent's YAML file. DefaultConfig holds every default.
type Config struct {
	// Listen is the TCP door: the gateway's POST /send and GET /v1/receiver,
	// each with control's bearer token (default 127.0.0.1:7401). Staging is
	// never accepted here.
	Listen string `yaml:"listen"`
	// AdminListen serves /metrics, /healthz, /readyz, /admin/staged and
	// /debug/pprof (default 127.0.0.1:7501). It must differ from Listen.
	AdminListen string `yaml:"admin_listen"`
	// Control chooses who may drive the agent: the node's encoder over a
	// Unix socket, the gateway over TCP with a bearer token.
	Control ControlConfig `yaml:"control"`
	// Admin protects the admin listener.
	Admin AdminConfig `yaml:"admin"`
	// Staging bounds what the encoder may stage.
	Staging StagingConfig `yaml:"staging"`
	// Transfer controls the Mooncake TCP initiator.
	Transfer TransferConfig `yaml:"transfer"`
	// CUDA lets the encoder stage by CUDA IPC handle (source=cuda): the
	// agent copies the embedding into device memory of its own and, at
	// /send, out of it through pinned host buffers while it is sent.
	CUDA CUDAConfig `yaml:"cuda"`
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
	// MaxStageBytes bounds one staged embedding; larger gets 413. 0 (the
	// default) means min(1GiB, CapacityBytes); a value set must not exceed
	// CapacityBytes.
	MaxStageBytes configfile.ByteSize `yaml:"max_stage_bytes"`
	// MaxConcurrent bounds the stages in progress at once (bytes still
	// arriving; default 64); one more gets 503 with Retry-After.
	MaxConcurrent int `yaml:"max_concurrent"`
}

// defaultMaxStage is staging.max_stage_bytes when capacity allows it.
const defaultMaxStage = 1 << 30

// MaxStage is the bound on one staged embedding that the agent applies:
// max_stage_bytes, or when that is 0, min(1GiB, capacity_bytes).
func (s StagingConfig) MaxStage() configfile.ByteSize {
	if s.MaxStageBytes > 0 {
		return s.MaxStageBytes
	}
	return min(defaultMaxStage, s.CapacityBytes)
}

// ControlConfig is the agent's two doors. The node's encoder stages
// embeddings and ack frames over Socket, where the file's permissions are
// the authentication, as for a container runtime's socket; staging is
// refused over TCP. The gateway's /send comes over Listen (TCP) with
// "Authorization: Bearer <token>"; with no token configured the TCP door
// refuses every request (401) unless Insecure is written.
type ControlConfig struct {
	// Socket is the Unix socket the node's encoder stages over (default
	// /run/encgate/agent.sock; its directory is created when missing). A
	// stale socket left by a dead agent is replaced; a live one, or a file
	// that is not a socket, is an error at start.
	Socket string `yaml:"socket"`
	// SocketMode is the socket file's permission bits in octal (default
	// "0660"). Bits for others are refused unless Insecure: anyone on the
	// node could stage.
	SocketMode string `yaml:"socket_mode"`
	// SocketGroup, when set, is the group (name or numeric gid) that owns
	// the socket, so an encoder running as another user in that group can
	// connect (default empty: the agent's own group).
	SocketGroup string `yaml:"socket_group"`
	// Token is the bearer token /send and /v1/receiver need over TCP; prefer
	// TokenFile. At least 16 characters of RFC 6750's alphabet.
	Token string `yaml:"token"`
	// TokenFile holds the token instead (mode 0600 or 0640; one line). Set
	// at most one of Token and TokenFile.
	TokenFile string `yaml:"token_file"`
	// Insecure, when true, lets TCP requests through without a token and
	// permits socket modes open to others (for a laptop or the demo); the
	// agent logs a warning at start. It cannot be combined with a token.
	Insecure bool `yaml:"insecure"`
	// ReadHeaderTimeout bounds the wait for a request's headers on either
	// door (default 10s).
	ReadHeaderTimeout configfile.Duration `yaml:"read_header_timeout"`
	// BodyTimeout bounds the wait for the next bytes of a request body
	// (default 10s): a stage whose body stalls this long gets 408 and its
	// reservation is released, as when its connection closes.
	BodyTimeout configfile.Duration `yaml:"body_timeout"`
}

// AdminConfig protects the admin listener, as the gateway's admin.token
// does.
type AdminConfig struct {
	// Token, when set, is required as "Authorization: Bearer <token>" on
	// /admin/... and /debug/pprof/...; /healthz, /readyz and /metrics stay
	// open. Default empty: no token.
	Token string `yaml:"token"`
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
	// ChunkBytes is the unit a transfer is sent in (default 4MiB, at most
	// 256MiB): each chunk is readied (for a device stage, copied into a
	// pinned host buffer) while the one before it is written.
	ChunkBytes configfile.ByteSize `yaml:"chunk_bytes"`
	// Buffers is how many chunks a transfer keeps in flight (default 3:
	// triple-buffered; 2 to 16). A device transfer holds Buffers pinned
	// buffers of ChunkBytes each.
	Buffers int `yaml:"buffers"`
}

// CUDA modes, the values of cuda.mode.
const (
	// CUDAAuto loads the driver at start when it is there; without it (or a
	// device) stage-by-handle is refused, naming why, and all else works.
	CUDAAuto = "auto"
	// CUDAOff never loads the driver; stage-by-handle is refused.
	CUDAOff = "off"
	// CUDARequired refuses to start without a usable driver and device.
	CUDARequired = "required"
)

// CUDAConfig controls stage-by-handle.
type CUDAConfig struct {
	// Mode is auto (the default), off or required.
	Mode string `yaml:"mode"`
	// Library is the CUDA driver library to load (default libcuda.so.1,
	// found the way dlopen finds it).
	Library string `yaml:"library"`
	// CapacityBytes bounds the device memory held for staged embeddings on
	// each device (default 4GiB); a stage beyond it gets 507.
	CapacityBytes configfile.ByteSize `yaml:"capacity_bytes"`
	// Lanes bounds the device transfers in flight at once per device
	// (default 4; 1 to 64); each lane holds transfer.buffers pinned host
	// buffers of transfer.chunk_bytes, allocated at its first use and kept.
	// A transfer beyond them waits for one.
	Lanes int `yaml:"lanes"`
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
		Control: ControlConfig{
			Socket:            "/run/encgate/agent.sock",
			SocketMode:        "0660",
			ReadHeaderTimeout: configfile.Duration(10e9),
			BodyTimeout:       configfile.Duration(10e9),
		},
		Staging: StagingConfig{
			CapacityBytes: 4 << 30,
			TTL:           configfile.Duration(180e9),
			MaxConcurrent: 64,
		},
		Transfer: TransferConfig{
			AllowNetworks:  []string{"127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"},
			ConnectTimeout: configfile.Duration(5e9),
			Timeout:        configfile.Duration(30e9),
			ChunkBytes:     4 << 20,
			Buffers:        3,
		},
		CUDA: CUDAConfig{Mode: CUDAAuto, CapacityBytes: 4 << 30, Lanes: 4},
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
	c.Control.validate(&p, "control")
	bearer.Check(&p, "admin.token", c.Admin.Token)
	c.Staging.validate(&p, "staging")
	c.Transfer.validate(&p, "transfer")
	c.CUDA.validate(&p, "cuda")
	if c.Receiver != nil {
		c.Receiver.validate(&p, "receiver")
	}
	c.Ack.validate(&p, "ack")
	if u := c.Notify.HTTPURL; u != "" {
		if hint := urlhint.Problem(u); hint != "" {
			p.Addf("notify.http_url", "%s", hint)
		} else if pu, err := url.Parse(u); err != nil || (pu.Scheme != "http" && pu.Scheme != "https") || pu.Host == "" {
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
	if s.MaxConcurrent < 1 || s.MaxConcurrent > maxConcurrentStages {
		p.Addf(path+".max_concurrent", "must be between 1 and %d, got %d", maxConcurrentStages, s.MaxConcurrent)
	}
	switch {
	case s.MaxStageBytes < 0:
		p.Addf(path+".max_stage_bytes", "must be >= 0 (0: min(1GiB, capacity_bytes)), got %s", s.MaxStageBytes)
	case int64(s.MaxStageBytes) > maxInt:
		p.Addf(path+".max_stage_bytes", "must fit in memory, got %s", s.MaxStageBytes)
	case s.CapacityBytes > 0 && s.MaxStageBytes > s.CapacityBytes:
		p.Addf(path+".max_stage_bytes", "must be <= capacity_bytes (%s), got %s", s.CapacityBytes, s.MaxStageBytes)
	}
}

// maxConcurrentStages caps staging.max_concurrent.
const maxConcurrentStages = 4096

func (c ControlConfig) validate(p *configfile.Problems, path string) {
	if c.Socket == "" {
		p.Addf(path+".socket", "must be set (the Unix socket the node's encoder stages over)")
	} else if !filepath.IsAbs(c.Socket) {
		p.Addf(path+".socket", "must be an absolute path, got %q", c.Socket)
	} else if len(c.Socket) > maxSocketPath {
		p.Addf(path+".socket", "must be at most %d bytes (a Unix socket address), got %d", maxSocketPath, len(c.Socket))
	}
	if mode, err := c.socketMode(); err != nil {
		p.Addf(path+".socket_mode", "must be octal permission bits such as \"0660\", got %q", c.SocketMode)
	} else if mode&0o007 != 0 && !c.Insecure {
		p.Addf(path+".socket_mode", "%q lets every user on the node stage; use 0660 with socket_group (or control.insecure: true)", c.SocketMode)
	} else if mode&0o600 != 0o600 {
		p.Addf(path+".socket_mode", "%q must give the agent's own user read and write (0600 at least)", c.SocketMode)
	}
	switch {
	case c.Token != "" && c.TokenFile != "":
		p.Addf(path+".token_file", "set at most one of token and token_file")
	case c.Token != "":
		bearer.Check(p, path+".token", c.Token)
	case c.TokenFile != "":
		if _, err := bearer.ReadFile(c.TokenFile); err != nil {
			p.Addf(path+".token_file", "%v", err)
		}
	}
	if c.Insecure && (c.Token != "" || c.TokenFile != "") {
		p.Addf(path+".insecure", "cannot be true with a token: the token would not be required")
	}
	p.Positive(path+".read_header_timeout", c.ReadHeaderTimeout)
	p.Positive(path+".body_timeout", c.BodyTimeout)
}

// maxSocketPath is the longest Unix socket path Linux accepts (sun_path is
// 108 bytes with its terminating NUL).
const maxSocketPath = 107

// socketMode parses SocketMode.
func (c ControlConfig) socketMode() (os.FileMode, error) {
	m, err := strconv.ParseUint(c.SocketMode, 8, 32)
	if err != nil || m > 0o777 || c.SocketMode == "" {
		return 0, fmt.Errorf("bad mode")
	}
	return os.FileMode(m), nil
}

// token is the bearer token TCP requests need, "" when none is configured.
func (c ControlConfig) token() (string, error) {
	if c.TokenFile != "" {
		return bearer.ReadFile(c.TokenFile)
	}
	return c.Token, nil
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
	if t.ChunkBytes < 4<<10 || t.ChunkBytes > maxChunk {
		p.Addf(path+".chunk_bytes", "must be between 4KiB and 256MiB, got %s", t.ChunkBytes)
	}
	if t.Buffers < 2 || t.Buffers > maxBuffers {
		p.Addf(path+".buffers", "must be between 2 and %d, got %d", maxBuffers, t.Buffers)
	}
}

// Bounds of transfer.chunk_bytes, transfer.buffers and cuda.lanes.
const (
	maxChunk   = 256 << 20
	maxBuffers = 16
	maxLanes   = 64
)

func (c CUDAConfig) validate(p *configfile.Problems, path string) {
	switch c.Mode {
	case CUDAAuto, CUDAOff, CUDARequired:
	default:
		p.Addf(path+".mode", "must be auto, off or required, got %q", c.Mode)
	}
	if c.CapacityBytes <= 0 || int64(c.CapacityBytes) > maxInt {
		p.Addf(path+".capacity_bytes", "must be > 0, got %s", c.CapacityBytes)
	}
	if c.Lanes < 1 || c.Lanes > maxLanes {
		p.Addf(path+".lanes", "must be between 1 and %d, got %d", maxLanes, c.Lanes)
	}
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
