//! What the engine decides, for an operator: counters and histograms through the `metrics`
//! facade (feature `metrics`), labelled by what the door names an operation by ([`Label`]: the
//! HTTP door's matched route, `route`; the consumer door's scope, `scope`), never by key.
//! Without the feature every function here is empty.

use std::{ops::Deref, sync::Arc, time::Duration};

/// The label of a door's metrics: its name (`route`, `scope`) and its value. Never a key.
#[derive(Debug, Clone)]
pub(crate) struct Label {
    /// Read only by the metrics.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    name: &'static str,
    value: Arc<str>,
}

impl Label {
    /// The HTTP door's: the matched route.
    pub(crate) fn route(value: impl Into<Arc<str>>) -> Self {
        Self { name: "route", value: value.into() }
    }

    /// The consumer door's: the scope an operation runs in.
    pub(crate) fn scope(value: impl Into<Arc<str>>) -> Self {
        Self { name: "scope", value: value.into() }
    }
}

/// The label's value, as the door logs it.
impl Deref for Label {
    type Target = str;

    fn deref(&self) -> &str {
        &self.value
    }
}

/// `idempotency_claims_total{route, outcome}`: claimed, taken_over, replayed, in_progress,
/// mismatch.
pub(crate) fn claim(route: &Label, outcome: &'static str) {
    #[cfg(feature = "metrics")]
    described();
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_claims_total", route.name => route.value.to_string(), "outcome" => outcome)
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (route, outcome);
}

/// `idempotency_recoveries_total{route, result}`: what the recovery hook answered: happened,
/// unknown, failed.
pub(crate) fn recovery(route: &Label, result: &'static str) {
    #[cfg(feature = "metrics")]
    described();
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_recoveries_total", route.name => route.value.to_string(), "result" => result)
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (route, result);
}

/// `idempotency_settles_total{route, result}`: stored, stored_in_transaction (by the
/// operation, with its side effect), released, fenced_out, failed.
pub(crate) fn settle(route: &Label, result: &'static str) {
    #[cfg(feature = "metrics")]
    described();
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_settles_total", route.name => route.value.to_string(), "result" => result)
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (route, result);
}

/// `idempotency_abandoned_claims_total{result}`: what the completer did with an abandoned
/// claim: settled, unresolved, failed, skipped.
pub(crate) fn abandoned(result: &'static str) {
    #[cfg(feature = "metrics")]
    described();
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_abandoned_claims_total", "result" => result).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = result;
}

/// `idempotency_store_errors_total{route, phase}`: claim, complete, release, touch.
pub(crate) fn store_error(route: &Label, phase: &'static str) {
    #[cfg(feature = "metrics")]
    described();
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_store_errors_total", route.name => route.value.to_string(), "phase" => phase)
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (route, phase);
}

/// `idempotency_wait_seconds{route}`: how long a duplicate waited for its original.
pub(crate) fn waited(route: &Label, took: Duration) {
    #[cfg(feature = "metrics")]
    described();
    #[cfg(feature = "metrics")]
    metrics::histogram!("idempotency_wait_seconds", route.name => route.value.to_string())
        .record(took.as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = (route, took);
}

/// `idempotency_handler_seconds{route}`: how long a claimed operation ran.
pub(crate) fn ran(route: &Label, took: Duration) {
    #[cfg(feature = "metrics")]
    described();
    #[cfg(feature = "metrics")]
    metrics::histogram!("idempotency_handler_seconds", route.name => route.value.to_string())
        .record(took.as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = (route, took);
}

/// `idempotency_replayed_record_age_seconds{route}`: how old a replayed outcome was, by the
/// clocks of the instances that stored and replayed it.
pub(crate) fn replayed_age(route: &Label, age: Duration) {
    #[cfg(feature = "metrics")]
    described();
    #[cfg(feature = "metrics")]
    metrics::histogram!("idempotency_replayed_record_age_seconds", route.name => route.value.to_string())
        .record(age.as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = (route, age);
}

/// Describes every metric to the installed recorder (its `# HELP` line in Prometheus), once,
/// when the first is recorded: a recorder installed at start-up, as `metrics` asks, gets them.
#[cfg(feature = "metrics")]
fn described() {
    static DESCRIBED: std::sync::Once = std::sync::Once::new();
    DESCRIBED.call_once(|| {
        use metrics::{Unit, describe_counter, describe_histogram};
        describe_counter!(
            "idempotency_claims_total",
            "Claims of a key, by what they found: claimed, taken_over (a lapsed lease taken over within its recovery window: its holder died or stalled), replayed, in_progress, mismatch"
        );
        describe_counter!(
            "idempotency_recoveries_total",
            "What the recovery hook answered: happened, unknown, mismatch, failed"
        );
        describe_counter!(
            "idempotency_settles_total",
            "How claimed operations settled: stored, stored_in_transaction, released, fenced_out, failed"
        );
        describe_counter!(
            "idempotency_abandoned_claims_total",
            "What the completer did with an abandoned claim: settled, unresolved, failed, skipped"
        );
        describe_counter!(
            "idempotency_store_errors_total",
            "Store calls that failed, by phase: claim, complete, release, touch"
        );
        describe_histogram!(
            "idempotency_wait_seconds",
            Unit::Seconds,
            "How long a duplicate waited for its in-progress original"
        );
        describe_histogram!(
            "idempotency_handler_seconds",
            Unit::Seconds,
            "How long a claimed operation (handler) ran"
        );
        describe_histogram!(
            "idempotency_replayed_record_age_seconds",
            Unit::Seconds,
            "How old a replayed outcome was, by the clocks of the instances that stored and replayed it"
        );
    });
}
