#!/usr/bin/env bash
# Instructions per request, counted by valgrind's callgrind: in process (no network), one
# thread, the same binary and inputs every time, so the counts repeat to the instruction.
# Each figure is (count for 5,500 requests − count for 500) / 5,000, which removes start-up.
# Needs valgrind and a Redis on REDIS_URL (default redis://127.0.0.1:6379), which it FLUSHALLs.
# Note: valgrind does not emulate SHA-NI, so SHA-256 runs in software and costs more here
# than on the machine itself.
set -euo pipefail
cd "$(dirname "$0")/load"
redis_url=${REDIS_URL:-redis://127.0.0.1:6379}
cargo build --release --ignore-rust-version -q
count() {
  redis-cli -u "$redis_url" flushall >/dev/null
  valgrind --tool=callgrind --callgrind-out-file=/dev/null \
    ./target/release/load inproc "$1" "$2" "$3" "$redis_url" 2>&1 |
    grep -o 'Collected : [0-9]*' | grep -o '[0-9]*'
}
echo "| scenario | target | instructions/request |"
echo "|---|---|---:|"
for scenario in pass-through fresh replay; do
  for target in bare identity memory redis peer; do
    [ "$target" = identity ] && [ "$scenario" != pass-through ] && continue
    small=$(count "$target" "$scenario" 500)
    large=$(count "$target" "$scenario" 5500)
    echo "| $scenario | $target | $(( (large - small) / 5000 )) |"
  done
done
