package idempotency

import (
	"testing"

	"github.com/encgate/encgate/internal/sglang"
)

const goodSend = `{"req_id":"r_local_part_0","part_idx":0,"embedding_size":1024,"prefill_host":"10.0.0.1","embedding_port":40001,"session_id":"10.0.0.1:17000","buffer_address":18446744073709551615,"receive_count":4}`

func parsed(t testing.TB, body string) Send {
	t.Helper()
	s, err := sglang.ParseSend([]byte(body), sglang.Limits{})
	if err != nil {
		t.Fatalf("%s: %v", body, err)
	}
	return NewSend(s)
}

func TestNewSend(t *testing.T) {
	s := parsed(t, goodSend)
	if s.Key != (Key{ReqID: "r_local_part_0", Dest: "10.0.0.1:40001"}) || s.ReceiveCount != 4 {
		t.Fatalf("%+v", s)
	}
	other := parsed(t, `{"req_id":"r_local_part_0","prefill_host":"10.0.0.1","embedding_port":40001,"session_id":"10.0.0.1:17000","buffer_address":18446744073709551614}`)
	if f := s.FP.Diff(other.FP); f != "buffer_address" || other.ReceiveCount != 0 {
		t.Errorf("Diff = %q, receive_count %d", f, other.ReceiveCount)
	}
	// One value, one identity, however JSON spells it.
	escaped := parsed(t, `{"req_id":"r_local\u005fpart_0","prefill_host":"10.0.0.\u0031","embedding_port":40001,"session_id":"10.0.0.1:1700\u0030","buffer_address":18446744073709551615,"receive_count":4}`)
	if escaped != s {
		t.Errorf("escaped spelling: %+v != %+v", escaped, s)
	}
}

// The key must not alias the body: the gateway's request buffers are reused.
func TestNewSendCopiesTheBody(t *testing.T) {
	body := []byte(goodSend)
	s := parsed(t, string(body))
	p, _ := sglang.ParseSend(body, sglang.Limits{})
	k := NewSend(p).Key
	for i := range body {
		body[i] = 'x'
	}
	if k != s.Key {
		t.Fatalf("key changed with the body: %+v", k)
	}
}
