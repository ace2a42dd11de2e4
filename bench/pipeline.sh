#!/usr/bin/env bash
# bench/pipeline.sh: the host source through the chunked pipeline against the
# path it replaced (one writev of header and bytes), side by side in one run,
# at 8 and 64 MiB, for each chunk size. Target: pipeline >= 0.95x writev.
#
#   writev       BenchmarkHostTransfer/<size>/writev (gpuagent/pipeline/bench_test.go):
#                mooncake.Initiator.Write, the agent's transfer before the
#                pipeline, into a Mooncake v2 receiver over loopback.
#   pipeline-C   BenchmarkHostTransfer/<size>/pipeline-C: the same transfer
#                through Initiator.WriteFrom with pipeline.Host, chunk C,
#                depth 3: what the agent does for a host stage now.
# Each round runs every case once (the benchmark binary interleaves them);
# the table shows the medians of the rounds and each case's ratio to writev.
#
# Environment:
#   ROUNDS=7            rounds (at least 3)
#   BENCHTIME=40x       go test -benchtime of each case
#   OUT=bench/results/pipeline.md
#   QUIET_WAIT=15       seconds to wait, before each round, for the machine to be idle
set -euo pipefail
# shellcheck source=bench/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
bench_cd_root
bench_need_go

ROUNDS=${ROUNDS:-7}
BENCHTIME=${BENCHTIME:-40x}
OUT=${OUT:-bench/results/pipeline.md}
mkdir -p "$(dirname "$OUT")"
if ((ROUNDS < 3)); then
	echo "pipeline: ROUNDS=$ROUNDS; at least 3 are needed for a median" >&2
	exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
go test -c -o "$tmp/pipeline.test" ./gpuagent/pipeline

: >"$tmp/results.txt"
for r in $(seq 1 "$ROUNDS"); do
	echo "pipeline: round $r/$ROUNDS" >&2
	bench_wait_quiet
	(cd gpuagent/pipeline && "$tmp/pipeline.test" -test.run '^$' -test.bench '^BenchmarkHostTransfer$' \
		-test.benchtime "$BENCHTIME") >"$tmp/out.txt"
	if ! grep -q '^PASS' "$tmp/out.txt"; then
		cat "$tmp/out.txt" >&2
		exit 1
	fi
	grep '^Benchmark' "$tmp/out.txt" >&2
	grep '^Benchmark' "$tmp/out.txt" | awk '{
		split($1, p, "/"); kind = p[3]; sub(/-[0-9]+$/, "", kind)
		for (i = 2; i <= NF; i++) if ($i == "MB/s") print p[2], kind, $(i - 1)
	}' >>"$tmp/results.txt"
done

med() { awk -v s="$1" -v k="$2" '$1 == s && $2 == k { print $3 / 1000 }' "$tmp/results.txt" | bench_median; }
each() { awk -v s="$1" -v k="$2" '$1 == s && $2 == k { printf "%s%.2f", (n++ ? ", " : ""), $3 / 1000 }' "$tmp/results.txt"; }
kinds=$(awk '$2 != "writev" { print $2 }' "$tmp/results.txt" | sort -u -t- -k2 -n)
{
	echo "## Host transfer: the chunked pipeline against one writev"
	echo
	echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(bench_machine), at $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $ROUNDS rounds of every case; medians in GB/s (10^9 bytes/s)."
	echo
	echo "| size | case | GB/s | ÷ writev | target ≥ 0.95× | every round |"
	echo "|---|---|---:|---:|---|---|"
	for s in 8MiB 64MiB; do
		w=$(med "$s" writev)
		echo "| $s | writev (before) | $(awk -v x="$w" 'BEGIN { printf "%.2f", x }') | | | $(each "$s" writev) |"
		for k in $kinds; do
			v=$(med "$s" "$k")
			ratio=$(awk -v a="$v" -v b="$w" 'BEGIN { printf "%.2f", a / b }')
			verdict=missed
			awk -v x="$ratio" 'BEGIN { exit !(x >= 0.95) }' && verdict=met
			echo "| $s | $k, depth 3 | $(awk -v x="$v" 'BEGIN { printf "%.2f", x }') | ${ratio}× | $verdict | $(each "$s" "$k") |"
		done
	done
	echo
	echo "- Both cases write into the same Mooncake v2 receiver in the same process over loopback (pooled connection, status frame)."
	echo "- The host source copies nothing: each chunk is a slice of the staged memory, one write(2) per chunk after the 24-byte header."
	bench_noise_note
} >"$OUT"
cat "$OUT"
