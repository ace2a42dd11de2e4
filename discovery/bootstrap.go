package discovery

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/jsonfield"
)

// BootstrapConfig is the `bootstrap:` section of the gateway config: the
// gateway's own sglang encoder bootstrap server, where encoders started with
// --encoder-register-urls register themselves.
type BootstrapConfig struct {
	// Listen is the bootstrap server's address, e.g. "0.0.0.0:8997"
	// (sglang's --encoder-bootstrap-port default). Empty (the default)
	// turns it off. Who may register is TokenFile's and AllowNetworks's
	// to say, below.
	Listen string `yaml:"listen"`
	// MaxEncoders bounds the registered encoders (default 1024), so that
	// callers cannot grow what the gateway holds and health-checks without
	// limit; past it a new URL gets a 503 with Retry-After. It bounds the
	// unregistration tombstones too.
	MaxEncoders int `yaml:"max_encoders"`
	// TTL is how long a registration lives without a refresh (default 60s),
	// by the store's clock (Redis's, with the Redis store). The gateway
	// refreshes registered encoders that pass health checks, so only one
	// that stopped answering them (crashed without unregistering) leaves
	// this long after. An unregistration's tombstone, which keeps replicas
	// from writing the URL back, lives as long.
	TTL configfile.Duration `yaml:"ttl"`
	// MaxBodyBytes bounds a registration's body (default 4KiB; a real one
	// is under 100 bytes). The server that serves Handler should use it as
	// its MaxRequestBodySize too, so larger bodies are refused unread.
	MaxBodyBytes configfile.ByteSize `yaml:"max_body_bytes"`

	// Who may use the API (bootstrap_access.go). With Listen set, at
	// least one of TokenFile and AllowNetworks is required, or Insecure
	// written: Validate refuses a listener open to whoever reaches it.

	// TokenFile holds the token the routes are served under: only
	// /t/<token>/register_encoder_url and the like answer, so sglang's
	// encoders are started with --encoder-register-urls
	// http://HOST:PORT/t/<token>. The file's rules are a bearer token
	// file's (mode 0600 or 0640, one line, at most 4KiB), the token at
	// least MinBootstrapTokenLen characters of letters, digits and -._~
	// (safe in a URL path as it is). Read at start and again on every
	// reload, so a rewritten file (a rotated Secret) applies on SIGHUP; the
	// path itself needs a restart, as every bootstrap key does.
	TokenFile string `yaml:"token_file"`
	// AllowNetworks lists the CIDRs (e.g. the cluster's pod CIDR) that a
	// caller's address, and every address of the host of a URL it
	// registers, must be in. Empty: no such check.
	AllowNetworks []string `yaml:"allow_networks"`
	// Insecure, when true, serves the API to whoever reaches Listen, with
	// neither TokenFile nor AllowNetworks (a laptop, a test); the gateway
	// logs a warning at start. It cannot be combined with either.
	Insecure bool `yaml:"insecure"`
	// ResolveTimeout bounds resolving the host name of a URL being
	// registered, for the AllowNetworks check (default 2s, at most 5s:
	// sglang's registration call gives up after 5 s).
	ResolveTimeout configfile.Duration `yaml:"resolve_timeout"`

	// Registrations across restarts (the memory store; Redis keeps them
	// itself).

	// StateFile, when set, is where the memory store's registrations are
	// kept, so that a restarted gateway serves the encoders registered
	// with the one before (sglang's encoders register only once). It is
	// written atomically on change (at most once per StateWriteInterval)
	// and at shutdown, and read at start (see StateFile). Its directory
	// must exist and be writable. Empty (the default): off.
	StateFile string `yaml:"state_file"`
	// StateWriteInterval is the least time between two writes of
	// StateFile (default 1s): a crash loses at most the changes of the
	// last interval. Below TTL.
	StateWriteInterval configfile.Duration `yaml:"state_write_interval"`
}

// DefaultBootstrap returns the bootstrap defaults: off, 1024 encoders, a
// 60 s TTL, 4 KiB bodies, no token, no networks, a 2 s resolve timeout.
func DefaultBootstrap() BootstrapConfig {
	return BootstrapConfig{
		MaxEncoders:  1024,
		TTL:          configfile.Duration(60 * time.Second),
		MaxBodyBytes: 4 << 10,
		// Empty, not nil: what `allow_networks: []` decodes to.
		AllowNetworks:  []string{},
		ResolveTimeout: configfile.Duration(2 * time.Second),

		StateWriteInterval: configfile.Duration(time.Second),
	}
}

// minBootstrapBody is the smallest max_body_bytes: a registration of a long
// https URL with a path prefix must still fit.
const minBootstrapBody = 256

// Validate checks the section; path is its field path.
func (c BootstrapConfig) Validate(p *configfile.Problems, path string) {
	if c.Listen != "" {
		_, port, err := net.SplitHostPort(c.Listen)
		n, perr := strconv.Atoi(port)
		if err != nil || perr != nil || n < 0 || n > 65535 {
			p.Addf(path+".listen", "must be empty (off) or host:port, got %q", c.Listen)
		}
	}
	if c.MaxEncoders < 1 {
		p.Addf(path+".max_encoders", "must be >= 1, got %d", c.MaxEncoders)
	}
	if c.TTL.D() < time.Second {
		p.Addf(path+".ttl", "must be >= 1s, got %s", c.TTL)
	}
	if c.MaxBodyBytes < minBootstrapBody {
		p.Addf(path+".max_body_bytes", "must be >= %d, got %d", minBootstrapBody, int64(c.MaxBodyBytes))
	}
	c.validateAccess(p, path)
	c.validateState(p, path)
}

// validateState checks state_file and state_write_interval. It looks at
// the file system: state_file's directory must exist and take a new file
// (one is made and removed), and state_file, if it exists, must be a
// regular file.
func (c BootstrapConfig) validateState(p *configfile.Problems, path string) {
	if w := c.StateWriteInterval.D(); w <= 0 || w >= c.TTL.D() {
		p.Addf(path+".state_write_interval", "must be above 0 and below ttl (%s): a crash loses the changes of the last interval, got %s", c.TTL, c.StateWriteInterval)
	}
	if c.StateFile == "" {
		return
	}
	if c.Listen == "" {
		p.Addf(path+".state_file", "is set but listen is empty: with the bootstrap API off there are no registrations to keep")
		return
	}
	if err := checkStateFile(c.StateFile); err != nil {
		p.Addf(path+".state_file", "%v", err)
	}
}

// pathProblem is err without the operation and path an *fs.PathError
// adds, which the message around it says.
func pathProblem(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// checkStateFile says what keeps path from being a state file: a directory
// that does not exist or does not take a new file, or a path that exists
// and is not a regular file.
func checkStateFile(path string) error {
	dir := filepath.Dir(path)
	if fi, err := os.Stat(dir); err != nil {
		return fmt.Errorf("directory %s: %w", dir, pathProblem(err))
	} else if !fi.IsDir() {
		return fmt.Errorf("%s is not a directory", dir)
	}
	if fi, err := os.Stat(path); err == nil && !fi.Mode().IsRegular() {
		return fmt.Errorf("%s exists and is not a regular file", path)
	}
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".check-*")
	if err != nil {
		return fmt.Errorf("directory %s is not writable: %w", dir, pathProblem(err))
	}
	_ = f.Close()
	_ = os.Remove(f.Name())
	return nil
}

// Bootstrap API routes, as sglang's EncoderBootstrapServer serves them.
const (
	pathRegister   = "/register_encoder_url"
	pathUnregister = "/unregister_encoder_url"
	pathList       = "/list_encoder_urls"
	pathHealth     = "/health"
)

// msgMissingURL is sglang's exact answer to a body without a usable url.
const msgMissingURL = "Missing or empty 'url' field"

// retryAfterFull is the Retry-After of a full registry's 503: sglang's
// encoder retries its registration every 5 s.
const retryAfterFull = "5"

var bootstrapURLKey = []string{"url"}

// Handler serves sglang's encoder bootstrap API over r, so that sglang
// encoders can register with the gateway as they would with a language-only
// server:
//
//   - POST /register_encoder_url {"url": U} registers U; DELETE
//     /unregister_encoder_url {"url": U} removes it. Both answer 200 "OK"
//     (text/plain), as sglang does.
//   - GET /list_encoder_urls answers {"encoder_urls": [...]}, the registered
//     URLs, sorted; GET /health answers 200 "OK".
//
// Errors are JSON {"error": ...}: 400 for a body without a usable url
// (sglang's own message), malformed JSON or an invalid URL; 413 for a body
// over max_body_bytes; 503 when the registry is full (with Retry-After: 5,
// sglang's retry interval) or the store is unavailable; 404 and 405 (with
// Allow) for other paths and methods. Registrations and unregistrations are
// logged at info with the normalised URL.
//
// access says who may call (BootstrapAccess): with a token the routes are
// served only under /t/<token>/, and every other path is a 404
// {"error":"not found"}; with networks a caller outside them gets a 403,
// and a registration of a URL whose host is outside them a 400 (a 503 with
// Retry-After when resolving its name failed). Both checks come before the
// path and method are looked at; the networks' before the token's.
func (r *Registry) Handler(log *zap.Logger, access BootstrapAccess) fasthttp.RequestHandler {
	h := &bootstrapHandler{r: r, log: log, guard: newBootstrapGuard(access, log)}
	return h.serve
}

// bootstrapHandler is Handler's state.
type bootstrapHandler struct {
	r     *Registry
	log   *zap.Logger
	guard *bootstrapGuard
}

func (h *bootstrapHandler) serve(ctx *fasthttp.RequestCtx) {
	route, ok := h.guard.admit(ctx)
	if !ok {
		return
	}
	var method string
	switch route {
	case pathRegister:
		method = fasthttp.MethodPost
	case pathUnregister:
		method = fasthttp.MethodDelete
	case pathList, pathHealth:
		method = fasthttp.MethodGet
	default:
		bootstrapError(ctx, fasthttp.StatusNotFound, "not found: the bootstrap API serves "+
			pathRegister+", "+pathUnregister+", "+pathList+" and "+pathHealth)
		return
	}
	if string(ctx.Method()) != method {
		ctx.Response.Header.Set("Allow", method)
		bootstrapError(ctx, fasthttp.StatusMethodNotAllowed, "method not allowed; use "+method)
		return
	}
	switch route {
	case pathHealth:
		bootstrapOK(ctx)
	case pathList:
		h.list(ctx)
	case pathRegister:
		h.change(ctx, true)
	case pathUnregister:
		h.change(ctx, false)
	}
}

func (h *bootstrapHandler) list(ctx *fasthttp.RequestCtx) {
	urls, err := h.r.listURLs(context.Background())
	if err != nil {
		h.storeError(ctx, "listing", err)
		return
	}
	if urls == nil {
		urls = []string{}
	}
	bootstrapJSON(ctx, fasthttp.StatusOK, struct {
		EncoderURLs []string `json:"encoder_urls"`
	}{urls})
}

// change registers (add) or unregisters the body's url.
func (h *bootstrapHandler) change(ctx *fasthttp.RequestCtx, add bool) {
	body := ctx.PostBody()
	if max := int64(h.r.cfg.MaxBodyBytes); int64(len(body)) > max {
		bootstrapError(ctx, fasthttp.StatusRequestEntityTooLarge,
			"request body is over bootstrap.max_body_bytes ("+h.r.cfg.MaxBodyBytes.String()+")")
		return
	}
	var raw [1][]byte
	if err := jsonfield.Lookup(body, bootstrapURLKey, raw[:]); err != nil {
		if errors.Is(err, jsonfield.ErrNotObject) {
			bootstrapError(ctx, fasthttp.StatusBadRequest, msgMissingURL)
			return
		}
		bootstrapError(ctx, fasthttp.StatusBadRequest, "invalid JSON body: "+bootstrapJSONProblem(err))
		return
	}
	rawURL, ok := jsonfield.String(raw[0])
	if !ok || rawURL == "" {
		bootstrapError(ctx, fasthttp.StatusBadRequest, msgMissingURL)
		return
	}
	// The store and the self check get a context of their own, not ctx: a
	// *fasthttp.RequestCtx is reset for the next request once the handler
	// returns, and a deadline timer made under it may still read it then.
	// Each bounds its own wait (the Redis timeout, the resolve timeout).
	var (
		u   string
		err error
	)
	if add {
		if norm, _, perr := ParseEncoderURL(rawURL); perr == nil && !h.guard.checkURL(ctx, norm) {
			return
		}
		u, err = h.r.register(context.Background(), rawURL)
	} else {
		u, err = h.r.unregister(context.Background(), rawURL)
	}
	switch {
	case err == nil:
		if add {
			h.log.Info("encoder registered", zap.String("url", u), zap.Stringer("remote", ctx.RemoteAddr()))
		} else {
			h.log.Info("encoder unregistered", zap.String("url", u), zap.Stringer("remote", ctx.RemoteAddr()))
		}
		bootstrapOK(ctx)
	case errors.Is(err, ErrInvalidURL):
		bootstrapError(ctx, fasthttp.StatusBadRequest, err.Error())
	case errors.Is(err, ErrFull):
		h.log.Warn("encoder registration refused: registry full", zap.String("url", u),
			zap.Int("max_encoders", h.r.cfg.MaxEncoders))
		ctx.Response.Header.Set("Retry-After", retryAfterFull)
		bootstrapError(ctx, fasthttp.StatusServiceUnavailable, err.Error())
	default:
		what := "registering"
		if !add {
			what = "unregistering"
		}
		h.storeError(ctx, what, err)
	}
}

// storeError answers a store failure with a 503 and logs it.
func (h *bootstrapHandler) storeError(ctx *fasthttp.RequestCtx, what string, err error) {
	h.log.Warn("bootstrap: registration store unavailable", zap.String("op", what), zap.Error(err))
	bootstrapError(ctx, fasthttp.StatusServiceUnavailable, "registration store unavailable: "+err.Error())
}

// bootstrapJSONProblem says what is wrong with a body jsonfield refused, without the
// "invalid JSON" its messages start with.
func bootstrapJSONProblem(err error) string {
	var se *jsonfield.SyntaxError
	switch {
	case errors.As(err, &se):
		return se.Msg + " at byte " + strconv.Itoa(se.Offset)
	case errors.Is(err, jsonfield.ErrTooDeep):
		return "nested too deeply"
	default:
		return err.Error()
	}
}

// bootstrapOK answers 200 "OK" as text/plain, sglang's success answer on every
// bootstrap route but the list.
func bootstrapOK(ctx *fasthttp.RequestCtx) {
	ctx.SetStatusCode(fasthttp.StatusOK)
	ctx.SetContentType("text/plain; charset=utf-8")
	ctx.SetBodyString("OK")
}

func bootstrapError(ctx *fasthttp.RequestCtx, status int, msg string) {
	bootstrapJSON(ctx, status, struct {
		Error string `json:"error"`
	}{msg})
}

func bootstrapJSON(ctx *fasthttp.RequestCtx, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil { // only strings and string slices are marshalled
		status, b = fasthttp.StatusInternalServerError, []byte(`{"error":"internal error"}`)
	}
	ctx.SetStatusCode(status)
	ctx.SetContentType("application/json")
	ctx.SetBody(b)
}
