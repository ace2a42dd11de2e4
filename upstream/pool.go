// Package upstream is the encoder pool: the encoders and their connections,
// rendezvous selection, req_id affinity (pins), and the classification of
// upstream failures.
package upstream

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/url"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/valyala/fasthttp"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
)

// Encoder is one encoder of the fleet and the gateway's connections to it.
type Encoder struct {
	Name string
	URL  string

	hash   uint64
	host   string // Host header and address, host:port
	scheme string // http or https
	client *fasthttp.HostClient

	inflight atomic.Int64
	requests atomic.Uint64
	usable   atomic.Bool
}

// Inflight returns the number of exchanges in progress with e.
func (e *Encoder) Inflight() int64 { return e.inflight.Load() }

// Requests returns the number of exchanges started with e.
func (e *Encoder) Requests() uint64 { return e.requests.Load() }

// Usable reports whether e may receive new work.
func (e *Encoder) Usable() bool { return e.usable.Load() }

// SetUsable marks e usable or not (health checks and breakers drive this).
func (e *Encoder) SetUsable(ok bool) { e.usable.Store(ok) }

// Do sends req to e and reads the answer into resp within timeout. The
// caller sets method, path, headers and body; Do sets the host. A connect
// failure is a *DialError; a timeout wraps fasthttp.ErrTimeout. A request
// that meets a pooled connection the encoder had already closed is sent on
// another connection: provably nothing of it was delivered.
func (e *Encoder) Do(req *fasthttp.Request, resp *fasthttp.Response, timeout time.Duration) error {
	e.inflight.Add(1)
	e.requests.Add(1)
	defer e.inflight.Add(-1)
	req.Header.SetHost(e.host)
	req.URI().SetScheme(e.scheme)
	resp.Header.SetNoDefaultContentType(true)
	deadline := time.Now().Add(timeout)
	for attempt := 0; ; attempt++ {
		err := e.client.DoDeadline(req, resp, deadline)
		if err == nil || !IsStale(err) || attempt == maxStaleRetries {
			return err
		}
	}
}

// maxStaleRetries bounds re-sends after stale pooled connections; each
// closes the stale connection, so the pool drains quickly.
const maxStaleRetries = 8

// Pool holds the fleet and the pin table. It is safe for concurrent use.
type Pool struct {
	log  *zap.Logger
	clk  clock.Clock
	aff  AffinityConfig
	Pins *PinTable

	list   []*Encoder
	byName map[string]*Encoder

	cancel context.CancelFunc
	done   chan struct{}
}

// NewPool builds the pool and starts its pin sweeper; Close stops it.
func NewPool(encs []EncoderConfig, aff AffinityConfig, cc ClientConfig, clk clock.Clock, log *zap.Logger) (*Pool, error) {
	p := &Pool{
		log:    log,
		clk:    clk,
		aff:    aff,
		Pins:   NewPinTable(aff.PinTTL.D(), aff.MaxPins, clk),
		byName: make(map[string]*Encoder, len(encs)),
		done:   make(chan struct{}),
	}
	for _, ec := range encs {
		e, err := newEncoder(ec, cc)
		if err != nil {
			return nil, err
		}
		p.list = append(p.list, e)
		p.byName[e.Name] = e
	}
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	go p.sweep(ctx)
	return p, nil
}

func newEncoder(ec EncoderConfig, cc ClientConfig) (*Encoder, error) {
	u, err := url.Parse(ec.URL)
	if err != nil {
		return nil, err
	}
	e := &Encoder{Name: ec.Name, URL: ec.URL, hash: xxhash.Sum64String(ec.Name), host: u.Host, scheme: u.Scheme}
	connectTimeout := cc.ConnectTimeout.D()
	dialer := &net.Dialer{Timeout: connectTimeout, KeepAlive: 30 * time.Second}
	isTLS := u.Scheme == "https"
	e.client = &fasthttp.HostClient{
		Addr:                      u.Host,
		Name:                      u.Scheme,
		IsTLS:                     isTLS,
		TLSConfig:                 &tls.Config{MinVersion: tls.VersionTLS12},
		MaxConns:                  cc.MaxConnsPerEncoder,
		MaxIdleConnDuration:       cc.IdleConnTimeout.D(),
		MaxResponseBodySize:       int(cc.MaxResponseBytes),
		MaxIdemponentCallAttempts: 1,
		// Never let the client retry on its own: whether a request may be
		// sent again is the gateway's decision (see DESIGN.md).
		RetryIfErr:               func(*fasthttp.Request, int, error) (bool, bool) { return false, false },
		NoDefaultUserAgentHeader: true,
		DisablePathNormalizing:   true,
		Dial: func(addr string) (net.Conn, error) {
			c, err := dialer.Dial("tcp", addr)
			if err != nil {
				return nil, &DialError{Encoder: ec.Name, Err: err}
			}
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetNoDelay(true)
			}
			return newProbedConn(c), nil
		},
	}
	e.usable.Store(true)
	return e, nil
}

// Encoders returns the fleet in configuration order.
func (p *Pool) Encoders() []*Encoder { return p.list }

// Lookup returns the encoder called name.
func (p *Pool) Lookup(name string) (*Encoder, bool) {
	e, ok := p.byName[name]
	return e, ok
}

// Ranked appends the usable encoders to dst in rendezvous order for reqID.
func (p *Pool) Ranked(reqID string, dst []*Encoder) []*Encoder {
	var buf [16]*Encoder
	usable := buf[:0]
	for _, e := range p.list {
		if e.Usable() {
			usable = append(usable, e)
		}
	}
	return rank(reqID, usable, dst)
}

// Owner returns the first usable encoder in rendezvous order for reqID.
func (p *Pool) Owner(reqID string) (*Encoder, error) {
	var buf [16]*Encoder
	r := p.Ranked(reqID, buf[:0])
	if len(r) == 0 {
		return nil, ErrNoEncoder
	}
	return r[0], nil
}

// AnyUsable reports whether at least one encoder is usable.
func (p *Pool) AnyUsable() bool {
	for _, e := range p.list {
		if e.Usable() {
			return true
		}
	}
	return false
}

// Route returns the encoder that holds reqID: its pin, waiting up to
// affinity.unknown_wait for one, else the rendezvous owner. A pin that
// records a failed /encode is returned with a nil encoder and ok pin.Failed.
func (p *Pool) Route(reqID string, done <-chan struct{}) (*Encoder, Pin, error) {
	pin, ok := p.Pins.Wait(reqID, p.aff.UnknownWait.D(), done)
	if !ok {
		e, err := p.Owner(reqID)
		return e, Pin{}, err
	}
	if pin.Failed {
		return nil, pin, nil
	}
	e, found := p.byName[pin.Encoder]
	if !found {
		return nil, pin, &UnknownEncoderError{Name: pin.Encoder}
	}
	return e, pin, nil
}

func (p *Pool) sweep(ctx context.Context) {
	defer close(p.done)
	defer func() {
		if r := recover(); r != nil {
			p.log.Error("pin sweeper panicked", zap.Any("panic", r), zap.Stack("stack"))
		}
	}()
	every := p.aff.PinTTL.D() / 8
	for {
		t := p.clk.NewTimer(every)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C():
			p.Pins.Sweep()
		}
	}
}

// Close stops the sweeper and closes idle connections.
func (p *Pool) Close() {
	p.cancel()
	<-p.done
	for _, e := range p.list {
		e.client.CloseIdleConnections()
	}
}

// IsTimeout reports whether err is an upstream timeout.
func IsTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, fasthttp.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) ||
		(errors.As(err, &ne) && ne.Timeout())
}
