// Package logtest reads the JSON log lines (zap's production encoder) that
// a process under test wrote, for the tests that start encgate as a
// process.
package logtest

import (
	"encoding/json"
	"strings"
	"testing"
)

// JSONLines decodes every line of out as a JSON log entry; a line that is
// not one (a plain-text line among zap's) fails the test.
func JSONLines(t testing.TB, out string) []map[string]any {
	t.Helper()
	var entries []map[string]any
	for l := range strings.SplitSeq(strings.TrimSpace(out), "\n") {
		var e map[string]any
		if err := json.Unmarshal([]byte(l), &e); err != nil {
			t.Errorf("not a JSON log line: %q", l)
			continue
		}
		entries = append(entries, e)
	}
	return entries
}
