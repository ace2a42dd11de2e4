package gateway

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/valyala/fasthttp"
	"go.yaml.in/yaml/v3"

	"github.com/encgate/encgate/internal/configfile/configfiletest"
	"github.com/encgate/encgate/internal/jsonfield"
	"github.com/encgate/encgate/upstream"
)

// FuzzGatewayConfig loads arbitrary files with LoadConfig: never a panic;
// every problem names a field path or a line; the error is exactly the
// decode problems and Validate's; and a file that loads encodes and loads
// back to the same configuration.
func FuzzGatewayConfig(f *testing.F) {
	example, err := os.ReadFile(filepath.Join("..", "configs", "gateway.yaml"))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(example)
	for _, s := range []string{
		"encoders: [{name: a, url: \"http://127.0.0.1:1\"}]\n",
		"encoders:\n  - name: a\n    url: http://h:1\n    agent: http://h:7401\nretry:\n  send: {retry_on: [connect_failure, timeout]}\n",
		"encoders: [{name: a, url: \"http://h:1\"}, {name: a, url: \"http://h:1\"}]\nlisten: x\nadmin_listen: x\n",
		"encoders: [{name: a, url: \"http://h:1\"}]\nbreaker: {ignore: [{status: 504, body_contains: \"x\"}], failure_ratio: .nan}\n",
		"encoders: [{name: a, url: \"http://h:1\"}]\nretry: {metadata: {jitter: 0.25, multiplier: 1e308, max_backoff: 2562047h}}\n",
		"encoders: [{name: a, url: \"http://h:1\"}]\nidempotency: {store: redis, redis: {addr: \"h:6379\"}}\nlimits: {max_body_bytes: 1KiB}\n",
		"encoders: [{name: a, url: \"http://h:1\"}]\nidempotency: {store: redis}\nredis: {mode: sentinel, master_name: m, sentinel_addrs: [\"s:26379\", \"s\"], tls: {enabled: true, ca_file: /nope}}\n",
		"encoders: [{name: a, url: \"http://h:1\"}]\nidempotency: {store: redis}\nredis: {mode: cluster, cluster_addrs: [\"n:1\"], db: 2, master_name: x}\n",
		"upstream: {max_response_bytes: lots, timeout: 5}\nbogus: 1\n", "encoders: ~\n", "- 1\n", "{", "",
	} {
		f.Add([]byte(s))
	}
	path := filepath.Join(f.TempDir(), "gateway.yaml")
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 16<<10 {
			return // long files add no paths and slow minimisation
		}
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		cfg, err := LoadConfig(path)
		configfiletest.CheckLoadError(t, data, err, cfg.Validate)
		if err != nil {
			return
		}
		out, err := yaml.Marshal(cfg)
		if err != nil {
			t.Fatalf("marshal: %v", err)
		}
		if err := os.WriteFile(path, out, 0o600); err != nil {
			t.Fatal(err)
		}
		back, err := LoadConfig(path)
		if err != nil {
			t.Fatalf("the re-encoded configuration does not load: %v\n%s", err, out)
		}
		if !reflect.DeepEqual(configfiletest.Normalize(back), configfiletest.Normalize(cfg)) {
			t.Fatalf("round trip differs\n got %+v\nwant %+v\nvia %s", back, cfg, out)
		}
	})
}

// FuzzBodyFields checks the message the gateway reads out of an encoder's
// error answer without decoding it (upstream.AnswerMessage: the envelope's
// message, else the trimmed raw text) against encoding/json, and that the
// envelope carrying it, with the body's req_id, is valid JSON that gives
// both back.
func FuzzBodyFields(f *testing.F) {
	for _, s := range []string{
		`{"status":"error","message":"encode metadata not ready","req_id":"r-1"}`,
		`{"req_id":"a\u0000b","message":"x\"y\\z\u00e9"}`,
		`{"message":null}`, `{"message":5}`, `{"req_id":""}`, ` plain text error `,
		`{"message":"first","message":"second"}`, `{"mess\u0061ge":"escaped key"}`,
		"{\"message\":\"caf\xc3\xa9 \xff\"}", `[{"message":"in an array"}]`, `{"message":"x"} trailing`, "",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		if len(body) > 8<<10 {
			return // long bodies add no paths and slow minimisation
		}
		var probe [1][]byte
		if errors.Is(jsonfield.Lookup(body, []string{"x"}, probe[:]), jsonfield.ErrTooDeep) {
			return // nested beyond jsonfield.MaxDepth: encoding/json allows more on purpose
		}
		var obj map[string]json.RawMessage
		isObj := json.Unmarshal(body, &obj) == nil && obj != nil
		field := func(key string) (string, bool) {
			raw, ok := obj[key]
			if !isObj || !ok || !bytes.HasPrefix(bytes.TrimSpace(raw), []byte(`"`)) {
				return "", false
			}
			var s string
			return s, json.Unmarshal(raw, &s) == nil
		}

		wantMsg, ok := field("message")
		if !ok {
			wantMsg = strings.TrimSpace(string(body))
		}
		msg := upstream.AnswerMessage(body)
		if msg != wantMsg {
			t.Fatalf("AnswerMessage(%q) = %q, encoding/json reads %q", body, msg, wantMsg)
		}
		var id *string
		if v, ok := field("req_id"); ok {
			id = &v
		}
		checkEnvelope(t, 500, msg, id)
	})
}

func deref(s *string) any {
	if s == nil {
		return nil
	}
	return *s
}

// checkEnvelope writes an envelope and checks it: the status, JSON content,
// the encoder's key order, and message and req_id back (invalid UTF-8 read
// as U+FFFD per byte, as encoding/json writes it).
func checkEnvelope(t *testing.T, status int, msg string, reqID *string) {
	t.Helper()
	var ctx fasthttp.RequestCtx
	ctx.Response.SetBodyString("previous body")
	writeEnvelope(&ctx, status, msg, reqID)
	if ctx.Response.StatusCode() != status || string(ctx.Response.Header.ContentType()) != "application/json" {
		t.Fatalf("envelope answered %d %q", ctx.Response.StatusCode(), ctx.Response.Header.ContentType())
	}
	body := ctx.Response.Body()
	if !bytes.HasPrefix(body, []byte(`{"status":"error","message":"`)) || !json.Valid(body) {
		t.Fatalf("envelope body %q", body)
	}
	var env struct {
		Status  string  `json:"status"`
		Message string  `json:"message"`
		ReqID   *string `json:"req_id"`
	}
	if err := json.Unmarshal(body, &env); err != nil {
		t.Fatal(err)
	}
	if env.Message != string([]rune(msg)) {
		t.Fatalf("envelope message %q, want %q", env.Message, msg)
	}
	if (env.ReqID == nil) != (reqID == nil) || reqID != nil && *env.ReqID != string([]rune(*reqID)) {
		t.Fatalf("envelope req_id %v, want %v", deref(env.ReqID), deref(reqID))
	}
	if !bytes.HasSuffix(body, []byte(`,"req_id":null}`)) && reqID == nil {
		t.Fatalf("envelope without req_id: %q", body)
	}
}
