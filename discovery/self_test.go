package discovery

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"testing"

	"go.uber.org/zap"
)

// A registration the gateway's SelfCheck refuses is answered 400 with the
// reason and stores nothing; the check sees the normalised URL, and other
// URLs register as before.
func TestRegistrationOfTheGatewayItselfIsRefused(t *testing.T) {
	reg := bsMemRegistry(8)
	var mu sync.Mutex
	var seen []string
	reg.SetSelfCheck(func(_ context.Context, u string) string {
		mu.Lock()
		seen = append(seen, u)
		mu.Unlock()
		if u == "http://127.0.0.1:8997" {
			return "is this gateway's own bootstrap.listen address (127.0.0.1:8997)"
		}
		return ""
	})
	base := serveBootstrap(t, reg, zap.NewNop())

	a := bsCall(t, http.MethodPost, base+pathRegister, `{"url":"HTTP://127.0.0.1:08997/"}`)
	want := `url "http://127.0.0.1:8997": is this gateway's own bootstrap.listen address (127.0.0.1:8997)`
	if a.status != http.StatusBadRequest || a.body != bsErrorBody(want) {
		t.Fatalf("registering the gateway: %d %s, want 400 %s", a.status, a.body, bsErrorBody(want))
	}
	if a := bsCall(t, http.MethodPost, base+pathRegister, `{"url":"http://127.0.0.1:30000"}`); a.status != http.StatusOK {
		t.Fatalf("registering an encoder: %d %s", a.status, a.body)
	}
	if l := bsCall(t, http.MethodGet, base+pathList, ""); l.body != `{"encoder_urls":["http://127.0.0.1:30000"]}` {
		t.Fatalf("list after the refusal: %s", l.body)
	}
	mu.Lock()
	if strings.Join(seen, " ") != "http://127.0.0.1:8997 http://127.0.0.1:30000" {
		t.Errorf("the check saw %q, want the normalised URLs", seen)
	}
	mu.Unlock()

	err := reg.Register(context.Background(), "http://127.0.0.1:8997")
	if !errors.Is(err, ErrSelf) || !errors.Is(err, ErrInvalidURL) {
		t.Fatalf("Register of the gateway: %v, want ErrSelf and ErrInvalidURL", err)
	}
	ms, err := reg.Members(context.Background())
	if err != nil || len(ms) != 1 || ms[0].URL != "http://127.0.0.1:30000" {
		t.Fatalf("members %v (%v), want the encoder alone", ms, err)
	}
}
