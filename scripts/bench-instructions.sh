#!/usr/bin/env bash
# Instructions a message that one bench arm runs inside its clock, counted by callgrind: a
# figure that does not move with the machine's load, for before/after pairs where client CPU
# time is too noisy to tell a few per cent. Needs valgrind, and the servers up with their
# environment exported (eval "$(scripts/servers.sh env)").
#
#   scripts/bench-instructions.sh BENCH ARM [MESSAGES]
#   scripts/bench-instructions.sh target/release/bench 'kafka: fw batched$' 20000
#
# Valgrind's CPU has no SHA extensions, so SHA-256 (the payload hash) runs its software rounds
# there, many times the instructions it takes on a CPU that has them: the second figure leaves
# those rounds out. With BENCH_CALLGRIND_OUT=FILE the profile is kept there, for
# callgrind_annotate FILE (instructions by function).
set -euo pipefail
bench=$1
arm=$2
n=${3:-20000}
command -v valgrind > /dev/null || {
  echo "bench-instructions.sh: needs valgrind (apt-get install valgrind)" >&2
  exit 1
}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkfifo "$dir/ctl"
valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$dir/out" \
  "$bench" --messages "$n" --reps 1 --arms "$arm" --perf-ctl "$dir/ctl" > "$dir/log" 2>&1 &
pid=$!
# The bench writes "enable" when the arm's clock starts and "disable" when it stops. The FIFO
# is opened for reading and writing, which does not wait for the bench to open it: a bench
# that fails before it does ends this loop instead of leaving it waiting.
exec 3<> "$dir/ctl"
while kill -0 "$pid" 2> /dev/null; do
  if read -r -t 1 command <&3; then
    case $command in
      enable) callgrind_control -i on "$pid" > /dev/null 2>&1 || true ;;
      disable) callgrind_control -i off "$pid" > /dev/null 2>&1 || true ;;
    esac
  fi
done
exec 3<&-
wait "$pid" || {
  cat "$dir/log" >&2
  exit 1
}
if [ -n "${BENCH_CALLGRIND_OUT:-}" ]; then
  cp "$dir/out" "$BENCH_CALLGRIND_OUT"
fi
report=$(callgrind_annotate "$dir/out")
total=$(awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}' <<< "$report")
sha=$(awk '/sha2::sha256::compress256/ {gsub(",", "", $1); print $1; exit}' <<< "$report")
sha=${sha:-0}
echo "${arm%\$}: $((total / n)) instructions a message, $(((total - sha) / n)) outside SHA-256's software rounds"
