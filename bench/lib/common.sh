# shellcheck shell=bash
# bench/lib/common.sh: helpers shared by bench/*.sh (sourced, never run).
# It lives below bench/lib/ so bench/all.sh, which runs bench/*.sh, skips it.

# cd to the repository root, whatever directory the script was started from.
bench_cd_root() {
	cd "$(dirname "${BASH_SOURCE[1]}")/.." || exit 1
	if [[ ! -f go.mod ]] || ! grep -q '^module github.com/encgate/encgate' go.mod; then
		echo "bench: cannot find the encgate repository root from $PWD" >&2
		exit 1
	fi
}

# Go is the project's own toolchain: it is not installed from Debian.
bench_need_go() {
	command -v go >/dev/null 2>&1 || PATH=$PATH:/usr/local/go/bin
	if ! command -v go >/dev/null 2>&1; then
		echo "bench: go is not on PATH (the project needs Go $(awk '/^go /{print $2}' go.mod))" >&2
		exit 1
	fi
}

# bench_apt_install CMD PKG: install Debian package PKG unless CMD exists.
bench_apt_install() {
	local cmd=$1 pkg=$2 sudo=()
	command -v "$cmd" >/dev/null 2>&1 && return 0
	if [[ $(id -u) -ne 0 ]]; then
		command -v sudo >/dev/null 2>&1 || { echo "bench: $pkg is missing and this is not root" >&2; exit 1; }
		sudo=(sudo)
	fi
	echo "bench: installing $pkg" >&2
	if ! DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q "$pkg" >/dev/null; then
		DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get update -q >/dev/null
		DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q "$pkg" >/dev/null
	fi
}

# bench_median: the median of the numbers on stdin, one per line ("n/a" when none).
bench_median() {
	sort -g | awk '{a[NR] = $1} END {
		if (NR == 0) { print "n/a"; exit }
		if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2 }'
}

# bench_unit UNIT: for Go benchmark lines on stdin, the value before UNIT
# (e.g. ns/op, MB/s, B/op), one per line.
bench_unit() {
	awk -v u="$1" '{ for (i = 2; i <= NF; i++) if ($i == u) print $(i - 1) }'
}

# bench_machine: one line naming this machine.
bench_machine() {
	local cpu
	cpu=$(awk -F': *' '/^model name/ {print $2; exit}' /proc/cpuinfo 2>/dev/null || true)
	printf '%s CPUs (%s), Linux %s, %s' "$(nproc)" "${cpu:-unknown CPU}" "$(uname -r)" "$(go version 2>/dev/null | awk '{print $3}')"
}

# bench_busy_cores: CPU time (in cores) spent by everything on the machine
# over the next 0.5 s, from /proc/stat.
bench_busy_cores() {
	local a b
	a=$(awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9, $5 + $6 }' /proc/stat)
	sleep 0.5
	b=$(awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9, $5 + $6 }' /proc/stat)
	awk -v a="$a" -v b="$b" -v n="$(nproc)" 'BEGIN {
		split(a, x, " "); split(b, y, " ")
		busy = y[1] - x[1]; all = busy + y[2] - x[2]
		printf "%.2f", (all > 0 ? n * busy / all : 0) }'
}

# bench_wait_quiet: before a measurement, wait up to QUIET_WAIT seconds
# (default 15) until the machine is idle (< QUIET_CORES, default 0.15, of a
# core busy), so another benchmark or build running at the same time does not
# skew it; then go on anyway. Increments BENCH_NOISY when it gave up.
BENCH_NOISY=0
bench_wait_quiet() {
	local deadline=$((SECONDS + ${QUIET_WAIT:-15})) busy
	while :; do
		busy=$(bench_busy_cores)
		awk -v b="$busy" -v q="${QUIET_CORES:-0.15}" 'BEGIN { exit !(b < q) }' && return 0
		if ((SECONDS >= deadline)); then
			echo "bench: machine still busy ($busy cores) after ${QUIET_WAIT:-15}s; measuring anyway" >&2
			BENCH_NOISY=$((BENCH_NOISY + 1))
			return 0
		fi
	done
}

# bench_noise_note: a results line saying how many measurements started on a
# busy machine (nothing when none did).
bench_noise_note() {
	if ((BENCH_NOISY > 0)); then
		echo
		echo "- **$BENCH_NOISY measurement(s) started while other processes kept the machine busy** (waited ${QUIET_WAIT:-15} s for quiet each time): figures may be low."
	fi
}

# bench_listening PORT: something accepts on 127.0.0.1:PORT.
bench_listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# bench_stop PID...: TERM each, give each up to 5 s, then KILL; reaps them.
bench_stop() {
	local p
	for p in "$@"; do kill -TERM "$p" 2>/dev/null || true; done
	for p in "$@"; do
		for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
		kill -KILL "$p" 2>/dev/null || true
		wait "$p" 2>/dev/null || true
	done
}

# bench_ports_free NAME PORT...: warns (as NAME) about each port still
# listening; fails when there is one.
bench_ports_free() {
	local name=$1 p rc=0
	shift
	for p in "$@"; do
		if bench_listening "$p"; then echo "$name: WARNING: port $p still listening after cleanup" >&2; rc=1; fi
	done
	return "$rc"
}
