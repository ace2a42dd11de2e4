package jsonfield

import (
	"bytes"
	"encoding/json"
	"errors"
	"testing"
)

var keys = []string{"req_id", "buffer_address", "receive_count"}

func TestLookup(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		want    []string // raw values, "" for absent
		wantErr error
	}{
		{"simple", `{"req_id":"r1","x":[1,{"req_id":"inner"}]}`, []string{`"r1"`, "", ""}, nil},
		{"big int raw", `{"buffer_address":18446744073709551615,"req_id":"a"}`, []string{`"a"`, "18446744073709551615", ""}, nil},
		{"spaces", " \n{ \"receive_count\" : 4 , \"req_id\" : \"z\" } \t", []string{`"z"`, "", "4"}, nil},
		{"last wins", `{"req_id":"a","req_id":"b"}`, []string{`"b"`, "", ""}, nil},
		{"escaped key", `{"req\u005fid":"e"}`, []string{`"e"`, "", ""}, nil},
		{"empty object", `{}`, []string{"", "", ""}, nil},
		{"array", `[1,2]`, nil, ErrNotObject},
		{"null", `null`, nil, ErrNotObject},
		{"string", `"x"`, nil, ErrNotObject},
		{"empty", ``, nil, ErrSyntax},
		{"truncated", `{"req_id":"a"`, nil, ErrSyntax},
		{"trailing", `{} x`, nil, ErrSyntax},
		{"two values", `{}{}`, nil, ErrSyntax},
		{"bad number", `{"a":01}`, nil, ErrSyntax},
		{"nan", `{"a":NaN}`, nil, ErrSyntax},
		{"trailing comma", `{"a":1,}`, nil, ErrSyntax},
		{"control char", "{\"a\":\"\x01\"}", nil, ErrSyntax},
		{"bad escape", `{"a":"\x"}`, nil, ErrSyntax},
		{"deep", string(bytes.Repeat([]byte("["), MaxDepth+10)), nil, ErrTooDeep},
		{"deep in object", `{"a":` + string(bytes.Repeat([]byte("["), MaxDepth+10)), nil, ErrTooDeep},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			out := make([][]byte, len(keys))
			err := Lookup([]byte(tc.in), keys, out)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("err = %v, want %v", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("err = %v", err)
			}
			for i := range keys {
				if string(out[i]) != tc.want[i] {
					t.Errorf("%s = %q, want %q", keys[i], out[i], tc.want[i])
				}
			}
		})
	}
}

func TestStringAndInt(t *testing.T) {
	if s, ok := String([]byte(`"a\"b\u00e9"`)); !ok || s != "a\"bé" {
		t.Errorf("String escaped = %q %v", s, ok)
	}
	if s, ok := String([]byte(`"plain"`)); !ok || s != "plain" {
		t.Errorf("String plain = %q %v", s, ok)
	}
	if _, ok := String([]byte(`12`)); ok {
		t.Error("String accepted a number")
	}
	if n, ok := Int([]byte(`-42`)); !ok || n != -42 {
		t.Errorf("Int = %d %v", n, ok)
	}
	for _, bad := range []string{`1.5`, `1e3`, `"1"`, `18446744073709551615`, ``} {
		if _, ok := Int([]byte(bad)); ok {
			t.Errorf("Int(%q) accepted", bad)
		}
	}
	if !IsNull(nil) || !IsNull([]byte("null")) || IsNull([]byte(`0`)) {
		t.Error("IsNull wrong")
	}
}

func TestLookupAllocs(t *testing.T) {
	body := []byte(`{"req_id":"abc_local_part_0","part_idx":0,"prefill_host":"10.0.0.1","embedding_port":40001,"session_id":"10.0.0.1:17001","buffer_address":140737488355328,"receive_count":4,"embedding_size":1048576}`)
	out := make([][]byte, len(keys))
	allocs := testing.AllocsPerRun(100, func() {
		if err := Lookup(body, keys, out); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Errorf("Lookup allocated %.1f times per call, want 0", allocs)
	}
}

// FuzzLookup checks Lookup against encoding/json: both must agree on whether
// the input is a JSON object, and on the raw text of every top-level member.
func FuzzLookup(f *testing.F) {
	for _, s := range []string{
		`{"req_id":"r","buffer_address":18446744073709551615,"receive_count":2}`,
		`{"req_id":"a\u0000b","x":{"y":[true,false,null,-0.5e+3]}}`,
		`[]`, `{"a":}`, `{"req_id":1}`, ` {"req_id" : "x" } `, `{"a":"\ud800"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		out := make([][]byte, len(keys))
		err := Lookup(data, keys, out)
		var m map[string]json.RawMessage
		stdErr := json.Unmarshal(data, &m)
		isObject := stdErr == nil && m != nil
		if !json.Valid(data) {
			if err == nil {
				t.Fatalf("Lookup accepted invalid JSON %q", data)
			}
			return
		}
		if !isObject {
			if err == nil {
				t.Fatalf("Lookup accepted a non-object %q", data)
			}
			return
		}
		if err != nil {
			if errors.Is(err, ErrTooDeep) {
				return
			}
			t.Fatalf("Lookup rejected valid object %q: %v", data, err)
		}
		for i, k := range keys {
			want, present := m[k]
			if !present {
				if out[i] != nil {
					t.Fatalf("%s: got %q, want absent", k, out[i])
				}
				continue
			}
			if !bytes.Equal(bytes.TrimSpace(want), out[i]) {
				t.Fatalf("%s: got %q, want %q", k, out[i], want)
			}
		}
	})
}
