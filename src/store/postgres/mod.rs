//! [`PostgresStore`]: records in PostgreSQL, the durable authority.

mod admin;
mod begin;
mod calls;
mod fleet;
mod listener;
mod schema;
mod sweeper;
mod transaction;

use std::{
    fmt,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use bytes::Bytes;
use sqlx::{PgPool, Row as _, postgres::PgRow};

pub(crate) use self::begin::Beginning;
pub(crate) use self::calls::{bounded, migrate, millis};
use self::calls::{corrupt, fenced, lock_wait};
use self::{listener::Listener, schema::Statements, sweeper::Sweeper};
pub use self::{schema::TableNameError, sweeper::LapsedClaims};
// What the app-level tables beside the stores (`crate::durable`) share with this store: its
// bounded calls, its migrations, and its transactional path.
pub(crate) use self::transaction::{Kept, Write, idle_limit, run};
use super::{
    Claim, Fenced, Lease, OwnerToken, Store, StoreError, Subscription,
    clock::{ServerClock, claim_resampling},
};
use crate::{fingerprint::Fingerprint, key::RecordKey};

/// The default for [`PostgresStore::command_timeout`].
const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(1);

/// Records in PostgreSQL, through the app's own sqlx
/// [`PgPool`](https://docs.rs/sqlx/0.8/sqlx/type.PgPool.html) (sqlx is re-exported as
/// `store::sqlx`): the durable authority.
///
/// Each record is a row of one table (`idempotency_records` unless
/// [`with_table`](Self::with_table) names another), and each transition is one statement,
/// decided by the database's clock: a call of a PL/pgSQL function that
/// [`migrate`](Self::migrate) installs with the table (the SQL is [`PostgresStore::SCHEMA`]),
/// or, for the owner's complete of its live claim, a plain `UPDATE` fenced as that function
/// fences it (a complete it does not apply goes on to the function). A handler that moves
/// money commits its side effect and its record in one transaction the store owns:
/// [`transaction`](Self::transaction).
///
#[doc = include_str!("../../docs/postgres.md")]
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
    command_timeout: Duration,
    sweep_every: Option<Duration>,
}

struct Inner {
    pool: PgPool,
    statements: Statements,
    clock: ServerClock,
    listener: Listener,
    /// The sweeper, started on the first claim (inside its runtime), again on the next claim
    /// after that runtime shut down (the task went with it), and stopped when the last clone
    /// of the store is dropped.
    sweeper: Mutex<Option<Sweeper>>,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.inner.statements.table)
            .field("pool_size", &self.inner.pool.size())
            .field("command_timeout", &self.command_timeout)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// The schema: the table, its index and the transition functions, for the default table
    /// name. [`migrate`](Self::migrate) runs it; a team that runs its own migrations can run
    /// [`schema`](Self::schema) instead.
    pub const SCHEMA: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/sql/postgres.sql"));

    /// A store over `pool`, in the table `idempotency_records`.
    #[must_use]
    pub fn new(pool: PgPool) -> Self {
        Self::build(pool, Statements::new(schema::DEFAULT_TABLE))
    }

    /// A store over `pool`, in the table `table`: a lowercase SQL identifier (letters, digits
    /// and `_`, starting with a letter or `_`, at most 48 characters), so that the functions,
    /// the index and the notification channel named after it are identifiers too.
    ///
    /// # Errors
    ///
    /// When `table` is not such a name.
    pub fn with_table(pool: PgPool, table: &str) -> Result<Self, TableNameError> {
        Ok(Self::build(pool, Statements::new(schema::table_name(table)?)))
    }

    fn build(pool: PgPool, statements: Statements) -> Self {
        let listener = Listener::new(pool.clone(), statements.channel.clone());
        let inner = Inner {
            pool,
            statements,
            clock: ServerClock::default(),
            listener,
            sweeper: Mutex::new(None),
        };
        Self {
            inner: Arc::new(inner),
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
            sweep_every: Some(sweeper::DEFAULT_EVERY),
        }
    }

    /// Bounds every store operation, a pool checkout included: past it the request is
    /// answered 503 (or passes through under `fail_open`). Defaults to 1 second.
    #[must_use]
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// How often the store's own task deletes expired rows (in batches of 1,000, until none
    /// is left); `None` starts no task, for an app that calls
    /// [`sweep_expired`](Self::sweep_expired) itself. Defaults to every minute.
    #[must_use]
    pub fn sweep_every(mut self, every: Option<Duration>) -> Self {
        self.sweep_every = every;
        self
    }

    /// The schema of this store's table: [`SCHEMA`](Self::SCHEMA) with its name.
    #[must_use]
    pub fn schema(&self) -> &str {
        &self.inner.statements.schema
    }

    /// Creates the table, its index and its functions where missing (and replaces the
    /// functions with this version's), in one transaction under an advisory lock, so that
    /// instances starting side by side do not collide. Safe to run on every start, under
    /// traffic: when the table's comment names this version's schema (written by the last
    /// `migrate`), it runs nothing and takes no lock on the table; otherwise it waits for each
    /// lock on the table at most half the [command timeout](Self::command_timeout), so that
    /// the claims queued behind it still answer in time.
    ///
    /// # Errors
    ///
    /// When the database cannot be reached or refuses the schema, or a lock on the table was
    /// not granted in time (a long transaction holds it): [`StoreError::Unavailable`], which
    /// says so; nothing was changed, and `migrate` may be run again.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let statements = &self.inner.statements;
        let schema = (&*statements.table, &*statements.schema);
        migrate(&self.inner.pool, schema, self.command_timeout).await
    }

    /// Runs `query` within the command timeout.
    async fn fetch(
        &self,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<PgRow, StoreError> {
        bounded(self.command_timeout, query.fetch_one(&self.inner.pool)).await
    }

    /// Runs a fenced function: 1 (or 2) when applied, 0 when another owner holds the key.
    async fn fenced(
        &self,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<Fenced, StoreError> {
        fenced(&self.fetch(query).await?)
    }

    /// Samples the database's clock, for the claims' deadlines.
    async fn sample_clock(&self) -> Result<(), StoreError> {
        let sent = Instant::now();
        let query = sqlx::query("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8");
        let server_ms: i64 = self.fetch(query).await?.try_get(0).map_err(corrupt)?;
        self.inner.clock.record(u64::try_from(server_ms).unwrap_or(0), sent);
        Ok(())
    }

    async fn claim_marking(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
        waiting: bool,
    ) -> Result<Claim, StoreError> {
        self.start_sweeping();
        if self.inner.clock.now().is_none() {
            self.sample_clock().await?;
        }
        claim_resampling(
            || self.claim_once(key, fingerprint, owner, lease, waiting),
            || self.sample_clock(),
        )
        .await
    }

    /// One call of the claim function, with the latest database time at which it may be
    /// applied: the command timeout and half a lease of slack (a claim applied within it is
    /// still met by its guard, which abandons it for a whole lease after the timeout).
    async fn claim_once(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
        waiting: bool,
    ) -> Result<Claim, StoreError> {
        let deadline = self.inner.clock.claim_deadline(self.command_timeout, lease.duration / 2);
        let query = sqlx::query(&self.inner.statements.claim)
            .bind(key.as_str())
            .bind(fingerprint.as_bytes())
            .bind(owner.as_bytes())
            .bind(millis(lease.duration))
            .bind(millis(lease.recovery_window))
            .bind(waiting)
            .bind(i64::try_from(deadline).unwrap_or(i64::MAX))
            .bind(lock_wait(self.command_timeout))
            .bind(transaction::key_lock(&self.inner.statements.table, key));
        let row = self.fetch(query).await?;
        let outcome: i32 = row.try_get(0).map_err(corrupt)?;
        let remaining = || {
            let ms: Option<i64> = row.try_get(2).ok().flatten();
            Duration::from_millis(ms.map_or(0, |ms| u64::try_from(ms).unwrap_or(0)))
        };
        Ok(match outcome {
            0 => Claim::Claimed,
            1 => {
                let response: Option<Vec<u8>> = row.try_get(1).map_err(corrupt)?;
                let response = response.ok_or_else(|| {
                    StoreError::CorruptRecord("a completed row without a response".to_owned())
                })?;
                Claim::Replay { response: Bytes::from(response), remaining: remaining() }
            }
            2 => Claim::Mismatch,
            3 => Claim::InProgress { remaining: remaining() },
            5 => Claim::TakenOver,
            6 => return Err(StoreError::ClaimAbandoned),
            other => {
                return Err(StoreError::CorruptRecord(format!("unknown claim outcome {other}")));
            }
        })
    }

    fn start_sweeping(&self) {
        if let Some(every) = self.sweep_every {
            let mut sweeper = self.inner.sweeper.lock().unwrap_or_else(PoisonError::into_inner);
            if sweeper.as_ref().is_none_or(Sweeper::ended) {
                let (pool, statements) = (self.inner.pool.clone(), self.inner.statements.clone());
                *sweeper = Some(Sweeper::start(pool, statements, every));
            }
        }
    }
}

impl Store for PostgresStore {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        self.claim_marking(key, fingerprint, owner, lease, false).await
    }

    async fn claim_waiting(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        self.claim_marking(key, fingerprint, owner, lease, true).await
    }

    async fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.inner.listener.subscribe(key.as_str(), self.command_timeout).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        response: Bytes,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        let (statements, pool) = (&self.inner.statements, &self.inner.pool);
        let query = |statement| {
            sqlx::query(statement)
                .bind(key.as_str())
                .bind(owner.as_bytes())
                .bind(fingerprint.as_bytes())
                .bind(&response[..])
                .bind(millis(retention))
        };
        // The owner's live claim in one plain statement; anything else (its answer lost, the
        // claim expired or abandoned, another owner's key) in a second round trip, to the
        // function. The command timeout bounds the two together.
        let decided = bounded(self.command_timeout, async {
            if query(&statements.complete_live).execute(pool).await?.rows_affected() == 1 {
                return Ok(None);
            }
            query(&statements.complete).fetch_one(pool).await.map(Some)
        })
        .await?;
        decided.map_or(Ok(Fenced::Applied), |row| fenced(&row))
    }

    async fn release(&self, key: &RecordKey, owner: &OwnerToken) -> Result<Fenced, StoreError> {
        let query =
            sqlx::query(&self.inner.statements.release).bind(key.as_str()).bind(owner.as_bytes());
        self.fenced(query).await
    }

    async fn abandon(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        let query = sqlx::query(&self.inner.statements.abandon)
            .bind(key.as_str())
            .bind(owner.as_bytes())
            .bind(fingerprint.as_bytes())
            .bind(millis(lease.duration))
            .bind(millis(lease.recovery_window));
        self.fenced(query).await
    }

    fn commits_in_transactions(&self) -> bool {
        true
    }

    async fn touch(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        let query = sqlx::query(&self.inner.statements.touch)
            .bind(key.as_str())
            .bind(owner.as_bytes())
            .bind(millis(lease.duration))
            .bind(millis(lease.recovery_window));
        self.fenced(query).await
    }

    async fn announce(
        &self,
        registry: &RecordKey,
        entries: &[(String, Duration)],
    ) -> Result<Option<Vec<String>>, StoreError> {
        self.announce_in(registry, entries).await.map(Some)
    }
}
