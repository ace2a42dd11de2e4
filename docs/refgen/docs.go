package main

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
)

// docIndex reads the doc comments of a package's types and struct fields
// from its source, found from reflect's PkgPath: a package of module mod
// lies in root joined with the rest of its path. So a struct that moves to
// another package is found where it moved.
type docIndex struct {
	root, mod string

	// tests reads _test.go files too (for refgen's own tests).
	tests bool

	mu   sync.Mutex
	pkgs map[string]*pkgDocs // by import path
}

func newDocIndex(root, mod string) *docIndex {
	return &docIndex{root: root, mod: mod, pkgs: map[string]*pkgDocs{}}
}

// pkgDocs are one package's type declarations.
type pkgDocs struct {
	dir   string // relative to the module root
	types map[string]*typeDocs
}

// typeDocs is one declared type: its doc comment and, for a struct, each
// field's.
type typeDocs struct {
	file   string // relative to the module root
	doc    string
	fields map[string]string // Go field name (an embedded one's type name) → doc
}

// pkg loads the package at import path p.
func (x *docIndex) pkg(p string) (*pkgDocs, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if d, ok := x.pkgs[p]; ok {
		return d, nil
	}
	rel, ok := strings.CutPrefix(p, x.mod)
	if !ok || (rel != "" && !strings.HasPrefix(rel, "/")) {
		return nil, fmt.Errorf("package %s is not in module %s: its doc comments cannot be read", p, x.mod)
	}
	rel = strings.TrimPrefix(rel, "/")
	d, err := parsePkg(x.root, rel, x.tests)
	if err != nil {
		return nil, err
	}
	x.pkgs[p] = d
	return d, nil
}

// typ returns the docs of type name in package p, nil when it is not
// declared there.
func (x *docIndex) typ(p, name string) (*typeDocs, error) {
	d, err := x.pkg(p)
	if err != nil {
		return nil, err
	}
	return d.types[name], nil
}

// parsePkg parses the Go files of root/rel, the tests' only when tests.
func parsePkg(root, rel string, tests bool) (*pkgDocs, error) {
	dir := filepath.Join(root, rel)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	d := &pkgDocs{dir: rel, types: map[string]*typeDocs{}}
	fset := token.NewFileSet()
	var names []string
	for _, e := range entries {
		n := e.Name()
		if !e.IsDir() && strings.HasSuffix(n, ".go") && (tests || !strings.HasSuffix(n, "_test.go")) {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	for _, n := range names {
		f, err := parser.ParseFile(fset, filepath.Join(dir, n), nil, parser.ParseComments|parser.SkipObjectResolution)
		if err != nil {
			return nil, err
		}
		relFile := filepath.ToSlash(filepath.Join(rel, n))
		for _, decl := range f.Decls {
			g, ok := decl.(*ast.GenDecl)
			if !ok || g.Tok != token.TYPE {
				continue
			}
			for _, spec := range g.Specs {
				ts := spec.(*ast.TypeSpec)
				td := &typeDocs{file: relFile, doc: ts.Doc.Text(), fields: map[string]string{}}
				if td.doc == "" && len(g.Specs) == 1 {
					td.doc = g.Doc.Text()
				}
				if st, ok := ts.Type.(*ast.StructType); ok {
					fieldDocs(fset, st, td.fields)
				}
				d.types[ts.Name.Name] = td
			}
		}
	}
	return d, nil
}

// fieldDocs records each field's doc comment: the comment above it, else
// the one after it on its line. A field with neither, declared on the line
// right after a documented field whose comment names it ("MasterName and
// SentinelAddrs: ..."), shares that comment.
func fieldDocs(fset *token.FileSet, st *ast.StructType, out map[string]string) {
	prevDoc, prevEnd := "", -1
	for _, f := range st.Fields.List {
		doc := f.Doc.Text()
		if doc == "" {
			doc = f.Comment.Text()
		}
		line := fset.Position(f.Pos()).Line
		if f.Doc != nil {
			line = fset.Position(f.Doc.Pos()).Line
		}
		names := fieldNames(f)
		for _, n := range names {
			d := doc
			if d == "" && line == prevEnd+1 && prevDoc != "" && mentions(prevDoc, n) {
				d = prevDoc
			}
			out[n] = d
			if d != "" {
				prevDoc = d
			}
		}
		if doc == "" && (len(names) == 0 || out[names[0]] == "") {
			prevDoc = ""
		}
		prevEnd = fset.Position(f.End()).Line
	}
}

// fieldNames are the names a field declares; an embedded field's is its
// type's name.
func fieldNames(f *ast.Field) []string {
	if len(f.Names) > 0 {
		var out []string
		for _, n := range f.Names {
			out = append(out, n.Name)
		}
		return out
	}
	t := f.Type
	if s, ok := t.(*ast.StarExpr); ok {
		t = s.X
	}
	switch t := t.(type) {
	case *ast.Ident:
		return []string{t.Name}
	case *ast.SelectorExpr:
		return []string{t.Sel.Name}
	}
	return nil
}

// mentions reports whether doc names the Go identifier name as a word.
func mentions(doc, name string) bool {
	return regexp.MustCompile(`\b` + regexp.QuoteMeta(name) + `\b`).MatchString(doc)
}
