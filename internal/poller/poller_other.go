//go:build !linux

package poller

// Poller is unavailable off Linux: New fails, and callers keep a goroutine
// per held request.
type Poller struct{}

// New returns ErrUnsupported.
func New() (*Poller, error) { return nil, ErrUnsupported }

// Watch is never reached.
func (p *Poller) Watch(int, func(Event)) (Watch, error) { return Watch{}, ErrUnsupported }

// Stop is never reached.
func (p *Poller) Stop(Watch) bool { return false }

// Armed is 0.
func (p *Poller) Armed() int { return 0 }

// Close does nothing.
func (p *Poller) Close() error { return nil }
