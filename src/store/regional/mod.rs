//! [`RegionalStore`]: one store per region, and every record decided by its key's home region.

mod admin;
mod fallback;
mod fleet;
mod home;
mod moving;

use std::{fmt, sync::Arc, time::Duration};

use bytes::Bytes;

use self::fallback::Fallback;
pub use self::home::{HashedHome, HomeRegion};
pub use self::moving::RegionsMoveError;
use super::{Claim, Fenced, Lease, OwnerToken, Store, StoreError, Subscription};
use crate::{fingerprint::Fingerprint, hashing::Deploy, key::RecordKey};

/// A store over one store per region, which sends every call for a record key to the key's
/// home region: one authority decides each key, so a retry that a global load balancer sends
/// to another region finds the first attempt's claim, waits for it, and gets its response.
///
/// - Each region's store is of one type (`St`): a [`RedisStore`](super::RedisStore) per region,
///   say, each reached from every region. The home of a key is picked by a [`HomeRegion`]
///   rule ([`HashedHome`] by default; [`home`](Self::home) sets another).
/// - Waiting ([`Store::subscribe`]) listens on the home's store; encryption at rest is the
///   doors' and is unchanged; a [`CachingStore`](super::CachingStore) over it is a near cache
///   local to the region that holds it (a completed record read once from the home).
/// - **The home unreachable fails closed**: the home store's own error comes back unchanged
///   (an unavailable or timed-out store), which the HTTP door answers 503 with `Retry-After`
///   and the consumer door as a store error; the operation does not run. Opt in to
///   [`fall_back_to`](Self::fall_back_to) to claim in this region instead, giving up
///   uniqueness across regions while the home is cut off.
/// - A claim from a region far from the key's home pays the round trips between the regions:
///   two per fresh request (claim, complete), one per replay.
///
/// ```
/// use axum_idempotency::{IdempotencyLayer, MemoryStore, store::RegionalStore};
///
/// // In production: a `RedisStore` per region, each reachable from every region.
/// let regions = [("eu", MemoryStore::new()), ("us", MemoryStore::new()), ("ap", MemoryStore::new())];
/// let store = RegionalStore::new(regions);
/// let layer = IdempotencyLayer::new(store);
/// ```
///
#[doc = include_str!("../../docs/regions.md")]
pub struct RegionalStore<St, H = HashedHome> {
    regions: Arc<[(String, St)]>,
    /// The regions' names, in order, as the home rule reads them.
    names: Arc<[String]>,
    home: Arc<H>,
    fallback: Option<Arc<Fallback>>,
    /// During a move between region lists ([`moving_to`](Self::moving_to)): the list moved
    /// to, and this build's deploy.
    next: Option<(Arc<RegionalStore<St, H>>, Deploy)>,
}

impl<St> RegionalStore<St> {
    /// A store over `regions`, each a name and its store, homing keys by [`HashedHome`].
    /// Every instance must be given the same regions (a rule of its own may also need them in
    /// the same order).
    ///
    /// # Panics
    ///
    /// When `regions` is empty, or two have one name: a configuration the service must not
    /// start with (two names for one home would split its keys).
    pub fn new<N: Into<String>>(regions: impl IntoIterator<Item = (N, St)>) -> Self {
        let regions: Arc<[(String, St)]> =
            regions.into_iter().map(|(name, store)| (name.into(), store)).collect();
        assert!(!regions.is_empty(), "a RegionalStore needs at least one region");
        let names: Arc<[String]> = regions.iter().map(|(name, _)| name.clone()).collect();
        for (index, name) in names.iter().enumerate() {
            assert!(!names[..index].contains(name), "two regions are named {name:?}");
        }
        Self { regions, names, home: Arc::new(HashedHome), fallback: None, next: None }
    }
}

impl<St, H> RegionalStore<St, H> {
    /// Sets the rule that picks a key's home. Defaults to [`HashedHome`].
    ///
    /// # Panics
    ///
    /// On a move between region lists ([`moving_to`](Self::moving_to)): set each list's rule
    /// before the move is made of them.
    #[must_use]
    pub fn home<H2: HomeRegion>(self, rule: H2) -> RegionalStore<St, H2> {
        assert!(self.next.is_none(), "set a RegionalStore's rule before `moving_to`");
        let (regions, names, fallback) = (self.regions, self.names, self.fallback);
        RegionalStore { regions, names, home: Arc::new(rule), fallback, next: None }
    }

    /// **Opt in, knowing what it gives up**: when a key's home cannot be reached (its store
    /// answers unavailable, or not in time), claim the key in the region named `region`
    /// (this instance's own, typically) instead of failing; the claim's settles (complete,
    /// release, renewals) follow it there. Defaults to none: the request fails closed.
    ///
    /// What it gives up: uniqueness while the home is cut off. **Every record the home holds,
    /// running or completed, is out of sight meanwhile**: a retry of a request answered long
    /// ago runs it again here, on this very instance, and its key then holds two answers, one
    /// per region. A retry that reaches the home meanwhile, or any request for the key once the
    /// home is back, does not see the claim taken here, and runs the operation again; the
    /// other side of a partition falls back to its own region. The home counts as cut off when
    /// its store answers [`StoreError::Unavailable`] (which also covers a server that answers
    /// with an error, such as a replica read-only during a failover) or
    /// [`StoreError::Timeout`]; a claim that timed out at the home is abandoned there in the
    /// background (it may have landed). Use it where serving beats running twice, never for a
    /// payment; waiters of a claim taken here wait out their deadline (they listen at the
    /// home). The operator's `inspect` and `forget` look at the fallback region when the home
    /// holds nothing.
    ///
    /// # Panics
    ///
    /// When no region is named `region`.
    #[must_use]
    pub fn fall_back_to(mut self, region: &str) -> Self {
        let index = self.regions.iter().position(|(name, _)| name == region);
        let index = index.unwrap_or_else(|| panic!("no region is named {region:?}"));
        self.fallback = Some(Arc::new(Fallback::new(index)));
        self
    }

    /// The regions' names, in order.
    pub fn regions(&self) -> impl Iterator<Item = &str> {
        self.regions.iter().map(|(name, _)| name.as_str())
    }

    /// The store of the region named `name`.
    #[must_use]
    pub fn region(&self, name: &str) -> Option<&St> {
        self.regions.iter().find(|(region, _)| region == name).map(|(_, store)| store)
    }
}

impl<St, H: HomeRegion> RegionalStore<St, H> {
    /// The name of `key`'s home region.
    #[must_use]
    pub fn home_of(&self, key: &RecordKey) -> &str {
        &self.regions[self.index_of(key)].0
    }

    fn index_of(&self, key: &RecordKey) -> usize {
        self.home.home(key, &self.names) % self.regions.len()
    }

    /// The store of `key`'s home region.
    fn authority(&self, key: &RecordKey) -> &St {
        &self.regions[self.index_of(key)].1
    }

    /// The store that holds `owner`'s claim of `key`: the home's, or the fallback's when the
    /// claim was taken there.
    fn holding(&self, key: &RecordKey, owner: &OwnerToken) -> &St {
        match &self.fallback {
            Some(fallback) if fallback.holds(key, owner) => &self.regions[fallback.region].1,
            _ => self.authority(key),
        }
    }

    /// Forgets a claim taken at the fallback once its settle has an answer.
    fn settled<T>(&self, key: &RecordKey, owner: &OwnerToken, answer: &Result<T, StoreError>) {
        if let (Some(fallback), Ok(_)) = (&self.fallback, answer) {
            fallback.forget(key, owner);
        }
    }
}

impl<St: Store, H: HomeRegion> RegionalStore<St, H> {
    /// A claim at the key's home; at the fallback, when one is set and the home is unreachable.
    async fn claim_in(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
        waiting: bool,
    ) -> Result<Claim, StoreError> {
        let claim = async |store: &St| match waiting {
            true => store.claim_waiting(key, fingerprint, owner, lease).await,
            false => store.claim(key, fingerprint, owner, lease).await,
        };
        let home = self.index_of(key);
        let answer = claim(&self.regions[home].1).await;
        match (&self.fallback, answer) {
            (Some(fallback), Err(error))
                if fallback.region != home && Fallback::applies(&error) =>
            {
                tracing::warn!(
                    key_hash = key.hash(),
                    home = self.regions[home].0,
                    fallback = self.regions[fallback.region].0,
                    %error,
                    "the key's home region is unreachable: claiming in the fallback region"
                );
                if matches!(error, StoreError::Timeout(_)) {
                    // The home's claim may have landed, or may still land: abandon it there
                    // (fenced by the token), as the engine abandons a claim whose answer it
                    // never saw, so that it does not hold the key for a lease.
                    let home_store = self.regions[home].1.clone();
                    let (key, owner, fingerprint) =
                        (key.clone(), owner.clone(), fingerprint.clone());
                    drop(tokio::spawn(async move {
                        let _ = home_store.abandon(&key, &owner, &fingerprint, lease).await;
                    }));
                }
                let claim = claim(&self.regions[fallback.region].1).await?;
                if matches!(claim, Claim::Claimed | Claim::TakenOver) {
                    fallback.remember(key, owner, lease);
                }
                Ok(claim)
            }
            (_, answer) => answer,
        }
    }
}

impl<St, H> Clone for RegionalStore<St, H> {
    fn clone(&self) -> Self {
        Self {
            regions: Arc::clone(&self.regions),
            names: Arc::clone(&self.names),
            home: Arc::clone(&self.home),
            fallback: self.fallback.clone(),
            next: self.next.clone(),
        }
    }
}

impl<St: fmt::Debug, H> fmt::Debug for RegionalStore<St, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The rule may be a closure, which has no `Debug`.
        f.debug_struct("RegionalStore")
            .field("regions", &self.regions)
            .field("home", &std::any::type_name::<H>())
            .field("fallback", &self.fallback.as_ref().map(|f| &self.regions[f.region].0))
            .field("moving_to", &self.next)
            .finish()
    }
}

impl<St: Store, H: HomeRegion> Store for RegionalStore<St, H> {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        if let Some(next) = self.moved(key) {
            return next.claim_in(&key.in_own_placement(), fingerprint, owner, lease, false).await;
        }
        self.claim_in(key, fingerprint, owner, lease, false).await
    }

    async fn claim_waiting(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Claim, StoreError> {
        if let Some(next) = self.moved(key) {
            return next.claim_in(&key.in_own_placement(), fingerprint, owner, lease, true).await;
        }
        self.claim_in(key, fingerprint, owner, lease, true).await
    }

    async fn subscribe(&self, key: &RecordKey) -> Subscription {
        if let Some(next) = self.moved(key) {
            let key = &key.in_own_placement();
            return next.authority(key).subscribe(key).await;
        }
        self.authority(key).subscribe(key).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        response: Bytes,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        if let Some(next) = self.moved(key) {
            let key = &key.in_own_placement();
            return next
                .authority(key)
                .complete(key, owner, fingerprint, response, retention)
                .await;
        }
        let store = self.holding(key, owner);
        let answer = store.complete(key, owner, fingerprint, response, retention).await;
        self.settled(key, owner, &answer);
        answer
    }

    async fn release(&self, key: &RecordKey, owner: &OwnerToken) -> Result<Fenced, StoreError> {
        if let Some(next) = self.moved(key) {
            let key = &key.in_own_placement();
            return next.authority(key).release(key, owner).await;
        }
        let answer = self.holding(key, owner).release(key, owner).await;
        self.settled(key, owner, &answer);
        answer
    }

    async fn abandon(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        if let Some(next) = self.moved(key) {
            let key = &key.in_own_placement();
            return next.authority(key).abandon(key, owner, fingerprint, lease).await;
        }
        let answer = self.holding(key, owner).abandon(key, owner, fingerprint, lease).await;
        self.settled(key, owner, &answer);
        answer
    }

    fn commits_in_transactions(&self) -> bool {
        self.regions.iter().any(|(_, store)| store.commits_in_transactions())
            || self.next.as_ref().is_some_and(|(next, _)| next.commits_in_transactions())
    }

    fn placement(&self) -> Option<(String, Option<(String, Deploy)>)> {
        let next = self.next.as_ref().map(|(next, deploy)| (next.id(), *deploy));
        Some((self.id(), next))
    }

    fn moves(&self, key: &RecordKey) -> Option<Deploy> {
        self.moves_home(key)
    }

    /// In every region's store (of both lists, during a move), each recording its region's
    /// name: a store that records another region's name (two URLs swapped, one store under
    /// two names) is refused, [`StoreError::Misplaced`]: its keys would have two homes.
    async fn announce(
        &self,
        registry: &RecordKey,
        entries: &[(String, Duration)],
    ) -> Result<Option<Vec<String>>, StoreError> {
        let Some((next, _)) = &self.next else {
            return fleet::announce(&self.regions, registry, entries).await;
        };
        for (name, store) in next.regions.iter() {
            if let Some(kept) = self.region(name)
                && !fleet::one_store(kept, store, registry).await?
            {
                return Err(StoreError::Misplaced(format!(
                    "region `{name}` names another store in the regions moved to than in the \
                     regions moved from: a kept region keeps its store, or its records there \
                     would be stranded (move them as a region of another name)"
                )));
            }
        }
        let mut regions = self.regions.to_vec();
        let added = next.regions.iter().filter(|(name, _)| !self.names.contains(name));
        regions.extend(added.cloned());
        fleet::announce(&regions, registry, entries).await
    }

    async fn touch(
        &self,
        key: &RecordKey,
        owner: &OwnerToken,
        lease: Lease,
    ) -> Result<Fenced, StoreError> {
        if let Some(next) = self.moved(key) {
            let key = &key.in_own_placement();
            return next.authority(key).touch(key, owner, lease).await;
        }
        let answer = self.holding(key, owner).touch(key, owner, lease).await;
        if let (Some(fallback), Ok(Fenced::Applied)) = (&self.fallback, &answer)
            && fallback.holds(key, owner)
        {
            fallback.remember(key, owner, lease);
        }
        answer
    }
}

#[cfg(test)]
mod tests;
