package admin

import (
	"context"
	"net"
	"net/http"
	"time"

	"github.com/encgate/encgate/internal/bearer"
)

// The sign-in form and its two routes, POST /signin and POST /signout.
// Both are same-origin form posts: the cookie is SameSite=Strict, so no
// other site's page makes a browser send it, and a post whose Origin (or
// Sec-Fetch-Site) names another site is refused before anything is read.

// DefaultCookie is the session cookie's name unless Options.Cookie says
// otherwise; the admin port is appended (encgate_admin_9090), as cookies
// are not kept apart by port and a host may run a gateway and an agent.
const DefaultCookie = "encgate_admin"

// maxFormBytes bounds a sign-in post: a token and a few bytes of encoding.
const maxFormBytes = 4 << 10

var signinPage = Parse("signin", `<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{{.Title}}: sign in</title>
<style>{{style}}
form.signin { max-width: 28em; }
form.signin input[type=password] { width: 100%; box-sizing: border-box; padding: .3em; margin: .3em 0 .6em; }
.error { background: #f7d4d4; padding: .3em .6em; border-radius: 3px; }</style>
</head>
<body>
<h1>{{.Title}}</h1>
<form class="signin" id="signin" method="post" action="/signin">
{{with .Error}}<p class="error" id="signin-error">{{.}}</p>{{end}}
<label for="token">Admin token (admin.token)</label>
<input type="password" id="token" name="token" autocomplete="current-password" required autofocus>
<button type="submit">Sign in</button>
<p class="muted">The session lasts {{.TTL}}, or until admin.token changes. Scripts send "Authorization: Bearer &lt;admin.token&gt;" instead.</p>
</form>
</body>
</html>`, nil)

type signinView struct {
	Title string
	Error string
	TTL   string
}

type signedInKey struct{}

// SignedIn reports whether r came through on a session cookie (not a
// bearer header, not an open admin listener): the page then offers
// sign-out.
func SignedIn(r *http.Request) bool {
	v, _ := r.Context().Value(signedInKey{}).(bool)
	return v
}

// cookieName is o's cookie name for r's admin port.
func (o Options) cookieName(r *http.Request) string {
	name := o.Cookie
	if name == "" {
		name = DefaultCookie
	}
	if _, port, err := net.SplitHostPort(r.Host); err == nil && port != "" && isDigits(port) {
		name += "_" + port
	}
	return name
}

func isDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

func (o Options) now() time.Time {
	if o.Clock == nil {
		return time.Now()
	}
	return o.Clock.Now()
}

func (o Options) ttl() time.Duration {
	if o.SessionTTL != nil {
		if d := o.SessionTTL(); d > 0 {
			return d
		}
	}
	return DefaultSessionTTL
}

func (o Options) title() string {
	if o.Title == "" {
		return "encgate"
	}
	return o.Title
}

// session reports whether r carries a session cookie valid for token now.
func (o Options) session(r *http.Request, token string) bool {
	c, err := r.Cookie(o.cookieName(r))
	return err == nil && VerifySession(c.Value, token, o.now())
}

// cookie is the session cookie with value, living maxAge seconds (-1
// deletes it).
func (o Options) cookie(r *http.Request, value string, maxAge int) *http.Cookie {
	return &http.Cookie{Name: o.cookieName(r), Value: value, Path: "/", MaxAge: maxAge,
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil}
}

// writeSignin serves the sign-in form with status and msg ("" for none).
func (o Options) writeSignin(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Cache-Control", "no-store")
	writePage(w, status, signinPage, signinView{Title: o.title(), Error: msg, TTL: HumanDuration(o.ttl())})
}

// sameOrigin refuses a post another site's page made: an Origin header
// that is not this listener's own, or Sec-Fetch-Site that says
// cross-site. A request with neither (curl, an old browser) passes: the
// SameSite=Strict cookie is what keeps other sites' posts unauthenticated.
func sameOrigin(r *http.Request) bool {
	if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" && site != "none" {
		return false
	}
	origin := r.Header.Get("Origin")
	if origin == "" {
		return true
	}
	scheme := "http://"
	if r.TLS != nil {
		scheme = "https://"
	}
	return origin == scheme+r.Host
}

// serveSignin checks the posted token: when it is admin.token, it sets the
// session cookie and sends the browser to the page; otherwise it shows the
// form again with an error and sets nothing.
func (o Options) serveSignin(w http.ResponseWriter, r *http.Request) {
	if !sameOrigin(r) {
		WriteError(w, http.StatusForbidden, "encgate: a sign-in must come from this admin listener's own page")
		return
	}
	token := o.Token()
	if token == "" { // nothing to sign in to
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
	if err := r.ParseForm(); err != nil {
		o.writeSignin(w, http.StatusBadRequest, "The form could not be read.")
		return
	}
	if !bearer.Equal(r.PostForm.Get("token"), token) {
		if o.Refused != nil {
			o.Refused(r, bearer.Wrong)
		}
		o.writeSignin(w, http.StatusUnauthorized, "That is not the admin token.")
		return
	}
	ttl := o.ttl()
	http.SetCookie(w, o.cookie(r, SignSession(token, o.now().Add(ttl)), int(ttl/time.Second)))
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

// serveSignout deletes the session cookie and sends the browser to the
// page (which shows the form again).
func (o Options) serveSignout(w http.ResponseWriter, r *http.Request) {
	if !sameOrigin(r) {
		WriteError(w, http.StatusForbidden, "encgate: a sign-out must come from this admin listener's own page")
		return
	}
	http.SetCookie(w, o.cookie(r, "", -1))
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

func withSignedIn(r *http.Request) *http.Request {
	return r.WithContext(context.WithValue(r.Context(), signedInKey{}, true))
}
