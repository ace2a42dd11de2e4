#!/usr/bin/env bash
# bench/affinity.sh: content affinity for encoder media caches,
# affinity.encode_by req_id vs content.
#
# A multi-turn chat re-sends its earlier turns' images with every turn, and
# an sglang encoder started with --enable-prefix-mm-cache answers media it
# has encoded before without running the model. Placed by req_id (a fresh
# one each turn), a re-sent image lands on a random encoder; placed by
# content (rendezvous on the mm_items bytes, bounded load), on the one that
# has it. Per run:
#   1. four `encgate fake-encoder`s (--cache-items 100000: a hit skips
#      --encode-latency; cache_hits/cache_misses in GET /_fake/stats) and an
#      `encgate gateway` in front of them (defaults, health checks included,
#      but log level warn and affinity.encode_by MODE), all freshly started
#      (cold caches, no pins);
#   2. bench/affinityclient runs CONVERSATIONS conversations at once, TURNS
#      turns each; turn t posts one /encode per image 0..t of its
#      conversation (part_idx k of num_parts t+1, mm_items [that image's
#      URL], a fresh req_id per turn and part), all parts of a turn at once,
#      the next turn once they answered. The fake's cache keys the whole
#      mm_items value, so a re-sent image hits exactly when it reaches an
#      encoder that encoded it before (sglang's cache, per item, hits the
#      same way);
#   3. the fakes' cache_hits / cache_misses deltas, the client's /encode
#      latencies and the X-Encgate-Encoder of each answer give the hit rate,
#      p50/p99 latency and per-encoder load. The client checks that the
#      fakes' hits are exactly the re-sent /encodes that reached an encoder
#      which had encoded the image, and every /encode must answer 200, or
#      the run FAILs.
# Modes alternate (req_id content req_id ...) for ROUNDS rounds; medians.
#
# Usage:  bash bench/affinity.sh
# Environment (defaults in brackets):
#   CONVERSATIONS  conversations at once                           [64]
#   TURNS          turns per conversation                          [6]
#   LATENCY        the fakes' --encode-latency (a cache miss)      [20ms]
#   LOAD_FACTOR    affinity.load_factor for the content runs       [1.25]
#   ROUNDS         rounds (each runs both modes)                   [5]
#   PORT_BASE      first of 6 loopback ports (4 fakes, gateway,
#                  gateway admin)                                  [19300]
#   RESULTS        markdown output file      [bench/results/affinity.md]
#   KEEP_TMP       1 keeps the temporary directory (configs, logs) [0]
#   QUIET_WAIT     seconds to wait for a quiet machine before each run [15]
# A default run takes about a minute after the build, on 2 cores.
# Traffic goes only to 127.0.0.1. Every process the script starts is stopped
# on exit (trap), and it checks that none of its ports is left listening.
set -euo pipefail
# shellcheck source=bench/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
bench_cd_root
bench_need_go
ROOT=$PWD

CONVERSATIONS=${CONVERSATIONS:-64} TURNS=${TURNS:-6} LATENCY=${LATENCY:-20ms}
LOAD_FACTOR=${LOAD_FACTOR:-1.25} ROUNDS=${ROUNDS:-5}
PORT_BASE=${PORT_BASE:-19300} KEEP_TMP=${KEEP_TMP:-0}
RESULTS=${RESULTS:-$ROOT/bench/results/affinity.md}
NFAKES=4

die() { echo "affinity.sh: FAIL: $*" >&2; exit 1; }
trap 'echo "affinity.sh: FAIL: unexpected error (exit $?) at line $LINENO: $BASH_COMMAND" >&2' ERR
log() { echo "== $*" >&2; }

for v in CONVERSATIONS TURNS ROUNDS PORT_BASE; do [[ ${!v} =~ ^[0-9]+$ ]] || die "$v must be a whole number, got '${!v}'"; done
((CONVERSATIONS >= 1 && CONVERSATIONS <= 1000)) || die "CONVERSATIONS must be 1..1000"
((TURNS >= 2 && TURNS <= 20)) || die "TURNS must be 2..20 (one turn re-sends nothing)"
((ROUNDS >= 1 && ROUNDS <= 9)) || die "ROUNDS must be 1..9"
[[ $LATENCY =~ ^[0-9]+(ms|s)$ ]] || die "LATENCY must be like 20ms, got '$LATENCY'"
[[ $LOAD_FACTOR =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "LOAD_FACTOR must be a number, got '$LOAD_FACTOR'"
# Every part of every conversation may be in flight at once.
ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)"
(($(ulimit -n) >= 4 * CONVERSATIONS * TURNS + 512)) || die "RLIMIT_NOFILE $(ulimit -n) is too small for $CONVERSATIONS x $TURNS parts in flight"
bench_apt_install curl curl

PORTS=() FAKE_PORTS=()
for ((i = 0; i < NFAKES; i++)); do FAKE_PORTS+=($((PORT_BASE + i))); done
P_GW=$((PORT_BASE + NFAKES)) P_ADMIN=$((PORT_BASE + NFAKES + 1))
PORTS=("${FAKE_PORTS[@]}" "$P_GW" "$P_ADMIN")
for p in "${PORTS[@]}"; do bench_listening "$p" && die "port $p on 127.0.0.1 is in use; set PORT_BASE to a free range"; done

TMP=$(mktemp -d /tmp/encgate-affinitybench.XXXXXX)
FAKE_PIDS=() GW_PID=
cleanup() {
  local rc=$?
  # shellcheck disable=SC2086 # empty pids drop out
  bench_stop $GW_PID "${FAKE_PIDS[@]}"
  bench_ports_free affinity.sh "${PORTS[@]}" || rc=1
  if [ "$KEEP_TMP" = 1 ] || ((rc != 0)); then echo "affinity.sh: logs and configs kept in $TMP" >&2; else rm -rf "$TMP"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
wait_port() { for _ in $(seq 100); do bench_listening "$1" && return 0; sleep 0.1; done; die "$2 did not listen on 127.0.0.1:$1 within 10 s (logs in $TMP)"; }

START=$SECONDS
log "building encgate and bench/affinityclient"
go build -o "$TMP/encgate" . || die "go build failed"
go build -o "$TMP/affinityclient" ./bench/affinityclient || die "go build ./bench/affinityclient failed"

gateway_config() { # mode -> $TMP/gateway-MODE.yaml
  {
    echo "# written by bench/affinity.sh: defaults but for the log level and the placement"
    echo "listen: \"127.0.0.1:$P_GW\""
    echo "admin_listen: \"127.0.0.1:$P_ADMIN\""
    echo "encoders:"
    for ((i = 0; i < NFAKES; i++)); do
      echo "  - name: fake-$i"
      echo "    url: \"http://127.0.0.1:${FAKE_PORTS[$i]}\""
    done
    echo "affinity:"
    echo "  encode_by: $1"
    echo "  load_factor: $LOAD_FACTOR"
    echo "log:"
    echo "  level: warn"
  } >"$TMP/gateway-$1.yaml"
  "$TMP/encgate" gateway --config "$TMP/gateway-$1.yaml" --check >"$TMP/gw-check-$1.log" 2>&1 ||
    { cat "$TMP/gw-check-$1.log" >&2; die "gateway config for $1 refused"; }
}
gateway_config req_id
gateway_config content

FAKES_ARG=
for ((i = 0; i < NFAKES; i++)); do FAKES_ARG+="${FAKES_ARG:+,}fake-$i=127.0.0.1:${FAKE_PORTS[$i]}"; done

RAW=$TMP/raw.tsv # mode round, then the client's columns
: >"$RAW"
FAILS=()
measure() { # mode round
  local mode=$1 r=$2 i
  FAKE_PIDS=()
  for ((i = 0; i < NFAKES; i++)); do
    GOMAXPROCS=1 "$TMP/encgate" fake-encoder --listen "127.0.0.1:${FAKE_PORTS[$i]}" --name "fake-$i" \
      --cache-items 100000 --encode-latency "$LATENCY" >"$TMP/fake-$i-$mode-$r.log" 2>&1 &
    FAKE_PIDS+=($!)
  done
  for ((i = 0; i < NFAKES; i++)); do wait_port "${FAKE_PORTS[$i]}" "fake-$i"; done
  "$TMP/encgate" gateway --config "$TMP/gateway-$mode.yaml" >"$TMP/gateway-$mode-$r.log" 2>&1 &
  GW_PID=$!
  wait_port "$P_GW" "encgate gateway"
  wait_port "$P_ADMIN" "encgate admin"
  for _ in $(seq 100); do curl -sf -o /dev/null "http://127.0.0.1:$P_GW/health" && break; sleep 0.1; done
  bench_wait_quiet
  if "$TMP/affinityclient" -addr "127.0.0.1:$P_GW" -fakes "$FAKES_ARG" -conversations "$CONVERSATIONS" -turns "$TURNS" \
    -prefix "$mode-r$r-" >"$TMP/client-$mode-$r.out" 2>"$TMP/client-$mode-$r.err"; then
    :
  else
    FAILS+=("$mode round $r: $(tail -3 "$TMP/client-$mode-$r.err" | paste -sd';')")
  fi
  cat "$TMP/client-$mode-$r.err" >&2
  if [[ $(wc -l <"$TMP/client-$mode-$r.out") -eq 2 ]]; then
    printf '%s\t%s\t%s\n' "$mode" "$r" "$(tail -1 "$TMP/client-$mode-$r.out")" >>"$RAW"
  else
    FAILS+=("$mode round $r: no result line from affinityclient")
  fi
  if [[ -s $TMP/gateway-$mode-$r.log ]]; then
    log "$mode round $r: the gateway logged $(wc -l <"$TMP/gateway-$mode-$r.log") lines at warn and above:"
    awk 'NR <= 5' "$TMP/gateway-$mode-$r.log" >&2
  fi
  # shellcheck disable=SC2086
  bench_stop $GW_PID "${FAKE_PIDS[@]}"
  GW_PID= FAKE_PIDS=()
}

for ((round = 1; round <= ROUNDS; round++)); do
  for mode in req_id content; do
    log "round $round: encode_by $mode"
    measure "$mode" "$round"
  done
done

# ---------------------------------------------------------------- report
# RAW columns: 1 mode 2 round 3 encodes 4 images 5 resent 6 hits 7 misses
# 8 predicted 9 first 10 first_hits 11 p50_ms 12 p99_ms 13 per_encoder
# 14 count_ratio 15 load_ratio 16 peak 17 wall_s 18 failed
med() { # mode awk-expression -> the median over the mode's rounds
  awk -F'\t' -v m="$1" '$1 == m { print '"$2"' }' "$RAW" | bench_median
}
each() { # mode awk-expression -> the rounds' values
  awk -F'\t' -v m="$1" '$1 == m { printf "%s%.3f", (n++ ? ", " : ""), '"$2"' }' "$RAW"
}
num() { awk -v x="$1" -v f="${2:-%.3f}" 'BEGIN { if (x == "n/a") print x; else printf f, x }'; }
HIT='($6 + $7 > 0 ? $6 / ($6 + $7) : 0)'
RESENT_HIT='($5 > 0 ? $6 / $5 : 0)'
FIRST_HIT='($9 > 0 ? $10 / $9 : 0)'
# Placed at random (a fresh req_id's owner), the j-th re-send of an image
# hits with probability 1 - (1 - 1/N)^j; image i of a conversation is sent
# TURNS - i times.
CHANCE=$(awk -v t="$TURNS" -v n="$NFAKES" 'BEGIN {
  for (i = 0; i < t; i++) for (j = 1; j < t - i; j++) { s += 1 - (1 - 1 / n) ^ j; c++ }
  printf "%.3f", s / c }')
CEILING=$(awk -v t="$TURNS" 'BEGIN { printf "%.3f", (t - 1) / (t + 1) }') # re-sent / all: sum(t-i-1) / sum(t-i)
table=$TMP/table.md
{
  echo "| encode_by | /encodes | cache hit rate | hit rate, re-sent images | hit rate, second sends | p50 /encode ms | p99 /encode ms | /encodes per encoder (round 1) | busiest / mean, /encodes | busiest / mean, load | peak in flight on one encoder |"
  echo "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"
  for mode in req_id content; do
    per=$(awk -F'\t' -v m="$mode" '$1 == m && $2 == 1 { gsub(",", ", ", $13); print $13 }' "$RAW")
    printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$mode" \
      "$(num "$(med "$mode" '$3')" %.0f)" "$(num "$(med "$mode" "$HIT")")" "$(num "$(med "$mode" "$RESENT_HIT")")" \
      "$(num "$(med "$mode" "$FIRST_HIT")")" "$(num "$(med "$mode" '$11')" %.2f)" "$(num "$(med "$mode" '$12')" %.2f)" \
      "${per:-n/a}" "$(num "$(med "$mode" '$14')" %.2f)" "$(num "$(med "$mode" '$15')" %.2f)" "$(num "$(med "$mode" '$16')" %.0f)"
  done
  echo
  verdict() { awk -v x="$1" -v op="$2" -v y="$3" 'BEGIN { if (x == "n/a") { print "n/a"; exit }
    ok = (op == ">=" ? x >= y : x <= y); print (ok ? "met" : "**missed**") }'; }
  c_hit=$(med content "$RESENT_HIT") r_hit=$(med req_id "$RESENT_HIT") r_first=$(med req_id "$FIRST_HIT")
  c_load=$(med content '$15') c_count=$(med content '$14')
  echo "| target | value | |"
  echo "|---|---:|---|"
  echo "| content: hit rate on re-sent images >= 0.9 | $(num "$c_hit") | $(verdict "$c_hit" ">=" 0.9) |"
  echo "| content: busiest encoder's load <= $LOAD_FACTOR x the mean | $(num "$c_load" %.2f) | $(verdict "$c_load" "<=" "$LOAD_FACTOR") |"
  echo "| req_id: hit rate on second sends ≈ 1/N = $(num "$(awk -v n=$NFAKES 'BEGIN { print 1 / n }')" %.2f) | $(num "$r_first") | (by chance) |"
  echo "| req_id: hit rate on re-sent images ≈ $CHANCE (chance: the j-th re-send hits with 1 - (1 - 1/N)^j) | $(num "$r_hit") | (by chance) |"
  echo
  echo "- The cache hit rate counts every /encode, first sends included, so it cannot pass (TURNS - 1) / (TURNS + 1) = $CEILING here: each conversation's $TURNS images are sent $((TURNS * (TURNS + 1) / 2)) times, $TURNS of them first sends (misses whatever the placement). The hit rate on re-sent images is the issue's measure: how often media sent before found its cache."
  echo "- Per round, hit rate on re-sent images: req_id $(each req_id "$RESENT_HIT"); content $(each content "$RESENT_HIT"). p50 ms: req_id $(each req_id '$11'); content $(each content '$11'). Busiest / mean load: req_id $(each req_id '$15'); content $(each content '$15'). Busiest / mean /encodes: content $(each content '$14') (median $(num "$c_count" %.2f))."
  echo "- Load is each encoder's mean /encodes in flight over the run (the time its /encodes took, summed, over the wall time), client side; bounded load acts on the gateway's in-flight count at each placement. The /encode counts per encoder follow the images' hashes (an early image is sent up to $TURNS times), which bounded load does not even out unless an encoder is busy."
  bench_noise_note
} >"$table"

git_v=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD -- . ':!bench' 2>/dev/null || git_v="$git_v (with uncommitted changes)"
mkdir -p "$(dirname "$RESULTS")"
{
  echo "# Content affinity: encoder media cache hits, encode_by req_id vs content"
  echo
  echo "Generated by \`CONVERSATIONS=$CONVERSATIONS TURNS=$TURNS ROUNDS=$ROUNDS bash bench/affinity.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC'); $(bench_machine)."
  echo
  echo "$NFAKES \`encgate fake-encoder\`s (--cache-items 100000, --encode-latency $LATENCY: a cache hit skips the latency) behind one \`encgate gateway\`, all freshly started for each run. $CONVERSATIONS conversations at once, $TURNS turns each: turn t posts one /encode per image 0..t of its conversation, all at once (part_idx k of num_parts t+1, mm_items one image URL, a fresh req_id per turn and part), the next turn once they answered; $((CONVERSATIONS * TURNS * (TURNS + 1) / 2)) /encodes per run, $((CONVERSATIONS * TURNS)) distinct images. Hits and misses are the fakes' /_fake/stats deltas (checked against the encoders the answers name); latency is the client's. Modes alternate for $ROUNDS round(s); medians."
  echo
  echo "- versions: encgate $git_v, $(go version | awk '{print $3}')"
  echo "- encgate: defaults (health checks included), log level warn, affinity.encode_by as the row says, affinity.load_factor $LOAD_FACTOR"
  echo
  cat "$table"
} >"$RESULTS"
echo; cat "$table"; echo
log "written to $RESULTS; took $((SECONDS - START)) s"
((${#FAILS[@]} == 0)) || die "$(IFS=';'; echo "${FAILS[*]}")"
