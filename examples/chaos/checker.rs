//! The checker: reads the whole history (every attempt and its answer, every fault) and the
//! system of record afterwards, and decides whether the run kept the crate's promises.
//!
//! - **Once**: per key, at most one execution row. A rerun whose holder was a worker paused
//!   past its lease between the key's first attempt and its write is what GUARANTEES.md says a lease allows ("at most once
//!   per lease"): it is counted and shown apart, not hidden, and not a violation.
//! - **The same answer**: every 2xx answer for a key carries the same receipt as the first, and
//!   that receipt is an execution the database holds.
//! - **An answer**: every client that stayed within its retry budget got a 2xx; none was
//!   refused (a 4xx other than 409 in progress, a 500). A budget runs out no sooner than
//!   `AFTER_HEAL` after the faults heal: what is checked is that every key is answered once
//!   the system is whole again, not that a key whose every attempt fell in a fault was.
//! - **No panic** in any process's log.
//!
//! In a `--lossy` run, a rerun with a restart without AOF or a failover between its executions
//! is counted apart too: GUARANTEES.md says such a loss costs a rerun without
//! `Recovery::every_claim`.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
};

use crate::{
    clients::{Attempt, KeyEnd, is_answer},
    nemesis::Fault,
    service::{Delivered, LEASE, Receipt},
};

/// An execution row of the system of record.
#[derive(Clone, Debug)]
pub(crate) struct Row {
    pub(crate) id: i64,
    pub(crate) door: String,
    pub(crate) key: String,
    pub(crate) amount: i64,
    pub(crate) process: String,
    pub(crate) started_ms: i64,
    pub(crate) written_ms: i64,
}

impl Row {
    fn receipt(&self) -> Receipt {
        Receipt { payment: self.id, key: self.key.clone(), amount: self.amount }
    }
}

#[derive(Default, Debug)]
pub(crate) struct Verdict {
    /// Violations, by check: one line each, naming the key.
    pub(crate) violations: BTreeMap<&'static str, Vec<String>>,
    /// Reruns GUARANTEES.md allows (a holder paused past its lease), naming the key.
    pub(crate) lease_reruns: Vec<String>,
    /// Reruns after the store lost records, in a `--lossy` run, naming the key.
    pub(crate) loss_reruns: Vec<String>,
}

pub(crate) const ONCE: &str = "side effect at most once per key";
pub(crate) const SAME_ANSWER: &str =
    "every 2xx answer for a key is the first one, and the database holds it";
pub(crate) const ANSWERED: &str = "every client within its budget got an answer";
pub(crate) const NO_PANIC: &str = "no panic in any log";

/// The faults that lose records, which the nemesis injects in a `--lossy` run only.
pub(crate) const LOSSY_FAULTS: &[&str] =
    &["restart-redis", "kill-master", "pause-master-past-timeout"];

impl Verdict {
    pub(crate) fn total(&self) -> usize {
        self.violations.values().map(Vec::len).sum()
    }

    fn violation(&mut self, check: &'static str, what: String) {
        self.violations.entry(check).or_default().push(what);
    }
}

/// The receipt a 2xx answer carries: the body itself (HTTP), or the worker's `receipt`.
fn receipt_of(attempt: &Attempt) -> Option<Receipt> {
    let body = attempt.body.as_deref()?;
    match attempt.door.as_str() {
        "consumer" => serde_json::from_str::<Delivered>(body).ok().map(|d| d.receipt),
        _ => serde_json::from_str::<Receipt>(body).ok(),
    }
}

pub(crate) fn check(
    attempts: &[Attempt],
    ends: &[KeyEnd],
    rows: &[Row],
    faults: &[Fault],
    logs: &[PathBuf],
    lossy: bool,
) -> Verdict {
    let mut verdict = Verdict::default();
    for check in [ONCE, SAME_ANSWER, ANSWERED, NO_PANIC] {
        verdict.violations.insert(check, Vec::new());
    }
    let mut rows_by_key: BTreeMap<(&str, &str), Vec<&Row>> = BTreeMap::new();
    for row in rows {
        rows_by_key.entry((&row.door, &row.key)).or_default().push(row);
    }
    // When each key was first sent: its holder may have claimed it from then on.
    let mut first_sent: BTreeMap<(&str, &str), i64> = BTreeMap::new();
    for attempt in attempts {
        let sent = first_sent.entry((&attempt.door, &attempt.key)).or_insert(attempt.start_ms);
        *sent = (*sent).min(attempt.start_ms);
    }
    let since = |row: &Row| {
        first_sent.get(&(row.door.as_str(), row.key.as_str())).copied().unwrap_or(row.started_ms)
    };
    // The holder that wrote `row` was stopped past its lease between the key's first attempt
    // and its write: its lease lapsed, and a retry took the key over.
    let paused_past_lease = |row: &Row| {
        faults.iter().any(|f| {
            f.kind == "pause-worker"
                && f.target == row.process
                && f.end_ms - f.start_ms >= i64::try_from(LEASE.as_millis()).unwrap_or(i64::MAX)
                && f.start_ms <= row.written_ms
                && f.end_ms >= since(row)
        })
    };
    // In a lossy run, a restart without AOF or a failover between a key's first attempt and
    // its last execution may have lost its record.
    let lost_between = |runs: &[&Row]| {
        let first = runs.iter().map(|r| since(r)).min().unwrap_or(0);
        let last = runs.iter().map(|r| r.started_ms).max().unwrap_or(0);
        lossy
            && faults
                .iter()
                .any(|f| LOSSY_FAULTS.contains(&f.kind) && f.start_ms <= last && f.end_ms >= first)
    };
    let mut explained = BTreeSet::new();
    for (&(door, key), runs) in &rows_by_key {
        if runs.len() <= 1 {
            continue;
        }
        let ids: Vec<String> = runs.iter().map(|r| format!("{}@{}", r.id, r.process)).collect();
        let what = format!("{door} {key}: {} executions ({})", runs.len(), ids.join(", "));
        if runs.iter().any(|row| paused_past_lease(row)) {
            explained.insert((door, key));
            verdict.lease_reruns.push(what);
        } else if lost_between(runs) {
            explained.insert((door, key));
            verdict.loss_reruns.push(what);
        } else {
            verdict.violation(ONCE, what);
        }
    }

    let mut first: BTreeMap<(&str, &str), Receipt> = BTreeMap::new();
    for attempt in attempts.iter().filter(|a| a.status.is_some_and(is_answer)) {
        let id = (attempt.door.as_str(), attempt.key.as_str());
        let Some(receipt) = receipt_of(attempt) else {
            verdict.violation(
                SAME_ANSWER,
                format!("{} {}: a 2xx without a receipt: {:?}", id.0, id.1, attempt.body),
            );
            continue;
        };
        let held =
            rows_by_key.get(&id).is_some_and(|runs| runs.iter().any(|r| r.receipt() == receipt));
        if !held {
            verdict.violation(
                SAME_ANSWER,
                format!(
                    "{} {}: answered {receipt:?}, which the database does not hold",
                    id.0, id.1
                ),
            );
        }
        match first.get(&id) {
            None => {
                first.insert(id, receipt);
            }
            Some(earlier) if *earlier != receipt && !explained.contains(&id) => {
                verdict.violation(
                    SAME_ANSWER,
                    format!("{} {}: answered {receipt:?} after {earlier:?}", id.0, id.1),
                );
            }
            Some(_) => {}
        }
    }

    for end in ends {
        if let Some(status) = end.refused {
            verdict.violation(ANSWERED, format!("{} {}: refused with {status}", end.door, end.key));
        } else if !end.answered {
            verdict.violation(
                ANSWERED,
                format!("{} {}: no 2xx in {} attempts", end.door, end.key, end.attempts),
            );
        }
    }

    for log in logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        for line in text.lines().filter(|l| l.contains("panicked")) {
            verdict.violation(NO_PANIC, format!("{}: {line}", log.display()));
        }
    }
    verdict
}
