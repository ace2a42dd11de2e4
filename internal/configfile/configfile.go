// Package configfile provides the pieces every encgate YAML file shares:
// strict decoding (an unknown key is an error that names it), human units for
// durations ("250ms") and byte sizes ("8MiB"), and field-path validation
// errors ("encoders[1].url: ...") collected with errors.Join.
package configfile

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
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

// Decode decodes YAML data strictly into dst. An empty document leaves dst
// unchanged; more than one document is an error. Problems with single keys
// (an unknown key, a value of the wrong form) do not stop decoding: they
// come back as a *DecodeError naming each key's field path, and dst holds
// everything else, so the caller can validate it too and report all
// problems at once. Any other error means nothing usable was decoded.
func Decode(data []byte, dst any) error {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(dst); err != nil {
		if errors.Is(err, io.EOF) {
			return nil
		}
		var te *yaml.TypeError
		if !errors.As(err, &te) {
			return fmt.Errorf("parsing config: %s%w", lineOf(data, err), err)
		}
		return newDecodeError(data, te.Errors)
	}
	var extra any
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		return errors.New("parsing config: more than one YAML document")
	}
	return nil
}

// lineOf returns "line N: " for a YAML syntax error that names no line:
// yaml.v3 leaves it out for a character YAML does not allow (reported at the
// first one) and for a problem on the first line.
func lineOf(data []byte, err error) string {
	if strings.Contains(err.Error(), "line ") {
		return ""
	}
	at := 0
	for i, r := range string(data) {
		ok := r == '\t' || r == '\n' || r == '\r' || r >= 0x20 && r <= 0x7e || r == 0x85 ||
			r >= 0xa0 && r <= 0xd7ff || r >= 0xe000 && r <= 0xfffd || r >= 0x10000
		if !ok || r == utf8.RuneError && !strings.HasPrefix(string(data[i:]), "\ufffd") {
			at = i
			break
		}
	}
	pre := data[:at] // YAML breaks lines at \n, \r\n and a lone \r
	breaks := bytes.Count(pre, []byte("\n")) + bytes.Count(pre, []byte("\r")) - bytes.Count(pre, []byte("\r\n"))
	return "line " + strconv.Itoa(1+breaks) + ": "
}

// DecodeError lists the keys that could not be decoded, each as
// "field.path: problem".
type DecodeError struct{ Problems []error }

func (e *DecodeError) Error() string { return errors.Join(e.Problems...).Error() }

// Unwrap returns the problems, so errors.Join and friends see each one.
func (e *DecodeError) Unwrap() []error { return e.Problems }

var (
	lineRE    = regexp.MustCompile(`(?s)^line (\d+)(?:, column (\d+))?: (.*)$`) // a message may quote a multi-line value
	unknownRE = regexp.MustCompile(`(?s)^field (\S+) not found in type .*$`)
)

func newDecodeError(data []byte, msgs []string) *DecodeError {
	var root yaml.Node
	_ = yaml.Unmarshal(data, &root)
	de := &DecodeError{}
	for _, m := range msgs {
		line, col, msg := 0, 0, m
		if g := lineRE.FindStringSubmatch(m); g != nil {
			line, _ = strconv.Atoi(g[1])
			col, _ = strconv.Atoi(g[2])
			msg = g[3]
		}
		key := ""
		if g := unknownRE.FindStringSubmatch(msg); g != nil {
			key, msg = g[1], "unknown key"
		}
		path := pathAt(&root, position{line, col}, key)
		if path == "" {
			path = "line " + strconv.Itoa(line)
		} else {
			msg += " (line " + strconv.Itoa(line) + ")"
		}
		de.Problems = append(de.Problems, fmt.Errorf("%s: %s", path, msg))
	}
	return de
}

// position is where a problem is: a line, and the column of the value when
// known (ValueError gives it; yaml's own unknown-key errors do not).
type position struct{ line, col int }

func (p position) at(n *yaml.Node) bool { return p.col > 0 && n.Line == p.line && n.Column == p.col }

// pathAt returns the field path of the problem at pos in the document under
// n, or "": the value at exactly pos when its column is known, else the
// deepest mapping key on that line (named key, when given).
func pathAt(n *yaml.Node, pos position, key string) string {
	line := pos.line
	var walk func(n *yaml.Node, path string) string
	walk = func(n *yaml.Node, path string) string {
		switch n.Kind {
		case yaml.DocumentNode:
			for _, c := range n.Content {
				if p := walk(c, path); p != "" {
					return p
				}
			}
		case yaml.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				k, v := n.Content[i], n.Content[i+1]
				child := k.Value
				if path != "" {
					child = path + "." + k.Value
				}
				if pos.at(v) {
					return child
				}
				if p := walk(v, child); p != "" {
					return p
				}
				if pos.col == 0 && k.Line == line && (key == "" || k.Value == key) {
					return child
				}
			}
		case yaml.SequenceNode:
			for i, c := range n.Content {
				child := path + "[" + strconv.Itoa(i) + "]"
				if pos.at(c) {
					return child
				}
				if p := walk(c, child); p != "" {
					return p
				}
			}
		}
		return ""
	}
	return walk(n, "")
}

// ValueError reports a value that cannot be decoded, in the form that lets
// decoding go on and collect every problem (see Decode).
func ValueError(n *yaml.Node, format string, args ...any) error {
	return &yaml.TypeError{Errors: []string{fmt.Sprintf("line %d, column %d: ", n.Line, n.Column) + fmt.Sprintf(format, args...)}}
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
