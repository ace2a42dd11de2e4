#!/usr/bin/env bash
# bench/proxy.sh: the proxy comparison of issue 6.
#
# One sglang-like fake encoder (`encgate fake-encoder`) behind
#   direct   nothing: wrk talks to the fake itself
#   encgate  `encgate gateway` (this repository, built by this script)
#   nginx    Debian's nginx as a keep-alive reverse proxy
#   haproxy  Debian's HAProxy in mode http with connection reuse
# driven by wrk with a small JSON POST to /scheduler_receive_url and, as a
# second workload, to /scheduler_receive_meta_data. Targets alternate
# (direct encgate nginx haproxy direct encgate ...) for ROUNDS rounds per
# workload, each measured run preceded by a short warm-up. Prints a markdown
# table per workload and writes everything to bench/results/proxy.md, with the
# gateway's RSS (VmRSS/VmHWM from /proc/PID/status) sampled during its runs.
#
# Besides req/s and latency, every measured run reports the proxy's CPU per
# proxied request, side by side in the same run: utime+stime (fields 14 and
# 15 of /proc/PID/stat, clock ticks, getconf CLK_TCK; all threads of the
# process) of the proxy's processes, read just before and just after the wrk
# run, so  µs/req = Δticks x 10^6 / CLK_TCK / requests.  The processes are
# encgate's one pid, nginx's master plus its workers (pgrep -P master), and
# HAProxy's one pid (-db: no master-worker; its threads are in that pid).
# Direct has no proxy, so no proxy CPU ("—"). The fake encoder's CPU per
# request is read the same way and shown beside it.
#
# Two layouts (LAYOUT):
#   split   (default) the proxy under test alone on SERVER_CPUS [core 0 of
#           2], one worker per core listed; wrk and the fake encoder share
#           LOADGEN_CPUS [core 1]. The proxy's core holds nothing else, so the
#           proxy CPU per request is the clean comparison; req/s is bounded
#           by whichever side saturates first (see the busy % columns).
#           Direct: wrk and the fake on LOADGEN_CPUS, the proxy core idle.
#   shared  the old layout: wrk alone on LOADGEN_CPUS [core 1], the fake
#           and the proxy share SERVER_CPUS [core 0], so every target gets
#           the same fixed budget behind wrk and a proxy's cost shows up as
#           throughput taken from the fake. Direct: the fake alone there.
# The results file says which layout it used.
#
# Usage:  bash bench/proxy.sh        (root, or sudo for the apt-get step)
#
# Environment (defaults in brackets):
#   DURATION     seconds of each measured wrk run                    [6]
#   WARMUP       seconds of the wrk warm-up before each measured run [1]
#   ROUNDS       rounds per workload (each round runs all 4 targets) [5]
#   CONNS        wrk connections                                     [32]
#   THREADS      wrk threads                                         [1]
#   LAYOUT       split or shared (see above)                         [split]
#   LOADGEN_CPUS cores for wrk (taskset list); with LAYOUT=split the fake
#                encoder's too               [1 on 2 cores; split: 1-(N-1)]
#   SERVER_CPUS  cores of the proxy under test; with LAYOUT=shared the fake
#                encoder's too               [0 on 2 cores; split: 0]
#                (each proxy gets as many workers/threads as cores listed:
#                one on 2 cores, in either layout)
#   PORT_BASE    first of 5 loopback ports used (fake, encgate,
#                encgate admin, nginx, haproxy)                      [19100]
#   RESULTS      markdown output file             [bench/results/proxy.md]
#   KEEP_TMP     1 keeps the temporary directory (configs, logs)     [0]
#   UNPARKED     1 adds a fifth target, "encgate-sync": a second encgate
#                gateway, the same config but limits.park_long_polls:
#                false, so the follow-ups (long polls) are exchanged on
#                the handler's goroutine instead of parking; it shows
#                what parking costs per request beside the default   [0]
#   FLOOR        1 adds three targets that are not proxies but measuring
#                sticks: bench/floor, a bare epoll loop in Go that copies
#                each message to the fake and back with no HTTP server or
#                gateway logic, once per way a Go loop can wait for the
#                kernel (floor-raw: a raw epoll_pwait the scheduler never
#                sees; floor-netpoll: the runtime's poller, as encgate's
#                parked exchanges wait; floor-blocking: an ordinary
#                system call). They show the least a Go program spends per
#                request here, beside nginx's                       [0]
#   GW_LOG_LEVEL encgate's log.level; info is the gateway's default, so
#                the default run measures the default config (health
#                checks on, as by default)                        [info]
#   QUIET_WAIT   seconds to wait, before each measured run, for the
#                machine to be quiet (< 15% of a core busy outside
#                this benchmark); then it runs anyway                [15]
#   REDO         times a measured run is repeated when processes
#                outside this benchmark took > 15% of a core in it   [2]
# Default run: 2 workloads x 5 rounds x 4 targets x (1+6)s = 280 s of load,
# plus a 0.5 s quiet check per run, build and setup: about 5.5 minutes on a
# quiet machine (longer when runs are repeated, see QUIET_WAIT and REDO).
# Five rounds rather than three: on a shared VM single rounds stray by 30%.
#
# Traffic goes only to 127.0.0.1. Every process the script starts is stopped
# on exit (trap), and it checks that none of its ports is left listening.
set -euo pipefail
# shellcheck source=bench/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"

DURATION=${DURATION:-6}
WARMUP=${WARMUP:-1}
ROUNDS=${ROUNDS:-5}
CONNS=${CONNS:-32}
THREADS=${THREADS:-1}
PORT_BASE=${PORT_BASE:-19100}
KEEP_TMP=${KEEP_TMP:-0}
GW_LOG_LEVEL=${GW_LOG_LEVEL:-info}
UNPARKED=${UNPARKED:-0}
FLOOR=${FLOOR:-0}
QUIET_WAIT=${QUIET_WAIT:-15}
REDO=${REDO:-2}

ROOT=$(cd "$(dirname "$0")/.." && pwd)
RESULTS=${RESULTS:-$ROOT/bench/results/proxy.md}
export PATH="$PATH:/usr/local/go/bin"

die() { echo "proxy.sh: FAIL: $*" >&2; exit 1; }
trap 'echo "proxy.sh: FAIL: unexpected error (exit $?) at line $LINENO: $BASH_COMMAND" >&2' ERR
log() { echo "== $*" >&2; }

LAYOUT=${LAYOUT:-split}
case $LAYOUT in split | shared) ;; *) die "LAYOUT must be split or shared, got '$LAYOUT'" ;; esac

for v in DURATION WARMUP ROUNDS CONNS THREADS PORT_BASE QUIET_WAIT REDO; do
  [[ ${!v} =~ ^[0-9]+$ ]] || die "$v must be a whole number, got '${!v}'"
done
((DURATION >= 1 && DURATION <= 120)) || die "DURATION must be 1..120 s"
((WARMUP <= 60)) || die "WARMUP must be 0..60 s"
((ROUNDS >= 1 && ROUNDS <= 20)) || die "ROUNDS must be 1..20"
((CONNS >= 1 && CONNS <= 1000)) || die "CONNS must be 1..1000"
((THREADS >= 1 && THREADS <= CONNS)) || die "THREADS must be 1..CONNS"
((QUIET_WAIT <= 120)) || die "QUIET_WAIT must be 0..120 s"
((REDO <= 5)) || die "REDO must be 0..5"

# ---------------------------------------------------------------- install
need=()
command -v wrk >/dev/null || need+=(wrk)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need+=(nginx)
command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || need+=(haproxy)
command -v curl >/dev/null || need+=(curl)
command -v taskset >/dev/null || need+=(util-linux)
if ((${#need[@]})); then
  log "installing from Debian: ${need[*]}"
  SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  # Keep the packages' own services from starting (they would take :80 and
  # run a second nginx/HAProxy during the benchmark): policy-rc.d says "no"
  # for the duration of the install, when no policy is in place already.
  policy=/usr/sbin/policy-rc.d made_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null && $SUDO chmod +x "$policy" && made_policy=1
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  if ((made_policy)); then $SUDO rm -f "$policy"; fi
fi
export PATH="$PATH:/usr/sbin:/sbin"
for c in wrk nginx haproxy curl taskset pgrep getconf go; do command -v "$c" >/dev/null || die "$c not found"; done
CLK_TCK=$(getconf CLK_TCK)
[[ $CLK_TCK =~ ^[0-9]+$ ]] && ((CLK_TCK > 0)) || die "getconf CLK_TCK gave '$CLK_TCK'"

# ---------------------------------------------------------------- cores
NPROC=$(nproc)
if [ -z "${LOADGEN_CPUS:-}" ] || [ -z "${SERVER_CPUS:-}" ]; then
  if ((NPROC >= 2)) && [ "$LAYOUT" = split ]; then
    # One core for the proxy (one worker, as the issue asks), the rest for
    # wrk and the fake; on 2 cores: proxy on core 0, wrk + fake on core 1.
    SERVER_CPUS=${SERVER_CPUS:-0}
    LOADGEN_CPUS=${LOADGEN_CPUS:-1-$((NPROC - 1))}
    [ "$LOADGEN_CPUS" = "1-1" ] && LOADGEN_CPUS=1
  elif ((NPROC >= 2)); then
    # Half the cores (rounded down, at least 1) for wrk, the rest for the
    # fake plus the proxy; on 2 cores: wrk on core 1, fake + proxy on core 0.
    lg=$((NPROC / 2))
    LOADGEN_CPUS=${LOADGEN_CPUS:-$((NPROC - lg))-$((NPROC - 1))}
    SERVER_CPUS=${SERVER_CPUS:-0-$((NPROC - lg - 1))}
    [ "$LOADGEN_CPUS" = "1-1" ] && LOADGEN_CPUS=1
    [ "$SERVER_CPUS" = "0-0" ] && SERVER_CPUS=0
  else
    LOADGEN_CPUS=${LOADGEN_CPUS:-0}; SERVER_CPUS=${SERVER_CPUS:-0}
  fi
fi
# Number of cores in a taskset list such as "0", "0-3", "0,2".
count_cpus() {
  local n=0 part
  IFS=, read -ra parts <<<"$1"
  for part in "${parts[@]}"; do
    if [[ $part == *-* ]]; then n=$((n + ${part#*-} - ${part%-*} + 1)); else n=$((n + 1)); fi
  done
  echo "$n"
}
# Indices of a taskset list, space-separated: "0-2,5" -> "0 1 2 5".
expand_cpus() {
  local part out=()
  IFS=, read -ra parts <<<"$1"
  for part in "${parts[@]}"; do
    if [[ $part == *-* ]]; then out+=($(seq "${part%-*}" "${part#*-}")); else out+=("$part"); fi
  done
  echo "${out[*]}"
}
WORKERS=$(count_cpus "$SERVER_CPUS")
((WORKERS >= 1)) || die "SERVER_CPUS '$SERVER_CPUS' names no core"
taskset -c "$SERVER_CPUS" true 2>/dev/null || die "cannot pin to SERVER_CPUS=$SERVER_CPUS"
taskset -c "$LOADGEN_CPUS" true 2>/dev/null || die "cannot pin to LOADGEN_CPUS=$LOADGEN_CPUS"
# Where the fake encoder runs, and with how many Ps.
if [ "$LAYOUT" = split ]; then FAKE_CPUS=$LOADGEN_CPUS; else FAKE_CPUS=$SERVER_CPUS; fi
FAKE_PROCS=$(count_cpus "$FAKE_CPUS")
OVERLAP=
for c in $(expand_cpus "$SERVER_CPUS"); do [[ " $(expand_cpus "$LOADGEN_CPUS") " == *" $c "* ]] && OVERLAP+=" $c"; done
if [ -n "$OVERLAP" ]; then
  PINNING="SERVER_CPUS=$SERVER_CPUS and LOADGEN_CPUS=$LOADGEN_CPUS overlap (core(s)$OVERLAP): wrk, the fake encoder and the proxy compete for those cores, so neither layout's premise holds (layout $LAYOUT requested). Every proxy gets ${WORKERS} worker(s); the fake runs with GOMAXPROCS=${FAKE_PROCS}."
elif [ "$LAYOUT" = split ]; then
  PINNING="layout **split** (the default): the proxy under test alone on core(s) ${SERVER_CPUS}; wrk (${THREADS} thread(s), ${CONNS} connections) and the fake encoder (GOMAXPROCS=${FAKE_PROCS}) share core(s) ${LOADGEN_CPUS} (taskset). Every proxy gets the same budget: ${WORKERS} worker(s) (nginx worker_processes ${WORKERS}, HAProxy nbthread ${WORKERS}, encgate GOMAXPROCS=${WORKERS}). Direct: wrk and the fake on core(s) ${LOADGEN_CPUS}, the proxy core(s) idle. Why: nothing but the proxy runs on its core(s), so its own CPU per request (utime+stime from /proc, divided by requests) is measured without the fake's work mixed in; req/s is bounded by whichever side saturates first (busy % columns), so in this layout the CPU per request is the comparison to read, and LAYOUT=shared is the fixed-budget throughput comparison."
elif ((NPROC >= 2)); then
  PINNING="layout **shared**: wrk (${THREADS} thread(s), ${CONNS} connections) pinned to core(s) ${LOADGEN_CPUS}; the fake encoder and the proxy under test share core(s) ${SERVER_CPUS} (taskset). Every proxy gets the same budget: ${WORKERS} worker(s) (nginx worker_processes ${WORKERS}, HAProxy nbthread ${WORKERS}, encgate GOMAXPROCS=${WORKERS}); the fake runs with GOMAXPROCS=${WORKERS} too. Direct: the fake alone on core(s) ${SERVER_CPUS}. Why: wrk gets a core of its own so the load generator never competes with what it measures, and everything behind wrk (fake + proxy) gets the same fixed budget for every target, so a proxy's cost shows up as throughput taken from the fake on the shared core. The proxy's own CPU per request is still read from /proc, but it shares its core with the fake."
else
  PINNING="one core: everything shares it (no pinning possible)"
fi

# ---------------------------------------------------------------- ports, tmp
P_FAKE=$PORT_BASE P_GW=$((PORT_BASE + 1)) P_ADMIN=$((PORT_BASE + 2)) P_NGINX=$((PORT_BASE + 3)) P_HAP=$((PORT_BASE + 4))
P_GW2=$((PORT_BASE + 5)) P_ADMIN2=$((PORT_BASE + 6))
PORTS=("$P_FAKE" "$P_GW" "$P_ADMIN" "$P_NGINX" "$P_HAP")
[ "$UNPARKED" = 1 ] && PORTS+=("$P_GW2" "$P_ADMIN2")
P_FLOOR_RAW=$((PORT_BASE + 7)) P_FLOOR_NETPOLL=$((PORT_BASE + 8)) P_FLOOR_BLOCKING=$((PORT_BASE + 9))
[ "$FLOOR" = 1 ] && PORTS+=("$P_FLOOR_RAW" "$P_FLOOR_NETPOLL" "$P_FLOOR_BLOCKING")
listening() { bench_listening "$1"; }
for p in "${PORTS[@]}"; do
  listening "$p" && die "port $p on 127.0.0.1 is in use; set PORT_BASE to a free range"
done

TMP=$(mktemp -d /tmp/encgate-proxybench.XXXXXX)
chmod 755 "$TMP"
PIDS=()
SAMPLER=
cleanup() {
  local rc=$? p
  [ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null || true
  bench_stop "${PIDS[@]}"
  bench_ports_free proxy.sh "${PORTS[@]}" || rc=1
  if [ "$KEEP_TMP" = 1 ] || ((rc != 0)); then echo "proxy.sh: logs and configs kept in $TMP" >&2; else rm -rf "$TMP"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_port() { # port what
  for _ in $(seq 100); do listening "$1" && return 0; sleep 0.1; done
  die "$2 did not listen on 127.0.0.1:$1 within 10 s (logs in $TMP)"
}

# ---------------------------------------------------------------- build
log "building encgate"
(cd "$ROOT" && go build -o "$TMP/encgate" .) || die "go build failed"
GW_BIN=$TMP/encgate
if [ "$FLOOR" = 1 ]; then
  (cd "$ROOT" && go build -o "$TMP/floor" ./bench/floor) || die "go build ./bench/floor failed"
fi

# ---------------------------------------------------------------- configs
cat >"$TMP/gateway.yaml" <<EOF
# written by bench/proxy.sh
listen: "127.0.0.1:$P_GW"
admin_listen: "127.0.0.1:$P_ADMIN"
encoders:
  - name: fake
    url: "http://127.0.0.1:$P_FAKE"
affinity:
  pin_ttl: 2h        # the run outlasts the default 240s; one /encode pins the req_id for all of it
log:
  level: $GW_LOG_LEVEL
EOF
"$GW_BIN" gateway --config "$TMP/gateway.yaml" --check >/dev/null || die "gateway config invalid"
if [ "$UNPARKED" = 1 ]; then
  sed -e "s/:$P_GW\"/:$P_GW2\"/" -e "s/:$P_ADMIN\"/:$P_ADMIN2\"/" "$TMP/gateway.yaml" >"$TMP/gateway-sync.yaml"
  printf 'limits:\n  park_long_polls: false\n' >>"$TMP/gateway-sync.yaml"
  "$GW_BIN" gateway --config "$TMP/gateway-sync.yaml" --check >/dev/null || die "gateway (sync) config invalid"
fi

mkdir -p "$TMP/nginx"
cat >"$TMP/nginx.conf" <<EOF
# written by bench/proxy.sh
daemon off;
worker_processes $WORKERS;
pid $TMP/nginx/nginx.pid;
error_log $TMP/nginx/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $TMP/nginx/body;
  proxy_temp_path $TMP/nginx/proxy;
  fastcgi_temp_path $TMP/nginx/fastcgi;
  uwsgi_temp_path $TMP/nginx/uwsgi;
  scgi_temp_path $TMP/nginx/scgi;
  keepalive_requests 1000000;
  keepalive_timeout 120s;
  upstream fake {
    server 127.0.0.1:$P_FAKE;
    keepalive 128;
    keepalive_requests 1000000;
    keepalive_timeout 120s;
  }
  server {
    listen 127.0.0.1:$P_NGINX;
    location / {
      proxy_pass http://fake;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
EOF
nginx -t -c "$TMP/nginx.conf" -p "$TMP/nginx" >"$TMP/nginx/test.log" 2>&1 || { cat "$TMP/nginx/test.log" >&2; die "nginx config invalid"; }

cat >"$TMP/haproxy.cfg" <<EOF
# written by bench/proxy.sh (no log lines: no 'log' directive anywhere)
global
  nbthread $WORKERS
  maxconn 4096
defaults
  mode http
  option http-keep-alive
  http-reuse always
  timeout connect 5s
  timeout client 60s
  timeout server 60s
  timeout http-keep-alive 120s
frontend fe
  bind 127.0.0.1:$P_HAP
  default_backend be
backend be
  server fake 127.0.0.1:$P_FAKE maxconn 1024
EOF
haproxy -c -q -f "$TMP/haproxy.cfg" >"$TMP/haproxy-check.log" 2>&1 || { cat "$TMP/haproxy-check.log" >&2; die "haproxy config invalid"; }

# ---------------------------------------------------------------- start
log "layout $LAYOUT: starting the fake encoder on core(s) $FAKE_CPUS, encgate, nginx and HAProxy on core(s) $SERVER_CPUS"
GOMAXPROCS=$FAKE_PROCS taskset -c "$FAKE_CPUS" "$GW_BIN" fake-encoder --listen "127.0.0.1:$P_FAKE" \
  --name fake --sweep-after 2h >"$TMP/fake.log" 2>&1 &
FAKE_PID=$!
PIDS+=("$FAKE_PID")
wait_port "$P_FAKE" "fake encoder"
GOMAXPROCS=$WORKERS taskset -c "$SERVER_CPUS" "$GW_BIN" gateway --config "$TMP/gateway.yaml" >"$TMP/gateway.log" 2>&1 &
GW_PID=$!
PIDS+=("$GW_PID")
wait_port "$P_GW" "encgate"
taskset -c "$SERVER_CPUS" nginx -c "$TMP/nginx.conf" -p "$TMP/nginx" >"$TMP/nginx/stdout.log" 2>&1 &
NGINX_PID=$!
PIDS+=("$NGINX_PID")
wait_port "$P_NGINX" "nginx"
taskset -c "$SERVER_CPUS" haproxy -db -f "$TMP/haproxy.cfg" >"$TMP/haproxy.log" 2>&1 &
HAP_PID=$!
PIDS+=("$HAP_PID")
wait_port "$P_HAP" "haproxy"
GW2_PID=
if [ "$UNPARKED" = 1 ]; then
  GOMAXPROCS=$WORKERS taskset -c "$SERVER_CPUS" "$GW_BIN" gateway --config "$TMP/gateway-sync.yaml" >"$TMP/gateway-sync.log" 2>&1 &
  GW2_PID=$!
  PIDS+=("$GW2_PID")
  wait_port "$P_GW2" "encgate (sync)"
fi
declare -A FLOOR_PID=()
if [ "$FLOOR" = 1 ]; then
  for m in raw netpoll blocking; do
    port_var=P_FLOOR_${m^^}
    GOMAXPROCS=$WORKERS taskset -c "$SERVER_CPUS" "$TMP/floor" -listen "127.0.0.1:${!port_var}" -upstream "127.0.0.1:$P_FAKE" \
      -wait "$m" >"$TMP/floor-$m.log" 2>&1 &
    FLOOR_PID[$m]=$!
    PIDS+=("$!")
    wait_port "${!port_var}" "floor ($m)"
  done
fi

# ---------------------------------------------------------------- proxy CPU
# The pids are those of the programs themselves (taskset and the GOMAXPROCS=
# prefix exec, they do not fork); check that before counting their CPU.
comm_of() { cat "/proc/$1/comm" 2>/dev/null || echo "?"; }
[ "$(comm_of "$FAKE_PID")" = encgate ] || die "pid $FAKE_PID is '$(comm_of "$FAKE_PID")', not the fake encoder"
[ "$(comm_of "$GW_PID")" = encgate ] || die "pid $GW_PID is '$(comm_of "$GW_PID")', not encgate"
[ "$(comm_of "$NGINX_PID")" = nginx ] || die "pid $NGINX_PID is '$(comm_of "$NGINX_PID")', not nginx"
[ "$(comm_of "$HAP_PID")" = haproxy ] || die "pid $HAP_PID is '$(comm_of "$HAP_PID")', not haproxy"
NGINX_WORKERS=$(pgrep -P "$NGINX_PID" | paste -sd' ')
[ "$(wc -w <<<"$NGINX_WORKERS")" -eq "$WORKERS" ] || die "nginx has workers '$NGINX_WORKERS', want $WORKERS"
[ -z "$(pgrep -P "$HAP_PID")" ] || die "HAProxy has child processes ($(pgrep -P "$HAP_PID" | paste -sd' ')); want one process"
[ -z "$(pgrep -P "$GW_PID")" ] || die "encgate has child processes; want one process"
if [ -n "$GW2_PID" ]; then
  [ "$(comm_of "$GW2_PID")" = encgate ] || die "pid $GW2_PID is '$(comm_of "$GW2_PID")', not encgate"
  [ -z "$(pgrep -P "$GW2_PID")" ] || die "encgate (sync) has child processes; want one process"
fi
for m in "${!FLOOR_PID[@]}"; do
  [ "$(comm_of "${FLOOR_PID[$m]}")" = floor ] || die "pid ${FLOOR_PID[$m]} is '$(comm_of "${FLOOR_PID[$m]}")', not floor"
done
# proxy_pids target -> the pids whose CPU is the proxy's (nothing for direct)
proxy_pids() {
  case $1 in
  encgate) echo "$GW_PID" ;;
  encgate-sync) echo "$GW2_PID" ;;
  nginx) echo "$NGINX_PID $(pgrep -P "$NGINX_PID" | paste -sd' ')" ;;
  haproxy) echo "$HAP_PID" ;;
  floor-*) echo "${FLOOR_PID[${1#floor-}]}" ;;
  direct) echo ;;
  esac
}
# stat_ticks user|all PID... -> utime (field 14 of /proc/PID/stat), or
# utime+stime (fields 14, 15), of all threads, summed over the pids; dies
# when one of them is gone.
stat_ticks() {
  local which=$1 p sum=0 v
  shift
  for p in "$@"; do
    v=$(awk -v w="$which" '{ sub(/^.*\) /, ""); split($0, f, " "); print (w == "user") ? f[12] : f[12] + f[13] }' "/proc/$p/stat" 2>/dev/null) || true
    [[ $v =~ ^[0-9]+$ ]] || die "cannot read /proc/$p/stat ($(comm_of "$p")): the process is gone"
    sum=$((sum + v))
  done
  echo "$sum"
}
# ticks PID... -> "ticks pids": utime+stime summed, and the pids read
ticks() { echo "$(stat_ticks all "$@") $*"; }
# uticks PID... -> utime summed: the user-space share of ticks
uticks() { stat_ticks user "$@"; }
# us_per_req ticks_before ticks_after requests -> CPU µs per request
us_per_req() {
  awk -v a="$1" -v b="$2" -v n="$3" -v hz="$CLK_TCK" 'BEGIN { printf "%.2f", (b - a) * 1e6 / hz / n }'
}

# ---------------------------------------------------------------- state
REQ_ID=bench-proxy-req-0
ENCODE_BODY="{\"req_id\":\"$REQ_ID\",\"modality\":\"IMAGE\",\"mm_items\":[\"bench://image-0\"],\"num_parts\":1,\"part_idx\":0}"
URL_BODY="{\"req_id\":\"$REQ_ID\",\"receive_url\":\"127.0.0.1:45000\",\"receive_count\":1}"
META_BODY="{\"req_id\":\"$REQ_ID\",\"part_idx\":0}"

post() { # port path body -> "status<TAB>encoder-header<TAB>body" ; one request, 5 s bound
  curl -sS --max-time 5 -o "$TMP/post.body" -D "$TMP/post.head" -w '%{http_code}' \
    -H 'Content-Type: application/json' --data-binary "$3" "http://127.0.0.1:$1$2" >"$TMP/post.code" 2>"$TMP/post.err" || true
  printf '%s\t%s\t%s\n' "$(cat "$TMP/post.code")" \
    "$(grep -i '^X-Encgate-Encoder:' "$TMP/post.head" 2>/dev/null | tr -d '\r' | cut -d' ' -f2)" "$(head -c 300 "$TMP/post.body" 2>/dev/null)"
}

# /encode goes through encgate, which pins the req_id to the fake; the fake
# then holds the request state (and the published metadata) that every
# target's follow-ups find. nginx and HAProxy need nothing of their own.
r=$(post "$P_GW" /encode "$ENCODE_BODY")
[ "${r%%$'\t'*}" = 200 ] || die "POST /encode through encgate: $r"
declare -A PORT_OF=([direct]=$P_FAKE [encgate]=$P_GW [nginx]=$P_NGINX [haproxy]=$P_HAP [encgate-sync]=$P_GW2)
TARGETS=(direct encgate nginx haproxy)
if [ "$UNPARKED" = 1 ]; then
  # The second gateway pins the req_id in its own pool: /encode through it
  # too (the fake answers a repeated /encode for the same req_id).
  r=$(post "$P_GW2" /encode "$ENCODE_BODY")
  [ "${r%%$'\t'*}" = 200 ] || die "POST /encode through encgate (sync): $r"
  TARGETS=(direct encgate encgate-sync nginx haproxy)
fi
PORT_OF[floor-raw]=$P_FLOOR_RAW PORT_OF[floor-netpoll]=$P_FLOOR_NETPOLL PORT_OF[floor-blocking]=$P_FLOOR_BLOCKING
[ "$FLOOR" = 1 ] && TARGETS+=(floor-raw floor-netpoll floor-blocking)
for t in "${TARGETS[@]}"; do
  for pb in "/scheduler_receive_url|$URL_BODY" "/scheduler_receive_meta_data|$META_BODY"; do
    r=$(post "${PORT_OF[$t]}" "${pb%%|*}" "${pb#*|}")
    [ "${r%%$'\t'*}" = 200 ] || die "$t ${pb%%|*} answered: $r"
    if [ "${t%-sync}" = encgate ]; then
      enc=$(cut -f2 <<<"$r"); [ "$enc" = fake ] || die "encgate ${pb%%|*}: X-Encgate-Encoder '$enc', want fake"
    fi
  done
done
log "state ready: every target answers 200 on both routes for $REQ_ID"

# ---------------------------------------------------------------- wrk
mklua() { # file path body
  cat >"$1" <<EOF
wrk.method = "POST"
wrk.path = "$2"
wrk.body = '$3'
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("BENCH requests=%d duration_us=%d p50_us=%.1f p99_us=%.1f connect=%d read=%d write=%d status=%d timeout=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect, e.read, e.write, e.status, e.timeout))
end
EOF
}
mklua "$TMP/url.lua" /scheduler_receive_url "$URL_BODY"
mklua "$TMP/meta.lua" /scheduler_receive_meta_data "$META_BODY"
declare -A LUA_OF=([url]=$TMP/url.lua [meta]=$TMP/meta.lua)
declare -A ROUTE_OF=([url]=/scheduler_receive_url [meta]=/scheduler_receive_meta_data)

# /proc/stat snapshot: "busy total" jiffies summed over the cores of a list
cpu_snap() {
  awk -v want=" $(expand_cpus "$1") " '$1 ~ /^cpu[0-9]+$/ { n = substr($1, 4); if (index(want, " " n " ")) {
      t = 0; for (i = 2; i <= NF; i++) t += $i; b += t - $5 - $6; tt += t } } END { print b, tt }' /proc/stat
}
busy_pct() { # before after -> percent busy between two cpu_snap outputs
  awk -v a="$1" -v b="$2" 'BEGIN { split(a, x, " "); split(b, y, " "); d = y[2] - x[2]; printf "%.0f", (d > 0) ? 100 * (y[1] - x[1]) / d : 0 }'
}

# CPU used outside this benchmark. proc_snap writes "pid jiffies" for every
# user-space process that is not ours, counting utime+stime+cutime+cstime
# (so a short-lived process shows up in its parent once reaped). Ours: this
# shell and its children (the servers, wrk's subshells, the RSS sampler)
# and nginx's workers; kernel threads (ppid 2) are left out too.
proc_snap() {
  # (cat, not awk over the glob: a process may exit between glob and read)
  { cat /proc/[0-9]*/stat 2>/dev/null || true; } | awk -v me="$$" -v ng="${NGINX_PID:-0}" '{
      line = $0; pid = $1; sub(/^.*\) /, "", line); split(line, f, " ")
      # f[1] state, f[2] ppid, f[12..15] utime stime cutime cstime
      if (pid != me && f[2] != me && f[2] != ng && f[2] != 2 && pid != 2)
        print pid, f[12] + f[13] + f[14] + f[15] }' >"$1"
}
# foreign_jiffies before_file after_file -> CPU jiffies of others between
# them: each process's growth (all of it for a new one), less what the
# processes that ended had used before the first snapshot (their parent's
# cutime takes their whole life when it reaps them).
foreign_jiffies() {
  awk 'NR == FNR { b[$1] = $2; next } { seen[$1] = 1; s += $2 - (($1 in b) ? b[$1] : 0) }
       END { for (p in b) if (!(p in seen)) s -= b[p]; print (s > 0) ? s : 0 }' "$1" "$2"
}
# as a percentage of one core over the elapsed jiffies of two all_snap outputs
all_snap() { awk -v n="$NPROC" '$1 == "cpu" { t = 0; for (i = 2; i <= NF; i++) t += $i; print t, n; exit }' /proc/stat; }
foreign_pct() { # jiffies snapA snapB
  awk -v j="$1" -v a="$2" -v b="$3" 'BEGIN { split(a, x, " "); split(b, y, " "); per_core = (y[1] - x[1]) / y[2];
    printf "%.0f", (per_core > 0) ? 100 * j / per_core : 0 }'
}
# wait (up to QUIET_WAIT s) for a 0.5 s window with < 15% of a core busy
# outside our (idle) servers; prints the last window's figure
wait_quiet() {
  local deadline=$((SECONDS + QUIET_WAIT)) a b f
  while :; do
    a=$(all_snap); proc_snap "$TMP/q0"; sleep 0.5; proc_snap "$TMP/q1"; b=$(all_snap)
    f=$(foreign_pct "$(foreign_jiffies "$TMP/q0" "$TMP/q1")" "$a" "$b")
    if ((f < 15 || SECONDS >= deadline)); then echo "$f"; return; fi
  done
}

# field NAME LINE -> value of NAME=... in a BENCH line
field() { sed -n "s/.*[[:space:]]$1=\([^[:space:]]*\).*/\1/p" <<<"$2"; }

# run_wrk workload target seconds tag -> the BENCH line; dies on any error
run_wrk() {
  local w=$1 t=$2 secs=$3 tag=$4 out line n bad
  out=$TMP/wrk-$w-$t-$tag.txt
  timeout $((secs + 30)) taskset -c "$LOADGEN_CPUS" wrk -t"$THREADS" -c"$CONNS" -d"${secs}s" --timeout 5s --latency \
    -s "${LUA_OF[$w]}" "http://127.0.0.1:${PORT_OF[$t]}${ROUTE_OF[$w]}" >"$out" 2>&1 || { cat "$out" >&2; die "wrk failed against $t ($w, $tag)"; }
  line=$(grep '^BENCH ' "$out" || true)
  [ -n "$line" ] || { cat "$out" >&2; die "no summary from wrk against $t ($w, $tag)"; }
  n=$(field requests "$line")
  bad=$(($(field connect "$line") + $(field read "$line") + $(field write "$line") + $(field status "$line") + $(field timeout "$line")))
  if ((n == 0 || bad != 0)) || grep -qE 'Non-2xx or 3xx responses|Socket errors' "$out"; then
    cat "$out" >&2
    die "$t ($w, $tag): $n requests, $bad errors: a benchmark of errors is worthless"
  fi
  echo "$line"
}

# RSS sampler for the gateway: "kB kB" (VmRSS VmHWM) every 0.2 s into a file
rss_now() { awk '/^VmRSS:/{r=$2} /^VmHWM:/{h=$2} END{print r, h}' "/proc/$GW_PID/status"; }
RSS_FILE=$TMP/rss.txt
: >"$RSS_FILE"
RSS_START=$(rss_now)

RAW=$TMP/raw.tsv # workload round target rps p50_us p99_us requests server_busy% loadgen_busy% foreign% proxy_cpu_us/req(NA: direct) fake_cpu_us/req proxy_ticks proxy_user_us/req(NA: direct)
REDONE=0
CONTAMINATED=()
: >"$RAW"
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
total_runs=$((2 * ROUNDS * ${#TARGETS[@]}))
i=0
for w in url meta; do
  for ((round = 1; round <= ROUNDS; round++)); do
    for t in "${TARGETS[@]}"; do
      i=$((i + 1))
      if [ "$t" = encgate ]; then
        ( for _ in $(seq $(((WARMUP + (REDO + 1) * (DURATION + QUIET_WAIT + 3) + 5) * 5))); do rss_now >>"$RSS_FILE" 2>/dev/null || exit 0; sleep 0.2; done ) &
        SAMPLER=$!
      fi
      ((WARMUP > 0)) && run_wrk "$w" "$t" "$WARMUP" "warm$round" >/dev/null
      for ((try = 0; ; try++)); do
        quiet=$(wait_quiet)
        s_srv=$(cpu_snap "$SERVER_CPUS"); s_lg=$(cpu_snap "$LOADGEN_CPUS"); s_all=$(all_snap); proc_snap "$TMP/p0"
        pp=$(proxy_pids "$t")
        # shellcheck disable=SC2086 # word splitting intended: a list of pids
        k_px0=$(ticks $pp); k_fk0=$(ticks "$FAKE_PID"); u_px0=$(uticks $pp)
        line=$(run_wrk "$w" "$t" "$DURATION" "r$round")
        # shellcheck disable=SC2086
        k_px1=$(ticks $pp); k_fk1=$(ticks "$FAKE_PID"); u_px1=$(uticks $pp)
        k_px0=${k_px0%% *} k_px1=${k_px1%% *} k_fk0=${k_fk0%% *} k_fk1=${k_fk1%% *}
        [ "$(proxy_pids "$t")" = "$pp" ] || die "$t's processes changed during the run: '$pp' then '$(proxy_pids "$t")'"
        b_srv=$(busy_pct "$s_srv" "$(cpu_snap "$SERVER_CPUS")"); b_lg=$(busy_pct "$s_lg" "$(cpu_snap "$LOADGEN_CPUS")")
        proc_snap "$TMP/p1"; e_all=$(all_snap)
        foreign=$(foreign_pct "$(foreign_jiffies "$TMP/p0" "$TMP/p1")" "$s_all" "$e_all")
        if [ "${DEBUG:-0}" = 1 ]; then
          log "debug: others' jiffies $(foreign_jiffies "$TMP/p0" "$TMP/p1"), top: $(awk 'NR == FNR { b[$1] = $2; next } { d = $2 - (($1 in b) ? b[$1] : 0); if (d > 0) print d, $1 }' "$TMP/p0" "$TMP/p1" | sort -rn | awk 'NR <= 3' | while read -r d p; do printf '%s jiffies pid %s (%s); ' "$d" "$p" "$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-60)"; done)"
        fi
        ((foreign > 15 && try < REDO)) || break
        log "$w round $round $t: processes outside the benchmark took $foreign% of a core during the run (quiet check before: $quiet%); running it again"
        REDONE=$((REDONE + 1))
      done
      ((foreign > 15)) && CONTAMINATED+=("$w round $round $t: $foreign% of a core")
      if [ "$t" = encgate ]; then
        kill "$SAMPLER" 2>/dev/null || true; wait "$SAMPLER" 2>/dev/null || true; SAMPLER=
        rss_now >>"$RSS_FILE"
        RSS_END=$(rss_now)
      fi
      n=$(field requests "$line"); us=$(field duration_us "$line")
      rps=$(awk -v n="$n" -v us="$us" 'BEGIN{printf "%.0f", n / (us / 1e6)}')
      if [ -n "$pp" ]; then cpu=$(us_per_req "$k_px0" "$k_px1" "$n") ucpu=$(us_per_req "$u_px0" "$u_px1" "$n"); else cpu=NA ucpu=NA; fi
      fcpu=$(us_per_req "$k_fk0" "$k_fk1" "$n")
      printf '%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$w" "$round" "$t" "$rps" "$(field p50_us "$line")" "$(field p99_us "$line")" "$n" "$b_srv" "$b_lg" "$foreign" "$cpu" "$fcpu" "$((k_px1 - k_px0))" "$ucpu" >>"$RAW"
      log "[$i/$total_runs] $w round $round $t: $rps req/s, p50 $(field p50_us "$line") us, p99 $(field p99_us "$line") us; proxy CPU ${cpu/NA/-} us/req ($((k_px1 - k_px0)) ticks), fake $fcpu us/req; busy: server cores $b_srv%, wrk cores $b_lg%, outside the benchmark $foreign% of a core"
    done
  done
done
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

# ---------------------------------------------------------------- report
median() { sort -g | awk '{a[NR]=$1} END{ if (NR % 2) printf "%s", a[(NR+1)/2]; else printf "%s", (a[NR/2]+a[NR/2+1])/2 }'; }
col() { awk -F'\t' -v w="$1" -v t="$2" -v c="$3" '$1==w && $3==t {print $c}' "$RAW"; }
f2() { awk '{ printf "%.2f", $1 }'; }
ms() { awk -v us="$1" 'BEGIN{printf "%.3f", us / 1000}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN{ if (b == 0) print "n/a"; else printf "%.2f", a / b }'; }
mark() { awk -v v="$1" -v op="$2" -v lim="$3" 'BEGIN{ ok = (op == ">=") ? v >= lim : v <= lim; print ok ? "met" : "missed" }'; }

# round_ratios workload other column [mine] -> "median (min-max)" of mine (encgate)/other per round
round_ratios() {
  awk -F'\t' -v w="$1" -v o="$2" -v c="$3" -v me="${4:-encgate}" '$1 == w && $3 == me { e[$2] = $c } $1 == w && $3 == o { x[$2] = $c }
    END { for (r in e) if ((r in x) && x[r] > 0) printf "%.3f\n", e[r] / x[r] }' "$RAW" | sort -g |
    awk '{ a[NR] = $1 } END { if (NR == 0) { print "n/a"; exit }
      m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2; printf "%.2f (%.2f-%.2f)", m, a[1], a[NR] }'
}
pretty_title() { [ "$1" = url ] && echo "/scheduler_receive_url" || echo "/scheduler_receive_meta_data"; }
name_of() { case $1 in direct) echo "direct (no proxy)";; encgate) echo "encgate";; encgate-sync) echo "encgate-sync (park_long_polls off)";; nginx) echo "nginx";; haproxy) echo "HAProxy";; floor-*) echo "floor, -wait ${1#floor-} (not a proxy)";; esac; }

report=$TMP/report.md
{
  for w in url meta; do
    declare -A RPS=() P50=() P99=() CPU=() UCPU=()
    for t in "${TARGETS[@]}"; do
      RPS[$t]=$(col "$w" "$t" 4 | median); P50[$t]=$(col "$w" "$t" 5 | median); P99[$t]=$(col "$w" "$t" 6 | median)
      if [ "$t" = direct ]; then CPU[$t]=— UCPU[$t]=—; else CPU[$t]=$(col "$w" "$t" 11 | median | f2) UCPU[$t]=$(col "$w" "$t" 14 | median | f2); fi
    done
    echo "### POST $(pretty_title "$w")"
    echo
    echo "| target | req/s (median) | p99 ms (median) | proxy CPU µs/req (median) | of it user µs/req (median) | p50 ms (median) | req/s per round | proxy CPU µs/req per round | fake CPU µs/req (median) | busy % server / wrk cores (median) | CPU outside the benchmark, % of a core (max) |"
    echo "|---|---:|---:|---:|---:|---:|---|---|---:|---|---:|"
    for t in "${TARGETS[@]}"; do
      if [ "$t" = direct ]; then cpu_rounds=—; else cpu_rounds=$(col "$w" "$t" 11 | paste -sd' ' | sed 's/ /, /g'); fi
      printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s / %s | %s |\n' "$(name_of "$t")" "${RPS[$t]}" "$(ms "${P99[$t]}")" "${CPU[$t]}" "${UCPU[$t]}" "$(ms "${P50[$t]}")" \
        "$(col "$w" "$t" 4 | paste -sd' ' | sed 's/ /, /g')" "$cpu_rounds" "$(col "$w" "$t" 12 | median | f2)" \
        "$(col "$w" "$t" 8 | median)" "$(col "$w" "$t" 9 | median)" "$(col "$w" "$t" 10 | sort -g | tail -1)"
    done
    echo
    r_ng=$(ratio "${RPS[encgate]}" "${RPS[nginx]}"); r_hp=$(ratio "${RPS[encgate]}" "${RPS[haproxy]}"); r_d=$(ratio "${RPS[encgate]}" "${RPS[direct]}")
    q_ng=$(ratio "${P99[encgate]}" "${P99[nginx]}"); q_hp=$(ratio "${P99[encgate]}" "${P99[haproxy]}")
    c_ng=$(ratio "${CPU[encgate]}" "${CPU[nginx]}"); c_hp=$(ratio "${CPU[encgate]}" "${CPU[haproxy]}")
    echo "| ratio | of the medians | median of per-round ratios (range) | target | |"
    echo "|---|---:|---:|---|---|"
    echo "| encgate / nginx, proxy CPU per request | $c_ng | $(round_ratios "$w" nginx 11) | ≤ 1.0 | $(mark "$c_ng" "<=" 1.0) |"
    echo "| encgate / HAProxy, proxy CPU per request | $c_hp | $(round_ratios "$w" haproxy 11) | ≤ 1.0 | $(mark "$c_hp" "<=" 1.0) |"
    echo "| encgate / nginx, req/s | $r_ng | $(round_ratios "$w" nginx 4) | ≥ 1.0 | $(mark "$r_ng" ">=" 1.0) |"
    echo "| encgate / HAProxy, req/s | $r_hp | $(round_ratios "$w" haproxy 4) | ≥ 1.0 | $(mark "$r_hp" ">=" 1.0) |"
    echo "| encgate / direct, req/s | $r_d | $(round_ratios "$w" direct 4) | ≥ 0.5 | $(mark "$r_d" ">=" 0.5) |"
    echo "| encgate / nginx, p99 | $q_ng | $(round_ratios "$w" nginx 6) | ≤ 1.0 | $(mark "$q_ng" "<=" 1.0) |"
    echo "| encgate / HAProxy, p99 | $q_hp | $(round_ratios "$w" haproxy 6) | ≤ 1.0 | $(mark "$q_hp" "<=" 1.0) |"
    if [ "$UNPARKED" = 1 ]; then
      s_ng=$(ratio "${CPU[encgate-sync]}" "${CPU[nginx]}"); s_hp=$(ratio "${CPU[encgate-sync]}" "${CPU[haproxy]}")
      s_rng=$(ratio "${RPS[encgate-sync]}" "${RPS[nginx]}"); s_rhp=$(ratio "${RPS[encgate-sync]}" "${RPS[haproxy]}")
      s_own=$(ratio "${CPU[encgate]}" "${CPU[encgate-sync]}")
      echo "| encgate-sync / nginx, proxy CPU per request | $s_ng | $(round_ratios "$w" nginx 11 encgate-sync) | (≤ 1.0) | $(mark "$s_ng" "<=" 1.0) |"
      echo "| encgate-sync / HAProxy, proxy CPU per request | $s_hp | $(round_ratios "$w" haproxy 11 encgate-sync) | (≤ 1.0) | $(mark "$s_hp" "<=" 1.0) |"
      echo "| encgate-sync / nginx, req/s | $s_rng | $(round_ratios "$w" nginx 4 encgate-sync) | (≥ 1.0) | $(mark "$s_rng" ">=" 1.0) |"
      echo "| encgate-sync / HAProxy, req/s | $s_rhp | $(round_ratios "$w" haproxy 4 encgate-sync) | (≥ 1.0) | $(mark "$s_rhp" ">=" 1.0) |"
      echo "| encgate / encgate-sync, proxy CPU per request (what parking costs) | $s_own | $(round_ratios "$w" encgate-sync 11) | | |"
    fi
    if [ "$FLOOR" = 1 ]; then
      for m in raw netpoll blocking; do
        f_ng=$(ratio "${CPU[floor-$m]}" "${CPU[nginx]}")
        echo "| floor -wait $m / nginx, proxy CPU per request (no HTTP server, no gateway) | $f_ng | $(round_ratios "$w" nginx 11 "floor-$m") | (reference) | |"
      done
      # On the meta workload encgate answers from its metadata cache and
      # the floor forwards every request: no like-for-like ratio there.
      if [ "$w" = url ]; then
        echo "| encgate / floor -wait netpoll, proxy CPU per request | $(ratio "${CPU[encgate]}" "${CPU[floor-netpoll]}") | $(round_ratios "$w" floor-netpoll 11) | (reference) | |"
      fi
    fi
    echo
    if [ "$FLOOR" = 1 ]; then
      echo "The floor targets are not proxies: \`bench/floor\` copies each message to the fake and back from one epoll loop, with no HTTP server, routing, parsing or gateway logic, once per way a Go loop can wait for the kernel (raw: a raw \`epoll_pwait\` the scheduler never sees, holding its P; netpoll: the runtime's poller; blocking: an ordinary system call). They bound what any Go design of this proxy could spend per request here.$([ "$w" = meta ] && echo " On this workload encgate answers from its metadata cache, so it is not compared with them.")"
      echo
    fi
    echo "Per-round ratios compare runs seconds apart, so they hold up better than the ratio of medians when the whole machine speeds up or slows down between rounds; met/missed is judged on the ratio of the medians."
    echo
    if [ "$LAYOUT" = split ]; then
      echo "Layout split: wrk and the fake share core(s) $LOADGEN_CPUS, so req/s and latency (direct's too: wrk and the fake take turns on one core) are bounded by that side when its busy % is near 100; read the proxy CPU per request first here, and LAYOUT=shared for the fixed-budget throughput comparison."
      echo
    fi
    if awk -v d="${RPS[direct]}" -v a="${RPS[encgate]}" -v b="${RPS[nginx]}" -v c="${RPS[haproxy]}" 'BEGIN{exit !(d < a || d < b || d < c)}'; then
      echo "**Sanity warning:** a proxied target beat direct on this workload; something else on the machine probably took CPU during some runs; compare the per-round figures."
      echo
    fi
    unset RPS P50 P99 CPU UCPU
  done
} >"$report"

read -r rss0 _ <<<"$RSS_START"
rss_max=$(awk 'BEGIN{m=0} {if ($1 > m) m = $1} END{print m}' "$RSS_FILE")
rss_hwm=$(awk '{h=$2} END{print h}' "$RSS_FILE")
read -r rss_end _ <<<"$RSS_END"
mib() { awk -v kb="$1" 'BEGIN{printf "%.1f MiB", kb / 1024}'; }
rss_section="### encgate gateway RSS under this run

From /proc/$GW_PID/status, sampled every 0.2 s during each encgate warm-up and measured run ($(wc -l <"$RSS_FILE") samples).

| when | VmRSS |
|---|---:|
| after start, /encode and one call per route (before load) | $(mib "$rss0") |
| max over the samples | $(mib "$rss_max") |
| at the end of the last encgate run | $(mib "$rss_end") |
| VmHWM at that point (the kernel's peak; it is updated lazily, so it can read a little below the sampled max) | $(mib "$rss_hwm") |
"

cpu_model=$(awk -F': ' '/^model name/{print $2; exit}' /proc/cpuinfo)
go_v=$(go version | awk '{print $3}')
nginx_v=$(nginx -v 2>&1 | sed 's/^nginx version: nginx\///')
# (awk reads to the end: `| head -1` could SIGPIPE the writer and, with pipefail, fail the script)
hap_v=$(haproxy -v 2>&1 | awk 'NR == 1 {print $3}')
wrk_v=$( (wrk -v 2>&1 || true) | awk 'NR == 1 {print $2}')
git_v=$(cd "$ROOT" && git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
(cd "$ROOT" && git diff --quiet HEAD -- . ':!bench' 2>/dev/null) || git_v="$git_v (with uncommitted changes)"

mkdir -p "$(dirname "$RESULTS")"
{
  echo "# Proxy comparison: encgate vs nginx vs HAProxy vs direct"
  echo
  echo "Generated by \`bash bench/proxy.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC')."
  echo
  echo "- machine: $NPROC cores ($cpu_model), $(awk '/^MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo) RAM, kernel $(uname -r), $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME")"
  echo "- versions: encgate $git_v, $go_v, nginx $nginx_v, HAProxy $hap_v, wrk $wrk_v"
  echo "- pinning: $PINNING"
  echo "- layout: $LAYOUT"
  echo "- load: wrk -t$THREADS -c$CONNS -d${DURATION}s --latency, POST of a small JSON body (Lua script); a ${WARMUP}s warm-up before each measured run; $ROUNDS rounds per workload, targets alternating $(printf '%s, ' "${TARGETS[@]}" | sed 's/, $//') in every round; medians over the rounds. 1-minute load average before/after (the benchmark itself adds about 2): $LOAD_BEFORE / $LOAD_AFTER."
  echo "- upstream: one \`encgate fake-encoder\` (Go net/http); req_id \`$REQ_ID\`, its /encode sent once through encgate (which pins it), so both routes answer 200 at once on every target. Every measured and warm-up run had 0 socket errors and 0 non-2xx answers (the script fails otherwise)."
  echo "- encgate: \`encgate gateway\`, log level $GW_LOG_LEVEL, the fake as its only encoder, admin on its own port, affinity.pin_ttl 2h (everything else default)$([ "$UNPARKED" = 1 ] && echo "; encgate-sync: a second \`encgate gateway\` with the same config and limits.park_long_polls: false, on the same core(s), its req_id pinned by an /encode of its own"). nginx: upstream keepalive 128, proxy_http_version 1.1, Connection \"\", access_log off, keepalive_requests 1000000. HAProxy: mode http, option http-keep-alive, http-reuse always, no logging."
  echo
  if ((${#CONTAMINATED[@]})); then
    echo "**Warning:** in ${#CONTAMINATED[@]} measured run(s) processes outside the benchmark still took > 15% of a core after $REDO repeat(s): $(IFS=';'; echo "${CONTAMINATED[*]}"). Treat those figures with care."
    echo
  fi
  echo "Log lines written during the run (encgate at $GW_LOG_LEVEL and above, nginx error log at warn, HAProxy stderr): encgate $(wc -l <"$TMP/gateway.log"), nginx $(cat "$TMP/nginx/error.log" 2>/dev/null | wc -l), HAProxy $(grep -vc NOTICE "$TMP/haproxy.log" || true)."
  echo
  echo "Runs repeated because something outside the benchmark used the CPU during them: $REDONE."
  echo
  echo "Layout: **$LAYOUT** (LAYOUT=split puts the proxy alone on the server core(s) and the fake beside wrk; LAYOUT=shared puts the fake and the proxy on the server core(s) and wrk alone; see the pinning line above)."
  echo
  echo "Proxy CPU µs/req: the proxy's own utime+stime (fields 14 and 15 of /proc/PID/stat, all threads; clock ticks of 1/$CLK_TCK s) read just before and just after each measured wrk run, times 10^6 / CLK_TCK / requests completed in that run. Processes counted: encgate's pid$([ "$UNPARKED" = 1 ] && echo " (encgate-sync's own pid for it)"); nginx's master and its worker(s) (pgrep -P); HAProxy's pid (one process, nbthread $WORKERS). Direct has no proxy (—). Of it user µs/req: utime alone (field 14), the share spent outside the kernel$([ "$FLOOR" = 1 ] && echo "; floor's targets count the floor's one pid"). Fake CPU µs/req: the fake encoder's, read the same way (in every target, so the upstream's own cost can be compared too). The CPU ratios' target, ≤ 1.0, is the per-core counterpart of the req/s target (≥ 1.0). CPU per request is measured at whatever rate each target ran at; it falls somewhat as load rises (more events per wake-up), so compare it with the busy % of the server core(s)."
  echo
  echo "Busy %: share of the server and wrk cores busy during each measured run (median over rounds); server cores near 100% with wrk's below means what runs on the server cores ($([ "$LAYOUT" = split ] && echo "the proxy" || echo "fake + proxy")), not the wrk cores ($([ "$LAYOUT" = split ] && echo "wrk + fake" || echo "wrk")), was the limit. CPU outside the benchmark: other processes' CPU during the run (from /proc/*/stat), max over rounds."
  echo
  cat "$report"
  echo "$rss_section"
} >"$RESULTS"

echo
cat "$RESULTS"
echo
log "written to $RESULTS"
