package idempotency

import (
	"bytes"
	"encoding/json"
	"errors"
	"math/big"
	"regexp"
	"testing"

	"github.com/cespare/xxhash/v2"

	"github.com/encgate/encgate/internal/jsonfield"
)

var jsonIntRE = regexp.MustCompile(`^-?(0|[1-9][0-9]*)$`)

// refParseSend is ParseSend written with encoding/json, check by check in
// the same order: the reference FuzzParseSendAgainstJSON compares with.
func refParseSend(body []byte) (reqID, dest string, fp Fingerprint, count int, err error) {
	var m map[string]json.RawMessage
	if json.Unmarshal(body, &m) != nil || m == nil {
		return "", "", fp, 0, errors.New("not a JSON object")
	}
	str := func(k string) (string, bool) {
		var s string
		return s, bytes.HasPrefix(m[k], []byte(`"`)) && json.Unmarshal(m[k], &s) == nil
	}
	intIn := func(k string, lo, hi int64) bool {
		n, ok := new(big.Int).SetString(string(m[k]), 10)
		return ok && jsonIntRE.Match(m[k]) && n.Cmp(big.NewInt(lo)) >= 0 && n.Cmp(big.NewInt(hi)) <= 0
	}
	if reqID, _ = str("req_id"); reqID == "" {
		return "", "", fp, 0, ErrBadReqID
	}
	host, ok := str("prefill_host")
	if !ok || host == "" || !intIn("embedding_port", 0, 65535) {
		return "", "", fp, 0, ErrBadDestination
	}
	if _, ok := str("session_id"); !ok || !regexp.MustCompile(`^[0-9]+$`).Match(m["buffer_address"]) {
		return "", "", fp, 0, ErrBadTransfer
	}
	if raw, ok := m["receive_count"]; ok && string(raw) != "null" {
		if !intIn("receive_count", 0, 1<<20) {
			return "", "", fp, 0, ErrBadReceiveCount
		}
		n, _ := new(big.Int).SetString(string(raw), 10)
		count = int(n.Int64())
	}
	fp = Fingerprint{SessionID: xxhash.Sum64(m["session_id"]), BufferAddress: xxhash.Sum64(m["buffer_address"])}
	return reqID, host + ":" + string(m["embedding_port"]), fp, count, nil
}

// FuzzParseSendAgainstJSON checks the gateway's /send parser against
// encoding/json: the same verdict and error, the same key (strings compared
// as encoding/json reads them: invalid UTF-8 as U+FFFD), the fingerprint of
// the raw session_id and buffer_address text, and receive_count.
func FuzzParseSendAgainstJSON(f *testing.F) {
	for _, s := range []string{
		goodSend,
		`{"req_id":"r","prefill_host":"h","embedding_port":0,"session_id":"","buffer_address":0,"receive_count":1048576}`,
		`{"req_id":"r","prefill_host":"h","embedding_port":65536,"session_id":"s","buffer_address":1}`,
		`{"req_id":"r","prefill_host":"h","embedding_port":-0,"session_id":"s","buffer_address":99999999999999999999999}`,
		`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1.5}`,
		`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1,"receive_count":1048577}`,
		`{"req_id":"\u0072","prefill_host":"\u0068","embedding_port":1,"session_id":5,"buffer_address":1}`,
		"{\"req_id\":\"\xff\",\"prefill_host\":\"h\",\"embedding_port\":1,\"session_id\":\"s\",\"buffer_address\":1}",
		`{"req_id":""}`, `[]`, `{`,
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
		s, err := ParseSend(body)
		reqID, dest, fp, count, werr := refParseSend(body)
		if (err == nil) != (werr == nil) {
			t.Fatalf("ParseSend(%s) = %+v, %v; encoding/json says %v", body, s, err, werr)
		}
		if err != nil {
			for _, known := range []error{ErrBadReqID, ErrBadDestination, ErrBadTransfer, ErrBadReceiveCount} {
				if errors.Is(werr, known) && !errors.Is(err, known) {
					t.Fatalf("ParseSend(%s): %v, want %v", body, err, werr)
				}
			}
			return
		}
		asJSON := func(s string) string { return string([]rune(s)) }
		if asJSON(s.Key.ReqID) != reqID || asJSON(s.Key.Dest) != dest || s.FP != fp || s.ReceiveCount != count {
			t.Fatalf("ParseSend(%s) = %+v; encoding/json reads req_id %q dest %q fp %+v count %d", body, s, reqID, dest, fp, count)
		}
	})
}
