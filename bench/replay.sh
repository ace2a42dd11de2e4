#!/usr/bin/env bash
# bench/replay.sh: a duplicate /send answered from the idempotency store
# against the same /send proxied to a fake encoder over loopback and stored.
# Target: replay >= 1.5x the proxied path's speed.
#
# The issue's pair, through the gateway's handler in process
# (gateway/send_bench_test.go):
#   BenchmarkSendReplay      a duplicate /send replayed from the memory store
#   BenchmarkSendProxied     a first /send forwarded and stored; every one goes
#                            to a new destination of the SAME req_id
# and, unless EXTRA=0 (gateway/send_http_bench_test.go):
#   BenchmarkSendProxiedTP2  as BenchmarkSendProxied, but each req_id gets the
#                            two /sends of a TP=2 receiver (sglang's shape)
#   BenchmarkSendReplayHTTP, BenchmarkSendProxiedHTTP
#                            the replay and the TP=2 proxied /send posted by a
#                            keep-alive fasthttp client to the listening gateway
#
# It builds the gateway's test binary once and runs it COUNT times, each run
# doing every benchmark once, so they interleave (R P R P ...); this is
#   go test -run '^$' -bench 'SendReplay|SendProxied' -benchmem -count COUNT ./gateway
# with the runs interleaved instead of grouped. The table shows medians.
#
# Environment:
#   COUNT=5        runs of each benchmark (at least 5 recommended)
#   BENCHTIME=1s   go test -benchtime per run
#   EXTRA=1        also run the TP=2 and client-connection benchmarks
#   QUIET_WAIT=15  seconds to wait, before each run, for the machine to be idle
#                  (other benchmarks or builds); then it measures anyway and says so
#   OUT=bench/results/replay.md
# Takes about COUNT * 12 s plus the build (COUNT * 4 s with EXTRA=0).
set -euo pipefail
# shellcheck source=bench/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
bench_cd_root
bench_need_go

COUNT=${COUNT:-5}
BENCHTIME=${BENCHTIME:-1s}
EXTRA=${EXTRA:-1}
OUT=${OUT:-bench/results/replay.md}
mkdir -p "$(dirname "$OUT")"
benches='BenchmarkSendReplay|BenchmarkSendProxied'
((EXTRA)) && benches+='|BenchmarkSendProxiedTP2|BenchmarkSendReplayHTTP|BenchmarkSendProxiedHTTP'

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

go test -c -o "$tmp/gateway.test" ./gateway
for i in $(seq 1 "$COUNT"); do
	bench_wait_quiet
	echo "replay: run $i/$COUNT" >&2
	(cd gateway && "$tmp/gateway.test" -test.run '^$' -test.bench "^($benches)\$" \
		-test.benchmem -test.count 1 -test.benchtime "$BENCHTIME") >"$tmp/run$i.txt"
	if ! grep -q '^PASS' "$tmp/run$i.txt"; then
		cat "$tmp/run$i.txt" >&2
		echo "replay: run $i failed" >&2
		exit 1
	fi
	grep '^Benchmark' "$tmp/run$i.txt" >&2
	cat "$tmp/run$i.txt" >>"$tmp/raw.txt"
done

# col NAME UNIT: the values of UNIT for benchmark NAME over all runs.
col() { grep -E "^$1(-[0-9]+)?[[:space:]]" "$tmp/raw.txt" | bench_unit "$2"; }
med() { col "$1" "$2" | bench_median; }
# ratio PROXIED REPLAY: "<x>x (met|missed)" for median ns/op.
ratio() {
	awk -v p="$(med "$1" ns/op)" -v r="$(med "$2" ns/op)" 'BEGIN {
		x = p / r; printf "**%.1fx** (target >= 1.5x: %s)", x, ((x >= 1.5) ? "met" : "missed") }'
}
row() { # NAME LABEL
	local ns runs
	ns=$(med "$1" ns/op)
	runs=$(col "$1" ns/op | tr '\n' ' ' | sed 's/ $//; s/ /, /g')
	printf '| %s | %s | %s | %s | %s | %s |\n' "$2" \
		"$(awk -v n="$ns" 'BEGIN { printf "%.0f", n }')" \
		"$(awk -v n="$ns" 'BEGIN { printf "%.0f", 1e9 / n }')" \
		"$(med "$1" B/op)" "$(med "$1" allocs/op)" "$runs"
}

{
	echo "## Replay: duplicate /send from the store vs proxied"
	echo
	echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(bench_machine); $COUNT interleaved runs of \`go test -bench 'SendReplay|SendProxied' -benchmem -benchtime $BENCHTIME ./gateway\`, medians."
	echo
	echo "| path | ns/op | ops/s (one at a time) | B/op | allocs/op | ns/op of each run |"
	echo "|---|---:|---:|---:|---:|---|"
	row BenchmarkSendReplay "duplicate \`/send\` replayed from the memory store, handler in process (\`BenchmarkSendReplay\`)"
	row BenchmarkSendProxied "first \`/send\` proxied to the fake encoder and stored, handler in process, all to one req_id (\`BenchmarkSendProxied\`)"
	if ((EXTRA)); then
		row BenchmarkSendProxiedTP2 "the same, two destinations per req_id (TP=2) (\`BenchmarkSendProxiedTP2\`)"
		row BenchmarkSendReplayHTTP "the replay, posted by a keep-alive client over loopback (\`BenchmarkSendReplayHTTP\`)"
		row BenchmarkSendProxiedHTTP "the TP=2 proxied \`/send\`, posted by a keep-alive client over loopback (\`BenchmarkSendProxiedHTTP\`)"
	fi
	echo
	echo "Replay speed / proxied speed (\`BenchmarkSendProxied\` / \`BenchmarkSendReplay\`): $(ratio BenchmarkSendProxied BenchmarkSendReplay)."
	if ((EXTRA)); then
		echo
		echo "- with TP=2 req_ids (\`BenchmarkSendProxiedTP2\` / \`BenchmarkSendReplay\`): $(ratio BenchmarkSendProxiedTP2 BenchmarkSendReplay)"
		echo "- through a client connection (\`BenchmarkSendProxiedHTTP\` / \`BenchmarkSendReplayHTTP\`): $(ratio BenchmarkSendProxiedHTTP BenchmarkSendReplayHTTP)"
	fi
	echo
	echo "- The in-process pair calls the gateway's handler directly, with no client socket in front of it; the proxied path includes the gateway's loopback round trip to the fake encoder."
	echo "- \`BenchmarkSendProxied\` sends every \`/send\` to a new destination of one req_id, so that req_id collects b.N destinations and each \`/send\` costs more as b.N grows (per-op time rises with -benchtime); the TP=2 variant does not."
	if ((EXTRA)); then
		echo "- The client pair adds one keep-alive fasthttp client posting to the listening gateway over loopback, as a receiver rank would; its B/op and allocs/op count the client too (same process)."
	fi
	echo "- ops/s is 10^9 / ns/op: one request at a time, not the gateway's concurrent capacity."
	bench_noise_note
} >"$OUT"
cat "$OUT"
