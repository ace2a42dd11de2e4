package redistest

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestKillRestart(t *testing.T) {
	s := Start(t)
	if err := ping(s.Addr()); err != nil {
		t.Fatalf("fresh server: %v", err)
	}
	port := s.Port()
	s.Kill()
	if err := ping(s.Addr()); err == nil {
		t.Fatal("killed server still answers PING")
	}
	s.Restart()
	if s.Port() != port {
		t.Fatalf("Restart moved the port: %d -> %d", port, s.Port())
	}
	if err := ping(s.Addr()); err != nil {
		t.Fatalf("restarted server: %v", err)
	}
	// Restart of a running server replaces it.
	s.Restart()
	if err := ping(s.Addr()); err != nil {
		t.Fatalf("server restarted while running: %v", err)
	}
}
