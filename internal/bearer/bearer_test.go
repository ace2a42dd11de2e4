package bearer

import (
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/encgate/encgate/internal/configfile"
)

const tok = "s3cr3t-t0ken-AAAAbbbb"

func TestParse(t *testing.T) {
	tests := []struct {
		header, token string
		ok            bool
	}{
		{"Bearer " + tok, tok, true},
		{"bearer " + tok, tok, true},
		{"BEARER   " + tok, tok, true},
		{"Bearer ", "", false},
		{"Bearer", "", false},
		{"Basic " + tok, "", false},
		{"", "", false},
		{tok, "", false},
	}
	for _, tc := range tests {
		got, ok := Parse(tc.header)
		if got != tc.token || ok != tc.ok {
			t.Errorf("Parse(%q) = %q, %v; want %q, %v", tc.header, got, ok, tc.token, tc.ok)
		}
	}
}

func TestEqual(t *testing.T) {
	if !Equal(tok, tok) {
		t.Error("a token differs from itself")
	}
	for _, other := range []string{"", tok[:len(tok)-1], tok + "x", strings.ToUpper(tok)} {
		if Equal(other, tok) {
			t.Errorf("Equal(%q, %q)", other, tok)
		}
	}
}

func TestIsToken68(t *testing.T) {
	for _, s := range []string{"a", "abc==", "A-._~+/9", "Zm9vYmFy"} {
		if !IsToken68(s) {
			t.Errorf("IsToken68(%q) = false", s)
		}
	}
	for _, s := range []string{"", "==", "a=b", "a b", "a\"b", "a,b", "é", "a\n"} {
		if IsToken68(s) {
			t.Errorf("IsToken68(%q) = true", s)
		}
	}
}

func TestCheck(t *testing.T) {
	var p configfile.Problems
	Check(&p, "x.token", tok)
	Check(&p, "x.token", "") // none configured
	if err := p.Err(); err != nil {
		t.Fatalf("a valid token: %v", err)
	}
	bad := "short token!"
	Check(&p, "x.token", bad)
	err := p.Err()
	if err == nil {
		t.Fatal("a bad token passed")
	}
	for _, w := range []string{"x.token: must be at least 16 characters, got 12",
		"x.token: must use only letters, digits and -._~+/ (then optional = padding), as a bearer token does (RFC 6750)"} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%q missing from %v", w, err)
		}
	}
	if strings.Contains(err.Error(), bad) {
		t.Errorf("the problem quotes the token: %v", err)
	}
}

func writeToken(t *testing.T, body string, mode os.FileMode) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(path, []byte(body), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil { // past the umask
		t.Fatal(err)
	}
	return path
}

func TestReadFileStripsTheLineEnd(t *testing.T) {
	for _, body := range []string{tok, tok + "\n", tok + "\r\n", "  " + tok + " \n\n"} {
		got, err := ReadFile(writeToken(t, body, 0o600))
		if err != nil || got != tok {
			t.Errorf("ReadFile of %q = %q, %v; want the token", body, got, err)
		}
	}
	if _, err := ReadFile(writeToken(t, tok+"\n", 0o640)); err != nil {
		t.Errorf("mode 0640: %v", err)
	}
}

func TestReadFileRefuses(t *testing.T) {
	big := strings.Repeat("a", MaxFileBytes+1)
	tests := []struct {
		name, body string
		mode       os.FileMode
		want       string
	}{
		{"empty", "", 0o600, "is empty"},
		{"blank", " \r\n", 0o600, "is empty"},
		{"over 4KiB", big, 0o600, "is over 4KiB"},
		{"short", "abc123\n", 0o600, "the token must be at least 16 characters, got 6"},
		{"bad alphabet", "spaces in the middle of it\n", 0o600, "the token must use only letters, digits and -._~+/"},
		{"two lines", tok + "\n" + tok + "\n", 0o600, "the token must use only letters"},
	}
	if runtime.GOOS != "windows" {
		tests = append(tests,
			struct {
				name, body string
				mode       os.FileMode
				want       string
			}{"world readable", tok, 0o644, "has mode 0644, which grants others access: chmod 600 (or 640) it"},
			struct {
				name, body string
				mode       os.FileMode
				want       string
			}{"world executable", tok, 0o601, "has mode 0601"})
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := writeToken(t, tc.body, tc.mode)
			got, err := ReadFile(path)
			if err == nil {
				t.Fatalf("ReadFile = %q, want an error", got)
			}
			if !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), path) {
				t.Fatalf("error %q, want %q naming %s", err, tc.want, path)
			}
			if s := strings.TrimSpace(tc.body); s != "" && strings.Contains(err.Error(), s) {
				t.Fatalf("the error quotes the token: %v", err)
			}
		})
	}
}

func TestReadFileRefusesMissingFilesAndDirectories(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "nope")
	if _, err := ReadFile(missing); err == nil || !strings.Contains(err.Error(), missing) || !os.IsNotExist(err) {
		t.Errorf("missing file: %v", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadFile(dir); err == nil || !strings.Contains(err.Error(), "is not a regular file") {
		t.Errorf("directory: %v", err)
	}
}

func TestAuthorize(t *testing.T) {
	const want = "the-right-token-0123"
	for _, tc := range []struct {
		header, want string
		out          Outcome
	}{
		{"", "", Allowed},
		{"Bearer anything", "", Allowed},
		{"Bearer " + want, want, Allowed},
		{"bearer  " + want, want, Allowed},
		{"", want, Missing},
		{"Basic " + want, want, Missing},
		{"Bearer", want, Missing},
		{"Bearer " + want + "x", want, Wrong},
		{"Bearer " + want[:len(want)-1], want, Wrong},
	} {
		if got := Authorize(tc.header, tc.want); got != tc.out {
			t.Errorf("Authorize(%q, %q) = %d, want %d", tc.header, tc.want, got, tc.out)
		}
	}
	if c := Challenge("r", Missing); c != `Bearer realm="r"` {
		t.Errorf("Challenge(Missing) = %s", c)
	}
	if c := Challenge("r", Wrong); c != `Bearer realm="r", error="invalid_token"` {
		t.Errorf("Challenge(Wrong) = %s", c)
	}
}
