package redistest

import (
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestKillRestart(t *testing.T) {
	s := Start(t)
	if err := ping(s.Addr(), ""); err != nil {
		t.Fatalf("fresh server: %v", err)
	}
	port := s.Port()
	s.Kill()
	if err := ping(s.Addr(), ""); err == nil {
		t.Fatal("killed server still answers PING")
	}
	s.Restart()
	if s.Port() != port {
		t.Fatalf("Restart moved the port: %d -> %d", port, s.Port())
	}
	if err := ping(s.Addr(), ""); err != nil {
		t.Fatalf("restarted server: %v", err)
	}
	// Restart of a running server replaces it.
	s.Restart()
	if err := ping(s.Addr(), ""); err != nil {
		t.Fatalf("server restarted while running: %v", err)
	}
}

// WithPassword: the server refuses a client without the password or with
// another one, takes the right one, and keeps requiring it after Restart.
func TestWithPassword(t *testing.T) {
	const pw = "a pass word, with spaces"
	s := Start(t, WithPassword(pw))
	if s.Password() != pw {
		t.Fatalf("Password() = %q", s.Password())
	}
	check := func(when string) {
		t.Helper()
		if err := ping(s.Addr(), pw); err != nil {
			t.Errorf("%s: the password: %v", when, err)
		}
		if err := ping(s.Addr(), ""); err == nil || !strings.Contains(err.Error(), "NOAUTH") {
			t.Errorf("%s: no password: %v, want NOAUTH", when, err)
		}
		if err := ping(s.Addr(), pw+"x"); err == nil || !strings.Contains(err.Error(), "WRONGPASS") {
			t.Errorf("%s: another password: %v, want WRONGPASS", when, err)
		}
	}
	check("started")
	s.Restart()
	check("restarted")
}
