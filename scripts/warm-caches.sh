#!/usr/bin/env bash
# The caches a first trace reads, filled: a trace's first start compiles
# its BPF program with clang (seconds; one program serves most options:
# docs/architecture.md) and reads its libc's facts; later starts load both
# from /var/cache/mtrace-live (or the MTRACE_LIVE_*_CACHE directories), and a
# start with the options of an earlier one makes its maps and programs while
# it plans. Done for the traces a new user starts first: --pid of a process
# (the live view, and text), with and without --contention, --pid of a
# Python process (the live view), and run. Called
# by scripts/setup.sh (as root) and by the start-up bench. Usage:
# warm-caches.sh MTRACE-LIVE; its exit code is the number of starts that
# failed (their errors in /tmp/mtrace-live-warm.log).
set -u
mtrace=$1
log=/tmp/mtrace-live-warm.log
: >"$log"
failed=0
sleep 300 &
target=$!
for options in "-o live" "-o text" "--contention -o live" "--contention -o text"; do
  # shellcheck disable=SC2086 # (the options are words)
  timeout 120 "$mtrace" --pid "$target" $options --duration 0.1 >/dev/null 2>>"$log" \
    || failed=$((failed + 1))
done
kill "$target" 2>/dev/null
wait "$target" 2>/dev/null
# a Python process (its plan reads the interpreter's layout);
# the system's python3, exec'd at once (a launcher on PATH, pyenv's shim,
# would be bash for the first tens of milliseconds)
/usr/bin/python3 -c 'import time; time.sleep(300)' &
target=$!
for _ in $(seq 100); do # (until the forked shell has exec'd python3)
  [ "$(readlink "/proc/$target/exe")" != "$(readlink /proc/$$/exe)" ] && break
  sleep 0.01
done
timeout 120 "$mtrace" --pid "$target" -o live --duration 0.1 >/dev/null 2>>"$log" \
  || failed=$((failed + 1))
kill "$target" 2>/dev/null
wait "$target" 2>/dev/null
timeout 120 "$mtrace" run -o summary -- true >/dev/null 2>>"$log" || failed=$((failed + 1))
exit "$failed"
