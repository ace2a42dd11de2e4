#!/usr/bin/env bash
# bench/all.sh: runs every bench/*.sh in turn (proxy, replay, transfer,
# memory first when present, then any others; never itself) and joins their
# results (bench/results/<name>.md, plus any other bench/results/*.md a
# script wrote during this run) into bench/results/README.md, headed by the
# date and the machine: nproc, CPU model, kernel, go version.
#
# A script that fails is noted in the README and the others still run; the
# exit status is then 1. Each script's own environment variables pass through
# (see the top of each script).
#
# Environment:
#   SKIP=""    space-separated script names not to run (e.g. SKIP="proxy");
#              their existing results file, if any, is still included and
#              marked as not rerun
#   OUT=bench/results/README.md
# The scripts' own output goes to stderr; stdout gets the README.
set -euo pipefail
# shellcheck source=bench/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
bench_cd_root
bench_need_go

OUT=${OUT:-bench/results/README.md}
results=bench/results
mkdir -p "$results" "$(dirname "$OUT")"

stamp=$(mktemp)
body=$(mktemp)
trap 'rm -f "$stamp" "$body"' EXIT

scripts=()
for s in proxy replay transfer memory; do
	[[ -f bench/$s.sh ]] && scripts+=("bench/$s.sh")
done
for s in bench/*.sh; do
	case $(basename "$s") in
	all.sh | proxy.sh | replay.sh | transfer.sh | memory.sh) ;;
	*) scripts+=("$s") ;;
	esac
done

failed=()
skipped=()
started=$(date -u '+%Y-%m-%d %H:%M UTC')
for s in "${scripts[@]}"; do
	name=$(basename "$s" .sh)
	if [[ " ${SKIP:-} " == *" $name "* ]]; then
		echo "=== $s: skipped (SKIP)" >&2
		skipped+=("$name")
		if [[ -f $results/$name.md ]]; then
			{
				printf '_bench/%s.sh was not rerun by this all.sh run (SKIP); its results file is from %s:_\n\n' \
					"$name" "$(date -u -r "$results/$name.md" '+%Y-%m-%d %H:%M UTC')"
				cat "$results/$name.md"
				echo
			} >>"$body"
		fi
		continue
	fi
	echo "=== $s" >&2
	t0=$(date +%s)
	if bash "$s" >&2; then
		rc=0
	else
		rc=$?
		failed+=("$name")
	fi
	secs=$(($(date +%s) - t0))
	echo "=== $s: exit $rc after ${secs}s" >&2
	{
		if [[ -f $results/$name.md && $results/$name.md -nt $stamp ]]; then
			cat "$results/$name.md"
			echo
		fi
		if ((rc != 0)); then
			printf '**bench/%s.sh failed (exit %d after %d s)**; see its output.\n\n' "$name" "$rc" "$secs"
		fi
	} >>"$body"
done

# Other result files the scripts wrote during this run.
for f in "$results"/*.md; do
	[[ -f $f && $f -nt $stamp ]] || continue
	case $(basename "$f" .md) in
	README) continue ;;
	esac
	seen=
	for s in "${scripts[@]}"; do
		[[ $(basename "$s" .sh) == $(basename "$f" .md) ]] && seen=1
	done
	[[ -n $seen ]] && continue
	cat "$f" >>"$body"
	echo >>"$body"
done

cpu=$(awk -F': *' '/^model name/ {print $2; exit}' /proc/cpuinfo 2>/dev/null || true)
{
	echo "# encgate benchmarks"
	echo
	echo "Run by \`bench/all.sh\`, started $started, finished $(date -u '+%Y-%m-%d %H:%M UTC')."
	echo
	echo "| machine | |"
	echo "|---|---|"
	echo "| CPUs (nproc) | $(nproc) |"
	echo "| CPU model | ${cpu:-unknown} |"
	echo "| kernel | $(uname -srm) |"
	echo "| Go | $(go version | awk '{print $3, $4}') |"
	echo
	echo "Scripts: ${scripts[*]}."
	if ((${#skipped[@]})); then
		echo
		echo "Not rerun (SKIP): ${skipped[*]}."
	fi
	if ((${#failed[@]})); then
		echo
		echo "**Failed: ${failed[*]}.**"
	fi
	echo
	cat "$body"
} >"$OUT"
cat "$OUT"
((${#failed[@]} == 0))
