package admin

import (
	"errors"
	"net/http"
	"strings"
)

// Check is one condition /readyz?verbose lists, after "shutdown" (Ready).
type Check struct {
	// Name is the check's name on its line: "[+]<name> ok".
	Name string
	// Err is why the check fails; nil when it passes.
	Err error
	// Advisory marks a check that /readyz lists but does not depend on:
	// failing, it is listed "[-]... failed" while /readyz stays 200. For
	// what a replica serves part of its traffic without (the gateway's
	// /send store): taking the replica out of its Service would stop the
	// rest too, on every replica at once when the failure is shared.
	Advisory bool
}

// errNotServing is the shutdown check's failure: Ready is false before the
// listeners serve and once draining has begun.
var errNotServing = errors.New("not serving: starting, or draining after SIGTERM")

// serveReadyz answers /readyz from o.Ready and o.Checks: 200 "ready" when
// every check that is not advisory passes, else 503 "not ready". With
// ?verbose (any value, as Kubernetes' /readyz?verbose) the body lists every
// check, one a line in plain text, "[+]<name> ok" or "[-]<name> failed:
// <reason>", then "readyz check passed" or "readyz check failed"; the
// status is the same.
func serveReadyz(o Options) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		checks := []Check{{Name: "shutdown"}}
		if !o.Ready() {
			checks[0].Err = errNotServing
		}
		if o.Checks != nil {
			checks = append(checks, o.Checks()...)
		}
		ready := true
		for _, c := range checks {
			ready = ready && (c.Err == nil || c.Advisory)
		}
		if !r.URL.Query().Has("verbose") {
			if !ready {
				http.Error(w, "not ready", http.StatusServiceUnavailable)
				return
			}
			_, _ = w.Write([]byte("ready\n"))
			return
		}
		var b strings.Builder
		for _, c := range checks {
			switch {
			case c.Err == nil:
				b.WriteString("[+]" + c.Name + " ok\n")
			case c.Advisory:
				b.WriteString("[-]" + c.Name + " failed: " + oneLine(c.Err.Error()) + " (advisory: readiness does not depend on it)\n")
			default:
				b.WriteString("[-]" + c.Name + " failed: " + oneLine(c.Err.Error()) + "\n")
			}
		}
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		if ready {
			b.WriteString("readyz check passed\n")
		} else {
			w.WriteHeader(http.StatusServiceUnavailable)
			b.WriteString("readyz check failed\n")
		}
		_, _ = w.Write([]byte(b.String()))
	}
}

// oneLine keeps a reason on its check's line.
func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}
