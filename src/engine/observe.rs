//! What the engine decides, for an operator: counters and histograms through the `metrics`
//! facade (feature `metrics`), labelled by route (HTTP: the matched route; consumer door: the
//! scope), never by key. Without the feature every function here is empty.

use std::time::Duration;

/// `idempotency_claims_total{route, outcome}`: claimed, taken_over, replayed, in_progress,
/// mismatch.
pub(crate) fn claim(route: &str, outcome: &'static str) {
    #[cfg(feature = "metrics")]
    described();
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_claims_total", "route" => route.to_owned(), "outcome" => outcome)
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (route, outcome);
}

/// `idempotency_recoveries_total{route, result}`: what the recovery hook answered: happened,
/// unknown, failed.
pub(crate) fn recovery(route: &str, result: &'static str) {
    #[cfg(feature = "metrics")]
    described();
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_recoveries_total", "route" => route.to_owned(), "result" => result)
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (route, result);
}

/// `idempotency_settles_total{route, result}`: stored, stored_in_transaction (by the
/// operation, with its side effect), released, fenced_out, failed.
pub(crate) fn settle(route: &str, result: &'static str) {
    #[cfg(feature = "metrics")]
    described();
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_settles_total", "route" => route.to_owned(), "result" => result)
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (route, result);
}

/// `idempotency_abandoned_claims_total{result}`: what the completer did with an abandoned
/// claim: settled, unresolved, failed, skipped.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) fn abandoned(result: &'static str) {
    #[cfg(feature = "metrics")]
    described();
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_abandoned_claims_total", "result" => result).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = result;
}

/// `idempotency_store_errors_total{route, phase}`: claim, complete, release, touch.
pub(crate) fn store_error(route: &str, phase: &'static str) {
    #[cfg(feature = "metrics")]
    described();
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_store_errors_total", "route" => route.to_owned(), "phase" => phase)
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (route, phase);
}

/// `idempotency_wait_seconds{route}`: how long a duplicate waited for its original.
pub(crate) fn waited(route: &str, took: Duration) {
    #[cfg(feature = "metrics")]
    described();
    #[cfg(feature = "metrics")]
    metrics::histogram!("idempotency_wait_seconds", "route" => route.to_owned())
        .record(took.as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = (route, took);
}

/// `idempotency_handler_seconds{route}`: how long a claimed operation ran.
pub(crate) fn ran(route: &str, took: Duration) {
    #[cfg(feature = "metrics")]
    described();
    #[cfg(feature = "metrics")]
    metrics::histogram!("idempotency_handler_seconds", "route" => route.to_owned())
        .record(took.as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = (route, took);
}

/// `idempotency_replayed_record_age_seconds{route}`: how old a replayed outcome was, by the
/// clocks of the instances that stored and replayed it.
pub(crate) fn replayed_age(route: &str, age: Duration) {
    #[cfg(feature = "metrics")]
    described();
    #[cfg(feature = "metrics")]
    metrics::histogram!("idempotency_replayed_record_age_seconds", "route" => route.to_owned())
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
