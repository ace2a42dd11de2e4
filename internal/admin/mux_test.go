package admin

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/encgate/encgate/internal/bearer"
)

func TestMuxGuardsWhatItMust(t *testing.T) {
	var ready atomic.Bool
	token := "s3cret-admin-token-0123"
	var refused []bearer.Outcome
	mux, protect, _ := NewMux(Options{Registry: prometheus.NewRegistry(), Ready: ready.Load,
		Token: func() string { return token }, Realm: "test admin",
		Refused: func(_ *http.Request, o bearer.Outcome) { refused = append(refused, o) }})
	protect("GET /admin/x", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "x") })
	get := func(path, auth string) (int, string, http.Header) {
		r := httptest.NewRequest(http.MethodGet, path, nil)
		if auth != "" {
			r.Header.Set("Authorization", auth)
		}
		w := httptest.NewRecorder()
		mux.ServeHTTP(w, r)
		return w.Code, w.Body.String(), w.Header()
	}
	for _, open := range []string{"/healthz", "/metrics"} {
		if code, _, _ := get(open, ""); code != http.StatusOK {
			t.Errorf("GET %s without a token: %d, want 200", open, code)
		}
	}
	if code, _, _ := get("/readyz", ""); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz before ready: %d, want 503", code)
	}
	ready.Store(true)
	if code, _, _ := get("/readyz", ""); code != http.StatusOK {
		t.Errorf("/readyz once ready: %d, want 200", code)
	}
	for _, path := range []string{"/admin/x", "/debug/pprof/"} {
		code, body, h := get(path, "")
		if code != http.StatusUnauthorized || !strings.Contains(h.Get("WWW-Authenticate"), `realm="test admin"`) ||
			!strings.Contains(body, `needs \"Authorization: Bearer <admin.token>\"`) {
			t.Errorf("GET %s without the token: %d %q %q", path, code, h.Get("WWW-Authenticate"), body)
		}
		if code, body, _ := get(path, "Bearer wrong-token-0123456789"); code != http.StatusUnauthorized || !strings.Contains(body, "is not admin.token") {
			t.Errorf("GET %s with a wrong token: %d %q", path, code, body)
		}
		if code, _, _ := get(path, "bearer "+token); code != http.StatusOK {
			t.Errorf("GET %s with the token: %d, want 200", path, code)
		}
	}
	if len(refused) != 4 || refused[0] != bearer.Missing || refused[1] != bearer.Wrong {
		t.Errorf("Refused saw %v, want Missing, Wrong twice", refused)
	}
	token = "" // admin.token unset by a reload: open at once
	if code, body, _ := get("/admin/x", ""); code != http.StatusOK || body != "x" {
		t.Errorf("GET /admin/x with no token configured: %d %q", code, body)
	}
}

// TestReadyzVerbose: /readyz?verbose lists each check, "[+]name ok" or
// "[-]name failed: reason", in plain text; only a failing check that is not
// advisory makes /readyz (verbose or not) answer 503.
func TestReadyzVerbose(t *testing.T) {
	var ready atomic.Bool
	var store, gate error
	mux, _, _ := NewMux(Options{Registry: prometheus.NewRegistry(), Ready: ready.Load, Token: func() string { return "" },
		Checks: func() []Check {
			return []Check{{Name: "dedupe_store", Err: store, Advisory: true}, {Name: "gate", Err: gate}}
		}})
	get := func(path string) (int, string, string) {
		w := httptest.NewRecorder()
		mux.ServeHTTP(w, httptest.NewRequest(http.MethodGet, path, nil))
		return w.Code, w.Body.String(), w.Header().Get("Content-Type")
	}
	for _, tc := range []struct {
		name       string
		ready      bool
		store      error
		gate       error
		code       int
		plain      string
		verboseOut string
	}{
		{"all pass", true, nil, nil, 200, "ready\n",
			"[+]shutdown ok\n[+]dedupe_store ok\n[+]gate ok\nreadyz check passed\n"},
		{"advisory fails", true, errors.New("redis claim: dial tcp 127.0.0.1:1:\nconnection refused"), nil, 200, "ready\n",
			"[+]shutdown ok\n[-]dedupe_store failed: redis claim: dial tcp 127.0.0.1:1: connection refused (advisory: readiness does not depend on it)\n[+]gate ok\nreadyz check passed\n"},
		{"gate fails", true, nil, errors.New("closed"), 503, "not ready\n",
			"[+]shutdown ok\n[+]dedupe_store ok\n[-]gate failed: closed\nreadyz check failed\n"},
		{"draining", false, nil, nil, 503, "not ready\n",
			"[-]shutdown failed: not serving: starting, or draining after SIGTERM\n[+]dedupe_store ok\n[+]gate ok\nreadyz check failed\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ready.Store(tc.ready)
			store, gate = tc.store, tc.gate
			if code, body, _ := get("/readyz"); code != tc.code || body != tc.plain {
				t.Errorf("/readyz: %d %q, want %d %q", code, body, tc.code, tc.plain)
			}
			for _, q := range []string{"?verbose", "?verbose=1"} {
				code, body, ctype := get("/readyz" + q)
				if code != tc.code || body != tc.verboseOut || ctype != "text/plain; charset=utf-8" {
					t.Errorf("/readyz%s: %d %s %q, want %d text/plain %q", q, code, ctype, body, tc.code, tc.verboseOut)
				}
			}
		})
	}
}
