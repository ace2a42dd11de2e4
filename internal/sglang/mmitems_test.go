package sglang

import (
	"testing"
	"unsafe"
)

// An /encode's mm_items come back as the body's own bytes, exactly as sent
// (whitespace and escapes included), so that content placement hashes what
// the encoder's media cache keys; the last occurrence wins, as the
// encoder's JSON decoder reads it. Other routes hand back none.
func TestEncodeHandsBackTheRawMMItems(t *testing.T) {
	for _, c := range []struct{ body, want string }{
		{`{"req_id":"r","modality":"IMAGE","mm_items":["a.png","b.png"],"num_parts":1,"part_idx":0}`, `["a.png","b.png"]`},
		{`{"req_id":"r","modality":"IMAGE","mm_items" : [ "a.png" ,"\u0062.png" ] ,"num_parts":1,"part_idx":0}`, `[ "a.png" ,"\u0062.png" ]`},
		{`{"req_id":"r","modality":"IMAGE","mm_items":"x.png","num_parts":1,"part_idx":0}`, `"x.png"`},
		{`{"mm_items":["old"],"req_id":"r","modality":"IMAGE","mm_items":["new"],"num_parts":1,"part_idx":0}`, `["new"]`},
	} {
		body := []byte(c.body)
		req, ferr := RouteEncode.Parse(body, Limits{})
		if ferr != nil {
			t.Fatalf("%s: %v", c.body, ferr)
		}
		if string(req.MMItems) != c.want {
			t.Errorf("%s: MMItems %s, want %s", c.body, req.MMItems, c.want)
			continue
		}
		start, end := uintptr(unsafe.Pointer(&body[0])), uintptr(unsafe.Pointer(&body[len(body)-1]))
		if at := uintptr(unsafe.Pointer(&req.MMItems[0])); at < start || at > end {
			t.Errorf("%s: MMItems is a copy, not a view of the body", c.body)
		}
	}
	req, ferr := RouteMetadata.Parse([]byte(`{"req_id":"r","part_idx":0,"mm_items":["a"]}`), Limits{})
	if ferr != nil || req.MMItems != nil {
		t.Errorf("a metadata pull: MMItems %q, %v; want none", req.MMItems, ferr)
	}
}
