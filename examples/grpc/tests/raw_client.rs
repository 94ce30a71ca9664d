//! What tonic's client never sends, sent over a real socket with a raw HTTP/2 client: a call
//! whose client resets its stream after its message. The read of the message is the same on
//! every store; the memory store serves.

use std::{net::SocketAddr, time::Duration};

use axum_idempotency::store::MemoryStore;
use bytes::Bytes;
use grpc_example::{Ledger, layer, pb::ChargeRequest};
use prost::Message as _;

async fn server() -> (SocketAddr, Ledger) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let ledger = Ledger::new();
    tokio::spawn(grpc_example::serve(listener, layer(MemoryStore::new()), ledger.clone()));
    (address, ledger)
}

/// A `Charge` call with `key`, its one message framed; reset with `CANCEL` after it when
/// `reset`, ended as a unary call ends otherwise. The call's `grpc-status`, when it is
/// answered.
async fn charge(address: SocketAddr, key: &str, reset: bool) -> Option<String> {
    let tcp = tokio::net::TcpStream::connect(address).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let request = http::Request::post(format!("http://{address}/payments.v1.Payments/Charge"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("idempotency-key", key)
        .body(())
        .unwrap();
    let (response, mut send) = client.send_request(request, false).unwrap();
    let message = ChargeRequest { request_id: String::new(), account: "acct".into(), amount: 5 }
        .encode_to_vec();
    let mut framed = vec![0];
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(&message);
    send.send_data(Bytes::from(framed), !reset).unwrap();
    if reset {
        tokio::time::sleep(Duration::from_millis(100)).await;
        send.send_reset(h2::Reason::CANCEL);
        return None;
    }
    let (head, mut body) = response.await.unwrap().into_parts();
    while let Some(data) = body.data().await {
        let _ = data.unwrap();
    }
    let trailers = body.trailers().await.unwrap().unwrap_or_default();
    let status = trailers.get("grpc-status").or_else(|| head.headers.get("grpc-status"));
    status.map(|status| status.to_str().unwrap().to_owned())
}

/// A client that resets its stream after its message cancelled the call: the handler does not
/// run, nothing is stored, and the call sent again runs once.
#[tokio::test]
async fn a_call_reset_after_its_message_does_not_run() {
    let (address, ledger) = server().await;
    assert_eq!(charge(address, "reset", true).await, None);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(ledger.calls(), 0, "a cancelled call ran its handler");
    assert_eq!(charge(address, "reset", false).await.as_deref(), Some("0"));
    assert_eq!(charge(address, "reset", false).await.as_deref(), Some("0"));
    assert_eq!(ledger.calls(), 1, "sent again, it ran once and was replayed");
}
