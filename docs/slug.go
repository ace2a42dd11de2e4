package docs

import (
	"fmt"
	"regexp"
	"strings"
	"unicode"
)

var (
	mdLinkText = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`)
	htmlTag    = regexp.MustCompile(`<[^>]+>`)
)

// Slug is the anchor GitHub gives a heading: its text as rendered (link
// text kept, tags, backticks and asterisks dropped), lowercased, punctuation
// but - and _ dropped, each space a -. Slugger adds the suffix of a
// repeated heading.
func Slug(heading string) string {
	h := mdLinkText.ReplaceAllString(heading, "$1")
	h = htmlTag.ReplaceAllString(h, "")
	h = strings.NewReplacer("`", "", "*", "").Replace(h)
	var b strings.Builder
	for _, r := range strings.ToLower(h) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r) || unicode.IsMark(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// Slugger hands out the anchors of one document's headings in order: a
// heading's Slug, then -1, -2 ... for the second and third with the same
// one, as GitHub does. The zero Slugger is ready to use.
type Slugger struct{ seen map[string]int }

// Next is the anchor of the document's next heading.
func (s *Slugger) Next(heading string) string {
	if s.seen == nil {
		s.seen = map[string]int{}
	}
	base := Slug(heading)
	n := s.seen[base]
	s.seen[base] = n + 1
	if n == 0 {
		return base
	}
	return fmt.Sprintf("%s-%d", base, n)
}
