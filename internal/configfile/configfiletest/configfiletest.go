// Package configfiletest holds the checks the config loaders' fuzz targets
// share (gateway and gpuagent): what a load error must say, and a
// normaliser for comparing a config with its YAML round trip.
package configfiletest

import (
	"errors"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/encgate/encgate/internal/configfile"
)

// validationRE is a Validate problem: a field path of the config's own keys,
// then the message.
var validationRE = regexp.MustCompile(`^[a-z_]+(\[[0-9]+\])?(\.[a-z_]+(\[[0-9]+\])?)*: `)

// problemLineRE finds the line a decode problem names.
var problemLineRE = regexp.MustCompile(`(?s)^line ([0-9]+): |^.+ \(line ([0-9]+)\)$`)

// CheckLoadError checks a LoadConfig error: nil, a parse error, or the
// decode problems (each naming a path and line, or a line) joined with
// validate's problems (each naming a field path).
func CheckLoadError(t *testing.T, data []byte, err error, validate func() error) {
	t.Helper()
	if err == nil {
		return
	}
	verr := validate()
	want := verr
	var de *configfile.DecodeError
	switch {
	case errors.As(err, &de):
		lines := configfile.YAMLLines(data)
		for _, p := range de.Problems {
			msg := p.Error()
			// "line N: problem", or "field.path: problem (line N)"; the
			// problem itself may quote the value, "line 0" included.
			m := problemLineRE.FindStringSubmatch(msg)
			if m == nil {
				t.Fatalf("decode problem %q names no line", msg)
			}
			if n, _ := strconv.Atoi(m[1] + m[2]); n < 1 || n > lines {
				t.Fatalf("decode problem %q names line %d of a %d-line file", msg, n, lines)
			}
		}
		want = errors.Join(de, verr)
	case strings.HasPrefix(err.Error(), "parsing config: "):
		// Nothing usable was decoded: a YAML syntax error, which names its
		// line, more than one document, or aliases that expand too much.
		if !strings.Contains(err.Error(), "line ") && !strings.HasSuffix(err.Error(), "more than one YAML document") &&
			!strings.HasSuffix(err.Error(), "excessive aliasing") {
			t.Fatalf("parse error %q names no line", err)
		}
		return
	}
	if want == nil || err.Error() != want.Error() {
		t.Fatalf("error\n%v\nis not the decode problems and Validate's\n%v", err, want)
	}
	if verr == nil {
		return
	}
	var joined interface{ Unwrap() []error }
	if !errors.As(verr, &joined) {
		t.Fatalf("Validate's error %T is not a list", verr)
	}
	for _, p := range joined.Unwrap() {
		if !validationRE.MatchString(p.Error()) {
			t.Fatalf("problem %q does not start with a field path", p)
		}
	}
}

// Normalize returns v with every empty slice and map set to nil and NaN
// floats set to a sentinel, so DeepEqual compares meaning: YAML writes nil
// and empty alike.
func Normalize[T any](v T) T {
	normalizeValue(reflect.ValueOf(&v).Elem())
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
