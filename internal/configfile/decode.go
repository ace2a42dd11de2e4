package configfile

import (
	"bytes"
	"encoding"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf16"

	"go.yaml.in/yaml/v3"
)

// decoder walks a document's node tree alongside the Go value it decodes
// into, so that every problem is found at a known field path and node. It
// follows yaml.v3's rules (keys matched by yaml tag, pointers allocated,
// maps added to, lists replaced, aliases and merge keys resolved alike),
// and leaves three things to yaml.v3 itself: a scalar, a value whose type
// has its own UnmarshalYAML, and an interface value, each decoded with
// yaml.Node.Decode on its own node. So a scalar is accepted in exactly the
// forms yaml.v3 accepts, and when one is refused the message is built here
// from the node and the Go type, not taken from yaml's text.
type decoder struct {
	data     []byte
	lines    lineMap // made for the first problem
	problems []error
	// aliases holds the aliases being expanded, to refuse one whose
	// anchor's value contains it.
	aliases map[*yaml.Node]bool
	// Expansion bound: nodes decoded, and how many of them were reached
	// through an alias (see step).
	count, aliasCount, aliasDepth int
}

func newDecoder(data []byte) *decoder {
	return &decoder{data: data, aliases: map[*yaml.Node]bool{}}
}

// abort carries the error that ends the walk early, by panicking out of
// however deep it is.
type abort struct{ err error }

// run decodes the document n into v.
func (d *decoder) run(n *yaml.Node, v reflect.Value) (err error) {
	defer func() {
		if r := recover(); r != nil {
			a, ok := r.(abort)
			if !ok {
				panic(r)
			}
			err = a.err
		}
	}()
	d.decode(n, v, "")
	return nil
}

var (
	nodeType           = reflect.TypeFor[yaml.Node]()
	durationType       = reflect.TypeFor[time.Duration]()
	unmarshalerType    = reflect.TypeFor[yaml.Unmarshaler]()
	obsoleteType       = reflect.TypeFor[interface{ UnmarshalYAML(func(any) error) error }]()
	textUnmarshalerTyp = reflect.TypeFor[encoding.TextUnmarshaler]()
)

const (
	nullTag   = "!!null"
	mergeTag  = "!!merge"
	mergeName = "<<"
)

// maxProblems bounds the problems reported: past it a file is not a config
// with mistakes but something else, often an alias multiplying one.
const maxProblems = 1000

// addf records a problem at path, found at node n.
func (d *decoder) addf(n *yaml.Node, path, format string, args ...any) {
	d.add(&FieldError{Path: path, Line: n.Line, Column: n.Column, Msg: fmt.Sprintf(format, args...)})
}

func (d *decoder) add(p *FieldError) {
	if d.lines == nil {
		d.lines = newLineMap(d.data)
	}
	p.Line, p.Column = d.lines.at(p.Line, p.Column)
	if len(d.problems) == maxProblems {
		d.problems = append(d.problems, &FieldError{Line: p.Line, Column: p.Column,
			Msg: "more than " + strconv.Itoa(maxProblems) + " problems; decoding stopped here"})
		panic(abort{&DecodeError{Problems: d.problems}})
	}
	d.problems = append(d.problems, p)
}

// lineMap turns yaml.v3's positions into the file's lines as an editor
// shows them, and as YAML 1.2 and lineOf count them: broken at \n, \r\n and
// a lone \r. libyaml also breaks lines at NEL, LS and PS (YAML 1.1). Entry
// i is where yaml's line i+1 starts: on which line, after how many
// characters of it.
type lineMap []struct{ line, col int }

func newLineMap(data []byte) lineMap {
	var text []rune
	switch {
	case bytes.HasPrefix(data, []byte{0xff, 0xfe}), bytes.HasPrefix(data, []byte{0xfe, 0xff}):
		// UTF-16, told by its byte order mark, as libyaml tells it.
		order := binary.ByteOrder(binary.LittleEndian)
		if data[0] == 0xfe {
			order = binary.BigEndian
		}
		units := make([]uint16, len(data)/2)
		for i := range units {
			units[i] = order.Uint16(data[2*i:])
		}
		text = utf16.Decode(units)
	case bytes.Contains(data, []byte("\u0085")) || bytes.Contains(data, []byte("\u2028")) || bytes.Contains(data, []byte("\u2029")):
		text = []rune(string(data))
	default:
		return lineMap{{1, 0}} // the two agree
	}
	m := lineMap{{1, 0}}
	line, col := 1, 0
	for i := 0; i < len(text); i++ {
		switch r := text[i]; r {
		case '\r', '\n':
			if r == '\r' && i+1 < len(text) && text[i+1] == '\n' {
				i++
			}
			line, col = line+1, 0
		case '\u0085', '\u2028', '\u2029':
			col++
		default:
			col++
			continue
		}
		m = append(m, struct{ line, col int }{line, col})
	}
	return m
}

// at translates yaml's line and column.
func (m lineMap) at(line, col int) (int, int) {
	if len(m) == 1 || line < 1 || line > len(m) {
		return line, col
	}
	return m[line-1].line, m[line-1].col + col
}

// step counts one node decoded and stops a document that alias expansion
// blows up ("billion laughs"), with yaml.v3's own rule: past the first
// thousand nodes, at most a fraction of them (99% for small documents, down
// to 10% for huge ones) may be reached through aliases.
func (d *decoder) step(n *yaml.Node) {
	d.count++
	if d.aliasDepth > 0 {
		d.aliasCount++
	}
	if d.aliasCount > 100 && d.count > 1000 && float64(d.aliasCount)/float64(d.count) > allowedAliasRatio(d.count) {
		panic(abort{fmt.Errorf("parsing config: line %d: aliases expand the document too much", n.Line)})
	}
}

// allowedAliasRatio is yaml.v3's: 99% up to 400,000 nodes, falling linearly
// to 10% at 4,000,000.
func allowedAliasRatio(count int) float64 {
	const low, high = 400_000, 4_000_000
	switch {
	case count <= low:
		return 0.99
	case count >= high:
		return 0.10
	}
	return 0.99 - 0.89*float64(count-low)/float64(high-low)
}

// decode decodes n into v (addressable), whose field path is path. It
// reports whether v got a value: as in yaml.v3, a list element or map entry
// that did not is left out.
func (d *decoder) decode(n *yaml.Node, v reflect.Value, path string) bool {
	d.step(n)
	if v.Type() == nodeType {
		v.Set(reflect.ValueOf(n).Elem())
		return true
	}
	switch n.Kind {
	case yaml.DocumentNode:
		if len(n.Content) == 1 {
			d.decode(n.Content[0], v, path)
		}
		return true
	case yaml.AliasNode:
		return d.alias(n, path, func(target *yaml.Node) bool { return d.decode(target, v, path) })
	}
	// A null leaves pointers unallocated and unmarshalers uncalled, as in
	// yaml.v3: "key: ~" resets a pointer, list or map and keeps anything
	// else as it was.
	null := n.ShortTag() == nullTag
	if !null {
		for v.Kind() == reflect.Pointer {
			if v.IsNil() {
				v.Set(reflect.New(v.Type().Elem()))
			}
			v = v.Elem()
		}
		if v.Type() == nodeType {
			v.Set(reflect.ValueOf(n).Elem())
			return true
		}
		if isUnmarshaler(v.Addr().Type()) {
			return d.unmarshaler(n, v, path)
		}
		if v.Kind() == reflect.Interface {
			return d.delegate(n, v, path)
		}
	}
	switch n.Kind {
	case yaml.ScalarNode:
		if null {
			if n.Tag != "" && !d.nullValue(n, path) {
				return false
			}
			return setNull(v)
		}
		return d.delegate(n, v, path)
	case yaml.MappingNode:
		return d.mapping(n, v, path, nil)
	case yaml.SequenceNode:
		return d.sequence(n, v, path)
	}
	panic(abort{fmt.Errorf("parsing config: line %d: a YAML node of unknown kind %d", n.Line, n.Kind)})
}

func isUnmarshaler(t reflect.Type) bool {
	return t.Implements(unmarshalerType) || t.Implements(obsoleteType)
}

// nullValue reports whether a scalar tagged !!null explicitly has a null's
// spelling, as yaml.v3 asks ("!!null 0" is refused, not read as null).
func (d *decoder) nullValue(n *yaml.Node, path string) bool {
	var probe any
	if err := n.Decode(&probe); err != nil {
		d.addf(n, path, "%s", errText(err))
		return false
	}
	return true
}

// setNull is yaml.v3's null: the zero value for what can be nil.
func setNull(v reflect.Value) bool {
	switch v.Kind() {
	case reflect.Interface, reflect.Pointer, reflect.Map, reflect.Slice:
		v.SetZero()
		return true
	}
	return false
}

// alias expands the alias n with f, refusing an alias met again inside its
// own expansion (its anchor's value contains it).
func (d *decoder) alias(n *yaml.Node, path string, f func(target *yaml.Node) bool) bool {
	if d.aliases[n] {
		d.addf(n, path, "alias *%s is inside its own anchor's value", n.Value)
		return false
	}
	d.aliases[n] = true
	d.aliasDepth++
	ok := f(n.Alias)
	d.aliasDepth--
	delete(d.aliases, n)
	return ok
}

// weigh counts the nodes below n (aliases expanded) towards the expansion
// bound before n is handed to yaml.v3, whose own bound starts afresh with
// each call and so would not stop a list of many aliases of a large value.
func (d *decoder) weigh(n *yaml.Node) {
	switch n.Kind {
	case yaml.AliasNode:
		if d.aliases[n] {
			return // yaml.v3 refuses it
		}
		d.aliases[n] = true
		d.aliasDepth++
		d.step(n.Alias)
		d.weigh(n.Alias)
		d.aliasDepth--
		delete(d.aliases, n)
	case yaml.MappingNode, yaml.SequenceNode:
		for _, c := range n.Content {
			d.step(c)
			d.weigh(c)
		}
	}
}

// unmarshaler decodes n into v, whose type has its own UnmarshalYAML. A
// *FieldError (ValueError) it returns is placed at path; any other error
// becomes one at path and n's line.
func (d *decoder) unmarshaler(n *yaml.Node, v reflect.Value, path string) bool {
	d.weigh(n)
	err := n.Decode(v.Addr().Interface())
	if err == nil {
		return true
	}
	var fe *FieldError
	if errors.As(err, &fe) {
		p := *fe
		p.Path = path
		if p.Line == 0 { // a node the unmarshaler made up
			p.Line, p.Column = n.Line, n.Column
		}
		d.add(&p)
		return false
	}
	d.addf(n, path, "%s", errText(err))
	return false
}

// delegate decodes n, a scalar or anything into an interface, with yaml.v3.
func (d *decoder) delegate(n *yaml.Node, v reflect.Value, path string) bool {
	d.weigh(n)
	err := n.Decode(v.Addr().Interface())
	switch {
	case err == nil:
		return true
	case v.Kind() == reflect.Interface: // any form fits: the reason is all there is
		d.addf(n, path, "%s", errText(err))
	default:
		d.addf(n, path, "cannot decode %s as %s%s", describeNode(n), describeType(v.Type()), detail(err))
	}
	return false
}

// detail adds the reason to a refusal yaml.v3 explains by more than its
// type mismatch (a TextUnmarshaler's error, bad base64, a bad tag).
func detail(err error) string {
	var te *yaml.TypeError
	if errors.As(err, &te) {
		return "" // the node and the type say it all
	}
	return ": " + errText(err)
}

// errText is an error's message without yaml's "yaml: " prefix, and a
// *yaml.TypeError's list joined by "; ".
func errText(err error) string {
	var te *yaml.TypeError
	if errors.As(err, &te) {
		return strings.Join(te.Errors, "; ")
	}
	return strings.TrimPrefix(err.Error(), "yaml: ")
}

// describeNode names a node in a problem: a scalar by its value.
func describeNode(n *yaml.Node) string {
	switch n.Kind {
	case yaml.ScalarNode:
		return strconv.Quote(n.Value)
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.AliasNode:
		if n.Alias != nil {
			return describeNode(n.Alias)
		}
	}
	return "a YAML node"
}

// describeType names the form a Go type takes in YAML.
func describeType(t reflect.Type) string {
	switch {
	case t == durationType:
		return "a duration (e.g. 250ms, 5s, 4m)"
	case reflect.PointerTo(t).Implements(textUnmarshalerTyp):
		return "a " + t.String()
	}
	switch t.Kind() {
	case reflect.Int, reflect.Int64:
		return "an integer"
	case reflect.Int8, reflect.Int16, reflect.Int32:
		bits := t.Bits()
		return fmt.Sprintf("an integer from %d to %d", -1<<(bits-1), 1<<(bits-1)-1)
	case reflect.Uint, reflect.Uint64, reflect.Uintptr:
		return "an integer >= 0"
	case reflect.Uint8, reflect.Uint16, reflect.Uint32:
		return fmt.Sprintf("an integer from 0 to %d", uint64(math.MaxUint64)>>(64-t.Bits()))
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Bool:
		return "a boolean (true or false)"
	case reflect.String:
		return "a string"
	case reflect.Slice:
		return "a list"
	case reflect.Array:
		return fmt.Sprintf("a list of %d", t.Len())
	case reflect.Map, reflect.Struct:
		return "a mapping"
	case reflect.Pointer:
		return describeType(t.Elem())
	}
	return "a " + t.String()
}

// isMerge is yaml.v3's test for a merge key: a plain or !!merge-tagged "<<".
func isMerge(k *yaml.Node) bool {
	return k.Kind == yaml.ScalarNode && k.Value == mergeName && (k.Tag == "" || k.Tag == "!" || k.ShortTag() == mergeTag)
}

// keyPath is path extended by a mapping key: ".key", or ["key"] quoted
// when the key is not plain, so that a path never holds a line break and
// never reads as something else.
func keyPath(path, key string) string {
	if !plainKey(key) {
		return path + "[" + strconv.Quote(key) + "]"
	}
	if path == "" {
		return key
	}
	return path + "." + key
}

func plainKey(key string) bool {
	if key == mergeName {
		return true
	}
	for _, r := range key {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '-') {
			return false
		}
	}
	return key != ""
}

func indexPath(path string, i int) string { return path + "[" + strconv.Itoa(i) + "]" }

// mergeValue returns the value of n's merge key, or nil; a repeated merge
// key is a problem, as any repeated key.
func (d *decoder) mergeValue(n *yaml.Node, path string) *yaml.Node {
	var first, value *yaml.Node
	for i := 0; i+1 < len(n.Content); i += 2 {
		if k := n.Content[i]; isMerge(k) {
			if first != nil {
				d.addf(k, keyPath(path, mergeName), "duplicate key, first at line %d", first.Line)
				continue
			}
			first, value = k, n.Content[i+1]
		}
	}
	return value
}

// mapping decodes the mapping n into v. seen is nil, or, while n is merged
// into a mapping (a merge key's value), the keys already set there: those
// are skipped, so that explicit keys override merged ones and an earlier
// merge overrides a later one.
func (d *decoder) mapping(n *yaml.Node, v reflect.Value, path string, seen map[any]bool) bool {
	switch v.Kind() {
	case reflect.Struct:
		d.mappingStruct(n, v, path, seen)
		return true
	case reflect.Map:
		d.mappingMap(n, v, path, seen)
		return true
	}
	d.addf(n, path, "cannot decode %s as %s", describeNode(n), describeType(v.Type()))
	return false
}

func (d *decoder) mappingStruct(n *yaml.Node, v reflect.Value, path string, seen map[any]bool) {
	info := structInfoOf(v.Type())
	for _, index := range info.inlineUnmarshalers {
		d.unmarshaler(n, d.field(v, index), path)
	}
	merge := d.mergeValue(n, path)
	if merge != nil && seen == nil {
		seen = map[any]bool{}
	}
	first := map[string]*yaml.Node{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val := n.Content[i], n.Content[i+1]
		d.step(k)
		if isMerge(k) {
			continue
		}
		name, ok := d.keyName(k, path)
		if !ok {
			continue
		}
		kp := keyPath(path, name)
		if f := first[name]; f != nil {
			d.addf(k, kp, "duplicate key, first at line %d", f.Line)
			continue
		}
		first[name] = k
		if seen != nil {
			if seen[name] {
				continue
			}
			seen[name] = true
		}
		if index, ok := info.fields[name]; ok {
			d.decode(val, d.field(v, index), kp)
		} else if info.inlineMap != nil {
			m := d.field(v, info.inlineMap)
			if m.IsNil() {
				m.Set(reflect.MakeMap(m.Type()))
			}
			e := reflect.New(m.Type().Elem()).Elem()
			d.decode(val, e, kp)
			m.SetMapIndex(reflect.ValueOf(name).Convert(m.Type().Key()), e)
		} else {
			d.addf(k, kp, "unknown key")
		}
	}
	if merge != nil {
		d.merge(merge, v, path, seen)
	}
}

// keyName is a struct key's name. A key that is not a non-null scalar is a
// problem (yaml.v3 drops a null key silently; strict decoding does not).
func (d *decoder) keyName(k *yaml.Node, path string) (string, bool) {
	r := k
	if r.Kind == yaml.AliasNode {
		r = r.Alias
	}
	if r.Kind != yaml.ScalarNode {
		d.addf(k, path, "a key must be a scalar, got %s", describeNode(r))
		return "", false
	}
	if r.ShortTag() == nullTag {
		d.addf(k, keyPath(path, r.Value), "null is not a valid key")
		return "", false
	}
	var name string
	if err := r.Decode(&name); err != nil {
		d.addf(k, path, "cannot decode key %s as a string%s", describeNode(r), detail(err))
		return "", false
	}
	return name, true
}

func (d *decoder) mappingMap(n *yaml.Node, v reflect.Value, path string, seen map[any]bool) {
	merge := d.mergeValue(n, path)
	if merge != nil && seen == nil {
		seen = map[any]bool{}
	}
	isNew := v.IsNil()
	if isNew {
		v.Set(reflect.MakeMap(v.Type()))
	}
	kt, et := v.Type().Key(), v.Type().Elem()
	first := map[any]*yaml.Node{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val := n.Content[i], n.Content[i+1]
		d.step(k)
		if isMerge(k) {
			continue
		}
		kv, ok := d.mapKey(k, kt, path)
		if !ok {
			continue
		}
		key := kv.Interface()
		kp := keyPath(path, fmt.Sprint(key))
		if f := first[key]; f != nil {
			d.addf(k, kp, "duplicate key, first at line %d", f.Line)
			continue
		}
		first[key] = k
		if seen != nil {
			if seen[key] {
				continue
			}
			seen[key] = true
		}
		e := reflect.New(et).Elem()
		if d.decode(val, e, kp) || val.ShortTag() == nullTag && (isNew || !v.MapIndex(kv).IsValid()) {
			v.SetMapIndex(kv, e)
		}
	}
	if merge != nil {
		d.merge(merge, v, path, seen)
	}
}

// mapKey decodes a map key of type kt: a non-null scalar.
func (d *decoder) mapKey(k *yaml.Node, kt reflect.Type, path string) (reflect.Value, bool) {
	r := k
	if r.Kind == yaml.AliasNode {
		r = r.Alias
	}
	if r.Kind != yaml.ScalarNode {
		d.addf(k, path, "a key must be a scalar, got %s", describeNode(r))
		return reflect.Value{}, false
	}
	if r.ShortTag() == nullTag {
		d.addf(k, keyPath(path, r.Value), "null is not a valid key")
		return reflect.Value{}, false
	}
	kv := reflect.New(kt)
	if err := r.Decode(kv.Interface()); err != nil {
		d.addf(k, path, "cannot decode key %s as %s%s", describeNode(r), describeType(kt), detail(err))
		return reflect.Value{}, false
	}
	if !kv.Elem().Comparable() {
		d.addf(k, path, "cannot use %s as a key", describeNode(r))
		return reflect.Value{}, false
	}
	return kv.Elem(), true
}

// merge merges the value m of a merge key into v: a mapping, an alias of
// one, or a list of those, in yaml.v3's order.
func (d *decoder) merge(m *yaml.Node, v reflect.Value, path string, seen map[any]bool) {
	one := func(n *yaml.Node) {
		d.step(n)
		if n.Kind == yaml.AliasNode {
			if n.Alias.Kind != yaml.MappingNode {
				d.addf(n, keyPath(path, mergeName), "can merge only a mapping or a list of mappings, got %s", describeNode(n))
				return
			}
			d.alias(n, keyPath(path, mergeName), func(target *yaml.Node) bool {
				d.step(target)
				return d.mapping(target, v, path, seen)
			})
			return
		}
		if n.Kind != yaml.MappingNode {
			d.addf(n, keyPath(path, mergeName), "can merge only a mapping or a list of mappings, got %s", describeNode(n))
			return
		}
		d.mapping(n, v, path, seen)
	}
	if m.Kind == yaml.SequenceNode {
		for _, n := range m.Content {
			one(n)
		}
		return
	}
	one(m)
}

// sequence decodes the list n into v. A slice is replaced, as in yaml.v3.
func (d *decoder) sequence(n *yaml.Node, v reflect.Value, path string) bool {
	switch v.Kind() {
	case reflect.Slice:
		s := reflect.MakeSlice(v.Type(), len(n.Content), len(n.Content))
		j := 0
		for i, c := range n.Content {
			e := reflect.New(v.Type().Elem()).Elem()
			if d.decode(c, e, indexPath(path, i)) {
				s.Index(j).Set(e)
				j++
			}
		}
		v.Set(s.Slice(0, j))
		return true
	case reflect.Array:
		if len(n.Content) != v.Len() {
			d.addf(n, path, "want a list of %d, got %d", v.Len(), len(n.Content))
			return false
		}
		for i, c := range n.Content {
			e := reflect.New(v.Type().Elem()).Elem()
			if d.decode(c, e, indexPath(path, i)) {
				v.Index(i).Set(e)
			}
		}
		return true
	}
	d.addf(n, path, "cannot decode %s as %s", describeNode(n), describeType(v.Type()))
	return false
}

// field returns v's field at index (through inlined structs), allocating
// nil pointers to inlined structs on the way, as yaml.v3 does.
func (d *decoder) field(v reflect.Value, index []int) reflect.Value {
	for _, i := range index {
		for v.Kind() == reflect.Pointer {
			if v.IsNil() {
				if !v.CanSet() {
					panic(abort{fmt.Errorf("configfile: cannot allocate the unexported embedded %s", v.Type())})
				}
				v.Set(reflect.New(v.Type().Elem()))
			}
			v = v.Elem()
		}
		v = v.Field(i)
	}
	if !v.CanSet() {
		panic(abort{fmt.Errorf("configfile: cannot set the unexported field of type %s", v.Type())})
	}
	return v
}

// structInfo is how a struct type's YAML keys map to its fields, by
// yaml.v3's rules: the yaml tag's name, else the lowercased field name; "-"
// skips a field; ",inline" lifts an embedded or named struct's keys (or,
// on a map[string]T, collects every other key).
type structInfo struct {
	fields             map[string][]int
	inlineMap          []int
	inlineUnmarshalers [][]int
}

var structInfos sync.Map // reflect.Type → *structInfo

func structInfoOf(t reflect.Type) *structInfo {
	if si, ok := structInfos.Load(t); ok {
		return si.(*structInfo)
	}
	si, err := newStructInfo(t)
	if err != nil {
		panic(abort{fmt.Errorf("configfile: %w", err)})
	}
	structInfos.Store(t, si)
	return si
}

func newStructInfo(t reflect.Type) (*structInfo, error) {
	si := &structInfo{fields: map[string][]int{}}
	add := func(name string, index []int) error {
		if _, dup := si.fields[name]; dup {
			return fmt.Errorf("duplicated key %q in struct %s", name, t)
		}
		si.fields[name] = index
		return nil
	}
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() && !f.Anonymous {
			continue
		}
		tag := f.Tag.Get("yaml")
		if tag == "" && !strings.Contains(string(f.Tag), ":") {
			tag = string(f.Tag) // yaml.v3 reads a bare tag as the yaml tag
		}
		if tag == "-" {
			continue
		}
		name, flags, _ := strings.Cut(tag, ",")
		inline := false
		if flags != "" {
			for flag := range strings.SplitSeq(flags, ",") {
				switch flag {
				case "omitempty", "flow":
				case "inline":
					inline = true
				default:
					return nil, fmt.Errorf("unsupported flag %q in tag %q of type %s", flag, tag, t)
				}
			}
		}
		if !inline {
			if name == "" {
				name = strings.ToLower(f.Name)
			}
			if err := add(name, []int{i}); err != nil {
				return nil, err
			}
			continue
		}
		ft := f.Type
		switch {
		case ft.Kind() == reflect.Map:
			if si.inlineMap != nil {
				return nil, fmt.Errorf("multiple ,inline maps in struct %s", t)
			}
			if ft.Key().Kind() != reflect.String {
				return nil, fmt.Errorf("option ,inline needs a map with string keys in struct %s", t)
			}
			si.inlineMap = []int{i}
			continue
		case ft.Kind() == reflect.Pointer || ft.Kind() == reflect.Struct:
			for ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct {
				break
			}
			fallthrough
		default:
			return nil, fmt.Errorf("option ,inline may only be used on a struct or map field (%s.%s)", t, f.Name)
		}
		if isUnmarshaler(reflect.PointerTo(ft)) {
			si.inlineUnmarshalers = append(si.inlineUnmarshalers, []int{i})
			continue
		}
		inner, err := newStructInfo(ft)
		if err != nil {
			return nil, err
		}
		for name, index := range inner.fields {
			if err := add(name, append([]int{i}, index...)); err != nil {
				return nil, err
			}
		}
		for _, index := range inner.inlineUnmarshalers {
			si.inlineUnmarshalers = append(si.inlineUnmarshalers, append([]int{i}, index...))
		}
	}
	return si, nil
}
