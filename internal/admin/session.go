package admin

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"strconv"
	"strings"
	"time"
)

// A browser cannot send "Authorization: Bearer", so a person signs in to
// the status page with a form (signin.go) that takes admin.token and, when
// it matches, sets a session cookie. The cookie holds nothing but its
// expiry and a signature: "v1.<unix seconds>.<HMAC-SHA256, base64url>",
// keyed with a key derived from the token (SessionKey). So the gateway
// keeps no session state, a session ends at its expiry however the clock
// is read, and a new token (a reload) ends every session signed with the
// old one: their signatures no longer verify.

// DefaultSessionTTL is how long a sign-in lasts unless admin.session_ttl
// says otherwise.
const DefaultSessionTTL = 12 * time.Hour

// MaxSessionTTL bounds admin.session_ttl.
const MaxSessionTTL = 30 * 24 * time.Hour

// sessionLabel is the HMAC message that derives the cookie key from the
// token; a new format gets a new label.
const sessionLabel = "encgate admin session v1"

// SessionKey derives the cookie's signing key from token:
// HMAC-SHA256(token, "encgate admin session v1"). The token itself is never
// the key, so a signature is no oracle on it.
func SessionKey(token string) []byte {
	m := hmac.New(sha256.New, []byte(token))
	m.Write([]byte(sessionLabel))
	return m.Sum(nil)
}

func sessionMAC(key []byte, payload string) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(payload))
	return m.Sum(nil)
}

// SignSession returns a cookie value that VerifySession accepts, with the
// same token, until exp (to the second).
func SignSession(token string, exp time.Time) string {
	payload := "v1." + strconv.FormatInt(exp.Unix(), 10)
	return payload + "." + base64.RawURLEncoding.EncodeToString(sessionMAC(SessionKey(token), payload))
}

// VerifySession reports whether value was signed by SignSession with token
// and has not expired at now. An empty token verifies nothing.
func VerifySession(value, token string, now time.Time) bool {
	if token == "" || len(value) > 128 {
		return false
	}
	i := strings.LastIndexByte(value, '.')
	if i < 0 {
		return false
	}
	payload, sig := value[:i], value[i+1:]
	ver, exp, ok := strings.Cut(payload, ".")
	if !ok || ver != "v1" {
		return false
	}
	got, err := base64.RawURLEncoding.DecodeString(sig)
	if err != nil || !hmac.Equal(got, sessionMAC(SessionKey(token), payload)) {
		return false
	}
	unix, err := strconv.ParseInt(exp, 10, 64)
	if err != nil {
		return false
	}
	return now.Before(time.Unix(unix, 0))
}
