//! `examples/clickstream.rs` run as a process against a private Redis: it reads its stream to
//! the end, counts every distinct click but the false positives, drops every redelivered one,
//! and leaves its filters (and no stream) in Redis.

use crate::common;

use common::example::Child;

/// The number after `label` in `line`.
fn number_after(line: &str, label: &str) -> usize {
    let rest =
        &line[line.find(label).unwrap_or_else(|| panic!("{label:?} in {line:?}")) + label.len()..];
    rest.trim_start().split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clickstream_example_drops_every_redelivery_and_few_new_clicks() {
    let server = common::RedisServer::start();
    let url = format!("redis://127.0.0.1:{}", server.port);
    let mut example = Child::spawn("clickstream", &["20000", "4000"], &[("REDIS_URL", &url)]);
    let produced = example.line_starting("produced").await;
    assert_eq!(produced, "produced 24000 clicks: 20000 distinct, 4000 redelivered");
    let counted = example.line_starting("counted").await;
    let positives = example.line_starting("false positives").await;
    let negatives = example.line_starting("false negatives").await;
    assert_eq!(negatives, "false negatives: 0 (a duplicate counted)");
    let false_positives = number_after(&positives, "false positives:");
    assert_eq!(number_after(&counted, "counted"), 20_000 - false_positives, "{counted}");
    assert_eq!(number_after(&counted, "dropped"), 4_000, "{counted}");
    // At most 1 %, the rate at the design load; the average while filling is about a fifth.
    assert!(false_positives <= 200, "{positives}");

    let mut redis = server.connection().await;
    let streams: Vec<String> =
        ::redis::cmd("KEYS").arg("clickstream:*").query_async(&mut redis).await.unwrap();
    assert!(streams.is_empty(), "the stream is deleted: {streams:?}");
    let filters: Vec<String> =
        ::redis::cmd("KEYS").arg("dedup:f:*").query_async(&mut redis).await.unwrap();
    assert!((16..=32).contains(&filters.len()), "a filter per shard and bucket: {filters:?}");
}
