//! Which region is a record key's home: the [`HomeRegion`] rule, and its default,
//! [`HashedHome`].

use crate::key::RecordKey;

#[cfg(doc)]
use super::RegionalStore;

/// Picks the home region of a record key: the one region whose store decides every claim,
/// settle and replay of that key, whatever region served the request.
///
/// Every instance of the service, in every region, must give the same answer for a key: build
/// each region's [`RegionalStore`] with the same regions and the same rule. A rule that reads a
/// clock, a config reloaded per region, or a process's random seed breaks that, and with it the
/// one authority per key. The default, [`HashedHome`], depends on the regions' names, not on
/// their order.
///
/// The record key is all a store sees of a request: a hash of the prefix, the scope and the
/// client's key (the scope itself is not in it). To home a tenant's keys in its region, give
/// the tenant's routes a layer whose [`key_prefix`](crate::IdempotencyLayer::key_prefix) names
/// the region, and match on it:
///
/// ```
/// use axum_idempotency::{MemoryStore, store::{RecordKey, RegionalStore}};
///
/// let regions = [("eu", MemoryStore::new()), ("us", MemoryStore::new())];
/// // `eu:` keys (a layer with `.key_prefix("eu")`) live in the EU, every other key in the US.
/// let store = RegionalStore::new(regions)
///     .home(|key: &RecordKey, _regions: &[String]| usize::from(!key.as_str().starts_with("eu:")));
/// assert_eq!(store.home_of(&RecordKey::new("eu", b"acme", b"order-1")), "eu");
/// assert_eq!(store.home_of(&RecordKey::new("idempotency", b"acme", b"order-1")), "us");
/// ```
pub trait HomeRegion: Send + Sync + 'static {
    /// The index of `key`'s home among the `regions` (their names, in the order
    /// [`RegionalStore::new`] was given them); an index past the last is taken modulo their
    /// number.
    fn home(&self, key: &RecordKey, regions: &[String]) -> usize;
}

impl<F> HomeRegion for F
where
    F: Fn(&RecordKey, &[String]) -> usize + Send + Sync + 'static,
{
    fn home(&self, key: &RecordKey, regions: &[String]) -> usize {
        self(key, regions)
    }
}

/// The default [`HomeRegion`]: rendezvous hashing of the record key over the regions' names
/// (the region whose SHA-256 of its name and the key's hash is highest). Keys spread evenly;
/// the answer depends on the key and the set of names alone, not their order, so every
/// instance agrees on it. Adding or removing a region moves only the keys it takes or held
/// (about one in the number of regions): move them with
/// [`RegionalStore::moving_to`](super::RegionalStore::moving_to).
#[derive(Debug, Clone, Copy, Default)]
pub struct HashedHome;

impl HomeRegion for HashedHome {
    fn home(&self, key: &RecordKey, regions: &[String]) -> usize {
        use sha2::{Digest, Sha256};
        let score = |name: &String| {
            let digest = Sha256::new()
                .chain_update((name.len() as u64).to_be_bytes())
                .chain_update(name.as_bytes())
                .chain_update(key.hash().as_bytes())
                .finalize();
            let mut high = [0; 8];
            high.copy_from_slice(&digest[..8]);
            u64::from_be_bytes(high)
        };
        // Ties (equal names, refused by `new`) go to the first.
        let mut best = (0, 0);
        for (index, name) in regions.iter().enumerate() {
            let scored = score(name);
            if index == 0 || scored > best.1 {
                best = (index, scored);
            }
        }
        best.0
    }
}
