package docs

import (
	"bufio"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// root is the repository root, seen from this package's directory.
const root = ".."

// maxReadmeLines bounds README.md: it says what encgate is and where to go
// next; the manual is under docs/.
const maxReadmeLines = 300

// manual lists the Markdown files whose links are checked: README.md and
// every .md file under docs/, as paths relative to the repository root.
func manual(t *testing.T) []string {
	t.Helper()
	files := []string{"README.md"}
	err := filepath.WalkDir(filepath.Join(root, "docs"), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".md") {
			rel, err := filepath.Rel(root, p)
			if err != nil {
				return err
			}
			files = append(files, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// A link as written in a Markdown file.
type link struct {
	line   int
	target string
}

var (
	// [text](target "title") and ![alt](target); the text may hold code
	// spans but no ']'. Angle-bracketed targets (<a b.md>) are allowed.
	inlineLink = regexp.MustCompile(`!?\[[^\]]*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+"[^"]*")?\s*\)`)
	// [label]: target
	refLink = regexp.MustCompile(`^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)`)
	// <a id="x"> or <a name="x">: explicit anchors.
	htmlAnchor = regexp.MustCompile(`<a\s+(?:id|name)="([^"]+)"`)
	codeSpan   = regexp.MustCompile("`+[^`]*`+")
	atxHeading = regexp.MustCompile(`^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$`)
)

// parse reads a Markdown file's links (outside fenced code blocks and code
// spans) and the anchors its headings and <a id> tags define.
func parse(text string) (links []link, anchors map[string]bool) {
	anchors = map[string]bool{}
	var slugs Slugger
	fence := ""
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		trimmed := strings.TrimLeft(line, " ")
		if fence != "" {
			if strings.HasPrefix(trimmed, fence) {
				fence = ""
			}
			continue
		}
		if strings.HasPrefix(trimmed, "```") || strings.HasPrefix(trimmed, "~~~") {
			fence = trimmed[:3]
			continue
		}
		for _, m := range htmlAnchor.FindAllStringSubmatch(line, -1) {
			anchors[m[1]] = true
		}
		if m := atxHeading.FindStringSubmatch(line); m != nil {
			anchors[slugs.Next(m[2])] = true
		}
		bare := codeSpan.ReplaceAllString(line, "``")
		for _, m := range inlineLink.FindAllStringSubmatch(bare, -1) {
			links = append(links, link{n, strings.Trim(m[1], "<>")})
		}
		if m := refLink.FindStringSubmatch(bare); m != nil {
			links = append(links, link{n, strings.Trim(m[1], "<>")})
		}
	}
	return links, anchors
}

// brokenLinks checks the links of the files (paths relative to dir) and
// returns one line per link that does not resolve.
func brokenLinks(dir string, files []string) ([]string, error) {
	anchorsOf := map[string]map[string]bool{}
	read := func(rel string) (map[string]bool, []link, error) {
		b, err := os.ReadFile(filepath.Join(dir, filepath.FromSlash(rel)))
		if err != nil {
			return nil, nil, err
		}
		links, anchors := parse(string(b))
		anchorsOf[rel] = anchors
		return anchors, links, nil
	}
	var broken []string
	for _, f := range files {
		own, links, err := read(f)
		if err != nil {
			return nil, err
		}
		for _, l := range links {
			u, err := url.Parse(l.target)
			if err != nil {
				broken = append(broken, fmt.Sprintf("%s:%d: %s: %v", f, l.line, l.target, err))
				continue
			}
			if u.Scheme != "" || u.Host != "" {
				continue // an external link: not checked here
			}
			target, anchors := f, own
			if u.Path != "" {
				if strings.HasPrefix(u.Path, "/") {
					broken = append(broken, fmt.Sprintf("%s:%d: %s: an absolute path; link relative to the file", f, l.line, l.target))
					continue
				}
				target = filepath.ToSlash(filepath.Clean(filepath.Join(filepath.Dir(f), u.Path)))
				if target == ".." || strings.HasPrefix(target, "../") {
					broken = append(broken, fmt.Sprintf("%s:%d: %s: outside the repository", f, l.line, l.target))
					continue
				}
				if _, err := os.Stat(filepath.Join(dir, filepath.FromSlash(target))); err != nil {
					broken = append(broken, fmt.Sprintf("%s:%d: %s: %s does not exist", f, l.line, l.target, target))
					continue
				}
				anchors = nil
			}
			if u.Fragment == "" {
				continue
			}
			if !strings.HasSuffix(target, ".md") {
				continue // an anchor into a non-Markdown file (a line of code) is GitHub's to resolve
			}
			if anchors == nil {
				if anchors = anchorsOf[target]; anchors == nil {
					if anchors, _, err = read(target); err != nil {
						return nil, err
					}
				}
			}
			if !anchors[u.Fragment] {
				broken = append(broken, fmt.Sprintf("%s:%d: %s: %s has no heading with anchor #%s", f, l.line, l.target, target, u.Fragment))
			}
		}
	}
	return broken, nil
}

// TestLinksResolve: every relative link in README.md and docs/ names a file
// that exists, and every #anchor a heading (or <a id>) of its target.
func TestLinksResolve(t *testing.T) {
	files := manual(t)
	broken, err := brokenLinks(root, files)
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range broken {
		t.Error(b)
	}
	t.Logf("checked the links of %d files", len(files))
}

// TestReadmeIsShort: README.md stays an entry point; what is longer goes
// under docs/.
func TestReadmeIsShort(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(b), "\n"); n > maxReadmeLines {
		t.Errorf("README.md has %d lines, more than %d: move the detail into docs/", n, maxReadmeLines)
	}
}

// TestEveryAlertHasARunbook: each alert in deploy/prometheus/alerts.yaml has
// a section in docs/operations/runbooks.md headed by its name, so an
// operator paged by one finds what to do at runbooks.md#<name lowercased>.
func TestEveryAlertHasARunbook(t *testing.T) {
	rules, err := os.ReadFile(filepath.Join(root, "deploy", "prometheus", "alerts.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	book, err := os.ReadFile(filepath.Join(root, "docs", "operations", "runbooks.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, anchors := parse(string(book))
	alerts := regexp.MustCompile(`(?m)^\s*-\s*alert:\s*(\S+)`).FindAllStringSubmatch(string(rules), -1)
	if len(alerts) == 0 {
		t.Fatal("no alerts found in alerts.yaml")
	}
	var names []string
	for _, m := range alerts {
		names = append(names, m[1])
		if !anchors[strings.ToLower(m[1])] {
			t.Errorf("alert %s has no runbook: docs/operations/runbooks.md needs a heading %q", m[1], m[1])
		}
	}
	// And no runbook for an alert that no longer exists.
	for a := range anchors {
		if strings.HasPrefix(a, "encgate") && !slices.ContainsFunc(names, func(n string) bool { return strings.ToLower(n) == a }) {
			t.Errorf("docs/operations/runbooks.md has a runbook #%s for no alert in alerts.yaml", a)
		}
	}
}
