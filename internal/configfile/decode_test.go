package configfile

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

// problems decodes in over dst and returns each problem's text; a fatal
// error fails the test.
func problems(t *testing.T, in string, dst any) []string {
	t.Helper()
	err := Decode([]byte(in), dst)
	if err == nil {
		return nil
	}
	var de *DecodeError
	if !errors.As(err, &de) {
		t.Fatalf("Decode(%q) = %v, want a *DecodeError", in, err)
	}
	var out []string
	for _, p := range de.Problems {
		var fe *FieldError
		if !errors.As(p, &fe) {
			t.Fatalf("problem %q is a %T, want a *FieldError", p, p)
		}
		out = append(out, p.Error())
	}
	return out
}

func wantProblems(t *testing.T, in string, dst any, want ...string) {
	t.Helper()
	got := problems(t, in, dst)
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Decode(%q) problems\n got %q\nwant %q", in, got, want)
	}
}

type fleetFile struct {
	Fleet struct {
		Pool struct {
			Encoders []struct {
				Name string   `yaml:"name"`
				Wait Duration `yaml:"wait"`
			} `yaml:"encoders"`
		} `yaml:"pool"`
	} `yaml:"fleet"`
}

func TestDecodeUnknownKeyDeepInAList(t *testing.T) {
	var f fleetFile
	wantProblems(t, `fleet:
  pool:
    encoders:
      - name: a
      - {name: b}
      - name: c
        bogus: 1
        wait: 1s
`, &f, "fleet.pool.encoders[2].bogus: unknown key (line 7)")
	encs := f.Fleet.Pool.Encoders
	if len(encs) != 3 || encs[2].Name != "c" || encs[2].Wait.D() != time.Second {
		t.Errorf("the rest was not decoded: %+v", encs)
	}
}

type policy struct {
	MaxAttempts    int      `yaml:"max_attempts"`
	InitialBackoff Duration `yaml:"initial_backoff"`
	Multiplier     float64  `yaml:"multiplier"`
}

type retryFile struct {
	Retry struct {
		Metadata policy `yaml:"metadata"`
		Send     policy `yaml:"send"`
		Encode   policy `yaml:"encode"`
	} `yaml:"retry"`
}

func TestDecodeMergeKeys(t *testing.T) {
	var f retryFile
	// The anchored mapping's problem is reported where it lands, under both
	// the mapping it is written in and the one it is merged into.
	wantProblems(t, `retry:
  metadata: &base
    max_attempts: abc
    initial_backoff: 100ms
    multiplier: 2
  send:
    <<: *base
    initial_backoff: 1s
`, &f,
		`retry.metadata.max_attempts: cannot decode "abc" as an integer (line 3)`,
		`retry.send.max_attempts: cannot decode "abc" as an integer (line 3)`)
	if s := f.Retry.Send; s.InitialBackoff.D() != time.Second || s.Multiplier != 2 {
		t.Errorf("send = %+v: explicit keys must override merged ones", s)
	}
	if m := f.Retry.Metadata; m.InitialBackoff.D() != 100*time.Millisecond {
		t.Errorf("metadata = %+v", m)
	}

	// A list of merges: the first mapping that has a key wins; explicit
	// keys win over all; an unknown key in a merged mapping lands too.
	f = retryFile{}
	wantProblems(t, `retry:
  metadata: &a {max_attempts: 1, multiplier: 1.5}
  encode: &b {max_attempts: 2, initial_backoff: 2s, multiplier: 3}
  send:
    <<: [*a, *b, {multiplier: 9, jitter: full}]
    multiplier: 4
`, &f, "retry.send.jitter: unknown key (line 5)")
	if s := f.Retry.Send; s != (policy{MaxAttempts: 1, InitialBackoff: Duration(2 * time.Second), Multiplier: 4}) {
		t.Errorf("send = %+v", s)
	}

	// Merged mappings can merge in turn; a merge of anything but mappings
	// is a problem at the merge key.
	f = retryFile{}
	wantProblems(t, `retry:
  metadata: &a {max_attempts: 1}
  encode: &b {<<: *a, multiplier: 3}
  send: {<<: *b}
`, &f)
	if s := f.Retry.Send; s != (policy{MaxAttempts: 1, Multiplier: 3}) {
		t.Errorf("send = %+v", s)
	}
	f = retryFile{}
	wantProblems(t, "retry:\n  metadata: {<<: 5, max_attempts: 2}\n  send: {<<: [{multiplier: 2}, [1]]}\n", &f,
		`retry.metadata.<<: can merge only a mapping or a list of mappings, got "5" (line 2)`,
		"retry.send.<<: can merge only a mapping or a list of mappings, got a list (line 3)")
	if f.Retry.Metadata.MaxAttempts != 2 || f.Retry.Send.Multiplier != 2 {
		t.Errorf("decoded %+v", f.Retry)
	}

	// Into a map too.
	var m struct {
		Labels map[string]int `yaml:"labels"`
		Base   map[string]int `yaml:"base"`
	}
	wantProblems(t, "base: &b {a: 1, b: 2}\nlabels: {<<: *b, b: 3, c: x}\n", &m,
		`labels.c: cannot decode "x" as an integer (line 2)`)
	if !reflect.DeepEqual(m.Labels, map[string]int{"a": 1, "b": 3}) {
		t.Errorf("labels = %v", m.Labels)
	}
}

func TestDecodeDuplicateKeys(t *testing.T) {
	var s sample
	wantProblems(t, "inner:\n  n: 1\n  n: 2\nwait: 1s\ninner: {n: 3}\n", &s,
		"inner.n: duplicate key, first at line 2 (line 3)",
		"inner: duplicate key, first at line 1 (line 5)")
	if s.Inner.N != 1 || s.Wait.D() != time.Second {
		t.Errorf("decoded %+v: the first of each key counts", s)
	}
	// Also when the repeat is spelled differently: an alias, a quoted key.
	wantProblems(t, "k: &k wait\nwait: 1s\n*k : 2s\n", &struct {
		K    string   `yaml:"k"`
		Wait Duration `yaml:"wait"`
	}{}, "wait: duplicate key, first at line 2 (line 3)")
	wantProblems(t, "m: {a: 1, 'a': 2}\n", &struct {
		M map[string]int `yaml:"m"`
	}{}, "m.a: duplicate key, first at line 1 (line 1)")
	wantProblems(t, "a: &a {n: 1}\nb: {<<: *a, <<: *a}\n", &struct {
		A struct{ N int } `yaml:"a"`
		B struct{ N int } `yaml:"b"`
	}{}, "b.<<: duplicate key, first at line 2 (line 2)")
}

// cond is a custom type in the manner of upstream.Condition: a word, or a
// mapping it decodes with yaml.v3 itself.
type cond struct {
	Word  string
	After Duration
}

func (c *cond) UnmarshalYAML(n *yaml.Node) error {
	switch n.Kind {
	case yaml.ScalarNode:
		if n.Value != "now" && n.Value != "later" {
			return ValueError(n, "unknown condition %q", n.Value)
		}
		c.Word = n.Value
		return nil
	case yaml.MappingNode:
		var m struct {
			After Duration `yaml:"after"`
			Code  int      `yaml:"code"`
		}
		if err := n.Decode(&m); err != nil {
			return err // a *FieldError from Duration, or yaml's *TypeError
		}
		for i := 0; i < len(n.Content); i += 2 {
			if k := n.Content[i]; k.Value != "after" && k.Value != "code" {
				return ValueError(k, "unknown key %q in a condition", k.Value)
			}
		}
		c.After = m.After
		return nil
	}
	return errors.New("want a condition word or mapping")
}

func TestDecodeUnmarshalerProblemsNameTheirPath(t *testing.T) {
	var f struct {
		Retry struct {
			On []cond `yaml:"retry_on"`
		} `yaml:"retry"`
		Size ByteSize `yaml:"size"`
	}
	wantProblems(t, `retry:
  retry_on:
    - now
    - sometimes
    - {after: 5s}
    - after: soon
    - {after: 1s,
       extra: 1}
    - {code: x}
    - [1]
size: [1]
`, &f,
		`retry.retry_on[1]: unknown condition "sometimes" (line 4)`,
		`retry.retry_on[3]: "soon" is not a duration (want e.g. 250ms, 5s, 4m) (line 6)`,
		`retry.retry_on[4]: unknown key "extra" in a condition (line 8)`,
		"retry.retry_on[5]: line 9: cannot unmarshal !!str `x` into int (line 9)",
		"retry.retry_on[6]: want a condition word or mapping (line 10)",
		"size: want a byte size such as 8MiB (line 11)")
	// As in yaml.v3, elements that did not decode are left out.
	if on := f.Retry.On; len(on) != 2 || on[0].Word != "now" || on[1].After.D() != 5*time.Second {
		t.Errorf("retry_on = %+v", on)
	}
}

func TestDecodeAliases(t *testing.T) {
	type item struct {
		URL  string   `yaml:"url"`
		Wait Duration `yaml:"wait"`
	}
	var f struct {
		Name  string   `yaml:"name"`
		Other string   `yaml:"other"`
		Items []item   `yaml:"items"`
		Copy  []item   `yaml:"copy"`
		One   *item    `yaml:"one"`
		Waits []string `yaml:"waits"`
	}
	wantProblems(t, `name: &n gw
other: *n
items: &items
  - &first {url: a, wait: 1s}
  - {url: b, wait: &w 2s}
copy: *items
one: *first
waits: [*w, *n]
`, &f)
	want := []item{{"a", Duration(time.Second)}, {"b", Duration(2 * time.Second)}}
	if f.Other != "gw" || !reflect.DeepEqual(f.Items, want) || !reflect.DeepEqual(f.Copy, want) ||
		f.One == nil || *f.One != want[0] || !reflect.DeepEqual(f.Waits, []string{"2s", "gw"}) {
		t.Errorf("decoded %+v", f)
	}
	// An alias lands where it is used; a problem in its value is reported
	// there, at the line of the value.
	wantProblems(t, "items: [&x {url: a, wat: 1}]\none: *x\n", &f,
		`items[0].wat: unknown key, did you mean "wait"? (line 1)`, `one.wat: unknown key, did you mean "wait"? (line 1)`)
	// An alias inside its own anchor's value.
	var chain struct {
		One link `yaml:"one"`
	}
	// yaml.v3 stops at it; here the key holding it is left out.
	wantProblems(t, "one: &x {name: a, next: *x}\n", &chain, "one.next.next: alias *x is inside its own anchor's value (line 1)")
	if chain.One.Name != "a" || chain.One.Next != nil {
		t.Errorf("decoded %+v", chain.One)
	}
}

type link struct {
	Name string `yaml:"name"`
	Next *link  `yaml:"next"`
}

// tree is a list of lists all the way down, so every node of a document of
// lists is decoded by the walk itself.
type tree []tree

func TestDecodeRefusesAliasBombs(t *testing.T) {
	// Ten lists of ten aliases of the one before: 10^10 lists once
	// expanded, from 400 bytes.
	var b strings.Builder
	b.WriteString("a: &a [[], [], [], [], [], [], [], [], [], []]\n")
	for c := 'b'; c <= 'k'; c++ {
		fmt.Fprintf(&b, "%c: &%c [%s]\n", c, c, strings.TrimSuffix(strings.Repeat(fmt.Sprintf("*%c, ", c-1), 10), ", "))
	}
	var s struct{ A, B, C, D, E, F, G, H, I, J, K tree }
	err := Decode([]byte(b.String()), &s)
	var de *DecodeError
	if err == nil || errors.As(err, &de) || !strings.HasPrefix(err.Error(), "parsing config: line ") ||
		!strings.Contains(err.Error(), "aliases expand the document too much") {
		t.Fatalf("Decode = %v, want the alias bomb refused with a line", err)
	}
	// A value handed to yaml.v3 whole (here into any) is bounded by
	// yaml.v3 itself, a problem at its path.
	var v map[string]any
	got := problems(t, b.String(), &v)
	if len(got) != 9 || got[0] != "c: document contains excessive aliasing (line 3)" {
		t.Fatalf("problems %q, want c to k refused", got)
	}
	if len(v) != 2 || v["b"] == nil {
		t.Errorf("decoded %v, want a and b", v)
	}
	// Many such values, each within yaml.v3's bound, exceed it together:
	// then yaml.v3 refuses the document, naming no line.
	b.Reset()
	b.WriteString("a: &a [" + strings.TrimSuffix(strings.Repeat("1, ", 300), ", ") + "]\nb: &b [*a, *a, *a]\n")
	for i := range 400 {
		fmt.Fprintf(&b, "k%d: *b\n", i)
	}
	if err := Decode([]byte(b.String()), &v); err == nil || errors.As(err, &de) ||
		err.Error() != "parsing config: document contains excessive aliasing" {
		t.Fatalf("Decode = %v, want the document refused", err)
	}
}

func TestDecodeStopsAfterManyProblems(t *testing.T) {
	var b strings.Builder
	for i := range 1200 {
		fmt.Fprintf(&b, "k%d: 1\n", i)
	}
	got := problems(t, b.String(), &sample{})
	if len(got) != maxProblems+1 || got[maxProblems-1] != "k999: unknown key (line 1000)" ||
		got[maxProblems] != "line 1001: more than 1000 problems; decoding stopped here" {
		t.Fatalf("%d problems, ending %q", len(got), got[len(got)-2:])
	}
}

type kinds struct {
	I    int           `yaml:"i"`
	I8   int8          `yaml:"i8"`
	I16  int16         `yaml:"i16"`
	I32  int32         `yaml:"i32"`
	I64  int64         `yaml:"i64"`
	U    uint          `yaml:"u"`
	U8   uint8         `yaml:"u8"`
	U16  uint16        `yaml:"u16"`
	U32  uint32        `yaml:"u32"`
	U64  uint64        `yaml:"u64"`
	F32  float32       `yaml:"f32"`
	F64  float64       `yaml:"f64"`
	B    bool          `yaml:"b"`
	S    string        `yaml:"s"`
	D    time.Duration `yaml:"d"`
	P    *int          `yaml:"p"`
	L    []int         `yaml:"l"`
	A    [2]int        `yaml:"a"`
	M    map[string]int
	Any  any `yaml:"any"`
	Skip int `yaml:"-"`
	Untagged
	Named   Untagged `yaml:",inline"`
	Omitted int      `yaml:"omitted,omitempty"`
}

type Untagged struct {
	Plain int
	Bare  int `yaml:"bare"`
}

func TestDecodeScalarsAsYAMLDoes(t *testing.T) {
	var k kinds
	wantProblems(t, `i: 0x1F
i8: -128
i16: 1_000
i32: 2147483647
i64: -9223372036854775808
u: 0o17
u8: 255
u16: 65535
u32: 4294967295
u64: 18446744073709551615
f32: 1.5
f64: -.inf
b: yes
s: 12
d: 1m30s
p: 7
l: [1, 2]
a: [3, 4]
m: {x: 1}
any: {a: [1, b]}
untagged: {plain: 5}
plain: 6
bare: 7
omitted: 8
`, &k)
	p := 7
	want := kinds{I: 31, I8: -128, I16: 1000, I32: 2147483647, I64: -1 << 63, U: 15, U8: 255, U16: 65535, U32: 1<<32 - 1,
		U64: 1<<64 - 1, F32: 1.5, F64: k.F64, B: true, S: "12", D: 90 * time.Second, P: &p, L: []int{1, 2}, A: [2]int{3, 4},
		M: map[string]int{"x": 1}, Any: map[string]any{"a": []any{1, "b"}},
		Untagged: Untagged{Plain: 5}, Named: Untagged{Plain: 6, Bare: 7}, Omitted: 8}
	if !reflect.DeepEqual(k, want) || k.F64 > -1e308 {
		t.Errorf("decoded\n %+v\nwant %+v", k, want)
	}

	k = kinds{I: 1, S: "keep", P: &p, L: []int{9}}
	wantProblems(t, `i: abc
i8: 128
u: -1
u8: 256
f32: x
b: maybe
s: [1]
d: 5
i64: "5"
l: [1, x, 3]
a: [1]
m: {a: b}
skip: 1
`, &k,
		`i: cannot decode "abc" as an integer (line 1)`,
		`i8: cannot decode "128" as an integer from -128 to 127 (line 2)`,
		`u: cannot decode "-1" as an integer >= 0 (line 3)`,
		`u8: cannot decode "256" as an integer from 0 to 255 (line 4)`,
		`f32: cannot decode "x" as a number (line 5)`,
		`b: cannot decode "maybe" as a boolean (true or false) (line 6)`,
		"s: cannot decode a list as a string (line 7)",
		`d: cannot decode "5" as a duration (e.g. 250ms, 5s, 4m) (line 8)`,
		`i64: cannot decode "5" as an integer (line 9)`,
		`l[1]: cannot decode "x" as an integer (line 10)`,
		"a: want a list of 2, got 1 (line 11)",
		`m.a: cannot decode "b" as an integer (line 12)`,
		"skip: unknown key (line 13)")
	if k.I != 1 || k.S != "keep" || !reflect.DeepEqual(k.L, []int{1, 3}) {
		t.Errorf("decoded %+v: a refused value keeps the old one; a list drops the refused element", k)
	}

	// Null resets what can be nil and keeps the rest, without a problem.
	k = kinds{I: 1, P: &p, L: []int{9}, M: map[string]int{"x": 1}}
	wantProblems(t, "i: ~\np: null\nl:\nm: {x: ~, y: ~}\n", &k)
	if k.I != 1 || k.P != nil || k.L != nil || !reflect.DeepEqual(k.M, map[string]int{"x": 1, "y": 0}) {
		t.Errorf("decoded %+v", k)
	}

	// Odd keys are quoted in the path, so it stays on one line.
	wantProblems(t, "\"a\\nb\": 1\n\"\": 2\n~: 3\n[1]: 4\n", &k,
		`["a\nb"]: unknown key (line 1)`, `[""]: unknown key (line 2)`,
		`["~"]: null is not a valid key (line 3)`, "line 4: a key must be a scalar, got a list")
}

func TestDecodeFiveProblemsAtOnce(t *testing.T) {
	var f struct {
		Listen string `yaml:"listen"`
		Retry  struct {
			Metadata policy `yaml:"metadata"`
		} `yaml:"retry"`
		Encoders []struct {
			Name string   `yaml:"name"`
			Wait Duration `yaml:"wait"`
		} `yaml:"encoders"`
		Limits struct {
			MaxBody ByteSize `yaml:"max_body_bytes"`
			Conns   int      `yaml:"max_conns"`
		} `yaml:"limits"`
	}
	err := Decode([]byte(`listen: ":8080"
retry:
  metadata:
    max_attempts: abc
    multiplier: 2
encoders:
  - name: a
    wait: forever
  - name: b
    bogus: 1
limits:
  max_body_bytes: lots
  max_conns: 10
  max_conns: 20
`), &f)
	var de *DecodeError
	if !errors.As(err, &de) {
		t.Fatalf("err = %v", err)
	}
	want := `retry.metadata.max_attempts: cannot decode "abc" as an integer (line 4)
encoders[0].wait: "forever" is not a duration (want e.g. 250ms, 5s, 4m) (line 8)
encoders[1].bogus: unknown key (line 10)
limits.max_body_bytes: "lots" is not a byte size (want e.g. 8MiB, 64KiB, 1048576) (line 12)
limits.max_conns: duplicate key, first at line 13 (line 14)`
	if err.Error() != want {
		t.Errorf("error\n%s\nwant\n%s", err, want)
	}
	if f.Listen != ":8080" || f.Retry.Metadata.Multiplier != 2 || len(f.Encoders) != 2 || f.Encoders[1].Name != "b" || f.Limits.Conns != 10 {
		t.Errorf("the rest was not decoded: %+v", f)
	}
	var fe *FieldError
	if !errors.As(err, &fe) || fe.Path != "retry.metadata.max_attempts" || fe.Line != 4 || fe.Column != 19 {
		t.Errorf("first problem = %+v", fe)
	}
}

// A problem's line is yaml.v3's: libyaml counts NEL, LS and PS as line
// breaks (YAML 1.1), and reads UTF-16 told by its byte order mark.
func TestDecodeLinesAsYAMLCountsThem(t *testing.T) {
	var s sample
	wantProblems(t, "wait: 1s\u0085bogus: 1\r\ninner: {n: \"a\u2028b\"}\rsize: [\u2029]\n", &s,
		"bogus: unknown key (line 2)", `inner.n: cannot decode "a\u2028b" as an integer (line 3)`,
		"size: want a byte size such as 8MiB (line 5)")
	err := Decode([]byte("wait: 1s\u0085bogus: 1\n"), &s)
	var fe *FieldError
	if !errors.As(err, &fe) || fe.Line != 2 || fe.Column != 1 {
		t.Errorf("problem at %+v, want line 2 column 1", fe)
	}
	utf16 := []byte{0xff, 0xfe}
	for _, r := range "wait: 1s\u0085x: 1\ny: 2\n" {
		utf16 = append(utf16, byte(r), byte(r>>8))
	}
	wantProblems(t, string(utf16), &s, "x: unknown key (line 2)", "y: unknown key (line 3)")
	if got := YAMLLines(utf16); got != 4 {
		t.Errorf("YAMLLines = %d, want 4", got)
	}
}

func TestDecodeDocumentLevel(t *testing.T) {
	s := sample{Size: 7}
	for _, in := range []string{"", "# nothing\n", "---\n", "~\n"} {
		if err := Decode([]byte(in), &s); err != nil || s.Size != 7 {
			t.Errorf("Decode(%q) = %v, %+v; want dst unchanged", in, err, s)
		}
	}
	if err := Decode([]byte("size: 1\n---\nsize: 2\n"), &s); err == nil || s.Size != 7 {
		t.Errorf("two documents: %v, %+v", err, s)
	}
	wantProblems(t, "- 1\n", &s, "line 1: cannot decode a list as a mapping")
	// A syntax error names yaml's line, or, where yaml names none, the one
	// found here.
	for in, want := range map[string]string{
		"wait: [\n":         "parsing config: yaml: line 1: ",
		"\tname: x":         "parsing config: line 1: ",
		"a: 1\nb: \"\x01\"": "parsing config: line 2: ",
		"a: 1\nb: *nope\n":  "parsing config: line ",
	} {
		if err := Decode([]byte(in), &s); err == nil || !strings.HasPrefix(err.Error(), want) {
			t.Errorf("Decode(%q) = %v, want %q...", in, err, want)
		}
	}
	if err := Decode([]byte("size: 1\n"), s); err == nil {
		t.Error("decoding into a non-pointer succeeded")
	}
	type badTag struct {
		A int `yaml:"a,sometimes"`
	}
	if err := Decode([]byte("a: 1\n"), &badTag{}); err == nil || !strings.Contains(err.Error(), "unsupported flag") {
		t.Errorf("bad tag: %v", err)
	}
}

func TestDecodeIgnoresTopLevelExtensionKeys(t *testing.T) {
	// An x- key holds anchors for merges and aliases elsewhere; only at
	// the top is it ignored.
	var f retryFile
	wantProblems(t, `x-defaults: &defaults
  max_attempts: 3
  initial_backoff: 250ms
x-factor: &factor 1.5
x-unused: {anything: [goes, here]}
retry:
  metadata:
    <<: *defaults
    multiplier: *factor
  send: *defaults
  encode:
    <<: *defaults
    x-note: no
`, &f, `retry.encode.x-note: unknown key (line 13)`)
	want := policy{MaxAttempts: 3, InitialBackoff: Duration(250 * time.Millisecond)}
	if f.Retry.Send != want || f.Retry.Encode != want {
		t.Errorf("decoded %+v, want send and encode %+v", f.Retry, want)
	}
	if want.Multiplier = 1.5; f.Retry.Metadata != want {
		t.Errorf("metadata = %+v, want %+v", f.Retry.Metadata, want)
	}
	// A mistake in an x- value shows where it lands.
	f = retryFile{}
	wantProblems(t, "x-d: &d {max_attempts: many, multipler: 2}\nretry: {send: {<<: *d, initial_backoff: 1s}}\n", &f,
		`retry.send.max_attempts: cannot decode "many" as an integer (line 1)`,
		`retry.send.multipler: unknown key, did you mean "multiplier"? (line 1)`)
	if f.Retry.Send.InitialBackoff.D() != time.Second {
		t.Errorf("send = %+v", f.Retry.Send)
	}
}

func TestDecodeMergedValueStandsInForARefusedOne(t *testing.T) {
	// The explicit value is refused and left out, so the merged one is
	// decoded, and checked.
	var f retryFile
	wantProblems(t, "retry:\n  metadata: &m {max_attempts: 2, multiplier: x}\n  send: {<<: *m, max_attempts: y}\n", &f,
		`retry.metadata.multiplier: cannot decode "x" as a number (line 2)`,
		`retry.send.max_attempts: cannot decode "y" as an integer (line 3)`,
		`retry.send.multiplier: cannot decode "x" as a number (line 2)`)
	if f.Retry.Send.MaxAttempts != 2 {
		t.Errorf("send = %+v, want the merged max_attempts", f.Retry.Send)
	}
}

func TestSuggest(t *testing.T) {
	names := []string{"pin_ttl", "unknown_wait", "failed_registration_wait", "max_pins", "n", "wait"}
	for unknown, want := range map[string]string{
		"unknwn_wait":  "unknown_wait", // a deletion
		"uknown_wiat":  "unknown_wait", // an insertion and a swap
		"pin_tll":      "pin_ttl",
		"max_pin":      "max_pins",
		"failed_regis": "failed_registration_wait", // a prefix
		"wat":          "wait",
		"m":            "", // too short to be near anything
		"bogus":        "",
		"pinttl_extra": "",
	} {
		got := suggest(unknown, names)
		if want != "" {
			want = `, did you mean "` + want + `"?`
		}
		if got != want {
			t.Errorf("suggest(%q) = %q, want %q", unknown, got, want)
		}
	}
	for a, b := range map[string]string{"": "abc", "ab": "ba", "kitten": "sitting", "same": "same"} {
		want := map[string]int{"": 3, "ab": 1, "kitten": 3, "same": 0}[a]
		if d := editDistance(a, b); d != want || editDistance(b, a) != want {
			t.Errorf("editDistance(%q, %q) = %d, want %d", a, b, d, want)
		}
	}
}
