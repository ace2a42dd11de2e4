package listener

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/fdlimit"
)

// DescriptorMargin is what the process opens for itself besides the
// connections the config bounds: stdin, stdout and stderr, the poller's
// epoll and wake-up descriptors, the process collector's /proc reads, the
// config file on a reload, DNS lookups of encoder hosts, pprof. An idle
// gateway holds about ten; the rest is room.
const DescriptorMargin = 64

// DescriptorPart is one term of what a config can hold open.
type DescriptorPart struct {
	Key  string // the config key that sizes it; "" for what no key changes
	What string // what it is, for the log and the error
	N    uint64
}

// DescriptorReport is what a config can make the gateway hold open at once,
// term by term, against RLIMIT_NOFILE.
type DescriptorReport struct {
	Parts  []DescriptorPart
	Limits fdlimit.Result // Need is the sum of Parts
	// Checked is false where the platform has no RLIMIT_NOFILE to compare
	// with (fdlimit.ErrUnsupported).
	Checked bool
}

// DescriptorError is a config that cannot fit in RLIMIT_NOFILE. It is a
// config error: main exits 2 for it, as for an invalid file.
type DescriptorError struct {
	Report DescriptorReport
	Err    *fdlimit.TooSmallError
}

func (e *DescriptorError) Error() string {
	r := e.Report
	var keys []string
	parts := append([]DescriptorPart(nil), r.Parts...)
	sort.SliceStable(parts, func(i, j int) bool { return parts[i].N > parts[j].N })
	seen := map[string]bool{}
	for _, p := range parts {
		if p.Key != "" && !seen[p.Key] {
			seen[p.Key] = true
			keys = append(keys, p.Key)
		}
	}
	why := fmt.Sprintf("more than its hard limit %s allows (soft %d)", fdlimit.Format(e.Err.Hard), e.Err.Soft)
	if e.Err.Err != nil {
		why = fmt.Sprintf("more than its soft limit %d, which could not be raised (hard %s): %v",
			e.Err.Soft, fdlimit.Format(e.Err.Hard), e.Err.Err)
	}
	return fmt.Sprintf("RLIMIT_NOFILE: the config can hold %d descriptors open at once (%s), %s; "+
		"lower %s, or raise the hard limit (ulimit -Hn, systemd LimitNOFILE=, docker --ulimit nofile=)",
		r.Limits.Need, r.terms(), why, orList(keys))
}

func (e *DescriptorError) Unwrap() error { return e.Err }

// String is the one-line summary that --check prints.
func (r DescriptorReport) String() string {
	if !r.Checked {
		return fmt.Sprintf("descriptors: the config can hold %d open at once (%s); RLIMIT_NOFILE is not known on this platform",
			r.Limits.Need, r.terms())
	}
	return fmt.Sprintf("descriptors: the config can hold %d open at once (%s); RLIMIT_NOFILE here is %d (hard %s)",
		r.Limits.Need, r.terms(), r.Limits.Soft, fdlimit.Format(r.Limits.Hard))
}

// terms writes the parts as "limits.max_conns 10000 + ...".
func (r DescriptorReport) terms() string {
	var b strings.Builder
	for i, p := range r.Parts {
		if i > 0 {
			b.WriteString(" + ")
		}
		fmt.Fprintf(&b, "%s %d", p.What, p.N)
	}
	return b.String()
}

func orList(keys []string) string {
	switch len(keys) {
	case 0:
		return "the limits"
	case 1:
		return keys[0]
	}
	return strings.Join(keys[:len(keys)-1], ", ") + " or " + keys[len(keys)-1]
}

// Budget compares what parts can make the process hold open with
// RLIMIT_NOFILE (l; nil: this process's). With raise, it raises the soft
// limit towards the hard one where that makes the config fit (New does);
// without, it only says whether it would fit (--check). A config that
// cannot fit is a *DescriptorError. Where the platform has no RLIMIT_NOFILE,
// the report says so and the error is nil.
func Budget(parts []DescriptorPart, l fdlimit.Limits, raise bool) (DescriptorReport, error) {
	if l == nil {
		l = fdlimit.Process
	}
	r := DescriptorReport{Parts: parts}
	var need uint64
	for _, p := range r.Parts {
		need += p.N
	}
	check := fdlimit.Check
	if raise {
		check = fdlimit.Ensure
	}
	res, err := check(need, l)
	r.Limits = res
	var tooSmall *fdlimit.TooSmallError
	switch {
	case err == nil:
		r.Checked = true
		return r, nil
	case errors.Is(err, fdlimit.ErrUnsupported):
		return r, nil
	case errors.As(err, &tooSmall):
		r.Checked = true
		return r, &DescriptorError{Report: r, Err: tooSmall}
	}
	return r, fmt.Errorf("reading RLIMIT_NOFILE: %w", err)
}

// LogDescriptors logs the figures the gateway starts with.
func LogDescriptors(log *zap.Logger, r DescriptorReport) {
	if !r.Checked {
		log.Warn("descriptors: RLIMIT_NOFILE is not known on this platform; not checked",
			zap.Uint64("need", r.Limits.Need), zap.String("terms", r.terms()))
		return
	}
	log.Info("descriptors: the config fits RLIMIT_NOFILE",
		zap.Uint64("need", r.Limits.Need), zap.Uint64("soft_limit", r.Limits.Soft),
		zap.String("hard_limit", fdlimit.Format(r.Limits.Hard)), zap.Bool("raised", r.Limits.Raised()),
		zap.Uint64("soft_limit_found", r.Limits.Was), zap.String("terms", r.terms()))
}
