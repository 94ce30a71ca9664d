//! The door's place in its fleet ([`crate::placement`]): announced in the store's registry
//! when the door first claims, then every third of a lease (between a second and ten) in the
//! background; a door whose naming
//! cannot serve beside what the registry lists refuses its requests
//! ([`StoreError::Misplaced`]) until the disagreement ends.

use std::{
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use tokio::time::Instant;

use super::{Engine, spawn};
use crate::{
    key::RecordKey,
    placement::{self, Phase},
    store::{Store, StoreError},
};

/// What a door last learned of its fleet; shared by the clones of its settings.
#[derive(Debug, Default)]
pub(crate) struct Fleet {
    state: Mutex<Known>,
    /// One announcement at a time.
    announcing: tokio::sync::Mutex<()>,
}

#[derive(Debug, Default, Clone)]
enum Known {
    /// Nothing yet: the first claim announces, and waits for the answer.
    #[default]
    Nothing,
    /// The store keeps no registry: nothing is checked.
    NoRegistry,
    /// Announced, and nothing disagrees; announced again after `next`.
    Agrees { next: Instant },
    /// The registry lists what this door cannot serve beside; asked again after `next`.
    Disagrees { why: Arc<str>, next: Instant },
}

impl<St: Store + Clone + 'static> Engine<St> {
    /// Whether this door may serve the request whose record key is `key` beside its fleet:
    /// announced (in the background once known), and refused while the registry disagrees.
    pub(super) async fn in_its_fleet(&self, key: &RecordKey) -> Result<(), StoreError> {
        let fleet = &self.settings.fleet;
        let known = fleet.state.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let due = match &known {
            Known::NoRegistry => return Ok(()),
            Known::Agrees { next } | Known::Disagrees { next, .. } => Instant::now() >= *next,
            Known::Nothing => true,
        };
        if due {
            let engine = self.clone();
            let registry = placement::registry(key.prefix());
            let announce = async move { engine.announce(&registry).await };
            if matches!(known, Known::Nothing) {
                announce.await?;
                return self.answer();
            }
            drop(spawn(self.settings.tasks.as_ref(), async move { drop(announce.await) }));
        }
        self.answer()
    }

    fn answer(&self) -> Result<(), StoreError> {
        match &*self.settings.fleet.state.lock().unwrap_or_else(PoisonError::into_inner) {
            Known::Disagrees { why, .. } => Err(StoreError::Misplaced(why.to_string())),
            _ => Ok(()),
        }
    }

    /// Learns what the fleet serves from `registry`, and announces this door there when it
    /// may serve beside it: one announcement at a time (another that is on its way answers for
    /// this one).
    ///
    /// A door that has not served yet (or was refused) reads the registry first, and is
    /// refused, announcing nothing, by any entry it cannot serve beside: an instance running,
    /// or records that may live. Once it serves, it announces itself, and is refused by a
    /// running instance it cannot serve beside (one that started at the same moment), not by
    /// the records of one refused so: a door refused at start never announces, and never
    /// refuses the fleet it was refused by.
    pub(crate) async fn announce(&self, registry: &RecordKey) -> Result<(), StoreError> {
        let fleet = &self.settings.fleet;
        let Ok(_one) = fleet.announcing.try_lock() else {
            // Another is on its way: wait for it, and take its answer.
            drop(fleet.announcing.lock().await);
            return Ok(());
        };
        let phase = Phase::of(&self.settings.hashing);
        let serving = matches!(
            *fleet.state.lock().unwrap_or_else(PoisonError::into_inner),
            Known::Agrees { .. }
        );
        let known = match self.learn(registry, &phase, serving).await {
            Ok(known) => known,
            Err(error) => {
                tracing::warn!(%error, "idempotency: could not announce this instance to its fleet");
                let next = Instant::now() + placement::announce_every(self.settings.lease);
                let mut state = fleet.state.lock().unwrap_or_else(PoisonError::into_inner);
                if let Known::Agrees { next: at } | Known::Disagrees { next: at, .. } = &mut *state
                {
                    *at = next;
                }
                return Err(error);
            }
        };
        if let Known::Disagrees { why, .. } = &known {
            tracing::error!(%why, "idempotency: this instance cannot serve beside its fleet; its requests are refused");
        }
        *fleet.state.lock().unwrap_or_else(PoisonError::into_inner) = known;
        Ok(())
    }

    async fn learn(
        &self,
        registry: &RecordKey,
        phase: &Phase,
        serving: bool,
    ) -> Result<Known, StoreError> {
        let next = Instant::now() + placement::announce_every(self.settings.lease);
        if !serving {
            let Some(listed) = self.store.announce(registry, &[]).await? else {
                tracing::warn!(
                    "idempotency: the store keeps no registry of its fleet: a deploy skipped in a \
                     move between namings is not refused"
                );
                return Ok(Known::NoRegistry);
            };
            if let Some(why) = placement::conflict(phase, &listed) {
                return Ok(Known::Disagrees { why: why.into(), next });
            }
        }
        let every = placement::announce_every(self.settings.lease);
        let entries = placement::entries(phase, every, self.records_live());
        let listed = self.store.announce(registry, &entries).await?.unwrap_or_default();
        let running: Vec<String> =
            listed.into_iter().filter(|entry| entry.starts_with("running:")).collect();
        Ok(match placement::conflict(phase, &running) {
            None => Known::Agrees { next },
            Some(why) => Known::Disagrees { why: why.into(), next },
        })
    }

    /// How long a record this door writes may live: its retention, its recovery window, its
    /// keep-alive ceiling and a lease.
    fn records_live(&self) -> Duration {
        let settings = &self.settings;
        let lease = settings.lease();
        [settings.retention, lease.recovery_window, settings.keep_alive.unwrap_or_default()]
            .into_iter()
            .fold(settings.lease, Duration::saturating_add)
    }
}
