//! [`DurableOutcomes`]: the durable half beside a fast record store (Redis). An operation
//! commits its outcome to a table the crate owns, in the transaction that writes its side
//! effect; the record store keeps the fast claim and the replays; a takeover, a lapsed lease or
//! a record the record store lost is answered from the table, the door's recovery hook
//! ([`Recover`] for every door).

use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{Request, Response};
use serde::de::DeserializeOwned;
use sqlx::{PgConnection, PgPool};

use crate::{
    context::{Encoding, IdempotencyContext},
    fingerprint::Fingerprint,
    key::RecordKey,
    recovery::{BoxError, DurableTable, Lookup, Recover, Recovered},
    store::{
        Committable, EncodedOutcome, StoreError, TransactionError,
        postgres::{Kept, Write, bounded, idle_limit, millis, run},
    },
};

/// Writes an outcome, unless the table holds a live one for its key: an expired row is the
/// past, taken over; a live one is another holder's. The transaction is then left to the
/// database's `idle_in_transaction_session_timeout` (`$5` ms) should its COMMIT be lost.
const INSERT: &str = "WITH idle AS (
        SELECT set_config('idle_in_transaction_session_timeout', $5, true))
    INSERT INTO idempotency_outcomes AS t (key, fingerprint, outcome, expires_at)
    SELECT $1, $2, $3, clock_timestamp() + $4 * interval '1 millisecond' FROM idle
    ON CONFLICT (key) DO UPDATE SET fingerprint = excluded.fingerprint,
        outcome = excluded.outcome, expires_at = excluded.expires_at
    WHERE t.expires_at <= clock_timestamp()
    RETURNING 1";

/// Writes `sealed` in the transaction: `Ok(false)` when the table holds another live outcome.
async fn write(
    tx: &mut PgConnection,
    sealed: &EncodedOutcome,
    timeout: Duration,
    statement: &str,
) -> Result<bool, StoreError> {
    let query = sqlx::query_scalar::<_, i32>(statement)
        .bind(sealed.key.as_str())
        .bind(&sealed.fingerprint.as_bytes()[..])
        .bind(&sealed.stored[..])
        .bind(millis(sealed.retention))
        .bind(idle_limit(timeout));
    Ok(bounded(timeout, query.fetch_optional(tx)).await?.is_some())
}

/// Outcomes committed with their side effects, in the table `idempotency_outcomes` of the
/// app's own PostgreSQL database, beside a record store that does not share that database
/// (Redis). Set up once, and handlers commit their outcomes to it
/// ([`transaction`](Self::transaction)); the front doors answer from it what the record store
/// cannot, with the table as their recovery hook (it is a [`Recover`] for every door):
/// `IdempotencyLayer::recover(outcomes)`, `Idempotent::recover(outcomes)`. Every new claim and
/// every takeover asks the table first (one primary-key read), so that a lapsed lease, a holder
/// that died after its commit, or a record Redis lost is replayed from PostgreSQL, and the
/// operation does not run again; a request with another payload under a key whose outcome only
/// the table still holds is answered as a key reused with a different request, never run.
///
/// The table's primary key is the fence: of two holders of one key (one that was slow, not
/// dead, and the one that took its lease over) only the first to commit keeps its side
/// effect; the other's commit is refused with [`StoreError::FencedOut`] and its transaction,
/// side effect included, is rolled back.
#[derive(Debug, Clone)]
pub struct DurableOutcomes {
    pool: PgPool,
    command_timeout: Duration,
}

impl DurableOutcomes {
    /// The table, safe to run on every start.
    pub const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS idempotency_outcomes (
    key TEXT PRIMARY KEY,
    fingerprint BYTEA NOT NULL,
    outcome BYTEA NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_outcomes_expires_at ON idempotency_outcomes (expires_at);";

    table_calls!("idempotency_outcomes", "Outcomes in `pool`'s database.");

    /// Runs `operation` in a transaction the table's pool begins, writes the operation's
    /// outcome to the table in that same transaction and commits it: the outcome is kept if
    /// and only if the side effect commits. The front door then stores it in its record store
    /// too, as the outcome it answers. Used as
    /// [`PostgresStore::transaction`](crate::store::PostgresStore::transaction) is, with the
    /// same outcomes, errors and refusals of misuse; refused ([`TransactionError::Misuse`])
    /// under a door whose recovery hook is not the table (`.recover(outcomes)`).
    ///
    /// # Errors
    ///
    /// [`TransactionError`]; [`StoreError::FencedOut`] (rolled back) when the table holds a
    /// live outcome for the key already: another holder of the key committed first.
    pub async fn transaction<O, E, F>(
        &self,
        context: &IdempotencyContext,
        operation: F,
    ) -> Result<O, TransactionError<E>>
    where
        O: Committable,
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<O, E>> + Send,
    {
        let pool = (&self.pool, self.command_timeout);
        let write: Write =
            |tx, sealed, timeout, statement| Box::pin(write(tx, sealed, timeout, statement));
        let table = self.table();
        run(pool, (write, INSERT), Kept::Beside(&table), context, operation).await
    }

    /// This table, by its database (host, port, name): what a door that answers from it holds,
    /// so that a commit into another table is refused.
    fn table(&self) -> DurableTable {
        let options = self.pool.connect_options();
        let database = options.get_database().unwrap_or_else(|| options.get_username());
        let place = format!(
            "{}:{}/{database}/idempotency_outcomes",
            options.get_host(),
            options.get_port()
        );
        DurableTable(place.into())
    }

    /// The live outcome of `key`, with the fingerprint of the request that made it.
    pub(crate) async fn read(
        &self,
        key: &RecordKey,
    ) -> Result<Option<(Fingerprint, Bytes)>, StoreError> {
        let select = "SELECT fingerprint, outcome FROM idempotency_outcomes
            WHERE key = $1 AND expires_at > clock_timestamp()";
        let query = sqlx::query_as::<_, (Vec<u8>, Vec<u8>)>(select).bind(key.as_str());
        let row = bounded(self.command_timeout, query.fetch_optional(&self.pool)).await?;
        row.map(|(fingerprint, outcome)| {
            let fingerprint = Fingerprint::from_stored(&fingerprint)
                .ok_or_else(|| StoreError::CorruptRecord("an outcome's fingerprint".into()))?;
            Ok((fingerprint, Bytes::from(outcome)))
        })
        .transpose()
    }
}

impl DurableOutcomes {
    /// The live outcome of `lookup`'s key, when the table holds one of the same request, read
    /// back as its door stored it (decrypted when the door encrypts) and then by `read`.
    async fn recovered<R, T>(
        &self,
        lookup: &Lookup<R>,
        read: impl FnOnce(&dyn Encoding, Bytes) -> Result<T, String>,
    ) -> Result<Recovered<T>, BoxError> {
        let context = &lookup.context;
        // Under the names the claim holds, then (while a service moves between namings) under
        // the request's other names, which an instance of the neighbouring deploy commits under.
        let mut found = None;
        for (key, request) in context.names() {
            if let Some(row) = self.read(key).await? {
                found = Some((key, request, row));
                break;
            }
        }
        let Some((key, request, (fingerprint, outcome))) = found else {
            return Ok(Recovered::Unknown);
        };
        if &fingerprint != request {
            return Ok(Recovered::Mismatch);
        }
        let completion = context.completion().ok_or("the context is not one a front door gave")?;
        let outcome = completion.at_rest.open(key, request, outcome)?;
        let value = read(&*completion.encoding, outcome)
            .map_err(|error| format!("the committed outcome is unreadable: {error}"))?;
        Ok(Recovered::Happened(value))
    }
}

/// The HTTP door's hook: the committed response of the request's key.
impl Recover<Request<Bytes>, Response<Bytes>> for DurableOutcomes {
    async fn recover(
        &self,
        lookup: Lookup<Request<Bytes>>,
    ) -> Result<Recovered<Response<Bytes>>, BoxError> {
        self.recovered(&lookup, |encoding, outcome| encoding.read_response(outcome)).await
    }

    fn durable(&self) -> Option<DurableTable> {
        Some(self.table())
    }
}

/// The consumer door's hook: the committed result of the delivery's key.
impl<T: DeserializeOwned + Send + 'static> Recover<Bytes, T> for DurableOutcomes {
    async fn recover(&self, lookup: Lookup<Bytes>) -> Result<Recovered<T>, BoxError> {
        self.recovered(&lookup, |encoding, outcome| {
            let json = encoding.read_json(outcome)?;
            serde_json::from_slice(&json).map_err(|error| error.to_string())
        })
        .await
    }

    fn durable(&self) -> Option<DurableTable> {
        Some(self.table())
    }
}

/// The gRPC door's hook: the committed reply of the call's key.
#[cfg(feature = "tonic")]
impl Recover<Bytes, crate::grpc::Reply> for DurableOutcomes {
    async fn recover(
        &self,
        lookup: Lookup<Bytes>,
    ) -> Result<Recovered<crate::grpc::Reply>, BoxError> {
        let read = self.recovered(&lookup, |encoding, outcome| encoding.read_response(outcome));
        Ok(read.await?.map(crate::grpc::Reply::from_stored))
    }

    fn durable(&self) -> Option<DurableTable> {
        Some(self.table())
    }
}
