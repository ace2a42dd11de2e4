package configfile

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.yaml.in/yaml/v3"
)

// checker walks a document's node tree alongside the Go type it decodes
// into, for what yaml.v3 does not do itself: it names every problem's field
// path, refuses unknown keys (suggesting a near one) and repeated ones, and
// goes on after a problem. It sets no value: each scalar, and each value
// whose type has its own UnmarshalYAML, is tried with yaml.v3 on a scratch
// value of its type, and whatever is refused is marked to drop, so that
// yaml.v3 then decodes the rest of the document into dst without error.
type checker struct {
	problems []error
	// drop holds the key of each pair, and each list element, to leave
	// out of the document yaml.v3 decodes.
	drop map[*yaml.Node]bool
	// aliases holds the aliases being expanded, to refuse one whose
	// anchor's value contains it (yaml.v3 stops decoding at it).
	aliases map[*yaml.Node]bool
	// Expansion bound: nodes walked, and how many of them were reached
	// through an alias (see step).
	count, aliasCount, aliasDepth int
}

// abort carries the error that ends the walk early, by panicking out of
// however deep it is.
type abort struct{ err error }

var (
	nodeType        = reflect.TypeFor[yaml.Node]()
	durationType    = reflect.TypeFor[time.Duration]()
	unmarshalerType = reflect.TypeFor[yaml.Unmarshaler]()
	obsoleteType    = reflect.TypeFor[interface{ UnmarshalYAML(func(any) error) error }]()
	textType        = reflect.TypeFor[interface{ UnmarshalText([]byte) error }]()
)

const (
	nullTag   = "!!null"
	mergeName = "<<"
)

// maxProblems bounds the problems reported: past it a file is not a config
// with mistakes but something else, often an alias multiplying one, and the
// walk stops, leaving dst as it was.
const maxProblems = 1000

// walk checks the document's value n against dst's type t and returns the
// problems, or the error that stopped the walk.
func walk(n *yaml.Node, t reflect.Type) (c *checker, err error) {
	c = &checker{drop: map[*yaml.Node]bool{}, aliases: map[*yaml.Node]bool{}}
	defer func() {
		if r := recover(); r != nil {
			a, ok := r.(abort)
			if !ok {
				panic(r)
			}
			err = a.err
		}
	}()
	if !c.check(n, t, "") {
		c.drop[n] = true // dst stays as it was
	}
	return c, nil
}

// addf records a problem at path, found at node n.
func (c *checker) addf(n *yaml.Node, path, format string, args ...any) {
	c.add(&FieldError{Path: path, Line: n.Line, Column: n.Column, Msg: fmt.Sprintf(format, args...)})
}

func (c *checker) add(p *FieldError) {
	if len(c.problems) == maxProblems {
		c.problems = append(c.problems, &FieldError{Line: p.Line, Column: p.Column,
			Msg: "more than " + strconv.Itoa(maxProblems) + " problems; decoding stopped here"})
		panic(abort{&DecodeError{Problems: c.problems}})
	}
	c.problems = append(c.problems, p)
}

// step counts one node walked and stops a document that alias expansion
// blows up ("billion laughs"), with yaml.v3's own rule: past the first
// thousand nodes, at most a fraction of them (99% for small documents, down
// to 10% for huge ones) may be reached through aliases.
func (c *checker) step(n *yaml.Node) {
	c.count++
	if c.aliasDepth > 0 {
		c.aliasCount++
	}
	ratio := 0.99 - 0.89*min(1, max(0, float64(c.count-400_000)/3_600_000))
	if c.aliasCount > 100 && c.count > 1000 && float64(c.aliasCount)/float64(c.count) > ratio {
		panic(abort{fmt.Errorf("parsing config: line %d: aliases expand the document too much", n.Line)})
	}
}

// alias walks the alias n's value with f, refusing an alias met again
// inside its own expansion.
func (c *checker) alias(n *yaml.Node, path string, f func(*yaml.Node) bool) bool {
	if c.aliases[n] {
		c.addf(n, path, "alias *%s is inside its own anchor's value", n.Value)
		return false
	}
	c.aliases[n] = true
	c.aliasDepth++
	defer func() { c.aliasDepth--; delete(c.aliases, n) }()
	return f(n.Alias)
}

// check checks that n decodes into a t at path, and reports whether it
// does; one that does not is dropped by its caller.
func (c *checker) check(n *yaml.Node, t reflect.Type, path string) bool {
	c.step(n)
	if t == nodeType {
		return true
	}
	if n.Kind == yaml.AliasNode {
		return c.alias(n, path, func(v *yaml.Node) bool { return c.check(v, t, path) })
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if n.ShortTag() != nullTag && !isUnmarshaler(t) {
		switch {
		case n.Kind == yaml.MappingNode && (t.Kind() == reflect.Struct || t.Kind() == reflect.Map):
			c.mapping(n, t, path, nil)
			return true
		case n.Kind == yaml.SequenceNode && t.Kind() == reflect.Slice:
			for i, e := range n.Content {
				if !c.check(e, t.Elem(), indexPath(path, i)) {
					c.drop[e] = true
				}
			}
			return true
		case n.Kind == yaml.SequenceNode && t.Kind() == reflect.Array:
			if len(n.Content) != t.Len() {
				c.addf(n, path, "want a list of %d, got %d", t.Len(), len(n.Content))
				return false
			}
			ok := true
			for i, e := range n.Content {
				ok = c.check(e, t.Elem(), indexPath(path, i)) && ok
			}
			return ok
		}
	}
	return c.leaf(n, t, path)
}

func isUnmarshaler(t reflect.Type) bool {
	pt := reflect.PointerTo(t)
	return pt.Implements(unmarshalerType) || pt.Implements(obsoleteType)
}

// leaf tries n with yaml.v3 on a scratch t. An UnmarshalYAML's *FieldError
// (ValueError) is placed at path; any other refusal becomes one at n.
func (c *checker) leaf(n *yaml.Node, t reflect.Type, path string) bool {
	err := n.Decode(reflect.New(t).Interface())
	var fe *FieldError
	switch {
	case err == nil:
		return true
	case errors.As(err, &fe):
		p := *fe
		p.Path = path
		if p.Line == 0 { // a node the unmarshaler made up
			p.Line, p.Column = n.Line, n.Column
		}
		c.add(&p)
	case isUnmarshaler(t) || t.Kind() == reflect.Interface: // the reason is all there is
		c.addf(n, path, "%s", errText(err))
	default:
		c.addf(n, path, "cannot decode %s as %s%s", describeNode(n), describeType(t), detail(err))
	}
	return false
}

// mapping checks the mapping n against t, a struct or a map, dropping the
// pairs that yaml.v3 would refuse or must not see. seen is nil, or, while n
// is merged into a mapping (a merge key's value), the keys already set
// there, as yaml.v3 keeps them: those are skipped, so that explicit keys
// override merged ones and an earlier merge overrides a later one.
func (c *checker) mapping(n *yaml.Node, t reflect.Type, path string, seen map[any]bool) {
	var fields *structFields
	if t.Kind() == reflect.Struct {
		fields = fieldsOf(t)
		for _, u := range fields.inlineUnmarshalers {
			c.leaf(n, u, path)
		}
	}
	var mergeKey, mergeValue *yaml.Node
	first := map[any]*yaml.Node{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if isMerge(k) {
			if mergeKey != nil {
				c.addf(k, keyPath(path, mergeName), "duplicate key, first at line %d", mergeKey.Line)
				c.drop[k] = true
			} else {
				mergeKey, mergeValue = k, v
			}
			continue
		}
		key, name, ok := c.key(k, t, path)
		if !ok {
			c.drop[k] = true
			continue
		}
		kp := keyPath(path, name)
		if f := first[key]; f != nil {
			c.addf(k, kp, "duplicate key, first at line %d", f.Line)
			c.drop[k] = true
			continue
		}
		first[key] = k
		if seen[key] {
			continue
		}
		var vt reflect.Type
		if fields == nil {
			vt = t.Elem()
		} else {
			var known bool
			if vt, known = fields.byName[name]; !known {
				vt = fields.inlineMap
			}
			if vt == nil {
				if path != "" || !strings.HasPrefix(name, "x-") { // an extension field is ignored
					c.addf(k, kp, "unknown key%s", suggest(name, fields.names))
				}
				c.drop[k] = true
				continue
			}
		}
		if !c.check(v, vt, kp) {
			c.drop[k] = true
			continue
		}
		if seen != nil {
			seen[key] = true
		}
	}
	if mergeKey == nil {
		return
	}
	if seen == nil { // yaml.v3 keeps the explicit keys as decoded into any
		seen = map[any]bool{}
		for i := 0; i+1 < len(n.Content); i += 2 {
			var key any
			if k := n.Content[i]; !c.drop[k] && k.Decode(&key) == nil && reflect.TypeOf(key).Comparable() {
				seen[key] = true
			}
		}
	}
	c.merge(mergeKey, mergeValue, t, path, seen)
}

// key decodes the key k of a mapping decoded into t: its identity among the
// mapping's keys, and its name in paths. A key that is not a non-null
// scalar is a problem (yaml.v3 drops a null key silently; strict decoding
// does not).
func (c *checker) key(k *yaml.Node, t reflect.Type, path string) (key any, name string, ok bool) {
	r := k
	if r.Kind == yaml.AliasNode {
		r = r.Alias
	}
	if r.Kind != yaml.ScalarNode {
		c.addf(k, path, "a key must be a scalar, got %s", describeNode(r))
		return nil, "", false
	}
	if r.ShortTag() == nullTag {
		c.addf(k, keyPath(path, r.Value), "null is not a valid key")
		return nil, "", false
	}
	kt := reflect.TypeFor[string]()
	if t.Kind() == reflect.Map {
		kt = t.Key()
	}
	kv := reflect.New(kt)
	if err := r.Decode(kv.Interface()); err != nil {
		c.addf(k, path, "cannot decode key %s as %s%s", describeNode(r), describeType(kt), detail(err))
		return nil, "", false
	}
	if !kv.Elem().Comparable() {
		c.addf(k, path, "cannot use %s as a key", describeNode(r))
		return nil, "", false
	}
	return kv.Elem().Interface(), fmt.Sprint(kv.Elem().Interface()), true
}

// merge checks the value m of the merge key k: a mapping, an alias of one,
// or a list of those, merged in order into the mapping at path.
func (c *checker) merge(k, m *yaml.Node, t reflect.Type, path string, seen map[any]bool) {
	one := func(n *yaml.Node) bool {
		c.step(n)
		r := n
		if n.Kind == yaml.AliasNode {
			r = n.Alias
		}
		if r.Kind != yaml.MappingNode {
			c.addf(n, keyPath(path, mergeName), "can merge only a mapping or a list of mappings, got %s", describeNode(r))
			return false
		}
		if n.Kind == yaml.AliasNode {
			return c.alias(n, keyPath(path, mergeName), func(r *yaml.Node) bool { c.mapping(r, t, path, seen); return true })
		}
		c.mapping(r, t, path, seen)
		return true
	}
	if m.Kind != yaml.SequenceNode {
		if !one(m) {
			c.drop[k] = true
		}
		return
	}
	for _, n := range m.Content {
		if !one(n) {
			c.drop[n] = true
		}
	}
}

// pruned returns a copy of the tree n without the dropped pairs and list
// elements; aliases in it point into the copy.
func (c *checker) pruned(n *yaml.Node, done map[*yaml.Node]*yaml.Node) *yaml.Node {
	if p, ok := done[n]; ok {
		return p
	}
	p := *n
	done[n] = &p
	width := 1
	if n.Kind == yaml.MappingNode {
		width = 2
	}
	p.Content = nil
	for i := 0; i < len(n.Content); i += width {
		if c.drop[n.Content[i]] {
			continue
		}
		for _, e := range n.Content[i:min(i+width, len(n.Content))] {
			p.Content = append(p.Content, c.pruned(e, done))
		}
	}
	if n.Alias != nil {
		p.Alias = c.pruned(n.Alias, done)
	}
	return &p
}

// suggest returns `, did you mean "name"?` for the known name nearest to
// an unknown one, when one is near: within two edits (fewer for a short
// name), or one a prefix of the other (of at least three letters).
func suggest(unknown string, names []string) string {
	best, bestDist := "", 0
	for _, name := range names {
		d := editDistance(unknown, name)
		near := d <= 2 && d*3 <= max(len(unknown), len(name))
		prefix := min(len(unknown), len(name)) >= 3 && (strings.HasPrefix(name, unknown) || strings.HasPrefix(unknown, name))
		if (near || prefix) && (best == "" || d < bestDist || d == bestDist && name < best) {
			best, bestDist = name, d
		}
	}
	if best == "" {
		return ""
	}
	return fmt.Sprintf(", did you mean %q?", best)
}

// editDistance is the optimal string alignment distance between a and b:
// insertions, deletions, substitutions and swaps of adjacent bytes.
func editDistance(a, b string) int {
	prev2, prev, cur := make([]int, len(b)+1), make([]int, len(b)+1), make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				cur[j] = min(cur[j], prev2[j-2]+1)
			}
		}
		prev2, prev, cur = prev, cur, prev2
	}
	return prev[len(b)]
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
	case reflect.PointerTo(t).Implements(textType):
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
	}
	return "a " + t.String()
}

// isMerge is yaml.v3's test for a merge key: a plain or !!merge-tagged "<<".
func isMerge(k *yaml.Node) bool {
	return k.Kind == yaml.ScalarNode && k.Value == mergeName && (k.Tag == "" || k.Tag == "!" || k.ShortTag() == "!!merge")
}

// keyPath is path extended by a mapping key: ".key", or ["key"] quoted
// when the key is not plain, so that a path never holds a line break and
// never reads as something else.
func keyPath(path, key string) string {
	plain := key != ""
	for _, r := range key {
		plain = plain && (r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '-')
	}
	switch {
	case !plain && key != mergeName:
		return path + "[" + strconv.Quote(key) + "]"
	case path == "":
		return key
	}
	return path + "." + key
}

func indexPath(path string, i int) string { return path + "[" + strconv.Itoa(i) + "]" }

// structFields is how a struct type's YAML keys map to field types, by
// yaml.v3's rules: the yaml tag's name, else the lowercased field name; "-"
// skips a field; ",inline" lifts an embedded or named struct's keys (or,
// on a map[string]T, collects every other key).
type structFields struct {
	byName             map[string]reflect.Type
	names              []string
	inlineMap          reflect.Type // the inline map's element type, or nil
	inlineUnmarshalers []reflect.Type
}

var structFieldsCache sync.Map // reflect.Type → *structFields

func fieldsOf(t reflect.Type) *structFields {
	if sf, ok := structFieldsCache.Load(t); ok {
		return sf.(*structFields)
	}
	sf, err := newStructFields(t)
	if err != nil {
		panic(abort{fmt.Errorf("configfile: %w", err)})
	}
	structFieldsCache.Store(t, sf)
	return sf
}

func newStructFields(t reflect.Type) (*structFields, error) {
	sf := &structFields{byName: map[string]reflect.Type{}}
	add := func(name string, ft reflect.Type) error {
		if _, dup := sf.byName[name]; dup {
			return fmt.Errorf("duplicated key %q in struct %s", name, t)
		}
		sf.byName[name] = ft
		sf.names = append(sf.names, name)
		return nil
	}
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("yaml")
		if tag == "" && !strings.Contains(string(f.Tag), ":") {
			tag = string(f.Tag) // yaml.v3 reads a bare tag as the yaml tag
		}
		if !f.IsExported() && !f.Anonymous || tag == "-" {
			continue
		}
		name, flags, _ := strings.Cut(tag, ",")
		inline := false
		for flag := range strings.SplitSeq(flags, ",") {
			switch flag {
			case "", "omitempty", "flow":
			case "inline":
				inline = true
			default:
				return nil, fmt.Errorf("unsupported flag %q in tag %q of type %s", flag, tag, t)
			}
		}
		ft := f.Type
		for inline && ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		switch {
		case !inline:
			if name == "" {
				name = strings.ToLower(f.Name)
			}
			if err := add(name, f.Type); err != nil {
				return nil, err
			}
		case ft.Kind() == reflect.Map && f.Type.Kind() == reflect.Map:
			if sf.inlineMap != nil || ft.Key().Kind() != reflect.String {
				return nil, fmt.Errorf("one ,inline map with string keys at most in struct %s", t)
			}
			sf.inlineMap = ft.Elem()
		case ft.Kind() != reflect.Struct:
			return nil, fmt.Errorf("option ,inline may only be used on a struct or map field (%s.%s)", t, f.Name)
		case isUnmarshaler(ft):
			sf.inlineUnmarshalers = append(sf.inlineUnmarshalers, ft)
		default:
			inner, err := newStructFields(ft)
			if err != nil {
				return nil, err
			}
			for _, name := range inner.names {
				if err := add(name, inner.byName[name]); err != nil {
					return nil, err
				}
			}
			sf.inlineUnmarshalers = append(sf.inlineUnmarshalers, inner.inlineUnmarshalers...)
		}
	}
	return sf, nil
}
