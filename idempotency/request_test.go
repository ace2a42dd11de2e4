package idempotency

import (
	"errors"
	"testing"

	"github.com/encgate/encgate/internal/jsonfield"
)

const goodSend = `{"req_id":"r_local_part_0","part_idx":0,"embedding_size":1024,"prefill_host":"10.0.0.1","embedding_port":40001,"session_id":"10.0.0.1:17000","buffer_address":18446744073709551615,"receive_count":4}`

func TestParseSend(t *testing.T) {
	s, err := ParseSend([]byte(goodSend))
	if err != nil {
		t.Fatal(err)
	}
	if s.Key != (Key{ReqID: "r_local_part_0", Dest: "10.0.0.1:40001"}) || s.ReceiveCount != 4 {
		t.Fatalf("parsed %+v", s)
	}
	other, _ := ParseSend([]byte(`{"req_id":"r_local_part_0","prefill_host":"10.0.0.1","embedding_port":40001,"session_id":"10.0.0.1:17000","buffer_address":18446744073709551614}`))
	if f := s.FP.Diff(other.FP); f != "buffer_address" {
		t.Errorf("Diff = %q, want buffer_address", f)
	}
	if other.ReceiveCount != 0 {
		t.Errorf("absent receive_count = %d", other.ReceiveCount)
	}
	tests := []struct {
		body string
		want error
	}{
		{`[]`, jsonfield.ErrNotObject},
		{`{"req_id":`, jsonfield.ErrSyntax},
		{`{"prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1}`, ErrBadReqID},
		{`{"req_id":"","prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1}`, ErrBadReqID},
		{`{"req_id":"r","embedding_port":1,"session_id":"s","buffer_address":1}`, ErrBadDestination},
		{`{"req_id":"r","prefill_host":"h","embedding_port":"1","session_id":"s","buffer_address":1}`, ErrBadDestination},
		{`{"req_id":"r","prefill_host":"h","embedding_port":70000,"session_id":"s","buffer_address":1}`, ErrBadDestination},
		{`{"req_id":"r","prefill_host":"h","embedding_port":1,"buffer_address":1}`, ErrBadTransfer},
		{`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1.5}`, ErrBadTransfer},
		{`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":-1}`, ErrBadTransfer},
		{`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1,"receive_count":-2}`, ErrBadReceiveCount},
	}
	for _, tc := range tests {
		if _, err := ParseSend([]byte(tc.body)); !errors.Is(err, tc.want) {
			t.Errorf("ParseSend(%s) = %v, want %v", tc.body, err, tc.want)
		}
	}
	if s, err := ParseSend([]byte(`{"req_id":"r","prefill_host":"h","embedding_port":1,"session_id":"s","buffer_address":1,"receive_count":null}`)); err != nil || s.ReceiveCount != 0 {
		t.Errorf("null receive_count: %+v %v", s, err)
	}
}

// FuzzParseSend: no panic, and an accepted body yields a key whose parts
// are non-empty and whose destination ends in the port's digits.
func FuzzParseSend(f *testing.F) {
	f.Add([]byte(goodSend))
	f.Add([]byte(`{"req_id":"a\u0062","prefill_host":"::1","embedding_port":0,"session_id":"","buffer_address":0}`))
	f.Add([]byte(`{"req_id":1}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		s, err := ParseSend(body)
		if err != nil {
			return
		}
		if s.Key.ReqID == "" || len(s.Key.Dest) < 3 || s.ReceiveCount < 0 {
			t.Fatalf("accepted %q as %+v", body, s)
		}
	})
}
