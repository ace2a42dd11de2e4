package jsonfield

import (
	"bytes"
	"encoding/json"
	"testing"
)

// FuzzString checks String against encoding/json on every JSON value: the
// same string for a JSON string (invalid UTF-8 read as U+FFFD, which String
// used to pass through raw on its fast path), ok false for anything else.
func FuzzString(f *testing.F) {
	for _, s := range []string{
		`"r-1"`, `"a\u0000b"`, `"\ud800"`, `"caf` + "\xc3\xa9" + `"`, `"` + "\xff\xfe" + `"`, `"\"\\\/\b\f\n\r\t"`,
		`""`, `null`, `1`, `["x"]`, `{"a":"b"}`, `"` + "\xe2\x82" + `"`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		if !json.Valid(raw) || len(bytes.TrimSpace(raw)) != len(raw) {
			return // String is given values as Lookup hands them out: valid, trimmed
		}
		var want any
		dec := json.NewDecoder(bytes.NewReader(raw))
		dec.UseNumber() // a number too large for a float64 is still valid JSON
		if err := dec.Decode(&want); err != nil {
			t.Fatal(err)
		}
		ws, isString := want.(string)
		got, ok := String(raw)
		if ok != isString || got != ws {
			t.Fatalf("String(%q) = %q, %v; encoding/json reads %q (a string: %v)", raw, got, ok, ws, isString)
		}
	})
}
