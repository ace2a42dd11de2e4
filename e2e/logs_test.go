package e2e

import (
	"net"
	"strings"
	"testing"

	"github.com/encgate/encgate/internal/logtest"
)

// A gateway process whose Redis is down writes only JSON lines to stderr:
// go-redis's own lines (a pool's failed dial) come through the gateway's
// logger, named "redis", instead of as plain "redis: ..." text.
func TestGatewayProcessLogsGoRedisAsJSON(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a gateway process")
	}
	down, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	redisAddr := down.Addr().String()
	if err := down.Close(); err != nil {
		t.Fatal(err)
	}
	path := writeTemp(t, "gateway.yaml", `
listen: "127.0.0.1:0"
admin_listen: "127.0.0.1:0"
encoders:
  - name: enc-a
    url: "http://127.0.0.1:30001"
idempotency:
  store: redis
redis:
  addr: "`+redisAddr+`"
`)
	// startGatewayProc returns once the gateway says it is listening; the
	// lines up to then include its Redis pool's first failed dial.
	p := startGatewayProc(t, path)
	var dial bool
	for _, e := range logtest.JSONLines(t, p.log()) {
		if msg, _ := e["msg"].(string); e["logger"] == "redis" && e["level"] == "warn" && strings.Contains(msg, "failed to dial") {
			dial = true
		}
	}
	if !dial {
		t.Errorf("no go-redis dial failure logged as a JSON entry of logger \"redis\":\n%s", p.log())
	}
}
