//! The operator's calls ([`Admin`]) over a store per region: each at the key's home (or, with
//! a fallback, the fallback region when the home holds nothing).

use std::time::Duration;

use super::{HomeRegion, RegionalStore};
use crate::store::{AbandonedClaim, Admin, Forgotten, Inspection, RecordKey, StoreError};

impl<St: Admin, H: HomeRegion> Admin for RegionalStore<St, H> {
    async fn inspect(
        &self,
        key: &RecordKey,
        with_outcome: bool,
    ) -> Result<Option<Inspection>, StoreError> {
        if let Some(next) = self.moved(key) {
            let key = &key.in_own_placement();
            return next.authority(key).inspect(key, with_outcome).await;
        }
        let found = self.authority(key).inspect(key, with_outcome).await?;
        match (&self.fallback, found) {
            // A claim taken at the fallback while the home was cut off is there.
            (Some(fallback), None) if fallback.region != self.index_of(key) => {
                self.regions[fallback.region].1.inspect(key, with_outcome).await
            }
            (_, found) => Ok(found),
        }
    }

    async fn forget(&self, key: &RecordKey, force: bool) -> Result<Forgotten, StoreError> {
        if let Some(next) = self.moved(key) {
            let key = &key.in_own_placement();
            return next.authority(key).forget(key, force).await;
        }
        let forgotten = self.authority(key).forget(key, force).await?;
        match (&self.fallback, forgotten) {
            (Some(fallback), Forgotten::Absent) if fallback.region != self.index_of(key) => {
                self.regions[fallback.region].1.forget(key, force).await
            }
            (_, forgotten) => Ok(forgotten),
        }
    }

    /// Every region's abandoned claims, oldest lapse first, at most `limit` in all. A region
    /// that cannot answer fails the listing: a partial list would read as "nothing abandoned
    /// there". During an outage, list the regions that answer one by one
    /// ([`region`](RegionalStore::region)`(name)`'s own `abandoned`).
    async fn abandoned(
        &self,
        lapsed_for: Duration,
        limit: u32,
    ) -> Result<Vec<AbandonedClaim>, StoreError> {
        let listings = self.regions.iter().map(|(_, store)| store.abandoned(lapsed_for, limit));
        let mut claims = Vec::new();
        for listing in futures_util::future::join_all(listings).await {
            claims.extend(listing?);
        }
        claims.sort_by_key(|claim| std::cmp::Reverse(claim.lapsed_for));
        claims.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        Ok(claims)
    }
}
