#!/usr/bin/env bash
# bench/memory.sh: resident bytes per idempotency record in the gateway's
# memory store at 10^5 and 10^6 records, receiver TP = 1 and 2.
# Target: <= 300 bytes per record.
#
# BenchmarkMemoryRSS (idempotency/rss_bench_test.go) fills the store the way
# the gateway's /send path does (ParseSend on sglang /send bodies, then
# Sends.Do storing the encoder's 200 null), with sglang keys: a 32-hex rid +
# "_local_part_N", destination "10.a.b.c:4xxxx" per TP rank, receive_count =
# TP. It reports (RSS after - RSS before) / records, RSS read from
# /proc/self/statm after runtime.GC and debug.FreeOSMemory, and the same for
# the Go heap in use (HeapInuse). Each measurement is its own process (RSS is
# per process); configurations are interleaved over RUNS runs, medians shown.
#
# Environment:
#   RUNS=3      processes per configuration
#   OUT=bench/results/memory.md
#   QUIET_WAIT=15  seconds to wait, before each process, for the machine to be idle
# Takes about RUNS * 20 s plus the build.
set -euo pipefail
# shellcheck source=bench/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
bench_cd_root
bench_need_go

RUNS=${RUNS:-3}
OUT=${OUT:-bench/results/memory.md}
mkdir -p "$(dirname "$OUT")"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

go test -c -o "$tmp/idempotency.test" ./idempotency
configs=("tp=1/records=100000" "tp=2/records=100000" "tp=1/records=1000000" "tp=2/records=1000000")
: >"$tmp/raw.txt"
for r in $(seq 1 "$RUNS"); do
	for c in "${configs[@]}"; do
		bench_wait_quiet
		echo "memory: run $r/$RUNS $c" >&2
		(cd idempotency && "$tmp/idempotency.test" -test.run '^$' -test.bench "^BenchmarkMemoryRSS\$/^${c%%/*}\$/^${c#*/}\$" \
			-test.benchtime 1x) >"$tmp/out.txt"
		if ! grep -q '^PASS' "$tmp/out.txt"; then
			cat "$tmp/out.txt" >&2
			echo "memory: $c failed" >&2
			exit 1
		fi
		grep '^Benchmark' "$tmp/out.txt" | tee -a "$tmp/raw.txt" >&2
	done
done

# col CONFIG UNIT: that metric over all runs of CONFIG.
col() { grep -F "BenchmarkMemoryRSS/$1-" "$tmp/raw.txt" | bench_unit "$2"; }
{
	echo "## Memory: resident bytes per idempotency record (memory store)"
	echo
	echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(bench_machine); \`BenchmarkMemoryRSS\`, one process per measurement, median of $RUNS."
	echo
	echo "| receiver TP | records | RSS B/record | heap in use B/record | RSS B/record, each run | evictions | target <= 300 B/record |"
	echo "|---:|---:|---:|---:|---|---:|---|"
	for c in "${configs[@]}"; do
		tp=${c%%/*} tp=${tp#tp=} n=${c#*records=}
		rss=$(col "$c" rss-B/record | bench_median)
		heap=$(col "$c" heap-B/record | bench_median)
		ev=$(col "$c" evictions | sort -g | tail -1)
		each=$(col "$c" rss-B/record | tr '\n' ' ' | sed 's/ $//; s/ /, /g')
		if awk -v x="$rss" 'BEGIN { exit !(x <= 300) }'; then t=met; else t=missed; fi
		label=$(awk -v n="$n" 'BEGIN { printf "10^%d", log(n) / log(10) + 0.5 }')
		printf '| %s | %s | %.0f | %.0f | %s | %s | %s |\n' "$tp" "$label" "$rss" "$heap" "$each" "$ev" "$t"
	done
	echo
	echo "- RSS = resident pages from \`/proc/self/statm\` x page size, after \`runtime.GC\` and \`debug.FreeOSMemory\`, before and after the fill; divided by the records held. Heap = \`MemStats.HeapInuse\`, same way."
	echo "- Filled through \`ParseSend\` + \`Sends.Do\` as the gateway's \`/send\` does (the forward answers 200 \`null\`, as the encoder), 4 parts per rid, \`receive_count\` = TP. Capacity is the default 10^6 or 2x the records, whichever is larger (the bound is per shard), so nothing is evicted."
	bench_noise_note
} >"$OUT"
cat "$OUT"
