#!/usr/bin/env bash
# bench/capacity.sh: the capacity model of the Redis the gateway replicas
# share, measured small.
#
# 1. Round trips per flow (gateway/capacity_test.go,
#    TestRedisRoundTripsPerFlow): two gateway replicas on one loopback
#    redis-server, a redis.Hook (gateway.Deps.RedisHook) on each replica's
#    client recording every command and pipeline. One part at a time: its
#    /encode on replica A, its metadata pull, a GEN0 registration and one
#    /send per receiver rank (TP 2 and 8) on A or B, each /send replayed on
#    the same and on the other replica. The test holds the counts to the
#    targets (it fails if they regress); here it writes its table.
# 2. /send latency, memory store against Redis, side by side
#    (gateway/send_bench_test.go): BenchmarkSendFirstTime (claimed,
#    forwarded to a fake encoder over loopback, stored; TP=2) and
#    BenchmarkSendReplayed (a duplicate), each with sub-benchmarks memory and
#    redis, handler in process; BenchmarkRedisPing is one PING for scale.
#    COUNT interleaved runs, medians.
# 3. Redis CPU per flow (gateway/capacity_bench_test.go, BenchmarkFlowRedis):
#    whole flows (/encode, pull, TP /sends) through 1, 2 and 4 replicas,
#    calls round-robin over them, one flow at a time (conc=1) or 16; the
#    redis-server's CPU (INFO cpu) per flow gives the flows one Redis core
#    carries. COUNT runs, medians.
# 4. For scale: redis-benchmark PING on this machine (50 clients), when
#    redis-benchmark is installed.
#
# Environment:
#   COUNT=3          runs of the latency and CPU benchmarks
#   BENCHTIME=1s     -benchtime of the latency benchmarks
#   FLOWS=1000       flows per BenchmarkFlowRedis run (-benchtime FLOWSx)
#   REDIS_PORT=19390 loopback port of the redis-benchmark reference server
#   QUIET_WAIT=15    seconds to wait, before each run, for the machine to be idle
#   OUT=bench/results/capacity.md
# Takes about COUNT * 90 s plus the build.
set -euo pipefail
# shellcheck source=bench/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
bench_cd_root
bench_need_go

COUNT=${COUNT:-3}
BENCHTIME=${BENCHTIME:-1s}
FLOWS=${FLOWS:-1000}
REDIS_PORT=${REDIS_PORT:-19390}
OUT=${OUT:-bench/results/capacity.md}
mkdir -p "$(dirname "$OUT")"
command -v redis-server >/dev/null 2>&1 || { echo "capacity: redis-server is not installed" >&2; exit 1; }

tmp=$(mktemp -d)
rpid=
cleanup() {
	[[ -n $rpid ]] && bench_stop "$rpid"
	rm -rf "$tmp"
}
trap cleanup EXIT

git_v=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[[ -n $(git status --porcelain -- '*.go' 2>/dev/null) ]] && git_v+=" (with uncommitted changes)"

go test -c -o "$tmp/gateway.test" ./gateway

echo "capacity: round trips per flow" >&2
(cd gateway && ENCGATE_CAPACITY_OUT="$tmp/flows.md" "$tmp/gateway.test" -test.run '^TestRedisRoundTripsPerFlow$' -test.count 1) >"$tmp/flows.txt" 2>&1 || {
	cat "$tmp/flows.txt" >&2
	echo "capacity: TestRedisRoundTripsPerFlow failed: a count regressed" >&2
	exit 1
}

: >"$tmp/raw.txt"
for i in $(seq 1 "$COUNT"); do
	bench_wait_quiet
	echo "capacity: latency run $i/$COUNT" >&2
	(cd gateway && "$tmp/gateway.test" -test.run '^$' -test.bench '^(BenchmarkSendFirstTime|BenchmarkSendReplayed|BenchmarkRedisPing)$' \
		-test.benchmem -test.count 1 -test.benchtime "$BENCHTIME") >"$tmp/lat$i.txt" 2>&1
	grep -q '^PASS' "$tmp/lat$i.txt" || { cat "$tmp/lat$i.txt" >&2; exit 1; }
	grep '^Benchmark' "$tmp/lat$i.txt" | tee -a "$tmp/raw.txt" >&2
	bench_wait_quiet
	echo "capacity: flow run $i/$COUNT" >&2
	(cd gateway && "$tmp/gateway.test" -test.run '^$' -test.bench '^BenchmarkFlowRedis$' \
		-test.count 1 -test.benchtime "${FLOWS}x") >"$tmp/flow$i.txt" 2>&1
	grep -q '^PASS' "$tmp/flow$i.txt" || { cat "$tmp/flow$i.txt" >&2; exit 1; }
	grep '^Benchmark' "$tmp/flow$i.txt" | tee -a "$tmp/raw.txt" >&2
done

# redis-benchmark reference: a redis-server as the tests start it.
ping_line=
if command -v redis-benchmark >/dev/null 2>&1; then
	if bench_listening "$REDIS_PORT"; then
		echo "capacity: port $REDIS_PORT is taken; skipping redis-benchmark (set REDIS_PORT)" >&2
	else
		redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
			--logfile '' --dir "$tmp" >/dev/null 2>&1 &
		rpid=$!
		for _ in $(seq 100); do bench_listening "$REDIS_PORT" && break; sleep 0.05; done
		rcpu() { redis-cli -p "$REDIS_PORT" info cpu | awk -F: '/^used_cpu_(user|sys):/ { s += $2 } END { printf "%.6f", s }'; }
		bench_wait_quiet
		c0=$(rcpu)
		rps=$(redis-benchmark -p "$REDIS_PORT" -q -n 200000 -c 50 -t ping_mbulk 2>/dev/null | tr '\r' '\n' |
			awk '/requests per second/ { for (i = 1; i <= NF; i++) if ($i == "requests") print $(i - 1) }' | tail -1)
		c1=$(rcpu)
		ping_line=$(awk -v r="$rps" -v a="$c0" -v b="$c1" 'BEGIN {
			printf "redis-benchmark on this machine, PING, 50 clients, no pipelining: %.0f requests/s, %.1f us of redis-server CPU each", r, (b - a) * 1e6 / 200000 }')
		bench_stop "$rpid"
		rpid=
	fi
fi

# col NAME UNIT: the values of UNIT for benchmark NAME over all runs.
col() { grep -E "^$1(-[0-9]+)?[[:space:]]" "$tmp/raw.txt" | bench_unit "$2"; }
med() { col "$1" "$2" | bench_median; }
fmt() { awk -v n="$1" -v f="$2" 'BEGIN { if (n == "n/a") print n; else printf f, n }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1fx", a / b }'; }

{
	echo "## Capacity: what a flow costs the shared Redis"
	echo
	echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(bench_machine), encgate $git_v; generated by \`bash bench/capacity.sh\` (COUNT=$COUNT, FLOWS=$FLOWS)."
	echo
	echo "### Round trips per flow"
	echo
	echo "Counted by a \`redis.Hook\` on each replica's client (\`TestRedisRoundTripsPerFlow\`, which fails if any count below regresses). Two replicas, A and B, on one loopback Redis; a flow is one part: its \`/encode\` on A, then its follow-ups. \"Before the forward\": the round trips made before the \`/send\` reached the encoder (noted by a proxy in front of the fake encoders). With the memory store a gateway has no Redis client at all (its pins and registry are in process too), so every call there costs 0. Warm: the scripts are in Redis and the pools hold their connections (the first flow on a fresh Redis is counted below the table)."
	echo
	cat "$tmp/flows.md"
	echo
	echo "### /send latency, memory store against Redis"
	echo
	echo "Handler in process, one fake encoder over loopback, a redis-server on loopback on the same machine; $COUNT interleaved runs, medians."
	echo
	echo "| /send | memory ns/op | redis ns/op | redis / memory | redis - memory | redis round trips per /send | allocs/op memory / redis |"
	echo "|---|---:|---:|---:|---:|---:|---|"
	for b in FirstTime Replayed; do
		m=$(med "BenchmarkSend$b/memory" ns/op)
		r=$(med "BenchmarkSend$b/redis" ns/op)
		label=$([[ $b == FirstTime ]] && echo "first time (claim, forward, complete; TP=2)" || echo "replayed (claim finds the record)")
		printf '| %s (`BenchmarkSend%s`) | %s | %s | %s | %s | %s | %s / %s |\n' "$label" "$b" "$(fmt "$m" %.0f)" "$(fmt "$r" %.0f)" \
			"$(ratio "$r" "$m")" "$(awk -v a="$r" -v b="$m" 'BEGIN { printf "%.0f ns", a - b }')" \
			"$(med "BenchmarkSend$b/redis" redis-rtt/op)" "$(med "BenchmarkSend$b/memory" allocs/op)" "$(med "BenchmarkSend$b/redis" allocs/op)"
	done
	echo
	echo "- One \`PING\` through a client built as the gateway's (\`BenchmarkRedisPing\`): $(fmt "$(med BenchmarkRedisPing ns/op)" %.0f) ns. Every round trip of the redis column costs about that, plus the script's own run."
	echo "- ns/op of each run: first time memory $(col BenchmarkSendFirstTime/memory ns/op | tr '\n' ' ' | sed 's/ $//'), redis $(col BenchmarkSendFirstTime/redis ns/op | tr '\n' ' ' | sed 's/ $//'); replayed memory $(col BenchmarkSendReplayed/memory ns/op | tr '\n' ' ' | sed 's/ $//'), redis $(col BenchmarkSendReplayed/redis ns/op | tr '\n' ' ' | sed 's/ $//')."
	echo
	echo "### Redis CPU per flow, and the flows one Redis core carries"
	echo
	echo "\`BenchmarkFlowRedis\`: $FLOWS flows per run, each an \`/encode\`, its metadata pull and TP \`/send\`s, every call on the next replica in turn (round-robin), through replicas whose handlers run in this process; \`conc\` flows at a time. Redis CPU is the redis-server process's (INFO cpu: user + sys) over the run, divided by the flows: every command, its socket reads and writes, and each placement's delivery to every subscribed replica. Flows/s per core = 10^6 / that: the rate at which one shard's one thread would be busy all the time. Medians of $COUNT runs."
	echo
	echo "| conc | TP | replicas | round trips / flow | Redis CPU us / flow | us per round trip | flows/s per Redis core | flows/s per core, each run |"
	echo "|---:|---:|---:|---:|---:|---:|---:|---|"
	for conc in 1 16; do
		for tp in 2 8; do
			for rep in 1 2 4; do
				n="BenchmarkFlowRedis/conc=$conc/tp=$tp/replicas=$rep"
				rtt=$(med "$n" redis-rtt/flow)
				cpu=$(med "$n" redis-cpu-us/flow)
				printf '| %s | %s | %s | %s | %s | %s | %s | %s |\n' "$conc" "$tp" "$rep" "$(fmt "$rtt" %.2f)" "$(fmt "$cpu" %.0f)" \
					"$(awk -v c="$cpu" -v r="$rtt" 'BEGIN { printf "%.0f", c / r }')" "$(fmt "$(med "$n" flows/s-per-core)" %.0f)" \
					"$(col "$n" flows/s-per-core | awk '{ printf "%s%.0f", (NR > 1 ? ", " : ""), $1 }')"
			done
		done
	done
	echo
	[[ -n $ping_line ]] && echo "- $ping_line."
	echo "- Round trips per flow grow with replicas only by pin reads: a replica reads a part's pin once, at its first follow-up of that part, when another replica placed it (round-robin over R replicas sends TP + 1 follow-ups to min(R - 1, TP + 1) replicas other than the /encode's). With conc > 1 the calls of different flows interleave, so fewer follow-ups land on a new replica."
	echo "- Redis CPU per flow grows with replicas by those reads and by the placement's PUBLISH, which Redis writes to every subscribed replica."
	echo "- This machine's redis-server shares 2 cores with the benchmark's client and gateways (and whatever else runs); the per-core figure counts only redis-server's own CPU time."
	bench_noise_note
} >"$OUT"
cat "$OUT"
