-- axum-idempotency: the schema of PostgresStore. `idempotency_records` is the table's name
-- (PostgresStore::with_table chooses another); every statement is safe to run again.
--
-- A row is one record:
--   state 'P'  in progress: `owner` holds it until `lease_until`, and the row is kept until
--              `expires_at` (the lease plus its recovery window) for a takeover
--   state 'C'  completed: `response` is replayed until `expires_at` (the retention)
--   state 'X'  the marker of an abandoned claim (see Store::abandon): `owner`'s claim, landing
--              late, is refused; for every other claim the key is absent
--   state 'F'  a door's fleet registry (Store::announce), under a key of its own prefix
--              (`{prefix}-fleet:{..}`, never a request's): its entries in `response`, a line
--              each, kept until the last of them (`expires_at`)
-- A row whose `expires_at` has passed is absent, whatever it holds; the sweeper deletes it.
-- `waited`: a claim is waiting for this record to settle, so its settle sends a NOTIFY on
-- the channel `idempotency_records_settled` with the key as the payload (on a completed row it
-- means nothing, and is left as it was). Time is always the database's (clock_timestamp()),
-- never the app's.

CREATE TABLE IF NOT EXISTS idempotency_records (
    key TEXT PRIMARY KEY,
    state "char" NOT NULL,
    fingerprint BYTEA NOT NULL,
    owner BYTEA,
    response BYTEA,
    lease_until TIMESTAMPTZ,
    expires_at TIMESTAMPTZ NOT NULL,
    waited BOOLEAN NOT NULL DEFAULT false
);

CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);

-- `state` had a CHECK (state IN ('P', 'C', 'X')) up to this version. Only the functions below
-- write it, each a literal state, and PostgreSQL rebuilds a CHECK's expression from its
-- stored text for every statement that writes the table (in PostgreSQL 15 about 31,000
-- instructions, a sixth of a claim's): a fresh request, a claim and a complete, paid it twice.
-- Dropped where it is still there, and only then: an ALTER TABLE on every start would wait for
-- the table's exclusive lock, and hold every claim back while it waits.
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_constraint WHERE conname = 'idempotency_records_state_check'
            AND conrelid = 'idempotency_records'::regclass) THEN
        ALTER TABLE idempotency_records DROP CONSTRAINT idempotency_records_state_check;
    END IF;
END $$;

-- Claims `p_key` for `p_owner`, or reports what holds it. `p_not_after` is the latest time at
-- which the claim may still be applied (0: none): a claim held up on the wire past it, whose
-- caller gave up, writes nothing. A row that a transaction holds locked past `p_lock_ms` (an
-- operation's commit in flight, or a transaction whose COMMIT was lost with its connection,
-- until the database ends it) is in progress, never an error.
-- outcome: 0 claimed; 1 replay (`response`, `remaining_ms` of retention); 2 mismatch;
-- 3 in progress (`remaining_ms` of lease); 5 taken over; 6 refused (late, or abandoned).
-- `p_lock` names the key's lock, which an operation's transaction holds from before its BEGIN
-- to after its COMMIT (PostgresStore::transaction): a lapsed lease whose lock is held is in
-- progress, never taken over.
-- The claims of the previous versions (7 arguments, no lock wait; 8, no key lock) are left
-- where they are: instances of those versions keep claiming through them during a rolling
-- deploy, and a start of one of them, which replaces its own, leaves this one as it is.
CREATE OR REPLACE FUNCTION idempotency_records_claim(
    p_key TEXT, p_fingerprint BYTEA, p_owner BYTEA, p_lease_ms BIGINT, p_window_ms BIGINT,
    p_waiting BOOLEAN, p_not_after_ms BIGINT, p_lock_ms BIGINT, p_lock BIGINT,
    OUT outcome INT, OUT response BYTEA, OUT remaining_ms BIGINT)
LANGUAGE plpgsql AS $$
DECLARE
    r idempotency_records%ROWTYPE;
    v_absent BOOLEAN;
    v_now TIMESTAMPTZ := clock_timestamp();
    v_late BOOLEAN;
    v_lease_until TIMESTAMPTZ;
    v_expires_at TIMESTAMPTZ;
BEGIN
    SELECT * INTO r FROM idempotency_records WHERE key = p_key;
    IF NOT FOUND THEN
        -- A new key (every first attempt): an insert that finds no row claims it, with no row
        -- lock taken to look first. Its deadline (in milliseconds: a deadline as far as
        -- i64::MAX is no timestamp), lease and recovery window are the long way's below,
        -- written in the insert itself, where they cost a claim less than variables do. A row
        -- written since the read above, or a claim past its deadline, goes the long way.
        INSERT INTO idempotency_records
            (key, state, fingerprint, owner, response, lease_until, expires_at, waited)
        SELECT p_key, 'P', p_fingerprint, p_owner, NULL,
            v_now + p_lease_ms * INTERVAL '1 millisecond',
            v_now + p_lease_ms * INTERVAL '1 millisecond' + p_window_ms * INTERVAL '1 millisecond',
            false
        WHERE p_not_after_ms <= 0 OR extract(epoch FROM v_now) * 1000 <= p_not_after_ms
        ON CONFLICT (key) DO NOTHING;
        IF FOUND THEN
            outcome := 0;
            RETURN;
        END IF;
    ELSIF r.state = 'C' AND r.expires_at > v_now THEN
        -- A completed record never changes until it expires: answered from the plain read
        -- above, so that the replays of one key do not queue on its row lock.
        IF r.fingerprint <> p_fingerprint THEN
            outcome := 2;
        ELSE
            outcome := 1;
            response := r.response;
            remaining_ms := ceil(extract(epoch FROM r.expires_at - v_now) * 1000);
        END IF;
        RETURN;
    END IF;
    -- In milliseconds: a deadline as far as i64::MAX is no timestamp.
    v_late := p_not_after_ms > 0 AND extract(epoch FROM v_now) * 1000 > p_not_after_ms;
    v_lease_until := v_now + p_lease_ms * INTERVAL '1 millisecond';
    v_expires_at := v_lease_until + p_window_ms * INTERVAL '1 millisecond';
    PERFORM set_config('lock_timeout', p_lock_ms::text, true);
    LOOP
        BEGIN
            SELECT * INTO r FROM idempotency_records WHERE key = p_key FOR UPDATE;
            v_absent := NOT FOUND;
        EXCEPTION WHEN lock_not_available THEN
            outcome := 3;
            remaining_ms := 1000;
            RETURN;
        END;
        IF v_absent OR r.expires_at <= v_now OR (r.state = 'X' AND r.owner <> p_owner) THEN
            IF NOT v_absent AND r.state = 'P' AND NOT pg_try_advisory_xact_lock(p_lock) THEN
                -- Expired, and its holder's transaction runs: held (see the lapsed lease).
                outcome := 3;
                remaining_ms := 200;
                RETURN;
            END IF;
            IF v_late THEN
                outcome := 6;
                RETURN;
            END IF;
            INSERT INTO idempotency_records AS t
                (key, state, fingerprint, owner, response, lease_until, expires_at, waited)
            VALUES (p_key, 'P', p_fingerprint, p_owner, NULL, v_lease_until, v_expires_at, false)
            ON CONFLICT (key) DO UPDATE SET state = 'P', fingerprint = p_fingerprint,
                owner = p_owner, response = NULL, lease_until = v_lease_until,
                expires_at = v_expires_at, waited = false
            WHERE t.expires_at <= v_now OR (t.state = 'X' AND t.owner <> p_owner);
            IF FOUND THEN
                outcome := 0;
                RETURN;
            END IF;
            -- Another claim wrote the key since we looked: look again.
            CONTINUE;
        END IF;
        IF r.state = 'X' THEN
            -- This very claim was abandoned by its caller before it landed.
            outcome := 6;
            RETURN;
        END IF;
        IF r.fingerprint <> p_fingerprint THEN
            outcome := 2;
            RETURN;
        END IF;
        IF r.state = 'C' THEN
            outcome := 1;
            response := r.response;
            remaining_ms := ceil(extract(epoch FROM r.expires_at - v_now) * 1000);
            RETURN;
        END IF;
        IF r.lease_until <= v_now THEN
            -- The holder's transaction (PostgresStore::transaction) holds the key's lock, taken
            -- before its BEGIN and let go after its COMMIT, and does not renew the lease while
            -- it runs: the holder is alive, however long it runs, and is not taken over. The
            -- lock ends with its session when the process dies. Polled, not waited for: no
            -- write of the row while that transaction runs (it would make a REPEATABLE READ or
            -- SERIALIZABLE transaction's own write of the record a concurrent update).
            IF NOT pg_try_advisory_xact_lock(p_lock) THEN
                outcome := 3;
                remaining_ms := 200;
                RETURN;
            END IF;
            IF v_late THEN
                outcome := 6;
                RETURN;
            END IF;
            -- The lease lapsed within the recovery window: the caller takes over, and the
            -- lapsed holder is fenced out by its token. `waited` stays: its settle notifies.
            UPDATE idempotency_records SET owner = p_owner, lease_until = v_lease_until,
                expires_at = v_expires_at WHERE key = p_key;
            outcome := 5;
            RETURN;
        END IF;
        IF p_waiting AND NOT r.waited THEN
            IF NOT pg_try_advisory_xact_lock(p_lock) THEN
                -- The holder's transaction runs (see the lapsed lease): polled, not marked.
                outcome := 3;
                remaining_ms := 200;
                RETURN;
            END IF;
            UPDATE idempotency_records SET waited = true WHERE key = p_key;
        END IF;
        outcome := 3;
        remaining_ms := ceil(extract(epoch FROM r.lease_until - v_now) * 1000);
        RETURN;
    END LOOP;
END $$;

-- Stores `p_response` if `p_owner` holds the key, or the key is absent (the lease lapsed and
-- nobody took over). A completed row keeps the owner that completed it. outcome: 1 written;
-- 2 this owner stored this very response already (an earlier attempt landed); 0 another
-- owner or another response holds the key.
-- The store sends this function's first update (the owner's live claim) as a plain statement
-- of its own (src/store/postgres/schema.rs, `complete_live`), fenced exactly as here, and calls
-- the function only when that statement updated nothing. The update stays here too: instances
-- of the previous version call the function for every complete.
CREATE OR REPLACE FUNCTION idempotency_records_complete(
    p_key TEXT, p_owner BYTEA, p_fingerprint BYTEA, p_response BYTEA, p_retention_ms BIGINT,
    OUT outcome INT)
LANGUAGE plpgsql AS $$
DECLARE
    r idempotency_records%ROWTYPE;
    v_waited BOOLEAN;
    v_now TIMESTAMPTZ := clock_timestamp();
    v_expires_at TIMESTAMPTZ := v_now + p_retention_ms * INTERVAL '1 millisecond';
BEGIN
    -- The owner's live claim (every completion but a late one): one update, fenced by the
    -- token. `waited` is left as it is, so that RETURNING reads whether to notify; nothing
    -- reads it on a completed row.
    UPDATE idempotency_records SET state = 'C', fingerprint = p_fingerprint,
        response = p_response, lease_until = NULL, expires_at = v_expires_at
    WHERE key = p_key AND state = 'P' AND owner = p_owner AND expires_at > v_now
    RETURNING waited INTO v_waited;
    IF FOUND THEN
        IF v_waited THEN
            PERFORM pg_notify('idempotency_records_settled', p_key);
        END IF;
        outcome := 1;
        RETURN;
    END IF;
    LOOP
        SELECT * INTO r FROM idempotency_records WHERE key = p_key FOR UPDATE;
        IF NOT FOUND OR r.expires_at <= v_now OR r.state = 'X' THEN
            INSERT INTO idempotency_records AS t
                (key, state, fingerprint, owner, response, lease_until, expires_at, waited)
            VALUES (p_key, 'C', p_fingerprint, p_owner, p_response, NULL, v_expires_at, false)
            ON CONFLICT (key) DO UPDATE SET state = 'C', fingerprint = p_fingerprint,
                owner = p_owner, response = p_response, lease_until = NULL,
                expires_at = v_expires_at, waited = false
            WHERE t.expires_at <= v_now OR t.state = 'X';
            IF FOUND THEN
                outcome := 1;
                RETURN;
            END IF;
            CONTINUE;
        END IF;
        -- Completed (by an earlier attempt of this very call, whose answer was lost, or by
        -- another owner), or another owner's claim: the update above took p_owner's own.
        outcome := CASE WHEN r.state = 'C' AND r.owner = p_owner AND r.response = p_response
            AND r.fingerprint = p_fingerprint THEN 2 ELSE 0 END;
        RETURN;
    END LOOP;
END $$;

-- Completes `p_owner`'s live claim with `p_response`, inside the operation's own transaction
-- (PostgresStore::transaction), so that the record commits with the side effect or not at
-- all. Only `p_owner`'s live claim is written (its fingerprint is the claim's): never an
-- absent key, never another owner's, never a completed row. The row stays locked until the transaction ends,
-- and a transaction left idle from here (its COMMIT lost with its connection) is ended by the
-- database after `p_idle_ms`, so that the lock is not held for as long as the connection
-- lives. The NOTIFY, when the record is waited for, is sent at the commit.
-- outcome: 1 written; 0 refused.
CREATE OR REPLACE FUNCTION idempotency_records_commit(
    p_key TEXT, p_owner BYTEA, p_fingerprint BYTEA, p_response BYTEA, p_retention_ms BIGINT,
    p_idle_ms BIGINT, OUT outcome INT)
LANGUAGE plpgsql AS $$
DECLARE
    v_waited BOOLEAN;
    v_now TIMESTAMPTZ := clock_timestamp();
BEGIN
    UPDATE idempotency_records SET state = 'C', response = p_response, lease_until = NULL,
        expires_at = v_now + p_retention_ms * INTERVAL '1 millisecond'
    WHERE key = p_key AND state = 'P' AND owner = p_owner AND expires_at > v_now
    RETURNING waited INTO v_waited;
    IF NOT FOUND THEN
        outcome := 0;
        RETURN;
    END IF;
    IF v_waited THEN
        PERFORM pg_notify('idempotency_records_settled', p_key);
    END IF;
    PERFORM set_config('idle_in_transaction_session_timeout', p_idle_ms::text, true);
    outcome := 1;
END $$;

-- Deletes the record if `p_owner` holds it. outcome: 1 deleted; 0 not the owner's.
CREATE OR REPLACE FUNCTION idempotency_records_release(p_key TEXT, p_owner BYTEA,
    OUT outcome INT)
LANGUAGE plpgsql AS $$
DECLARE
    v_waited BOOLEAN;
BEGIN
    DELETE FROM idempotency_records WHERE key = p_key AND state = 'P' AND owner = p_owner
        AND expires_at > clock_timestamp()
    RETURNING waited INTO v_waited;
    IF NOT FOUND THEN
        outcome := 0;
        RETURN;
    END IF;
    IF v_waited THEN
        PERFORM pg_notify('idempotency_records_settled', p_key);
    END IF;
    outcome := 1;
END $$;

-- Renews the lease of `p_owner`'s record: it now ends in `p_lease_ms` (0: now), and the
-- record is kept `p_window_ms` after. outcome: 1 renewed; 0 not the owner's.
CREATE OR REPLACE FUNCTION idempotency_records_touch(p_key TEXT, p_owner BYTEA,
    p_lease_ms BIGINT, p_window_ms BIGINT, OUT outcome INT)
LANGUAGE plpgsql AS $$
DECLARE
    v_now TIMESTAMPTZ := clock_timestamp();
    v_lease_until TIMESTAMPTZ := v_now + p_lease_ms * INTERVAL '1 millisecond';
BEGIN
    UPDATE idempotency_records SET lease_until = v_lease_until,
        expires_at = v_lease_until + p_window_ms * INTERVAL '1 millisecond'
    WHERE key = p_key AND state = 'P' AND owner = p_owner AND expires_at > v_now;
    outcome := CASE WHEN FOUND THEN 1 ELSE 0 END;
END $$;

-- Settles a claim whose answer its caller never saw. If `p_owner` holds the key, its lease
-- ends now (kept `p_window_ms` for a takeover; deleted without a window): outcome 1. If the
-- key is absent, a marker refuses `p_owner`'s claim for `p_marker_ms`, should it land late:
-- outcome 2. Otherwise 0.
CREATE OR REPLACE FUNCTION idempotency_records_abandon(p_key TEXT, p_owner BYTEA,
    p_fingerprint BYTEA, p_marker_ms BIGINT, p_window_ms BIGINT, OUT outcome INT)
LANGUAGE plpgsql AS $$
DECLARE
    r idempotency_records%ROWTYPE;
    v_now TIMESTAMPTZ := clock_timestamp();
BEGIN
    LOOP
        SELECT * INTO r FROM idempotency_records WHERE key = p_key FOR UPDATE;
        IF NOT FOUND OR r.expires_at <= v_now THEN
            INSERT INTO idempotency_records AS t
                (key, state, fingerprint, owner, response, lease_until, expires_at, waited)
            VALUES (p_key, 'X', p_fingerprint, p_owner, NULL, NULL,
                v_now + p_marker_ms * INTERVAL '1 millisecond', false)
            ON CONFLICT (key) DO UPDATE SET state = 'X', fingerprint = p_fingerprint,
                owner = p_owner, response = NULL, lease_until = NULL,
                expires_at = v_now + p_marker_ms * INTERVAL '1 millisecond', waited = false
            WHERE t.expires_at <= v_now;
            IF FOUND THEN
                outcome := 2;
                RETURN;
            END IF;
            CONTINUE;
        END IF;
        IF r.state <> 'P' OR r.owner <> p_owner THEN
            outcome := 0;
            RETURN;
        END IF;
        IF p_window_ms > 0 THEN
            UPDATE idempotency_records SET lease_until = v_now,
                expires_at = v_now + p_window_ms * INTERVAL '1 millisecond'
            WHERE key = p_key;
        ELSE
            DELETE FROM idempotency_records WHERE key = p_key;
        END IF;
        IF r.waited THEN
            PERFORM pg_notify('idempotency_records_settled', p_key);
        END IF;
        outcome := 1;
        RETURN;
    END LOOP;
END $$;
