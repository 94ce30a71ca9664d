//! What a new connection of a [`RedisStore`](super::RedisStore) is checked for before any
//! script runs on it: the server's version, and its eviction policy.

use deadpool_redis::redis::{Value, aio::ConnectionLike};

use crate::store::StoreError;

/// Refuses a server older than `minimum`, with an error that says what was found. A server
/// that does not answer `INFO server` (some managed services rename it) is let through.
pub(super) async fn check_version(
    connection: &mut (impl ConnectionLike + Send),
    minimum: (u32, u32),
) -> Result<(), StoreError> {
    let reply: Result<Value, _> =
        deadpool_redis::redis::cmd("INFO").arg("server").query_async(connection).await;
    let Ok(reply) = reply else {
        tracing::debug!("idempotency: could not read the Redis version");
        return Ok(());
    };
    match oldest_version(&reply) {
        Some(found) if found < minimum => Err(StoreError::UnsupportedServer(format!(
            "Redis {}.{} found; this store needs Redis {}.{} or later",
            found.0, found.1, minimum.0, minimum.1
        ))),
        _ => Ok(()),
    }
}

/// The oldest `redis_version` (major, minor) in an `INFO` reply: one server's text, or, on a
/// Cluster, one per node.
fn oldest_version(reply: &Value) -> Option<(u32, u32)> {
    let parse = |text: &[u8]| {
        let text = std::str::from_utf8(text).ok()?;
        let line = text.lines().find_map(|line| line.strip_prefix("redis_version:"))?;
        let mut numbers = line.trim().split('.').map(str::parse::<u32>);
        Some((numbers.next()?.ok()?, numbers.next()?.ok()?))
    };
    match reply {
        Value::BulkString(text) => parse(text),
        Value::VerbatimString { text, .. } | Value::SimpleString(text) => parse(text.as_bytes()),
        Value::Map(nodes) => nodes.iter().filter_map(|(_, info)| oldest_version(info)).min(),
        Value::Array(nodes) => nodes.iter().filter_map(oldest_version).min(),
        _ => None,
    }
}

/// Records must not be evicted: an evicted record lets a retry run the handler again.
pub(super) async fn warn_unless_noeviction(connection: &mut (impl ConnectionLike + Send)) {
    let reply: Result<Vec<String>, _> = deadpool_redis::redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(connection)
        .await;
    match reply.as_deref() {
        Ok([_, policy]) if policy == "noeviction" => {}
        Ok([_, policy]) => tracing::warn!(
            policy = policy.as_str(),
            "idempotency: Redis maxmemory-policy is not noeviction; an evicted record lets a retry run its handler again"
        ),
        // CONFIG is often disabled on managed Redis: nothing to learn, nothing to warn.
        _ => tracing::debug!("idempotency: could not read Redis maxmemory-policy"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_version_is_read_from_info() {
        let info = |version: &str| {
            Value::BulkString(
                format!("# Server\r\nredis_version:{version}\r\nredis_mode:standalone\r\n")
                    .into_bytes(),
            )
        };
        assert_eq!(oldest_version(&info("7.0.15")), Some((7, 0)));
        assert_eq!(oldest_version(&info("4.0.14")), Some((4, 0)));
        assert!(oldest_version(&info("4.0.14")).unwrap() < (5, 0));
        assert!(oldest_version(&info("5.0.0")).unwrap() >= (5, 0));
        let cluster = Value::Map(vec![
            (Value::SimpleString("a:7000".to_owned()), info("7.2.4")),
            (Value::SimpleString("b:7001".to_owned()), info("6.2.1")),
        ]);
        assert_eq!(oldest_version(&cluster), Some((6, 2)));
        assert_eq!(oldest_version(&Value::BulkString(b"no version here".to_vec())), None);
        assert_eq!(oldest_version(&Value::Nil), None);
    }
}
