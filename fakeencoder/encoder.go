// Package fakeencoder is a faithful fake of an sglang multimodal encoder
// (--encoder-only) HTTP server, for tests, the demo and benchmarks.
//
// It serves /encode, /send, /scheduler_receive_meta_data,
// /scheduler_receive_url, /health, /health_generate, /start_profile and
// /stop_profile with the status codes, messages and blocking behaviour of
// sglang's NEW encoder (sgl-project/sglang@1901ddec), keeps the per-req_id
// state machine (request state, metadata registry, destination refcount,
// sweep), and adds fault injection plus control routes that faults never
// touch: GET /_fake/stats, POST /_fake/reset and GET/PUT /_fake/faults. No
// embedding data moves by default: there is no GPU, ZMQ or Mooncake
// traffic.
//
// Options.Generation = Gen0 imitates GEN0 instead, the older flat
// disaggregation/encode_server.py generation still in the field (protocol
// reference §11): there is no /scheduler_receive_meta_data (404); in
// mooncake mode every receiver TP rank posts /encode with the same req_id
// and the encoder dedupes them (the first call encodes, the others wait for
// it and get its sizes, or 500 "Encode failed on the first request" when it
// failed; a success is kept for later callers until the request is released
// or swept, a failure is dropped so a later call encodes anew); /encode
// validates nothing (a missing req_id is starlette's 500 text, other missing
// keys and a bad modality a 500 envelope with Python's error text);
// /send answers every error, an unknown req_id and a missing field
// included, with starlette's 500 text and counts raw calls against
// receive_count (Gen0 implies RefcountCalls); /scheduler_receive_url stores
// a registration that comes before its /encode (no wait) and answers a
// changed receive_count with 500 text (a failed assert).
//
// Options.Generation = Gen1 imitates GEN1 (protocol reference §12), and with
// Options.DPSize > 1 its DP mode (gen1dp.go): a req_id → rank mapping set
// by /encode, 404 "Unknown req_id" for follow-ups with none after
// DPMappingWait, plain-text DP /send errors, and, with DPMappingRace, the
// dispatcher bug that drops the mapping when a metadata pull completes while
// a /send of the same req_id is in flight.
//
// Options.PushFrames makes zmq mode push ZMQ messages as sglang's
// send_with_url and send do: to each URL registered for the part (or to
// prefill_host:embedding_port), a two-frame message on success and a
// one-frame error message when the encode failed (GEN0 pushes no error frame
// to a single integer embedding_port: its zmq_to_tokenizer path does not).
// With no embedding_port, GEN0 and NEW alike answer a failed /encode at once
// and keep pushing its error frame in the background to each URL as it is
// registered, until receive_count URLs got it or SendTimeout passes. Frame 0
// is not sglang's pickled EmbeddingData but a JSON stand-in
// {"req_id","num_parts","part_idx","error_msg","error_code"}; frame 1 is
// embedding_size zero bytes. Stats counts registrations as they arrive and
// every push per req_id and URL.
//
// Test hooks in the request body: when the first mm_item is the string
// "fail:<status>:<message>", the encode fails during preprocessing (before
// metadata is published) with that status and message;
// "fail-encode:<status>:<message>" fails it after the metadata was published
// (a model-forward failure).
package fakeencoder

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Mode selects the encoder transfer backend the fake imitates.
type Mode string

const (
	// ModeMooncake imitates --encoder-transfer-backend mooncake: /encode
	// answers the echoed request with embedding sizes and the embedding stays
	// staged until /send calls release it.
	ModeMooncake Mode = "mooncake"
	// ModeZMQ imitates the zmq backends: /encode answers null, after waiting
	// for /scheduler_receive_url registrations when embedding_port is null.
	ModeZMQ Mode = "zmq"
)

// String returns the mode name; it makes *Mode a flag.Value.
func (m *Mode) String() string { return string(*m) }

// Set parses a mode name ("mooncake" or "zmq"); it makes *Mode a flag.Value.
func (m *Mode) Set(s string) error {
	switch Mode(strings.ToLower(s)) {
	case ModeMooncake:
		*m = ModeMooncake
	case ModeZMQ:
		*m = ModeZMQ
	default:
		return fmt.Errorf("fakeencoder: unknown mode %q (want mooncake or zmq)", s)
	}
	return nil
}

// Generation selects the generation of sglang's encoder server the fake
// imitates (protocol reference §11).
type Generation int

const (
	// GenNew is the NEW encoder (disaggregation/encoder/…, protocol
	// reference §1–§10): the default.
	GenNew Generation = iota
	// Gen0 is GEN0, the flat disaggregation/encode_server.py generation
	// still in the field (protocol reference §11): no
	// /scheduler_receive_meta_data, every receiver TP rank posts /encode
	// itself in mooncake mode and the encoder dedupes those calls by req_id,
	// no /encode validation, KeyErrors and failed asserts answered as
	// starlette's 500 text, registrations stored before their /encode, and
	// /send refcounted by raw calls (Gen0 implies RefcountCalls).
	Gen0
	// Gen1 is GEN1, the encoder/ layout as first released (protocol
	// reference §12): NEW's routes with partial /encode validation
	// (validateGen1), non-DP /send exceptions answered as starlette's 500
	// text, and /send refcounted by raw calls (Gen1 implies RefcountCalls).
	// With Options.DPSize > 1 it imitates GEN1's DP mode (gen1dp.go).
	Gen1
)

// String returns the generation name ("new" or "gen0"); with Set it makes
// *Generation a flag.Value.
func (g Generation) String() string {
	switch g {
	case Gen0:
		return "gen0"
	case Gen1:
		return "gen1"
	}
	return "new"
}

// Set parses a generation name ("new" or "gen0"); it makes *Generation a
// flag.Value.
func (g *Generation) Set(s string) error {
	switch strings.ToLower(s) {
	case "new":
		*g = GenNew
	case "gen0":
		*g = Gen0
	case "gen1":
		*g = Gen1
	default:
		return fmt.Errorf("fakeencoder: unknown generation %q (want new, gen0 or gen1)", s)
	}
	return nil
}

// Default values for zero Options fields.
const (
	DefaultName          = "fake"
	DefaultTimeout       = 180 * time.Second // sglang REQ_TIMEOUT / SEND_TIMEOUT
	DefaultTokensPerItem = 256
	DefaultDim           = 1024
	DefaultElementSize   = 2 // bf16
	DefaultFailStatus    = http.StatusInternalServerError
	DefaultFailMessage   = "Internal encoding error: injected fault"

	// sglang's self-registration numbers (--encoder-register-urls,
	// protocol reference §1.7).
	DefaultRegistrationInterval  = 5 * time.Second
	DefaultRegistrationAttempts  = 30
	DefaultRegistrationTimeout   = 5 * time.Second
	DefaultUnregistrationTimeout = 2 * time.Second
)

// Options configures an Encoder. Zero fields take the documented defaults.
type Options struct {
	// Name is shown in stats. Default "fake".
	Name string
	// Mode is the transfer backend imitated. Default ModeMooncake.
	Mode Mode
	// Generation is the sglang encoder generation imitated. Default GenNew.
	// Gen0 implies RefcountCalls.
	Generation Generation
	// PushFrames makes the fake push ZMQ messages in zmq mode, as sglang's
	// send_with_url and send do: to every URL registered for the part through
	// /scheduler_receive_url, or to prefill_host:embedding_port when
	// /encode names a port. A success is a two-frame message (frame 0 the
	// metadata, frame 1 embedding_size bytes of zeros), a failed encode a
	// one-frame error message. Frame 0 is NOT sglang's pickled EmbeddingData
	// (the fake cannot build torch pickles) but a small JSON object
	// {"req_id","num_parts","part_idx","error_msg","error_code"}. Each push
	// dials its own connection (connect within 2s, the whole push within
	// min(SendTimeout, 5s)), so an unreachable URL never holds a handler
	// long. Off by default: the fake then pushes nothing.
	PushFrames bool
	// EncodeLatency is the simulated encode time after metadata publish.
	// Default 0.
	EncodeLatency time.Duration
	// MetadataTimeout bounds a /scheduler_receive_meta_data wait (sglang
	// SGLANG_ENCODER_REQ_TIMEOUT). Default 180s.
	MetadataTimeout time.Duration
	// RegisterTimeout bounds the /scheduler_receive_url wait for /encode to
	// start. Default 180s.
	RegisterTimeout time.Duration
	// HoldFailedRegistrations: a /scheduler_receive_url for a part whose
	// zmq /encode failed is held RegisterTimeout and then answered 504
	// "Timed out waiting for encoder request to start", pushing nothing to
	// it, as issue 27 saw NEW-layout encoders do; otherwise it is taken and
	// the error frame pushed to it, as GEN0 and GEN1 do (§11, §12).
	HoldFailedRegistrations bool
	// SendTimeout bounds a zmq /encode wait for receive_count registrations
	// (sglang SGLANG_ENCODER_SEND_TIMEOUT). Default 180s.
	SendTimeout time.Duration
	// SweepAfter drops staged state this long after its last metadata
	// publish. Default 180s.
	SweepAfter time.Duration
	// RefcountCalls selects OLD sglang refcounting: count raw /send calls
	// instead of distinct prefill_host:embedding_port destinations.
	RefcountCalls bool
	// TokensPerItem is embedding_len per mm_item. Default 256.
	TokensPerItem int
	// Dim is embedding_dim. Default 1024.
	Dim int
	// ElementSize is bytes per element. Default 2 (bf16).
	ElementSize int
	// Rand supplies randomness for Faults.FailureRate, values in [0,1). It is
	// only called with the encoder's lock held. Default: a math/rand source
	// seeded with 1.
	Rand func() float64
	// EncodeHook, when set, is called by /encode after the preprocess
	// metadata is published and before the simulated encode (EncodeLatency).
	// Tests block in it to hold an encode in flight; it must return once ctx
	// is done (the client went away or the encoder was closed).
	EncodeHook func(ctx context.Context, reqID string)
	// Stage, when set, is called in mooncake mode once the encode succeeded
	// and before /encode answers, as sglang's encoder stages its embedding:
	// the demo hands the embedding to the node's gpuagent here. Metadata is
	// then published only after staging (not at preprocessing time), so no
	// rank's /send can reach the agent before the embedding does. An error
	// fails the /encode with 500 "Internal encoding error: staging: ...".
	Stage func(ctx context.Context, reqID string, tokens, dim, elementSize int) error
	// EchoSend makes a successful /send answer
	// {"req_id":R,"destination":"host:port"} instead of sglang's null, so a
	// test can tell whose answer a caller got (a gateway that passes bodies
	// through and replays them must hand each caller its own). Off by
	// default: the fake then answers exactly as sglang does.
	EchoSend bool
	// RegisterURLs are bootstrap base URLs (an EncoderBootstrapServer,
	// "http://lang:8997") to self-register with after Start, as sglang's
	// --encoder-register-urls: see Register and Unregister. Empty (the
	// default) registers nowhere.
	RegisterURLs []string
	// AdvertiseURL is the URL registered with the bootstrap servers. Default
	// the fake's own URL (URL()), which is what a gateway-less fleet wants;
	// set it to register a URL in front of the fake instead.
	AdvertiseURL string
	// RegistrationInterval is the wait between registration attempts.
	// Default 5s, as sglang.
	RegistrationInterval time.Duration
	// RegistrationAttempts bounds the registration attempts per bootstrap
	// URL; after that the loop gives up. Default 30, as sglang.
	RegistrationAttempts int
	// RegistrationTimeout bounds one registration call. Default 5s, as
	// sglang. (RegisterTimeout is the /scheduler_receive_url wait.)
	RegistrationTimeout time.Duration
	// UnregistrationTimeout bounds one unregistration call. Default 2s, as
	// sglang.
	UnregistrationTimeout time.Duration
	// CacheItems turns on a media cache of up to CacheItems entries, as
	// sglang's --enable-prefix-mm-cache: an /encode whose mm_items value has
	// the same raw bytes as a recent successful one skips EncodeLatency
	// (counted in Stats.CacheHits and CacheMisses). 0, the default, is off.
	CacheItems int
	// DPSize is GEN1's --dp-size: > 1 imitates GEN1's DP mode (protocol
	// reference §2, §3, §12; see gen1dp.go), only with Generation Gen1.
	// Default 1 (0 reads as 1): no DP.
	DPSize int
	// DPMappingWait bounds a DP metadata pull's or registration's wait for
	// its req_id → rank mapping (with MetadataTimeout, whichever is
	// shorter), then 404 "Unknown req_id". Default 5s, as sglang.
	DPMappingWait time.Duration
	// DPMappingRace imitates GEN1's DP dispatcher bug (§12): a metadata pull
	// that completes while a /send of the same req_id is in flight drops the
	// mapping and discards that /send's result (it answers 504 once
	// MetadataTimeout, sglang's REQ_TIMEOUT, passed since its dispatch). Needs
	// DPSize > 1. Off by default.
	DPMappingRace bool
	// SendHook, when set, is called by a DP /send (DPSize > 1) once it is
	// dispatched (in flight at the encoder) and before the send itself.
	// Tests block in it to hold a /send in flight; it must return once ctx
	// is done.
	SendHook func(ctx context.Context, reqID, destination string)
	// Faults are the initial faults; change them with SetFaults.
	Faults Faults
}

// Faults are injected failures. The zero value injects nothing.
type Faults struct {
	// Latency is added to every request before handling.
	Latency time.Duration
	// MetadataDelay delays the /encode metadata publish (preprocessing).
	MetadataDelay time.Duration
	// Leading504s makes the first N /scheduler_receive_meta_data calls per
	// req_id answer at once 504 "encode metadata not ready".
	Leading504s int
	// FailureRate is the probability in [0,1] that a request on FailRoutes
	// answers FailStatus with the FailMessage error envelope.
	FailureRate float64
	// FailStatus is the injected failure status. Default 500.
	FailStatus int
	// FailMessage is the injected failure message. Default
	// "Internal encoding error: injected fault".
	FailMessage string
	// FailRoutes are the paths FailureRate applies to. Empty means /encode,
	// /send, /scheduler_receive_meta_data and /scheduler_receive_url.
	FailRoutes []string
	// Hang accepts and reads requests but never answers them (until the
	// client goes away or Close).
	Hang bool
	// Refuse closes the listener so connects are refused (idle keep-alive
	// connections are closed too); turning it off listens again on the same
	// address.
	Refuse bool
	// HealthFail makes /health and /health_generate answer 503.
	HealthFail bool
	// HealthHang makes /health and /health_generate never answer.
	HealthHang bool
	// HealthFlap makes /health and /health_generate flap: HealthFlap
	// answers 200, then HealthFlap answers 503, and so on, counted from the
	// last SetFaults. 0 turns it off.
	HealthFlap int
	// CrashAt crashes the encoder (see Crash) once the CrashAt-th request on
	// CrashRoutes, counted from the last SetFaults, has been read and
	// before it is handled: that request and every other one in flight get
	// a reset connection and no answer. It fires once (CrashAt goes back to
	// 0); the encoder stays down until Restart. 0 never crashes.
	CrashAt int
	// CrashRoutes are the paths CrashAt counts. Empty means /encode, /send,
	// /scheduler_receive_meta_data and /scheduler_receive_url.
	CrashRoutes []string
	// Truncate handles each request on TruncateRoutes normally (the encoder
	// does the work), then sends an answer whose Content-Length is larger
	// than the bytes that follow (half the body) and closes the connection,
	// as a process dying mid-write does.
	Truncate bool
	// TruncateRoutes are the paths Truncate applies to. Empty means /encode,
	// /send, /scheduler_receive_meta_data and /scheduler_receive_url.
	TruncateRoutes []string
}

// clone returns f with its slices copied.
func (f Faults) clone() Faults {
	f.FailRoutes = append([]string(nil), f.FailRoutes...)
	f.CrashRoutes = append([]string(nil), f.CrashRoutes...)
	f.TruncateRoutes = append([]string(nil), f.TruncateRoutes...)
	return f
}

// Encoder is a fake sglang encoder. It is safe for concurrent use.
type Encoder struct {
	opts    Options
	handler http.Handler
	reg     registrar   // self-registration (register.go)
	cache   *mediaCache // nil unless Options.CacheItems > 0

	done   chan struct{} // closed by Close
	cancel context.CancelFunc
	ctx    context.Context // canceled by Close; parent of background work

	mu       sync.Mutex // protects everything below, up to lnMu
	closed   bool
	faults   Faults
	states   map[string]*reqState            // sglang req_states
	meta     map[string]*metaEntry           // sglang EncoderMetaRegistry
	sendDone map[string]*sendCount           // registry _rid_to_send_done
	recv     map[string]*recvReg             // rid_to_receive_endpoint/count
	lead504  map[string]*lead504             // Faults.Leading504s counters
	dedupe   map[string]*inflight            // Gen0 mooncake /encode dedupe by req_id
	dpRank   map[string]int                  // GEN1 DP: req_id -> rank
	dpAt     map[string]time.Time            // GEN1 DP: when the mapping was set
	dpNext   int                             // GEN1 DP: next rank, round robin
	dpSends  map[string]map[*dpSend]struct{} // GEN1 DP: /send in flight per req_id
	watches  map[string]*watch               // per-req_id wake-up channels
	waiting  map[string]int                  // route -> handlers blocked now
	stats    statsData                       // counters behind Stats
	profile  profileState                    // /start_profile, /stop_profile
	sweeping bool                            // sweeper goroutine started
	crashN   int                             // requests counted towards Faults.CrashAt
	healthN  int                             // health answers counted for Faults.HealthFlap
	inflight sync.WaitGroup                  // handlers running; Add only under mu (never while down or closed)
	bg       sync.WaitGroup                  // sweeper, servers, background sends

	down   atomic.Bool // crashed and not yet restarted; set under mu
	connMu sync.Mutex  // protects conns
	conns  map[net.Conn]struct{}

	lnMu     sync.Mutex // serialises listener changes; protects below
	srv      *http.Server
	ln       net.Listener
	bindHost string // host part of the Start address
	addr     string // "127.0.0.1:PORT"
}

// New returns an Encoder with opts' zero fields set to their defaults. It
// starts no goroutine; call Start to serve, or mount Handler.
func New(opts Options) *Encoder {
	opts.setDefaults()
	opts.setRegistrationDefaults()
	if opts.Generation == Gen0 || opts.Generation == Gen1 {
		opts.RefcountCalls = true // GEN0 and GEN1 (§12) count raw /send calls
	}
	if opts.Rand == nil {
		opts.Rand = rand.New(rand.NewSource(1)).Float64
	}
	opts.RegisterURLs = append([]string(nil), opts.RegisterURLs...)
	ctx, cancel := context.WithCancel(context.Background())
	e := &Encoder{
		opts:     opts,
		done:     make(chan struct{}),
		ctx:      ctx,
		cancel:   cancel,
		faults:   opts.Faults,
		states:   map[string]*reqState{},
		meta:     map[string]*metaEntry{},
		sendDone: map[string]*sendCount{},
		recv:     map[string]*recvReg{},
		lead504:  map[string]*lead504{},
		dedupe:   map[string]*inflight{},
		dpRank:   map[string]int{},
		dpAt:     map[string]time.Time{},
		dpSends:  map[string]map[*dpSend]struct{}{},
		watches:  map[string]*watch{},
		waiting:  map[string]int{},
		stats:    newStatsData(),
		conns:    map[net.Conn]struct{}{},
		reg:      registrar{client: newRegistrationClient()},
		cache:    newMediaCache(opts.CacheItems),
	}
	e.handler = http.HandlerFunc(e.serveHTTP)
	return e
}

// setDefaults fills zero fields (except Rand) with their defaults.
func (o *Options) setDefaults() {
	if o.Name == "" {
		o.Name = DefaultName
	}
	if o.Mode == "" {
		o.Mode = ModeMooncake
	}
	for _, d := range []*time.Duration{&o.MetadataTimeout, &o.RegisterTimeout, &o.SendTimeout, &o.SweepAfter} {
		if *d <= 0 {
			*d = DefaultTimeout
		}
	}
	if o.DPSize == 0 {
		o.DPSize = 1
	}
	if o.DPMappingWait <= 0 {
		o.DPMappingWait = DefaultDPMappingWait
	}
	if o.TokensPerItem <= 0 {
		o.TokensPerItem = DefaultTokensPerItem
	}
	if o.Dim <= 0 {
		o.Dim = DefaultDim
	}
	if o.ElementSize <= 0 {
		o.ElementSize = DefaultElementSize
	}
}

// setRegistrationDefaults fills the zero registration fields. New applies
// it, BindFlags does not: their flags take 0 for sglang's numbers, so that
// flag-bound Options stay zero where no flag was given.
func (o *Options) setRegistrationDefaults() {
	if o.RegistrationInterval <= 0 {
		o.RegistrationInterval = DefaultRegistrationInterval
	}
	if o.RegistrationAttempts <= 0 {
		o.RegistrationAttempts = DefaultRegistrationAttempts
	}
	if o.RegistrationTimeout <= 0 {
		o.RegistrationTimeout = DefaultRegistrationTimeout
	}
	if o.UnregistrationTimeout <= 0 {
		o.UnregistrationTimeout = DefaultUnregistrationTimeout
	}
}

// Handler returns the encoder's HTTP handler, for mounting without Start.
func (e *Encoder) Handler() http.Handler { return e.handler }

// Start listens on addr (":0" and "127.0.0.1:0" pick a free port) and serves
// in a goroutine. With Faults.Refuse set it binds, records the address and
// closes the listener at once. Then, with Options.RegisterURLs, it starts
// registering with them (Register), as sglang does once uvicorn is up.
func (e *Encoder) Start(addr string) error {
	if err := e.listen(addr); err != nil {
		return err
	}
	return e.Register()
}

// listen is Start less the registration.
func (e *Encoder) listen(addr string) error {
	e.lnMu.Lock()
	defer e.lnMu.Unlock()
	if e.srv != nil {
		return errors.New("fakeencoder: already started")
	}
	if err := e.opts.Validate(); err != nil {
		return err
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("fakeencoder: bad address %q: %w", addr, err)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("fakeencoder: listen: %w", err)
	}
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	e.bindHost = host
	e.addr = net.JoinHostPort(dialHost(host), port)
	e.srv = &http.Server{Handler: e.handler, ReadHeaderTimeout: 30 * time.Second, ConnState: e.connState}
	if e.Faults().Refuse {
		e.srv.SetKeepAlivesEnabled(false)
		return ln.Close()
	}
	return e.serveLocked(ln)
}

// dialHost maps an unspecified listen host to the loopback address.
func dialHost(host string) string {
	if host == "" || host == "0.0.0.0" || host == "::" {
		return "127.0.0.1"
	}
	return host
}

// serveLocked serves ln in a background goroutine. lnMu must be held.
func (e *Encoder) serveLocked(ln net.Listener) error {
	srv := e.srv
	if !e.goBackground(func() { _ = srv.Serve(ln) }) {
		_ = ln.Close()
		return errors.New("fakeencoder: closed")
	}
	e.ln = ln
	return nil
}

// goBackground runs f in a goroutine tracked for Close; false once closed.
func (e *Encoder) goBackground(f func()) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return false
	}
	e.bg.Add(1)
	go func() {
		defer e.bg.Done()
		f()
	}()
	return true
}

// Addr returns the bound address as "127.0.0.1:PORT" (the listen host when it
// was a specific one), or "" before Start.
func (e *Encoder) Addr() string {
	e.lnMu.Lock()
	defer e.lnMu.Unlock()
	return e.addr
}

// URL returns "http://" + Addr().
func (e *Encoder) URL() string { return "http://" + e.Addr() }

// Faults returns the faults in effect.
func (e *Encoder) Faults() Faults {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.faults.clone()
}

// SetFaults replaces the faults in effect; safe while serving. It restarts
// the CrashAt and HealthFlap counts. Turning Refuse on closes the listener
// and idle connections (in-flight requests finish); turning it off listens
// again on the same address, retrying for up to a second if the port is
// briefly unavailable. A crashed encoder stays down until Restart.
func (e *Encoder) SetFaults(f Faults) {
	f = f.clone()
	e.lnMu.Lock()
	defer e.lnMu.Unlock()
	e.mu.Lock()
	e.faults = f
	e.crashN, e.healthN = 0, 0
	e.mu.Unlock()
	if e.srv == nil || e.down.Load() {
		return
	}
	switch {
	case f.Refuse && e.ln != nil:
		e.srv.SetKeepAlivesEnabled(false) // also closes idle connections
		_ = e.ln.Close()
		e.ln = nil
	case !f.Refuse && e.ln == nil:
		e.srv.SetKeepAlivesEnabled(true)
		_ = e.relistenLocked()
	}
}

// relistenLocked listens again on the started address, retrying for up to
// a second while the port is unavailable. lnMu must be held.
func (e *Encoder) relistenLocked() error {
	_, port, _ := net.SplitHostPort(e.addr)
	addr := net.JoinHostPort(e.bindHost, port)
	var err error
	for i := 0; i < 50; i++ {
		var ln net.Listener
		if ln, err = net.Listen("tcp", addr); err == nil {
			return e.serveLocked(ln)
		}
		select {
		case <-e.done:
			return errors.New("fakeencoder: closed")
		case <-time.After(20 * time.Millisecond):
		}
	}
	return fmt.Errorf("fakeencoder: listening again on %s: %w", addr, err)
}

// Close leaves the fleets (Unregister, while still serving), stops serving,
// stops the sweeper and background work, releases every blocked handler and
// waits for them to return. It is idempotent. An unregistration that fails
// is not its error: sglang ignores those at exit too.
func (e *Encoder) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	e.mu.Unlock()
	_ = e.Unregister(context.Background()) // each call bounded by UnregistrationTimeout
	// Close the connections before releasing the blocked handlers, so that a
	// released handler cannot answer (net/http would send an empty 200).
	e.lnMu.Lock()
	var err error
	if e.srv != nil {
		err = e.srv.Close()
	}
	e.ln = nil
	e.lnMu.Unlock()
	close(e.done)
	e.cancel()
	e.inflight.Wait()
	e.bg.Wait()
	return err
}

// BindFlags registers flags for the `encgate fake-encoder` subcommand on fs,
// writing into o. The flags' defaults are o's current values, with zero
// fields shown as their defaults (the registration numbers stay 0, which
// New reads as sglang's defaults).
func (o *Options) BindFlags(fs *flag.FlagSet) {
	o.setDefaults()
	fs.StringVar(&o.Name, "name", o.Name, "encoder name shown in /_fake/stats")
	fs.Var(&o.Mode, "mode", "transfer backend imitated: mooncake or zmq")
	fs.Var(&o.Generation, "generation", "sglang encoder generation imitated: new (default), gen0 (protocol reference §11) or gen1 (§12); gen0 and gen1 imply --refcount-calls")
	fs.BoolVar(&o.PushFrames, "push-frames", o.PushFrames, "zmq mode: push each part's ZMQ message (frame 0 a JSON stand-in for the pickle) to its registered URLs or prefill_host:embedding_port")
	fs.DurationVar(&o.EncodeLatency, "encode-latency", o.EncodeLatency, "simulated encode time after the metadata publish")
	fs.DurationVar(&o.MetadataTimeout, "metadata-timeout", o.MetadataTimeout, "/scheduler_receive_meta_data wait before 504 (sglang REQ_TIMEOUT)")
	fs.DurationVar(&o.RegisterTimeout, "register-timeout", o.RegisterTimeout, "/scheduler_receive_url wait for /encode to start before 504")
	fs.DurationVar(&o.SendTimeout, "send-timeout", o.SendTimeout, "zmq /encode wait for receive_count registrations (sglang SEND_TIMEOUT)")
	fs.DurationVar(&o.SweepAfter, "sweep-after", o.SweepAfter, "drop staged state this long after the last metadata publish")
	fs.BoolVar(&o.RefcountCalls, "refcount-calls", o.RefcountCalls, "OLD sglang: count raw /send calls, not distinct destinations")
	fs.IntVar(&o.TokensPerItem, "tokens-per-item", o.TokensPerItem, "embedding_len per mm_item")
	fs.IntVar(&o.Dim, "dim", o.Dim, "embedding_dim")
	fs.IntVar(&o.ElementSize, "element-size", o.ElementSize, "bytes per embedding element")
	fs.Func("register-url", "bootstrap base `URL` (an sglang EncoderBootstrapServer, e.g. http://127.0.0.1:8997) to self-register with, as --encoder-register-urls; repeatable", func(s string) error {
		u, err := parseBootstrapURL(s)
		if err == nil {
			o.RegisterURLs = append(o.RegisterURLs, u)
		}
		return err
	})
	fs.StringVar(&o.AdvertiseURL, "advertise-url", o.AdvertiseURL, "`URL` registered with the bootstrap servers (default this fake's own http://host:port)")
	fs.DurationVar(&o.RegistrationInterval, "registration-interval", o.RegistrationInterval, "wait between registration attempts per bootstrap URL (0 = 5s, as sglang)")
	fs.IntVar(&o.RegistrationAttempts, "registration-attempts", o.RegistrationAttempts, "registration attempts per bootstrap URL before giving up (0 = 30, as sglang)")
	fs.DurationVar(&o.RegistrationTimeout, "registration-timeout", o.RegistrationTimeout, "timeout of one POST /register_encoder_url (0 = 5s, as sglang)")
	fs.DurationVar(&o.UnregistrationTimeout, "unregistration-timeout", o.UnregistrationTimeout, "timeout of one DELETE /unregister_encoder_url at exit (0 = 2s, as sglang)")
	fs.IntVar(&o.DPSize, "dp-size", o.DPSize, "with --generation gen1: imitate GEN1's DP mode with N ranks (protocol reference §2, §12); 1 = no DP")
	fs.DurationVar(&o.DPMappingWait, "dp-mapping-wait", o.DPMappingWait, "DP: longest wait of a metadata pull or registration for its req_id's rank (capped by --metadata-timeout) before 404 Unknown req_id")
	fs.BoolVar(&o.DPMappingRace, "dp-mapping-race", o.DPMappingRace, "DP: imitate GEN1's dispatcher bug (§12): a metadata pull completing while a /send of the same req_id is in flight drops the mapping and that /send answers 504 after --metadata-timeout")
	fs.IntVar(&o.CacheItems, "cache-items", o.CacheItems, "media cache entries, as --enable-prefix-mm-cache: an /encode with the same mm_items bytes as a cached one skips --encode-latency (0 = off)")
	o.Faults.bindFlags(fs)
}

// bindFlags registers the fault flags on fs.
func (f *Faults) bindFlags(fs *flag.FlagSet) {
	fs.DurationVar(&f.Latency, "latency", f.Latency, "fault: latency added to every request")
	fs.DurationVar(&f.MetadataDelay, "metadata-delay", f.MetadataDelay, "fault: delay before /encode publishes metadata")
	fs.IntVar(&f.Leading504s, "leading-504s", f.Leading504s, "fault: first N metadata calls per req_id answer 504 at once")
	fs.Float64Var(&f.FailureRate, "failure-rate", f.FailureRate, "fault: probability that a request on the fail routes fails")
	fs.IntVar(&f.FailStatus, "fail-status", f.FailStatus, "fault: status of injected failures (0 = 500)")
	fs.StringVar(&f.FailMessage, "fail-message", f.FailMessage, "fault: message of injected failures (empty = default)")
	fs.Func("fail-routes", "fault: comma-separated routes --failure-rate applies to (default the four encoder POST routes)", routeList(&f.FailRoutes))
	fs.BoolVar(&f.Hang, "hang", f.Hang, "fault: read requests but never answer")
	fs.BoolVar(&f.Refuse, "refuse", f.Refuse, "fault: refuse connections")
	fs.BoolVar(&f.HealthFail, "health-fail", f.HealthFail, "fault: /health answers 503")
	fs.BoolVar(&f.HealthHang, "health-hang", f.HealthHang, "fault: /health never answers")
	fs.IntVar(&f.HealthFlap, "health-flap", f.HealthFlap, "fault: /health answers N times 200, then N times 503, and so on (0 = off)")
	fs.IntVar(&f.CrashAt, "crash-at", f.CrashAt, "fault: crash (reset every connection, refuse new ones) when the Nth request on the crash routes arrives (0 = never)")
	fs.Func("crash-routes", "fault: comma-separated routes --crash-at counts (default the four encoder POST routes)", routeList(&f.CrashRoutes))
	fs.BoolVar(&f.Truncate, "truncate", f.Truncate, "fault: answers on the truncate routes declare more bytes than they send, then the connection closes")
	fs.Func("truncate-routes", "fault: comma-separated routes --truncate applies to (default the four encoder POST routes)", routeList(&f.TruncateRoutes))
}

// routeList parses a comma-separated list of routes into *dst.
func routeList(dst *[]string) func(string) error {
	return func(s string) error {
		*dst = nil
		for _, r := range strings.Split(s, ",") {
			if r = strings.TrimSpace(r); r != "" {
				*dst = append(*dst, r)
			}
		}
		return nil
	}
}
