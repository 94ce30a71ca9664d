//! Reads the Redis server's clock (`TIME`) into the store's [`ServerClock`].

use std::time::Instant;

use deadpool_redis::redis::{self, RedisError, aio::ConnectionLike};

use crate::store::clock::ServerClock;

impl ServerClock {
    /// Reads the server's `TIME` on `connection`.
    pub(super) async fn sample<C: ConnectionLike + Send>(
        &self,
        connection: &mut C,
    ) -> Result<(), RedisError> {
        let sent = Instant::now();
        let (seconds, micros): (u64, u64) = redis::cmd("TIME").query_async(connection).await?;
        self.record(seconds.saturating_mul(1000).saturating_add(micros / 1000), sent);
        Ok(())
    }
}
