#!/usr/bin/env bash
# Run a command beside BUSY busy processes and report the load average it ran at, e.g. the whole suite at load ~10 on
# 2 cores:   bash scripts/under_load.sh 8 bash scripts/test.sh -q
# Every LOAD_INTERVAL seconds (default 60) the 1-minute load average is read; at the end its min/median/max is
# printed. The busy processes end with the command (or on Ctrl-C), and the command's exit status is this script's.
set -uo pipefail
if [[ $# -lt 2 || ! "$1" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 BUSY COMMAND [ARGS...]  (BUSY: how many busy processes, a whole number)" >&2
  exit 2
fi
busy=$1
shift
interval=${LOAD_INTERVAL:-60}
samples=$(mktemp)
pids=()
stop() {
  kill "${pids[@]}" 2>/dev/null
  wait "${pids[@]}" 2>/dev/null
}
trap 'stop; rm -f "$samples"; exit 130' INT TERM
for _ in $(seq "$busy"); do
  python3 -c "while True: pass" &
  pids+=($!)
done
(while true; do cut -d' ' -f1 /proc/loadavg >> "$samples"; sleep "$interval"; done) &
pids+=($!)
started=$(date +%s)
"$@"
status=$?
stop
python3 - "$samples" "$busy" "$(( $(date +%s) - started ))" "$status" <<'EOF'
import statistics, sys
loads = [float(line) for line in open(sys.argv[1]) if line.strip()]
busy, seconds, status = sys.argv[2:]
spread = f"{min(loads):.2f} / {statistics.median(loads):.2f} / {max(loads):.2f}" if loads else "not read"
print(f"under load: {busy} busy processes, exit {status} after {seconds} s; 1-minute load min / median / max: {spread} ({len(loads)} readings)")
EOF
rm -f "$samples"
exit "$status"
