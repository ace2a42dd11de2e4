// Package testtool is how a test says it needs a program the machine may
// lack (redis-server, promtool, chromium, a C compiler, python3 with zmq):
// without it the test skips and says what to install, and with
// ENCGATE_TEST_STRICT=1 in the environment (as .ci/run sets) it fails
// instead, so that a CI machine missing a tool cannot pass by skipping the
// tests that need it.
//
// Only a missing tool goes through here. A test that does not apply to the
// machine (a platform without memfd_create or IPv6 loopback, a user that
// is not root), that is opt-in or long (testing.Short) skips with t.Skip
// as before, strict or not.
package testtool

import (
	"os"
	"os/exec"
	"testing"
)

// StrictEnv is the environment variable that, set to 1, makes a missing
// tool fail the test that needs it instead of skipping it.
const StrictEnv = "ENCGATE_TEST_STRICT"

// Strict reports whether StrictEnv is 1.
func Strict() bool { return os.Getenv(StrictEnv) == "1" }

// Need returns the path of the program name on PATH. When there is none it
// calls Missing for it: the test skips, or under StrictEnv fails, naming
// the Debian package pkg that brings the program.
func Need(t testing.TB, name, pkg string) string {
	t.Helper()
	path, err := exec.LookPath(name)
	if err != nil {
		Missing(t, name, pkg, err.Error())
		return ""
	}
	return path
}

// Missing ends t for a tool it needs and did not find (tool names it, as
// a program or, e.g., "python3 with the zmq module"; pkg is the Debian
// package that brings it; why says what the test cannot do without it or
// how the lookup failed): t skips, or under StrictEnv fails.
func Missing(t testing.TB, tool, pkg, why string) {
	t.Helper()
	if Strict() {
		t.Fatalf("%s is not installed (Debian: apt-get install %s), and %s=1 makes a missing tool a failure: %s", tool, pkg, StrictEnv, why)
		return
	}
	t.Skipf("%s is not installed (Debian: apt-get install %s; .ci/run installs what the tests need; %s=1 fails instead of skipping): %s", tool, pkg, StrictEnv, why)
}
