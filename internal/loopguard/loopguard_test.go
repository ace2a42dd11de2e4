package loopguard

import (
	"bytes"
	"testing"

	"github.com/valyala/fasthttp"
)

const fixedID = "0102030405060708"

func fixedEntropy() *bytes.Reader { return bytes.NewReader([]byte{1, 2, 3, 4, 5, 6, 7, 8}) }

func TestReadVia(t *testing.T) {
	l, err := New(fixedEntropy(), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		fields []string
		hops   int
		own    bool
	}{
		{nil, 0, false},
		{[]string{""}, 0, false},
		{[]string{"1.1 a"}, 1, false},
		{[]string{"1.1 a, , 1.1 b,"}, 2, false},
		{[]string{"1.1 a (x, y, z), HTTP/2 b"}, 2, false},
		{[]string{"1.1 a", "1.1 b, 1.1 c"}, 3, false},
		{[]string{"1.1 encgate-" + fixedID}, 1, true},
		{[]string{"1.1 a,1.1\tencgate-" + fixedID + "(me)"}, 2, true},
		{[]string{"1.1 encgate-" + fixedID + "0"}, 1, false},
		{[]string{"1.1 x (1.1 encgate-" + fixedID + ")"}, 1, false}, // in a comment: not a received-by
		{[]string{"encgate-" + fixedID}, 1, false},                  // no protocol: a received-by alone is not one
	} {
		var h fasthttp.RequestHeader
		for _, f := range c.fields {
			h.Add("Via", f)
		}
		hops, own := l.Read(&h)
		if hops != c.hops || own != c.own {
			t.Errorf("Via %q: hops %d own %v, want %d %v", c.fields, hops, own, c.hops, c.own)
		}
	}
}

func TestViaAppendsTheEntry(t *testing.T) {
	l, err := New(fixedEntropy(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var h fasthttp.RequestHeader
	if v := string(l.Via(&h)); v != "1.1 encgate-"+fixedID {
		t.Errorf("Via without one: %q", v)
	}
	h.Add("Via", "1.1 a")
	h.Add("Via", "1.0 b")
	if v := string(l.Via(&h)); v != "1.1 a, 1.0 b, 1.1 encgate-"+fixedID {
		t.Errorf("Via after two fields: %q", v)
	}
	if l.Mark() != "encgate-"+fixedID {
		t.Errorf("Mark %q", l.Mark())
	}
}
