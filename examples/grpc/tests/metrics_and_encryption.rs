//! The gRPC door's metrics, labelled with the method's path as their `route`, and its records
//! encrypted at rest: the engine's, reused. A test binary of its own: the metrics recorder is
//! the process's.

use std::collections::BTreeMap;

use axum_idempotency::layer::scope::ScopeExtractor;
use axum_idempotency::{MemoryStore, encryption::Keyring};
use grpc_example::{
    Ledger, layer,
    pb::{ChargeRequest, payments_client::PaymentsClient},
    serve,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tonic::{Code, Request, transport::Channel};

async fn start(
    layer: axum_idempotency::grpc::GrpcIdempotencyLayer<MemoryStore, impl ScopeExtractor>,
) -> PaymentsClient<Channel> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, layer, Ledger::new()));
    PaymentsClient::connect(format!("http://{addr}")).await.unwrap()
}

fn charge(key: &str, amount: i64) -> Request<ChargeRequest> {
    let mut request =
        Request::new(ChargeRequest { request_id: String::new(), account: "a".into(), amount });
    request.metadata_mut().insert("idempotency-key", key.parse().unwrap());
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_are_counted_by_method_and_encrypted_records_replay() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().expect("the only recorder of this test binary");

    let keyring = Keyring::new("k1", [7; 32]).unwrap();
    let mut client = start(layer(MemoryStore::new()).encrypt_at_rest(keyring)).await;
    let first = client.charge(charge("m", 10)).await.unwrap();
    let again = client.charge(charge("m", 10)).await.unwrap();
    assert_eq!(again.metadata().get("idempotency-replayed").unwrap(), "true");
    assert_eq!(again.into_inner(), first.into_inner(), "decrypted and replayed");
    let other = client.charge(charge("m", 11)).await.unwrap_err();
    assert_eq!(other.code(), Code::FailedPrecondition);

    let mut counters = BTreeMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        if let DebugValue::Counter(count) = value {
            let key = key.key();
            let labels: Vec<String> =
                key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
            counters.insert(format!("{}{{{}}}", key.name(), labels.join(",")), count);
        }
    }
    let claims = |outcome: &str| {
        let name = format!(
            "idempotency_claims_total{{route=/payments.v1.Payments/Charge,outcome={outcome}}}"
        );
        counters.get(&name).copied().unwrap_or_else(|| panic!("no {name} in {counters:#?}"))
    };
    assert_eq!((claims("claimed"), claims("replayed"), claims("mismatch")), (1, 1, 1));
}
