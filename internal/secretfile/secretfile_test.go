package secretfile

import (
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/encgate/encgate/internal/secretfile/secretfiletest"
)

const secret = "a Redis password, spaces inside"

// The content comes back without the surrounding whitespace; inner spaces
// stay (a password may hold them).
func TestReadTrimsTheSurroundingWhitespace(t *testing.T) {
	for _, body := range []string{secret, secret + "\n", secret + "\r\n", "\t" + secret + " \n\n"} {
		for _, mode := range []os.FileMode{0o600, 0o640, 0o400, 0o440} {
			if got, err := Read(secretfiletest.Write(t, "secret", body, mode), "password file"); err != nil || got != secret {
				t.Errorf("Read of %q, mode %04o = %q, %v; want the secret", body, mode, got, err)
			}
		}
	}
}

// A Kubernetes Secret volume lays each key out as a link into a
// timestamped directory (key -> ..data/key, ..data -> ..2024_...): Read
// follows the links and judges the file they reach.
func TestReadFollowsTheLinksOfASecretVolume(t *testing.T) {
	if runtime.GOOS == "windows" {
		t.Skip("no symlinks")
	}
	dir := t.TempDir()
	ts := filepath.Join(dir, "..2024_01_01_00_00_00.000000000")
	if err := os.Mkdir(ts, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(ts, "secret"), []byte(secret+"\n"), 0o440); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Base(ts), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	key := filepath.Join(dir, "password")
	if err := os.Symlink(filepath.Join("..data", "secret"), key); err != nil {
		t.Fatal(err)
	}
	if got, err := Read(key, "password file"); err != nil || got != secret {
		t.Fatalf("Read through the links = %q, %v", got, err)
	}
	if err := os.Chmod(filepath.Join(ts, "secret"), 0o444); err != nil {
		t.Fatal(err)
	}
	if _, err := Read(key, "password file"); err == nil || !strings.Contains(err.Error(), "has mode 0444") {
		t.Fatalf("a link to a file others may read: %v", err)
	}
}

func TestReadRefuses(t *testing.T) {
	dir := t.TempDir()
	for name, tc := range map[string]struct {
		path func() string
		want string
	}{
		"missing":     {func() string { return filepath.Join(dir, "missing") }, "no such file or directory"},
		"a directory": {func() string { return dir }, "password file " + dir + " is not a regular file"},
		"empty":       {func() string { return secretfiletest.Write(t, "secret", "", 0o600) }, " is empty"},
		"blank":       {func() string { return secretfiletest.Write(t, "secret", " \r\n\t", 0o600) }, " is empty"},
		"over 4KiB":   {func() string { return secretfiletest.Write(t, "secret", strings.Repeat("p", MaxBytes+1), 0o600) }, " is over 4KiB"},
		"others read": {func() string { return secretfiletest.Write(t, "secret", secret, 0o604) }, " has mode 0604, which grants others access: chmod 600 (or 640) it"},
		"others exec": {func() string { return secretfiletest.Write(t, "secret", secret, 0o641) }, " has mode 0641"},
	} {
		if runtime.GOOS == "windows" && strings.HasPrefix(name, "others") {
			continue
		}
		t.Run(name, func(t *testing.T) {
			path := tc.path()
			got, err := Read(path, "password file")
			if err == nil {
				t.Fatalf("Read = %q, want an error", got)
			}
			if !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), path) {
				t.Fatalf("error %q, want %q naming %s", err, tc.want, path)
			}
			if strings.Contains(err.Error(), secret) {
				t.Fatalf("the error quotes the secret: %v", err)
			}
		})
	}
	// Exactly MaxBytes is still read.
	if _, err := Read(secretfiletest.Write(t, "secret", strings.Repeat("p", MaxBytes), 0o600), "password file"); err != nil {
		t.Errorf("a file of %d bytes: %v", MaxBytes, err)
	}
}
