// Package docs holds encgate's manual (the Markdown files under this
// directory) and the test that keeps its links true: every relative link in
// README.md and docs/**/*.md names a file that exists, and every #anchor a
// heading of its target. Its one piece of code is GitHub's heading anchors
// (Slug, Slugger), which that test and the references' generator
// (docs/refgen) share.
package docs
