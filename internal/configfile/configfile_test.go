package configfile

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func TestParseByteSize(t *testing.T) {
	tests := []struct {
		in   string
		want ByteSize
		bad  bool
	}{
		{"1024", 1024, false}, {"8MiB", 8 << 20, false}, {"64 KiB", 64 << 10, false},
		{"2GB", 2e9, false}, {"1B", 1, false}, {"0", 0, false},
		{"-1", 0, true}, {"lots", 0, true}, {"1.5MiB", 0, true}, {"99999999999TiB", 0, true},
	}
	for _, tc := range tests {
		got, err := ParseByteSize(tc.in)
		if tc.bad != (err != nil) || got != tc.want {
			t.Errorf("ParseByteSize(%q) = %d, %v", tc.in, got, err)
		}
	}
	if s := ByteSize(8 << 20).String(); s != "8MiB" {
		t.Errorf("String = %q", s)
	}
	if s := ByteSize(1000).String(); s != "1000" {
		t.Errorf("String = %q", s)
	}
}

type sample struct {
	Wait  Duration `yaml:"wait"`
	Size  ByteSize `yaml:"size"`
	Inner struct {
		N int `yaml:"n"`
	} `yaml:"inner"`
}

func TestDecodeStrict(t *testing.T) {
	s := sample{Size: 7}
	if err := Decode([]byte("wait: 250ms\ninner:\n  n: 3\n"), &s); err != nil {
		t.Fatal(err)
	}
	if s.Wait.D() != 250*time.Millisecond || s.Inner.N != 3 || s.Size != 7 {
		t.Fatalf("decoded %+v", s)
	}
	for in, want := range map[string]string{
		"inner:\n  m: 1\n":      "inner.m: unknown key (line 2)",
		"wait: soon\n":          `"soon" is not a duration`,
		"size: [1]\n":           "want a byte size",
		"wait: 1s\n---\nx: 1\n": "more than one YAML document",
	} {
		err := Decode([]byte(in), &s)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Decode(%q) = %v, want %q", in, err, want)
		}
	}
	if err := Decode(nil, &s); err != nil {
		t.Errorf("empty document: %v", err)
	}
}

func TestProblems(t *testing.T) {
	var p Problems
	if p.Err() != nil {
		t.Fatal("empty Problems is an error")
	}
	p.Addf("a.b", "must be %d", 1)
	p.Positive("c", 0)
	err := p.Err()
	if err == nil || !strings.Contains(err.Error(), "a.b: must be 1") || !strings.Contains(err.Error(), "c: must be > 0") {
		t.Fatalf("Err = %v", err)
	}
}

func TestDecodeReportsEveryKeyWithItsPath(t *testing.T) {
	var s sample
	err := Decode([]byte("wait: soon\ninner:\n  n: 3\n  m: 1\nextra: [1]\nsize: 2MiB\n"), &s)
	var de *DecodeError
	if !errors.As(err, &de) {
		t.Fatalf("err = %v, want a *DecodeError", err)
	}
	want := []string{
		`wait: "soon" is not a duration (want e.g. 250ms, 5s, 4m) (line 1)`,
		"inner.m: unknown key (line 4)",
		"extra: unknown key (line 5)",
	}
	if len(de.Problems) != len(want) {
		t.Fatalf("problems %q, want %q", de.Problems, want)
	}
	for i, w := range want {
		if de.Problems[i].Error() != w {
			t.Errorf("problem %d = %q, want %q", i, de.Problems[i], w)
		}
	}
	// Everything else was still decoded.
	if s.Inner.N != 3 || s.Size != 2<<20 {
		t.Errorf("partial decode lost values: %+v", s)
	}
	if err := Decode([]byte("wait: [\n"), &s); err == nil || errors.As(err, &de) {
		t.Errorf("a syntax error must be fatal, got %v", err)
	}
}
