#!/usr/bin/env python3
"""Hand mutants that cargo-mutants cannot make: the Lua scripts, PostgresStore's SQL, and the
MemoryStore fencing comparisons it only flips one way. Each mutant is applied to the working tree, the store
contract suite (and the memory unit tests) run against it, and the file is restored. A
mutant the tests do not catch is a promise no test holds: the script exits non-zero.

    python3 scripts/hand-mutants.py            # every mutant
    python3 scripts/hand-mutants.py release    # those whose name contains "release"
"""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (name, file, original text, mutated text, tests that must catch it)
REDIS = ["--test", "store_contract", "--test", "store_lost_answers", "--", "redis::", "cluster::"]
MEMORY = ["--test", "store_contract", "--test", "store_lost_answers", "--", "memory::"]
LOST = ["--test", "redis_lost_answers"]
WAITING = ["--test", "waiting", "--test", "redis_waiting", "--test", "round_trips", "--", "--skip", "memory::"]
# A mutant's tests are one cargo invocation, or a list of them (a filter applies to every test
# binary of its invocation: tests/postgres.rs runs whole, the shared suites on `postgres::`).
PG = [["--test", "store_contract", "--test", "store_lost_answers", "--test", "conformance",
       "--", "postgres"], ["--test", "postgres"]]
PG_WAITING = [["--test", "waiting", "--", "postgres"], ["--test", "postgres"]]
SQL = "sql/postgres.sql"
SCHEMA_RS = "src/store/postgres/schema.rs"
TXN = [["--test", "transactional"]]
TXN_HTTP = [["--test", "transactional_http"]]
HELD = [["--test", "held_transactions"]]
OPERATOR_REDIS = ["--test", "operator", "--", "redis::", "cluster::"]
OPERATOR_MEMORY = ["--test", "operator", "--", "memory::"]
OPERATOR_PG = ["--test", "operator", "--", "postgres::"]
DEDUP_REDIS = ["--test", "dedup", "--", "redis", "cluster"]
DEDUP_MEMORY = ["--test", "dedup", "--", "memory"]
# Not mutated, being equivalent: dropping `state = 'P'` from the abandoned claims' listing,
# since a completed row and a marker have a NULL `lease_until`.
FLEET = ["--test", "conformance", "--", "the_fleet_registry", "pass_the_kit", "passes_the_kit"]
REGION_MOVES = ["--test", "suite", "--", "regions_moves"]
MUTANTS = [
    ("a RegionalStore's move claims a moving key at its old home alone", "src/store/regional/moving.rs",
     "(next.home_of(key) != self.home_of(key)).then_some(*deploy)", "None::<Deploy>.filter(|_| next.home_of(key) != self.home_of(key))", REGION_MOVES),
    ("a transaction of a key changing home is not refused", "src/store/postgres/transaction.rs",
     "if placed_next && matches!(where_kept, Kept::InRecord(_)) {", "if false && placed_next && matches!(where_kept, Kept::InRecord(_)) {", REGION_MOVES),
    ("a transaction beside the store of a key changing home is refused", "src/store/postgres/transaction.rs",
     "if placed_next && matches!(where_kept, Kept::InRecord(_)) {", "if placed_next {", REGION_MOVES),
    ("a RegionalStore tells its fleet nothing of its region list", "src/store/regional/mod.rs",
     "        Some((self.id(), next))\n", "        drop(next);\n        None\n", REGION_MOVES),
    ("announce.lua shortens an entry another instance announced for longer", "lua/announce.lua",
     "if not kept or tonumber(kept) < untl then", "if true then", FLEET),
    ("PostgreSQL's announce keeps the shorter time of an entry", "src/store/postgres/fleet.rs",
     "SELECT entry, max(until) AS until FROM", "SELECT entry, min(until) AS until FROM", FLEET),
    ("MemoryStore's announce shortens an entry", "src/store/memory/mod.rs",
     "*kept = (*kept).max(until);", "*kept = until;", FLEET),
    ("complete.lua without the owner comparison", "lua/complete.lua",
     "\n      or string.sub(record, 35, 50) ~= ARGV[1] then", " then", REDIS),
    ("complete.lua over another version's record", "lua/complete.lua",
     "\n      or string.sub(record, 1, 1) ~= string.sub(completed, 1, 1)", "", REDIS),
    ("complete.lua over a completed record", "lua/complete.lua",
     "  if state ~= 'P' and state ~= 'W' then\n    return 0\n  end\n", "", REDIS),
    ("release.lua without the owner comparison", "lua/release.lua",
     "\n    or string.sub(record, 35, 50) ~= ARGV[1] then\n  return 0", " then\n  return 0", REDIS),
    ("release.lua of a completed record", "lua/release.lua",
     "if state ~= 'P' and state ~= 'W' then\n  return 0\nend\n", "", REDIS),
    ("touch.lua of a completed record", "lua/touch.lua",
     "if state ~= 'P' and state ~= 'W' then\n  return 0\nend\n", "", REDIS),
    ("release.lua deleting whatever is under the key", "lua/release.lua",
     "local record = redis.pcall('GET', key)\n",
     "local record = redis.pcall('GET', key)\nredis.call('DEL', key)\nif true then return 1 end\n",
     REDIS),
    ("touch.lua without the owner comparison", "lua/touch.lua",
     "\n    or string.sub(record, 35, 50) ~= ARGV[1] then\n  return 0", " then\n  return 0", REDIS),
    ("claim.lua taking over before the deadline", "lua/claim.lua",
     "if now < deadline then", "if false then", REDIS),
    ("claim.lua never taking over", "lua/claim.lua",
     "if now < deadline then", "if true then", REDIS),
    ("claim.lua answering a takeover as a plain claim", "lua/claim.lua",
     "answer = 5", "answer = 0", REDIS),
    ("claim.lua replaying without the record's time to live", "lua/claim.lua",
     "return {1, record, redis.call('PTTL', key)}", "return {1, record, -1}", REDIS),
    ("claim.lua keeping records no longer than their lease", "lua/claim.lua",
     "'PX', ARGV[6])", "'PX', ARGV[3])", REDIS),
    ("claim.lua reporting the time to the end of the window", "lua/claim.lua",
     "return {3, deadline - now}", "return {3, redis.call('PTTL', key)}", REDIS),
    ("claim.lua taking over for another fingerprint", "lua/claim.lua",
     "    if string.sub(record, 3, 34) ~= ARGV[1] then\n      return {2}\n    end\n", "", REDIS),
    ("touch.lua keeping the old deadline", "lua/touch.lua",
     "string.sub(record, 1, 50) .. string.format('%.0f', now + lease)", "record", REDIS),
    ("touch.lua without the recovery window", "lua/touch.lua",
     "math.max(lease + tonumber(ARGV[4]), 1)", "math.max(lease, 1)", REDIS),
    ("MemoryStore taking over before the deadline", "src/store/memory/mod.rs",
     "State::InProgress { deadline, .. } if *deadline > now =>", "State::InProgress { deadline, .. } if false =>", MEMORY),
    ("MemoryStore takeover keeping the old expiry", "src/store/memory/mod.rs",
     "                    record.expires_at = later(*deadline, lease.recovery_window);\n                    Claim::TakenOver",
     "                    Claim::TakenOver", MEMORY),
    ("MemoryStore takeover keeping the old owner", "src/store/memory/mod.rs",
     "                    *holder = owner.clone();\n", "                    let _ = (&holder, owner);\n", MEMORY),
    ("MemoryStore touch keeping the old deadline", "src/store/memory/mod.rs",
     "                *deadline = later(Instant::now(), lease.duration);\n", "", MEMORY),
    ("claim.lua replaying an in-progress record", "lua/claim.lua",
     "if state == 'C' then", "if true then", REDIS),
    ("claim.lua never marking a waited record", "lua/claim.lua",
     "      if state == 'P' and ARGV[5] == '1' then\n        redis.call('SETRANGE', key, 1, 'W')\n      end\n      return {3, deadline - now}",
     "      return {3, deadline - now}", WAITING),
    ("complete.lua never publishing", "lua/complete.lua",
     "if waited then", "if false then", WAITING),
    ("release.lua never publishing", "lua/release.lua",
     "if state == 'W' then", "if false then", WAITING),
    ("complete.lua publishing for every record", "lua/complete.lua",
     "if waited then", "if true then", WAITING),
    ("MemoryStore complete waking nobody", "src/store/memory/mod.rs",
     "        drop(records);\n        self.waiters.notify(key.as_str());\n", "", ["--test", "waiting", "--", "memory::"]),
    ("MemoryStore::complete without the owner comparison", "src/store/memory/mod.rs",
     "Some(Record { state: State::InProgress { owner: holder, .. }, .. })\n                if holder == owner => {}",
     "Some(Record { state: State::InProgress { .. }, .. }) => {}", MEMORY),
    ("MemoryStore release/touch without the owner comparison", "src/store/memory/mod.rs",
     "Some(Record { state: State::InProgress { owner: holder, .. }, .. }) if holder == owner\n",
     "Some(Record { state: State::InProgress { .. }, .. })\n", MEMORY),
    ("MemoryStore release/touch of any live record", "src/store/memory/mod.rs",
     "Some(Record { state: State::InProgress { owner: holder, .. }, .. }) if holder == owner\n",
     "Some(_)\n", MEMORY),
    ("MemoryStore complete refusing its own response stored already", "src/store/memory/mod.rs",
     "                if *stored == response && held == fingerprint =>", "                if false =>", MEMORY),
    ("MemoryStore complete accepting another response stored already", "src/store/memory/mod.rs",
     "                if *stored == response && held == fingerprint =>", "                if held == fingerprint =>", MEMORY),
    ("abandon.lua leaving no marker on an absent key", "lua/abandon.lua",
     "  redis.call('SET', key, ARGV[3] .. 'X' .. ARGV[2] .. ARGV[1], 'PX', ARGV[5])\n", "", REDIS),
    ("abandon.lua without the owner comparison", "lua/abandon.lua",
     "\n    or string.sub(record, 35, 50) ~= ARGV[1] then\n  return 0", " then\n  return 0", REDIS),
    ("abandon.lua of a completed record", "lua/abandon.lua",
     "if state ~= 'P' and state ~= 'W' then\n  return 0\nend\n", "", REDIS),
    ("abandon.lua deleting what a window should keep", "lua/abandon.lua",
     "if window > 0 then", "if false then", REDIS),
    ("abandon.lua keeping the lease running", "lua/abandon.lua",
     "string.sub(record, 1, 50) .. string.format('%.0f', now)", "record", REDIS),
    ("claim.lua letting the abandoned claim land", "lua/claim.lua",
     "if string.sub(record, 35, 50) == ARGV[2] then", "if false then", REDIS),
    ("claim.lua reading a marker as a foreign value", "lua/claim.lua",
     "if state == 'X' and #record == 50 then", "if false then", REDIS),
    ("complete.lua refusing its own response stored already", "lua/complete.lua",
     "  if record == completed then\n    return 2\n  end\n", "", REDIS),
    ("complete.lua reading a marker as a foreign value", "lua/complete.lua",
     "  record = false\n", "  record = record\n", REDIS),
    ("claim.lua ignoring its deadline", "lua/claim.lua",
     "local not_after = tonumber(ARGV[7]) or 0", "local not_after = 0", LOST),
    # One deadline check, which a claim of an absent key, a takeover and a marker's reclaim
    # share: the comparison turned around lets every claim past its deadline land.
    ("claim.lua claiming past its deadline", "lua/claim.lua",
     "if not_after > 0 and now > not_after then", "if not_after > 0 and now < not_after then", LOST),
    ("the guard releasing rather than abandoning", "src/engine/settle.rs",
     "        match store.abandon(key, owner, fingerprint, lease).await {",
     "        match store.release(key, owner).await {", LOST),
    ("the guard trying once", "src/engine/settle.rs",
     "            Err(error) if tokio::time::Instant::now() + delay >= give_up_at => {",
     "            Err(error) if true => {", LOST),
    ("postgres complete without the owner comparison", SQL,
     "expires_at = v_expires_at\n    WHERE key = p_key AND state = 'P' AND owner = p_owner AND",
     "expires_at = v_expires_at\n    WHERE key = p_key AND state = 'P' AND", PG),
    ("postgres complete taking any row of its fingerprint for its own response", SQL,
     "outcome := CASE WHEN r.state = 'C' AND r.owner = p_owner AND r.response = p_response",
     "outcome := CASE WHEN true", PG),
    ("postgres complete answering 'already stored' to another owner", SQL,
     "WHEN r.state = 'C' AND r.owner = p_owner AND", "WHEN r.state = 'C' AND", PG),
    # The transactional path (PostgresStore::transaction): the commit's owner fence, the lock a
    # claim does not wait on past half its timeout, the abandoned transaction the database ends,
    # the commit's NOTIFY, and a completed row (which keeps its owner) that no renewal or
    # release of that owner touches. Not mutated, being equivalent: dropping `state = 'P'`
    # from the commit's WHERE (the same owner cannot commit twice: the claim's transaction is
    # refused after a commit, before any SQL).
    ("postgres commit without the owner comparison", SQL,
     "p_retention_ms * INTERVAL '1 millisecond'\n    WHERE key = p_key AND state = 'P' AND owner = p_owner AND",
     "p_retention_ms * INTERVAL '1 millisecond'\n    WHERE key = p_key AND state = 'P' AND", TXN),
    ("postgres claim waiting on a locked row", SQL,
     "    PERFORM set_config('lock_timeout', p_lock_ms::text, true);\n", "", TXN_HTTP),
    ("postgres commit leaving an abandoned transaction its row lock", SQL,
     "    PERFORM set_config('idle_in_transaction_session_timeout', p_idle_ms::text, true);\n",
     "", TXN_HTTP),
    ("postgres commit never notifying", SQL,
     "    IF v_waited THEN\n        PERFORM pg_notify('idempotency_records_settled', p_key);\n    END IF;\n    PERFORM set_config",
     "    PERFORM set_config", TXN_HTTP),
    ("postgres touch of a completed record", SQL,
     "WHERE key = p_key AND state = 'P' AND owner = p_owner AND expires_at > v_now;",
     "WHERE key = p_key AND owner = p_owner AND expires_at > v_now;",
     # The kit's touch of a completed record by its owner (PostgreSQL keeps the owner on it).
     TXN_HTTP + [["--test", "conformance", "--", "postgres"]]),
    ("postgres release of a completed record", SQL,
     "DELETE FROM idempotency_records WHERE key = p_key AND state = 'P' AND owner = p_owner",
     "DELETE FROM idempotency_records WHERE key = p_key AND owner = p_owner", TXN_HTTP),
    ("postgres migrate without its advisory lock", "src/store/postgres/calls.rs",
     "\"SELECT pg_advisory_xact_lock(hashtext('axum-idempotency:{table}'));\\n\\\n", "\"\\\n",
     [["--test", "postgres"]]),
    ("postgres migrate running its schema when it is current", "src/store/postgres/calls.rs",
     "if bounded(timeout, is_current.fetch_one(pool)).await? {",
     "if bounded(timeout, is_current.fetch_one(pool)).await? && false {", HELD),
    ("postgres migrate waiting for a table's lock without a limit", "src/store/postgres/calls.rs",
     "SET LOCAL lock_timeout = {wait};", "SET LOCAL lock_timeout = {wait}0000;", HELD),
    ("postgres claim taking over a lapsed lease its holder's transaction holds", SQL,
     "            IF NOT pg_try_advisory_xact_lock(p_lock) THEN\n                outcome := 3;\n                remaining_ms := 200;\n                RETURN;\n            END IF;\n            IF v_late THEN\n                outcome := 6;\n                RETURN;\n            END IF;\n            -- The lease lapsed",
     "            IF v_late THEN\n                outcome := 6;\n                RETURN;\n            END IF;\n            -- The lease lapsed",
     HELD),
    ("postgres claim marking waited a record its holder's transaction holds", SQL,
     "        IF p_waiting AND NOT r.waited THEN\n            IF NOT pg_try_advisory_xact_lock",
     "        IF p_waiting AND NOT r.waited THEN\n            IF false AND NOT pg_try_advisory_xact_lock",
     HELD),
    ("postgres transaction without the key's lock", "src/store/postgres/transaction/key_lock.rs",
     "SELECT pg_advisory_lock($1)", "SELECT $1::int8", HELD),
    ("checkpoints mark without the idle limit", "src/durable/checkpoints.rs",
     "RETURNING set_config('idle_in_transaction_session_timeout', $6, true)",
     "RETURNING $6::text", HELD),
    ("settle not waiting for the operation's context", "src/store/transaction/slot.rs",
     "_ if state.context_alive && tokio::time::Instant::now() < give_up => true,",
     "_ if false => true,", HELD),
    ("engine running a claim answered too late to hold its lease", "src/engine/claim_once.rs",
     "            && !heard_in_time(sent.elapsed(), lease.duration)\n",
     "            && !heard_in_time(sent.elapsed(), lease.duration)\n            && false\n",
     [["--test", "suite", "--", "late_claim_answers::"]]),
    ("engine abandoning a claim that was never sent", "src/engine/claim_once.rs",
     " && !error.was_never_sent()) {", ") {",
     [["--test", "suite", "--", "redis_connections::a_redis_gone"]]),
    ("a near cache hiding that its store commits in transactions", "src/store/caching.rs",
     "        self.inner.commits_in_transactions()\n", "        false\n", HELD),
    ("a transaction begun after its door settled", "src/store/transaction/slot.rs",
     "        if state.closed {", "        if false {", HELD),
    ("recovery points resumed for another request", "src/durable/checkpoints.rs",
     "SELECT result, fingerprint = $3 FROM", "SELECT result, true FROM", [["--test", "suite", "--", "recovery_points::"]]),
    ("recovery points kept past the key's retention", "src/durable/checkpoints.rs",
     "            .bind(millis(context.retention()))\n",
     "            .bind(millis(Duration::from_secs(86_400)))\n", [["--test", "suite", "--", "recovery_points::"]]),
    # The complete of the owner's live claim, a plain statement (the function's first update,
    # which stays in the function for the previous version's instances: the mutants above of
    # its owner comparison and its notification). Not mutated, being equivalent: dropping
    # `expires_at > clock_timestamp()` from it, since the function completes an expired claim
    # of any owner too (the update would only keep the row's `waited`, which a completed row
    # ignores).
    ("postgres complete of a live claim without the owner comparison", SCHEMA_RS,
     "AND state = 'P' AND owner = $2 AND expires_at", "AND state = 'P' AND expires_at", PG),
    ("postgres complete of a live claim over a completed record", SCHEMA_RS,
     "WHERE key = $1 AND state = 'P' AND owner = $2", "WHERE key = $1 AND owner = $2", PG),
    ("postgres complete of a live claim without its retention", SCHEMA_RS,
     "expires_at = clock_timestamp() + $5 * INTERVAL '1 millisecond'",
     "expires_at = clock_timestamp()", PG),
    ("postgres complete of a live claim never notifying", SCHEMA_RS,
     "waited = CASE WHEN waited THEN", "waited = CASE WHEN false THEN", PG_WAITING),
    ("postgres complete of a live claim notifying for every record", SCHEMA_RS,
     "waited = CASE WHEN waited THEN", "waited = CASE WHEN true THEN", PG_WAITING),
    ("postgres complete refusing its own response stored already", SQL,
     "THEN 2 ELSE 0 END", "THEN 0 ELSE 0 END", PG),
    ("postgres complete reading a marker as a record", SQL,
     "IF NOT FOUND OR r.expires_at <= v_now OR r.state = 'X' THEN", "IF NOT FOUND OR r.expires_at <= v_now THEN", PG),
    ("postgres release without the owner comparison", SQL,
     "AND state = 'P' AND owner = p_owner\n        AND expires_at > clock_timestamp()",
     "AND state = 'P'\n        AND expires_at > clock_timestamp()", PG),
    ("postgres release of an expired record", SQL,
     "AND state = 'P' AND owner = p_owner\n        AND expires_at > clock_timestamp()",
     "AND state = 'P' AND owner = p_owner", PG),
    ("postgres touch without the owner comparison", SQL,
     "WHERE key = p_key AND state = 'P' AND owner = p_owner AND expires_at > v_now;",
     "WHERE key = p_key AND state = 'P' AND expires_at > v_now;", PG),
    ("postgres touch keeping the old deadline", SQL,
     "    UPDATE idempotency_records SET lease_until = v_lease_until,\n",
     "    UPDATE idempotency_records SET lease_until = lease_until,\n", PG),
    ("postgres touch without the recovery window", SQL,
     "        expires_at = v_lease_until + p_window_ms * INTERVAL '1 millisecond'\n    WHERE",
     "        expires_at = v_lease_until\n    WHERE", PG),
    ("postgres claim taking over before the deadline", SQL,
     "IF r.lease_until <= v_now THEN", "IF true THEN", PG),
    ("postgres claim never taking over", SQL,
     "IF r.lease_until <= v_now THEN", "IF false THEN", PG),
    ("postgres claim answering a takeover as a plain claim", SQL,
     "            outcome := 5;", "            outcome := 0;", PG),
    # A claim's lease, window and deadline are written twice: in the insert of a new key, and
    # in the long way's variables (a takeover, a reclaim of an expired record or a marker).
    ("postgres claim keeping records no longer than their lease, the long way", SQL,
     "    v_expires_at := v_lease_until + p_window_ms * INTERVAL '1 millisecond';",
     "    v_expires_at := v_lease_until;", PG),
    ("postgres claim keeping a new key no longer than its lease", SQL,
     "            v_now + p_lease_ms * INTERVAL '1 millisecond' + p_window_ms * INTERVAL '1 millisecond',\n",
     "            v_now + p_lease_ms * INTERVAL '1 millisecond',\n", PG),
    ("postgres claim inserting a new key with its lease over", SQL,
     "NULL,\n            v_now + p_lease_ms * INTERVAL '1 millisecond',\n",
     "NULL,\n            v_now,\n", PG),
    ("postgres claim taking over for another fingerprint", SQL,
     "        IF r.fingerprint <> p_fingerprint THEN\n            outcome := 2;\n            RETURN;\n        END IF;\n", "", PG),
    ("postgres claim replaying another fingerprint's response, unlocked", SQL,
     "        IF r.fingerprint <> p_fingerprint THEN\n            outcome := 2;\n        ELSE",
     "        IF false THEN\n            outcome := 2;\n        ELSE", PG),
    ("postgres claim replaying an expired record, unlocked", SQL,
     "    ELSIF r.state = 'C' AND r.expires_at > v_now THEN",
     "    ELSIF r.state = 'C' THEN", PG),
    ("postgres claim inserting a new key past its deadline", SQL,
     "        WHERE p_not_after_ms <= 0 OR extract(epoch FROM v_now) * 1000 <= p_not_after_ms\n",
     "        WHERE true\n", PG),
    ("postgres claim answering an insert that found a row as a claim", SQL,
     "        ON CONFLICT (key) DO NOTHING;\n        IF FOUND THEN", "        ON CONFLICT (key) DO NOTHING;\n        IF true THEN", PG),
    ("postgres claim replaying an in-progress record", SQL,
     "        IF r.state = 'C' THEN\n            outcome := 1;", "        IF true THEN\n            outcome := 1;", PG),
    ("postgres claim ignoring its deadline", SQL,
     "v_late := p_not_after_ms > 0 AND", "v_late := false AND", PG),
    ("postgres claim letting the abandoned claim land", SQL,
     "        IF r.state = 'X' THEN\n            -- This very claim", "        IF false THEN\n            -- This very claim", PG),
    ("postgres claim reading another claim's marker as a record", SQL,
     "IF v_absent OR r.expires_at <= v_now OR (r.state = 'X' AND r.owner <> p_owner) THEN",
     "IF v_absent OR r.expires_at <= v_now THEN", PG),
    ("postgres claim never marking a waited record", SQL,
     "IF p_waiting AND NOT r.waited THEN", "IF false THEN", PG_WAITING),
    ("postgres complete never notifying", SQL,
     "        IF v_waited THEN\n            PERFORM", "        IF false THEN\n            PERFORM", PG_WAITING),
    ("postgres release never notifying", SQL,
     "    IF v_waited THEN\n        PERFORM pg_notify('idempotency_records_settled', p_key);\n    END IF;\n    outcome := 1;",
     "    outcome := 1;", PG_WAITING),
    ("postgres abandon leaving no marker on an absent key", SQL,
     "                v_now + p_marker_ms * INTERVAL '1 millisecond', false)", "                v_now, false)", PG),
    ("postgres abandon without the owner comparison", SQL,
     "IF r.state <> 'P' OR r.owner <> p_owner THEN", "IF r.state <> 'P' THEN", PG),
    ("postgres abandon of a completed record", SQL,
     "IF r.state <> 'P' OR r.owner <> p_owner THEN", "IF r.owner <> p_owner THEN", PG),
    ("postgres abandon deleting what a window should keep", SQL,
     "IF p_window_ms > 0 THEN", "IF false THEN", PG),
    ("postgres abandon keeping the lease running", SQL,
     "            UPDATE idempotency_records SET lease_until = v_now,\n",
     "            UPDATE idempotency_records SET lease_until = lease_until,\n", PG),
    ("postgres sweep deleting live records", "src/store/postgres/schema.rs",
     "WHERE expires_at <= clock_timestamp() LIMIT $1", "WHERE true LIMIT $1", [["--test", "postgres"]]),
    ("postgres abandoned claims whatever their lapse", "src/store/postgres/schema.rs",
     "clock_timestamp() - $1 * interval '1 millisecond'",
     "clock_timestamp() - $1 * interval '0 millisecond'", [["--test", "suite", "--", "completer::"]]),
    ("postgres abandoned claims whose lease still runs", "src/store/postgres/schema.rs",
     "AND lease_until <= clock_timestamp() - $1", "AND lease_until <= clock_timestamp() + interval '1 hour' + $1",
     [["--test", "suite", "--", "completer::"]]),
    ("postgres abandoned claims past their window", "src/store/postgres/schema.rs",
     "AND expires_at > clock_timestamp() ORDER BY", "ORDER BY", [["--test", "suite", "--", "completer::"]]),
    ("postgres abandoned claims newest first", "src/store/postgres/schema.rs",
     "ORDER BY lease_until LIMIT $2", "ORDER BY lease_until DESC LIMIT $2", [["--test", "suite", "--", "completer::"]]),
    ("durable outcomes overwriting another holder's live outcome", "src/durable/outcomes.rs",
     "WHERE t.expires_at <= clock_timestamp()", "WHERE true", [["--test", "suite", "--", "durable::"]]),
    ("durable outcomes answering an expired outcome", "src/durable/outcomes.rs",
     "WHERE key = $1 AND expires_at > clock_timestamp()", "WHERE key = $1", [["--test", "suite", "--", "durable::"]]),
    ("recovery points marking a step twice", "src/durable/checkpoints.rs",
     "WHERE t.expires_at <= clock_timestamp()", "WHERE true", [["--test", "suite", "--", "durable::"]]),
    ("recovery points answering an expired step", "src/durable/checkpoints.rs",
     "WHERE key_hash = $1 AND step = $2 AND expires_at > clock_timestamp()",
     "WHERE key_hash = $1 AND step = $2", [["--test", "suite", "--", "durable::"]]),
    ("MemoryStore sweep keeping only records expiring now", "src/store/memory/mod.rs",
     "records.map.retain(|_, record| record.expires_at > now);",
     "records.map.retain(|_, record| record.expires_at == now);",
     ["--lib", "store::memory"]),
    # The operator's calls (store::Admin): forget's refusal of a running record, its wake-up of
    # the waiters, inspect's lease arithmetic, and the abandoned listing's lapse, on each store.
    ("forget.lua deleting a running record unforced", "lua/forget.lua",
     "if running and ARGV[2] ~= '1' then", "if false then", OPERATOR_REDIS),
    ("forget.lua refusing a lapsed record", "lua/forget.lua",
     "running = deadline == nil\n      or deadline >", "running = true or deadline >", OPERATOR_REDIS),
    ("forget.lua waking nobody", "lua/forget.lua",
     "  redis.call(ARGV[3], KEYS[2], 'forgotten')\n", "", OPERATOR_REDIS),
    ("forget.lua deleting an abandoned claim's marker", "lua/forget.lua",
     "if state == 'X' then\n  return 0\nend\n", "", [["--test", "store_contract", "--", "redis::"], OPERATOR_REDIS]),
    ("inspect.lua with the lease's sign turned", "lua/inspect.lua",
     "left = deadline - (", "left = -deadline + 2 * (", OPERATOR_REDIS),
    ("inspect.lua answering the record for a marker", "lua/inspect.lua",
     "if state == 'X' and #record == 50 then\n  return {0}\nend\n", "", OPERATOR_REDIS),
    ("postgres forget refusing a lapsed record", "src/store/postgres/schema.rs",
     "OR found.lease_until <= clock_timestamp() OR $2", "OR $2", OPERATOR_PG),
    ("postgres forget unforced deleting a running record", "src/store/postgres/schema.rs",
     "OR found.lease_until <= clock_timestamp() OR $2", "OR true", OPERATOR_PG),
    ("postgres forget waking nobody", "src/store/postgres/admin.rs",
     "        if waited {\n", "        if false {\n", OPERATOR_PG),
    ("postgres inspect reading a lapsed lease as running", "src/store/postgres/schema.rs",
     "(extract(epoch FROM lease_until - clock_timestamp()) * 1000)::int8, waited",
     "abs(extract(epoch FROM lease_until - clock_timestamp()) * 1000)::int8, waited", OPERATOR_PG),
    ("MemoryStore forget deleting a running record unforced", "src/store/memory/admin.rs",
     "if *deadline > now && !force =>", "if false =>", OPERATOR_MEMORY),
    ("MemoryStore forget refusing a lapsed record", "src/store/memory/admin.rs",
     "if *deadline > now && !force =>", "if !force =>", OPERATOR_MEMORY),
    ("MemoryStore forget waking nobody", "src/store/memory/admin.rs",
     "if forgotten == Forgotten::Deleted {", "if false {", OPERATOR_MEMORY),
    ("MemoryStore abandoned whatever the lapse", "src/store/memory/admin.rs",
     "(lapsed >= lapsed_for)", "(lapsed >= Duration::ZERO)", OPERATOR_MEMORY),
    ("MemoryStore abandoned newest first", "src/store/memory/admin.rs",
     "lapsed.sort_by_key(|claim| std::cmp::Reverse(claim.lapsed_for));",
     "lapsed.sort_by_key(|claim| claim.lapsed_for);", OPERATOR_MEMORY),
    # The dedup door's stores: a marker set only when absent, a bucket entry added only when
    # absent from its three sets, and the set's expiry.
    ("dedup.lua checking its own bucket alone", "lua/dedup.lua",
     "for i = 1, 3 do", "for i = 2, 2 do", DEDUP_REDIS),
    ("dedup.lua without the set's expiry", "lua/dedup.lua",
     "redis.call('PEXPIREAT', KEYS[2], ARGV[1])\n", "", DEDUP_REDIS),
    ("bloom.lua checking its own filter alone", "lua/bloom.lua",
     "    if present[i] then", "    if present[i] and i == 2 then", DEDUP_REDIS),
    ("bloom.lua reading one bit of an event's", "lua/bloom.lua",
     "for h = 1, k do\n        if redis.call('GETBIT'", "for h = 1, 1 do\n        if redis.call('GETBIT'",
     DEDUP_REDIS),
    ("bloom.lua setting no bits", "lua/bloom.lua",
     "redis.call('BITFIELD', KEYS[2], unpack(set))", "", DEDUP_REDIS),
    ("bloom.lua growing its filter bit by bit", "lua/bloom.lua",
     "redis.call('SET', KEYS[2], string.rep('\\0', tonumber(ARGV[3])))", "", DEDUP_REDIS),
    ("bloom.lua without the filter's expiry", "lua/bloom.lua",
     "redis.call('PEXPIREAT', KEYS[2], ARGV[1])\n", "", DEDUP_REDIS),
    ("evalsha not loading the script on NOSCRIPT", "src/store/redis/scripts.rs",
     "ErrorKind::Server(ServerErrorKind::NoScript) =>",
     "ErrorKind::Server(ServerErrorKind::NoScript) && false =>", [["--test", "suite", "--", "cluster::"]]),
    ("RedisStore marker set whether or not present", "src/store/redis/dedup.rs",
     '.arg("NX")\n', "\n", DEDUP_REDIS),
    ("Dedup buckets kept one window short", "src/dedup/events.rs",
     "(number + 3) * window_ms", "(number + 2) * window_ms", DEDUP_REDIS),
    ("Dedup refusing by its own bucket's expiry, not the one before", "src/dedup/events.rs",
     "bucket.number.saturating_sub(1) * window_ms", "bucket.number * window_ms", DEDUP_MEMORY),
    ("Dedup not checking the bucket before", "src/dedup/mod.rs",
     "[key(bucket.saturating_sub(1)), key(bucket), key(bucket + 1)]",
     "[key(bucket), key(bucket), key(bucket + 1)]", DEDUP_MEMORY),
    ("Dedup not checking the bucket after", "src/dedup/mod.rs",
     "[key(bucket.saturating_sub(1)), key(bucket), key(bucket + 1)]",
     "[key(bucket.saturating_sub(1)), key(bucket), key(bucket)]", DEDUP_MEMORY),
    ("MemoryStore dedup checking its own bucket alone", "src/store/memory/dedup.rs",
     "!batch.sets.iter().any(", "!batch.sets[1..2].iter().any(", DEDUP_MEMORY),
    ("MemoryStore filter checking its own bucket alone", "src/store/memory/dedup.rs",
     "if batch.filters.iter().any(", "if batch.filters[1..2].iter().any(", DEDUP_MEMORY),
    ("MemoryStore filter seen by any one bit", "src/store/memory/dedup.rs",
     "positions.iter().all(|&bit|", "positions.iter().any(|&bit|", DEDUP_MEMORY),
    ("MemoryStore filter setting no bits", "src/store/memory/dedup.rs",
     "*word |= 1 << (bit % 64);", "*word |= 0;", DEDUP_MEMORY),
    ("MemoryStore marker set whether or not present", "src/store/memory/dedup.rs",
     "Some(at) if *at > now => false,", "Some(at) if false && *at > now => false,", DEDUP_MEMORY),
    ("RedisStore abandoned whatever the lapse", "src/store/redis/admin.rs",
     "&& lapsed >= lapsed_for", "&& lapsed >= Duration::ZERO", OPERATOR_REDIS),
]


def run(mutant):
    name, path, original, mutated, tests = mutant
    file = ROOT / path
    source = file.read_text()
    if source.count(original) != 1:
        sys.exit(f"{name}: the original text is not in {path} exactly once; update this script")
    file.write_text(source.replace(original, mutated))
    invocations = tests if isinstance(tests[0], list) else [tests]
    try:
        caught = False
        for invocation in invocations:
            targets = invocation[:invocation.index("--")] if "--" in invocation else invocation
            built = subprocess.run(
                ["cargo", "test", "--all-features", "--no-run", "-q", *targets],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if built.returncode != 0:
                sys.exit(f"{name}: the mutant does not build; fix this script")
            result = subprocess.run(
                ["cargo", "test", "--all-features", "-q", *invocation],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if result.returncode != 0:
                caught = True
                break
    finally:
        file.write_text(source)
    return caught


def main():
    wanted = sys.argv[1] if len(sys.argv) > 1 else ""
    survivors = []
    for mutant in MUTANTS:
        if wanted not in mutant[0]:
            continue
        caught = run(mutant)
        print(f"{'caught  ' if caught else 'MISSED  '} {mutant[0]}", flush=True)
        if not caught:
            survivors.append(mutant[0])
    if survivors:
        sys.exit(f"{len(survivors)} hand mutant(s) survived")


if __name__ == "__main__":
    main()
