//! The example payments service, served over gRPC behind the idempotency layer.
//!
//! ```text
//! cargo run -p grpc-example                                   # memory, 127.0.0.1:50051
//! STORE=redis REDIS_URL=redis://127.0.0.1:6379 cargo run -p grpc-example
//! STORE=postgres DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run -p grpc-example
//! ```
//!
//! `ADDR` sets the address (`127.0.0.1:0` for any free port); `LEASE_MS` the claims' lease.
//! It prints `listening on <address>` once it accepts calls.

use std::time::Duration;

use axum_idempotency::store::Store;
use axum_idempotency::{
    MemoryStore, RedisStore,
    store::{PostgresStore, sqlx::PgPool},
};
use grpc_example::{Ledger, layer, serve};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::var("ADDR").unwrap_or_else(|_| "127.0.0.1:50051".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    match std::env::var("STORE").as_deref().unwrap_or("memory") {
        "memory" => run(listener, MemoryStore::new(), Ledger::new()).await,
        "redis" => {
            let store = RedisStore::from_url(&std::env::var("REDIS_URL")?)?;
            run(listener, store, Ledger::new()).await
        }
        "postgres" => {
            let pool = PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
            let store = PostgresStore::new(pool.clone());
            store.migrate().await?;
            let ledger = Ledger::with_postgres(store.clone(), &pool).await?;
            run(listener, store, ledger).await
        }
        other => Err(format!("STORE={other}: memory, redis or postgres").into()),
    }
}

/// Serves the ledger over `store`, with the lease `LEASE_MS` sets.
async fn run<St: Store>(
    listener: tokio::net::TcpListener,
    store: St,
    ledger: Ledger,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut layer = layer(store);
    if let Ok(ms) = std::env::var("LEASE_MS") {
        layer = layer.lease(Duration::from_millis(ms.parse()?));
    }
    println!("listening on {}", listener.local_addr()?);
    serve(listener, layer, ledger).await?;
    Ok(())
}
