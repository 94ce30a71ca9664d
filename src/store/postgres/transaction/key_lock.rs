//! How a record store's transaction holds its key while it runs: a session-level advisory
//! lock ([`KeyLock`]), taken before its `BEGIN` and let go after its `COMMIT`.

use std::time::Duration;

use sqlx::{PgConnection, Row as _};

use super::{Beginning, bounded, millis};
use crate::{context::Completion, fingerprint::Fingerprint, key::RecordKey, store::OwnerToken};

/// The lock a record store's transaction holds its key by, from before its `BEGIN` to after
/// its `COMMIT`: a session-level advisory lock named after the table and the key
/// ([`key_lock`]), which the claim function looks at before it takes a lapsed lease over. The lease is not renewed
/// while the transaction runs (a renewal's write of the record would make a REPEATABLE READ or
/// SERIALIZABLE transaction's own write of it a concurrent update); the lock holds the key
/// instead, for as long as the holder's session lives, and no longer: a process that dies
/// ends its session and its lock. Taken outside the transaction, so that the operation's
/// first statement may still set its isolation level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyLock<'a> {
    /// The records' table, which names the lock with the key.
    pub(crate) table: &'a str,
    /// The table's renewal statement (`touch`).
    pub(crate) touch: &'a str,
}

/// The advisory lock of `key` in `table`: the first eight bytes of their digest, computed
/// here for both the transaction that takes it and the claim that looks at it.
pub(crate) fn key_lock(table: &str, key: &RecordKey) -> i64 {
    let digest = Fingerprint::of_fields(&[table.as_bytes(), key.as_str().as_bytes()]);
    let mut first = [0; 8];
    first.copy_from_slice(&digest.as_bytes()[..8]);
    i64::from_be_bytes(first)
}

/// A record store's transaction's hold on its key: [`KeyLock`], on `key`, claimed by `owner`.
pub(super) struct Held<'a> {
    pub(super) lock: KeyLock<'a>,
    pub(super) key: &'a RecordKey,
    pub(super) owner: &'a OwnerToken,
}

impl Held<'_> {
    /// Takes the key's lock on `connection`, then renews the claim's lease, fenced: `false`
    /// when the claim is no longer this holder's (taken over before the lock was granted).
    /// The connection is closed rather than handed back from the moment the lock is asked
    /// for until [`let_go`](Self::let_go) lets it go.
    pub(super) async fn take(
        &self,
        connection: &mut Beginning,
        completion: &Completion,
    ) -> Result<bool, sqlx::Error> {
        connection.holds_lock(true);
        let lock =
            sqlx::query("SELECT pg_advisory_lock($1)").bind(key_lock(self.lock.table, self.key));
        lock.execute(connection.connection()).await?;
        self.renew(connection.connection(), completion).await
    }

    /// The claim's lease renewed, fenced by its owner token: whether it was.
    async fn renew(
        &self,
        connection: &mut PgConnection,
        completion: &Completion,
    ) -> Result<bool, sqlx::Error> {
        let renew = sqlx::query(self.lock.touch)
            .bind(self.key.as_str())
            .bind(self.owner.as_bytes())
            .bind(millis(completion.lease.duration))
            .bind(millis(completion.lease.recovery_window));
        let outcome: i32 = renew.fetch_one(connection).await?.try_get(0)?;
        Ok(outcome == 1)
    }

    /// Renews the lease (`renew`, unless the outcome committed) and lets the key's lock go,
    /// each within `timeout`; when either fails, the connection is closed rather than
    /// handed back, which ends the lock with its session.
    pub(super) async fn let_go(
        self,
        connection: &mut Beginning,
        renew: Option<&Completion>,
        timeout: Duration,
    ) {
        if let Some(completion) = renew
            && !matches!(
                bounded(timeout, self.renew(connection.connection(), completion)).await,
                Ok(true)
            )
        {
            return;
        }
        let unlock =
            sqlx::query("SELECT pg_advisory_unlock($1)").bind(key_lock(self.lock.table, self.key));
        let unlocked = bounded(timeout, unlock.fetch_one(connection.connection())).await;
        if unlocked.is_ok_and(|row| row.try_get::<bool, _>(0).unwrap_or(false)) {
            connection.holds_lock(false);
        }
    }
}
