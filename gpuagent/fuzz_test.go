package gpuagent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/encgate/encgate/internal/configfile/configfiletest"
	"github.com/encgate/encgate/internal/jsonfield"
)

// FuzzAgentConfig loads arbitrary files with LoadConfig: never a panic;
// every problem names a field path or a line; the error is exactly the
// decode problems and Validate's; and a file that loads encodes and loads
// back to the same configuration.
func FuzzAgentConfig(f *testing.F) {
	example, err := os.ReadFile(filepath.Join("..", "configs", "agent.yaml"))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(example)
	for _, s := range []string{
		"listen: \"127.0.0.1:0\"\nadmin_listen: \"127.0.0.1:0\"\n",
		"receiver:\n  handshake_listen: \"127.0.0.1:0\"\n  data_listen: \"127.0.0.1:0\"\n  advertise_host: 127.0.0.1\n  buffers: [64MiB, 1024]\n",
		"receiver: {}\n", "receiver: ~\n", "staging: {capacity_bytes: 1KiB, max_stage_bytes: 2KiB, ttl: 0s}\n",
		"transfer: {allow_networks: [\"0.0.0.0/0\", \"::/0\", \"10.0.0.1/33\", x]}\n",
		"notify: {http_url: \"ftp://x\"}\nlog: {level: loud}\nshutdown: {grace: -1s}\n",
		"staging: {capacity_bytes: 9223372036854775807B}\nbogus: [1]\n", "- a\n", "{", "",
	} {
		f.Add([]byte(s))
	}
	path := filepath.Join(f.TempDir(), "agent.yaml")
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
		if len(cfg.Transfer.allowList()) != len(cfg.Transfer.AllowNetworks) {
			t.Fatalf("allow_networks %q validated but parse to %v", cfg.Transfer.AllowNetworks, cfg.Transfer.allowList())
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

var (
	jsonIntRE  = regexp.MustCompile(`^-?(0|[1-9][0-9]*)$`)
	jsonUintRE = regexp.MustCompile(`^(0|[1-9][0-9]*)$`)
)

// refSend is parseSend written with encoding/json, field by field in the
// same order: the reference the fuzz target compares with.
func refSend(body []byte) (r sendRequest, ok bool) {
	var m map[string]json.RawMessage
	if json.Unmarshal(body, &m) != nil || m == nil {
		return r, false
	}
	str := func(k string) (string, bool) {
		raw := m[k]
		if !bytes.HasPrefix(raw, []byte(`"`)) {
			return "", false
		}
		var s string
		return s, json.Unmarshal(raw, &s) == nil
	}
	isNull := func(k string) bool { raw, ok := m[k]; return !ok || string(raw) == "null" }
	num := func(k string, re *regexp.Regexp, lo, hi *big.Int) (*big.Int, bool) {
		raw := string(m[k])
		if !re.MatchString(raw) {
			return nil, false
		}
		n, _ := new(big.Int).SetString(raw, 10)
		return n, n.Cmp(lo) >= 0 && n.Cmp(hi) <= 0
	}
	minI, maxI := big.NewInt(-1<<63), big.NewInt(1<<63-1)
	maxU := new(big.Int).SetUint64(1<<64 - 1)
	r.ReqID, _ = str("req_id")
	if r.ReqID == "" {
		return r, false
	}
	if !isNull("part_idx") {
		n, ok := num("part_idx", jsonIntRE, minI, maxI)
		if !ok {
			return r, false
		}
		v := n.Int64()
		r.PartIdx = &v
	}
	var ok1, ok2 bool
	if r.PrefillHost, ok1 = str("prefill_host"); !ok1 || r.PrefillHost == "" {
		return r, false
	}
	port, ok2 := num("embedding_port", jsonIntRE, big.NewInt(1), big.NewInt(65535))
	if !ok2 {
		return r, false
	}
	r.EmbeddingPort = port.Int64()
	if r.SessionID, ok1 = str("session_id"); !ok1 || r.SessionID == "" {
		return r, false
	}
	addr, ok := num("buffer_address", jsonUintRE, big.NewInt(0), maxU)
	if !ok {
		return r, false
	}
	r.BufferAddress = addr.Uint64()
	if !isNull("receive_count") {
		n, ok := num("receive_count", jsonIntRE, big.NewInt(0), maxI)
		if !ok {
			return r, false
		}
		r.ReceiveCount = n.Int64()
	}
	return r, true
}

// FuzzSendBody checks the agent's /send body parser against encoding/json:
// the same verdict, the same fields (buffer_address exact to the last of its
// 64 bits), a req_id whenever the body has one even when another field is
// wrong, and every refusal a *badRequest.
func FuzzSendBody(f *testing.F) {
	for _, s := range []string{
		`{"req_id":"r","part_idx":0,"prefill_host":"10.0.0.2","embedding_port":5757,"session_id":"10.0.0.2:16001","buffer_address":140737488355328,"receive_count":2}`,
		`{"req_id":"r","part_idx":null,"prefill_host":"h","embedding_port":1,"session_id":"h:1","buffer_address":18446744073709551615,"receive_count":null}`,
		`{"req_id":"r","prefill_host":"h","embedding_port":65536,"session_id":"h:1","buffer_address":1}`,
		`{"req_id":"r","prefill_host":"h","embedding_port":5,"session_id":"h:1","buffer_address":18446744073709551616}`,
		`{"req_id":"r","prefill_host":"h","embedding_port":5,"session_id":"h:1","buffer_address":-1}`,
		`{"req_id":"r","prefill_host":"h","embedding_port":5.0,"session_id":"h:1","buffer_address":1e3}`,
		`{"req_id":"r","part_idx":"1","prefill_host":"h","embedding_port":5,"session_id":"h:1","buffer_address":0,"receive_count":-1}`,
		`{"req_id":"\u00e9\ud800","prefill_host":"h\u0000","embedding_port":5,"session_id":"[::1]:5","buffer_address":0}`,
		`{"req_id":7}`, `[]`, `null`, `{"req_id":"r","req_id":""}`, "{\"req_id\":\"\xff\"}", ``,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		if len(body) > 8<<10 {
			return // long bodies add no paths and slow minimisation
		}
		got, err := parseSend(body)
		var probe [1][]byte
		if errors.Is(jsonfield.Lookup(body, []string{"x"}, probe[:]), jsonfield.ErrTooDeep) {
			return // nested beyond jsonfield.MaxDepth: encoding/json allows more on purpose
		}
		want, ok := refSend(body)
		if ok != (err == nil) {
			t.Fatalf("parseSend(%s) = %+v, %v; encoding/json says ok=%v (%+v)", body, got, err, ok, want)
		}
		if err != nil {
			var bad *badRequest
			if !errors.As(err, &bad) {
				t.Fatalf("error %v is not a badRequest", err)
			}
			if got.ReqID != want.ReqID {
				t.Fatalf("parseSend(%s) refused with req_id %q, want %q", body, got.ReqID, want.ReqID)
			}
			return
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("parseSend(%s)\n got %+v\nwant %+v", body, got, want)
		}
		if got.dest() != fmt.Sprintf("%s:%d", got.PrefillHost, got.EmbeddingPort) {
			t.Fatalf("dest %q", got.dest())
		}
	})
}

// FuzzQueries checks the two small query parsers of the control API: the
// /v1/ack query (req_id alone, exactly once, not empty) against the
// reference reading of url.ParseQuery, and that the req_id an error
// envelope carries (queryReqID) is the one both the ack and the stage
// parsers accepted.
func FuzzQueries(f *testing.F) {
	for _, s := range []string{
		"req_id=chatcmpl-abc", "req_id=", "req_id=a&req_id=b", "req_id=a&x=1", "req_id=%zz", "req_id=a;b",
		"req_id=a%26b%3Dc", "REQ_ID=a", "req_id=a&tokens=1&dim=1&dtype=float32", "",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		id, err := parseAckQuery(raw)
		q, qerr := url.ParseQuery(raw)
		wantOK := qerr == nil && len(q) == 1 && len(q["req_id"]) == 1 && q["req_id"][0] != ""
		if (err == nil) != wantOK {
			t.Fatalf("parseAckQuery(%q) = %q, %v; url.ParseQuery reads %v, %v", raw, id, err, q, qerr)
		}
		if err != nil {
			var bad *badRequest
			if !errors.As(err, &bad) {
				t.Fatalf("error %v is not a badRequest", err)
			}
		} else if id != q["req_id"][0] || queryReqID(raw) != id {
			t.Fatalf("parseAckQuery(%q) = %q, url.ParseQuery %q, queryReqID %q", raw, id, q["req_id"][0], queryReqID(raw))
		}
		if r, err := parseStageQuery(raw); err == nil && queryReqID(raw) != r.ReqID {
			t.Fatalf("stage query %q: req_id %q, queryReqID %q", raw, r.ReqID, queryReqID(raw))
		}
	})
}
