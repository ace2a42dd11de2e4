package urlhint

import "testing"

func TestNoScheme(t *testing.T) {
	for _, tc := range []struct {
		raw, meant string // meant "": no hint
	}{
		{"10.0.0.5:30000", "http://10.0.0.5:30000"},
		{"enc-0:30000", "http://enc-0:30000"},
		{"enc-0.encoders.svc.cluster.local:30000/", "http://enc-0.encoders.svc.cluster.local:30000/"},
		{"[::1]:30000", "http://[::1]:30000"},
		{"localhost:8997", "http://localhost:8997"},
		{"http://10.0.0.5:30000", ""},
		{"ftp://10.0.0.5:30000", ""},
		{"10.0.0.5", ""},
		{"enc-0:port", ""},
		{":30000", ""},
		{"user@enc-0:30000", ""},
		{"", ""},
	} {
		meant, ok := NoScheme(tc.raw)
		if meant != tc.meant || ok != (tc.meant != "") {
			t.Errorf("NoScheme(%q) = %q, %v; want %q", tc.raw, meant, ok, tc.meant)
		}
	}
	if got, want := Problem("10.0.0.5:30000"), `"10.0.0.5:30000" has no scheme; did you mean "http://10.0.0.5:30000"?`; got != want {
		t.Errorf("Problem = %s, want %s", got, want)
	}
	if got := Problem("http://10.0.0.5:30000"); got != "" {
		t.Errorf("Problem of a URL with its scheme = %q, want none", got)
	}
}
