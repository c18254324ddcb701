#!/usr/bin/env bash
# Stop what up.sh DIR started, by the pids it recorded (TERM, then KILL after 5 s); keeps DIR.
set -uo pipefail
dir=${1:?usage: down.sh DIR}
pids=()
for f in "$dir"/d-n1.pid "$dir"/d-n2.pid "$dir"/slurmctld.pid "$dir"/sshd.pid "$dir"/munged.pid; do
    [ -s "$f" ] && pids+=("$(cat "$f")")
done
[ ${#pids[@]} -eq 0 ] && exit 0
kill -TERM "${pids[@]}" 2>/dev/null
for _ in $(seq 1 50); do
    alive=()
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive+=("$p"); done
    [ ${#alive[@]} -eq 0 ] && exit 0
    sleep 0.1
done
kill -KILL "${alive[@]}" 2>/dev/null
exit 0
