package admin

import (
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/encgate/encgate/internal/bearer"
	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/sglang"
)

// Registry is where a gateway or an agent registers its metrics and what
// its /metrics serves: a *prometheus.Registry, or one wrapped to see each
// collector registered (docs/refgen lists the metrics that way).
type Registry interface {
	prometheus.Registerer
	prometheus.Gatherer
}

// Options describe one admin listener: the gateway's or the agent's.
type Options struct {
	// Registry is what /metrics serves.
	Registry Registry
	// Ready answers /readyz: 200 "ready" while it is true (and Checks
	// pass), else 503; /readyz?verbose lists it as the "shutdown" check.
	Ready func() bool
	// Checks, when set, are the other conditions /readyz?verbose lists
	// (readyz.go); only those not Advisory make /readyz fail.
	Checks func() []Check
	// Token is admin.token as it is now ("": the protected routes are
	// open); it is read per request, so a reload changes it at once.
	Token func() string
	// Realm is the Bearer challenge's realm on a 401.
	Realm string
	// Refused, when set, is told of each request answered 401 (a counter,
	// a debug line), a wrong token posted to the sign-in form included.
	Refused func(r *http.Request, o bearer.Outcome)
	// SessionTTL is how long a sign-in lasts (admin.session_ttl), read at
	// each sign-in; nil or 0 means DefaultSessionTTL.
	SessionTTL func() time.Duration
	// Clock tells the sessions' time; nil means the wall clock.
	Clock clock.Clock
	// Cookie names the session cookie (DefaultCookie when empty); the
	// admin port is appended.
	Cookie string
	// Title heads the sign-in form ("encgate" when empty).
	Title string
}

// NewMux returns the routes every admin listener serves; protect, which
// adds a route of the caller's behind admin.token; and page, which adds a
// page for a person's browser behind it. /healthz and /readyz stay open
// for probes, and /metrics for scrapers (its labels are bounded: never a
// req_id or a URL); the status page, /admin/... and Go's profiler under
// /debug/pprof/ (heap, goroutine stacks and the command line are in there)
// need, when admin.token is set, the bearer token or the session cookie
// that signing in with it sets (POST /signin; POST /signout ends it).
// Without either a page answers 401 with the sign-in form, any other route
// 401 with the JSON error envelope.
func NewMux(o Options) (mux *http.ServeMux, protect, page func(pattern string, h http.HandlerFunc)) {
	mux = http.NewServeMux()
	protect = func(pattern string, h http.HandlerFunc) { mux.Handle(pattern, requireToken(o, h, false)) }
	page = func(pattern string, h http.HandlerFunc) { mux.Handle(pattern, requireToken(o, h, true)) }
	mux.HandleFunc("GET /signin", func(w http.ResponseWriter, r *http.Request) {
		if t := o.Token(); t == "" || o.session(r, t) {
			http.Redirect(w, r, "/", http.StatusSeeOther)
			return
		}
		o.writeSignin(w, http.StatusOK, "")
	})
	mux.HandleFunc("POST /signin", o.serveSignin)
	mux.HandleFunc("POST /signout", o.serveSignout)
	mux.Handle("GET /metrics", promhttp.HandlerFor(o.Registry, promhttp.HandlerOpts{Registry: o.Registry}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", serveReadyz(o))
	protect("GET /debug/pprof/", pprof.Index)
	protect("GET /debug/pprof/cmdline", pprof.Cmdline)
	protect("GET /debug/pprof/profile", pprof.Profile)
	protect("GET /debug/pprof/symbol", pprof.Symbol)
	protect("GET /debug/pprof/trace", pprof.Trace)
	return mux, protect, page
}

// requireToken lets a request through to h when the token is unset, the
// request carries "Authorization: Bearer <token>" (the scheme in any case,
// RFC 7235), or it carries no Authorization and a session cookie signed
// with the token that has not expired; otherwise it answers 401 with a
// Bearer challenge (RFC 6750) and, on a page, the sign-in form, else the
// encoder's error envelope. bearer.Authorize compares in constant time,
// as SHA-256 digests, so that not even the length leaks; the cookie's
// signature is compared with hmac.Equal.
func requireToken(o Options, h http.Handler, page bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token := o.Token()
		out := bearer.Authorize(r.Header.Get("Authorization"), token)
		if out == bearer.Allowed {
			h.ServeHTTP(w, r)
			return
		}
		if out == bearer.Missing && o.session(r, token) {
			h.ServeHTTP(w, withSignedIn(r))
			return
		}
		if o.Refused != nil {
			o.Refused(r, out)
		}
		w.Header().Set("WWW-Authenticate", bearer.Challenge(o.Realm, out))
		if page && out == bearer.Missing {
			o.writeSignin(w, http.StatusUnauthorized, "")
			return
		}
		msg := `encgate: this admin route needs "Authorization: Bearer <admin.token>"`
		if out == bearer.Wrong {
			msg = "encgate: the bearer token is not admin.token"
		}
		WriteError(w, http.StatusUnauthorized, msg)
	})
}

// WriteError answers an admin request with the encoder's error envelope.
func WriteError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(sglang.AppendEnvelope(nil, msg, nil))
}
