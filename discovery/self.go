package discovery

import (
	"context"
	"errors"
)

// SelfCheck tells the registry whether an encoder URL (normalised, as
// ParseEncoderURL returns it) is the gateway itself: one of its own
// listeners, by address, interface or a name that resolves to one. A
// non-empty reason (a phrase such as "is this gateway's own listen address
// (127.0.0.1:8080)") refuses the registration. The gateway supplies it;
// discovery knows nothing of the gateway's listeners. It may resolve names
// within ctx and must bound the time it takes.
type SelfCheck func(ctx context.Context, url string) (reason string)

// ErrSelf is matched (errors.Is) by the error Register returns for a URL
// that SelfCheck says is the gateway itself. It matches ErrInvalidURL too:
// the bootstrap API answers it 400 with the reason, and nothing joins.
var ErrSelf = errors.New("encoder url is this gateway itself")

// selfURLError is the refusal of a URL that is the gateway itself.
type selfURLError struct{ encoderURLError }

// Is makes errors.Is(err, ErrSelf) and errors.Is(err, ErrInvalidURL) true.
func (e *selfURLError) Is(target error) bool { return target == ErrSelf || target == ErrInvalidURL }

// SetSelfCheck makes Register refuse the URLs f says are the gateway
// itself. Call it before the registry serves its first registration.
func (r *Registry) SetSelfCheck(f SelfCheck) { r.self = f }

// checkSelf is the refusal of u when it is the gateway itself, else nil.
func (r *Registry) checkSelf(ctx context.Context, u string) error {
	if r.self == nil {
		return nil
	}
	if why := r.self(ctx, u); why != "" {
		return &selfURLError{encoderURLError{raw: u, problem: why}}
	}
	return nil
}
