#!/usr/bin/env bash
# Runs examples/consumer.rs against a private redis-server (records and broker in it) and
# checks what it promises, twice in a row: every event's side effect once, the reused event id
# dead-lettered, its streams deleted.
set -euo pipefail
cd "$(dirname "$0")/.."
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
dir=$(mktemp -d)
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" \
  --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log"
trap 'kill "$(cat "$dir/redis.pid")" 2>/dev/null || true; rm -rf "$dir"' EXIT
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
# Twice against the same Redis: the second run must keep the promise too.
for run in 1 2; do
  output=$(REDIS_URL="redis://127.0.0.1:$port" cargo run -q --example consumer)
  echo "run $run: $(echo "$output" | tail -1)"
  echo "$output" | tail -1 | grep -Eq '^events: 12, deliveries: [0-9]+, side effects: 12, dead-lettered: 1$' || {
    echo "$output"; echo "consumer example, run $run: not every event ran once, or the reused id was not dead-lettered"; exit 1; }
done
# What it leaves behind: its records (expiring), no streams.
for key in $(redis-cli -p "$port" --scan); do
  if [ "$(redis-cli -p "$port" type "$key")" = stream ]; then
    echo "consumer example: stream $key left behind"; exit 1
  fi
done
