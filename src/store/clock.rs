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
}
