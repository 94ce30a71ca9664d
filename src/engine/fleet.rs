//! The door's place in its fleet ([`crate::placement`]): announced in the store's registry
//! when the door first claims, then every third of a lease (between a second and ten) in the
//! background; a door whose naming
//! cannot serve beside what the registry lists refuses its requests
//! ([`StoreError::Misplaced`]) until the disagreement ends.

use std::{
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
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
#[derive(Debug)]
pub(crate) struct Fleet {
    state: Mutex<Known>,
    /// While the door agrees with its fleet, until when it need not announce itself again
    /// (milliseconds from `since`): a request's only cost then, one atomic read and the clock.
    agrees_until: AtomicU64,
    since: Instant,
    /// One announcement at a time.
    announcing: tokio::sync::Mutex<()>,
}

impl Default for Fleet {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            agrees_until: AtomicU64::new(0),
            since: Instant::now(),
            announcing: tokio::sync::Mutex::default(),
        }
    }
}

impl Fleet {
    fn millis(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.since).as_millis()).unwrap_or(u64::MAX)
    }

    fn learned(&self, known: Known) {
        let agrees_until = match &known {
            Known::Agrees { next } => self.millis(*next),
            Known::NoRegistry => u64::MAX,
            Known::Nothing | Known::Disagrees { .. } => 0,
        };
        *self.state.lock().unwrap_or_else(PoisonError::into_inner) = known;
        self.agrees_until.store(agrees_until, Ordering::Release);
    }
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
    /// Whether this door may serve the request whose record key is `key` beside its fleet.
    /// While it agrees and its entry in the registry lives, it serves, and announces itself
    /// again in the background when due. Otherwise (its first claim, an idle door whose entry
    /// may have lapsed, a refusal due to be asked again) the request waits for the registry's
    /// answer: refused while it disagrees, a store error while it cannot be read.
    pub(super) async fn in_its_fleet(&self, key: &RecordKey) -> Result<(), StoreError> {
        let fleet = &self.settings.fleet;
        let now = Instant::now();
        if fleet.millis(now) < fleet.agrees_until.load(Ordering::Acquire) {
            return Ok(());
        }
        let known = fleet.state.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let every = placement::announce_every(self.settings.lease);
        match known {
            Known::NoRegistry => return Ok(()),
            // Due, its running entry still live (it lasts three announcements): announced
            // again in the background, the request served meanwhile.
            Known::Agrees { next } if now < next + every * 2 => {
                // The requests meanwhile take the fast path: one announcement is on its way.
                fleet.agrees_until.store(fleet.millis(next + every), Ordering::Release);
                let (engine, registry) = (self.clone(), placement::registry(key.prefix()));
                let announce = async move { drop(engine.announce(&registry, false).await) };
                drop(spawn(self.settings.tasks.as_ref(), announce));
                return Ok(());
            }
            Known::Disagrees { why, next } if now < next => {
                return Err(StoreError::Misplaced(why.to_string()));
            }
            Known::Nothing | Known::Agrees { .. } | Known::Disagrees { .. } => {}
        }
        self.announce(&placement::registry(key.prefix()), true).await?;
        match &*fleet.state.lock().unwrap_or_else(PoisonError::into_inner) {
            Known::Disagrees { why, .. } => Err(StoreError::Misplaced(why.to_string())),
            Known::Nothing => {
                Err(StoreError::unavailable("the fleet's registry could not be read yet"))
            }
            Known::Agrees { .. } | Known::NoRegistry => Ok(()),
        }
    }

    /// [`in_its_fleet`](Self::in_its_fleet), for an operator's readiness check: `key` names the
    /// door's prefix.
    pub(crate) async fn check_fleet(&self, key: &RecordKey) -> Result<(), StoreError> {
        self.in_its_fleet(key).await
    }

    /// Learns what the fleet serves from `registry`, and announces this door there when it
    /// may serve beside it: one announcement at a time (another that is on its way answers for
    /// this one). `starting`: the door does not serve yet (or no longer: refused, or idle).
    pub(crate) async fn announce(
        &self,
        registry: &RecordKey,
        starting: bool,
    ) -> Result<(), StoreError> {
        let fleet = &self.settings.fleet;
        let Ok(_one) = fleet.announcing.try_lock() else {
            // Another is on its way: wait for it, and take its answer.
            drop(fleet.announcing.lock().await);
            return Ok(());
        };
        let phase = match Phase::of_door(&self.settings.hashing, self.store.placement()) {
            Ok(phase) => phase,
            Err(why) => {
                tracing::error!(%why, "idempotency: this instance cannot serve; its requests are refused");
                let next = Instant::now() + placement::announce_every(self.settings.lease);
                fleet.learned(Known::Disagrees { why: why.into(), next });
                return Ok(());
            }
        };
        let known = match self.learn(registry, &phase, starting).await {
            Ok(known) => known,
            Err(error) => {
                tracing::warn!(%error, "idempotency: could not announce this instance to its fleet");
                return Err(error);
            }
        };
        if let Known::Disagrees { why, .. } = &known {
            tracing::error!(%why, "idempotency: this instance cannot serve beside its fleet; its requests are refused");
        }
        fleet.learned(known);
        Ok(())
    }

    /// A door `starting` first says so for one announcement (`starting:`), and reads every
    /// entry: it is refused, having recorded nothing lasting, by any it cannot serve beside (an
    /// instance running or starting, records that may live). Two doors starting at once that
    /// cannot serve side by side: the one that reads second sees the other's, and is refused.
    /// Then (and every announcement after) it records itself running and its records, and
    /// is refused by an instance running that it cannot serve beside; never by an instance
    /// starting, nor by the records of one refused: a door refused at start never refuses
    /// the fleet it was refused by.
    async fn learn(
        &self,
        registry: &RecordKey,
        phase: &Phase,
        starting: bool,
    ) -> Result<Known, StoreError> {
        let every = placement::announce_every(self.settings.lease);
        let next = Instant::now() + every;
        if starting {
            let Some(listed) =
                self.store.announce(registry, &placement::starting(phase, every)).await?
            else {
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
