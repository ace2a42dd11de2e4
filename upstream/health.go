package upstream

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
)

// HealthConfig configures the active health checks of every encoder.
//
// An idle sglang encoder answers GET /health by running a dummy encode, one
// GPU forward of up to 30 s; a busy one answers at once. So probes are
// spaced seconds apart and given a generous timeout, and one slow answer
// does not mark an encoder down.
type HealthConfig struct {
	// Disabled turns active checks off: every encoder counts as up.
	Disabled bool `yaml:"disabled"`
	// Path is the probed path (default /health).
	Path string `yaml:"path"`
	// Interval is the time between probes (default 10s, at least 1s).
	Interval configfile.Duration `yaml:"interval"`
	// Timeout bounds one probe (default 5s, below Interval).
	Timeout configfile.Duration `yaml:"timeout"`
	// DownAfter consecutive failed probes mark the encoder down (default 3).
	DownAfter int `yaml:"down_after"`
	// UpAfter consecutive passed probes mark it up again (default 2).
	UpAfter int `yaml:"up_after"`
}

// DefaultHealth returns the health-check defaults.
func DefaultHealth() HealthConfig {
	return HealthConfig{
		Path:      "/health",
		Interval:  configfile.Duration(10 * time.Second),
		Timeout:   configfile.Duration(5 * time.Second),
		DownAfter: 3,
		UpAfter:   2,
	}
}

// minHealthInterval is the shortest probe interval Validate accepts.
const minHealthInterval = time.Second

// Validate records c's problems in p; path is its field path ("health").
func (c HealthConfig) Validate(p *configfile.Problems, path string) {
	if c.Interval.D() < minHealthInterval {
		p.Addf(path+".interval", "must be >= %s, got %s: each probe of an idle encoder runs a GPU forward, so never probe aggressively", minHealthInterval, c.Interval)
	}
	switch {
	case c.Timeout <= 0:
		p.Addf(path+".timeout", "must be > 0, got %s", c.Timeout)
	case c.Timeout >= c.Interval:
		p.Addf(path+".timeout", "must be < interval (%s), got %s", c.Interval, c.Timeout)
	}
	if c.DownAfter < 1 {
		p.Addf(path+".down_after", "must be >= 1, got %d", c.DownAfter)
	}
	if c.UpAfter < 1 {
		p.Addf(path+".up_after", "must be >= 1, got %d", c.UpAfter)
	}
	if !strings.HasPrefix(c.Path, "/") {
		p.Addf(path+".path", "must start with \"/\", got %q", c.Path)
	}
}

// Prober checks an encoder once. It returns nil when the encoder is healthy,
// else an error that says why ("status 503", a dial error, a timeout).
type Prober func(ctx context.Context) error

// ProbeStatusError is a probe answered with a status other than 200.
type ProbeStatusError struct{ Status int }

func (e *ProbeStatusError) Error() string { return "status " + strconv.Itoa(e.Status) }

// HTTPProber returns a Prober that GETs path from the encoder through client
// (a HostClient pointed at the encoder), with Host header host, within
// timeout or ctx's deadline, whichever comes first. 200 is healthy; any
// other status is a *ProbeStatusError; failures are the client's errors (a
// timeout wraps fasthttp.ErrTimeout; the pool's dialer makes *DialError).
// When ctx ends first the prober returns ctx's error at once; the exchange
// itself ends by its deadline. Give it a HostClient of its own (a couple of
// connections, the pool's dialer) rather than the one traffic uses: a busy
// encoder whose traffic connections are all taken would otherwise fail its
// probe with fasthttp.ErrNoFreeConns, although sglang answers /health at
// once when busy.
func HTTPProber(client *fasthttp.HostClient, scheme, host, path string, timeout time.Duration) Prober {
	uri := scheme + "://" + host + path
	return func(ctx context.Context) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		deadline := time.Now().Add(timeout)
		if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
			deadline = d
		}
		req := fasthttp.AcquireRequest()
		resp := fasthttp.AcquireResponse()
		req.Header.SetMethod(fasthttp.MethodGet)
		req.SetRequestURI(uri)
		req.Header.SetHost(host)
		errc := make(chan error, 1)
		go func() {
			defer fasthttp.ReleaseRequest(req)
			defer fasthttp.ReleaseResponse(resp)
			err := client.DoDeadline(req, resp, deadline)
			if err == nil && resp.StatusCode() != fasthttp.StatusOK {
				err = &ProbeStatusError{Status: resp.StatusCode()}
			}
			errc <- err
		}()
		select {
		case err := <-errc:
			return err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// HealthSnapshot is a Health's state, for the admin API.
type HealthSnapshot struct {
	Disabled            bool      `json:"disabled,omitempty"`
	Up                  bool      `json:"up"`
	ConsecutiveFailures int       `json:"consecutive_failures"`
	ConsecutivePasses   int       `json:"consecutive_passes"`
	LastError           string    `json:"last_error,omitempty"`
	LastCheck           time.Time `json:"last_check"`
	Checks              uint64    `json:"checks"`
}

// Health runs the active checks of one encoder. Its state is safe to read
// concurrently; Run is called once.
type Health struct {
	name     string
	cfg      HealthConfig
	probe    Prober
	clk      clock.Clock
	onChange func(up bool)
	onResult func(err error)
	log      *zap.Logger

	up   atomic.Bool
	mu   sync.Mutex // protects snap and probeAtOnce
	snap HealthSnapshot
	// probeAtOnce: the first probe comes as Run starts (startDown).
	probeAtOnce bool
}

// NewHealth returns the checker of the encoder called name. It starts up:
// a fresh encoder is usable until DownAfter probes in a row have failed.
// onChange(up) is called on every up/down transition and onResult(err) after
// every probe (nil err: passed); both run on Run's goroutine, either may be
// nil. log (may be nil) records a panicking prober or callback.
func NewHealth(name string, cfg HealthConfig, probe Prober, clk clock.Clock, onChange func(up bool), onResult func(err error), log *zap.Logger) *Health {
	if log == nil {
		log = zap.NewNop()
	}
	h := &Health{name: name, cfg: cfg, probe: probe, clk: clk, onChange: onChange, onResult: onResult, log: log}
	h.up.Store(true)
	h.snap = HealthSnapshot{Disabled: cfg.Disabled, Up: true}
	return h
}

// startDown makes a checker that has not run yet start out of service, and
// its first probe come at once: a discovered encoder joins after UpAfter
// passed probes, as one coming back up does. With checks disabled it stays
// up (nothing would ever bring it back).
func (h *Health) startDown() {
	if h.cfg.Disabled {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.up.Store(false)
	h.snap.Up = false
	h.probeAtOnce = true
}

// Run probes every Interval until ctx ends; the first probe comes one
// Interval after the start (at once for a checker that starts down). It
// returns at once when checks are disabled. A panicking prober counts as a
// failed probe; a panicking callback is logged; neither stops the loop.
func (h *Health) Run(ctx context.Context) {
	if h.cfg.Disabled {
		return
	}
	h.mu.Lock()
	atOnce := h.probeAtOnce
	h.mu.Unlock()
	if atOnce {
		h.check(ctx)
	}
	for {
		t := h.clk.NewTimer(h.cfg.Interval.D())
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C():
		}
		h.check(ctx)
	}
}

// check runs one probe and applies its result.
func (h *Health) check(ctx context.Context) {
	err := h.runProbe(ctx)
	if ctx.Err() != nil {
		return // stopping: a probe cut short says nothing about the encoder
	}
	if err != nil && LocalShortage(err) {
		// This process ran out of descriptors or buffers to probe with:
		// that says nothing about the encoder either.
		h.mu.Lock()
		h.snap.LastError = "not checked: " + err.Error()
		h.mu.Unlock()
		return
	}
	var changed bool
	h.mu.Lock()
	h.snap.Checks++
	h.snap.LastCheck = h.clk.Now()
	if err == nil {
		h.snap.LastError = ""
		h.snap.ConsecutiveFailures = 0
		h.snap.ConsecutivePasses++
		if !h.snap.Up && h.snap.ConsecutivePasses >= h.cfg.UpAfter {
			h.snap.Up, changed = true, true
		}
	} else {
		h.snap.LastError = err.Error()
		h.snap.ConsecutivePasses = 0
		h.snap.ConsecutiveFailures++
		if h.snap.Up && h.snap.ConsecutiveFailures >= h.cfg.DownAfter {
			h.snap.Up, changed = false, true
		}
	}
	up := h.snap.Up
	h.up.Store(up)
	h.mu.Unlock()

	if changed && h.onChange != nil {
		h.callback("onChange", func() { h.onChange(up) })
	}
	if h.onResult != nil {
		h.callback("onResult", func() { h.onResult(err) })
	}
}

func (h *Health) runProbe(ctx context.Context) (err error) {
	pctx, cancel := context.WithTimeout(ctx, h.cfg.Timeout.D())
	defer cancel()
	defer func() {
		if r := recover(); r != nil {
			h.log.Error("health prober panicked", zap.String("encoder", h.name),
				zap.Any("panic", r), zap.Stack("stack"))
			err = fmt.Errorf("prober panicked: %v", r)
		}
	}()
	return h.probe(pctx)
}

func (h *Health) callback(what string, f func()) {
	defer func() {
		if r := recover(); r != nil {
			h.log.Error("health "+what+" callback panicked", zap.String("encoder", h.name),
				zap.Any("panic", r), zap.Stack("stack"))
		}
	}()
	f()
}

// Up reports whether the encoder passes its health checks (always true when
// they are disabled).
func (h *Health) Up() bool { return h.up.Load() }

// Snapshot returns the current state.
func (h *Health) Snapshot() HealthSnapshot {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.snap
}
