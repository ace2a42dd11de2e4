package gateway

import (
	"net/http"
	"strings"
	"testing"

	"github.com/encgate/encgate/internal/redistest"
)

// TestReadyzShowsTheDedupeStore: with the /send store on a real Redis that
// is killed mid-test, /sends are refused, /readyz?verbose names the store's
// failure and encgate_dedupe_store_up reads 0, while /readyz stays 200
// (the check is advisory: /encode and its follow-ups still serve). Once
// Redis is back and a /send reaches it, both say so again.
func TestReadyzShowsTheDedupeStore(t *testing.T) {
	rd := redistest.Start(t)
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Idempotency.Store = "redis"
		c.Redis.Addr = rd.Addr()
		c.Redis.KeyPrefix = "readyz:"
	})
	verbose := func() answer {
		t.Helper()
		return do(t, http.MethodGet, g.admin+"/readyz?verbose", "")
	}
	const up = "[+]shutdown ok\n[+]dedupe_store ok\nreadyz check passed\n"
	if a := verbose(); a.status != 200 || a.body != up {
		t.Fatalf("/readyz?verbose with Redis up: %d %q, want 200 %q", a.status, a.body, up)
	}
	if v := metricValue(t, g, "encgate_dedupe_store_up"); v != 1 {
		t.Fatalf("encgate_dedupe_store_up %v with Redis up, want 1", v)
	}
	if a := post(t, g.base+"/encode", encodeBody("ready_0")); a.status != 200 {
		t.Fatalf("/encode: %d %s", a.status, a.body)
	}
	if a := post(t, g.base+"/send", tpSend("ready_0", 0, 1)); a.status != 200 {
		t.Fatalf("/send with Redis up: %d %s", a.status, a.body)
	}

	rd.Kill()
	if a := post(t, g.base+"/send", tpSend("ready_0", 1, 2)); a.status == 200 {
		t.Fatalf("/send with Redis killed: %d %s, want it refused", a.status, a.body)
	}
	a := verbose()
	t.Logf("/readyz?verbose with Redis killed: %d\n%s", a.status, a.body)
	wantFailed := "[-]dedupe_store failed: redis "
	if a.status != 200 || !strings.HasPrefix(a.body, "[+]shutdown ok\n"+wantFailed) ||
		!strings.Contains(a.body, "connection refused") ||
		!strings.HasSuffix(a.body, "(advisory: readiness does not depend on it)\nreadyz check passed\n") {
		t.Fatalf("/readyz?verbose with Redis killed: %d %q, want 200 with %q...connection refused, advisory, passed", a.status, a.body, wantFailed)
	}
	if a := do(t, http.MethodGet, g.admin+"/readyz", ""); a.status != 200 || a.body != "ready\n" {
		t.Errorf("/readyz with Redis killed: %d %q, want 200 ready", a.status, a.body)
	}
	if v := metricValue(t, g, "encgate_dedupe_store_up"); v != 0 {
		t.Errorf("encgate_dedupe_store_up %v with Redis killed, want 0", v)
	}

	rd.Restart()
	if a := post(t, g.base+"/encode", encodeBody("ready_1")); a.status != 200 {
		t.Fatalf("/encode after Redis's restart: %d %s", a.status, a.body)
	}
	if a := post(t, g.base+"/send", tpSend("ready_1", 0, 1)); a.status != 200 {
		t.Fatalf("/send after Redis's restart: %d %s", a.status, a.body)
	}
	if a := verbose(); a.status != 200 || a.body != up {
		t.Errorf("/readyz?verbose once Redis is back: %d %q, want 200 %q", a.status, a.body, up)
	}
	if v := metricValue(t, g, "encgate_dedupe_store_up"); v != 1 {
		t.Errorf("encgate_dedupe_store_up %v once Redis is back, want 1", v)
	}
}

// TestReadyzMemoryStore: the memory store has no backend to lose: its
// check passes and encgate_dedupe_store_up is 1 from the start.
func TestReadyzMemoryStore(t *testing.T) {
	g := startGateway(t, []string{"http://" + deadAddr(t)}, nil)
	const up = "[+]shutdown ok\n[+]dedupe_store ok\nreadyz check passed\n"
	if a := do(t, http.MethodGet, g.admin+"/readyz?verbose", ""); a.status != 200 || a.body != up {
		t.Errorf("/readyz?verbose: %d %q, want 200 %q", a.status, a.body, up)
	}
	if v := metricValue(t, g, "encgate_dedupe_store_up"); v != 1 {
		t.Errorf("encgate_dedupe_store_up %v, want 1", v)
	}
}
