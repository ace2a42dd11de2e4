package idempotency

import (
	"context"
	"errors"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/encgate/encgate/internal/redisclient"
	"github.com/encgate/encgate/internal/redistest"
	"github.com/encgate/encgate/internal/secretfile/secretfiletest"
)

// A Redis that requires a password: the store built from the config with
// password_file holding it works; with another password, or none, Open
// still builds the store (as it does while Redis is down) but says that
// Redis refuses the credentials (its own WRONGPASS or NOAUTH), not that it
// is unreachable, and every operation fails as ErrUnavailable with Redis's
// refusal.
func TestRedisPasswordFile(t *testing.T) {
	const pw = "the store's password"
	srv := redistest.Start(t, redistest.WithPassword(pw))
	const refusedMsg = "redis refuses the gateway's credentials (redis.username, password or password_file); /sends are refused until it accepts them"
	for _, tc := range []struct {
		name, file string
		want       string // in Open's log line; "" for none
		claim      string // in a Claim's error
	}{
		{"the password", secretfiletest.Write(t, "redis.password", pw+"\n", 0o600), "", ""},
		{"another password", secretfiletest.Write(t, "redis.password", pw+"x\n", 0o640), "WRONGPASS", "WRONGPASS"},
		// Redis refuses a script from a client that has not authenticated
		// before reading it all.
		{"no password", "", "NOAUTH", "unauthenticated"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Store = "redis"
			conn := redisclient.Default()
			conn.Addr, conn.PasswordFile = srv.Addr(), tc.file
			core, logs := observer.New(zap.InfoLevel)
			o, err := Open(cfg, newClient(t, conn), conn, nil, zap.New(core))
			if err != nil {
				t.Fatal(err)
			}
			defer o.Close()
			_, err = o.Store.Claim(context.Background(), Key{"pw_local_part_0", "h:1"}, fpN(1))
			refused := logs.FilterMessage(refusedMsg).All()
			if tc.want == "" {
				if err != nil || logs.Len() != 0 {
					t.Fatalf("Claim: %v; log: %v", err, logs.All())
				}
				return
			}
			if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), tc.claim) {
				t.Errorf("Claim: %v, want ErrUnavailable with Redis's %q", err, tc.claim)
			}
			if len(refused) != 1 || logs.Len() != 1 || !strings.Contains(refused[0].ContextMap()["error"].(string), tc.want) {
				t.Fatalf("Open's log: %v, want one %q line with %s", logs.All(), refusedMsg, tc.want)
			}
			for _, e := range logs.All() {
				if strings.Contains(e.Message+e.ContextMap()["error"].(string), pw) {
					t.Errorf("the log shows the password: %v", e)
				}
			}
		})
	}
}
