// Package secretfile reads the small secret files encgate's configs name
// instead of holding a secret inline: the bearer token files
// (encoders[].agent_token_file, admin.token_file, the agent's
// control.token_file, through internal/bearer) and the Redis password file
// (redis.password_file). Such a file is typically a mounted
// Kubernetes Secret. The checks are ssh's for a private key: a file that
// others may read is refused.
package secretfile

import (
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"

	"github.com/encgate/encgate/internal/configfile"
)

// MaxBytes bounds a secret file.
const MaxBytes = 4 << 10

// Read returns the content of the file at path without surrounding
// whitespace (the trailing "\n" or "\r\n" an editor or echo leaves), so a
// secret can neither begin nor end with whitespace. what names the kind of
// file in errors ("token file", "password file"). It refuses a file that is
// not a regular file, one over MaxBytes, an empty (or blank) one, and, on
// Unix, one whose mode grants any permission to others. Its errors name the
// path, never the content.
func Read(path, what string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return "", err
	}
	if !fi.Mode().IsRegular() {
		return "", fmt.Errorf("%s %s is not a regular file", what, path)
	}
	if perm := fi.Mode().Perm(); runtime.GOOS != "windows" && perm&0o007 != 0 {
		return "", fmt.Errorf("%s %s has mode %04o, which grants others access: chmod 600 (or 640) it", what, path, perm)
	}
	data, err := io.ReadAll(io.LimitReader(f, MaxBytes+1))
	if err != nil {
		return "", err // a *PathError: it names the path
	}
	if len(data) > MaxBytes {
		return "", fmt.Errorf("%s %s is over %s", what, path, configfile.ByteSize(MaxBytes))
	}
	secret := strings.TrimSpace(string(data))
	if secret == "" {
		return "", fmt.Errorf("%s %s is empty", what, path)
	}
	return secret, nil
}
