#!/usr/bin/env bash
# bench/gpu/prepare.sh: builds, on a machine with Go, the three binaries that
# bench/gpu/run.sh runs on the GPU machine, into bench/gpu/bin/ (git-ignored):
#
#   encgate     the agent (`encgate agent`), default tags (CUDA loader in)
#   cudaexport  internal/cuda/cudaexport: device memory with the pattern, its IPC handle
#   gpucheck    bench/gpu/gpucheck: the check itself
#
# The device machine has no Go toolchain and nothing can be fetched there
# (/work/.library/device/README.md and KINDS.md: an image with CUDA, nvcc and
# PyTorch), so the binaries travel: name bench/gpu/bin in the device tool's
# `carry`. They are x86-64 Linux (the device's processor), CGO_ENABLED=0 (the
# loader is purego: the binaries are dynamically linked for dlopen but ask
# for no versioned glibc symbol, so any glibc on the device will do),
# stripped (-s -w) to keep what travels well under 64 MiB. A list of the
# source files' SHA-256 sums goes with them; run.sh checks it on the device
# and says in the results when the binaries are older than the tree.
#
# Takes about 10-30 s (a warm build cache: a few seconds).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [[ ! -f go.mod ]] || ! grep -q '^module github.com/encgate/encgate' go.mod; then
	echo "prepare: cannot find the encgate repository root from $PWD" >&2
	exit 1
fi
command -v go >/dev/null 2>&1 || PATH=$PATH:/usr/local/go/bin
command -v go >/dev/null 2>&1 || { echo "prepare: go is not on PATH" >&2; exit 1; }

out=bench/gpu/bin
rm -rf "$out.new"
mkdir -p "$out.new"
trap 'rm -rf "$out.new"' EXIT
build() { # OUTPUT PACKAGE
	echo "prepare: go build $2" >&2
	CGO_ENABLED=0 GOOS=linux GOARCH=amd64 go build -trimpath -ldflags='-s -w' -o "$out.new/$1" "$2"
}
build encgate .
build cudaexport ./internal/cuda/cudaexport
build gpucheck ./bench/gpu/gpucheck

# The sources the binaries came from: the Go files (tests left out), the
# embedded status pages, go.mod and go.sum that git tracks or would track
# (the device receives exactly those).
if git rev-parse --git-dir >/dev/null 2>&1; then
	git ls-files -z -co --exclude-standard -- '*.go' '*.html' go.mod go.sum ':!:*_test.go' ':!:**/testdata/**' |
		xargs -0 sha256sum >"$out.new/sources.sha256"
	rev="$(git rev-parse --short HEAD)$([[ -z $(git status --porcelain 2>/dev/null) ]] || echo ' + uncommitted changes')"
else
	find . -path ./bench/gpu/bin -prune -o -path ./.git -prune -o -path '*/testdata' -prune -o -type f \
		\( -name '*.go' ! -name '*_test.go' -o -name '*.html' -o -name go.mod -o -name go.sum \) -print0 |
		xargs -0 sha256sum >"$out.new/sources.sha256"
	rev="(no git)"
fi
printf 'built %s from %s with %s, CGO_ENABLED=0 linux/amd64 -trimpath -s -w\n' \
	"$(date -u '+%Y-%m-%d %H:%M UTC')" "$rev" "$(go version | awk '{print $3}')" >"$out.new/BUILD"

rm -rf "$out"
mv "$out.new" "$out"
trap - EXIT
du -b "$out"/* | awk '{ s += $1; printf "prepare: %-28s %6.1f MiB\n", $2, $1 / 1048576 } END { printf "prepare: together %.1f MiB (the device tool carries 64 MiB with the tree)\n", s / 1048576 }' >&2
cat "$out/BUILD" >&2
cat >&2 <<'MSG'
prepare: on the device machine run (device tool `run`):
  command: bash bench/gpu/run.sh
  carry:   ["bench/gpu/bin"]
  timeout_s: 540   (run.sh bounds itself with LIMIT=480)
MSG
