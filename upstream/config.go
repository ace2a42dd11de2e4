package upstream

import (
	"net/url"
	"strings"
	"time"

	"github.com/encgate/encgate/internal/bearer"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/urlhint"
)

// EncoderConfig names one encoder of the fleet.
type EncoderConfig struct {
	// Name labels the encoder in metrics, logs and the admin API. It is also
	// its rendezvous-hash identity: renaming an encoder moves its req_ids.
	Name string `yaml:"name"`
	// URL is the encoder's base URL, http://host:port (https also works).
	URL string `yaml:"url"`
	// Agent, when set, is the base URL of the gpuagent on the encoder's node
	// (http://host:7401): this encoder's /sends go there instead (the agent
	// holds the staged embeddings). Dedupe and refcount stay in the gateway.
	Agent string `yaml:"agent,omitempty"`
	// AgentTokenFile, with Agent, is the file holding the bearer token the
	// agent requires on /send: the gateway sends it as "Authorization:
	// Bearer <token>" on every request to the agent, never to the encoder.
	// The file is read (bearer.ReadFile: one line, mode 0600 or 0640) when
	// the config is validated and again on every reload, so rewriting it
	// and reloading applies a new token. Only the path is ever shown.
	AgentTokenFile string `yaml:"agent_token_file,omitempty"`
	// Generation is an optional override of what the gateway learns from
	// the encoder's answers (Learned): unset (the default) learns; new
	// says the encoder holds a registration for a part whose /encode
	// failed, so the gateway answers it at once from the remembered
	// failure; gen0 or gen1 (protocol reference §11, §12) say the encoder
	// takes it and pushes its error frame to the rank, so the gateway
	// forwards it. Learning serves every generation without it.
	Generation Generation `yaml:"generation,omitempty"`

	// What the gateway's fleet sets, never the file:

	// Source is where the encoder came from: SourceStatic (the config
	// file), SourceRegistered (sglang's bootstrap API) or SourceDNS.
	Source string `yaml:"-"`
	// Draining: the encoder left its source. It gets no new work (no
	// /encode is placed on it, no unpinned call is routed to it) while the
	// follow-ups of req_ids pinned to it still reach it; the fleet drops it
	// once none is pinned to it (PinTable.Count).
	Draining bool `yaml:"-"`
	// Joining: the encoder was discovered, not configured. It starts out of
	// service and joins rendezvous once it passes health.up_after probes in
	// a row, the first at once, as an encoder coming back up does. A
	// configured encoder starts in service.
	Joining bool `yaml:"-"`
}

// Encoder sources (EncoderConfig.Source).
const (
	SourceStatic     = "static"
	SourceRegistered = "registered"
	SourceDNS        = "dns"
)

// Generation is an sglang encoder generation.
type Generation string

// Generations. GenAuto (unset) learns the encoder's behaviour.
const (
	GenAuto Generation = ""
	GenNew  Generation = "new"
	Gen0    Generation = "gen0"
	Gen1    Generation = "gen1"
)

var generations = [...]Generation{GenAuto, GenNew, Gen0, Gen1}

// index is g's position in generations; an unknown one is GenAuto.
func (g Generation) index() uint32 {
	for i, x := range generations {
		if x == g {
			return uint32(i)
		}
	}
	return 0
}

func (g Generation) valid() bool { return g == GenAuto || g.index() != 0 }

// AffinityConfig controls how req_ids stay on the encoder that holds them.
type AffinityConfig struct {
	// PinTTL is how long req_id -> encoder is remembered (default 240s, longer
	// than sglang's 180s send timeout plus its 45s sweep).
	PinTTL configfile.Duration `yaml:"pin_ttl"`
	// UnknownWait is how long a follow-up waits for its /encode's pin before
	// it routes by rendezvous order (default 5s, as sglang's DP dispatcher).
	UnknownWait configfile.Duration `yaml:"unknown_wait"`
	// FailedRegistrationWait bounds how long a registration for a part
	// whose /encode the encoder failed is forwarded to it (default 1s):
	// GEN0 and GEN1 take it at once and push their own error frame to the
	// rank; NEW holds it, and past the bound the gateway answers it from
	// the remembered failure, ends the held exchange, and learns to answer
	// that encoder's at once.
	FailedRegistrationWait configfile.Duration `yaml:"failed_registration_wait"`
	// MaxPins bounds the pin table exactly (default 1,000,000); at the
	// bound an expired pin makes room, else the oldest failed, pending,
	// then encoded one, counted by state in a metric.
	MaxPins int `yaml:"max_pins"`
	// EncodeBy is what places an /encode that is not pinned yet:
	// EncodeByReqID (the default) ranks the encoders by rendezvous on the
	// req_id, which spreads parts evenly and lets a follow-up that comes
	// before its /encode find the same encoder; EncodeByContent ranks them
	// on a hash of the body's mm_items, so that media sent again (a
	// multi-turn chat re-sends its earlier images) reaches the encoder whose
	// media cache (sglang's --enable-prefix-mm-cache) already holds it,
	// under bounded load (LoadFactor). Either way the pin is set per req_id
	// and every follow-up follows it.
	EncodeBy string `yaml:"encode_by"`
	// LoadFactor bounds content placement (default 1.25): an encoder whose
	// in-flight exchanges, with this /encode, would exceed LoadFactor times
	// the fleet's mean passes it to the next in order, so that popular media
	// cannot pile onto one encoder ("consistent hashing with bounded
	// loads", as HAProxy's hash-balance-factor). Closer to 1 spreads load
	// more evenly and keeps fewer repeats on their cache.
	LoadFactor float64 `yaml:"load_factor"`
	// MetadataCache bounds the metadata pull answers kept for sharing
	// (default 65,536): every receiver TP rank of a part pulls the same
	// metadata, and a part's pulls reach its encoder once per replica.
	// While one is at the encoder the others of the same req_id, part_idx
	// and encoder wait for its answer; a 200 is kept and answers later ones
	// until the req_id's /encode is placed again. This shields a GEN1 DP
	// encoder from a sibling rank's pull answered while the part's /send
	// is in flight (protocol reference §12). 0 disables sharing entirely.
	MetadataCache int `yaml:"metadata_cache"`
}

// Placements (AffinityConfig.EncodeBy).
const (
	EncodeByReqID   = "req_id"
	EncodeByContent = "content"
)

// ClientConfig controls the gateway's connections to encoders.
type ClientConfig struct {
	// ConnectTimeout bounds a TCP connect to an encoder (default 5s).
	ConnectTimeout configfile.Duration `yaml:"connect_timeout"`
	// Timeout bounds one exchange on routes without a retry policy (the
	// profile broadcast; default 1800s, sglang's SGLANG_ENCODER_HTTP_TIMEOUT).
	// Routes with a policy use its per_try_timeout and deadline.
	Timeout configfile.Duration `yaml:"timeout"`
	// IdleConnTimeout closes pooled connections idle this long (default 4s,
	// below uvicorn's 5s keep-alive so the gateway never reuses a connection
	// the encoder is closing). Every pooled connection is also checked with a
	// non-blocking peek before it is reused.
	IdleConnTimeout configfile.Duration `yaml:"idle_conn_timeout"`
	// MaxConnsPerEncoder bounds open connections to one encoder (default 1024).
	MaxConnsPerEncoder int `yaml:"max_conns_per_encoder"`
	// MaxResponseBytes bounds an encoder's response body (default 64MiB).
	MaxResponseBytes configfile.ByteSize `yaml:"max_response_bytes"`
	// MaxDialsPerEncoder bounds connects in progress to one encoder (default
	// 32); more wait for one to finish, within connect_timeout. A connect
	// runs on a goroutine of its own whose stack grows to 8 KiB, and a burst
	// of new connections (thousands of pulls at once) would otherwise leave
	// that much per connection resident after the burst.
	MaxDialsPerEncoder int `yaml:"max_dials_per_encoder"`
}

// DefaultAffinity returns the affinity defaults.
func DefaultAffinity() AffinityConfig {
	return AffinityConfig{
		PinTTL:      configfile.Duration(240e9),
		UnknownWait: configfile.Duration(5e9),
		// GEN0 and GEN1 answer such a registration as soon as they read it.
		FailedRegistrationWait: configfile.Duration(1e9),
		MaxPins:                1_000_000,
		EncodeBy:               EncodeByReqID,
		LoadFactor:             1.25,
		MetadataCache:          65536,
	}
}

// DefaultClient returns the client defaults.
func DefaultClient() ClientConfig {
	return ClientConfig{
		ConnectTimeout:     configfile.Duration(5e9),
		Timeout:            configfile.Duration(1800e9),
		IdleConnTimeout:    configfile.Duration(4e9),
		MaxConnsPerEncoder: 1024,
		MaxResponseBytes:   64 << 20,
		MaxDialsPerEncoder: 32,
	}
}

// ValidateEncoders checks the encoder list; path is its field path.
func ValidateEncoders(p *configfile.Problems, path string, encs []EncoderConfig) {
	names := map[string]int{}
	urls := map[string]int{}
	for i, e := range encs {
		at := path + "[" + itoa(i) + "]"
		switch {
		case e.Name == "":
			p.Addf(at+".name", "must not be empty")
		case strings.ContainsAny(e.Name, " \t\n\"{}"):
			p.Addf(at+".name", "%q must not contain spaces, quotes or braces", e.Name)
		}
		if j, dup := names[e.Name]; dup && e.Name != "" {
			p.Addf(at+".name", "%q is already used by %s[%d]", e.Name, path, j)
		}
		names[e.Name] = i
		if err := checkURL(e.URL); err != "" {
			p.Addf(at+".url", "%s", err)
		} else if j, dup := urls[e.URL]; dup {
			p.Addf(at+".url", "%q is already used by %s[%d]", e.URL, path, j)
		}
		urls[e.URL] = i
		if e.Agent != "" {
			if err := checkURL(e.Agent); err != "" {
				p.Addf(at+".agent", "%s", err)
			}
		}
		if e.AgentTokenFile != "" {
			if e.Agent == "" {
				p.Addf(at+".agent_token_file", "needs agent")
			} else if _, err := bearer.ReadFile(e.AgentTokenFile); err != nil {
				p.Addf(at+".agent_token_file", "%s", err)
			}
		}
		if !e.Generation.valid() {
			p.Addf(at+".generation", "must be unset (learned from the encoder's answers), new, gen0 or gen1, got %q", string(e.Generation))
		}
	}
}

func checkURL(raw string) string {
	if raw == "" {
		return "must not be empty"
	}
	if hint := urlhint.Problem(raw); hint != "" {
		return hint
	}
	u, err := url.Parse(raw)
	if err != nil {
		return "not a URL: " + err.Error()
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return "scheme must be http or https, got " + quote(u.Scheme)
	}
	if u.Host == "" || u.Port() == "" {
		return "must be http(s)://host:port, got " + quote(raw)
	}
	if (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.User != nil {
		return "must be a base URL without path, query or credentials, got " + quote(raw)
	}
	return ""
}

// Validate checks the affinity settings.
func (c AffinityConfig) Validate(p *configfile.Problems, path string) {
	p.Positive(path+".pin_ttl", c.PinTTL)
	if c.FailedRegistrationWait <= 0 || c.FailedRegistrationWait.D() > time.Minute {
		p.Addf(path+".failed_registration_wait", "must be in (0, 1m], got %s", c.FailedRegistrationWait)
	}
	if c.UnknownWait < 0 {
		p.Addf(path+".unknown_wait", "must be >= 0, got %s", c.UnknownWait)
	}
	if c.MaxPins < 1 {
		p.Addf(path+".max_pins", "must be >= 1, got %d", c.MaxPins)
	}
	if c.MetadataCache < 0 {
		p.Addf(path+".metadata_cache", "must be >= 0 (0 disables sharing), got %d", c.MetadataCache)
	}
	if c.EncodeBy != EncodeByReqID && c.EncodeBy != EncodeByContent {
		p.Addf(path+".encode_by", "must be %s or %s, got %q", EncodeByReqID, EncodeByContent, c.EncodeBy)
	}
	// At 1.0 the bound is even spreading itself: media leaves its encoder
	// whenever that one holds a part more than its share, so repeats miss
	// their cache under any load (and below 1.0 no encoder may fit). Past 10
	// it no longer bounds anything a fleet would notice.
	if !(c.LoadFactor > 1 && c.LoadFactor <= 10) {
		p.Addf(path+".load_factor", "must be > 1.0 and <= 10, got %g", c.LoadFactor)
	}
}

// Validate checks the client settings.
func (c ClientConfig) Validate(p *configfile.Problems, path string) {
	p.Positive(path+".connect_timeout", c.ConnectTimeout)
	p.Positive(path+".timeout", c.Timeout)
	p.Positive(path+".idle_conn_timeout", c.IdleConnTimeout)
	if c.MaxConnsPerEncoder < 1 {
		p.Addf(path+".max_conns_per_encoder", "must be >= 1, got %d", c.MaxConnsPerEncoder)
	}
	if c.MaxDialsPerEncoder < 1 {
		p.Addf(path+".max_dials_per_encoder", "must be >= 1, got %d", c.MaxDialsPerEncoder)
	}
	if c.MaxResponseBytes < 1024 {
		p.Addf(path+".max_response_bytes", "must be >= 1KiB, got %s", c.MaxResponseBytes)
	}
}
