//! What the store knows of its fleet: each instance records, in a registry the store keeps
//! beside its records ([`Store::announce`](crate::store::Store::announce)), the naming it serves
//! and where a move between namings stands ([`Hashing::moving_to`](crate::hashing::Hashing::moving_to)),
//! and refuses to run beside an instance whose records it could not see, or that could not see
//! its own: a deploy skipped, another secret, a move begun in the middle of another, a
//! rollback too far.
//!
//! The rule is one, and the protocol's model checks its pairs (`tests/model.rs`, the
//! transition's neighbouring builds, and the skipped builds' counterexamples): an instance may
//! run beside another only if each reads the names the other always completes (the only names
//! of a naming alone; the old names in a move's first deploy, the new ones in its second);
//! and it may start after another stopped only if it reads the names that one always
//! completed, for as long as that one's records live (its retention, its recovery window, its
//! keep-alive ceiling and a lease).

use std::{fmt, time::Duration};

use crate::{
    fingerprint::Fingerprint,
    hashing::{Deploy, Hashing, Names},
    key::RecordKey,
};

/// How often a door whose claims hold their keys for `lease` announces itself again: a third
/// of the lease, between a second and ten. Its "running" entry lasts three announcements:
/// an instance that stopped is forgotten within about a lease (ten seconds by default).
pub(crate) fn announce_every(lease: Duration) -> Duration {
    (lease / 3).clamp(Duration::from_secs(1), Duration::from_secs(10))
}

/// A naming, as the registry names it: `plain`, or `keyed-` and 16 hex digits of an HMAC of
/// a constant under the secret (which tells secrets apart and confirms nothing of one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct NamingId(String);

impl NamingId {
    #[cfg(test)]
    fn of_test(hashing: &Hashing) -> Self {
        Self::of(hashing.namings().next().unwrap_or(&Names::Plain))
    }

    pub(crate) fn of(names: &Names) -> Self {
        match names {
            Names::Plain => Self("plain".to_owned()),
            Names::Keyed(_) => {
                let id = names.fingerprint(&Fingerprint::from_digest([0x1d; 32]));
                Self(format!("keyed-{}", &hex(id.as_bytes())[..16]))
            }
        }
    }
}

impl NamingId {
    /// The region list it is placed over (after `@`), if any.
    fn regions(&self) -> Option<&str> {
        self.0.split_once('@').map(|(_, regions)| regions)
    }
}

/// Where an instance stands: a naming alone, or a deploy of a move between two.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Alone(NamingId),
    Moving { from: NamingId, to: NamingId, deploy: Deploy },
}

impl Phase {
    pub(crate) fn of(hashing: &Hashing) -> Self {
        let mut namings = hashing.namings();
        let from = namings.next().map_or(NamingId("plain".to_owned()), NamingId::of);
        match (namings.next(), hashing.deploy()) {
            (Some(to), Some(deploy)) => Self::Moving { from, to: NamingId::of(to), deploy },
            _ => Self::Alone(from),
        }
    }

    /// Where a door stands: its naming's phase, over its store's placement (`store`, a
    /// `RegionalStore`'s region list, and during a move of its own the list moved to and the
    /// deploy). Each id is the naming's, and `@` the region list's: a change of either is a
    /// move. A door whose naming and store move at once cannot stand anywhere: why.
    pub(crate) fn of_door(
        hashing: &Hashing,
        store: Option<(String, Option<(String, Deploy)>)>,
    ) -> Result<Self, String> {
        let Some((here, moving)) = store else { return Ok(Self::of(hashing)) };
        let at = |id: &NamingId, regions: &str| NamingId(format!("{}@{regions}", id.0));
        Ok(match (Self::of(hashing), moving) {
            (Self::Alone(names), None) => Self::Alone(at(&names, &here)),
            (Self::Moving { from, to, deploy }, None) => {
                Self::Moving { from: at(&from, &here), to: at(&to, &here), deploy }
            }
            (Self::Alone(names), Some((there, deploy))) => {
                Self::Moving { from: at(&names, &here), to: at(&names, &there), deploy }
            }
            (Self::Moving { .. }, Some(_)) => {
                return Err("this instance moves its naming (`Hashing::moving_to`) and its \
                            regions (`RegionalStore::moving_to`) at once: finish one move, \
                            all three deploys, before the other"
                    .to_owned());
            }
        })
    }

    /// The namings whose records it reads (claims, replays).
    fn reads(&self) -> Vec<&NamingId> {
        match self {
            Self::Alone(names) => vec![names],
            Self::Moving { from, to, .. } => vec![from, to],
        }
    }

    /// The naming every request it completes is completed under first: the one a crash
    /// between two completes never leaves incomplete.
    fn completes_first(&self) -> &NamingId {
        match self {
            Self::Alone(names) | Self::Moving { from: names, deploy: Deploy::First, .. } => names,
            Self::Moving { to, .. } => to,
        }
    }

    /// Whether it reads every record `other` completed.
    fn sees(&self, other: &Self) -> bool {
        self.reads().contains(&other.completes_first())
    }

    fn label(&self) -> String {
        match self {
            Self::Alone(names) => format!("names={}", names.0),
            Self::Moving { from, to, deploy } => {
                let deploy = if *deploy == Deploy::First { 1 } else { 2 };
                format!("move={}>{}:{deploy}", from.0, to.0)
            }
        }
    }

    fn parse(label: &str) -> Option<Self> {
        if let Some(names) = label.strip_prefix("names=") {
            return Some(Self::Alone(NamingId(names.to_owned())));
        }
        let (from, rest) = label.strip_prefix("move=")?.split_once('>')?;
        let (to, deploy) = rest.rsplit_once(':')?;
        let deploy = match deploy {
            "1" => Deploy::First,
            "2" => Deploy::Second,
            _ => return None,
        };
        Some(Self::Moving { from: NamingId(from.to_owned()), to: NamingId(to.to_owned()), deploy })
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Alone(names) => write!(f, "the {} names alone", names.0),
            Self::Moving { from, to, deploy } => {
                let deploy =
                    if *deploy == Deploy::First { "Deploy::First" } else { "Deploy::Second" };
                write!(f, "the move from the {} names to the {} names, {deploy}", from.0, to.0)
            }
        }
    }
}

impl Hashing {
    /// Whether instances configured with this hashing may serve beside instances configured
    /// with `other`, by the rule the fleet's registry holds them to (see
    /// [`crate::hashing`]): each reads the names the other always completes. The two deploys of
    /// a move beside each other and beside their outer neighbours, yes; a deploy skipped,
    /// another secret mid-move, no. For a deploy pipeline's own check; the doors check it
    /// themselves.
    ///
    /// ```
    /// use axum_idempotency::hashing::{Deploy, Hashing};
    ///
    /// let secret = [7; 32];
    /// let first = Hashing::plain().moving_to(Hashing::keyed(secret), Deploy::First).unwrap();
    /// assert!(first.serves_beside(&Hashing::plain()));
    /// assert!(!first.serves_beside(&Hashing::keyed(secret)), "deploy 2 is skipped");
    /// ```
    #[must_use]
    pub fn serves_beside(&self, other: &Hashing) -> bool {
        let (mine, theirs) = (Phase::of(self), Phase::of(other));
        mine.sees(&theirs) && theirs.sees(&mine)
    }
}

/// The registry's key for a door whose records' keys have `prefix` (escaped): beside them,
/// under a prefix of its own, never a request's key (an operator's scan of abandoned claims
/// that meets it reads no record there, and skips it).
pub(crate) fn registry(prefix: &str) -> RecordKey {
    RecordKey::with_digest(
        &format!("{prefix}-fleet"),
        Fingerprint::of_fields(&[b"fleet"]).as_bytes(),
    )
}

/// The entries an instance in `phase` announces every `every`: running (for three
/// announcements), and its records (for `records_live`, how long a record it writes may live).
pub(crate) fn entries(
    phase: &Phase,
    every: Duration,
    records_live: Duration,
) -> [(String, Duration); 2] {
    let label = phase.label();
    [(format!("running:{label}"), every * 3), (format!("wrote:{label}"), records_live)]
}

/// The entry a door in `phase` announces while it starts (for one announcement, `every`):
/// another door starting at the same moment that cannot serve beside it sees it.
pub(crate) fn starting(phase: &Phase, every: Duration) -> [(String, Duration); 1] {
    [(format!("starting:{}", phase.label()), every)]
}

/// Why an instance in `mine` cannot serve beside the registry's `entries`, if it cannot.
///
/// An instance starting (`starting:`) counts only if the instances running would let it
/// start: one they refuse is refused already, and refuses nobody.
pub(crate) fn conflict(mine: &Phase, entries: &[String]) -> Option<String> {
    let running: Vec<Phase> =
        entries.iter().filter_map(|entry| Phase::parse(entry.strip_prefix("running:")?)).collect();
    for entry in entries {
        let Some((kind @ ("running" | "starting" | "wrote"), label)) = entry.split_once(':') else {
            continue;
        };
        let Some(other) = Phase::parse(label) else {
            return Some(format!(
                "the fleet's registry lists {entry:?}, which this version does not know: a \
                 newer version runs beside it"
            ));
        };
        if other == *mine {
            continue;
        }
        let refused_already =
            running.iter().any(|phase| !(phase.sees(&other) && other.sees(phase)));
        if kind == "starting" && refused_already {
            continue;
        }
        let both_ways = kind != "wrote";
        if mine.sees(&other) && (!both_ways || other.sees(mine)) {
            continue;
        }
        return Some(why(mine, &other, both_ways));
    }
    None
}

/// Why an operator in `mine` cannot forget a key of the fleet the registry's `entries`
/// describe, if it cannot: a naming an instance reads (running, or whose records may live) that
/// it does not, under which the key's record would be left to answer it.
pub(crate) fn uncovered(mine: &Phase, entries: &[String]) -> Option<String> {
    let phases = entries.iter().filter_map(|entry| Phase::parse(entry.split_once(':')?.1));
    for other in phases {
        if other.reads().iter().any(|names| !mine.reads().contains(names)) {
            return Some(format!(
                "this operator serves {mine}, and instances serving {other} read names it does \
                 not: a key forgotten here would still be answered there. Forget it through an \
                 operator of a build of the move (either deploy), which forgets it under both"
            ));
        }
    }
    None
}

/// What the operator is told: the two phases, and the step that is missing.
fn why(mine: &Phase, other: &Phase, running: bool) -> String {
    let when = if running {
        "run now".to_owned()
    } else {
        "ran recently enough that their records may still live (their retention, recovery \
         window, keep-alive ceiling and a lease after the last of them stopped)"
            .to_owned()
    };
    // The region lists each is placed over: a change of list, not of naming, when they differ.
    fn regions(phase: &Phase) -> std::collections::BTreeSet<Option<&str>> {
        match phase {
            Phase::Alone(id) => [id.regions()].into(),
            Phase::Moving { from, to, .. } => [from.regions(), to.regions()].into(),
        }
    }
    let step = match (mine, other) {
        _ if regions(mine) != regions(other) => {
            "a change of region list (a region added, removed or renamed, another rule) is a \
             move of three rolling deploys: `RegionalStore::moving_to(.., Deploy::First)`, \
             then `Deploy::Second`, then the new list alone, once the first's records expired; \
             one deploy at a time, and every instance of a deploy given the same list"
        }
        (Phase::Alone(_), Phase::Alone(_)) => {
            "a change of naming is a move of three rolling deploys: \
             `Hashing::moving_to(.., Deploy::First)`, then `Deploy::Second`, then the new \
             naming alone"
        }
        (Phase::Alone(to), Phase::Moving { to: moved_to, deploy: Deploy::First, .. })
            if to == moved_to =>
        {
            "the move's second deploy (`Deploy::Second`) is missing: it replaces the first, and \
             the new naming alone comes after the first's records expired"
        }
        (Phase::Moving { from, deploy: Deploy::Second, .. }, Phase::Alone(alone))
            if from == alone =>
        {
            "the move's first deploy (`Deploy::First`) is missing: it replaces the old naming \
             alone before the second deploy"
        }
        (Phase::Alone(from), Phase::Moving { from: moved_from, .. }) if from == moved_from => {
            "the move's first deploy (`Deploy::First`) was skipped, or this is a rollback too \
             far: the move's first deploy replaces the old naming alone before the second, and \
             the old naming alone comes back only after the second's records expired (roll \
             back one deploy at a time)"
        }
        (Phase::Moving { to, deploy: Deploy::First, .. }, Phase::Alone(alone)) if to == alone => {
            "the move's second deploy (`Deploy::Second`) was skipped, or this is a rollback too \
             far: roll back one deploy at a time (the move's second deploy first)"
        }
        (Phase::Moving { .. }, Phase::Moving { .. }) => {
            "another move (another secret, or a move begun in the middle of this one): finish \
             one move, all three deploys, before the next"
        }
        _ => "another naming than this move's: a move is between two namings, one at a time",
    };
    format!("this instance serves {mine}, and instances serving {other} {when}: {step}")
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests;
