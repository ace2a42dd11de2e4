#!/usr/bin/env bash
# bench/held.sh: memory per held metadata pull, encgate vs nginx vs HAProxy,
# and the latency each adds to a held pull's answer.
#
# sglang receivers pull POST /scheduler_receive_meta_data, which the encoder
# holds until the part's metadata is published (up to 180 s), so a proxy in
# front of encoders holds one client and one upstream connection per pull.
# One `encgate fake-encoder` (--metadata-timeout 1h: it holds a pull whose
# req_id has no /encode yet) is started once; in front of it, in turn, a
# fresh encgate (built here; defaults but log level warn and connection
# limits raised to fit N), the same with limits.park_long_polls: false
# ("encgate (unparked)": a goroutine per held pull, as before parked
# exchanges), nginx (1 worker) and HAProxy (nbthread 1); and "direct", no
# proxy: the clients talk to the fake (no RSS figures; the latency baseline).
# For each:
#   1. RSS before: VmRSS summed over the proxy's processes (nginx master +
#      worker) from /proc/PID/status, after start and a quiet-machine check;
#   2. bench/heldclient opens N connections through the proxy, each with one
#      pull for its own req_id (held-<proxy>-<i>);
#   3. waits until the fake holds all N (its /_fake/stats "waiting" count;
#      encgate first holds an unpinned follow-up affinity.unknown_wait, 5 s);
#   4. RSS with N held, once two readings 1 s apart agree within 1%
#      (SETTLE s after the count reached N): (after - before) / N bytes each;
#      for encgate also a heap profile and the goroutine count (log only);
#   5. release: heldclient POSTs /encode for every req_id straight to the
#      fake; every held client must then get 200 with its req_id and an
#      embedding_size, or the run FAILs (nothing may be dropped to save memory).
#      The release measures latency, not a queue: RELEASE_C workers (1 by
#      default: one pull at a time) each take the next req_id, read the clock
#      (t0) just before writing its /encode, and wait for that pull's answer
#      before the next; t1 is when the pull's client has read the answer's
#      whole body (one process, one monotonic clock). Latency = t1 - t0: the
#      fake's publish plus the answer's way back through the proxy. p50 and
#      p99 over the N pulls are reported raw and as added by the proxy: its
#      p50 (p99) minus direct's p50 (p99) (a difference of percentiles, not a
#      percentile of differences).
# Fake and proxy are pinned to core 0, the client to core 1 (taskset), all
# GOMAXPROCS=1. ROUNDS > 1 interleaves (direct encgate encgate-unparked
# nginx haproxy direct ...), each round a fresh proxy process and fresh
# req_ids; medians shown (latency: the median of the rounds' p50s, p99s).
#
# Usage:  N=4000 bash bench/held.sh      (root, or sudo for the apt-get step)
# Environment (defaults in brackets):
#   N            held pulls per proxy, at most 8000, or 16000 for rows
#                whose descriptors fit RLIMIT_NOFILE 20000: direct, and
#                encgate with TP >= 2 (N client connections and N/TP to
#                the fake); nginx and HAProxy need 2N                [4000]
#   TP           pulls per req_id, as a part's receiver TP ranks each
#                pull its metadata; N must be a multiple. encgate sends
#                one per part to the fake (affinity.metadata_cache), the
#                others wait for it; nginx and HAProxy send all N       [1]
#   ROUNDS       rounds (each runs the three proxies)                [1]
#   SETTLE       seconds between "all N held" and the RSS readings   [2]
#   HOLD         extra seconds to hold before the release            [0]
#                (over ~25, encgate's metadata per_try_timeout of 30 s
#                ends tries, and past the retry budget clients get 504)
#   UNKNOWN_WAIT encgate's affinity.unknown_wait: an unpinned pull waits
#                that long for a pin (parked) before it is forwarded; /encode goes straight to the
#                fake here, so every pull is unpinned  [unset: the 5s default]
#   RELEASE_C    pulls released at once (each worker waits for its
#                pull's answer before the next)                      [1]
#   ARRIVE_C     the client's connections being opened at once: 32
#                makes the pulls arrive as a burst (a 504 storm); 1
#                paces them, so a proxy holds what a held pull costs
#                rather than what a burst of arrivals costs in passing [32]
#   PORT_BASE    first of 5 loopback ports (fake, encgate, encgate
#                admin, nginx, haproxy)                              [19200]
#   RESULTS      markdown output file              [bench/results/held.md]
#   KEEP_TMP     1 keeps the temporary directory (configs, logs, heap
#                profiles)                                           [0]
#   QUIET_WAIT   seconds to wait for a quiet machine before each proxy [15]
#   PROXIES      which rows to run, in order
#                [direct encgate encgate-unparked nginx haproxy]
#                (a subset is for iterating; the table's ratios need all,
#                the added latency needs direct)
# A default run takes about two minutes after the build.
# Traffic goes only to 127.0.0.1. Every process the script starts is stopped
# on exit (trap), and it checks that none of its ports is left listening.
set -euo pipefail
# shellcheck source=bench/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
bench_cd_root
bench_need_go
ROOT=$PWD

N=${N:-4000} TP=${TP:-1} ROUNDS=${ROUNDS:-1} SETTLE=${SETTLE:-2} HOLD=${HOLD:-0} RELEASE_C=${RELEASE_C:-1} ARRIVE_C=${ARRIVE_C:-32}
((TP >= 1 && N % TP == 0)) || { echo "held.sh: N=$N is not a multiple of TP=$TP" >&2; exit 2; }
PORT_BASE=${PORT_BASE:-19200} KEEP_TMP=${KEEP_TMP:-0}
RESULTS=${RESULTS:-$ROOT/bench/results/held.md} UNKNOWN_WAIT=${UNKNOWN_WAIT:-}

die() { echo "held.sh: FAIL: $*" >&2; exit 1; }
trap 'echo "held.sh: FAIL: unexpected error (exit $?) at line $LINENO: $BASH_COMMAND" >&2' ERR
log() { echo "== $*" >&2; }

for v in N ROUNDS SETTLE HOLD RELEASE_C ARRIVE_C PORT_BASE; do [[ ${!v} =~ ^[0-9]+$ ]] || die "$v must be a whole number, got '${!v}'"; done
((N >= 1 && N <= 16000)) || die "N must be 1..16000"
read -r -a PROXIES <<<"${PROXIES:-direct encgate encgate-unparked nginx haproxy}"
((ROUNDS >= 1 && ROUNDS <= 9)) || die "ROUNDS must be 1..9"
((RELEASE_C >= 1 && RELEASE_C <= 64)) || die "RELEASE_C must be 1..64"
[[ -z $UNKNOWN_WAIT || $UNKNOWN_WAIT =~ ^[0-9]+(ms|s)$ ]] || die "UNKNOWN_WAIT must be a duration like 0s, 100ms or 5s, got '$UNKNOWN_WAIT'"
ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)"
# What each row holds open: the proxy's N client connections and its
# connections to the fake (N for nginx and HAProxy; N/TP for encgate, which
# forwards one pull per part), plus some to spare; direct, the fake's N.
for px in "${PROXIES[@]}"; do
  case $px in
  direct) fds=$((N + 1200)) ;;
  encgate*) fds=$((N + N / TP + 1200)) ;;
  *) fds=$((2 * N + 1200)) ;;
  esac
  (($(ulimit -n) >= fds)) || die "RLIMIT_NOFILE $(ulimit -n) is too small for $px with N=$N TP=$TP: it holds about $fds descriptors (raise the hard limit, or leave $px out of PROXIES)"
done

export PATH="$PATH:/usr/sbin:/sbin"
for cp in nginx:nginx haproxy:haproxy curl:curl taskset:util-linux ss:iproute2; do bench_apt_install "${cp%%:*}" "${cp#*:}"; done
((NPROC = $(nproc))) && ((NPROC >= 2)) || die "needs 2 cores (proxy + fake on core 0, client on core 1)"
SRV="taskset -c 0" CLI="taskset -c 1"

P_FAKE=$PORT_BASE P_GW=$((PORT_BASE + 1)) P_ADMIN=$((PORT_BASE + 2)) P_NGINX=$((PORT_BASE + 3)) P_HAP=$((PORT_BASE + 4))
PORTS=("$P_FAKE" "$P_GW" "$P_ADMIN" "$P_NGINX" "$P_HAP")
declare -A PORT_OF=([direct]=$P_FAKE [encgate]=$P_GW [encgate-unparked]=$P_GW [nginx]=$P_NGINX [haproxy]=$P_HAP)
listening() { bench_listening "$1"; }
for p in "${PORTS[@]}"; do listening "$p" && die "port $p on 127.0.0.1 is in use; set PORT_BASE to a free range"; done

TMP=$(mktemp -d /tmp/encgate-heldbench.XXXXXX)
chmod 755 "$TMP"
FAKE_PID= PROXY_PID= HOLD_PID=
cleanup() {
  local rc=$? p
  { exec 5>&-; } 2>/dev/null || true
  # shellcheck disable=SC2086 # empty pids drop out
  bench_stop $HOLD_PID $PROXY_PID $FAKE_PID
  bench_ports_free held.sh "${PORTS[@]}" || rc=1
  if [ "$KEEP_TMP" = 1 ] || ((rc != 0)); then echo "held.sh: logs, configs and profiles kept in $TMP" >&2; else rm -rf "$TMP"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
wait_port() { for _ in $(seq 100); do listening "$1" && return 0; sleep 0.1; done; die "$2 did not listen on 127.0.0.1:$1 within 10 s (logs in $TMP)"; }

START=$SECONDS
log "building encgate and bench/heldclient"
go build -o "$TMP/encgate" . || die "go build failed"
go build -o "$TMP/heldclient" ./bench/heldclient || die "go build ./bench/heldclient failed"

# ---------------------------------------------------------------- configs
# A held pull is a long poll: each encoder admits limits.poll_share (0.75 by
# default) of limits.max_inflight_per_encoder of them, the rest being kept
# for the calls that complete a part. The bound is raised so that N long
# polls fit under the default share; below it the gateway answers the rest
# 503 (the long-poll refusal) at once, as it should. The connection bound
# (which the descriptor budget counts) stays at what N needs.
GW_LIM=$((N + 1024)) GW_INFL=$(((N * 4 + 2) / 3 + 1024)) GW_CONNS=$((N + 1024 > 10000 ? N + 1024 : 10000))
if ((N > 8000)); then
  # Over 8000 the bounds are what N/TP needs, so that the descriptor budget
  # (limits.max_conns + upstream.max_conns_per_encoder + ...) fits
  # RLIMIT_NOFILE 20000; the check below (--check) says so if it does not.
  GW_LIM=$((N / TP + 512)) GW_CONNS=$((N + 512))
fi
cat >"$TMP/gateway.yaml" <<EOF
# written by bench/held.sh: defaults but for the log level and the limits N needs
listen: "127.0.0.1:$P_GW"
admin_listen: "127.0.0.1:$P_ADMIN"
encoders:
  - name: fake
    url: "http://127.0.0.1:$P_FAKE"
upstream:
  max_conns_per_encoder: $GW_LIM
limits:
  max_conns: $GW_CONNS
  max_inflight_per_encoder: $GW_INFL
log:
  level: warn
EOF
[ -z "$UNKNOWN_WAIT" ] || printf 'affinity:\n  unknown_wait: %s\n' "$UNKNOWN_WAIT" >>"$TMP/gateway.yaml"
# "encgate (unparked)": the same but for limits.park_long_polls.
sed 's/^limits:$/limits:\n  park_long_polls: false/' "$TMP/gateway.yaml" >"$TMP/gateway-unparked.yaml"
grep -q '^  park_long_polls: false$' "$TMP/gateway-unparked.yaml" || die "could not write gateway-unparked.yaml"
for f in gateway gateway-unparked; do
  "$TMP/encgate" gateway --config "$TMP/$f.yaml" --check >"$TMP/$f-check.log" 2>&1 || { cat "$TMP/$f-check.log" >&2; die "$f.yaml refused"; }
done

# nginx closes connections still waiting for their request ("worker_connections
# are not enough, reusing connections") once fewer than 1/16 are free: 2N + 1/8 + 512.
NGX_CONNS=$((2 * N + N / 4 + 512))
mkdir -p "$TMP/nginx"
cat >"$TMP/nginx.conf" <<EOF
# written by bench/held.sh
daemon off;
worker_processes 1;
worker_rlimit_nofile $((NGX_CONNS + 512));
pid $TMP/nginx/nginx.pid;
error_log $TMP/nginx/error.log warn;
events { worker_connections $NGX_CONNS; }
http {
  access_log off;
  client_body_temp_path $TMP/nginx/body; proxy_temp_path $TMP/nginx/proxy;
  fastcgi_temp_path $TMP/nginx/fastcgi; uwsgi_temp_path $TMP/nginx/uwsgi; scgi_temp_path $TMP/nginx/scgi;
  upstream fake { server 127.0.0.1:$P_FAKE; keepalive 128; }
  server {
    listen 127.0.0.1:$P_NGINX backlog=4096;
    location / {
      proxy_pass http://fake;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_read_timeout 600s;
    }
  }
}
EOF
nginx -t -c "$TMP/nginx.conf" -p "$TMP/nginx" >"$TMP/nginx/test.log" 2>&1 || { cat "$TMP/nginx/test.log" >&2; die "nginx config invalid"; }

cat >"$TMP/haproxy.cfg" <<EOF
# written by bench/held.sh (no 'log' directive: no log lines)
global
  nbthread 1
  maxconn $((N + 512))
defaults
  mode http
  maxconn $((N + 512))
  option http-keep-alive
  http-reuse always
  timeout connect 5s
  timeout client 600s
  timeout server 600s
frontend fe
  bind 127.0.0.1:$P_HAP
  default_backend be
backend be
  server fake 127.0.0.1:$P_FAKE
EOF
haproxy -c -q -f "$TMP/haproxy.cfg" >"$TMP/haproxy-check.log" 2>&1 || { cat "$TMP/haproxy-check.log" >&2; die "haproxy config invalid"; }

# ---------------------------------------------------------------- helpers
log "starting the fake encoder on core 0"
GOMAXPROCS=1 $SRV "$TMP/encgate" fake-encoder --listen "127.0.0.1:$P_FAKE" --name fake \
  --metadata-timeout 1h --sweep-after 2h >"$TMP/fake.log" 2>&1 &
FAKE_PID=$!
wait_port "$P_FAKE" "fake encoder"

held_count() { # pulls the fake holds right now
  curl -sS --max-time 5 "http://127.0.0.1:$P_FAKE/_fake/stats" | grep -o '"waiting":{[^}]*}' |
    grep -o '"/scheduler_receive_meta_data":[0-9]*' | cut -d: -f2 | grep . || echo 0
}
rss_kb() { # VmRSS of $1 and its children, kB
  local p sum=0 kb
  for p in "$1" $(pgrep -P "$1" || true); do
    kb=$(awk '/^VmRSS:/ {print $2}' "/proc/$p/status" 2>/dev/null || true)
    sum=$((sum + ${kb:-0}))
  done
  echo "$sum"
}
start_proxy() { # name round -> PROXY_PID (none for direct)
  [ "$1" = direct ] || ! listening "${PORT_OF[$1]}" || die "port ${PORT_OF[$1]} is taken by another process; set PORT_BASE to a free range"
  case $1 in
    direct) return 0 ;;
    encgate) GOMAXPROCS=1 $SRV "$TMP/encgate" gateway --config "$TMP/gateway.yaml" >"$TMP/$1-$2.log" 2>&1 & ;;
    encgate-unparked) GOMAXPROCS=1 $SRV "$TMP/encgate" gateway --config "$TMP/gateway-unparked.yaml" >"$TMP/$1-$2.log" 2>&1 & ;;
    nginx) $SRV nginx -c "$TMP/nginx.conf" -p "$TMP/nginx" >"$TMP/nginx/stdout-$2.log" 2>&1 & ;;
    haproxy) $SRV haproxy -db -f "$TMP/haproxy.cfg" >"$TMP/haproxy-$2.log" 2>&1 & ;;
  esac
  PROXY_PID=$!
  wait_port "${PORT_OF[$1]}" "$1"
  case $1 in encgate*) wait_port "$P_ADMIN" "encgate admin" ;; esac
}
stop_proxy() {
  [ -n "$PROXY_PID" ] || return 0
  kill -TERM "$PROXY_PID" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$PROXY_PID" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$PROXY_PID" 2>/dev/null || true; wait "$PROXY_PID" 2>/dev/null || true; PROXY_PID=
}

RAW=$TMP/raw.tsv # proxy round before_kB after_kB bytes_per_pull ok wrong missing early held p50_us p99_us (direct: - for the RSS ones)
: >"$RAW"
FAILS=()
measure() { # proxy round
  local px=$1 r=$2 prefix before=- after=- bpp=- prev held=0 line lat p50 p99 want=$N
  case $px in encgate*) want=$((N / TP)) ;; esac # one pull per part reaches the fake; its other ranks' wait for it
  prefix=held-$px-; ((r == 1)) || prefix=held-$px-r$r-
  curl -sS --max-time 5 -X POST "http://127.0.0.1:$P_FAKE/_fake/reset" >/dev/null
  [ "$(held_count)" = 0 ] || die "the fake still holds pulls from the previous proxy"
  start_proxy "$px" "$r"
  bench_wait_quiet; sleep 1
  [ "$px" = direct ] || before=$(rss_kb "$PROXY_PID")
  rm -f "$TMP/ctl"; mkfifo "$TMP/ctl"
  $CLI "$TMP/heldclient" hold -addr "127.0.0.1:${PORT_OF[$px]}" -n "$N" -tp "$TP" -prefix "$prefix" -timeout 120s \
    -release "127.0.0.1:$P_FAKE" -rc "$RELEASE_C" -c "$ARRIVE_C" \
    <"$TMP/ctl" >"$TMP/hold-$px-$r.out" 2>"$TMP/hold-$px-$r.err" &
  HOLD_PID=$!
  exec 5>"$TMP/ctl"
  local t0=$SECONDS
  until grep -q '^sent' "$TMP/hold-$px-$r.out" 2>/dev/null; do
    ((SECONDS - t0 < 60)) || die "$px: heldclient did not get its $N requests out within 60 s"
    kill -0 "$HOLD_PID" 2>/dev/null || { cat "$TMP/hold-$px-$r.err" >&2; die "$px: heldclient exited"; }
    sleep 0.2
  done
  log "$px round $r: $(cat "$TMP/hold-$px-$r.out") in $((SECONDS - t0)) s; waiting for the fake to hold them"
  while held=$(held_count); ((held < want && SECONDS - t0 < 90)); do sleep 0.2; done
  ((held == want)) || log "$px round $r: WARNING: the fake holds only $held of $want after $((SECONDS - t0)) s"
  log "$px round $r: fake holds $held after $((SECONDS - t0)) s; $(ss -Htn state established "( dport = :$P_FAKE )" | wc -l) established connections to the fake"
  if [ "$px" != direct ]; then
    sleep "$SETTLE"
    prev=$(rss_kb "$PROXY_PID")
    for _ in 1 2 3 4 5; do
      sleep 1; after=$(rss_kb "$PROXY_PID")
      awk -v a="$after" -v b="$prev" 'BEGIN { exit !(a - b < a / 100 && b - a < a / 100) }' && break
      prev=$after
    done
    held=$(held_count)
    ((held == want)) || FAILS+=("$px round $r: the fake held $held of $want when RSS was read")
  fi
  case $px in encgate*)
    curl -sS --max-time 30 "http://127.0.0.1:$P_ADMIN/debug/pprof/heap" >"$TMP/heap-$px-$r.pprof"
    curl -sS --max-time 30 "http://127.0.0.1:$P_ADMIN/debug/pprof/goroutine?debug=1" >"$TMP/goroutine-$px-$r.txt"
    log "$px round $r, $held held: $(head -1 "$TMP/goroutine-$px-$r.txt"); goroutine?debug=1 | head -5:"
    awk 'NR <= 5' "$TMP/goroutine-$px-$r.txt" >&2
    curl -sS --max-time 5 "http://127.0.0.1:$P_ADMIN/metrics" | grep -E '^go_(goroutines|memstats_(heap_inuse|stack_inuse|sys)_bytes) ' >&2 || true
    log "$px heap, go tool pprof -top -sample_index=inuse_space (top 15):"
    go tool pprof -top -sample_index=inuse_space "$TMP/encgate" "$TMP/heap-$px-$r.pprof" 2>&1 | awk 'NR <= 21' >&2 || true
    ;;
  esac
  ((HOLD == 0)) || { log "$px round $r: holding $HOLD s more (HOLD)"; sleep "$HOLD"; }
  local t1=$SECONDS
  echo release >&5; exec 5>&-
  wait "$HOLD_PID" || true; HOLD_PID=
  grep -q "^encoded $((N / TP)) failed 0\$" "$TMP/hold-$px-$r.out" ||
    { cat "$TMP/hold-$px-$r.err" >&2; FAILS+=("$px round $r: /encode to the fake failed: $(grep '^encoded' "$TMP/hold-$px-$r.out")"); }
  lat=$(grep '^latency_us ' "$TMP/hold-$px-$r.out" || echo "latency_us n 0 p50 0 p99 0 max 0")
  read -r _ _ _ _ p50 _ p99 _ <<<"$lat"
  log "$px round $r: released $RELEASE_C at a time in $((SECONDS - t1)) s: $lat"
  line=$(grep '^ok ' "$TMP/hold-$px-$r.out" || echo "ok 0 wrong 0 missing $N early 0")
  read -r _ ok _ wrong _ missing _ early <<<"$line"
  if ((ok != N || early != 0)); then
    FAILS+=("$px round $r: $line")
    log "$px round $r: FAIL: $line; reasons:"; cat "$TMP/hold-$px-$r.err" >&2
  fi
  case $px in encgate*)
    log "$px round $r: its log ($(wc -l <"$TMP/$px-$r.log") lines at warn and above):"; awk 'NR <= 5' "$TMP/$px-$r.log" >&2
    log "$px round $r: metrics (refusals, retries, requests):"
    curl -sS --max-time 5 "http://127.0.0.1:$P_ADMIN/metrics" | grep -E '^encgate_(upstream_refused|connections_rejected|retries|retry_budget_exhausted|requests|upstream_requests)_total' >&2 || true
    ;;
  esac
  stop_proxy
  [ "$px" = direct ] || bpp=$(awk -v a="$after" -v b="$before" -v n="$N" 'BEGIN { printf "%.0f", (a - b) * 1024 / n }')
  printf '%s\t%d\t%s\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\n' "$px" "$r" "$before" "$after" "$bpp" \
    "$ok" "$wrong" "$missing" "$early" "$held" "$p50" "$p99" >>"$RAW"
  log "$px round $r: RSS $before kB -> $after kB with $held held: $bpp B per pull; latency p50 $p50 us, p99 $p99 us; $line"
}

for px in "${PROXIES[@]}"; do [ -n "${PORT_OF[$px]:-}" ] || die "unknown proxy '$px' in PROXIES"; done
for ((round = 1; round <= ROUNDS; round++)); do
  for px in "${PROXIES[@]}"; do measure "$px" "$round"; done
done

# ---------------------------------------------------------------- report
col() { awk -F'\t' -v p="$1" -v c="$2" '$1 == p {print $c}' "$RAW"; }
total() { col "$1" "$2" | awk '{ s += $1 } END { print s + 0 }'; }
mib() { awk -v kb="$1" 'BEGIN { printf "%.1f MiB", kb / 1024 }'; }
declare -A BPP P50 P99
name_of() {
  case $1 in
    direct) echo "direct (no proxy)";; encgate) echo encgate;; encgate-unparked) echo "encgate (unparked)";;
    nginx) echo "nginx (1 worker)";; haproxy) echo "HAProxy (nbthread 1)";;
  esac
}
us() { col "$1" "$2" | bench_median | xargs printf "%.0f"; }
added() { # proxy p50|p99: its median minus direct's
  local -n v=$2
  if [ "$1" = direct ]; then echo "—"; elif [ -z "${v[direct]:-}" ]; then echo "n/a"; else echo $((v[$1] - v[direct])); fi
}
table=$TMP/table.md
{
  echo "| | bytes per held pull | RSS before | RSS with $N held | answer latency p50 (µs) | p99 (µs) | added p50 (µs) | added p99 (µs) | answered after release |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---|"
  for px in "${PROXIES[@]}"; do P50[$px]=$(us "$px" 11) P99[$px]=$(us "$px" 12); done
  for px in "${PROXIES[@]}"; do
    ok=$(total "$px" 6) tot=$((N * ROUNDS))
    ans="$ok/$tot ok"; ((ok == tot)) || ans="**$ans** (wrong $(total "$px" 7), missing $(total "$px" 8), early $(total "$px" 9))"
    if [ "$px" = direct ]; then
      rss="— | — | —"
    else
      BPP[$px]=$(col "$px" 5 | bench_median | xargs printf "%.0f")
      rss="${BPP[$px]} | $(mib "$(col "$px" 3 | bench_median)") | $(mib "$(col "$px" 4 | bench_median)")"
    fi
    printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$(name_of "$px")" "$rss" "${P50[$px]}" "${P99[$px]}" \
      "$(added "$px" P50)" "$(added "$px" P99)" "$ans"
  done
  echo
  ratio() { awk -v a="${BPP[$1]:-0}" -v b="${BPP[$2]:-0}" 'BEGIN { if (a <= 0 || b <= 0) print "n/a"; else printf "%.2f", a / b }'; }
  echo "- encgate / nginx, bytes per held pull: $(ratio encgate nginx)"
  echo "- encgate / HAProxy, bytes per held pull: $(ratio encgate haproxy)"
  echo "- encgate parked / unparked, bytes per held pull: $(ratio encgate encgate-unparked)"
  echo "- latency: from just before a pull's /encode is written to the fake to its client having read the whole answer; $(if ((TP == 1)); then echo "the $N pulls released $RELEASE_C at a time, each worker waiting for its pull's answer before the next"; else echo "the $((N / TP)) parts released $RELEASE_C at a time, each worker waiting for the answers of its part's $TP pulls before the next"; fi). Added = the row's p50 (p99) minus direct's."
  ((ROUNDS == 1)) || echo "- per round, bytes per held pull: $(for px in "${PROXIES[@]}"; do [ "$px" = direct ] || printf '%s %s; ' "$px" "$(col "$px" 5 | paste -sd,)"; done)"
  ((ROUNDS == 1)) || echo "- per round, latency p50/p99 (µs): $(for px in "${PROXIES[@]}"; do printf '%s %s; ' "$px" "$(paste -d/ <(col "$px" 11) <(col "$px" 12) | paste -sd,)"; done)"
  bench_noise_note
} >"$table"

git_v=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD -- . ':!bench' 2>/dev/null || git_v="$git_v (with uncommitted changes)"
mkdir -p "$(dirname "$RESULTS")"
{
  echo "# Held metadata pulls: proxy memory per pull and added latency"
  echo
  echo "Generated by \`N=$N$( ((TP == 1)) || echo " TP=$TP") ROUNDS=$ROUNDS bash bench/held.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC'); $(bench_machine)."
  echo
  echo "Each proxy, freshly started, fronts the same \`encgate fake-encoder\`, which holds a POST /scheduler_receive_meta_data until /encode publishes its req_id's metadata (sglang holds up to 180 s). $N client connections, one held pull each (a req_id of its own$( ((TP == 1)) || echo ", or shared by $TP: see TP below")), go through the proxy; once the fake holds all $N$( ((TP == 1)) || echo " (all $((N / TP)) through encgate: see TP)"), the proxy's RSS (VmRSS summed over its processes: nginx master + worker) is read again and (after - before) / $N is the cost of one held pull: its client connection, its upstream connection and whatever the proxy keeps for it. Then /encode is posted for every req_id straight to the fake, $RELEASE_C at a time (each waits for its pull's answer before the next), and each client must get its 200 (req_id and embedding_size): nothing may be dropped to save memory. A pull's latency is from just before its /encode is written to its client having read the whole answer; \`direct\` is the same release with the clients on the fake itself, so a proxy's added latency is its p50 (p99) minus direct's. Medians of $ROUNDS round(s), proxies interleaved, a fresh process per measurement. Proxy and fake pinned to core 0, the client to core 1, everything single-threaded (GOMAXPROCS=1, nginx worker_processes 1, HAProxy nbthread 1)."
  echo
  echo "- versions: encgate $git_v, $(go version | awk '{print $3}'), $(nginx -v 2>&1 | sed 's/^nginx version: //'), $(haproxy -v 2>&1 | awk 'NR == 1')"
  ((TP == 1)) || echo "- TP: $TP pulls per req_id, as a part's $TP receiver TP ranks each pull its metadata ($((N / TP)) parts). encgate forwards one pull per part to the fake (affinity.metadata_cache, on by default), and the part's other pulls wait for its answer; so the fake holds $((N / TP)) pulls for encgate and $N for nginx and HAProxy, which forward each. One /encode releases a part's $TP pulls; each is timed from it."
  echo "- arrivals: the client opened $ARRIVE_C connection(s) at a time (ARRIVE_C; 32 is a burst, 1 paces them)."
  echo "- encgate: defaults but affinity.unknown_wait ${UNKNOWN_WAIT:-5s} (the default 5s unless UNKNOWN_WAIT: an unpinned pull waits that long for a pin, parked, before it is forwarded), log level warn, limits.max_conns $GW_CONNS, upstream.max_conns_per_encoder $GW_LIM, limits.max_inflight_per_encoder $GW_INFL (so that N long polls fit under limits.poll_share 0.75). nginx: worker_connections $NGX_CONNS, upstream keepalive 128, proxy_http_version 1.1, proxy_read_timeout 600s. HAProxy: mode http, maxconn $((N + 512)), timeout server 600s."
  echo "- encgate (unparked): the same with limits.park_long_polls false."
  echo
  cat "$table"
} >"$RESULTS"
echo; cat "$table"; echo
log "written to $RESULTS; took $((SECONDS - START)) s"
((${#FAILS[@]} == 0)) || die "$(IFS=';'; echo "${FAILS[*]}")"
