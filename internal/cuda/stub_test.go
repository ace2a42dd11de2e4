//go:build !linux || nocuda

package cuda

import (
	"errors"
	"runtime"
	"strings"
	"testing"
)

func TestOpenUnavailable(t *testing.T) {
	_, err := Open("")
	var u *UnavailableError
	if !errors.As(err, &u) {
		t.Fatalf("got %v (%T), want an *UnavailableError", err, err)
	}
	want := "-tags nocuda"
	if runtime.GOOS != "linux" {
		want = "Linux only"
	}
	if !strings.Contains(u.Reason, want) {
		t.Errorf("reason %q does not say %q", u.Reason, want)
	}
}
