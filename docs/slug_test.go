package docs

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// The anchors GitHub's rules give these headings: the text as rendered,
// lowercased, punctuation but - and _ dropped, each space a -.
func TestSlug(t *testing.T) {
	for _, c := range []struct{ heading, want string }{
		{"Idempotent /send", "idempotent-send"},
		{"Redis modes: what each guarantees", "redis-modes-what-each-guarantees"},
		{"Retries, budget, breakers, health, reload", "retries-budget-breakers-health-reload"},
		{"sglang generations, learned from answers", "sglang-generations-learned-from-answers"},
		{"Capacity: what the replicas ask of Redis", "capacity-what-the-replicas-ask-of-redis"},
		{"`affinity.max_pins` bounds each replica", "affinitymax_pins-bounds-each-replica"},
		{"Stage by CUDA IPC handle", "stage-by-cuda-ipc-handle"},
		{"The [fake](x.md) encoder", "the-fake-encoder"},
		{"A — B", "a--b"},
	} {
		if got := Slug(c.heading); got != c.want {
			t.Errorf("Slug(%q) = %q, want %q", c.heading, got, c.want)
		}
	}
}

// A second heading with the same text is #x-1, a third #x-2; links in code
// blocks and code spans are not links.
func TestParse(t *testing.T) {
	links, anchors := parse("# A\n## A\n## A\n<a id=\"here\"></a>\n```\n[no](nowhere.md)\n```\n`[no](nowhere.md)` [yes](there.md#a-1)\n[ref]: other.md\n")
	for _, a := range []string{"a", "a-1", "a-2", "here"} {
		if !anchors[a] {
			t.Errorf("no anchor %q in %v", a, anchors)
		}
	}
	var targets []string
	for _, l := range links {
		targets = append(targets, l.target)
	}
	if want := []string{"there.md#a-1", "other.md"}; !slices.Equal(targets, want) {
		t.Errorf("links %q, want %q", targets, want)
	}
}

// brokenLinks finds each kind of broken link: a missing file, a missing
// anchor in another file and in the same file, a path outside the tree.
func TestBrokenLinksAreFound(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("README.md", "# Top\n[ok](docs/a.md#section-one) [ok](#top) [gone](docs/missing.md)\n[no anchor](docs/a.md#section-two) [self](#nope) [out](../x.md) [ext](https://example.com/#x)\n")
	write("docs/a.md", "# A\n## Section one\n[up](../README.md#top) [dir](.)\n")
	got, err := brokenLinks(dir, []string{"README.md", "docs/a.md"})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"README.md:2: docs/missing.md: docs/missing.md does not exist",
		"README.md:3: docs/a.md#section-two: docs/a.md has no heading with anchor #section-two",
		"README.md:3: #nope: README.md has no heading with anchor #nope",
		"README.md:3: ../x.md: outside the repository",
	}
	if !slices.Equal(got, want) {
		t.Errorf("broken links:\n%q\nwant\n%q", got, want)
	}
}
