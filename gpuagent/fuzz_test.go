package gpuagent

import (
	"errors"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/encgate/encgate/internal/configfile/configfiletest"
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
