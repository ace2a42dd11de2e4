package main

import (
	"net"
	"strings"
	"testing"

	"github.com/encgate/encgate/internal/logtest"
)

// A gateway whose listen address is taken exits 1 with one error entry
// that says so, without a stack trace: an address in use is an expected
// condition, not a bug in the gateway.
func TestBindFailureLogsNoStackTrace(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = taken.Close() }()
	path := writeTemp(t, "gateway.yaml", `
listen: "`+taken.Addr().String()+`"
admin_listen: "127.0.0.1:0"
encoders:
  - name: enc-a
    url: "http://127.0.0.1:30001"
`)
	code, stdout, stderr := runCmd("gateway", "--config", path)
	if code != 1 {
		t.Fatalf("exit %d, want 1; stdout %q stderr:\n%s", code, stdout, stderr)
	}
	if strings.Contains(stderr, "stacktrace") {
		t.Errorf("stderr holds a stack trace:\n%s", stderr)
	}
	var found bool
	for _, e := range logtest.JSONLines(t, stderr) {
		if e["level"] == "error" && e["msg"] == "starting gateway" {
			found = true
			if msg, _ := e["error"].(string); !strings.Contains(msg, "address already in use") {
				t.Errorf("the entry does not say the address is in use: %v", e)
			}
		}
	}
	if !found {
		t.Errorf("no error entry \"starting gateway\" in:\n%s", stderr)
	}
}

// The process's logger puts stack traces on DPanic and above only: an
// error, such as a refused reload, carries none.
func TestLoggerStackTracesOnlyFromDPanic(t *testing.T) {
	var out strings.Builder
	log, _, err := newLogger("info", &out)
	if err != nil {
		t.Fatal(err)
	}
	log.Warn("breaker opened")
	log.Error("config reload refused; the running config stays")
	if strings.Contains(out.String(), "stacktrace") {
		t.Fatalf("warn or error entries carry a stack trace:\n%s", out.String())
	}
	if n := len(logtest.JSONLines(t, out.String())); n != 2 {
		t.Fatalf("%d entries, want 2:\n%s", n, out.String())
	}
	out.Reset()
	log.DPanic("an invariant broke") // logs; panics only in development
	if !strings.Contains(out.String(), `"stacktrace"`) {
		t.Fatalf("a DPanic entry carries no stack trace:\n%s", out.String())
	}
}
