package listener

import (
	"testing"
)

// FuzzFramerSplits feeds the framer arbitrary bytes in one read and one
// byte at a time (FuzzFrontEnd in gateway/ sends them through a whole
// gateway).
func FuzzFramerSplits(f *testing.F) {
	for _, s := range []string{
		"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
		"POST /encode HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}",
		"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX: y\r\n\r\n",
		"GET / HTTP/1.1\nHost: a\n\n",
		"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 16<<10 {
			return
		}
		checkFramerSplits(t, data)
	})
}

// checkFramerSplits checks that the framer reads data the same whether it
// comes in one read or one byte at a time: the same refusal at the same
// byte, or the same state after it.
func checkFramerSplits(t *testing.T, data []byte) {
	var whole, bytewise framer
	kw, ew := whole.scan(append([]byte(nil), data...))
	kb, eb := -1, (*framingError)(nil)
	for i := range data {
		if _, err := bytewise.scan(data[i : i+1]); err != nil {
			kb, eb = i, err
			break
		}
	}
	switch {
	case ew != eb:
		t.Fatalf("framer: one read refuses with %v, byte by byte with %v\ninput %q", ew, eb, data)
	case ew != nil && kw != kb:
		t.Fatalf("framer: one read refuses at byte %d, byte by byte at %d (%v)\ninput %q", kw, kb, ew, data)
	case ew == nil && whole != bytewise:
		t.Fatalf("framer: one read ends in %+v, byte by byte in %+v\ninput %q", whole, bytewise, data)
	}
}
