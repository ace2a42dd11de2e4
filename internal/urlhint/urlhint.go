// Package urlhint recognises a URL written without its scheme (an
// encoder's "10.0.0.5:30000" where "http://10.0.0.5:30000" was meant), so
// that the error about it can say what was probably meant. Without the
// hint, Go's url.Parse makes "enc-0:30000" a URL of scheme "enc-0" and
// refuses "10.0.0.5:30000" for a colon in its first path segment: errors
// that do not point at the missing "http://".
package urlhint

import (
	"fmt"
	"net"
	"strconv"
	"strings"
)

// NoScheme reports whether raw is host:port with no scheme, and the URL
// probably meant: raw behind "http://".
func NoScheme(raw string) (meant string, ok bool) {
	if strings.Contains(raw, "://") {
		return "", false
	}
	host, port, err := net.SplitHostPort(strings.TrimRight(raw, "/"))
	if err != nil || host == "" || strings.ContainsAny(host, "/?#@") {
		return "", false
	}
	if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
		return "", false
	}
	return "http://" + raw, true
}

// Problem is the problem to report for raw when it has no scheme, e.g.
// `"10.0.0.5:30000" has no scheme; did you mean "http://10.0.0.5:30000"?`,
// and "" otherwise.
func Problem(raw string) string {
	meant, ok := NoScheme(raw)
	if !ok {
		return ""
	}
	return fmt.Sprintf("%q has no scheme; did you mean %q?", raw, meant)
}
