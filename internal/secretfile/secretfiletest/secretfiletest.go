// Package secretfiletest writes the secret files (token and password files)
// that tests hand to the config loaders.
package secretfiletest

import (
	"os"
	"path/filepath"
	"testing"
)

// Write writes body to a file called name in a new temp dir of t, with
// mode set past the umask, and returns its path.
func Write(t testing.TB, name, body string, mode os.FileMode) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(body), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
	return path
}
