//! `examples/server.rs` run as a process: its operator routes (`ADMIN_TOKEN`) inspect and
//! forget a tenant's key and list the abandoned claims, and refuse a request without the token.

use crate::common;

use std::time::Duration;

use axum::body::Body;
use common::{example::Child, free_port};
use http::Request;
use http_body_util::BodyExt;
use serde_json::Value;

/// `method` `path` on the server at `port`, with `token` as a bearer token and `headers`.
async fn call(
    port: u16,
    method: &str,
    path: &str,
    token: Option<&str>,
    headers: &[(&str, &str)],
) -> (u16, Value) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Body>();
    let mut request =
        Request::builder().method(method).uri(format!("http://127.0.0.1:{port}{path}"));
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let body = if method == "POST" { Body::from(r#"{"amount":100}"#) } else { Body::empty() };
    let response =
        tokio::time::timeout(Duration::from_secs(15), client.request(request.body(body).unwrap()))
            .await
            .expect("an answer within 15 s")
            .expect("the server answers");
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_routes_inspect_and_forget_a_tenants_key_behind_the_token() {
    let port = free_port();
    let mut server = Child::spawn(
        "server",
        &[],
        &[("PORT", &port.to_string()), ("ADMIN_TOKEN", "s3cret"), ("RUST_LOG", "warn")],
    );
    server.line_starting("listening on").await;
    let pay = [
        ("idempotency-key", "order-1"),
        ("x-tenant-id", "acme"),
        ("content-type", "application/json"),
    ];
    let (status, first) = call(port, "POST", "/payments", None, &pay).await;
    assert_eq!((status, &first["id"]), (201, &Value::from("pay_1")));

    assert_eq!(call(port, "GET", "/admin/keys/acme/order-1", None, &[]).await.0, 401);
    assert_eq!(call(port, "GET", "/admin/keys/acme/order-1", Some("wrong"), &[]).await.0, 401);
    let (status, report) = call(port, "GET", "/admin/keys/acme/order-1", Some("s3cret"), &[]).await;
    assert_eq!((status, &report["state"]), (200, &Value::from("completed")), "{report}");
    assert!(report["response"].is_null(), "the body only when asked: {report}");
    assert!(report["size"].as_u64().unwrap() > 0 && report["time_left_ms"].as_u64().unwrap() > 0);
    let path = "/admin/keys/acme/order-1?body=true";
    let (_, report) = call(port, "GET", path, Some("s3cret"), &[]).await;
    assert_eq!(report["response"]["status"], 201, "{report}");
    assert!(report["response"]["body"].as_str().unwrap().contains("pay_1"), "{report}");
    // Another tenant's key of the same name is another record.
    assert_eq!(call(port, "GET", "/admin/keys/globex/order-1", Some("s3cret"), &[]).await.0, 404);

    let (status, forgotten) =
        call(port, "DELETE", "/admin/keys/acme/order-1", Some("s3cret"), &[]).await;
    assert_eq!((status, &forgotten["forgotten"]), (200, &Value::from("deleted")));
    let (status, again) = call(port, "POST", "/payments", None, &pay).await;
    assert_eq!((status, &again["id"]), (201, &Value::from("pay_2")), "the retry ran as new");
    let (status, absent) =
        call(port, "DELETE", "/admin/keys/acme/nothing", Some("s3cret"), &[]).await;
    assert_eq!((status, &absent["forgotten"]), (404, &Value::from("absent")));

    let (status, listed) =
        call(port, "GET", "/admin/abandoned?lapsed_secs=0", Some("s3cret"), &[]).await;
    assert_eq!((status, listed), (200, Value::Array(vec![])));
    server.sigkill().await;
}
