package fakeencoder

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"sync"
	"time"

	"github.com/encgate/encgate/internal/urlhint"
)

// Self-registration with a language-only server's EncoderBootstrapServer,
// as sglang's encoder does with --encoder-register-urls (protocol reference
// §1.7): a background loop per bootstrap URL POSTs
// {bootstrap}/register_encoder_url until one answers 200, and leaving sends
// DELETE {bootstrap}/unregister_encoder_url, so a test can grow and shrink
// a fleet that a gateway discovers instead of configuring it. The route is
// joined onto the bootstrap URL exactly as sglang's f-string does, nothing
// trimmed or escaped: a URL with a path (encgate's /t/<token>) keeps it,
// and one with a trailing slash sends "//register_encoder_url", as sglang
// would.

// Bootstrap server paths the fake calls.
const (
	PathRegisterEncoder   = "/register_encoder_url"
	PathUnregisterEncoder = "/unregister_encoder_url"
)

// registrar is the registration state of one Encoder.
type registrar struct {
	// mu serialises Register and Unregister, so that a leave's DELETEs can
	// never overtake the POSTs of a join that started after it.
	mu      sync.Mutex
	session *regSession // the running or finished join; nil when not joined
	client  *http.Client
}

// regSession is one join: a registration loop per bootstrap URL.
type regSession struct {
	cancel context.CancelFunc
	done   chan struct{} // closed once every loop has returned
	body   []byte        // {"url": advertise}
}

// registrationBody is the JSON body of both registration calls.
type registrationBody struct {
	URL string `json:"url"`
}

// closedChan is a channel that is always closed.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// newRegistrationClient returns the client for bootstrap calls. It keeps no
// idle connections: a registration is one call every few seconds at most,
// and a kept connection would outlive Close.
func newRegistrationClient() *http.Client {
	return &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
}

// advertiseURL is the URL the fake registers: Options.AdvertiseURL, or its
// own URL once started; "" before Start without AdvertiseURL.
func (e *Encoder) advertiseURL() string {
	if e.opts.AdvertiseURL != "" {
		return e.opts.AdvertiseURL
	}
	if e.Addr() == "" {
		return ""
	}
	return e.URL()
}

// Register joins the fleets of Options.RegisterURLs: for each bootstrap URL
// a background loop POSTs {bootstrap}/register_encoder_url with
// {"url": AdvertiseURL} (RegistrationTimeout per call) until it answers
// 200, waiting RegistrationInterval between attempts and giving up after
// RegistrationAttempts. Start calls it; call it again after Unregister to
// rejoin. It does nothing while joined or without RegisterURLs, and fails
// once closed or when there is no URL to advertise (not started and no
// AdvertiseURL).
func (e *Encoder) Register() error {
	if len(e.opts.RegisterURLs) == 0 {
		return nil
	}
	e.reg.mu.Lock()
	defer e.reg.mu.Unlock()
	if e.isClosed() {
		return errors.New("fakeencoder: closed")
	}
	if e.reg.session != nil {
		return nil
	}
	adv := e.advertiseURL()
	if adv == "" {
		return errors.New("fakeencoder: nothing to advertise: not started and no AdvertiseURL")
	}
	body, err := json.Marshal(registrationBody{URL: adv})
	if err != nil {
		return fmt.Errorf("fakeencoder: registration body: %w", err)
	}
	ctx, cancel := context.WithCancel(e.ctx)
	s := &regSession{cancel: cancel, done: make(chan struct{}), body: body}
	var wg sync.WaitGroup
	for _, b := range e.opts.RegisterURLs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.registerLoop(ctx, b, body)
		}()
	}
	go func() {
		wg.Wait()
		close(s.done)
	}()
	e.reg.session = s
	return nil
}

// isClosed reports whether Close has begun.
func (e *Encoder) isClosed() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.closed
}

// registerLoop registers with one bootstrap server until it answers 200,
// the attempts run out or ctx ends.
func (e *Encoder) registerLoop(ctx context.Context, bootstrap string, body []byte) {
	target := bootstrap + PathRegisterEncoder // sglang's f"{url}/register_encoder_url", nothing trimmed
	for attempt := 1; attempt <= e.opts.RegistrationAttempts; attempt++ {
		if attempt > 1 {
			t := time.NewTimer(e.opts.RegistrationInterval)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
		}
		e.mu.Lock()
		e.stats.regAttempts++
		e.mu.Unlock()
		if e.bootstrapCall(ctx, http.MethodPost, target, body, e.opts.RegistrationTimeout) == nil {
			e.mu.Lock()
			e.stats.regOK++
			e.mu.Unlock()
			return
		}
		if ctx.Err() != nil {
			return
		}
	}
}

// bootstrapCall sends one JSON call to a bootstrap server within timeout;
// nil only for a 200.
func (e *Encoder) bootstrapCall(ctx context.Context, method, target string, body []byte, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, target, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := e.reg.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s %s: status %d", method, target, resp.StatusCode)
	}
	return nil
}

// RegistrationDone returns a channel closed once the current join's loops
// have all ended (registered, given up, or stopped by Unregister or Close).
// It is closed already when the encoder is not joined. Tests wait on it
// before reading the registration counters in Stats.
func (e *Encoder) RegistrationDone() <-chan struct{} {
	e.reg.mu.Lock()
	defer e.reg.mu.Unlock()
	if e.reg.session == nil {
		return closedChan
	}
	return e.reg.session.done
}

// Unregister leaves the fleets while the encoder keeps serving, as an
// sglang encoder does at exit: it stops the registration loops, then sends
// DELETE {bootstrap}/unregister_encoder_url with the registration body to
// every bootstrap URL, registered with or not (UnregistrationTimeout each,
// all at once, within ctx). Each 200 counts in Stats.Unregistrations; the
// other outcomes come back joined in the error. It does nothing when not
// joined (never started, or already left); Register rejoins. Close calls
// it before closing the listener.
func (e *Encoder) Unregister(ctx context.Context) error {
	e.reg.mu.Lock()
	defer e.reg.mu.Unlock()
	s := e.reg.session
	if s == nil {
		return nil
	}
	e.reg.session = nil
	s.cancel()
	<-s.done
	errs := make([]error, len(e.opts.RegisterURLs))
	var wg sync.WaitGroup
	for i, b := range e.opts.RegisterURLs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			target := b + PathUnregisterEncoder
			if errs[i] = e.bootstrapCall(ctx, http.MethodDelete, target, s.body, e.opts.UnregistrationTimeout); errs[i] == nil {
				e.mu.Lock()
				e.stats.unregs++
				e.mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("fakeencoder: unregister: %w", err)
	}
	return nil
}

// parseBootstrapURL checks a --register-url value: an absolute http or
// https URL with a host and no query, as sglang appends the paths to it.
func parseBootstrapURL(s string) (string, error) {
	if hint := urlhint.Problem(s); hint != "" {
		return "", fmt.Errorf("bad bootstrap URL: %s", hint)
	}
	u, err := url.Parse(s)
	if err != nil {
		return "", fmt.Errorf("bad bootstrap URL %q: %w", s, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
		return "", fmt.Errorf("bad bootstrap URL %q: want http(s)://host:port", s)
	}
	return s, nil
}
