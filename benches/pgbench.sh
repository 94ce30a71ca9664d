#!/usr/bin/env bash
# The database's side of a fresh request, without the app: pgbench runs the PostgreSQL floor's
# two statements, the same two statements on PostgresStore's table (plain SQL: the fewest a
# store with this schema could send), and PostgresStore's two function calls, each on freshly
# truncated tables, 16 clients, prepared statements. Then a replay: the floor's select, a plain
# select of a stored record, and the claim function answering it.
#
#   DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres benches/pgbench.sh [seconds]
#
# It creates the database `axum_idempotency_pgbench` on that server and drops it at the end.
set -euo pipefail
export PGOPTIONS="-c client_min_messages=warning"
admin=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
seconds=${1:-8}
db=axum_idempotency_pgbench
url=${admin%/*}/$db
dir=$(mktemp -d)
trap 'psql -q "$admin" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)"; rm -rf "$dir"' EXIT
psql -q "$admin" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db"
psql -q "$url" -f "$(dirname "$0")/../sql/postgres.sql"
psql -q "$url" -c 'CREATE TABLE floor (key TEXT PRIMARY KEY, state "char" NOT NULL, response BYTEA)'

hex() { printf "'\\\\x%s'::bytea" "$(printf "$1%.0s" $(seq "$2"))"; }
fp=$(hex ab 32) owner=$(hex cd 16) response=$(hex ef 350) short=$(hex ef 40)
key="'k:' || :k"
cat > "$dir/floor.sql" <<SQL
\set k random(1, 1000000000000)
INSERT INTO floor (key, state) VALUES ($key, 'P') ON CONFLICT (key) DO UPDATE SET state = 'P';
UPDATE floor SET state = 'C', response = $short WHERE key = $key;
SQL
cat > "$dir/plain.sql" <<SQL
\set k random(1, 1000000000000)
INSERT INTO idempotency_records (key, state, fingerprint, owner, lease_until, expires_at) VALUES ($key, 'P', $fp, $owner, clock_timestamp() + interval '30 s', clock_timestamp() + interval '90 s') ON CONFLICT (key) DO NOTHING;
UPDATE idempotency_records SET state = 'C', owner = NULL, response = $response, lease_until = NULL, expires_at = clock_timestamp() + interval '1 day' WHERE key = $key AND state = 'P' AND owner = $owner AND expires_at > clock_timestamp();
SQL
# As the store calls them (src/store/postgres/schema.rs): in the select list.
cat > "$dir/functions.sql" <<SQL
\set k random(1, 1000000000000)
SELECT (r).outcome, (r).response, (r).remaining_ms FROM (SELECT idempotency_records_claim($key, $fp, $owner, 30000, 60000, false, 0, 500) AS r) AS called;
SELECT idempotency_records_complete($key, $owner, $fp, $response, 86400000);
SQL
echo "SELECT response FROM floor WHERE key = 'replay';" > "$dir/floor-replay.sql"
echo "SELECT state, fingerprint, response, expires_at FROM idempotency_records WHERE key = 'replay';" > "$dir/plain-replay.sql"
echo "SELECT (r).outcome, (r).response, (r).remaining_ms FROM (SELECT idempotency_records_claim('replay', $fp, $owner, 30000, 60000, false, 0, 500) AS r) AS called;" > "$dir/functions-replay.sql"

run() {
  psql -q "$url" -c "TRUNCATE floor, idempotency_records" -c "CHECKPOINT" \
    -c "INSERT INTO floor VALUES ('replay', 'C', $short)" \
    -c "SELECT idempotency_records_claim('replay', $fp, $owner, 30000, 60000, false, 0, 500)" \
    -c "SELECT idempotency_records_complete('replay', $owner, $fp, $response, 86400000)" > /dev/null
  local tps
  tps=$(pgbench -n -M prepared -c 16 -j 2 -T "$seconds" -f "$dir/$1.sql" "$url" 2>&1 | sed -n 's/^tps = \([0-9]*\).*/\1/p')
  printf '| %s | %s |\n' "$1" "$tps"
}
echo "| script | transactions/s |"
echo "|---|---:|"
for script in floor plain functions floor-replay plain-replay functions-replay; do run "$script"; done
