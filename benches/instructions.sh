#!/usr/bin/env bash
# Instructions per request, counted by valgrind's callgrind: in process (no network), one
# thread, the same binary and inputs every time, so the counts repeat (to within a few
# instructions: hash maps are seeded at random). Each figure is (count for 5,500 requests −
# count for 500) / 5,000, which removes start-up. Needs valgrind and redis-server; the Redis is
# a private one on a free port (or REDIS_URL, which it FLUSHALLs). valgrind does not emulate
# SHA-NI, so SHA-256 runs in software and costs more here than on the machine itself.
#
#   benches/instructions.sh                    # the table, the peer crate included
#   benches/instructions.sh --check FILE       # this crate's counts against FILE: fails when
#                                              # one grew more than 10 % (CI runs this)
#   benches/instructions.sh --write FILE       # writes this crate's counts to FILE: a new
#                                              # baseline, committed on purpose, saying why
set -euo pipefail
mode=${1:-table}
file=${2:-}
root=$(cd "$(dirname "$0")/.." && pwd)
case "$file" in /* | "") ;; *) file=$PWD/$file ;; esac
cd "$root/benches/load"
if [ -z "${REDIS_URL:-}" ]; then
  # A port nothing answers on, below the kernel's ephemeral range (a port an outgoing
  # connection holds answers nothing and still cannot be bound). A server that exits or does
  # not answer within 5 s (the port taken meanwhile) is tried again on another port, up to
  # five times, rather than waited for forever.
  redis_pid=""
  trap 'kill $redis_pid 2>/dev/null || true' EXIT
  for attempt in 1 2 3 4 5; do
    port=$(( 20000 + RANDOM % 12000 ))
    while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do port=$(( 20000 + RANDOM % 12000 )); done
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --logfile /dev/null &
    redis_pid=$!
    redis_url=redis://127.0.0.1:$port
    for _ in $(seq 50); do
      redis-cli -u "$redis_url" ping >/dev/null 2>&1 && break 2
      kill -0 "$redis_pid" 2>/dev/null || break
      sleep 0.1
    done
    echo "redis-server on port $port did not answer (attempt $attempt); another port" >&2
    kill "$redis_pid" 2>/dev/null || true
    redis_pid=""
  done
  [ -n "$redis_pid" ] || { echo "no redis-server answered in five attempts" >&2; exit 1; }
else
  redis_url=$REDIS_URL
fi
cargo build --release --ignore-rust-version -q
count() {
  redis-cli -u "$redis_url" flushall >/dev/null
  valgrind --tool=callgrind --callgrind-out-file=/dev/null \
    ./target/release/load inproc "$1" "$2" "$3" "$redis_url" 2>&1 |
    grep -o 'Collected : [0-9]*' | grep -o '[0-9]*'
}
per_request() {
  local small large
  small=$(count "$1" "$2" 500)
  large=$(count "$1" "$2" 5500)
  echo $(( (large - small) / 5000 ))
}
# This crate's scenarios, which the baseline holds.
ours() {
  for pair in "pass-through memory" "pass-through redis" "fresh memory" "fresh redis" \
    "replay memory" "replay redis"; do
    set -- $pair
    echo "$1 $2 $(per_request "$2" "$1")"
  done
}
case "$mode" in
  table)
    echo "| scenario | target | instructions/request |"
    echo "|---|---|---:|"
    for scenario in pass-through fresh replay; do
      for target in bare identity memory redis peer; do
        [ "$target" = identity ] && [ "$scenario" != pass-through ] && continue
        echo "| $scenario | $target | $(per_request "$target" "$scenario") |"
      done
    done
    ;;
  --write)
    [ -n "$file" ] || { echo "--write needs a file" >&2; exit 2; }
    ours > "$file"
    cat "$file"
    ;;
  --check)
    [ -n "$file" ] || { echo "--check needs a file" >&2; exit 2; }
    now_file=$(mktemp)
    ours > "$now_file"
    echo "| scenario | target | baseline | now | now / baseline |"
    echo "|---|---|---:|---:|---:|"
    failed=0
    while read -r scenario target baseline; do
      now=$(awk -v s="$scenario" -v t="$target" '$1 == s && $2 == t { print $3 }' "$now_file")
      ratio=$(awk -v n="$now" -v b="$baseline" 'BEGIN { printf "%.3f", n / b }')
      echo "| $scenario | $target | $baseline | $now | $ratio |"
      # A count that is not a positive number is a run that failed (a store that timed out
      # under valgrind answers errors, whose requests cost less): no measurement at all.
      if ! awk -v n="$now" 'BEGIN { exit !(n > 0) }'; then
        echo "$scenario over $target: no valid count ($now): the run failed" >&2
        failed=1
      fi
      if awk -v n="$now" -v b="$baseline" 'BEGIN { exit !(n > b * 1.10) }'; then
        echo "$scenario over $target grew more than 10 % past the baseline in $file" >&2
        failed=1
      fi
    done < "$file"
    exit $failed
    ;;
  *)
    echo "usage: benches/instructions.sh [--check FILE | --write FILE]" >&2
    exit 2
    ;;
esac
