#!/usr/bin/env bash
# bench/gpu/run.sh: the device check of stage by CUDA IPC handle, as one
# command for a GPU machine. It runs bench/gpu/gpucheck, which for each size
# (default 8MiB, 64MiB, 256MiB):
#   - times device-to-host copies in its own process (chunked through pinned
#     buffers with an event per slot, as the agent copies; and whole);
#   - times loopback TCP (one 127.0.0.1 connection, one buffer);
#   - starts cudaexport (device memory filled with a pattern, its IPC handle)
#     and, for each transfer.chunk_bytes × transfer.buffers pair (default
#     1MiB, 4MiB, 16MiB × 2, 3), a real `encgate agent` with its own Mooncake
#     receiver; stages by handle over the agent's Unix socket, POSTs /send,
#     reads the receiver's buffer back and checks EVERY byte, then times
#     ROUNDS more /sends;
# and writes a markdown table: DtoH, TCP, end-to-end GB/s, and end-to-end ÷
# min(DtoH, TCP) against the target 0.9. A wrong byte exits 1 naming the
# first bad offset.
#
# How long: about 1-3 minutes on a one-GPU machine with the defaults (18
# agent starts, 3 exporter starts, a few GB moved); never more than LIMIT
# (480 s) plus 30 s to stop, so a device call with timeout_s 540 fits.
#
# The device machine has no Go toolchain and fetches nothing. Build the
# binaries here first, then carry them:
#   here:    bash bench/gpu/prepare.sh          (into bench/gpu/bin/, git-ignored)
#   device:  bash bench/gpu/run.sh              (carry: ["bench/gpu/bin"])
# Without bench/gpu/bin and with Go on PATH (and the modules cached) it
# builds the three binaries into a temporary directory instead.
#
# Environment:
#   LIMIT=480              seconds for the whole check (timeout(1)); 124 when hit
#   LIBRARY=libcuda.so.1   the CUDA driver library (found the way dlopen finds it,
#                          else looked for in the usual driver directories)
#   DEVICE=0               the device ordinal
#   SIZES, ROUNDS, CHUNKS, BUFFERS   gpucheck's --sizes, --rounds, --chunks, --buffers
#   OUT                    a directory (the device tool's $OUT): results in $OUT/gpu.md
#                          and the whole log in $OUT/gpu.log; a file name: the results
#                          there; unset: bench/results/gpu.md
# Further arguments are passed to gpucheck.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [[ ! -f go.mod ]] || ! grep -q '^module github.com/encgate/encgate' go.mod; then
	echo "gpu: cannot find the encgate repository root from $PWD" >&2
	exit 1
fi

LIMIT=${LIMIT:-480}
OUT_DIR=bench/results
if [[ -n ${OUT:-} && -d ${OUT} ]]; then
	out=$OUT/gpu.md
	log=$OUT/gpu.log
else
	out=${OUT:-$OUT_DIR/gpu.md}
	log=
fi
mkdir -p "$(dirname "$out")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
[[ -n $log ]] || log=$tmp/gpu.log
: >"$log"
say() { echo "gpu: $*" | tee -a "$log" >&2; }

# The binaries: prebuilt (prepare.sh), else built here.
bin=bench/gpu/bin
if [[ -x $bin/encgate && -x $bin/cudaexport && -x $bin/gpucheck ]]; then
	build_info="bench/gpu/bin: $(cat "$bin/BUILD" 2>/dev/null || echo 'no BUILD file')"
	if [[ -f $bin/sources.sha256 ]]; then
		if changed=$(sha256sum --quiet -c "$bin/sources.sha256" 2>/dev/null); then
			build_info+="; the sources are unchanged since"
		else
			n=$(grep -c . <<<"$changed" || true)
			say "WARNING: $n source file(s) differ from those bench/gpu/bin was built from (rerun bench/gpu/prepare.sh):"
			head -20 <<<"$changed" | sed 's/^/gpu:   /' | tee -a "$log" >&2
			build_info+="; STALE: $n source file(s) changed since"
		fi
	fi
else
	command -v go >/dev/null 2>&1 || PATH=$PATH:/usr/local/go/bin
	if ! command -v go >/dev/null 2>&1; then
		say "no bench/gpu/bin and no go on PATH: run bash bench/gpu/prepare.sh where Go is, and carry bench/gpu/bin"
		exit 1
	fi
	bin=$tmp
	say "building encgate, cudaexport and gpucheck into $bin"
	go build -o "$bin/encgate" .
	go build -o "$bin/cudaexport" ./internal/cuda/cudaexport
	go build -o "$bin/gpucheck" ./bench/gpu/gpucheck
	build_info="built by run.sh with $(go version | awk '{print $3}')"
fi
say "$build_info"

# The driver library: as dlopen finds it, else a full path from the usual places.
LIBRARY=${LIBRARY:-libcuda.so.1}
if [[ $LIBRARY != */* ]] && ! ldconfig -p 2>/dev/null | grep -q "[[:space:]]$LIBRARY "; then
	ld_path=${LD_LIBRARY_PATH:-}
	for d in ${ld_path//:/ } /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu \
		/usr/lib64 /usr/local/cuda/lib64 /usr/local/cuda/compat /usr/lib/wsl/lib; do
		if [[ -e $d/$LIBRARY ]]; then
			say "ldconfig does not know $LIBRARY; using $d/$LIBRARY"
			LIBRARY=$d/$LIBRARY
			break
		fi
	done
fi

{
	echo "gpu: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(nproc) CPUs, Linux $(uname -r), library $LIBRARY, limit ${LIMIT}s"
	if command -v nvidia-smi >/dev/null 2>&1; then
		nvidia-smi -L || true
	else
		echo "gpu: nvidia-smi is not on PATH"
	fi
} 2>&1 | tee -a "$log" >&2

args=(--encgate "$bin/encgate" --exporter "$bin/cudaexport" --library "$LIBRARY" --device "${DEVICE:-0}"
	--out "$out" --build-info "$build_info")
[[ -z ${SIZES:-} ]] || args+=(--sizes "$SIZES")
[[ -z ${ROUNDS:-} ]] || args+=(--rounds "$ROUNDS")
[[ -z ${CHUNKS:-} ]] || args+=(--chunks "$CHUNKS")
[[ -z ${BUFFERS:-} ]] || args+=(--buffers "$BUFFERS")

set +e
timeout --kill-after=30 "$LIMIT" "$bin/gpucheck" "${args[@]}" "$@" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
set -e
case $rc in
0) say "done: results in $out" ;;
124) say "FAILED: the check ran past LIMIT=${LIMIT}s and was stopped" ;;
*) say "FAILED: gpucheck exited $rc" ;;
esac
exit "$rc"
