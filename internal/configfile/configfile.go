// Package configfile provides the pieces every encgate YAML file shares:
// strict decoding on top of yaml.v3 (an unknown key is an error that names
// it and the known key it is probably a misspelling of; top-level "x-" keys
// are free for anchors), human units for durations ("250ms") and byte sizes
// ("8MiB"), and field-path validation errors ("encoders[1].url: ...")
// collected with errors.Join.
package configfile

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"reflect"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"go.uber.org/zap/zapcore"
	"go.yaml.in/yaml/v3"
)

// Load reads path and decodes it strictly into dst, which should already hold
// the defaults: keys absent from the file keep them.
func Load(path string, dst any) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("reading config: %w", err)
	}
	return Decode(data, dst)
}

// Decode decodes YAML data strictly into dst, a non-nil pointer. An empty
// document leaves dst unchanged; more than one document is an error.
// Problems with single keys (an unknown or repeated key, a value of the
// wrong form) do not stop decoding: they come back as a *DecodeError whose
// every problem is a *FieldError naming its field path and line, and dst
// holds everything else, so the caller can validate it too and report all
// problems at once. Any other error means nothing usable was decoded.
//
// yaml.v3 decodes: anchors, aliases and merge keys (<<) work as there. The
// node tree is first walked alongside dst's type (see checker), so that a
// problem's path is where it was found, never inferred from an error
// message, and what yaml.v3 would refuse is left out of what it decodes.
// Top-level keys starting "x-" (YAML extension fields, a place for anchors
// to merge elsewhere) are ignored.
func Decode(data []byte, dst any) error {
	rv := reflect.ValueOf(dst)
	if rv.Kind() != reflect.Pointer || rv.IsNil() {
		return fmt.Errorf("configfile: Decode needs a non-nil pointer, got %T", dst)
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil
		}
		return fmt.Errorf("parsing config: %s%w", lineOf(data, err), err)
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		return errors.New("parsing config: more than one YAML document")
	}
	if len(doc.Content) != 1 {
		return nil
	}
	c, err := walk(doc.Content[0], rv.Elem().Type())
	if err != nil {
		return err
	}
	tree := &doc
	if len(c.drop) > 0 {
		tree = c.pruned(tree, map[*yaml.Node]*yaml.Node{})
	}
	if err := tree.Decode(dst); err != nil {
		// The walk found whatever yaml.v3 refuses; what is left is
		// aliases that expand too much for yaml.v3's own bound.
		var te *yaml.TypeError
		if !errors.As(err, &te) {
			return fmt.Errorf("parsing config: %s", errText(err))
		}
		for _, e := range te.Errors {
			c.problems = append(c.problems, errors.New(e))
		}
	}
	if len(c.problems) > 0 {
		return &DecodeError{Problems: c.problems}
	}
	return nil
}

// lineOf returns "line N: " for a YAML syntax error that names no line, else
// "". A syntax error is a plain error from yaml.v3's parser, whose position
// is not exposed in any other way, so this is the one place that reads
// yaml's text, and only to see whether the message already names a line.
// yaml.v3 leaves it out for a character YAML does not allow (found here: the
// first such character), for a problem on the first line and for an unknown
// anchor (line 1 here, unless a character YAML does not allow comes first).
// Lines are counted as yaml.v3 counts them: broken at \n, \r\n, a lone \r
// and (YAML 1.1) NEL, LS and PS.
func lineOf(data []byte, err error) string {
	if strings.Contains(err.Error(), "line ") {
		return ""
	}
	line, prev := 1, rune(0)
	for i, r := range string(data) {
		ok := r == '\t' || r == '\n' || r == '\r' || r >= 0x20 && r <= 0x7e || r == 0x85 ||
			r >= 0xa0 && r <= 0xd7ff || r >= 0xe000 && r <= 0xfffd || r >= 0x10000
		if !ok || r == utf8.RuneError && !strings.HasPrefix(string(data[i:]), "\ufffd") {
			return "line " + strconv.Itoa(line) + ": "
		}
		if r == '\r' || r == '\n' && prev != '\r' || r == 0x85 || r == 0x2028 || r == 0x2029 {
			line++
		}
		prev = r
	}
	return "line 1: "
}

// DecodeError lists the keys that could not be decoded, each a *FieldError
// ("field.path: problem (line N)").
type DecodeError struct{ Problems []error }

func (e *DecodeError) Error() string { return errors.Join(e.Problems...).Error() }

// Unwrap returns the problems, so errors.Join and friends see each one.
func (e *DecodeError) Unwrap() []error { return e.Problems }

// FieldError is one value or key that could not be decoded.
type FieldError struct {
	// Path is the field path ("retry.metadata.retry_on[2]"), "" for the
	// document itself. Decode sets it; ValueError leaves it empty.
	Path string
	// Line and Column are where the offending YAML starts (1-based), as
	// yaml.v3 counts them.
	Line, Column int
	// Msg says what is wrong.
	Msg string
}

// Error is "path: msg (line N)", or "line N: msg" without a path.
func (e *FieldError) Error() string {
	if e.Path == "" {
		return "line " + strconv.Itoa(e.Line) + ": " + e.Msg
	}
	return e.Path + ": " + e.Msg + " (line " + strconv.Itoa(e.Line) + ")"
}

// ValueError reports that n cannot be decoded; an UnmarshalYAML returns it.
// Decode then reports it as a problem at the field's path with n's line and
// goes on decoding the rest (see Decode).
func ValueError(n *yaml.Node, format string, args ...any) error {
	return &FieldError{Line: n.Line, Column: n.Column, Msg: fmt.Sprintf(format, args...)}
}

// Duration is a time.Duration written in YAML as a Go duration string
// ("250ms", "5s", "4m").
type Duration time.Duration

// D returns d as a time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

// String formats d like time.Duration.
func (d Duration) String() string { return time.Duration(d).String() }

// UnmarshalYAML accepts a Go duration string.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return ValueError(n, "want a duration such as 250ms or 5s")
	}
	v, err := time.ParseDuration(n.Value)
	if err != nil {
		return ValueError(n, "%q is not a duration (want e.g. 250ms, 5s, 4m)", n.Value)
	}
	*d = Duration(v)
	return nil
}

// MarshalYAML writes d as a duration string.
func (d Duration) MarshalYAML() (any, error) { return d.String(), nil }

// ByteSize is a size in bytes, written in YAML as a plain integer or with a
// unit: B, KB/MB/GB (powers of 1000) or KiB/MiB/GiB (powers of 1024).
type ByteSize int64

var byteUnits = []struct {
	suffix string
	mult   int64
}{
	{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
	{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
	{"B", 1},
}

// ParseByteSize parses "8MiB", "64KB", "1024" and the like.
func ParseByteSize(s string) (ByteSize, error) {
	s = strings.TrimSpace(s)
	mult := int64(1)
	num := s
	for _, u := range byteUnits {
		if strings.HasSuffix(s, u.suffix) {
			mult, num = u.mult, strings.TrimSpace(strings.TrimSuffix(s, u.suffix))
			break
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || n < 0 || n > (1<<63-1)/mult { // every value String writes reads back
		return 0, fmt.Errorf("%q is not a byte size (want e.g. 8MiB, 64KiB, 1048576)", s)
	}
	return ByteSize(n * mult), nil
}

// UnmarshalYAML accepts an integer or a number with a unit.
func (b *ByteSize) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return ValueError(n, "want a byte size such as 8MiB")
	}
	v, err := ParseByteSize(n.Value)
	if err != nil {
		return ValueError(n, "%v", err)
	}
	*b = v
	return nil
}

// String formats b with the largest binary unit that divides it exactly.
func (b ByteSize) String() string {
	for _, u := range []struct {
		s string
		m int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if b != 0 && int64(b)%u.m == 0 {
			return strconv.FormatInt(int64(b)/u.m, 10) + u.s
		}
	}
	return strconv.FormatInt(int64(b), 10)
}

// MarshalYAML writes b with a unit.
func (b ByteSize) MarshalYAML() (any, error) { return b.String(), nil }

// Problems collects validation problems, each prefixed with its field path.
// The zero value is ready to use.
type Problems struct {
	errs []error
}

// Addf records a problem at path.
func (p *Problems) Addf(path, format string, args ...any) {
	p.errs = append(p.errs, fmt.Errorf("%s: %s", path, fmt.Sprintf(format, args...)))
}

// Positive records a problem when d is not > 0.
func (p *Problems) Positive(path string, d Duration) {
	if d <= 0 {
		p.Addf(path, "must be > 0, got %s", d)
	}
}

// Err returns all problems joined, or nil.
func (p *Problems) Err() error { return errors.Join(p.errs...) }

// Log is the `log:` section every role has.
type Log struct {
	// Level is debug, info, warn or error (default info).
	Level string `yaml:"level"`
}

// Validate checks the section; path is its field path.
func (l Log) Validate(p *Problems, path string) {
	if _, err := zapcore.ParseLevel(l.Level); err != nil || l.Level == "" {
		p.Addf(path+".level", "must be debug, info, warn or error, got %q", l.Level)
	}
}

// Shutdown is the `shutdown:` section every role has.
type Shutdown struct {
	// Grace is how long in-flight requests may finish after SIGTERM (default 30s).
	Grace Duration `yaml:"grace"`
}

// Validate checks the section; path is its field path.
func (s Shutdown) Validate(p *Problems, path string) { p.Positive(path+".grace", s.Grace) }

// Moved is a key that has moved elsewhere in the file: any value decodes
// into it, and the section's Validate names where the key went (Set), so
// an old config gets that answer rather than "unknown key". It is never
// written out (omitempty, IsZero).
type Moved struct{ set bool }

// UnmarshalYAML implements yaml.Unmarshaler: any value marks it set.
func (m *Moved) UnmarshalYAML(*yaml.Node) error { m.set = true; return nil }

// IsZero reports whether the key was absent.
func (m Moved) IsZero() bool { return !m.set }

// Set reports whether the file had the key.
func (m Moved) Set() bool { return m.set }

// MarshalYAML writes nothing: a moved key is not part of any config.
func (m Moved) MarshalYAML() (any, error) { return nil, nil }
