//! A page of events as the bucketed strategies see it: each distinct event's hash, its shard
//! and its member; the bucket it falls in; and the store's answers put back in the page's order.

use std::{
    collections::{HashMap, HashSet},
    hash::Hash,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use crate::{fingerprint::Fingerprint, hashing::Names, store::StoreError};

/// A page's events for a bucketed strategy: each distinct one's hash, grouped by shard.
pub(super) struct Events {
    /// Each distinct event's hash, in the order first met.
    pub(super) hashes: Vec<[u8; 32]>,
    /// For each event of the page, the index of its hash (`None` for a repeat in the page).
    pub(super) firsts: Vec<Option<usize>>,
    /// Each shard met, with its events' indices in `hashes`, in order.
    pub(super) shards: Vec<(u16, Vec<usize>)>,
}

impl Events {
    pub(super) fn of(names: &Names, scope: &str, ids: &[impl AsRef<[u8]>], shards: u16) -> Self {
        let hashes = ids.iter().map(|id| {
            let hash = names.fingerprint(&Fingerprint::of_fields(&[scope.as_bytes(), id.as_ref()]));
            *hash.as_bytes()
        });
        let (hashes, firsts) = once_each(hashes);
        let mut grouped: Vec<(u16, Vec<usize>)> = Vec::new();
        let mut group_of: HashMap<u16, usize> = HashMap::new();
        for (i, hash) in hashes.iter().enumerate() {
            let shard = u16::from_be_bytes([hash[0], hash[1]]) % shards.max(1);
            let group = *group_of.entry(shard).or_insert_with(|| {
                grouped.push((shard, Vec::new()));
                grouped.len() - 1
            });
            grouped[group].1.push(i);
        }
        Self { hashes, firsts, shards: grouped }
    }

    /// The store's answers, one list per shard, put back in the order of `hashes`.
    pub(super) fn scatter(&self, by_shard: &[Vec<bool>]) -> Result<Vec<bool>, StoreError> {
        let mut fresh = vec![false; self.hashes.len()];
        let answered = by_shard.iter().map(Vec::len).eq(self.shards.iter().map(|(_, e)| e.len()));
        if !answered {
            return Err(StoreError::Unavailable("the store answered for other events".into()));
        }
        for ((_, events), answers) in self.shards.iter().zip(by_shard) {
            for (&i, &new) in events.iter().zip(answers) {
                fresh[i] = new;
            }
        }
        Ok(fresh)
    }
}

/// The farthest a bucket's expiry is set from now.
const FAR: Duration = Duration::from_secs(30 * 365 * 24 * 60 * 60);

/// The bucket an event seen `at` falls in, and when its set or filter expires.
pub(super) struct Bucket {
    pub(super) number: u128,
    pub(super) expire_at: SystemTime,
}

impl Bucket {
    fn at(at: SystemTime, window: Duration) -> Self {
        let window_ms = window.as_millis().max(1);
        let number = at.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() / window_ms;
        // Kept while the buckets after it check it (an event of the next bucket, asked up to
        // its own horizon, reads this one), and a quarter window more for clocks that differ
        // between instances and the store.
        let expire_ms = (number + 3) * window_ms + window_ms / 4;
        // Thirty years from now at most: a window as long as `Duration::MAX` keeps its buckets
        // "for ever", not past what a store takes (Redis refuses an expiry past `i64::MAX`
        // milliseconds, after the script wrote the member).
        let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_millis();
        let expire_ms = expire_ms.min(now_ms + FAR.as_millis());
        let expire_ms = u64::try_from(expire_ms).unwrap_or(u64::MAX);
        Self { number, expire_at: UNIX_EPOCH + Duration::from_millis(expire_ms) }
    }

    /// The bucket of `at`, unless a bucket its window reads has expired already: the one
    /// before it, which expires first, where an original seen up to a window earlier was
    /// recorded (answered new, it would be a false negative), or its own (its set or filter
    /// would expire as it is written).
    pub(super) fn within_horizon(at: SystemTime, window: Duration) -> Result<Self, StoreError> {
        let bucket = Self::at(at, window);
        let window_ms = window.as_millis().max(1);
        let before =
            Self::at(UNIX_EPOCH + millis(bucket.number.saturating_sub(1) * window_ms), window);
        match SystemTime::now().duration_since(before.expire_at) {
            Ok(past) => Err(StoreError::BeyondHorizon(past)),
            Err(_) => Ok(bucket),
        }
    }
}

/// `ms` milliseconds, as far as a `Duration` reaches.
fn millis(ms: u128) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX))
}

/// An event's member in a bucket set: the half of its hash that the shard does not use.
pub(super) fn member(hash: &[u8; 32]) -> [u8; 16] {
    let mut member = [0; 16];
    member.copy_from_slice(&hash[16..]);
    member
}

/// For each event of a page, whether it is new: its first occurrence's answer, and `false`
/// for a repeat in the page.
pub(super) fn answers(firsts: &[Option<usize>], fresh: &[bool]) -> Result<Vec<bool>, StoreError> {
    firsts
        .iter()
        .map(|first| match first {
            None => Ok(false),
            Some(i) => fresh.get(*i).copied().ok_or_else(|| {
                StoreError::Unavailable("the store answered for fewer events".into())
            }),
        })
        .collect()
}

/// `items` once each, in order, and for each item where its first occurrence is among them
/// (`None` for a repeat): the same event twice in one page is new the first time only.
pub(super) fn once_each<T: Hash + Eq + Clone>(
    items: impl Iterator<Item = T>,
) -> (Vec<T>, Vec<Option<usize>>) {
    let (mut unique, mut firsts, mut seen) = (Vec::new(), Vec::new(), HashSet::new());
    for item in items {
        match seen.insert(item.clone()) {
            true => {
                firsts.push(Some(unique.len()));
                unique.push(item);
            }
            false => firsts.push(None),
        }
    }
    (unique, firsts)
}
