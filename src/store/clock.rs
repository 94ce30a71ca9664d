//! The server's clock, as this process can tell it: a sample of the store server's time,
//! carried forward by the local monotonic clock. A claim names the latest server time at which
//! it may still be applied, so that a claim held up on the wire (a paused server, a full socket
//! buffer) and applied after its caller gave up on it writes nothing: no key is locked by a
//! claim nobody runs, however long the pause.
//!
//! Only the server's time is compared with the server's time: the sample comes from the
//! server, and the local clock measures nothing but the time elapsed since it (`Instant`,
//! which no wall-clock step moves). Each backend reads the sample its own way (Redis: `TIME`
//! on each new connection; PostgreSQL: `clock_timestamp()`).

use std::{
    sync::{Mutex, PoisonError},
    time::{Duration, Instant},
};

use super::{Claim, StoreError};

/// The latest sample: the server's time in milliseconds since the Unix epoch, and when it was
/// read by the local monotonic clock (the middle of the round trip).
#[derive(Debug, Default)]
pub(crate) struct ServerClock {
    sample: Mutex<Option<(u64, Instant)>>,
}

impl ServerClock {
    /// The server's time now, in milliseconds since the Unix epoch; `None` before a sample.
    pub(crate) fn now(&self) -> Option<u64> {
        let (server_ms, at) = (*self.sample.lock().unwrap_or_else(PoisonError::into_inner))?;
        let elapsed = u64::try_from(at.elapsed().as_millis()).unwrap_or(u64::MAX);
        Some(server_ms.saturating_add(elapsed))
    }

    /// Keeps `server_ms`, read by a round trip sent at `sent`, as the sample.
    pub(crate) fn record(&self, server_ms: u64, sent: Instant) {
        let at = sent + sent.elapsed() / 2;
        *self.sample.lock().unwrap_or_else(PoisonError::into_inner) = Some((server_ms, at));
    }

    /// The latest server time at which a claim sent now may be applied: the command timeout
    /// (its caller waits that long), plus `slack` for the sample's error and another node's
    /// clock on a Cluster. `0`, no deadline, before a sample.
    pub(crate) fn claim_deadline(&self, timeout: Duration, slack: Duration) -> u64 {
        let wait = u64::try_from(timeout.saturating_add(slack).as_millis()).unwrap_or(u64::MAX);
        self.now().map_or(0, |now| now.saturating_add(wait))
    }
}

/// Runs `claim`; when the store refuses it as landed past its deadline although it was
/// answered in time, the sample is off (the server's clock stepped): `resample`, and claim
/// once more with the new deadline.
pub(crate) async fn claim_resampling<C, R>(
    claim: impl Fn() -> C,
    resample: impl FnOnce() -> R,
) -> Result<Claim, StoreError>
where
    C: Future<Output = Result<Claim, StoreError>>,
    R: Future<Output = Result<(), StoreError>>,
{
    let first = claim().await;
    if let Err(StoreError::ClaimAbandoned) = first {
        tracing::warn!(
            "idempotency: a claim landed after its deadline while answered in time; sampling the store server's clock again"
        );
        resample().await?;
        return claim().await;
    }
    first
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_time_moves_with_the_local_monotonic_clock() {
        let clock = ServerClock::default();
        assert_eq!(clock.now(), None);
        assert_eq!(clock.claim_deadline(Duration::from_secs(1), Duration::from_secs(15)), 0);
        let sampled = Instant::now() - Duration::from_millis(250);
        *clock.sample.lock().unwrap() = Some((1_000_000, sampled));
        let now = clock.now().unwrap();
        assert!((1_000_250..1_001_250).contains(&now), "{now}");
        let deadline = clock.claim_deadline(Duration::from_secs(1), Duration::from_secs(15));
        assert!((1_016_250..1_017_250).contains(&deadline), "{deadline}");
    }

    /// Claims as `answers` say, counting the claims and the samples.
    async fn claims(
        answers: [Result<Claim, StoreError>; 2],
    ) -> (Result<Claim, StoreError>, usize, usize) {
        let answers = Mutex::new(Vec::from(answers));
        let (claimed, sampled) = (Mutex::new(0), Mutex::new(0));
        let claim = || async {
            *claimed.lock().unwrap() += 1;
            answers.lock().unwrap().remove(0)
        };
        let resample = || async {
            *sampled.lock().unwrap() += 1;
            Ok(())
        };
        let outcome = claim_resampling(claim, resample).await;
        (outcome, claimed.into_inner().unwrap(), sampled.into_inner().unwrap())
    }

    #[tokio::test]
    async fn a_claim_refused_as_late_though_answered_in_time_samples_again_and_claims_once_more() {
        let refused = || Err(StoreError::ClaimAbandoned);
        assert!(matches!(
            claims([refused(), Ok(Claim::Claimed)]).await,
            (Ok(Claim::Claimed), 2, 1)
        ));
        // Refused again: the second answer is the answer, and nothing is tried a third time.
        assert!(matches!(
            claims([refused(), refused()]).await,
            (Err(StoreError::ClaimAbandoned), 2, 1)
        ));
        // Any other answer is the answer.
        assert!(matches!(
            claims([Ok(Claim::Mismatch), refused()]).await,
            (Ok(Claim::Mismatch), 1, 0)
        ));
        let timeout = || Err(StoreError::Timeout(Duration::from_secs(1)));
        assert!(matches!(
            claims([timeout(), refused()]).await,
            (Err(StoreError::Timeout(_)), 1, 0)
        ));
    }
}
