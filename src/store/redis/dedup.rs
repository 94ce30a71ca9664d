//! [`DedupStore`] for [`RedisStore`]: a marker is `SET NX PX`; a shard's page of bucket
//! members is `lua/dedup.lua` over its three sets, of filter positions `lua/bloom.lua` over
//! its three filters. A call's commands go at once on the shared multiplexed connection (on a
//! Cluster, each to its own slot's master): pipelined, one round trip's wait per node.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use deadpool_redis::redis::{Script, Value, cmd};
use futures_util::future::try_join_all;

use super::{
    RedisStore,
    scripts::{BLOOM, DEDUP, ScriptCall, millis},
};
use crate::store::{BucketBatch, DedupStore, FilterBatch, StoreError};

/// The most events one script takes: Redis runs nothing else while a script runs, and a longer
/// page is split into scripts of this many.
const EVENTS_PER_SCRIPT: usize = 256;

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

    async fn add_unseen(&self, batches: &[BucketBatch]) -> Result<Vec<Vec<bool>>, StoreError> {
        let batches = batches.iter().map(|batch| {
            let chunks = batch.members.chunks(EVENTS_PER_SCRIPT).map(|members| {
                let members = members.iter().map(|member| member.to_vec());
                self.page(&DEDUP, &batch.sets, batch.expire_at, members)
            });
            async { Ok::<_, StoreError>(try_join_all(chunks).await?.concat()) }
        });
        try_join_all(batches).await
    }

    async fn set_unseen(&self, batches: &[FilterBatch]) -> Result<Vec<Vec<bool>>, StoreError> {
        let batches = batches.iter().map(|batch| {
            let hashes = batch.per_event();
            let chunks = batch.positions.chunks(EVENTS_PER_SCRIPT * hashes).map(move |positions| {
                let sizes = [hashes.to_string(), batch.bits.div_ceil(8).to_string()];
                let args = sizes
                    .into_iter()
                    .map(String::into_bytes)
                    .chain(positions.iter().map(|bit| bit.to_string().into_bytes()));
                self.page(&BLOOM, &batch.filters, batch.expire_at, args)
            });
            async { Ok::<_, StoreError>(try_join_all(chunks).await?.concat()) }
        });
        try_join_all(batches).await
    }
}

impl RedisStore {
    /// Runs one page script over a bucket's three keys with the expiry and then `args`: for
    /// each event, whether it is new.
    async fn page(
        &self,
        script: &'static Script,
        keys: &[String; 3],
        expire_at: SystemTime,
        args: impl Iterator<Item = Vec<u8>>,
    ) -> Result<Vec<bool>, StoreError> {
        let expire_at = expire_at.duration_since(UNIX_EPOCH).unwrap_or_default();
        let expire_at = u64::try_from(expire_at.as_millis()).unwrap_or(u64::MAX).to_string();
        let args: Vec<Vec<u8>> = std::iter::once(expire_at.into_bytes()).chain(args).collect();
        let args: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
        let keys = [keys[0].as_str(), keys[1].as_str(), keys[2].as_str()];
        let fresh: Vec<i64> = self.invoke(ScriptCall::new(script, &keys, &args, 0)).await?;
        Ok(fresh.into_iter().map(|new| new == 1).collect())
    }
}
