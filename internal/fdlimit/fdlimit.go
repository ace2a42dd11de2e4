// Package fdlimit fits what a process can be made to hold open into its
// RLIMIT_NOFILE: it raises the soft limit towards the hard one where that
// makes the need fit, and says so, with the numbers, where nothing can.
//
// Go itself already raises the soft limit at start: on Linux (and the other
// Unixes) the syscall package's init sets it to the hard limit minus one
// (minus one so that a later prlimit(1) to exactly the hard limit can be
// told apart), and restores the original soft limit in child processes it
// starts (go.dev/issue/46279). So a process normally finds soft = hard-1
// here, and Ensure raises it only for a need of exactly the hard limit, or
// where something lowered the soft limit after Go's init (a prlimit, a
// library). Setting the limit through this package (syscall.Setrlimit)
// also stops Go from restoring the original limit in children: they then
// inherit the raised one, which no encgate role minds.
package fdlimit

import (
	"errors"
	"fmt"
)

// Limits reads and sets a process's RLIMIT_NOFILE. Process is this
// process's; tests pass their own.
type Limits interface {
	Get() (soft, hard uint64, err error)
	Set(soft, hard uint64) error
}

// ErrUnsupported is Process's error where the platform has no
// RLIMIT_NOFILE this package knows how to read.
var ErrUnsupported = errors.New("fdlimit: RLIMIT_NOFILE is not supported on this platform")

// Unlimited reports whether a limit is RLIM_INFINITY: ^0 on Linux,
// 1<<63-1 on macOS.
func Unlimited(n uint64) bool { return n >= 1<<63-1 }

// Result is what Ensure found and did.
type Result struct {
	Need uint64 // descriptors the caller can be made to hold open
	Was  uint64 // the soft limit found
	Soft uint64 // the soft limit now (Was unless raised)
	Hard uint64 // the hard limit
}

// Raised reports whether Ensure raised the soft limit.
func (r Result) Raised() bool { return r.Soft != r.Was }

// TooSmallError says that need cannot fit: it is above the hard limit, or
// the soft limit could not be raised to it.
type TooSmallError struct {
	Need, Soft, Hard uint64
	Err              error // why raising failed; nil when need > Hard
}

func (e *TooSmallError) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("need %d descriptors; RLIMIT_NOFILE is %d (hard limit %s) and raising it failed: %v",
			e.Need, e.Soft, Format(e.Hard), e.Err)
	}
	return fmt.Sprintf("need %d descriptors; RLIMIT_NOFILE's hard limit is %s (soft %d)", e.Need, Format(e.Hard), e.Soft)
}

func (e *TooSmallError) Unwrap() error { return e.Err }

// Format writes a limit, "unlimited" for RLIM_INFINITY.
func Format(n uint64) string {
	if Unlimited(n) {
		return "unlimited"
	}
	return fmt.Sprint(n)
}

// Check reports whether need fits under l's hard limit, without changing
// anything (what Ensure would do, for a dry run such as --check).
func Check(need uint64, l Limits) (Result, error) {
	soft, hard, err := l.Get()
	if err != nil {
		return Result{Need: need}, err
	}
	r := Result{Need: need, Was: soft, Soft: soft, Hard: hard}
	if need > hard {
		return r, &TooSmallError{Need: need, Soft: soft, Hard: hard}
	}
	return r, nil
}

// Ensure makes l's soft limit at least need. Where the soft limit is below
// need, it raises it to the hard limit (the headroom costs nothing: the
// kernel allocates descriptor tables as they grow), or to need where the
// hard limit is unlimited or refused (macOS caps the soft limit below an
// unlimited hard one). A need above the hard limit is a *TooSmallError.
func Ensure(need uint64, l Limits) (Result, error) {
	r, err := Check(need, l)
	if err != nil || need <= r.Soft {
		return r, err
	}
	targets := []uint64{r.Hard, need}
	if Unlimited(r.Hard) {
		targets = targets[1:]
	}
	var setErr error
	for _, t := range targets {
		if setErr = l.Set(t, r.Hard); setErr == nil {
			r.Soft = t
			return r, nil
		}
	}
	return r, &TooSmallError{Need: need, Soft: r.Soft, Hard: r.Hard, Err: setErr}
}
