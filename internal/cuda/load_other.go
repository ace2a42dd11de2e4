//go:build !linux || nocuda

package cuda

import "runtime"

// load fails: this build has no loader.
func load(path string) (*lib, error) {
	if runtime.GOOS != "linux" {
		return nil, &UnavailableError{Reason: "CUDA is supported on Linux only, and this encgate was built for " + runtime.GOOS}
	}
	return nil, &UnavailableError{Reason: "this encgate was built with -tags nocuda (a static binary), so it cannot load the CUDA driver " + path}
}
