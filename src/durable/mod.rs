//! App-level durability beside the stores, in the app's own PostgreSQL database (feature
//! `postgres`): tables the crate owns, written in the transactions of the app's operations,
//! whatever store keeps the idempotency records.
//!
//! - [`DurableOutcomes`]: the durable half beside a fast record store (Redis). An operation
//!   commits its outcome to it in the transaction of its side effect
//!   ([`DurableOutcomes::transaction`]); the door asks it as its recovery hook
//!   (`.recover(outcomes)`: it implements [`Recover`](crate::recovery::Recover) for both
//!   doors), so that a takeover, a lapsed lease or a record the record store lost is answered
//!   from the table.
//! - [`Checkpoints`]: the steps of an operation that makes more than one foreign call, each
//!   marked done in the transaction that commits it, so that the same request run again
//!   resumes after the last step that committed.
//!
//! Neither is a store: the records stay in the door's [`Store`](crate::store::Store).

// The whole module is the `postgres` feature's: the doors reach it through `Recover` alone.
#![cfg(feature = "postgres")]

/// The calls every table of this module has, written once (as the builders' shared setters
/// are): `new` over the app's pool, `command_timeout`, `migrate` and `sweep_expired`. The type
/// has the fields `pool` and `command_timeout`, and a `SCHEMA` creating `$table`.
macro_rules! table_calls {
    ($table:literal, $new:literal) => {
        #[doc = $new]
        #[doc = ""]
        #[doc = "Every call is bounded by a command timeout of a second"]
        #[doc = "([`command_timeout`](Self::command_timeout))."]
        #[must_use]
        pub fn new(pool: sqlx::PgPool) -> Self {
            Self { pool, command_timeout: std::time::Duration::from_secs(1) }
        }

        /// Sets the longest a call may take.
        #[must_use]
        pub fn command_timeout(mut self, timeout: std::time::Duration) -> Self {
            self.command_timeout = timeout;
            self
        }

        /// Creates the table when it is missing ([`SCHEMA`](Self::SCHEMA)), under an advisory
        /// lock, so that instances starting side by side do not collide. Safe on every start,
        /// under traffic: when the table's comment names this version's schema (written by the
        /// last `migrate`), it runs nothing and takes no lock on the table; otherwise it waits
        /// for each lock on the table at most half the
        /// [command timeout](Self::command_timeout).
        ///
        /// # Errors
        ///
        /// When the database cannot be reached or refuses the schema, or a lock on the table
        /// was not granted in time (a long transaction holds it): nothing was changed, and
        /// `migrate` may be run again.
        pub async fn migrate(&self) -> Result<(), crate::store::StoreError> {
            let schema = ($table, Self::SCHEMA);
            crate::store::postgres::migrate(&self.pool, schema, self.command_timeout).await
        }

        /// Deletes the expired rows, and returns how many.
        ///
        /// # Errors
        ///
        /// When the database cannot be reached.
        pub async fn sweep_expired(&self) -> Result<u64, crate::store::StoreError> {
            let delete = concat!("DELETE FROM ", $table, " WHERE expires_at <= clock_timestamp()");
            let done = sqlx::query(delete)
                .execute(&self.pool)
                .await
                .map_err(crate::store::StoreError::unavailable)?;
            Ok(done.rows_affected())
        }
    };
}

mod checkpoints;
mod outcomes;

pub use self::{checkpoints::Checkpoints, outcomes::DurableOutcomes};
