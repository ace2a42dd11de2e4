package main

import (
	"encoding"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/encgate/encgate/gateway"
	"github.com/encgate/encgate/gpuagent"
	"github.com/encgate/encgate/internal/configfile"
)

// role is one YAML file the reference documents.
type role struct {
	title   string // the heading
	intro   string // a paragraph under it
	config  any    // DefaultConfig(): the defaults and, by reflection, the keys
	section string // the reference's anchor prefix
}

func roles() []role {
	return []role{
		{
			title:   "Gateway",
			intro:   "The file `encgate gateway --config FILE` reads (gateway.Config; the defaults are gateway.DefaultConfig). `encgate gateway --config FILE --check` validates it and prints every problem.",
			config:  gateway.DefaultConfig(),
			section: "gateway",
		},
		{
			title:   "Agent",
			intro:   "The file `encgate agent --config FILE` reads (gpuagent.Config; the defaults are gpuagent.DefaultConfig). `encgate agent --config FILE --check` validates it and prints every problem.",
			config:  gpuagent.DefaultConfig(),
			section: "agent",
		},
	}
}

// key is one documented YAML key: a value, or a section (a mapping or a
// list of mappings) holding keys.
type key struct {
	path    string            // e.g. encoders[].url, retry.metadata.retry_on
	typ     string            // as written in YAML: string, duration, list of string, ...
	def     string            // the default, as YAML; "" when the key has none of its own
	reload  string            // live or restart (the gateway's reload tags), "" where untagged
	doc     string            // the field's doc comment
	section bool              // holds keys of its own
	where   string            // the Go field, e.g. gateway.LimitsConfig.PollShare (gateway/config.go)
	goName  string            // the Go field's name
	names   map[string]string // Go field name → key, of the struct that holds it
}

// valueType is a YAML value type with rules of its own (a Go type with its
// own UnmarshalYAML), explained once below the keys.
type valueType struct {
	name string // as the keys' type column says it
	doc  string
	goty string // the Go type
}

// walker lists a config's keys with configfile's own rules (decode.go's
// structInfo, yaml.v3's): the yaml tag's name, else the lowercased field
// name; "-" and unexported fields are skipped; ",inline" lifts the keys of
// an embedded struct; a type with its own UnmarshalYAML is one value.
type walker struct {
	docs     *docIndex
	keys     []key
	problems []error
	types    map[reflect.Type]*valueType
}

var (
	unmarshalerType = reflect.TypeFor[yaml.Unmarshaler]()
	obsoleteType    = reflect.TypeFor[interface{ UnmarshalYAML(func(any) error) error }]()
	textType        = reflect.TypeFor[encoding.TextUnmarshaler]()
	nodeType        = reflect.TypeFor[yaml.Node]()
	// movedType marks a key that has moved elsewhere: any value is
	// refused with where it went, so it is no key of the config.
	movedType    = reflect.TypeFor[configfile.Moved]()
	durationType = reflect.TypeFor[configfile.Duration]()
	byteSizeType = reflect.TypeFor[configfile.ByteSize]()
)

func isUnmarshaler(t reflect.Type) bool {
	p := reflect.PointerTo(t)
	return p.Implements(unmarshalerType) || p.Implements(obsoleteType) || p.Implements(textType)
}

// walkConfig lists the keys of cfg, a DefaultConfig.
func (w *walker) walkConfig(cfg any) {
	v := reflect.ValueOf(cfg)
	w.structKeys(v.Type(), v, "", "")
}

// structKeys lists the keys of struct type t whose value (the defaults) is
// v, invalid inside a list entry or an absent section.
func (w *walker) structKeys(t reflect.Type, v reflect.Value, path, reload string) {
	td, err := w.docs.typ(t.PkgPath(), t.Name())
	if err != nil {
		w.problems = append(w.problems, err)
		return
	}
	// Go field names of t's keys, for the docs that name them.
	names := map[string]string{}
	for i := range t.NumField() {
		f := t.Field(i)
		if name, inline, skip := yamlKey(f); !skip && !inline {
			names[f.Name] = name
		}
	}
	for i := range t.NumField() {
		f := t.Field(i)
		name, inline, skip := yamlKey(f)
		if skip || f.Type == movedType {
			continue
		}
		fv := reflect.Value{}
		if v.IsValid() {
			fv = v.Field(i)
		}
		r := reload
		if tag := f.Tag.Get("reload"); tag != "" {
			r = tag
		}
		if inline {
			ft := f.Type
			if ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
				if fv.IsValid() {
					if fv.IsNil() {
						fv = reflect.Value{}
					} else {
						fv = fv.Elem()
					}
				}
			}
			if ft.Kind() != reflect.Struct {
				w.problems = append(w.problems, fmt.Errorf("%s: an inline %s is not documented by refgen", joinPath(path, name), ft))
				continue
			}
			w.structKeys(ft, fv, path, r)
			continue
		}
		k := key{path: joinPath(path, name), reload: r, names: names, goName: f.Name}
		k.where = fmt.Sprintf("%s.%s.%s", pkgName(t.PkgPath()), t.Name(), f.Name)
		file := "?"
		if td != nil {
			file = td.file
			k.doc = td.fields[f.Name]
		} else if t.Name() == "" {
			file = "an unnamed struct type"
		}
		k.where += " (" + file + ")"
		if strings.TrimSpace(k.doc) == "" {
			w.problems = append(w.problems, fmt.Errorf("config key %s: field %s has no doc comment: write one (it is this key's entry in %s)", k.path, k.where, configFile))
		}
		w.value(k, f.Type, fv)
	}
}

// value adds key k, of Go type t with default v, and the keys below it.
func (w *walker) value(k key, t reflect.Type, v reflect.Value) {
	if v.IsValid() {
		k.def = renderYAML(v)
		// A value type's own text ("512" for a size of 512 bytes) needs no
		// quotes: its UnmarshalYAML reads the plain scalar.
		if u := elemStruct(t); isUnmarshaler(u) && u.Kind() != reflect.String {
			var n yaml.Node
			if err := n.Encode(v.Interface()); err == nil && n.Kind == yaml.ScalarNode {
				k.def = n.Value
			}
		}
	}
	// A pointer to a section: absent by default (null) or present.
	if t.Kind() == reflect.Pointer && !isUnmarshaler(t.Elem()) && t.Elem().Kind() == reflect.Struct {
		k.typ, k.section = "mapping", true
		w.keys = append(w.keys, k)
		inner := reflect.Value{}
		if v.IsValid() && !v.IsNil() {
			inner = v.Elem()
		}
		w.structKeys(t.Elem(), inner, k.path, k.reload)
		return
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
		if v.IsValid() {
			if v.IsNil() {
				v = reflect.Value{}
			} else {
				v = v.Elem()
			}
		}
	}
	switch {
	case w.leaf(t):
		k.typ = w.typeName(t)
		w.keys = append(w.keys, k)
	case t.Kind() == reflect.Struct:
		k.typ, k.section, k.def = "mapping", true, ""
		w.keys = append(w.keys, k)
		w.structKeys(t, v, k.path, k.reload)
	case t.Kind() == reflect.Slice || t.Kind() == reflect.Array:
		k.typ, k.section = "list of mappings", true
		w.keys = append(w.keys, k)
		// A list's entries have no defaults of their own in DefaultConfig.
		w.structKeys(elemStruct(t.Elem()), reflect.Value{}, k.path+"[]", k.reload)
	case t.Kind() == reflect.Map:
		k.typ, k.section = "mapping of names to mappings", true
		w.keys = append(w.keys, k)
		w.structKeys(elemStruct(t.Elem()), reflect.Value{}, k.path+".<name>", k.reload)
	default:
		w.problems = append(w.problems, fmt.Errorf("config key %s: refgen cannot document a %s", k.path, t))
	}
}

// elemStruct is t with its pointers taken off (a struct, as w.leaf said).
func elemStruct(t reflect.Type) reflect.Type {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t
}

// leaf reports whether a value of type t is one YAML value (a scalar, a
// type with its own unmarshaling, or a list or map of such), not a section.
func (w *walker) leaf(t reflect.Type) bool {
	t = elemStruct(t)
	if t == nodeType || isUnmarshaler(t) {
		return true
	}
	switch t.Kind() {
	case reflect.Struct:
		return false
	case reflect.Slice, reflect.Array, reflect.Map:
		return w.leaf(t.Elem())
	}
	return true
}

// typeName names t as the reference's type column does, and records the
// value types with rules of their own.
func (w *walker) typeName(t reflect.Type) string {
	t = elemStruct(t)
	switch {
	case t == durationType || t == reflect.TypeFor[time.Duration]():
		w.valueType(t, "duration")
		return "duration"
	case t == byteSizeType:
		w.valueType(t, "size")
		return "size"
	case t == nodeType:
		return "any"
	case isUnmarshaler(t):
		name := strings.ToLower(t.Name())
		w.valueType(t, name)
		return name
	}
	switch t.Kind() {
	case reflect.String:
		return "string"
	case reflect.Bool:
		return "boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "integer"
	case reflect.Float32, reflect.Float64:
		return "number"
	case reflect.Slice, reflect.Array:
		return "list of " + w.typeName(t.Elem())
	case reflect.Map:
		return "mapping of " + w.typeName(t.Key()) + " to " + w.typeName(t.Elem())
	}
	return "any"
}

// valueType records t, explained in the reference by its doc comment.
func (w *walker) valueType(t reflect.Type, name string) {
	if _, ok := w.types[t]; ok {
		return
	}
	vt := &valueType{name: name, goty: pkgName(t.PkgPath()) + "." + t.Name()}
	w.types[t] = vt
	if t.PkgPath() == "time" {
		vt.doc = "A Go duration string such as 250ms, 5s or 4m."
		return
	}
	td, err := w.docs.typ(t.PkgPath(), t.Name())
	switch {
	case err != nil:
		w.problems = append(w.problems, err)
	case td == nil || strings.TrimSpace(td.doc) == "":
		w.problems = append(w.problems, fmt.Errorf("value type %s has no doc comment: write one (it explains the type %s in %s)", vt.goty, name, configFile))
	default:
		vt.doc = td.doc
	}
}

// yamlKey is f's key by configfile's rules; inline says its keys are
// lifted into the struct's own, skip that it has none.
func yamlKey(f reflect.StructField) (name string, inline, skip bool) {
	if !f.IsExported() && !f.Anonymous {
		return "", false, true
	}
	tag := f.Tag.Get("yaml")
	if tag == "" && !strings.Contains(string(f.Tag), ":") {
		tag = string(f.Tag) // yaml.v3 reads a bare tag as the yaml tag
	}
	if tag == "-" {
		return "", false, true
	}
	name, flags, _ := strings.Cut(tag, ",")
	for flag := range strings.SplitSeq(flags, ",") {
		if flag == "inline" {
			inline = true
		}
	}
	if name == "" {
		name = strings.ToLower(f.Name)
	}
	return name, inline, false
}

func joinPath(path, name string) string {
	if path == "" {
		return name
	}
	return path + "." + name
}

// pkgName is the last element of an import path.
func pkgName(p string) string {
	if i := strings.LastIndex(p, "/"); i >= 0 {
		return p[i+1:]
	}
	return p
}

// renderYAML writes v as YAML shows it, on one line: scalars as they are,
// lists and mappings in flow style.
func renderYAML(v reflect.Value) string {
	var n yaml.Node
	if err := n.Encode(v.Interface()); err != nil {
		return "(" + err.Error() + ")"
	}
	flow(&n)
	out, err := yaml.Marshal(&n)
	if err != nil {
		return "(" + err.Error() + ")"
	}
	return strings.TrimSpace(string(out))
}

func flow(n *yaml.Node) {
	if n.Kind == yaml.SequenceNode || n.Kind == yaml.MappingNode {
		n.Style |= yaml.FlowStyle
	}
	for _, c := range n.Content {
		flow(c)
	}
}

// configKeys lists every key of each role, and every problem: above all,
// the fields without a doc comment.
func configKeys(docs *docIndex) ([][]key, []*valueType, error) {
	w := &walker{docs: docs, types: map[reflect.Type]*valueType{}}
	var all [][]key
	for _, r := range roles() {
		w.keys = nil
		w.walkConfig(r.config)
		all = append(all, w.keys)
	}
	var types []*valueType
	for _, vt := range w.types {
		types = append(types, vt)
	}
	return all, types, errors.Join(w.problems...)
}
