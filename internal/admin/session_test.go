package admin

import (
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/encgate/encgate/internal/bearer"
	"github.com/encgate/encgate/internal/clock"
)

const sessionToken = "session-admin-token-0123456789"

// A session signed with the token verifies until its expiry, to the
// second, and no longer; not with another token (a rotation); not once
// any part of it is changed.
func TestSessionSignAndVerify(t *testing.T) {
	now := time.Date(2026, 12, 6, 4, 0, 0, 0, time.UTC)
	exp := now.Add(12 * time.Hour)
	v := SignSession(sessionToken, exp)
	if !VerifySession(v, sessionToken, now) {
		t.Fatalf("a fresh session %q does not verify", v)
	}
	if !VerifySession(v, sessionToken, exp.Add(-time.Second)) {
		t.Error("a session does not verify a second before its expiry")
	}
	if VerifySession(v, sessionToken, exp) || VerifySession(v, sessionToken, exp.Add(time.Hour)) {
		t.Error("a session verifies at or after its expiry")
	}
	if VerifySession(v, "another-admin-token-0123456789", now) {
		t.Error("a session verifies under another token: a rotation would not end it")
	}
	if VerifySession(v, "", now) {
		t.Error("a session verifies with no token set")
	}
	if strings.Contains(v, sessionToken) {
		t.Error("the cookie carries the token")
	}
	// Tampered: a later expiry with the old signature, each byte of the
	// signature changed, a truncation, another version, junk.
	parts := strings.Split(v, ".")
	later := parts[0] + "." + "9" + parts[1] + "." + parts[2]
	tampered := []string{later, v[:len(v)-1], "v2" + v[2:], "", "v1", "v1..", "v1.x." + parts[2], v + "A"}
	for i := range parts[2] {
		b := []byte(parts[2])
		b[i] ^= 0x01
		tampered = append(tampered, parts[0]+"."+parts[1]+"."+string(b))
	}
	for _, x := range tampered {
		if VerifySession(x, sessionToken, now) {
			t.Errorf("tampered session %q verifies", x)
		}
	}
	// The key is derived: not the token, and fixed for a token.
	if string(SessionKey(sessionToken)) == sessionToken || string(SessionKey(sessionToken)) != string(SessionKey(sessionToken)) {
		t.Error("SessionKey is not a fixed derivation of the token")
	}
}

type signinHarness struct {
	t       *testing.T
	mux     *http.ServeMux
	clk     *clock.Fake
	token   string
	refused []bearer.Outcome
}

func newSigninHarness(t *testing.T) *signinHarness {
	h := &signinHarness{t: t, clk: clock.NewFake(time.Date(2026, 12, 6, 4, 0, 0, 0, time.UTC)), token: sessionToken}
	mux, protect, page := NewMux(Options{Registry: prometheus.NewRegistry(), Ready: func() bool { return true },
		Token: func() string { return h.token }, Realm: "test admin", Clock: h.clk,
		SessionTTL: func() time.Duration { return time.Hour }, Cookie: "test_admin",
		Refused: func(_ *http.Request, o bearer.Outcome) { h.refused = append(h.refused, o) }})
	page("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		if SignedIn(r) {
			_, _ = io.WriteString(w, "page, signed in")
			return
		}
		_, _ = io.WriteString(w, "page")
	})
	protect("GET /admin/x", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "x") })
	h.mux = mux
	return h
}

func (h *signinHarness) do(method, path string, form url.Values, hdr http.Header, cookies ...*http.Cookie) *httptest.ResponseRecorder {
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	r := httptest.NewRequest(method, "http://127.0.0.1:9090"+path, body)
	if form != nil {
		r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for k, v := range hdr {
		r.Header[k] = v
	}
	for _, c := range cookies {
		r.AddCookie(c)
	}
	w := httptest.NewRecorder()
	h.mux.ServeHTTP(w, r)
	return w
}

func sessionCookie(t *testing.T, w *httptest.ResponseRecorder) *http.Cookie {
	t.Helper()
	for _, c := range w.Result().Cookies() {
		if c.Name == "test_admin_9090" {
			return c
		}
	}
	return nil
}

// Signing in through the form: the page without a credential is the form
// (401), an API route the JSON envelope; a wrong token shows the form with
// an error and sets nothing; the right one sets an HttpOnly, SameSite=Strict
// cookie for the admin port that opens the page and the API routes until
// it expires on the clock or the token changes; sign-out deletes it; a
// post from another origin is refused.
func TestSigninThroughTheForm(t *testing.T) {
	h := newSigninHarness(t)
	w := h.do(http.MethodGet, "/", nil, nil)
	if w.Code != http.StatusUnauthorized || !strings.Contains(w.Body.String(), `<form class="signin" id="signin" method="post" action="/signin">`) ||
		!strings.HasPrefix(w.Header().Get("Content-Type"), "text/html") || !strings.Contains(w.Header().Get("Content-Security-Policy"), "form-action 'self'") {
		t.Fatalf("GET / without a credential: %d %q %q", w.Code, w.Header(), w.Body)
	}
	if w := h.do(http.MethodGet, "/admin/x", nil, nil); w.Code != http.StatusUnauthorized || w.Header().Get("Content-Type") != "application/json" {
		t.Errorf("GET /admin/x without a credential: %d %q, want the JSON 401", w.Code, w.Header().Get("Content-Type"))
	}
	if w := h.do(http.MethodGet, "/signin", nil, nil); w.Code != http.StatusOK || !strings.Contains(w.Body.String(), `id="signin"`) {
		t.Errorf("GET /signin: %d", w.Code)
	}

	w = h.do(http.MethodPost, "/signin", url.Values{"token": {"wrong-admin-token-0123456789"}}, nil)
	if w.Code != http.StatusUnauthorized || !strings.Contains(w.Body.String(), `id="signin-error"`) || len(w.Result().Cookies()) != 0 {
		t.Fatalf("a wrong token: %d, cookies %v, body %q", w.Code, w.Result().Cookies(), w.Body)
	}
	if strings.Contains(w.Body.String(), "wrong-admin-token") {
		t.Error("the form echoes the token posted")
	}
	if len(h.refused) != 3 || h.refused[2] != bearer.Wrong {
		t.Errorf("Refused saw %v, want Missing, Missing, Wrong", h.refused)
	}

	w = h.do(http.MethodPost, "/signin", url.Values{"token": {sessionToken}}, http.Header{"Origin": {"http://127.0.0.1:9090"}})
	c := sessionCookie(t, w)
	if w.Code != http.StatusSeeOther || w.Header().Get("Location") != "/" || c == nil {
		t.Fatalf("the right token: %d %q, cookies %v", w.Code, w.Header().Get("Location"), w.Result().Cookies())
	}
	if !c.HttpOnly || c.SameSite != http.SameSiteStrictMode || c.Path != "/" || c.Secure || c.MaxAge != 3600 {
		t.Errorf("the session cookie: %+v, want HttpOnly, SameSite=Strict, Path=/, not Secure over plain HTTP, Max-Age 3600", c)
	}
	if w := h.do(http.MethodGet, "/", nil, nil, c); w.Code != 200 || w.Body.String() != "page, signed in" {
		t.Errorf("GET / with the cookie: %d %q", w.Code, w.Body)
	}
	if w := h.do(http.MethodGet, "/admin/x", nil, nil, c); w.Code != 200 {
		t.Errorf("GET /admin/x with the cookie: %d", w.Code)
	}
	if w := h.do(http.MethodGet, "/", nil, http.Header{"Authorization": {"Bearer " + sessionToken}}); w.Code != 200 || w.Body.String() != "page" {
		t.Errorf("GET / with the bearer header: %d %q", w.Code, w.Body)
	}
	if w := h.do(http.MethodGet, "/", nil, http.Header{"Authorization": {"Bearer wrong-admin-token-0123456789"}}, c); w.Code != http.StatusUnauthorized {
		t.Errorf("a wrong bearer header beside a good cookie: %d, want 401", w.Code)
	}

	// Expiry on the clock.
	h.clk.Advance(time.Hour - time.Second)
	if w := h.do(http.MethodGet, "/", nil, nil, c); w.Code != 200 {
		t.Errorf("GET / a second before the session's end: %d", w.Code)
	}
	h.clk.Advance(time.Second)
	if w := h.do(http.MethodGet, "/", nil, nil, c); w.Code != http.StatusUnauthorized || !strings.Contains(w.Body.String(), `id="signin"`) {
		t.Errorf("GET / once the session ended: %d", w.Code)
	}

	// A rotated token ends the session.
	c = sessionCookie(t, h.do(http.MethodPost, "/signin", url.Values{"token": {sessionToken}}, nil))
	if w := h.do(http.MethodGet, "/", nil, nil, c); w.Code != 200 {
		t.Fatalf("GET / after signing in again: %d", w.Code)
	}
	h.token = "rotated-admin-token-0123456789"
	if w := h.do(http.MethodGet, "/", nil, nil, c); w.Code != http.StatusUnauthorized {
		t.Errorf("GET / with a session of the old token: %d, want 401", w.Code)
	}
	h.token = sessionToken

	// Another origin can neither sign in nor out.
	for _, hdr := range []http.Header{{"Origin": {"http://evil.example"}}, {"Origin": {"null"}}, {"Sec-Fetch-Site": {"cross-site"}}} {
		if w := h.do(http.MethodPost, "/signin", url.Values{"token": {sessionToken}}, hdr); w.Code != http.StatusForbidden || len(w.Result().Cookies()) != 0 {
			t.Errorf("sign-in with %v: %d, cookies %v", hdr, w.Code, w.Result().Cookies())
		}
		if w := h.do(http.MethodPost, "/signout", nil, hdr, c); w.Code != http.StatusForbidden || len(w.Result().Cookies()) != 0 {
			t.Errorf("sign-out with %v: %d", hdr, w.Code)
		}
	}

	// Sign-out deletes the cookie.
	w = h.do(http.MethodPost, "/signout", nil, http.Header{"Origin": {"http://127.0.0.1:9090"}}, c)
	gone := sessionCookie(t, w)
	if w.Code != http.StatusSeeOther || gone == nil || gone.MaxAge >= 0 || gone.Value != "" || !gone.HttpOnly || gone.SameSite != http.SameSiteStrictMode {
		t.Errorf("sign-out: %d, cookie %+v", w.Code, gone)
	}

	// With no token set the page is open and sign-in has nothing to do.
	h.token = ""
	if w := h.do(http.MethodGet, "/", nil, nil); w.Code != 200 || w.Body.String() != "page" {
		t.Errorf("GET / with no token set: %d %q", w.Code, w.Body)
	}
	if w := h.do(http.MethodPost, "/signin", url.Values{"token": {"anything"}}, nil); w.Code != http.StatusSeeOther || len(w.Result().Cookies()) != 0 {
		t.Errorf("sign-in with no token set: %d %v", w.Code, w.Result().Cookies())
	}
}
