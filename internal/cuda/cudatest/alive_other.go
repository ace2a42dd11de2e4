//go:build !unix

package cudatest

// alive assumes every process exists: nothing is swept.
func alive(int) bool { return true }
