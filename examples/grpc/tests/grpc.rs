//! The gRPC door over real sockets: a tonic server behind the layer on a loopback port, and a
//! tonic client, on every store (memory, Redis, Redis behind the near cache, PostgreSQL).
//! What each test asserts is what a client sees: the status, the message, the metadata, and
//! how many times the handler ran.

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::time::Duration;

use axum_idempotency::{grpc::GrpcIdempotencyLayer, settings::Waiting, store::Store};
use common::*;
use grpc_example::{
    Ledger, layer,
    pb::{ChargeReply, ChargeRequest, payments_client::PaymentsClient},
    serve,
};
use tonic::{Code, Request, Response, Status, codec::CompressionEncoding, transport::Channel};

/// A server on a free loopback port, and a client of it. The server stops with the test.
async fn start<St: Store>(layer: GrpcIdempotencyLayer<St>, ledger: Ledger) -> PaymentsClient<Channel> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, layer, ledger));
    PaymentsClient::connect(format!("http://{addr}")).await.expect("the server answers")
}

/// A charge of `amount` to `account`, with `key` as its `idempotency-key` when given.
fn charge(key: Option<&str>, account: &str, amount: i64) -> Request<ChargeRequest> {
    let message = ChargeRequest { request_id: String::new(), account: account.into(), amount };
    let mut request = Request::new(message);
    if let Some(key) = key {
        request.metadata_mut().insert("idempotency-key", key.parse().unwrap());
    }
    request
}

/// The request, asking its handler to take `ms` milliseconds.
fn slow(mut request: Request<ChargeRequest>, ms: u64) -> Request<ChargeRequest> {
    request.metadata_mut().insert("x-delay-ms", ms.to_string().parse().unwrap());
    request
}

fn replayed<T>(response: &Response<T>) -> bool {
    response.metadata().get("idempotency-replayed").is_some_and(|v| v == "true")
}

fn status_replayed(status: &Status) -> bool {
    status.metadata().get("idempotency-replayed").is_some_and(|v| v == "true")
}

fn reply(answer: Result<Response<ChargeReply>, Status>) -> (ChargeReply, bool, String) {
    let response = answer.expect("OK");
    let charge_id = response.metadata().get("x-charge-id").unwrap().to_str().unwrap().to_owned();
    let replayed = replayed(&response);
    (response.into_inner(), replayed, charge_id)
}

async fn a_call_runs_once_and_its_retry_is_replayed<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let mut client = start(layer(h.store()), ledger.clone()).await;
    let (first, first_replayed, first_id) = reply(client.charge(charge(Some("k1"), "acct", 100)).await);
    assert_eq!((first.call, first.amount, first_replayed), (1, 100, false));
    assert_eq!(first_id, "ch_acct_1");
    let (again, again_replayed, again_id) = reply(client.charge(charge(Some("k1"), "acct", 100)).await);
    assert_eq!(again, first, "the stored message");
    assert!(again_replayed, "marked as replayed");
    assert_eq!(again_id, first_id, "the stored metadata");
    assert_eq!(ledger.calls(), 1, "the handler ran once");
}

async fn twenty_concurrent_duplicates_run_the_handler_once<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let client = start(layer(h.store()), ledger.clone()).await;
    let calls: Vec<_> = (0..20)
        .map(|_| {
            let mut client = client.clone();
            tokio::spawn(async move { client.charge(slow(charge(Some("dup"), "acct", 5), 300)).await })
        })
        .collect();
    let mut replays = 0;
    for call in calls {
        let (answer, was_replayed, _) = reply(call.await.unwrap());
        assert_eq!(answer.call, 1, "every duplicate gets the first call's reply");
        replays += usize::from(was_replayed);
    }
    assert_eq!(replays, 19, "all but the first are replays");
    assert_eq!(ledger.calls(), 1);
}

async fn another_message_under_the_key_is_failed_precondition<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let mut client = start(layer(h.store()), ledger.clone()).await;
    reply(client.charge(charge(Some("k"), "acct", 100)).await);
    let other = client.charge(charge(Some("k"), "acct", 200)).await.unwrap_err();
    assert_eq!(other.code(), Code::FailedPrecondition, "{other:?}");
    assert!(other.message().contains("another request message"), "{other:?}");
    assert_eq!(ledger.calls(), 1);
}

async fn a_retry_while_the_call_runs_waits_and_gets_its_reply<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let mut client = start(layer(h.store()), ledger.clone()).await;
    let mut first = client.clone();
    let running = tokio::spawn(async move { first.charge(slow(charge(Some("w"), "a", 7), 800)).await });
    eventually("the first call runs", async || ledger.calls() == 1).await;
    let (waited, was_replayed, _) = reply(client.charge(charge(Some("w"), "a", 7)).await);
    assert_eq!((waited.call, was_replayed), (1, true));
    assert_eq!(reply(running.await.unwrap()).0.call, 1);
    assert_eq!(ledger.calls(), 1);
}

async fn a_retry_past_the_wait_is_aborted_with_retry_info<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let short = layer(h.store()).waiting(Waiting::up_to(Duration::from_millis(200)));
    let mut client = start(short, ledger.clone()).await;
    let mut first = client.clone();
    let running = tokio::spawn(async move { first.charge(slow(charge(Some("r"), "a", 7), 1500)).await });
    eventually("the first call runs", async || ledger.calls() == 1).await;
    let aborted = client.charge(charge(Some("r"), "a", 7)).await.unwrap_err();
    assert_eq!(aborted.code(), Code::Aborted, "{aborted:?}");
    assert!(aborted.message().contains("in progress"), "{aborted:?}");
    let pushback = aborted.metadata().get("grpc-retry-pushback-ms").expect("a pushback");
    assert!(pushback.to_str().unwrap().parse::<u64>().unwrap() >= 1);
    assert!(!aborted.details().is_empty(), "google.rpc.RetryInfo in the details");
    reply(running.await.unwrap());
    let (after, was_replayed, _) = reply(client.charge(charge(Some("r"), "a", 7)).await);
    assert_eq!((after.call, was_replayed), (1, true));
    assert_eq!(ledger.calls(), 1);
}

async fn a_missing_or_malformed_key_is_invalid_argument<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let mut client = start(layer(h.store()), ledger.clone()).await;
    let missing = client.charge(charge(None, "a", 1)).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");
    assert!(missing.message().contains("idempotency key"), "{missing:?}");
    for bad in ["a,b".to_owned(), "k".repeat(256)] {
        let malformed = client.charge(charge(Some(&bad), "a", 1)).await.unwrap_err();
        assert_eq!(malformed.code(), Code::InvalidArgument, "{bad}: {malformed:?}");
    }
    let mut long_id = charge(None, "a", 1);
    long_id.get_mut().request_id = "r".repeat(256);
    let refused = client.charge(long_id).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert_eq!(ledger.calls(), 0, "nothing ran");
}

async fn the_request_id_in_the_message_is_the_key<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let mut client = start(layer(h.store()), ledger.clone()).await;
    let by_id = || {
        let mut request = charge(None, "a", 3);
        request.get_mut().request_id = "6f1f0a4e-aip-155".into();
        request
    };
    let (first, first_replayed, _) = reply(client.charge(by_id()).await);
    let (again, again_replayed, _) = reply(client.charge(by_id()).await);
    assert_eq!((first.call, first_replayed, again.call, again_replayed), (1, false, 1, true));
    assert_eq!(ledger.calls(), 1);
}

async fn a_declined_charge_is_replayed_and_a_busy_one_runs_again<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let mut client = start(layer(h.store()), ledger.clone()).await;
    let declined = client.charge(charge(Some("d"), "a", 0)).await.unwrap_err();
    let again = client.charge(charge(Some("d"), "a", 0)).await.unwrap_err();
    assert_eq!((declined.code(), again.code()), (Code::FailedPrecondition, Code::FailedPrecondition));
    assert_eq!(again.message(), "declined on call 1", "the stored status");
    assert!(!status_replayed(&declined) && status_replayed(&again));
    let busy = client.charge(charge(Some("b"), "busy", 5)).await.unwrap_err();
    let retried = client.charge(charge(Some("b"), "busy", 5)).await.unwrap_err();
    assert_eq!((busy.code(), busy.message()), (Code::Unavailable, "busy on call 2"));
    assert_eq!(retried.message(), "busy on call 3", "not stored: the retry ran");
    assert!(!status_replayed(&retried));
    assert_eq!(ledger.calls(), 3);
}

async fn scopes_keep_tenants_keys_apart<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let mut client = start(layer(h.store()), ledger.clone()).await;
    for tenant in ["t1", "t2"] {
        let mut request = charge(Some("same"), "a", 9);
        request.metadata_mut().insert("x-tenant-id", tenant.parse().unwrap());
        let (answer, was_replayed, _) = reply(client.charge(request).await);
        assert!(!was_replayed, "{tenant}: {answer:?}");
    }
    assert_eq!(ledger.calls(), 2);
}

async fn streaming_methods_and_compressed_calls<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let mut client = start(layer(h.store()), ledger.clone()).await;
    for _ in 0..2 {
        let mut stream = client.watch(charge(Some("s"), "a", 1)).await.unwrap();
        assert!(!replayed(&stream), "a stream is passed through");
        let mut replies = 0;
        while stream.get_mut().message().await.unwrap().is_some() {
            replies += 1;
        }
        assert_eq!(replies, 2);
    }
    assert_eq!(ledger.calls(), 4, "each stream ran its handler");
    let mut gzip = client.clone().send_compressed(CompressionEncoding::Gzip);
    let refused = gzip.charge(charge(Some("z"), "a", 1)).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unimplemented, "{refused:?}");
    assert_eq!(ledger.calls(), 4);
}

every_store!(
    a_call_runs_once_and_its_retry_is_replayed,
    twenty_concurrent_duplicates_run_the_handler_once,
    another_message_under_the_key_is_failed_precondition,
    a_retry_while_the_call_runs_waits_and_gets_its_reply,
    a_retry_past_the_wait_is_aborted_with_retry_info,
    a_missing_or_malformed_key_is_invalid_argument,
    the_request_id_in_the_message_is_the_key,
    a_declined_charge_is_replayed_and_a_busy_one_runs_again,
    scopes_keep_tenants_keys_apart,
    streaming_methods_and_compressed_calls,
);
