// Package bearer handles the bearer tokens (RFC 6750) of encgate: the admin
// listeners' admin.token (or admin.token_file), and the token a node's
// gpuagent requires on /send (the gateway's encoders[].agent_token_file). It
// parses an Authorization value, compares tokens in constant time, validates
// a token's length and alphabet, and reads a token file (through
// internal/secretfile, which the Redis password file shares).
package bearer

import (
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"strings"

	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/secretfile"
)

// MinLen is the shortest token accepted.
const MinLen = 16

// MaxFileBytes bounds a token file (ReadFile).
const MaxFileBytes = secretfile.MaxBytes

// Parse returns the token of an "Authorization: Bearer <token>" value; the
// scheme matches in any case (RFC 7235). ok is false for another scheme or
// an empty token.
func Parse(header string) (token string, ok bool) {
	scheme, token, ok := strings.Cut(header, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	token = strings.TrimLeft(token, " ")
	return token, token != ""
}

// Equal reports whether got is want, in constant time: the two are compared
// as SHA-256 digests, so that not even the length leaks.
func Equal(got, want string) bool {
	g, w := sha256.Sum256([]byte(got)), sha256.Sum256([]byte(want))
	return subtle.ConstantTimeCompare(g[:], w[:]) == 1
}

// Outcome is Authorize's verdict on a request.
type Outcome int

const (
	// Allowed: the request carries the token, or none is required.
	Allowed Outcome = iota
	// Missing: no "Authorization: Bearer <token>" (RFC 6750's challenge
	// without an error code).
	Missing
	// Wrong: a bearer token that is not the one required
	// (error="invalid_token").
	Wrong
)

// Authorize judges an Authorization header value against want; an empty
// want requires nothing.
func Authorize(header, want string) Outcome {
	if want == "" {
		return Allowed
	}
	got, ok := Parse(header)
	switch {
	case !ok:
		return Missing
	case !Equal(got, want):
		return Wrong
	}
	return Allowed
}

// Challenge is the WWW-Authenticate value of a 401 for o in realm.
func Challenge(realm string, o Outcome) string {
	if o == Wrong {
		return `Bearer realm="` + realm + `", error="invalid_token"`
	}
	return `Bearer realm="` + realm + `"`
}

// Check adds a problem at path for each way token is not a valid bearer
// token: shorter than MinLen, or outside the RFC 6750 alphabet. An empty
// token means none is configured and passes. Problems never quote the
// token.
func Check(p *configfile.Problems, path, token string) {
	if token == "" {
		return
	}
	for _, msg := range problems(token) {
		p.Addf(path, "%s", msg)
	}
}

func problems(token string) []string {
	var out []string
	if len(token) < MinLen {
		out = append(out, fmt.Sprintf("must be at least %d characters, got %d", MinLen, len(token)))
	}
	if !IsToken68(token) {
		out = append(out, "must use only letters, digits and -._~+/ (then optional = padding), as a bearer token does (RFC 6750)")
	}
	return out
}

// IsToken68 reports whether s is an RFC 6750 b64token (RFC 7235 token68).
func IsToken68(s string) bool {
	end := len(s)
	for end > 0 && s[end-1] == '=' {
		end--
	}
	if end == 0 {
		return false
	}
	for i := 0; i < end; i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case c == '-', c == '.', c == '_', c == '~', c == '+', c == '/':
		default:
			return false
		}
	}
	return true
}

// ReadFile reads the token in the file at path with secretfile.Read: its
// content without surrounding whitespace, refused when the file is not a
// regular file, is over MaxFileBytes, is empty, or, on Unix, grants any
// permission to others (as ssh refuses such a key). It also refuses a token
// that fails Check. Its errors name the path, never the token.
func ReadFile(path string) (string, error) {
	token, err := secretfile.Read(path, "token file")
	if err != nil {
		return "", err
	}
	if ps := problems(token); len(ps) > 0 {
		return "", fmt.Errorf("token file %s: the token %s", path, strings.Join(ps, "; it "))
	}
	return token, nil
}
