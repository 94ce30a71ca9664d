#!/usr/bin/env bash
# Two builds (or two targets) side by side in one run, each round alternating between them,
# so that a machine that drifts during the run moves both alike. Each cell: a private
# redis-server and `load serve TARGET` pinned to core 0, `load drive` on core 1 (as the matrix
# pins them), 0.5 s of warm-up, then 2 s measured. Prints, per round and per entry: requests a
# second, non-2xx answers, and server and Redis CPU (user + system) per request sent.
#
#   benches/side-by-side.sh SCENARIO CONNECTIONS SIZE ROUNDS BINARY:TARGET...
#
#   # the landed build against this tree's, fresh keys, 16 connections, 256-byte bodies:
#   git worktree add /tmp/before HEAD~1
#   (cd /tmp/before/benches/load && CARGO_TARGET_DIR=/tmp/before-target cargo build --release --ignore-rust-version)
#   (cd benches/load && cargo build --release --ignore-rust-version)
#   benches/side-by-side.sh fresh 16 256 3 /tmp/before-target/release/load:redis \
#     benches/load/target/release/load:redis benches/load/target/release/load:peer
set -euo pipefail
[ $# -ge 5 ] || { sed -n 2,15p "$0" >&2; exit 2; }
scenario=$1 connections=$2 size=$3 rounds=$4
shift 4
ticks=$(getconf CLK_TCK)
redis_cpu() {
  redis-cli -p "$1" info cpu | awk -F: '/used_cpu_(sys|user):/ { s += $2 } END { printf "%.6f", s }'
}
for round in $(seq "$rounds"); do
  for entry in "$@"; do
    binary=${entry%:*} target=${entry##*:}
    # Two ports nothing answers on (a cell's server may still hold the last cell's for a moment),
    # below the kernel's ephemeral range: a port the drive's connections hold as their own end
    # answers nothing, but cannot be bound.
    free_port() {
      local low
      read -r low _ </proc/sys/net/ipv4/ip_local_port_range
      local port=$(( 10000 + RANDOM % (low - 10000) ))
      while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do port=$(( 10000 + RANDOM % (low - 10000) )); done
      echo "$port"
    }
    redis_port=$(free_port); server_port=$(free_port)
    taskset -c 0 redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
      --logfile /dev/null &
    redis_pid=$!
    # Bounded waits: a server that did not start (a port taken meanwhile) fails the run loudly.
    waited=0
    until redis-cli -p "$redis_port" ping >/dev/null 2>&1; do
      kill -0 "$redis_pid" 2>/dev/null && [ $(( waited += 1 )) -lt 200 ] ||
        { echo "redis-server on port $redis_port did not start" >&2; exit 1; }
      sleep 0.05
    done
    server_log=$(mktemp)
    taskset -c 0 "$binary" serve "$target" "$server_port" "redis://127.0.0.1:$redis_port" >"$server_log" 2>&1 &
    server_pid=$!
    waited=0
    until (exec 3<>"/dev/tcp/127.0.0.1/$server_port") 2>/dev/null; do
      kill -0 "$server_pid" 2>/dev/null && [ $(( waited += 1 )) -lt 200 ] ||
        { echo "load serve on port $server_port did not start:" >&2; tail -5 "$server_log" >&2; kill "$redis_pid"; exit 1; }
      sleep 0.05
    done
    taskset -c 1 "$binary" drive "$server_port" "$scenario" "$connections" 500 0 "$size" >/dev/null
    redis_before=$(redis_cpu "$redis_port")
    server_before=$(awk '{ print $14 + $15 }' "/proc/$server_pid/stat")
    # The drive's last line: answered, non-2xx, p50 µs, p99 µs, seconds, sent.
    read -r answered failed _ _ seconds sent < <(taskset -c 1 "$binary" drive "$server_port" \
      "$scenario" "$connections" 2000 0 "$size" 2>/dev/null | tail -1)
    redis_after=$(redis_cpu "$redis_port")
    server_after=$(awk '{ print $14 + $15 }' "/proc/$server_pid/stat")
    kill "$server_pid" "$redis_pid"
    rm -f "$server_log"
    wait "$server_pid" "$redis_pid" 2>/dev/null || true
    awk -v r="$round" -v e="$entry" -v a="$answered" -v f="$failed" -v s="$seconds" -v n="$sent" \
      -v sb="$server_before" -v sa="$server_after" -v t="$ticks" -v rb="$redis_before" -v ra="$redis_after" \
      'BEGIN { printf "round %s  %-60s %8.0f req/s  %d non-2xx  server %5.1f µs  Redis %5.1f µs\n",
               r, e, a / s, f, (sa - sb) / t * 1e6 / n, (ra - rb) * 1e6 / n }'
  done
done
