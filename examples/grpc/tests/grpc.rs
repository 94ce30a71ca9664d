//! The gRPC door over real sockets: a tonic server behind the layer on a loopback port, and a
//! tonic client, on every store (memory, Redis, Redis behind the near cache, PostgreSQL).
//! What each test asserts is what a client sees: the status, the message, the metadata, and
//! how many times the handler ran.

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::time::Duration;

use axum_idempotency::{
    grpc::{GrpcIdempotencyLayer, HeaderScope, Limits},
    layer::scope::ScopeExtractor,
    settings::Waiting,
    store::Store,
};
use common::*;
use grpc_example::{
    Ledger, layer,
    pb::{ChargeReply, ChargeRequest, payments_client::PaymentsClient},
    serve,
};
use tonic::{Code, Request, Response, Status, codec::CompressionEncoding, transport::Channel};

/// A server on a free loopback port, and a client of it. The server stops with the test.
async fn start<St: Store, Sc: ScopeExtractor>(
    layer: GrpcIdempotencyLayer<St, Sc>,
    ledger: Ledger,
) -> PaymentsClient<Channel> {
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
    let (first, first_replayed, first_id) =
        reply(client.charge(charge(Some("k1"), "acct", 100)).await);
    assert_eq!((first.call, first.amount, first_replayed), (1, 100, false));
    assert_eq!(first_id, "ch_acct_1");
    let (again, again_replayed, again_id) =
        reply(client.charge(charge(Some("k1"), "acct", 100)).await);
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
            tokio::spawn(
                async move { client.charge(slow(charge(Some("dup"), "acct", 5), 300)).await },
            )
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
    assert!(other.message().contains("another method or request message"), "{other:?}");
    assert_eq!(ledger.calls(), 1);
}

async fn a_retry_while_the_call_runs_waits_and_gets_its_reply<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let mut client = start(layer(h.store()), ledger.clone()).await;
    let mut first = client.clone();
    let running =
        tokio::spawn(async move { first.charge(slow(charge(Some("w"), "a", 7), 800)).await });
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
    let running =
        tokio::spawn(async move { first.charge(slow(charge(Some("r"), "a", 7), 1500)).await });
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

/// A retry whose own deadline (`grpc-timeout`) is shorter than the layer's wait waits within
/// it, and is answered `ABORTED` with when to retry: not `DEADLINE_EXCEEDED`, which says
/// nothing of the original.
async fn a_retry_waits_within_its_own_deadline<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let mut client = start(layer(h.store()), ledger.clone()).await;
    let mut first = client.clone();
    let running =
        tokio::spawn(async move { first.charge(slow(charge(Some("t"), "a", 7), 3000)).await });
    eventually("the first call runs", async || ledger.calls() == 1).await;
    let mut retry = charge(Some("t"), "a", 7);
    retry.set_timeout(Duration::from_millis(600));
    let started = std::time::Instant::now();
    let aborted = client.charge(retry).await.unwrap_err();
    let took = started.elapsed();
    assert_eq!(aborted.code(), Code::Aborted, "{aborted:?}");
    assert!(aborted.metadata().get("grpc-retry-pushback-ms").is_some(), "{aborted:?}");
    assert!(took >= Duration::from_millis(400) && took < Duration::from_millis(600), "{took:?}");
    assert_eq!(reply(running.await.unwrap()).0.call, 1);
    assert_eq!(ledger.calls(), 1);
}

/// A server with its own timeout (`Server::builder().timeout`), told to the layer: a duplicate
/// of a call that outlasts it is answered `ABORTED` with when to retry before tonic cuts it
/// `CANCELLED "Timeout expired"`, which no retry policy lists; the handler runs once and a
/// later call replays.
async fn a_servers_own_timeout_is_answered_aborted_before_it_cuts_the_call<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let timeout = Duration::from_secs(1);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tonic::transport::Server::builder()
        .timeout(timeout)
        .layer(layer(h.store()).server_timeout(timeout))
        .add_service(grpc_example::pb::payments_server::PaymentsServer::new(ledger.clone()))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(server);
    let mut client = PaymentsClient::connect(format!("http://{addr}")).await.unwrap();
    let mut first = client.clone();
    // The original outlasts the server's timeout: tonic cuts it, and its handler goes on.
    let running =
        tokio::spawn(async move { first.charge(slow(charge(Some("s"), "a", 7), 1500)).await });
    eventually("the first call runs", async || ledger.calls() == 1).await;
    let started = std::time::Instant::now();
    let aborted = client.charge(charge(Some("s"), "a", 7)).await.unwrap_err();
    let took = started.elapsed();
    assert_eq!(aborted.code(), Code::Aborted, "{aborted:?}");
    assert!(aborted.metadata().get("grpc-retry-pushback-ms").is_some(), "{aborted:?}");
    assert!(!aborted.details().is_empty(), "google.rpc.RetryInfo in the details");
    assert!(took >= Duration::from_millis(700) && took < timeout, "{took:?}");
    // The original's own answer is tonic's, cut at the server's timeout.
    assert_eq!(running.await.unwrap().unwrap_err().code(), Code::Cancelled);
    eventually("the original settles", async || {
        client.clone().charge(charge(Some("s"), "a", 7)).await.is_ok()
    })
    .await;
    let (after, was_replayed, _) = reply(client.charge(charge(Some("s"), "a", 7)).await);
    assert_eq!((after.call, was_replayed), (1, true));
    assert_eq!(ledger.calls(), 1);
}

/// The HTTP layer's scopes serve the gRPC door: a metadata entry, and an extractor's refusal
/// in gRPC's terms.
async fn a_metadata_scope_keys_tenants_apart_and_refuses_a_call_without_it<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let tenants = layer(h.store()).scope(HeaderScope::new("x-tenant-id").unwrap());
    let mut client = start(tenants, ledger.clone()).await;
    let missing = client.charge(charge(Some("k"), "a", 1)).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");
    assert!(missing.message().contains("x-tenant-id"), "{missing:?}");
    for (tenant, runs) in [("t1", 1), ("t2", 2), ("t1", 2)] {
        let mut request = charge(Some("k"), "a", 1);
        request.metadata_mut().insert("x-tenant-id", tenant.parse().unwrap());
        reply(client.charge(request).await);
        assert_eq!(ledger.calls(), runs, "{tenant}");
    }
}

async fn a_missing_or_malformed_key_is_invalid_argument<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let mut client = start(layer(h.store()), ledger.clone()).await;
    let missing = client.charge(charge(None, "a", 1)).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");
    assert!(missing.message().contains("idempotency key"), "{missing:?}");
    for bad in [String::new(), "k".repeat(256)] {
        let malformed = client.charge(charge(Some(&bad), "a", 1)).await.unwrap_err();
        assert_eq!(malformed.code(), Code::InvalidArgument, "{bad}: {malformed:?}");
    }
    let mut twice = charge(Some("k"), "a", 1);
    twice.metadata_mut().append("idempotency-key", "k".parse().unwrap());
    assert_eq!(client.charge(twice).await.unwrap_err().code(), Code::InvalidArgument);
    // A binary key, alone or beside an ASCII one (the two could name two keys).
    for ascii in [None, Some("k")] {
        let mut binary = charge(ascii, "a", 1);
        binary
            .metadata_mut()
            .insert_bin("idempotency-key-bin", tonic::metadata::MetadataValue::from_bytes(b"k"));
        let refused = client.charge(binary).await.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument, "{ascii:?}: {refused:?}");
    }
    let mut long_id = charge(None, "a", 1);
    long_id.get_mut().request_id = "r".repeat(256);
    let refused = client.charge(long_id).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert_eq!(ledger.calls(), 0, "nothing ran");
    // A key made optional: a call without one runs, every time, without idempotency.
    let mut optional = start(layer(h.store()).require_key(false), ledger.clone()).await;
    for call in 1..=2 {
        let (ran, was_replayed, _) = reply(optional.charge(charge(None, "a", 1)).await);
        assert_eq!((ran.call, was_replayed), (call, false));
    }
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
    assert_eq!(
        (declined.code(), again.code()),
        (Code::FailedPrecondition, Code::FailedPrecondition)
    );
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

/// A key is an opaque metadata value: spaces and commas are its own, and a quoted key is
/// another key than the bare one (no HTTP quoting).
async fn a_key_is_any_printable_ascii_metadata_value<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let mut client = start(layer(h.store()), ledger.clone()).await;
    for (n, key) in ["order 17", "order,17", "qq", "\"qq\""].into_iter().enumerate() {
        let (ran, was_replayed, _) = reply(client.charge(charge(Some(key), "a", 1)).await);
        assert_eq!((ran.call, was_replayed), (n as u64 + 1, false), "{key}");
        let (again, was_replayed, _) = reply(client.charge(charge(Some(key), "a", 1)).await);
        assert_eq!((again.call, was_replayed), (n as u64 + 1, true), "{key}");
    }
    assert_eq!(ledger.calls(), 4);
}

/// A server that compresses its replies for the clients that accept gzip: the stored reply is
/// the uncompressed one, so that a retry from a client that accepts no compression reads it.
async fn a_reply_is_stored_uncompressed_and_replayed_to_any_client<H: Harness>(h: H) {
    use grpc_example::pb::payments_server::PaymentsServer;
    let ledger = Ledger::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = PaymentsServer::new(ledger.clone())
        .send_compressed(CompressionEncoding::Gzip)
        .accept_compressed(CompressionEncoding::Gzip);
    let server = tonic::transport::Server::builder()
        .layer(layer(h.store()))
        .add_service(service)
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(server);
    let plain = PaymentsClient::connect(format!("http://{addr}")).await.unwrap();
    let mut gzip = plain.clone().accept_compressed(CompressionEncoding::Gzip);
    let (first, first_replayed, first_id) = reply(gzip.charge(charge(Some("g"), "a", 5)).await);
    assert_eq!((first.call, first_replayed), (1, false));
    for mut client in [plain.clone(), gzip.clone()] {
        let (again, was_replayed, id) = reply(client.charge(charge(Some("g"), "a", 5)).await);
        assert_eq!((again.call, was_replayed, id), (1, true, first_id.clone()));
    }
    assert_eq!(ledger.calls(), 1);
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
    // A gzip request is read uncompressed: its fingerprint is the message's, so a retry sent
    // without compression is the same call, and another message under the key is not.
    let mut gzip = client.clone().send_compressed(CompressionEncoding::Gzip);
    let (_, first_replayed, first_id) = reply(gzip.charge(charge(Some("z"), "a", 1)).await);
    assert!(!first_replayed);
    assert_eq!(ledger.calls(), 5);
    let (_, was_replayed, id) = reply(client.charge(charge(Some("z"), "a", 1)).await);
    assert_eq!((was_replayed, id), (true, first_id.clone()));
    let other = gzip.charge(charge(Some("z"), "a", 2)).await.unwrap_err();
    assert_eq!(other.code(), Code::FailedPrecondition, "{other:?}");
    // So is a deflate request.
    let mut deflate = client.clone().send_compressed(CompressionEncoding::Deflate);
    let (_, was_replayed, id) = reply(deflate.charge(charge(Some("z"), "a", 1)).await);
    assert_eq!((was_replayed, id), (true, first_id));
    assert_eq!(ledger.calls(), 5);
}

/// A streaming method listed as unary runs, and its stream is answered; its retry is told
/// that it ran and cannot be replayed: never a second run, never half a reply.
async fn a_stream_listed_as_unary_runs_once_and_is_not_replayed<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let mut client =
        start(layer(h.store()).unary("/payments.v1.Payments/Watch"), ledger.clone()).await;
    let mut stream = client.watch(charge(Some("w"), "a", 1)).await.unwrap();
    let mut replies = 0;
    while stream.get_mut().message().await.unwrap().is_some() {
        replies += 1;
    }
    // The example's stream counts a call a reply.
    assert_eq!((replies, ledger.calls()), (2, 2));
    let retried = client.watch(charge(Some("w"), "a", 1)).await.unwrap_err();
    assert_eq!(retried.code(), Code::Internal, "{retried:?}");
    assert!(retried.message().contains("not one message"), "{retried:?}");
    assert_eq!(ledger.calls(), 2, "not run again");
}

/// One call, one key: a metadata key and a request id that differ are refused (a retry that
/// carried one of them alone would name another record, and run again); so is a key with a
/// space at either end, which HTTP/2 forbids and a proxy may strip.
async fn two_different_keys_or_a_padded_key_are_refused<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let mut client = start(layer(h.store()), ledger.clone()).await;
    let mut both = charge(Some("meta-1"), "a", 1);
    both.get_mut().request_id = "req-1".into();
    let refused = client.charge(both).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("differ"), "{refused:?}");
    for padded in [" k", "k "] {
        let refused = client.charge(charge(Some(padded), "a", 1)).await.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument, "{padded:?}: {refused:?}");
    }
    assert_eq!(ledger.calls(), 0);
    let mut same = charge(Some("k-1"), "a", 1);
    same.get_mut().request_id = "k-1".into();
    let (first, _, _) = reply(client.charge(same).await);
    let mut by_id = charge(None, "a", 1);
    by_id.get_mut().request_id = "k-1".into();
    let (again, was_replayed, _) = reply(client.charge(by_id).await);
    assert_eq!((first.call, again.call, was_replayed), (1, 1, true));
}

async fn a_recovery_hook_answers_what_happened_and_the_handler_does_not_run<H: Harness>(h: H) {
    use axum_idempotency::{
        grpc::Reply,
        recovery::{Lookup, Recovered},
    };
    use prost::Message as _;
    let ledger = Ledger::new();
    let every_claim = axum_idempotency::settings::Recovery::default().every_claim(true);
    let hooked =
        layer(h.store()).recovery(every_claim).recover(|lookup: Lookup<bytes::Bytes>| async move {
            let request = ChargeRequest::decode(lookup.request.unwrap_or_default())?;
            let reply =
                ChargeReply { charge_id: "ch_recovered".into(), amount: request.amount, call: 0 };
            match request.account.as_str() {
                "known" => Ok(Recovered::Happened(Reply::from(Response::new(reply)))),
                "hook-down" => Err("the system of record is down".into()),
                _ => Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Recovered::Unknown),
            }
        });
    let mut client = start(hooked, ledger.clone()).await;
    for _ in 0..2 {
        let known = client.charge(charge(Some("known"), "known", 5)).await.unwrap();
        assert!(replayed(&known), "answered as a replay");
        assert_eq!(known.into_inner().charge_id, "ch_recovered");
    }
    let (new, new_replayed, _) = reply(client.charge(charge(Some("new"), "acct", 5)).await);
    assert_eq!((new.call, new_replayed), (1, false));
    let refused = client.charge(charge(Some("down"), "hook-down", 5)).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert_eq!(ledger.calls(), 1, "the handler ran for the unknown call alone");
}

async fn a_reply_over_the_stored_limit_is_not_run_again<H: Harness>(h: H) {
    let ledger = Ledger::new();
    let mut client =
        start(layer(h.store()).limits(Limits::default().stored_body(4)), ledger.clone()).await;
    let (first, first_replayed, _) = reply(client.charge(charge(Some("big"), "acct", 5)).await);
    assert_eq!((first.call, first_replayed), (1, false), "the caller gets its reply");
    let retried = client.charge(charge(Some("big"), "acct", 5)).await.unwrap_err();
    assert_eq!(retried.code(), Code::Internal, "{retried:?}");
    assert!(retried.message().contains("cannot be replayed"), "{retried:?}");
    assert_eq!(ledger.calls(), 1, "completed, not replayable: never run again");
}

every_store!(
    a_reply_over_the_stored_limit_is_not_run_again,
    a_recovery_hook_answers_what_happened_and_the_handler_does_not_run,
    a_call_runs_once_and_its_retry_is_replayed,
    twenty_concurrent_duplicates_run_the_handler_once,
    another_message_under_the_key_is_failed_precondition,
    a_retry_while_the_call_runs_waits_and_gets_its_reply,
    a_retry_past_the_wait_is_aborted_with_retry_info,
    a_missing_or_malformed_key_is_invalid_argument,
    a_retry_waits_within_its_own_deadline,
    a_servers_own_timeout_is_answered_aborted_before_it_cuts_the_call,
    a_stream_listed_as_unary_runs_once_and_is_not_replayed,
    two_different_keys_or_a_padded_key_are_refused,
    a_metadata_scope_keys_tenants_apart_and_refuses_a_call_without_it,
    the_request_id_in_the_message_is_the_key,
    a_declined_charge_is_replayed_and_a_busy_one_runs_again,
    scopes_keep_tenants_keys_apart,
    streaming_methods_and_compressed_calls,
    a_key_is_any_printable_ascii_metadata_value,
    a_reply_is_stored_uncompressed_and_replayed_to_any_client,
);

/// The store unreachable: `UNAVAILABLE`, with a hint to retry, and nothing runs.
fn assert_unavailable(answer: Result<Response<ChargeReply>, Status>) {
    let status = answer.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("store is unavailable"), "{status:?}");
    assert!(status.metadata().get("grpc-retry-pushback-ms").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_is_unavailable() {
    let mut server = RedisServer::start();
    let ledger = Ledger::new();
    let mut client = start(layer(server.store()), ledger.clone()).await;
    reply(client.charge(charge(Some("before"), "a", 1)).await);
    server.kill();
    assert_unavailable(client.charge(charge(Some("after"), "a", 1)).await);
    assert_eq!(ledger.calls(), 1, "nothing ran without its claim");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_down_is_unavailable() {
    use axum_idempotency::store::{PostgresStore, sqlx::postgres::PgPoolOptions};
    let url = format!("postgres://postgres@127.0.0.1:{}/postgres", free_port());
    let pool =
        PgPoolOptions::new().acquire_timeout(Duration::from_secs(2)).connect_lazy(&url).unwrap();
    let ledger = Ledger::new();
    let mut client = start(layer(PostgresStore::new(pool)), ledger.clone()).await;
    assert_unavailable(client.charge(charge(Some("k"), "a", 1)).await);
    assert_eq!(ledger.calls(), 0);
}

/// How many charges the ledger's table holds.
async fn charges(database: &common::postgres::TestDatabase) -> i64 {
    let client = database.client().await;
    client.query_one("SELECT count(*) FROM charges", &[]).await.unwrap().get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_commits_with_its_record_in_one_transaction() {
    let h = PostgresHarness::start().await;
    let ledger = Ledger::with_postgres(h.store(), &h.pool()).await.unwrap();
    let mut client = start(layer(h.store()), ledger.clone()).await;
    let (first, first_replayed, first_id) =
        reply(client.charge_in_transaction(charge(Some("tx"), "acct", 40)).await);
    assert_eq!((first.call, first_replayed), (1, false));
    let key = axum_idempotency::store::RecordKey::new("idempotency-grpc", b"", b"tx");
    assert_eq!(h.held(&key).await, Some(Held::Completed), "committed with the charge");
    let (again, again_replayed, again_id) =
        reply(client.charge_in_transaction(charge(Some("tx"), "acct", 40)).await);
    assert_eq!((again, again_replayed, again_id), (first, true, first_id));
    assert_eq!((charges(&h.database).await, ledger.calls()), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_charge_releases_its_key() {
    let h = PostgresHarness::start().await;
    let ledger = Ledger::with_postgres(h.store(), &h.pool()).await.unwrap();
    let mut client = start(layer(h.store()), ledger.clone()).await;
    for _ in 0..2 {
        let failed = client.charge_in_transaction(charge(Some("rb"), "fail", 40)).await;
        let failed = failed.unwrap_err();
        assert_eq!(failed.code(), Code::Internal, "{failed:?}");
        assert!(!status_replayed(&failed));
    }
    assert_eq!(ledger.calls(), 2, "released: the retry ran again");
    assert_eq!(charges(&h.database).await, 0, "each charge rolled back with its record");
    let key = axum_idempotency::store::RecordKey::new("idempotency-grpc", b"", b"rb");
    assert_eq!(h.held(&key).await, None);
}

/// The example's server binary over `database`, run as a child process (a lease of one
/// second), its stdout read line by line; killed when dropped.
struct Server {
    child: tokio::process::Child,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl Server {
    /// Starts a server, and a client of it once it listens.
    async fn spawn(database: &common::postgres::TestDatabase) -> (Self, PaymentsClient<Channel>) {
        use tokio::io::AsyncBufReadExt as _;
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_grpc-example"))
            .envs([("STORE", "postgres"), ("ADDR", "127.0.0.1:0"), ("LEASE_MS", "1000")])
            .env("DATABASE_URL", database.uri())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the example server starts");
        let stdout = child.stdout.take().unwrap();
        let mut server = Self { child, lines: tokio::io::BufReader::new(stdout).lines() };
        let listening = server.line_starting("listening on ").await;
        let addr = listening.trim_start_matches("listening on ");
        let client = PaymentsClient::connect(format!("http://{addr}")).await.unwrap();
        (server, client)
    }

    /// Waits (at most 30 s) for a line of output that starts with `prefix`.
    async fn line_starting(&mut self, prefix: &str) -> String {
        let found = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = self.lines.next_line().await.unwrap() {
                if line.starts_with(prefix) {
                    return line;
                }
            }
            panic!("the server exited before it printed {prefix:?}");
        });
        found.await.unwrap_or_else(|_| panic!("no {prefix:?} within 30 s"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_call_leaves_the_retry_to_another_which_charges_once() {
    let database = common::postgres::TestDatabase::create("grpc_kill").await;
    let (mut first, client) = Server::spawn(&database).await;
    let mut caller = client.clone();
    let call = tokio::spawn(async move {
        caller.charge_in_transaction(slow(charge(Some("kill"), "acct", 70), 60_000)).await
    });
    // Killed with its charge written in its transaction, before the commit.
    first.line_starting("charge 1 written").await;
    first.child.kill().await.unwrap();
    let lost = call.await.unwrap().unwrap_err();
    assert!(matches!(lost.code(), Code::Unavailable | Code::Unknown | Code::Cancelled), "{lost:?}");
    assert_eq!(charges(&database).await, 0, "the killed server's charge rolled back");

    // The retry, on a second server: it waits for the dead holder's lease, takes the key
    // over, and charges once.
    let (_second, mut client) = Server::spawn(&database).await;
    let (retried, retried_replayed, _) =
        reply(client.charge_in_transaction(charge(Some("kill"), "acct", 70)).await);
    assert_eq!((retried.call, retried_replayed), (1, false), "the second server's first call");
    let (again, again_replayed, _) =
        reply(client.charge_in_transaction(charge(Some("kill"), "acct", 70)).await);
    assert_eq!((again, again_replayed), (retried, true));
    assert_eq!(charges(&database).await, 1, "charged once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_losing_its_records_is_answered_from_the_durable_outcomes() {
    use axum_idempotency::durable::DurableOutcomes;
    let server = RedisServer::start();
    let database = common::postgres::TestDatabase::create("grpc_durable").await;
    let pool = common::postgres::pool_for(&database);
    let outcomes = DurableOutcomes::new(pool.clone());
    outcomes.migrate().await.unwrap();
    let ledger = Ledger::with_durable(outcomes.clone(), &pool).await.unwrap();
    let mut client = start(layer(server.store()).recover(outcomes), ledger.clone()).await;
    let (first, first_replayed, first_id) =
        reply(client.charge_in_transaction(charge(Some("d"), "acct", 12)).await);
    assert_eq!((first.call, first_replayed), (1, false));
    let mut redis = server.connection().await;
    let () = axum_idempotency::store::deadpool_redis::redis::cmd("FLUSHALL")
        .query_async(&mut redis)
        .await
        .unwrap();
    let (again, again_replayed, again_id) =
        reply(client.charge_in_transaction(charge(Some("d"), "acct", 12)).await);
    assert_eq!((again, again_replayed, again_id), (first, true, first_id), "from PostgreSQL");
    assert_eq!((charges(&database).await, ledger.calls()), (1, 1), "charged once");
}
