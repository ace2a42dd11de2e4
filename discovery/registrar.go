package discovery

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/urlhint"
)

// The bootstrap server's routes (sglang's EncoderBootstrapServer, served by
// the language-only server on --encoder-bootstrap-port, 8997 by default).
const (
	selfRegisterPath   = "/register_encoder_url"
	selfUnregisterPath = "/unregister_encoder_url"
	selfListPath       = "/list_encoder_urls"
)

// selfUnregisterTimeout bounds Unregister as a whole: sglang's encoders give
// their own DELETE 2 s at exit, and a gateway shutting down must not wait
// longer on a language server that is already gone.
const selfUnregisterTimeout = 2 * time.Second

// maxSelfFanout bounds RegistrarConfig.Fanout: each slot is one URL registered
// with every bootstrap and one more part of every request.
const maxSelfFanout = 1024

// selfRegisterWorkers bounds how many registrations of one bootstrap are in
// flight at once, and selfUnregisterWorkers how many DELETEs Unregister has in
// flight in all, so a large fanout does not open a thousand connections to
// the language server at once.
const (
	selfRegisterWorkers   = 16
	selfUnregisterWorkers = 64
)

// selfWarnEvery is how often a run of failed rounds is logged at warn: the
// first failure, then every selfWarnEvery-th, so a language server that is down
// for an hour costs a few log lines, not one every RetryInterval.
const selfWarnEvery = 10

// Caps on what is read from a bootstrap's answers: an error body is only
// quoted, and a list of encoder URLs is kilobytes.
const (
	selfMaxErrorBody = 512
	selfMaxListBody  = 8 << 20
)

// RegistrarConfig is how the gateway registers itself with sglang bootstrap
// servers, as an encoder would, so a language-only server started with
// --encoder-bootstrap-port finds it without a static --encoder-urls.
//
// sglang dedupes the URLs registered with it and sends one part per modality
// per URL, so a gateway registered once would get every request in one part.
// The registrar therefore registers Fanout distinct URLs, AdvertiseURL/p/0
// … /p/<Fanout-1>, all served by the gateway (every route is also served
// under /p/<k>/), which gives N-way fan-out across the encoders behind it.
type RegistrarConfig struct {
	// RegisterWith are the bootstrap base URLs ("http://lang:8997"); empty
	// turns self-registration off.
	RegisterWith []string `yaml:"register_with"`
	// AdvertiseURL is where the language server's clients reach this
	// gateway ("http://encgate:8080"); required when RegisterWith is set. It
	// must name a port, because sglang joins paths onto it verbatim.
	AdvertiseURL string `yaml:"advertise_url"`
	// Fanout is how many distinct URLs are registered (default 1, at most
	// 1024): the number of parts per modality each request is split into.
	Fanout int `yaml:"fanout"`
	// RetryInterval is the wait before a failed registration, or a failed
	// read of a bootstrap's list, is tried again (default 5s, sglang's).
	// Retries go on for as long as Run runs, unlike an encoder's 30
	// attempts, so the gateway comes back after the language server
	// restarts.
	RetryInterval configfile.Duration `yaml:"retry_interval"`
	// Timeout bounds each registration and list request (default 5s,
	// sglang's).
	Timeout configfile.Duration `yaml:"timeout"`
	// CheckInterval is how often each bootstrap's list is read once every
	// URL is registered, to register again what it no longer lists: a
	// restarted language server starts with an empty list (default 30s).
	CheckInterval configfile.Duration `yaml:"check_interval"`
}

// DefaultRegistrar returns the defaults: off, fanout 1, and sglang's own
// timing (5 s between retries, 5 s per request), with a check every 30 s.
func DefaultRegistrar() RegistrarConfig {
	return RegistrarConfig{
		Fanout:        1,
		RetryInterval: configfile.Duration(5 * time.Second),
		Timeout:       configfile.Duration(5 * time.Second),
		CheckInterval: configfile.Duration(30 * time.Second),
	}
}

// selfFieldPath joins a section's path and a key, so a section that sits at the
// top level (path "") names its keys plainly.
func selfFieldPath(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// Validate records every problem with c in p, each under its field path
// below path (path+".advertise_url", or "advertise_url" when path is "":
// these keys sit at the top level of the gateway's config).
func (c RegistrarConfig) Validate(p *configfile.Problems, path string) {
	seen := make(map[string]int, len(c.RegisterWith))
	for i, b := range c.RegisterWith {
		fp := selfFieldPath(path, "register_with") + "[" + strconv.Itoa(i) + "]"
		if hint := urlhint.Problem(b); hint != "" {
			p.Addf(fp, "%s", hint)
			continue
		}
		if msg := selfCheckURL(b, false); msg != "" {
			p.Addf(fp, "%s, got %q", msg, b)
			continue
		}
		key := strings.TrimRight(b, "/")
		if j, dup := seen[key]; dup {
			p.Addf(fp, "%q is already register_with[%d]", b, j)
			continue
		}
		seen[key] = i
	}
	ap := selfFieldPath(path, "advertise_url")
	switch {
	case c.AdvertiseURL == "" && len(c.RegisterWith) > 0:
		p.Addf(ap, "required when register_with is set: the URL the language server reaches this gateway at, e.g. http://encgate:8080")
	case urlhint.Problem(c.AdvertiseURL) != "":
		p.Addf(ap, "%s", urlhint.Problem(c.AdvertiseURL))
	case c.AdvertiseURL != "":
		if msg := selfCheckURL(c.AdvertiseURL, true); msg != "" {
			p.Addf(ap, "%s, got %q", msg, c.AdvertiseURL)
		}
	}
	if c.Fanout < 1 || c.Fanout > maxSelfFanout {
		p.Addf(selfFieldPath(path, "fanout"), "must be 1..%d, got %d", maxSelfFanout, c.Fanout)
	}
	p.Positive(selfFieldPath(path, "retry_interval"), c.RetryInterval)
	p.Positive(selfFieldPath(path, "timeout"), c.Timeout)
	p.Positive(selfFieldPath(path, "check_interval"), c.CheckInterval)
}

// selfCheckURL returns what is wrong with s as a base URL that paths are
// joined onto ("" if nothing): http or https, a host, no query, fragment or
// user info, and with needPort an explicit port.
func selfCheckURL(s string, needPort bool) string {
	u, err := url.Parse(s)
	switch {
	case err != nil:
		return "not a URL"
	case u.Scheme != "http" && u.Scheme != "https":
		return "must be an http:// or https:// URL"
	case u.Hostname() == "":
		return "must name a host"
	case u.User != nil:
		return "must not carry user info"
	case u.RawQuery != "" || u.ForceQuery:
		return "must not have a query"
	case u.Fragment != "" || strings.Contains(s, "#"):
		return "must not have a fragment"
	}
	if port := u.Port(); port != "" {
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
			return "port must be 1..65535"
		}
	} else if needPort {
		return "must name a port (host:port)"
	}
	return ""
}

// selfBase returns s without trailing slashes, the form paths are joined onto.
func selfBase(s string) string { return strings.TrimRight(s, "/") }

// URLs returns the URLs the gateway registers, AdvertiseURL (trailing slash
// trimmed) + "/p/" + k for k in 0..Fanout-1, in slot order.
func (c RegistrarConfig) URLs() []string {
	adv := selfBase(c.AdvertiseURL)
	out := make([]string, 0, max(c.Fanout, 0))
	for k := range c.Fanout {
		out = append(out, adv+"/p/"+strconv.Itoa(k))
	}
	return out
}

// RegistrarDeps are what a Registrar is given rather than reaching for
// globals, so tests can drive time and watch logs and metrics.
type RegistrarDeps struct {
	// Log receives the registrar's log lines; nil discards them.
	Log *zap.Logger
	// Registry receives the metrics listed on Registrar; nil keeps them in
	// a private registry.
	Registry prometheus.Registerer
	// Clock drives the retry and check waits and stamps Status; nil is the
	// wall clock. Request timeouts run on the wall clock regardless: they
	// bound real network exchanges.
	Clock clock.Clock
	// Client sends the requests; nil is a client of the registrar's own,
	// sharing nothing with http.DefaultTransport and reading no proxy from
	// the environment (a bootstrap is an in-cluster neighbour).
	Client *http.Client
}

// RegistrationState is where one (bootstrap, URL) registration stands.
type RegistrationState string

// The states of a registration.
const (
	// RegistrationPending: not registered yet, or the bootstrap forgot it and it
	// is being registered again.
	RegistrationPending RegistrationState = "pending"
	// RegistrationRegistered: the bootstrap accepted it and, at the last check,
	// still listed it.
	RegistrationRegistered RegistrationState = "registered"
	// RegistrationUnregistered: Unregister removed it.
	RegistrationUnregistered RegistrationState = "unregistered"
)

// RegistrationStatus is one (bootstrap, URL) registration as /admin shows
// it, so an operator can see whether the language server knows the gateway
// and, if not, why.
type RegistrationStatus struct {
	// Bootstrap is the bootstrap's base URL, trailing slash trimmed.
	Bootstrap string `json:"bootstrap"`
	// URL is the registered URL (AdvertiseURL/p/<k>).
	URL string `json:"url"`
	// State is pending, registered or unregistered.
	State RegistrationState `json:"state"`
	// Registered is State == RegistrationRegistered.
	Registered bool `json:"registered"`
	// Attempts counts the POSTs sent since the registration last became
	// pending (at start, or when a check found it missing), so a registered
	// one shows how many it took.
	Attempts int `json:"attempts"`
	// LastError is the last attempt's error, "" once one succeeded.
	LastError string `json:"last_error,omitempty"`
	// LastAttempt is when the last POST (or DELETE) finished.
	LastAttempt time.Time `json:"last_attempt,omitzero"`
	// RegisteredAt is when the bootstrap last accepted it.
	RegisteredAt time.Time `json:"registered_at,omitzero"`
	// Forgotten counts the checks that found the bootstrap no longer
	// listing it (each a language-server restart, typically).
	Forgotten int `json:"forgotten"`
	// LastCheck is when the bootstrap's list was last read successfully.
	LastCheck time.Time `json:"last_check,omitzero"`
	// CheckError is the last read of the list's error, "" once one
	// succeeded.
	CheckError string `json:"check_error,omitempty"`
}

// selfRegistration is the mutable state behind a RegistrationStatus.
type selfRegistration struct {
	state        RegistrationState
	attempts     int
	lastErr      string
	lastAttempt  time.Time
	registeredAt time.Time
	forgotten    int
}

// selfBootstrap is one bootstrap: its registrations (indexed like
// Registrar.urls) and its series.
type selfBootstrap struct {
	base         string
	regs         []selfRegistration // guarded by Registrar.mu
	lastCheck    time.Time          // guarded by Registrar.mu
	lastCheckErr string             // guarded by Registrar.mu

	// failures counts consecutive failed rounds; only the bootstrap's own
	// loop touches it.
	failures int

	gauges                  map[RegistrationState]prometheus.Gauge
	attemptsOK, attemptsErr prometheus.Counter
	checksOK, checksErr     prometheus.Counter
	forgotten               prometheus.Counter
	unregOK, unregErr       prometheus.Counter
}

// Registrar registers the gateway with sglang bootstrap servers and keeps it
// registered: each bootstrap has its own loop, so one that is down does not
// hold up another.
//
// Metrics (registered on RegistrarDeps.Registry):
//
//   - encgate_self_registrations{bootstrap,state}: gauge, how many of the
//     gateway's URLs are registered, pending or unregistered with each
//     bootstrap. Alert on pending > 0 for long: the language server does not
//     know (all of) the gateway and sends it fewer parts, or none.
//   - encgate_self_registration_attempts_total{bootstrap,result}: counter,
//     registration POSTs by result ok or error.
//   - encgate_self_registration_checks_total{bootstrap,result}: counter,
//     reads of the bootstrap's list by result ok or error.
//   - encgate_self_registration_forgotten_total{bootstrap}: counter, URLs a
//     check found missing from the bootstrap's list and registered again;
//     a step here is a language-server restart (or an eviction).
//   - encgate_self_unregistrations_total{bootstrap,result}: counter,
//     Unregister's DELETEs by result ok or error.
//
// Series are keyed by bootstrap base URL; building a second Registrar on the
// same registry (a reload) reuses the collectors.
type Registrar struct {
	cfg    RegistrarConfig
	urls   []string
	log    *zap.Logger
	clock  clock.Clock
	client *http.Client
	// ownClient: the client is the registrar's, so it may close its idle
	// connections when it is done with them.
	ownClient bool

	mu         sync.Mutex // guards the regs, lastCheck and checkErr of every bootstrap
	bootstraps []*selfBootstrap
}

// registrarMetrics are the registrar's collectors.
type registrarMetrics struct {
	registrations *prometheus.GaugeVec
	attempts      *prometheus.CounterVec
	checks        *prometheus.CounterVec
	forgotten     *prometheus.CounterVec
	unregisters   *prometheus.CounterVec
}

// registerOrReuse registers c on reg, or returns the collector of the same
// description already there: a Registrar rebuilt on reload shares its
// predecessor's series, and every discovery source counts its failures on
// one encgate_discovery_errors_total. A different metric under the same name
// is a programming error and panics, as with MustRegister.
func registerOrReuse[T prometheus.Collector](reg prometheus.Registerer, c T) T {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(T); ok {
				return existing
			}
		}
		panic(fmt.Sprintf("discovery: registering metrics: %v", err))
	}
	return c
}

func newRegistrarMetrics(reg prometheus.Registerer) registrarMetrics {
	return registrarMetrics{
		registrations: registerOrReuse(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "encgate_self_registrations",
			Help: "The gateway's own URLs per sglang bootstrap server, by state: registered, pending (not yet accepted, or forgotten and being registered again) or unregistered (at shutdown).",
		}, []string{"bootstrap", "state"})),
		attempts: registerOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_self_registration_attempts_total",
			Help: "Registration requests (POST /register_encoder_url) the gateway sent for itself, by bootstrap and result (ok, error).",
		}, []string{"bootstrap", "result"})),
		checks: registerOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_self_registration_checks_total",
			Help: "Reads of a bootstrap's list (GET /list_encoder_urls) to find forgotten registrations, by bootstrap and result (ok, error).",
		}, []string{"bootstrap", "result"})),
		forgotten: registerOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_self_registration_forgotten_total",
			Help: "The gateway's URLs a check found missing from a bootstrap's list (a language-server restart, typically), each then registered again.",
		}, []string{"bootstrap"})),
		unregisters: registerOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_self_unregistrations_total",
			Help: "Unregistration requests (DELETE /unregister_encoder_url) sent at shutdown, by bootstrap and result (ok, error).",
		}, []string{"bootstrap", "result"})),
	}
}

// NewRegistrar returns a registrar for cfg, which must have passed Validate;
// nothing is sent until Run.
func NewRegistrar(cfg RegistrarConfig, deps RegistrarDeps) *Registrar {
	r := &Registrar{
		cfg:    cfg,
		urls:   cfg.URLs(),
		log:    deps.Log,
		clock:  deps.Clock,
		client: deps.Client,
	}
	if r.log == nil {
		r.log = zap.NewNop()
	}
	r.log = r.log.Named("registrar")
	if r.clock == nil {
		r.clock = clock.Real{}
	}
	if r.client == nil {
		r.client = newRegistrarClient(cfg.Timeout.D())
		r.ownClient = true
	}
	reg := deps.Registry
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m := newRegistrarMetrics(reg)
	for _, raw := range cfg.RegisterWith {
		b := &selfBootstrap{
			base: selfBase(raw),
			regs: make([]selfRegistration, len(r.urls)),
		}
		b.gauges = map[RegistrationState]prometheus.Gauge{}
		for _, s := range []RegistrationState{RegistrationPending, RegistrationRegistered, RegistrationUnregistered} {
			b.gauges[s] = m.registrations.WithLabelValues(b.base, string(s))
			b.gauges[s].Set(0)
		}
		for i := range b.regs {
			b.regs[i].state = RegistrationPending
		}
		b.gauges[RegistrationPending].Set(float64(len(r.urls)))
		b.attemptsOK = m.attempts.WithLabelValues(b.base, "ok")
		b.attemptsErr = m.attempts.WithLabelValues(b.base, "error")
		b.checksOK = m.checks.WithLabelValues(b.base, "ok")
		b.checksErr = m.checks.WithLabelValues(b.base, "error")
		b.forgotten = m.forgotten.WithLabelValues(b.base)
		b.unregOK = m.unregisters.WithLabelValues(b.base, "ok")
		b.unregErr = m.unregisters.WithLabelValues(b.base, "error")
		r.bootstraps = append(r.bootstraps, b)
	}
	return r
}

// newRegistrarClient is the client used when none is given: its own
// transport, no proxy from the environment, dials bounded by the request
// timeout.
func newRegistrarClient(timeout time.Duration) *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext:           (&net.Dialer{Timeout: timeout, KeepAlive: 30 * time.Second}).DialContext,
		TLSHandshakeTimeout:   timeout,
		ResponseHeaderTimeout: timeout,
		MaxIdleConns:          selfUnregisterWorkers,
		MaxIdleConnsPerHost:   selfRegisterWorkers,
		IdleConnTimeout:       90 * time.Second,
		ForceAttemptHTTP2:     true,
	}}
}

// setState moves registration i of b to s, keeping the gauges in step.
// The caller holds r.mu.
func (b *selfBootstrap) setState(i int, s RegistrationState) {
	old := b.regs[i].state
	if old == s {
		return
	}
	b.gauges[old].Dec()
	b.gauges[s].Inc()
	b.regs[i].state = s
}

// Run registers every URL with every bootstrap and keeps them registered
// until ctx is done, then returns once every bootstrap's loop has stopped.
// With no bootstraps configured it returns at once. Call it once.
//
// Per bootstrap: the pending URLs are registered (several at a time); those
// that failed are tried again every RetryInterval, for as long as Run runs.
// Once all are registered, the bootstrap's list is read every
// CheckInterval (every RetryInterval while reading it fails), and any URL
// missing from it is pending again and registered at once. A run of failed
// rounds is logged at warn on its first round and every 10th after, and
// its end at info.
func (r *Registrar) Run(ctx context.Context) {
	if len(r.bootstraps) == 0 || len(r.urls) == 0 {
		return
	}
	r.log.Info("registering with sglang bootstrap servers",
		zap.Strings("bootstraps", r.cfg.RegisterWith), zap.Int("urls", len(r.urls)),
		zap.String("first_url", r.urls[0]))
	var wg sync.WaitGroup
	for _, b := range r.bootstraps {
		wg.Go(func() { r.loop(ctx, b) })
	}
	wg.Wait()
	if r.ownClient {
		r.client.CloseIdleConnections()
	}
}

// loop keeps b's registrations current until ctx is done.
func (r *Registrar) loop(ctx context.Context, b *selfBootstrap) {
	pending := make([]int, len(r.urls))
	for i := range pending {
		pending[i] = i
	}
	checkFailed := false
	for {
		if len(pending) > 0 {
			var err error
			total := len(pending)
			pending, err = r.registerRound(ctx, b, pending)
			if ctx.Err() != nil {
				return
			}
			if len(pending) > 0 {
				r.failed(b, "registering with bootstrap failed", err,
					zap.Int("failed", len(pending)), zap.Int("of", total))
			} else {
				r.succeeded(b, "registered with bootstrap", true, zap.Int("urls", total))
			}
		}
		wait := r.cfg.CheckInterval.D()
		if len(pending) > 0 || checkFailed {
			wait = r.cfg.RetryInterval.D()
		}
		if !r.sleep(ctx, wait) {
			return
		}
		if len(pending) > 0 {
			continue
		}
		missing, err := r.check(ctx, b)
		if ctx.Err() != nil {
			return
		}
		checkFailed = err != nil
		if checkFailed {
			r.failed(b, "reading bootstrap's list of encoder URLs failed", err)
			continue
		}
		if len(missing) > 0 {
			r.log.Info("bootstrap no longer lists the gateway; registering again",
				zap.String("bootstrap", b.base), zap.Int("missing", len(missing)), zap.Int("of", len(r.urls)))
		} else {
			r.succeeded(b, "reading bootstrap's list of encoder URLs works again", false)
		}
		pending = missing
	}
}

// failed counts a failed round of b and logs it at warn if it is the first
// of a run or every selfWarnEvery-th, else at debug.
func (r *Registrar) failed(b *selfBootstrap, msg string, err error, fields ...zap.Field) {
	b.failures++
	fields = append(fields, zap.String("bootstrap", b.base), zap.Error(err),
		zap.Int("consecutive_failures", b.failures), zap.Duration("retry_in", r.cfg.RetryInterval.D()))
	if b.failures == 1 || b.failures%selfWarnEvery == 0 {
		r.log.Warn(msg, fields...)
		return
	}
	r.log.Debug(msg, fields...)
}

// succeeded ends a run of failed rounds of b, logging msg at info if there
// was one, or always: a registration round that succeeded (at start, or
// after the bootstrap forgot the gateway) is rare and worth a line.
func (r *Registrar) succeeded(b *selfBootstrap, msg string, always bool, fields ...zap.Field) {
	if b.failures == 0 && !always {
		return
	}
	fields = append(fields, zap.String("bootstrap", b.base), zap.Int("after_failures", b.failures))
	r.log.Info(msg, fields...)
	b.failures = 0
}

// sleep waits d on the registrar's clock; false if ctx ended first.
func (r *Registrar) sleep(ctx context.Context, d time.Duration) bool {
	t := r.clock.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C():
		return true
	}
}

// registerRound POSTs the registrations of b at indices pending, a few at
// a time, and returns those that failed (in order) and the first failure.
// Attempts cut short by ctx are not counted.
func (r *Registrar) registerRound(ctx context.Context, b *selfBootstrap, pending []int) ([]int, error) {
	errs := make([]error, len(pending))
	next := make(chan int)
	var wg sync.WaitGroup
	for range min(selfRegisterWorkers, len(pending)) {
		wg.Go(func() {
			for j := range next {
				errs[j] = r.registerOne(ctx, b, pending[j])
			}
		})
	}
	for j := range pending {
		next <- j
	}
	close(next)
	wg.Wait()
	var failed []int
	var first error
	for j, err := range errs {
		if err != nil {
			failed = append(failed, pending[j])
			if first == nil {
				first = err
			}
		}
	}
	return failed, first
}

// registerOne POSTs registration i of b and records the outcome.
func (r *Registrar) registerOne(ctx context.Context, b *selfBootstrap, i int) error {
	rctx, cancel := context.WithTimeout(ctx, r.cfg.Timeout.D())
	defer cancel()
	err := r.send(rctx, http.MethodPost, b.base+selfRegisterPath, r.urls[i])
	if ctx.Err() != nil {
		return ctx.Err() // Run is stopping: not an attempt worth recording
	}
	now := r.clock.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	reg := &b.regs[i]
	reg.attempts++
	reg.lastAttempt = now
	if err != nil {
		reg.lastErr = err.Error()
		b.attemptsErr.Inc()
		return err
	}
	reg.lastErr = ""
	reg.registeredAt = now
	b.setState(i, RegistrationRegistered)
	b.attemptsOK.Inc()
	return nil
}

// send makes one registration request (POST or DELETE with {"url": u}) and
// returns an error unless the answer is 2xx.
func (r *Registrar) send(ctx context.Context, method, target, u string) error {
	body, err := json.Marshal(struct {
		URL string `json:"url"`
	}{u})
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, method, target, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := r.client.Do(req)
	if err != nil {
		return err
	}
	defer selfDrainClose(resp.Body)
	if resp.StatusCode/100 != 2 {
		return selfAnswerError(method, target, resp)
	}
	return nil
}

// selfAnswerError describes a non-2xx answer, quoting the start of its body
// (sglang's bootstrap puts the reason there).
func selfAnswerError(method, target string, resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, selfMaxErrorBody))
	msg := strings.TrimSpace(string(b))
	if msg == "" {
		return fmt.Errorf("%s %s: %s", method, target, resp.Status)
	}
	return fmt.Errorf("%s %s: %s: %q", method, target, resp.Status, msg)
}

// selfDrainClose reads a little of what is left of body, so the connection can
// be reused, and closes it.
func selfDrainClose(body io.ReadCloser) {
	_, _ = io.Copy(io.Discard, io.LimitReader(body, 64<<10))
	_ = body.Close()
}

// check reads b's list and returns the indices of the gateway's URLs it no
// longer lists, which are pending again.
func (r *Registrar) check(ctx context.Context, b *selfBootstrap) ([]int, error) {
	listed, err := r.list(ctx, b)
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	now := r.clock.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	if err != nil {
		b.lastCheckErr = err.Error()
		b.checksErr.Inc()
		return nil, err
	}
	b.lastCheckErr = ""
	b.lastCheck = now
	b.checksOK.Inc()
	var missing []int
	for i, u := range r.urls {
		if listed[u] || b.regs[i].state != RegistrationRegistered {
			continue
		}
		missing = append(missing, i)
		reg := &b.regs[i]
		reg.forgotten++
		reg.attempts = 0
		b.setState(i, RegistrationPending)
		b.forgotten.Inc()
	}
	return missing, nil
}

// list GETs b's list of encoder URLs as a set, trailing slashes trimmed.
func (r *Registrar) list(ctx context.Context, b *selfBootstrap) (map[string]bool, error) {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.Timeout.D())
	defer cancel()
	target := b.base + selfListPath
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return nil, err
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer selfDrainClose(resp.Body)
	if resp.StatusCode/100 != 2 {
		return nil, selfAnswerError(http.MethodGet, target, resp)
	}
	var answer struct {
		URLs *[]string `json:"encoder_urls"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, selfMaxListBody)).Decode(&answer); err != nil {
		return nil, fmt.Errorf("GET %s: reading the answer: %w", target, err)
	}
	if answer.URLs == nil {
		return nil, fmt.Errorf("GET %s: the answer has no encoder_urls", target)
	}
	set := make(map[string]bool, len(*answer.URLs))
	for _, u := range *answer.URLs {
		set[selfBase(u)] = true
	}
	return set, nil
}

// Unregister sends DELETE /unregister_encoder_url for every URL to every
// bootstrap, concurrently, and returns the failures joined, one error per
// bootstrap that refused or missed any (how many, and the first, which it
// wraps), or nil. The whole call is bounded by 2 s (sglang's own unregister
// timeout) or ctx, whichever ends first, so a language server that is
// already gone does not hold up shutdown. Every URL is sent, registered or
// not: a POST that timed out here may still have landed there.
//
// The gateway calls it on SIGTERM before draining, after cancelling Run and
// waiting for it to return (a Run still going could register again).
func (r *Registrar) Unregister(ctx context.Context) error {
	if len(r.bootstraps) == 0 || len(r.urls) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, selfUnregisterTimeout)
	defer cancel()
	errs := make([][]error, len(r.bootstraps))
	for bi := range errs {
		errs[bi] = make([]error, len(r.urls))
	}
	next := make(chan [2]int)
	var wg sync.WaitGroup
	for range min(selfUnregisterWorkers, len(r.bootstraps)*len(r.urls)) {
		wg.Go(func() {
			for j := range next {
				bi, i := j[0], j[1]
				errs[bi][i] = r.unregisterOne(ctx, r.bootstraps[bi], i)
			}
		})
	}
	for i := range r.urls { // interleave bootstraps, so each gets its share of the time
		for bi := range r.bootstraps {
			next <- [2]int{bi, i}
		}
	}
	close(next)
	wg.Wait()
	if r.ownClient {
		r.client.CloseIdleConnections()
	}
	var out []error
	for bi, b := range r.bootstraps {
		n, first, firstURL := 0, error(nil), ""
		for i, err := range errs[bi] {
			if err != nil {
				if first == nil {
					first, firstURL = err, r.urls[i]
				}
				n++
			}
		}
		if n > 0 {
			out = append(out, fmt.Errorf("discovery: unregistering %d of %d URLs from %s failed; %s: %w",
				n, len(r.urls), b.base, firstURL, first))
		}
	}
	return errors.Join(out...)
}

// unregisterOne DELETEs registration i of b and records the outcome.
func (r *Registrar) unregisterOne(ctx context.Context, b *selfBootstrap, i int) error {
	err := r.send(ctx, http.MethodDelete, b.base+selfUnregisterPath, r.urls[i])
	now := r.clock.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	reg := &b.regs[i]
	reg.lastAttempt = now
	if err != nil {
		reg.lastErr = "unregister: " + err.Error()
		b.unregErr.Inc()
		return err
	}
	reg.lastErr = ""
	b.setState(i, RegistrationUnregistered)
	b.unregOK.Inc()
	return nil
}

// Status returns every (bootstrap, URL) registration, bootstraps in config
// order and URLs in slot order, for /admin.
func (r *Registrar) Status() []RegistrationStatus {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]RegistrationStatus, 0, len(r.bootstraps)*len(r.urls))
	for _, b := range r.bootstraps {
		for i, reg := range b.regs {
			out = append(out, RegistrationStatus{
				Bootstrap:    b.base,
				URL:          r.urls[i],
				State:        reg.state,
				Registered:   reg.state == RegistrationRegistered,
				Attempts:     reg.attempts,
				LastError:    reg.lastErr,
				LastAttempt:  reg.lastAttempt,
				RegisteredAt: reg.registeredAt,
				Forgotten:    reg.forgotten,
				LastCheck:    b.lastCheck,
				CheckError:   b.lastCheckErr,
			})
		}
	}
	return out
}
