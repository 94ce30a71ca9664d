//! How a call reaches the database: within its timeout ([`bounded`]), its errors told as the
//! store's, its durations in milliseconds, and the migrations run one instance at a time.

use std::time::Duration;

use sqlx::{Executor as _, PgPool, Row as _, postgres::PgRow};

use super::Beginning;
use crate::{
    fingerprint::Fingerprint,
    store::{Fenced, StoreError},
};

/// The longest duration written to the database: 30 years, in milliseconds. A configured
/// duration as long as `Duration::MAX` means "keep it", never an overflow.
const LONGEST_MS: i64 = 30 * 365 * 24 * 60 * 60 * 1000;

/// Brings `table`'s schema to `schema`: nothing at all when the catalog says it is current
/// (the table's comment names `schema`'s version), so that a start takes no lock on a table
/// in use. Otherwise `schema` runs in one transaction under an advisory lock named after
/// `table` (instances starting side by side do not collide: two `CREATE TABLE IF NOT EXISTS`
/// at once fail on the catalog's unique index), each lock on the table waited for at most
/// half of `timeout`, so that the claims queued behind a DDL statement's lock request still
/// answer within their own timeout; the version is written last.
pub(crate) async fn migrate(
    pool: &PgPool,
    (table, schema): (&str, &str),
    timeout: Duration,
) -> Result<(), StoreError> {
    let version = schema_version(schema);
    let current = format!(
        "SELECT coalesce(obj_description(to_regclass('{table}'), 'pg_class') = '{version}', false)"
    );
    let is_current = sqlx::query_scalar::<_, bool>(&current);
    if bounded(timeout, is_current.fetch_one(pool)).await? {
        return Ok(());
    }
    // One statement, so that no borrow of the transaction is held across two awaits (which
    // would make the future not `Send` for every lifetime, and `tokio::spawn` refuse it). The
    // advisory lock is waited for without a limit: the instance that holds it migrates within
    // its own locks' limits, and the schema is safe to run again once it has.
    let locked = format!(
        "SELECT pg_advisory_xact_lock(hashtext('axum-idempotency:{table}'));\n\
         SET LOCAL lock_timeout = {wait};\n{schema}\n\
         COMMENT ON TABLE {table} IS '{version}';",
        wait = lock_wait(timeout),
    );
    // As `pool.begin()` would, through `Beginning`: a caller that gives up on a start leaves
    // no transaction open (and the advisory lock held, every other instance's start waiting).
    let connection = pool.acquire().await.map_err(StoreError::unavailable)?;
    let mut beginning = Beginning::new(connection);
    let mut tx = beginning.begin().await.map_err(StoreError::unavailable)?;
    let connection: &mut sqlx::PgConnection = &mut tx;
    connection.execute(sqlx::raw_sql(&locked)).await.map_err(|error| {
        // lock_not_available: a transaction holds the table (an operation's, a claim's).
        let code = error.as_database_error().and_then(sqlx::error::DatabaseError::code);
        if code.is_some_and(|code| code == "55P03") {
            let wait = lock_wait(timeout);
            StoreError::unavailable(format!(
                "migrate() gave up on {table}'s schema: a lock on the table was not granted \
                 within {wait} ms (a long transaction holds it); nothing was changed, run it \
                 again"
            ))
        } else {
            StoreError::unavailable(error)
        }
    })?;
    tx.commit().await.map_err(StoreError::unavailable)
}

/// The version of `schema` a migrated table's comment names: its digest, so that any change
/// to the schema's text migrates again.
fn schema_version(schema: &str) -> String {
    let digest = Fingerprint::of_payload(schema.as_bytes());
    let hex: String = digest.as_bytes()[..12].iter().map(|byte| format!("{byte:02x}")).collect();
    format!("axum-idempotency schema {hex}")
}

/// How long a claim waits for a row another transaction holds locked before it answers "in
/// progress": half the command timeout, so that the answer comes within it; at least a
/// millisecond (0 would be no limit).
pub(super) fn lock_wait(command_timeout: Duration) -> i64 {
    millis(command_timeout / 2).max(1)
}

/// `call`, within `timeout`: its error is the store being unavailable, its timeout
/// [`StoreError::Timeout`]. Every call of the PostgreSQL stores goes through here.
pub(crate) async fn bounded<T>(
    timeout: Duration,
    call: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(store_error(error)),
        Err(_) => Err(StoreError::Timeout(timeout)),
    }
}

/// A database error as the store reports it: a missing function or table is the schema
/// missing (`migrate()` was not run), any other error the store being unavailable.
fn store_error(error: sqlx::Error) -> StoreError {
    // undefined_function, undefined_table
    let missing = error
        .as_database_error()
        .and_then(sqlx::error::DatabaseError::code)
        .is_some_and(|code| code == "42883" || code == "42P01");
    if missing {
        StoreError::SchemaMissing(error.to_string())
    } else {
        StoreError::unavailable(error)
    }
}

/// `duration` in whole milliseconds, at most 30 years.
pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(LONGEST_MS).min(LONGEST_MS)
}

/// A fenced function's answer: 1 (or 2) when applied, 0 when another owner holds the key.
pub(super) fn fenced(row: &PgRow) -> Result<Fenced, StoreError> {
    let outcome: i32 = row.try_get(0).map_err(corrupt)?;
    Ok(if outcome == 0 { Fenced::Rejected } else { Fenced::Applied })
}

pub(super) fn corrupt(error: sqlx::Error) -> StoreError {
    StoreError::CorruptRecord(format!("an answer of another shape: {error}"))
}
