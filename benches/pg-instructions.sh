#!/usr/bin/env bash
# Instructions a PostgreSQL backend spends per statement of a fresh request (the claim of a new
# key, then its complete) and per replay, for PostgresStore's statements and for the PostgreSQL
# floor's (`benches/load`): deterministic, where the load bench's requests a second move with
# whatever else the machine runs. A private server (initdb in a temporary folder, fsync off)
# runs under valgrind (cachegrind, no cache simulation); psql sends each statement K times
# (prepared, simple protocol) and the backend's instruction count is read when it exits; each
# figure is (count with K statements - count without) / K, so that connecting and preparing
# cancel out. Needs valgrind and PostgreSQL's binaries; as root, the server runs as `postgres`.
#
#   benches/pg-instructions.sh [K]                       # this tree's schema and statements
#   SCHEMA=old.sql CALL=from benches/pg-instructions.sh  # another schema; functions called in FROM
#
# CALL=from calls the functions as `SELECT * FROM f(...)` (the store before issue 44's cut);
# CALL=select calls both in the select list (the store at 08d1a57, the complete a function
# call); the default sends the statements this tree's store sends: the claim function in the
# select list, the complete of a live claim as a plain UPDATE.
set -euo pipefail
k=${1:-1000}
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
schema=${SCHEMA:-$(dirname "$0")/../sql/postgres.sql}
dir=$(mktemp -d)
as=(); [ "$(id -u)" -eq 0 ] && { chown postgres "$dir"; as=(runuser -u postgres --); }
port=$((20000 + RANDOM % 20000))
"${as[@]}" "$bin/initdb" --auth=trust --username=postgres --no-sync -D "$dir/data" > /dev/null
"${as[@]}" valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file="$dir/cg.%p" \
  "$bin/postgres" -D "$dir/data" -p "$port" -c listen_addresses=127.0.0.1 -k "$dir" \
  -c fsync=off -c synchronous_commit=off -c autovacuum=off > "$dir/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 120); do "$bin/pg_isready" -q -h 127.0.0.1 -p "$port" && break; sleep 0.5; done
sql() { psql -qAt -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$port" -U postgres "$@"; }
sql postgres -c "CREATE DATABASE bench" > /dev/null
PGOPTIONS="-c client_min_messages=warning" sql bench -f "$schema" > /dev/null
sql bench -c 'CREATE TABLE floor (key TEXT PRIMARY KEY, state "char" NOT NULL, response BYTEA)'

hex() { printf "'\\\\x%s'::bytea" "$(printf "$1%.0s" $(seq "$2"))"; }
fp=$(hex ab 32) owner=$(hex cd 16) response=$(hex ef 350) short=$(hex ef 40)
claim="SELECT (r).outcome, (r).response, (r).remaining_ms FROM (SELECT idempotency_records_claim(\$1, $fp, $owner, 30000, 60000, false, 0, 500) AS r) AS called"
# The complete of a live claim, as this tree's store sends it (schema.rs, `complete_live`).
complete="UPDATE idempotency_records SET state = 'C', fingerprint = $fp, response = $response, lease_until = NULL, expires_at = clock_timestamp() + 86400000 * INTERVAL '1 millisecond', waited = CASE WHEN waited THEN pg_notify('idempotency_records_settled', \$1) IS NOT NULL ELSE false END WHERE key = \$1 AND state = 'P' AND owner = $owner AND expires_at > clock_timestamp()"
case ${CALL:-} in
  from)
    claim="SELECT * FROM idempotency_records_claim(\$1, $fp, $owner, 30000, 60000, false, 0, 500)"
    complete="SELECT * FROM idempotency_records_complete(\$1, $owner, $fp, $response, 86400000)" ;;
  select)
    complete="SELECT idempotency_records_complete(\$1, $owner, $fp, $response, 86400000)" ;;
esac
declare -A store=([c]=$claim [d]=$complete [r]=$claim)
declare -A floor=(
  [c]="INSERT INTO floor (key, state) VALUES (\$1, 'P') ON CONFLICT (key) DO UPDATE SET state = 'P'"
  [d]="UPDATE floor SET state = 'C', response = $short WHERE key = \$1"
  [r]="SELECT response FROM floor WHERE key = \$1")

# The backend's instructions for the setup, then `$2` claims, completes or replays.
count() {
  local -n s=$1
  {
    echo "SELECT 'pid', pg_backend_pid();"
    echo "TRUNCATE floor, idempotency_records;"
    for p in c d r; do echo "PREPARE $p(text) AS ${s[$p]};"; done
    echo "EXECUTE c('replay'); EXECUTE d('replay');"
    echo "INSERT INTO floor VALUES ('replay', 'C', $short) ON CONFLICT DO NOTHING;"
    # More than five runs of each, so that every plan is the generic one.
    for i in $(seq 8); do echo "EXECUTE c('w$i'); EXECUTE d('w$i'); EXECUTE r('replay');"; done
    case $2 in
      claims) for i in $(seq "$k"); do echo "EXECUTE c('k$i');"; done ;;
      completes) for i in $(seq "$k"); do echo "EXECUTE c('k$i');"; done
                 for i in $(seq "$k"); do echo "EXECUTE d('k$i');"; done ;;
      replays) for i in $(seq "$k"); do echo "EXECUTE r('replay');"; done ;;
    esac
  } > "$dir/in.sql"
  local pid
  pid=$(sql bench -f "$dir/in.sql" | sed -n 's/^pid|//p')
  for _ in $(seq 100); do
    grep -qs '^summary:' "$dir/cg.$pid" && break
    sleep 0.2
  done
  sed -n 's/^summary: *//p' "$dir/cg.$pid"
}
echo "| statements | claim (new key) | complete | fresh: claim + complete | replay |"
echo "|---|---:|---:|---:|---:|"
for target in floor store; do
  base=$(count $target none) claims=$(count $target claims)
  completes=$(count $target completes) replays=$(count $target replays)
  awk -v t="$target" -v k="$k" -v b="$base" -v c="$claims" -v d="$completes" -v r="$replays" 'BEGIN {
    printf "| %s | %.1fk | %.1fk | %.1fk | %.1fk |\n", t, (c-b)/k/1000, (d-c)/k/1000, (d-b)/k/1000, (r-b)/k/1000 }'
done
