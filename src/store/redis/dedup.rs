//! [`DedupStore`] for [`RedisStore`]: a marker is `SET NX PX`; a bucket entry is
//! `lua/dedup.lua` over its three sets. A batch's commands go at once on the shared
//! multiplexed connection (on a Cluster, each to its own slot's master): pipelined, one round
//! trip's wait per node.

use std::time::{Duration, UNIX_EPOCH};

use deadpool_redis::redis::{Value, cmd};
use futures_util::future::try_join_all;

use super::{
    RedisStore,
    scripts::{DEDUP_ADD, millis},
};
use crate::store::{BucketEntry, DedupStore, StoreError};

impl DedupStore for RedisStore {
    async fn mark(&self, keys: &[String], ttl: Duration) -> Result<Vec<bool>, StoreError> {
        let ttl = millis(ttl);
        let timeout = self.command_timeout;
        let marks = keys.iter().map(|key| {
            self.connections.run(timeout, move |mut connection| async move {
                let reply: Value = cmd("SET")
                    .arg(key)
                    .arg(b"1")
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl)
                    .query_async(&mut connection)
                    .await?;
                Ok(matches!(reply, Value::Okay | Value::SimpleString(_)))
            })
        });
        try_join_all(marks).await
    }

    async fn add_unseen(&self, entries: &[BucketEntry]) -> Result<Vec<bool>, StoreError> {
        let adds = entries.iter().map(|entry| async move {
            let expire_at = entry.expire_at.duration_since(UNIX_EPOCH).unwrap_or_default();
            let expire_at = u64::try_from(expire_at.as_millis()).unwrap_or(u64::MAX).to_string();
            let keys = [entry.sets[0].as_str(), entry.sets[1].as_str(), entry.sets[2].as_str()];
            let added: i64 =
                self.invoke(&DEDUP_ADD, &keys, &[&entry.member, expire_at.as_bytes()]).await?;
            Ok::<_, StoreError>(added == 1)
        });
        try_join_all(adds).await
    }
}
