//! The gRPC door's example service: `payments.v1.Payments` (`proto/payments.proto`, compiled
//! by this crate's `build.rs` in pure Rust), served by tonic behind
//! [`GrpcIdempotencyLayer`]. The server binary (`src/main.rs`) and the door's tests
//! (`tests/`) both serve it with [`serve`].

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use axum_idempotency::{
    IdempotencyContext,
    durable::DurableOutcomes,
    grpc::GrpcIdempotencyLayer,
    layer::scope::ScopeExtractor,
    store::{
        PostgresStore, Store,
        sqlx::{self, PgConnection, PgPool},
    },
};
use prost::Message as _;
use tonic::{Code, Request, Response, Status, metadata::MetadataValue};

/// The messages, client and server `build.rs` generated from `proto/payments.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("payments.v1");
}

use pb::{
    ChargeReply, ChargeRequest,
    payments_server::{Payments, PaymentsServer},
};

/// The unary methods the layer makes idempotent.
pub const CHARGE: &str = "/payments.v1.Payments/Charge";
/// The charge made in the same PostgreSQL transaction as its idempotency record.
pub const CHARGE_IN_TRANSACTION: &str = "/payments.v1.Payments/ChargeInTransaction";

/// The layer the example puts in front of its service: `Charge` and `ChargeInTransaction`
/// handled, keyed by the `idempotency-key` metadata entry or the message's `request_id`;
/// scoped by `x-tenant-id` when the call names one; `OK` and a declined charge
/// (`FAILED_PRECONDITION`) stored and replayed, every other error retried.
pub fn layer<St: Store>(store: St) -> GrpcIdempotencyLayer<St, impl ScopeExtractor> {
    GrpcIdempotencyLayer::new(store)
        .unary(CHARGE)
        .unary(CHARGE_IN_TRANSACTION)
        .key_from_message(|_method: &str, message: &[u8]| {
            ChargeRequest::decode(message).ok().map(|request| request.request_id)
        })
        .scope(|parts: &http::request::Parts| {
            let tenant = parts.headers.get("x-tenant-id").map(|v| v.to_str().map(str::to_owned));
            match tenant {
                None => Some(String::new()),
                Some(tenant) => tenant.ok(),
            }
        })
        .store_policy(|code: Code| matches!(code, Code::Ok | Code::FailedPrecondition))
}

/// The payments service: counts its calls, and charges a PostgreSQL ledger when it has one.
#[derive(Clone, Default)]
pub struct Ledger {
    calls: Arc<AtomicU64>,
    postgres: Option<Committer>,
}

/// Where a charge's reply commits with it: the record store's own table (`PostgresStore`), or
/// the durable table beside a Redis record store (`DurableOutcomes`).
#[derive(Clone)]
enum Committer {
    Records(PostgresStore),
    Beside(DurableOutcomes),
}

impl Ledger {
    /// A ledger without a database: `ChargeInTransaction` is `UNIMPLEMENTED`.
    pub fn new() -> Self {
        Self::default()
    }

    /// A ledger whose `ChargeInTransaction` inserts into the `charges` table (created here)
    /// in the store's transaction.
    ///
    /// # Errors
    ///
    /// When the table cannot be created.
    pub async fn with_postgres(store: PostgresStore, pool: &PgPool) -> Result<Self, sqlx::Error> {
        Self::with(Committer::Records(store), pool).await
    }

    /// A ledger whose `ChargeInTransaction` commits its reply to `outcomes` (Redis the record
    /// store in front, PostgreSQL the authority: the outcomes are the layer's `recover` hook).
    ///
    /// # Errors
    ///
    /// When the table cannot be created.
    pub async fn with_durable(
        outcomes: DurableOutcomes,
        pool: &PgPool,
    ) -> Result<Self, sqlx::Error> {
        Self::with(Committer::Beside(outcomes), pool).await
    }

    async fn with(committer: Committer, pool: &PgPool) -> Result<Self, sqlx::Error> {
        let sql = "CREATE TABLE IF NOT EXISTS charges \
                   (id BIGSERIAL PRIMARY KEY, key_hash TEXT NOT NULL, amount BIGINT NOT NULL)";
        sqlx::query(sql).execute(pool).await?;
        Ok(Self { calls: Arc::default(), postgres: Some(committer) })
    }

    /// How many times the handlers ran.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// Counts the call and prints it (the tests read the server's output).
    fn start(&self) -> u64 {
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        println!("handler {call} started");
        call
    }
}

/// How long the call asks its handler to take: its `x-delay-ms` metadata entry.
fn delay<T>(request: &Request<T>) -> Duration {
    let ms = request.metadata().get("x-delay-ms").and_then(|v| v.to_str().ok()?.parse().ok());
    Duration::from_millis(ms.unwrap_or(0))
}

/// A charge's work in its transaction.
type Charged<'c> = Pin<Box<dyn Future<Output = Result<Response<ChargeReply>, String>> + Send + 'c>>;

/// The charge, in the transaction it is given: its row, then (after `delay`) its reply; the
/// account `fail` rolls back.
fn charge(
    key_hash: String,
    request: ChargeRequest,
    call: u64,
    delay: Duration,
) -> impl for<'c> FnOnce(&'c mut PgConnection) -> Charged<'c> + Send {
    move |tx| {
        Box::pin(async move {
            let sql = "INSERT INTO charges (key_hash, amount) VALUES ($1, $2)";
            let insert = sqlx::query(sql).bind(key_hash).bind(request.amount);
            insert.execute(&mut *tx).await.map_err(|error| error.to_string())?;
            println!("charge {call} written");
            tokio::time::sleep(delay).await;
            if request.account == "fail" {
                return Err(format!("the ledger refused call {call}"));
            }
            Ok(reply(&request, call))
        })
    }
}

/// The reply, with the charge's id in the `x-charge-id` metadata entry too.
fn reply(request: &ChargeRequest, call: u64) -> Response<ChargeReply> {
    let charge_id = format!("ch_{}_{call}", request.account);
    let mut response =
        Response::new(ChargeReply { charge_id: charge_id.clone(), amount: request.amount, call });
    let value = MetadataValue::try_from(charge_id).expect("an ASCII charge id");
    response.metadata_mut().insert("x-charge-id", value);
    response
}

#[tonic::async_trait]
impl Payments for Ledger {
    /// Charges `amount` to `account`: a non-positive amount is declined
    /// (`FAILED_PRECONDITION`, stored and replayed), the account `busy` is `UNAVAILABLE`
    /// (released: a retry runs again).
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        let (call, delay) = (self.start(), delay(&request));
        tokio::time::sleep(delay).await;
        let request = request.into_inner();
        if request.account == "busy" {
            return Err(Status::unavailable(format!("busy on call {call}")));
        }
        if request.amount <= 0 {
            return Err(Status::failed_precondition(format!("declined on call {call}")));
        }
        Ok(reply(&request, call))
    }

    /// Charges in one PostgreSQL transaction with the idempotency record: the `charges` row
    /// and the stored reply commit together, or neither does. The account `fail` rolls back
    /// after its row was written (`INTERNAL`; the key is released).
    async fn charge_in_transaction(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        if let Some(committer) = &self.postgres {
            let context = request.extensions().get::<IdempotencyContext>().cloned();
            let context = context.ok_or_else(|| Status::internal("no idempotency context"))?;
            let (call, delay) = (self.start(), delay(&request));
            let charge = charge(context.key_hash().to_owned(), request.into_inner(), call, delay);
            return Ok(match committer {
                Committer::Records(store) => store.transaction(&context, charge).await?,
                Committer::Beside(outcomes) => outcomes.transaction(&context, charge).await?,
            });
        }
        Err(Status::unimplemented("this ledger has no database"))
    }

    type WatchStream = tonic::codegen::BoxStream<ChargeReply>;

    /// Two replies, one per handler call: a server stream, which the layer passes through.
    async fn watch(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let first = self.start();
        tokio::time::sleep(delay(&request)).await;
        let request = request.into_inner();
        let second = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let replies = [first, second].map(|call| Ok(reply(&request, call).into_inner()));
        Ok(Response::new(Box::pin(tonic::codegen::tokio_stream::iter(replies))))
    }
}

/// Serves `ledger` behind `layer` (the example's [`layer`], configured further as the caller
/// likes) on `listener`, until the process ends.
///
/// # Errors
///
/// When the server fails.
pub async fn serve<St: Store, Sc: ScopeExtractor>(
    listener: tokio::net::TcpListener,
    layer: GrpcIdempotencyLayer<St, Sc>,
    ledger: Ledger,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .layer(layer)
        .add_service(PaymentsServer::new(ledger))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
        .await
}
