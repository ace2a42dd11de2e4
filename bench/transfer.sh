#!/usr/bin/env bash
# bench/transfer.sh: gpuagent -> Mooncake receiver over loopback for 1, 8 and
# 64 MiB embeddings, next to a plain Go net.Conn write loop and iperf3, all
# measured in the same run. Target: agent >= 0.95x the Go loop at 8 and 64 MiB.
#
#   (a) agent      BenchmarkAgentTransfer/{1,8,64}MiB (gpuagent/transfer_bench_test.go):
#                  the embedding is staged once over POST /v1/stage, then every
#                  iteration is the agent's real HTTP POST /send from a
#                  keep-alive fasthttp.HostClient, the client the gateway sends
#                  /send with: sglang's checks, allow_networks, the Mooncake TCP
#                  initiator writing into a separate Mooncake receiver (v2,
#                  pooled connection, confirmed by the status frame), 200 null.
#                  No receive_count, so the entry stays staged.
#   (i) initiator  BenchmarkInitiatorWrite/...: mooncake.Initiator.Write alone
#                  (no HTTP, no checks), to show what /send adds.
#   (b) Go loop    BenchmarkNetConnLoop/...: one net.Conn; the sender writes N
#                  bytes, the receiver reads them into one buffer and acks with
#                  1 byte, which the sender waits for.
#   (c) iperf3     iperf3 -s -1 and iperf3 -c 127.0.0.1 -t IPERF_SECONDS -J
#                  (one TCP stream, default 128 KiB writes).
#   (s) side by side  BenchmarkTransferSideBySide/...: a, i and b in one
#                  process, op by op in turn, each timed over its own ops, so
#                  that a change in the machine's load (other processes)
#                  falls on all three alike; a, i and b alone each run for
#                  BENCHTIME seconds apart from the others.
# Each round runs a, i, b, s, c in turn (a i b s c a i b s c ...); the tables
# show the median of the rounds. GB/s = 10^9 bytes/s. The Go benchmarks run on
# GOMAXPROCS = all CPUs, sender and receiver in one process.
#
# Environment:
#   ROUNDS=5            rounds (at least 3)
#   BENCHTIME=1s        go test -benchtime of each Go measurement
#   IPERF_SECONDS=5     iperf3 -t
#   IPERF_PORT=15201    iperf3 port on 127.0.0.1
#   OUT=bench/results/transfer.md
#   QUIET_WAIT=15       seconds to wait, before each measurement, for the machine to
#                       be idle; then it measures anyway and says so in the results
# Takes about ROUNDS * (30 s + IPERF_SECONDS) plus the build, plus up to
# QUIET_WAIT before each of the five measurements of a round.
set -euo pipefail
# shellcheck source=bench/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
bench_cd_root
bench_need_go
bench_apt_install iperf3 iperf3

ROUNDS=${ROUNDS:-5}
BENCHTIME=${BENCHTIME:-1s}
IPERF_SECONDS=${IPERF_SECONDS:-5}
IPERF_PORT=${IPERF_PORT:-15201}
OUT=${OUT:-bench/results/transfer.md}
mkdir -p "$(dirname "$OUT")"
if ((ROUNDS < 3)); then
	echo "transfer: ROUNDS=$ROUNDS; at least 3 are needed for a median" >&2
	exit 1
fi

tmp=$(mktemp -d)
server_pid=
cleanup() {
	if [[ -n $server_pid ]] && kill -0 "$server_pid" 2>/dev/null; then
		kill "$server_pid" 2>/dev/null || true
		wait "$server_pid" 2>/dev/null || true
	fi
	rm -rf "$tmp"
}
trap cleanup EXIT

go test -c -o "$tmp/gpuagent.test" ./gpuagent

# gobench KIND BENCH: one run of the Go benchmark BENCH; appends "KIND SIZE MB/s"
# lines, and "KIND-NAME SIZE value" for each NAME-MB/s metric it reports.
gobench() {
	local kind=$1 bench=$2
	bench_wait_quiet
	(cd gpuagent && "$tmp/gpuagent.test" -test.run '^$' -test.bench "^$bench\$" -test.benchtime "$BENCHTIME" \
		-test.benchmem) >"$tmp/out.txt"
	if ! grep -q '^PASS' "$tmp/out.txt"; then
		cat "$tmp/out.txt" >&2
		echo "transfer: $bench failed" >&2
		exit 1
	fi
	grep '^Benchmark' "$tmp/out.txt" >&2
	grep '^Benchmark' "$tmp/out.txt" | awk -v k="$kind" '{
		split($1, p, "/"); size = p[2]; sub(/-[0-9]+$/, "", size)
		for (i = 2; i <= NF; i++) {
			if ($i == "MB/s") print k, size, $(i - 1)
			else if ($i ~ /-MB\/s$/) { n = $i; sub(/-MB\/s$/, "", n); print k "-" n, size, $(i - 1) }
		}
	}' >>"$tmp/results.txt"
}

# iperf_once: one bounded iperf3 server + client on loopback; writes the
# received bits/s to $tmp/bps (empty when the run failed). Not run in a
# subshell, so the EXIT trap knows the server's pid.
iperf_once() {
	bench_wait_quiet
	timeout $((IPERF_SECONDS + 30)) iperf3 -s -1 -B 127.0.0.1 -p "$IPERF_PORT" >"$tmp/iperf-server.txt" 2>&1 &
	server_pid=$!
	# Wait until the server listens (bounded), so the client's first try counts.
	for _ in $(seq 1 50); do
		if command -v ss >/dev/null 2>&1; then
			ss -Hltn "sport = :$IPERF_PORT" 2>/dev/null | grep -q . && break
		fi
		sleep 0.1
	done
	timeout $((IPERF_SECONDS + 20)) iperf3 -c 127.0.0.1 -p "$IPERF_PORT" -t "$IPERF_SECONDS" -J >"$tmp/iperf.json" 2>&1 || true
	# The one-off server exits after its client; stop it if the client never came.
	for _ in $(seq 1 30); do
		kill -0 "$server_pid" 2>/dev/null || break
		sleep 0.1
	done
	kill "$server_pid" 2>/dev/null || true
	wait "$server_pid" 2>/dev/null || true
	server_pid=
	awk '/"sum_received"/ {s = 1} s && /"bits_per_second"/ { gsub(/[^0-9.eE+-]/, "", $2); if ($2 + 0 > 0) print $2; exit }' "$tmp/iperf.json" >"$tmp/bps"
}

# iperf: one iperf3 measurement (up to 3 tries); appends "iperf3 all MB/s".
iperf() {
	local bps='' try
	for try in 1 2 3; do
		iperf_once
		bps=$(cat "$tmp/bps")
		[[ -n $bps ]] && break
		echo "transfer: iperf3 try $try gave no throughput:" >&2
		grep -i '"error"' "$tmp/iperf.json" >&2 || tail -5 "$tmp/iperf.json" >&2 || true
	done
	if [[ -z $bps ]]; then
		cat "$tmp/iperf-server.txt" >&2
		echo "transfer: iperf3 failed" >&2
		exit 1
	fi
	echo "iperf3: $(awk -v b="$bps" 'BEGIN { printf "%.2f GB/s", b / 8e9 }')" >&2
	awk -v b="$bps" 'BEGIN { printf "iperf3 all %.2f\n", b / 8e6 }' >>"$tmp/results.txt"
}

: >"$tmp/results.txt"
for r in $(seq 1 "$ROUNDS"); do
	echo "transfer: round $r/$ROUNDS" >&2
	gobench agent BenchmarkAgentTransfer
	gobench initiator BenchmarkInitiatorWrite
	gobench goloop BenchmarkNetConnLoop
	gobench side BenchmarkTransferSideBySide
	iperf
done

# gbs KIND SIZE: median GB/s.
gbs() {
	awk -v k="$1" -v s="$2" '$1 == k && $2 == s { print $3 / 1000 }' "$tmp/results.txt" | bench_median
}
# each KIND SIZE: every round's GB/s.
each() {
	awk -v k="$1" -v s="$2" '$1 == k && $2 == s { printf "%s%.2f", (n++ ? ", " : ""), $3 / 1000 }' "$tmp/results.txt"
}
# pairs KIND1 KIND2 SIZE: KIND1 / KIND2 within each round (measured seconds
# apart, so under nearly the same load from the rest of the machine).
pairs() {
	awk -v a="$1" -v b="$2" -v s="$3" '$2 == s && $1 == a { x[++i] = $3 } $2 == s && $1 == b { y[++j] = $3 }
		END { for (k = 1; k <= i && k <= j; k++) printf "%s%.2f", (k > 1 ? ", " : ""), x[k] / y[k] }' "$tmp/results.txt"
}
fmt2() { awk -v x="$1" 'BEGIN { printf "%.2f", x }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }

# target RATIO SIZE: the target column.
target() {
	if [[ $2 == 1MiB ]]; then
		echo "(not a target at 1 MiB)"
	elif awk -v x="$1" 'BEGIN { exit !(x >= 0.95) }'; then
		echo "met"
	else
		echo "missed"
	fi
}

ip=$(gbs iperf3 all)
{
	echo "## Transfer: gpuagent -> Mooncake receiver over loopback"
	echo
	echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(bench_machine); $ROUNDS rounds, each running agent, initiator, Go loop, the three side by side, and iperf3 in turn; medians in GB/s (10^9 bytes/s)."
	echo
	echo "| size | agent \`/send\` | \`Initiator.Write\` alone | Go \`net.Conn\` loop | iperf3 | agent / Go loop | agent / iperf3 | target agent >= 0.95x Go loop |"
	echo "|---|---:|---:|---:|---:|---:|---:|---|"
	for s in 1MiB 8MiB 64MiB; do
		a=$(gbs agent $s) i=$(gbs initiator $s) g=$(gbs goloop $s)
		ag=$(ratio "$a" "$g")
		echo "| $s | $(fmt2 "$a") | $(fmt2 "$i") | $(fmt2 "$g") | $(fmt2 "$ip") | ${ag}x | $(ratio "$a" "$ip")x | $(target "$ag" $s) |"
	done
	echo
	echo "Side by side in one process, op by op in turn (\`BenchmarkTransferSideBySide\`):"
	echo
	echo "| size | agent \`/send\` | \`Initiator.Write\` | Go loop | agent / Go loop | target agent >= 0.95x Go loop |"
	echo "|---|---:|---:|---:|---:|---|"
	for s in 1MiB 8MiB 64MiB; do
		a=$(gbs side-agent $s) i=$(gbs side-initiator $s) g=$(gbs side-goloop $s)
		ag=$(ratio "$a" "$g")
		echo "| $s | $(fmt2 "$a") | $(fmt2 "$i") | $(fmt2 "$g") | ${ag}x | $(target "$ag" $s) |"
	done
	echo
	echo "Every round (GB/s):"
	echo
	echo "| size | agent \`/send\` | \`Initiator.Write\` | Go loop | agent / Go loop, same round |"
	echo "|---|---|---|---|---|"
	for s in 1MiB 8MiB 64MiB; do
		echo "| $s | $(each agent $s) | $(each initiator $s) | $(each goloop $s) | $(pairs agent goloop $s) |"
	done
	for s in 1MiB 8MiB 64MiB; do
		echo "| $s side by side | $(each side-agent $s) | $(each side-initiator $s) | $(each side-goloop $s) | $(pairs side-agent side-goloop $s) |"
	done
	echo "| iperf3 (one stream, ${IPERF_SECONDS} s) | $(each iperf3 all) | | | |"
	echo
	echo "- **agent**: \`BenchmarkAgentTransfer\` (gpuagent/transfer_bench_test.go): staged once over \`POST /v1/stage\`, then each op is the agent's HTTP \`POST /send\` (a keep-alive \`fasthttp.HostClient\`, as the gateway's; all of the agent's checks, no \`receive_count\`), written by the Mooncake TCP initiator into a separate Mooncake receiver (v2, pooled connection, confirmed by the status frame); the benchmark checks the receiver's bytes and write count afterwards."
	echo "- **Initiator.Write**: \`BenchmarkInitiatorWrite\`, the same transfer without HTTP or checks."
	echo "- **Go loop**: \`BenchmarkNetConnLoop\`, one loopback \`net.Conn\`; the sender writes N bytes, the receiver reads them into one buffer and acks 1 byte, which the sender waits for."
	echo "- **side by side**: \`BenchmarkTransferSideBySide\`, the same three paths set up in one process and run op by op in turn (agent, initiator, Go loop; each iteration starts one further along), each path's GB/s over its own ops; a change in the machine's load between seconds falls on all three alike, which the separate runs above (each ${BENCHTIME} long, seconds apart) cannot promise."
	echo "- **iperf3**: \`iperf3 -c 127.0.0.1 -t ${IPERF_SECONDS} -J\` against \`iperf3 -s -1\`, received throughput; it does not depend on the size."
	echo "- Sender and receiver share this machine's CPUs; no pinning."
	bench_noise_note
} >"$OUT"
cat "$OUT"
