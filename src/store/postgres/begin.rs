//! [`Beginning`]: a transaction begun on a pooled connection that no cancellation leaves open.

use sqlx::{Postgres, pool::PoolConnection};

/// A pooled connection whose `BEGIN` is in flight: closed, not returned to its pool, when
/// dropped before the `BEGIN` is known to have ended (the timeout, or the caller gone). sqlx
/// (0.8.4 to 0.9, launchbadge/sqlx#4393) counts a transaction only once `BEGIN`'s answer is
/// read, and rolls back on drop only what it counted: a `BEGIN` cancelled in flight would leave
/// the session inside a transaction that nothing ends, and the pool would hand it on. Every
/// later statement on it (a claim's, a complete's) would run inside it: its row locks held for
/// as long as the connection lives, its writes never committed, every other claim of those keys
/// answered "in progress". Closing the connection ends the transaction.
///
/// It closes the connection too while it may hold a session-level lock (a record store's
/// transaction's hold on its key): a connection handed back to the pool with the lock would
/// hold the key for as long as it lives.
pub(crate) struct Beginning {
    connection: PoolConnection<Postgres>,
    /// `BEGIN`'s answer was read: sqlx's own transaction rolls back on drop from here.
    begun: bool,
    /// A session-level lock was asked for, and not known to be let go.
    locked: bool,
}

impl Beginning {
    /// `connection`, before its `BEGIN`.
    pub(crate) fn new(connection: PoolConnection<Postgres>) -> Self {
        Self { connection, begun: false, locked: false }
    }

    /// Says that the session may hold a lock (`true`, set before it is asked for), or that it
    /// was let go.
    pub(crate) fn holds_lock(&mut self, locked: bool) {
        self.locked = locked;
    }

    /// The connection, outside any transaction.
    pub(crate) fn connection(&mut self) -> &mut sqlx::PgConnection {
        &mut self.connection
    }

    /// Its transaction. Given up before `BEGIN`'s answer is read, or failed, the connection is
    /// closed when this is dropped.
    pub(crate) async fn begin(&mut self) -> Result<sqlx::Transaction<'_, Postgres>, sqlx::Error> {
        self.begun = false;
        let tx = sqlx::Acquire::begin(&mut self.connection).await?;
        self.begun = true;
        Ok(tx)
    }
}

impl Drop for Beginning {
    fn drop(&mut self) {
        if !self.begun || self.locked {
            self.connection.close_on_drop();
        }
    }
}
