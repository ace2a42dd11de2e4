package testtool

import (
	"fmt"
	"strings"
	"testing"
)

// recorder is a testing.TB that records how the test would have ended.
type recorder struct {
	testing.TB
	skipped, failed string
}

func (r *recorder) Helper() {}
func (r *recorder) Skipf(format string, args ...any) {
	r.skipped = fmt.Sprintf(format, args...)
}
func (r *recorder) Fatalf(format string, args ...any) {
	r.failed = fmt.Sprintf(format, args...)
}

const absent = "encgate-testtool-no-such-program"

func TestNeedSkipsWithoutStrict(t *testing.T) {
	t.Setenv(StrictEnv, "")
	r := &recorder{}
	if p := Need(r, absent, "some-package"); p != "" {
		t.Fatalf("Need found %q", p)
	}
	if r.failed != "" || !strings.Contains(r.skipped, absent+" is not installed (Debian: apt-get install some-package") {
		t.Fatalf("skipped %q, failed %q", r.skipped, r.failed)
	}
}

func TestNeedFailsUnderStrict(t *testing.T) {
	t.Setenv(StrictEnv, "1")
	r := &recorder{}
	Need(r, absent, "some-package")
	if r.skipped != "" || !strings.Contains(r.failed, absent+" is not installed (Debian: apt-get install some-package)") ||
		!strings.Contains(r.failed, StrictEnv+"=1") {
		t.Fatalf("skipped %q, failed %q", r.skipped, r.failed)
	}
}

func TestNeedFindsAProgram(t *testing.T) {
	t.Setenv(StrictEnv, "1")
	r := &recorder{}
	// sh is on every machine these tests run on.
	if p := Need(r, "sh", "dash"); p == "" || r.skipped != "" || r.failed != "" {
		t.Fatalf("Need(sh) = %q; skipped %q, failed %q", p, r.skipped, r.failed)
	}
}

func TestMissingNamesTheToolAndWhy(t *testing.T) {
	t.Setenv(StrictEnv, "1")
	r := &recorder{}
	Missing(r, "python3 with the zmq module", "python3-zmq", "the interop test needs a real libzmq peer")
	for _, w := range []string{"python3 with the zmq module", "apt-get install python3-zmq", "needs a real libzmq peer"} {
		if !strings.Contains(r.failed, w) {
			t.Errorf("failure %q lacks %q", r.failed, w)
		}
	}
	t.Setenv(StrictEnv, "0")
	r = &recorder{}
	Missing(r, "promtool", "prometheus", "x")
	if r.failed != "" || r.skipped == "" {
		t.Fatalf("%s=0: skipped %q, failed %q", StrictEnv, r.skipped, r.failed)
	}
}
