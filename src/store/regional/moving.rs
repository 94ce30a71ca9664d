//! A move of a [`RegionalStore`] from one region list to another (a region added, removed or
//! renamed, or another home rule): the same transition as a move between namings
//! ([`crate::hashing`]), a key's home under the old list claimed first, then its home under
//! the new one, in two rolling deploys, and the fleet's registry holding every instance to
//! its neighbours.

use std::{error::Error, fmt, sync::Arc};

use super::{HomeRegion, RegionalStore};
use crate::{fingerprint::Fingerprint, hashing::Deploy, key::RecordKey};

/// Why [`RegionalStore::moving_to`] refused a move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegionsMoveError {
    /// The regions moved to are the ones moved from (the same names, and rule): nothing moves.
    SameRegions,
    /// One of the two is a move already: one move at a time.
    Nested,
    /// The regions moved from fall back to a region ([`RegionalStore::fall_back_to`]): a key
    /// claimed there, under its own text, may be its new home's record. Remove the fallback
    /// for the move.
    Fallback,
}

impl fmt::Display for RegionsMoveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::SameRegions => "a move to the regions moved from (the same names and rule)",
            Self::Nested => "a move from or to a move: finish one move, all three deploys, first",
            Self::Fallback => {
                "a move from regions with a fallback region: remove the fallback for the move"
            }
        })
    }
}

impl Error for RegionsMoveError {}

impl<St, H: HomeRegion> RegionalStore<St, H> {
    /// A build of a move from these regions to `to`'s (a region added, removed or renamed),
    /// in three rolling deploys, each beside its neighbours only:
    ///
    /// 1. `RegionalStore::new(old).moving_to(RegionalStore::new(new), Deploy::First)?`
    /// 2. the same with `Deploy::Second`;
    /// 3. `RegionalStore::new(new)`, which its fleet lets start once deploy 1's records have
    ///    expired.
    ///
    /// Deploys 1 and 2 claim a key whose home changes at its old home, then at its new one,
    /// hold both until the settle, replay a response stored at either, and complete both (the
    /// old home first in deploy 1, the new one first in deploy 2): the transition of a move
    /// between namings, which the protocol's model checks. A key whose home stays is claimed
    /// once, there. Each instance records its region list and deploy in the fleet's registry,
    /// in every region's store: an instance whose list disagrees with a running one (a list
    /// rolled out to some instances first, a deploy skipped) is refused
    /// ([`StoreError::Misplaced`](crate::store::StoreError::Misplaced)), and nothing runs. A
    /// move of regions and a move of namings at once are refused too.
    ///
    /// A region's name names its store: a region kept in both lists keeps its store, and one
    /// given another store in `to` is refused (its records in the old one would be stranded at
    /// deploy 3; each announcement tells the two apart by an entry of its own). The two lists share the rule's type, and the
    /// fleet tells lists apart by their names and that type (not a rule's own settings). No
    /// fallback region during the move ([`fall_back_to`](Self::fall_back_to) on `to` is
    /// dropped). A `PostgresStore::transaction` for a key whose home changes is refused (its
    /// two homes are two databases; `DurableOutcomes::transaction` is not, writing beside
    /// the store); the operator's `abandoned` lists the old list's regions.
    ///
    /// # Errors
    ///
    /// [`RegionsMoveError::SameRegions`] when `to` has the same names and rule;
    /// [`RegionsMoveError::Nested`] when either is a move already;
    /// [`RegionsMoveError::Fallback`] when these regions fall back to one.
    pub fn moving_to(mut self, mut to: Self, deploy: Deploy) -> Result<Self, RegionsMoveError> {
        if self.next.is_some() || to.next.is_some() {
            return Err(RegionsMoveError::Nested);
        }
        if self.id() == to.id() {
            return Err(RegionsMoveError::SameRegions);
        }
        if self.fallback.is_some() {
            return Err(RegionsMoveError::Fallback);
        }
        to.fallback = None;
        self.next = Some((Arc::new(to), deploy));
        Ok(self)
    }

    /// The region list's id in the fleet's registry: `regions-` and 16 hex digits of a
    /// SHA-256 of its rule's type and its names (sorted for [`HashedHome`](super::HashedHome),
    /// which reads them in any order).
    pub(super) fn id(&self) -> String {
        let rule = std::any::type_name::<H>();
        let mut names: Vec<&[u8]> = self.names.iter().map(String::as_bytes).collect();
        if rule == std::any::type_name::<super::HashedHome>() {
            names.sort_unstable();
        }
        let mut fields = vec![rule.as_bytes()];
        fields.extend(names);
        let digest = Fingerprint::of_fields(&fields);
        let hex: String = digest.as_bytes()[..8].iter().map(|b| format!("{b:02x}")).collect();
        format!("regions-{hex}")
    }

    /// The region list moved to, for a key in the placement moved to.
    pub(super) fn moved(&self, key: &RecordKey) -> Option<&Self> {
        self.next.as_ref().filter(|_| key.is_placed_next()).map(|(next, _)| &**next)
    }

    /// This build's deploy, when `key`'s home changes in its move.
    pub(super) fn moves_home(&self, key: &RecordKey) -> Option<Deploy> {
        let (next, deploy) = self.next.as_ref()?;
        (next.home_of(key) != self.home_of(key)).then_some(*deploy)
    }
}
