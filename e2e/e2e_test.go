// Package e2e runs encgate as its users do: the binary, built once from
// this module, started as processes (gateway replicas, agents, fake
// encoders) that the tests signal, reload, restart and kill.
package e2e

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"testing"
)

// encgateBin is the encgate binary TestMain builds for the tests.
var encgateBin string

// TestMain builds the binary once into a temporary directory (with -race
// when the tests run with it, so the processes are checked too), runs the
// tests, and removes it.
func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "encgate-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		os.Exit(1)
	}
	code := build(dir)
	if code == 0 {
		code = m.Run()
	}
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

func build(dir string) int {
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	encgateBin = filepath.Join(dir, "encgate")
	args := []string{"build", "-o", encgateBin}
	if raceEnabled {
		args = append(args, "-race")
	}
	cmd := exec.Command(goBin, append(args, "github.com/encgate/encgate")...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: building encgate: %v\n%s", err, out.String())
		return 1
	}
	return 0
}

// runCmd runs the binary to its end and returns its exit status and output.
func runCmd(args ...string) (code int, stdout, stderr string) {
	var out, errb bytes.Buffer
	cmd := exec.Command(encgateBin, args...)
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &exit):
		code = exit.ExitCode()
	default:
		code = -1
		errb.WriteString(err.Error())
	}
	return code, out.String(), errb.String()
}

func writeTemp(t *testing.T, name, text string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// metricValue is the value of the one series of /metrics text that starts
// with series (name and labels as Prometheus writes them); -1 if absent.
func metricValue(t *testing.T, text, series string) float64 {
	t.Helper()
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`).FindStringSubmatch(text)
	if m == nil {
		return -1
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}
