package configfile

import (
	"bytes"
	"errors"
	"io"
	"math/big"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

// FuzzParseByteSize checks ParseByteSize against big-integer arithmetic on
// the number and its unit, and that String is its inverse.
func FuzzParseByteSize(f *testing.F) {
	for _, s := range []string{
		"1024", "8MiB", "64 KiB", "2GB", "1B", "0", "-1", "lots", "1.5MiB", "99999999999TiB",
		"4611686018427387904", "4TiB", "  7 KB ", "+5", "0x10", "1e3", "MiB", "9223372036854775807",
	} {
		f.Add(s)
	}
	units := map[string]int64{"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "B": 1}
	f.Fuzz(func(t *testing.T, s string) {
		b, err := ParseByteSize(s)
		// The reference: space, a decimal integer (strconv's optional sign),
		// space, the longest unit the text ends with; the product in
		// [0, MaxInt64].
		num, mult, unitLen := strings.TrimSpace(s), int64(1), 0
		for u, m := range units {
			if strings.HasSuffix(num, u) && len(u) > unitLen {
				mult, unitLen = m, len(u)
			}
		}
		num = strings.TrimSpace(num[:len(num)-unitLen])
		n, ok := new(big.Int).SetString(num, 10)
		valid := ok && decimalRE.MatchString(num) && n.Sign() >= 0
		if valid {
			valid = n.Mul(n, big.NewInt(mult)).Cmp(big.NewInt(1<<63-1)) <= 0
		}
		if valid != (err == nil) {
			t.Fatalf("ParseByteSize(%q) = %d, %v; reference says valid=%v", s, b, err, valid)
		}
		if err != nil {
			if !strings.Contains(err.Error(), strconv.Quote(strings.TrimSpace(s))) {
				t.Fatalf("error %q does not quote the input", err)
			}
			return
		}
		if n.Cmp(big.NewInt(int64(b))) != 0 {
			t.Fatalf("ParseByteSize(%q) = %d, want %s", s, b, n)
		}
		if b2, err := ParseByteSize(b.String()); err != nil || b2 != b {
			t.Fatalf("ParseByteSize(%q) = %d; its String %q reads back as %d, %v", s, b, b.String(), b2, err)
		}
	})
}

// fuzzDoc is a config section with every kind of field the real files use.
type fuzzDoc struct {
	Name     string            `yaml:"name"`
	Count    int               `yaml:"count"`
	Ratio    float64           `yaml:"ratio"`
	Wait     Duration          `yaml:"wait"`
	Size     ByteSize          `yaml:"size"`
	On       bool              `yaml:"on"`
	Items    []fuzzItem        `yaml:"items"`
	Sizes    []ByteSize        `yaml:"sizes"`
	Nested   *fuzzItem         `yaml:"nested"`
	Labels   map[string]string `yaml:"labels"`
	Log      Log               `yaml:"log"`
	Shutdown Shutdown          `yaml:"shutdown"`
}

type fuzzItem struct {
	URL  string   `yaml:"url"`
	Wait Duration `yaml:"wait"`
}

func defaultFuzzDoc() fuzzDoc {
	return fuzzDoc{Name: "n", Count: 3, Ratio: 0.5, Wait: Duration(1e9), Size: 1 << 20, Log: Log{Level: "info"}, Shutdown: Shutdown{Grace: Duration(30e9)}}
}

var (
	decimalRE = regexp.MustCompile(`^[+-]?[0-9]+$`)
	// A problem from Decode names a field path and its line, or a line.
	// The problem itself may quote the value, "line 0" included.
	problemRE = regexp.MustCompile(`(?s)^(?:line ([1-9][0-9]*): .*|[^\n]+: .* \(line ([1-9][0-9]*)\))$`)
)

// FuzzDecode decodes arbitrary YAML over defaults: never a panic; an error
// is either a parse error naming its line or a *DecodeError whose every
// problem names a field path or a line that exists; whatever decodes without
// error encodes and decodes back to the same value; and Decode agrees with
// yaml.v3's own strict decoder (see checkLikeYAML).
func FuzzDecode(f *testing.F) {
	for _, s := range []string{
		"name: x\ncount: 7\nwait: 250ms\nsize: 8MiB\n",
		"items:\n  - url: http://a\n    wait: 1s\n  - {url: b, wait: 2m}\nsizes: [1, 2KiB, 3GB]\n",
		"wait: 5\nsize: lots\nbogus: 1\nitems: [{url: a, wat: 1}]\n",
		"nested: {url: u}\nlabels: {a: b}\nlog: {level: debug}\nshutdown: {grace: 1s}\n",
		"---\nname: a\n---\nname: b\n", "name: [unclosed", "", "~", "# only a comment\n",
		"name: &a x\ncount: *a\n", "size: !!binary aGVsbG8=\n", "ratio: .nan\n", "wait: -5s\n",
		"items:\n- url: a\n  url: b\n", "\tname: x", "name: \"\\xff\"\n",
		"n: &n {url: a, wait: 1s}\np: {<<: [*n, {url: b, next: *n}], wait: 2s}\nms: {x: *n, <<: {y: {url: c}}}\n",
		"i8: 127\nu16: 0x10\nu64: 1e3\nf32: .inf\nb: on\nd: 1h\na: [1, 2]\nx: {k: [1, ~]}\ne: 3\nuntagged: 4\n",
		"mi: {1: a, 0x1: b}\nm: {a: 1, *k : 2}\nopen: {name: o, extra: 5}\nl: [~, {url: d}]\npi: ~\n",
		"m: {~: 1}\nls: !!seq [a]\ns: !!binary aGk=\nwait: !!null 5s\nn: {next: {next: {url: z}}}\n",
		"x-d: &d {url: a, wait: 2s}\nnested: {<<: *d, url: b}\nitems: [*d]\nx-e: [1]\n",
		"nested: {x-a: 1, wiat: 1s}\nitme: 2\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 4096 {
			return // long documents add no paths and slow minimisation
		}
		checkLikeYAML(t, data)
		doc := defaultFuzzDoc()
		err := Decode(data, &doc)
		var de *DecodeError
		switch {
		case errors.As(err, &de):
			lines := YAMLLines(data)
			for _, p := range de.Problems {
				msg := p.Error()
				m := problemRE.FindStringSubmatch(msg)
				if m == nil {
					t.Fatalf("problem %q names neither a field path nor a line", msg)
				}
				if n, _ := strconv.Atoi(m[1] + m[2]); n < 1 || n > lines {
					t.Fatalf("problem %q names line %d of a %d-line document", msg, n, lines)
				}
			}
			return
		case err != nil:
			if !strings.HasPrefix(err.Error(), "parsing config: ") {
				t.Fatalf("error %q is not a parse error", err)
			}
			if !strings.Contains(err.Error(), "line ") && !strings.HasSuffix(err.Error(), "more than one YAML document") &&
				!strings.HasSuffix(err.Error(), "excessive aliasing") {
				t.Fatalf("parse error %q names no line", err)
			}
			return
		}
		out, err := yaml.Marshal(doc)
		if err != nil {
			t.Fatalf("marshal %+v: %v", doc, err)
		}
		back := defaultFuzzDoc()
		if err := Decode(out, &back); err != nil {
			t.Fatalf("re-decoding %q: %v", out, err)
		}
		if !reflect.DeepEqual(normalize(doc), normalize(back)) {
			t.Fatalf("round trip of %q via %q\n got %+v\nwant %+v", data, out, back, doc)
		}
	})
}

// likeDoc has a field of every kind the walk handles, so that checkLikeYAML
// compares Decode with yaml.v3 on each.
type likeDoc struct {
	S         string         `yaml:"s"`
	I         int            `yaml:"i"`
	I8        int8           `yaml:"i8"`
	U16       uint16         `yaml:"u16"`
	U64       uint64         `yaml:"u64"`
	F32       float32        `yaml:"f32"`
	F64       float64        `yaml:"f64"`
	B         bool           `yaml:"b"`
	D         time.Duration  `yaml:"d"`
	Wait      Duration       `yaml:"wait"`
	Size      ByteSize       `yaml:"size"`
	P         *likeItem      `yaml:"p"`
	PI        *int           `yaml:"pi"`
	L         []likeItem     `yaml:"l"`
	LS        []string       `yaml:"ls"`
	A         [2]int         `yaml:"a"`
	M         map[string]int `yaml:"m"`
	MI        map[int]string `yaml:"mi"`
	MS        map[string]likeItem
	N         likeItem `yaml:"n"`
	Open      likeOpen `yaml:"open"`
	X         any      `yaml:"x"`
	Skip      int      `yaml:"-"`
	Untagged  int
	likeEmbed `yaml:",inline"`
}

type likeItem struct {
	URL  string    `yaml:"url"`
	Wait Duration  `yaml:"wait"`
	Next *likeItem `yaml:"next"`
}

type likeOpen struct {
	Name string         `yaml:"name"`
	Rest map[string]int `yaml:",inline"`
}

type likeEmbed struct {
	E int `yaml:"e"`
}

func defaultLikeDoc() likeDoc {
	five := 5
	return likeDoc{S: "d", I: 1, F64: 0.5, Wait: Duration(time.Second), P: &likeItem{URL: "d"}, PI: &five,
		L: []likeItem{{URL: "d"}}, LS: []string{"d"}, A: [2]int{1, 2}, M: map[string]int{"d": 1},
		MS: map[string]likeItem{"d": {URL: "d"}}, Open: likeOpen{Rest: map[string]int{"d": 1}}, Skip: 7, Untagged: 3}
}

// checkLikeYAML decodes data into a likeDoc with Decode and with yaml.v3's
// decoder (KnownFields), each over the defaults: when both succeed the
// results are the same, and when one fails the other does too, except where
// Decode is stricter on purpose (a null key, which yaml.v3 drops; a map key
// repeated in a different spelling, which yaml.v3 lets the last one win) or
// the two alias-expansion bounds count differently.
func checkLikeYAML(t *testing.T, data []byte) {
	ref := defaultLikeDoc()
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	refErr := dec.Decode(&ref)
	if errors.Is(refErr, io.EOF) {
		refErr = nil
	} else if refErr == nil {
		var extra yaml.Node
		if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
			refErr = errors.New("more than one document")
		}
	}
	got := defaultLikeDoc()
	err := Decode(data, &got)
	aliasing := func(err error) bool {
		return err != nil && (strings.Contains(err.Error(), "aliases expand the document too much") ||
			strings.Contains(err.Error(), "excessive aliasing"))
	}
	switch {
	case aliasing(err) || aliasing(refErr):
	case err == nil && refErr == nil:
		if !sameValue(reflect.ValueOf(got), reflect.ValueOf(ref)) {
			g, _ := yaml.Marshal(got)
			w, _ := yaml.Marshal(ref)
			t.Fatalf("Decode(%q) differs from yaml.v3\n--- got\n%s\n--- want\n%s", data, g, w)
		}
	case err == nil:
		var te *yaml.TypeError
		if errors.As(refErr, &te) && onlyExtensionKeys(te) {
			break // Decode ignores them on purpose
		}
		t.Fatalf("Decode(%q) accepts what yaml.v3 refuses: %v", data, refErr)
	case refErr == nil:
		var de *DecodeError
		if !errors.As(err, &de) {
			t.Fatalf("Decode(%q) = %v; yaml.v3 accepts it", data, err)
		}
		for _, p := range de.Problems {
			var fe *FieldError
			if !errors.As(p, &fe) || fe.Msg != "null is not a valid key" && !strings.HasPrefix(fe.Msg, "duplicate key") {
				t.Fatalf("Decode(%q) refuses what yaml.v3 accepts: %v", data, p)
			}
		}
	}
}

// onlyExtensionKeys reports whether yaml.v3 refused nothing but top-level
// "x-" keys, which Decode ignores.
func onlyExtensionKeys(te *yaml.TypeError) bool {
	for _, e := range te.Errors {
		if !extensionRE.MatchString(e) {
			return false
		}
	}
	return true
}

var extensionRE = regexp.MustCompile(`^line [0-9]+: field x-.* not found in type configfile\.likeDoc$`)

// sameValue is reflect.DeepEqual with NaN equal to itself.
func sameValue(a, b reflect.Value) bool {
	if a.IsValid() != b.IsValid() {
		return false
	}
	if !a.IsValid() {
		return true
	}
	if a.Type() != b.Type() {
		return false
	}
	switch a.Kind() {
	case reflect.Float32, reflect.Float64:
		x, y := a.Float(), b.Float()
		return x == y || x != x && y != y
	case reflect.Pointer, reflect.Interface:
		if a.IsNil() || b.IsNil() {
			return a.IsNil() == b.IsNil()
		}
		return sameValue(a.Elem(), b.Elem())
	case reflect.Struct:
		for i := range a.NumField() {
			if !sameValue(a.Field(i), b.Field(i)) {
				return false
			}
		}
		return true
	case reflect.Slice, reflect.Array:
		if a.Kind() == reflect.Slice && a.IsNil() != b.IsNil() || a.Len() != b.Len() {
			return false
		}
		for i := range a.Len() {
			if !sameValue(a.Index(i), b.Index(i)) {
				return false
			}
		}
		return true
	case reflect.Map:
		if a.IsNil() != b.IsNil() || a.Len() != b.Len() {
			return false
		}
		for it := a.MapRange(); it.Next(); {
			if !sameValue(it.Value(), b.MapIndex(it.Key())) {
				return false
			}
		}
		return true
	}
	return reflect.DeepEqual(a.Interface(), b.Interface())
}

// normalize returns v with every empty slice and map set to nil, and NaN
// floats set to a sentinel, so DeepEqual compares meaning: YAML writes nil
// and empty alike.
func normalize[T any](v T) T {
	rv := reflect.ValueOf(&v).Elem()
	normalizeValue(rv)
	return v
}

func normalizeValue(v reflect.Value) {
	switch v.Kind() {
	case reflect.Pointer:
		if !v.IsNil() {
			normalizeValue(v.Elem())
		}
	case reflect.Struct:
		for i := range v.NumField() {
			if v.Field(i).CanSet() {
				normalizeValue(v.Field(i))
			}
		}
	case reflect.Slice:
		if v.Len() == 0 {
			v.SetZero()
			return
		}
		for i := range v.Len() {
			normalizeValue(v.Index(i))
		}
	case reflect.Map:
		if v.Len() == 0 {
			v.SetZero()
		}
	case reflect.Float32, reflect.Float64:
		if f := v.Float(); f != f {
			v.SetFloat(-1.2345e-300)
		}
	}
}
