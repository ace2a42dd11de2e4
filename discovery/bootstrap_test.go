package discovery

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/valyala/fasthttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
)

// serveBootstrap serves reg's bootstrap API on a loopback port until the
// test ends and returns its base URL. The server's own body limit is left
// far above the registry's, so the handler's 413 is what a test sees.
func serveBootstrap(t *testing.T, reg *Registry, log *zap.Logger) string {
	t.Helper()
	return serveBootstrapWith(t, reg, log, BootstrapAccess{})
}

// serveBootstrapWith is serveBootstrap with access.
func serveBootstrapWith(t *testing.T, reg *Registry, log *zap.Logger, access BootstrapAccess) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &fasthttp.Server{Handler: reg.Handler(log, access), MaxRequestBodySize: 1 << 20}
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		_ = srv.Shutdown()
		<-served
	})
	return "http://" + ln.Addr().String()
}

type bsAnswer struct {
	status int
	header http.Header
	body   string
}

// bsCall sends one request over a fresh connection and reads the answer.
func bsCall(t *testing.T, method, url, body string) bsAnswer {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: regGuard}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return bsAnswer{status: resp.StatusCode, header: resp.Header, body: string(b)}
}

func bsErrorBody(msg string) string {
	b, _ := json.Marshal(map[string]string{"error": msg})
	return string(b)
}

func bsMemRegistry(max int) *Registry {
	cfg := DefaultBootstrap()
	cfg.MaxEncoders = max
	cfg.MaxBodyBytes = 256
	return NewRegistry(cfg, NewMemoryStore(clock.Real{}), clock.Real{}, zap.NewNop())
}

func TestBootstrapHandlerStatuses(t *testing.T) {
	reg := bsMemRegistry(2)
	base := serveBootstrap(t, reg, zap.NewNop())
	// Two registrations fill the registry for the "full" case below.
	if err := reg.Register(context.Background(), "http://filler-a:1"); err != nil {
		t.Fatal(err)
	}
	missing := bsErrorBody("Missing or empty 'url' field")
	big := `{"url":"http://h:1","pad":"` + strings.Repeat("x", 300) + `"}`
	cases := []struct {
		name, method, path, body string
		status                   int
		allow, retryAfter        string
		wantBody                 string // exact, when set
		bodyPrefix               string // when set
		contentType              string
	}{
		{name: "health", method: "GET", path: "/health", status: 200, wantBody: "OK", contentType: "text/plain; charset=utf-8"},
		{name: "health wrong method", method: "POST", path: "/health", status: 405, allow: "GET", bodyPrefix: `{"error":"method not allowed`},
		{name: "register wrong method", method: "GET", path: "/register_encoder_url", status: 405, allow: "POST"},
		{name: "unregister wrong method", method: "POST", path: "/unregister_encoder_url", body: `{"url":"http://h:1"}`, status: 405, allow: "DELETE"},
		{name: "list wrong method", method: "DELETE", path: "/list_encoder_urls", status: 405, allow: "GET"},
		{name: "unknown path", method: "GET", path: "/nope", status: 404, bodyPrefix: `{"error":"not found`, contentType: "application/json"},
		{name: "path with a suffix", method: "POST", path: "/register_encoder_url/x", body: `{"url":"http://h:1"}`, status: 404},
		{name: "missing url", method: "POST", path: "/register_encoder_url", body: `{}`, status: 400, wantBody: missing, contentType: "application/json"},
		{name: "empty url", method: "POST", path: "/register_encoder_url", body: `{"url":""}`, status: 400, wantBody: missing},
		{name: "url not a string", method: "POST", path: "/register_encoder_url", body: `{"url":5}`, status: 400, wantBody: missing},
		{name: "url null", method: "POST", path: "/register_encoder_url", body: `{"url":null}`, status: 400, wantBody: missing},
		{name: "url an object", method: "POST", path: "/register_encoder_url", body: `{"url":{"u":"http://h:1"}}`, status: 400, wantBody: missing},
		{name: "body an array", method: "POST", path: "/register_encoder_url", body: `["http://h:1"]`, status: 400, wantBody: missing},
		{name: "body a string", method: "DELETE", path: "/unregister_encoder_url", body: `"http://h:1"`, status: 400, wantBody: missing},
		{name: "unregister missing url", method: "DELETE", path: "/unregister_encoder_url", body: `{"URL":"http://h:1"}`, status: 400, wantBody: missing},
		{name: "malformed JSON", method: "POST", path: "/register_encoder_url", body: `{"url":`, status: 400, bodyPrefix: `{"error":"invalid JSON body: `},
		{name: "trailing garbage", method: "POST", path: "/register_encoder_url", body: `{"url":"http://h:1"} x`, status: 400, bodyPrefix: `{"error":"invalid JSON body: `},
		{name: "empty body", method: "POST", path: "/register_encoder_url", body: ``, status: 400, bodyPrefix: `{"error":"invalid JSON body: `},
		{name: "deep nesting over the limit", method: "POST", path: "/register_encoder_url", body: strings.Repeat("[", 600), status: 413},
		{name: "bad scheme", method: "POST", path: "/register_encoder_url", body: `{"url":"ftp://x:1"}`, status: 400, wantBody: bsErrorBody(`url "ftp://x:1": scheme must be http or https`)},
		{name: "no port", method: "DELETE", path: "/unregister_encoder_url", body: `{"url":"http://x"}`, status: 400, wantBody: bsErrorBody(`url "http://x": must have a port (host:port)`)},
		{name: "body over the limit", method: "POST", path: "/register_encoder_url", body: big, status: 413, bodyPrefix: `{"error":"request body is over bootstrap.max_body_bytes (256)"`},
		{name: "unregister unknown", method: "DELETE", path: "/unregister_encoder_url", body: `{"url":"http://never:1"}`, status: 200, wantBody: "OK"},
		{name: "register", method: "POST", path: "/register_encoder_url", body: `{"url":"HTTP://Enc-B:8000/"}`, status: 200, wantBody: "OK", contentType: "text/plain; charset=utf-8"},
		{name: "re-register when full", method: "POST", path: "/register_encoder_url", body: `{"url":"http://enc-b:8000"}`, status: 200, wantBody: "OK"},
		{name: "full", method: "POST", path: "/register_encoder_url", body: `{"url":"http://enc-c:8000"}`, status: 503, retryAfter: "5", bodyPrefix: `{"error":"bootstrap.max_encoders encoders are registered (2)`},
		{name: "list", method: "GET", path: "/list_encoder_urls", status: 200, wantBody: `{"encoder_urls":["http://enc-b:8000","http://filler-a:1"]}`, contentType: "application/json"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			a := bsCall(t, c.method, base+c.path, c.body)
			if a.status != c.status {
				t.Fatalf("status %d, want %d (body %s)", a.status, c.status, a.body)
			}
			if c.wantBody != "" && a.body != c.wantBody {
				t.Errorf("body %q, want %q", a.body, c.wantBody)
			}
			if c.bodyPrefix != "" && !strings.HasPrefix(a.body, c.bodyPrefix) {
				t.Errorf("body %q, want prefix %q", a.body, c.bodyPrefix)
			}
			if c.contentType != "" && a.header.Get("Content-Type") != c.contentType {
				t.Errorf("Content-Type %q, want %q", a.header.Get("Content-Type"), c.contentType)
			}
			if got := a.header.Get("Allow"); got != c.allow {
				t.Errorf("Allow %q, want %q", got, c.allow)
			}
			if got := a.header.Get("Retry-After"); got != c.retryAfter {
				t.Errorf("Retry-After %q, want %q", got, c.retryAfter)
			}
			if a.status != 200 && !json.Valid([]byte(a.body)) {
				t.Errorf("error body is not JSON: %q", a.body)
			}
		})
	}
}

// TestBootstrapHandlerDepth: deeply nested JSON within the size limit is a
// 400, not a crash.
func TestBootstrapHandlerDepth(t *testing.T) {
	cfg := DefaultBootstrap()
	cfg.MaxBodyBytes = 64 << 10
	reg := NewRegistry(cfg, NewMemoryStore(clock.Real{}), clock.Real{}, zap.NewNop())
	base := serveBootstrap(t, reg, zap.NewNop())
	a := bsCall(t, "POST", base+"/register_encoder_url", `{"url":`+strings.Repeat("[", 10000))
	if a.status != 400 || a.body != bsErrorBody("invalid JSON body: nested too deeply") {
		t.Fatalf("got %d %s", a.status, a.body)
	}
}

func TestBootstrapListEmptyIsArray(t *testing.T) {
	base := serveBootstrap(t, bsMemRegistry(2), zap.NewNop())
	a := bsCall(t, "GET", base+"/list_encoder_urls", "")
	if a.status != 200 || a.body != `{"encoder_urls":[]}` {
		t.Fatalf("got %d %s", a.status, a.body)
	}
}

// TestBootstrapRoundTrip: what a registration stores is what the list shows
// and what Members returns; an unregistration takes it away.
func TestBootstrapRoundTrip(t *testing.T) {
	reg := bsMemRegistry(4)
	base := serveBootstrap(t, reg, zap.NewNop())
	for _, u := range []string{"http://c:3/", "http://a:1", "http://b:2"} {
		if a := bsCall(t, "POST", base+"/register_encoder_url", `{"url":"`+u+`"}`); a.status != 200 {
			t.Fatalf("register %s: %d %s", u, a.status, a.body)
		}
	}
	a := bsCall(t, "GET", base+"/list_encoder_urls", "")
	if want := `{"encoder_urls":["http://a:1","http://b:2","http://c:3"]}`; a.body != want {
		t.Fatalf("list %s, want %s", a.body, want)
	}
	ms, err := reg.Members(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := []Member{
		{Name: "a:1", URL: "http://a:1", Source: "registered"},
		{Name: "b:2", URL: "http://b:2", Source: "registered"},
		{Name: "c:3", URL: "http://c:3", Source: "registered"},
	}
	if !sameMemberSet(ms, want) {
		t.Fatalf("members %+v, want %+v", ms, want)
	}
	if a := bsCall(t, "DELETE", base+"/unregister_encoder_url", `{"url":"http://B:2/"}`); a.status != 200 || a.body != "OK" {
		t.Fatalf("unregister: %d %s", a.status, a.body)
	}
	a = bsCall(t, "GET", base+"/list_encoder_urls", "")
	if want := `{"encoder_urls":["http://a:1","http://c:3"]}`; a.body != want {
		t.Fatalf("list after unregister %s, want %s", a.body, want)
	}
}

func TestBootstrapHandlerLogs(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	base := serveBootstrap(t, bsMemRegistry(2), zap.New(core))
	bsCall(t, "POST", base+"/register_encoder_url", `{"url":"http://Enc:1/"}`)
	bsCall(t, "DELETE", base+"/unregister_encoder_url", `{"url":"http://enc:1"}`)
	for _, msg := range []string{"encoder registered", "encoder unregistered"} {
		got := logs.FilterMessage(msg).All()
		if len(got) != 1 {
			t.Fatalf("%d %q entries, want 1 (all: %v)", len(got), msg, logs.All())
		}
		if u := got[0].ContextMap()["url"]; u != "http://enc:1" {
			t.Errorf("%q logged url %v, want the normalised http://enc:1", msg, u)
		}
	}
}

// regFailingStore fails every call, as a store whose backend is down does.
type regFailingStore struct{ err error }

func (f regFailingStore) Add(context.Context, string, time.Duration, Room) (AddResult, error) {
	return AddResult{}, f.err
}
func (f regFailingStore) Refresh(context.Context, []string, time.Duration, int) ([]RefreshOutcome, error) {
	return nil, f.err
}
func (f regFailingStore) Remove(context.Context, string, time.Duration, int) error { return f.err }
func (f regFailingStore) List(context.Context) (Listing, error)                    { return Listing{}, f.err }

func TestBootstrapStoreUnavailable(t *testing.T) {
	cfg := DefaultBootstrap()
	reg := NewRegistry(cfg, regFailingStore{errors.New("backend down")}, clock.Real{}, zap.NewNop())
	base := serveBootstrap(t, reg, zap.NewNop())
	want := bsErrorBody("registration store unavailable: backend down")
	for _, c := range []struct{ method, path, body string }{
		{"POST", "/register_encoder_url", `{"url":"http://h:1"}`},
		{"DELETE", "/unregister_encoder_url", `{"url":"http://h:1"}`},
		{"GET", "/list_encoder_urls", ""},
	} {
		a := bsCall(t, c.method, base+c.path, c.body)
		if a.status != 503 || a.body != want {
			t.Errorf("%s %s: %d %s, want 503 %s", c.method, c.path, a.status, a.body, want)
		}
		if a.header.Get("Retry-After") != "" {
			t.Errorf("%s %s: Retry-After %q on a store failure", c.method, c.path, a.header.Get("Retry-After"))
		}
	}
	// Health is the bootstrap server's own liveness, not the store's.
	if a := bsCall(t, "GET", base+"/health", ""); a.status != 200 {
		t.Errorf("health %d with the store down", a.status)
	}
}

func TestBootstrapConfigValidate(t *testing.T) {
	var p configfile.Problems
	DefaultBootstrap().Validate(&p, "bootstrap")
	if err := p.Err(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	d := DefaultBootstrap()
	if d.Listen != "" || d.MaxEncoders != 1024 || d.TTL.D() != time.Minute || d.MaxBodyBytes != 4096 {
		t.Fatalf("defaults %+v", d)
	}
	for _, ok := range []string{"0.0.0.0:8997", "127.0.0.1:0", ":8997", "[::]:8997"} {
		c := DefaultBootstrap()
		c.Listen, c.Insecure = ok, true // who may register: bootstrap_access_test.go
		var p configfile.Problems
		c.Validate(&p, "bootstrap")
		if err := p.Err(); err != nil {
			t.Errorf("listen %q: %v", ok, err)
		}
	}
	bad := BootstrapConfig{
		Listen:       "8997",
		MaxEncoders:  0,
		TTL:          configfile.Duration(999 * time.Millisecond),
		MaxBodyBytes: 255,
	}
	p = configfile.Problems{}
	bad.Validate(&p, "bootstrap")
	err := p.Err()
	if err == nil {
		t.Fatal("no problems")
	}
	for _, want := range []string{
		`bootstrap.listen: must be empty (off) or host:port, got "8997"`,
		"bootstrap.max_encoders: must be >= 1, got 0",
		"bootstrap.ttl: must be >= 1s, got 999ms",
		"bootstrap.max_body_bytes: must be >= 256, got 255",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("problems %q lack %q", err, want)
		}
	}
	for _, badListen := range []string{"h:port", "h:70000", "h:-1", "h"} {
		c := DefaultBootstrap()
		c.Listen = badListen
		var p configfile.Problems
		c.Validate(&p, "bootstrap")
		if p.Err() == nil {
			t.Errorf("listen %q accepted", badListen)
		}
	}
}

// FuzzBootstrapHandler: no method, path or body makes the handler panic or
// answer anything but a known status; every error answer is JSON.
func FuzzBootstrapHandler(f *testing.F) {
	f.Add("POST", "/register_encoder_url", []byte(`{"url":"http://h:1"}`))
	f.Add("DELETE", "/unregister_encoder_url", []byte(`{"url":"http://h:1/p/"}`))
	f.Add("POST", "/register_encoder_url", []byte(`{"url":"\u0000"}`))
	f.Add("POST", "/register_encoder_url", []byte(`{"url":"http://[::1]:1","url":7}`))
	f.Add("POST", "/register_encoder_url", []byte(strings.Repeat(`{"a":`, 100)))
	f.Add("GET", "/list_encoder_urls", []byte(nil))
	f.Add("PUT", "/health", []byte("x"))
	h := bsMemRegistry(8).Handler(zap.NewNop(), BootstrapAccess{})
	f.Fuzz(func(t *testing.T, method, path string, body []byte) {
		var req fasthttp.Request
		req.Header.SetMethod(method)
		req.SetRequestURI(path)
		req.SetBody(body)
		var ctx fasthttp.RequestCtx
		ctx.Init(&req, nil, nil)
		h(&ctx)
		status := ctx.Response.StatusCode()
		switch status {
		case 200:
		case 400, 404, 405, 413, 503:
			if !json.Valid(ctx.Response.Body()) {
				t.Fatalf("%d body is not JSON: %q", status, ctx.Response.Body())
			}
		default:
			t.Fatalf("status %d", status)
		}
	})
}
