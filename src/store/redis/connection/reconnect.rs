//! How an operation gets a connection when its runtime has none: one connect at a time (per
//! runtime), in a task of its own, and a pause after one that failed.
//!
//! A connect made inside the caller's future ended with the caller's deadline, and the next
//! caller started another. Against a stalled Redis (SIGSTOP, a VM pause), whose kernel still
//! completes TCP handshakes, each of those left a socket in the server's accept queue, closed
//! on our side but not on its: 514 in 5 s under 200 clients, which Redis accepted all at once
//! when it resumed, hundreds past its `maxclients` (issue 62). A task no caller cancels, which
//! every caller waits for, makes one socket per attempt; the pause after a failed attempt, in
//! which callers are answered at once, keeps the attempts few however long the stall.
//!
//! A pause must not outlast the fault: an outage the store sees longer than it was costs
//! renewals, and a lease that lapses lets a retry run the handler again. So the pause is
//! short (a second at most), and the connection dropped before it is asked (`PING`, on its
//! own socket: no new one) until the server answers, which ends the pause at once.

use std::{
    error::Error,
    fmt,
    sync::{Arc, Weak},
    time::Duration,
};

use deadpool_redis::redis::{self, ErrorKind, RedisError};
use tokio::{runtime, sync::watch, time::Instant};

use super::{Connections, NO_DEADLINE, RUNTIMES, Shared};
use crate::store::{StoreError, redis::bounded::SharedConnection};

/// The pause after the first failed connect; it doubles with each failure in a row.
const FIRST_PAUSE: Duration = Duration::from_millis(50);
/// The longest pause: a server back after a long outage waits at most this for its store,
/// unless the probe saw it first. Each timed-out attempt costs the stopped server an entry in
/// its accept queue: with attempts of a second, one more every two seconds of a stall.
const LONGEST_PAUSE: Duration = Duration::from_secs(1);
/// How long the probe waits for one `PING`'s answer before it sends another.
const PROBE_WAIT: Duration = Duration::from_secs(5);
/// How soon the probe asks again after an error reply (`BUSY`, `LOADING`).
const PROBE_AGAIN: Duration = Duration::from_millis(100);

/// The store's connect: the one in flight, and the pause after the last failed.
#[derive(Default)]
pub(super) struct Reconnect {
    /// The connects in flight, one per runtime at most: a connect's task is its runtime's, and
    /// a runtime that stops running its tasks must not hold up another's callers.
    in_flight: Vec<InFlight>,
    /// Connects failed in a row.
    failures: u32,
    /// Until when no connect starts, and why the last failed.
    paused: Option<(Instant, Failure)>,
    /// The connection last dropped, kept until a connect succeeds: the probe's while a pause
    /// lasts.
    pub(super) suspect: Option<SharedConnection>,
}

struct InFlight {
    /// The runtime it connects for: a connection's driver is a task of the runtime that made it.
    runtime: Option<runtime::Id>,
    outcome: watch::Receiver<Option<Outcome>>,
}

/// What became of a connect, as those who waited for it are told.
#[derive(Clone)]
enum Outcome {
    Connected(u64, SharedConnection),
    Failed(Failure),
    /// Its task ended with its runtime before it was done: nobody's failure, no pause.
    Ended,
}

/// Why a connect failed, told to every caller that waited for it.
#[derive(Clone)]
enum Failure {
    TimedOut,
    Unsupported(String),
    Unavailable(Arc<dyn Error + Send + Sync>),
}

impl Failure {
    fn from_store(error: StoreError) -> Self {
        match error {
            StoreError::Timeout(_) => Self::TimedOut,
            StoreError::UnsupportedServer(why) => Self::Unsupported(why),
            StoreError::Unavailable(error) => Self::Unavailable(Arc::from(error)),
            other => Self::Unavailable(Arc::new(other)),
        }
    }

    /// The error of a caller whose operation had `timeout`.
    fn to_store(&self, timeout: Duration) -> StoreError {
        match self {
            Self::TimedOut => StoreError::Timeout(timeout),
            Self::Unsupported(why) => StoreError::UnsupportedServer(why.clone()),
            Self::Unavailable(error) => StoreError::unavailable(SharedError(error.clone())),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TimedOut => f.write_str("timed out"),
            Self::Unsupported(why) => write!(f, "failed: unsupported server: {why}"),
            Self::Unavailable(error) => write!(f, "failed: {error}"),
        }
    }
}

/// One connect's error, told to each of its callers.
#[derive(Debug)]
struct SharedError(Arc<dyn Error + Send + Sync>);

impl fmt::Display for SharedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Error for SharedError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.0.source()
    }
}

/// The answer while the store waits before its next connect.
#[derive(Debug)]
struct Reconnecting {
    last: String,
    next_in: Duration,
}

impl fmt::Display for Reconnecting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "reconnecting to Redis: the last connect {}; the next in {} ms",
            self.last,
            self.next_in.as_millis()
        )
    }
}

impl Error for Reconnecting {}

/// The pause after `failures` connects failed in a row.
fn pause(failures: u32) -> Duration {
    FIRST_PAUSE.saturating_mul(1 << failures.saturating_sub(1).min(16)).min(LONGEST_PAUSE)
}

impl Connections {
    /// The connection shared on `runtime`, the caller's: the one there is, the one being made,
    /// or a new one. An operation of `timeout` that started the connect gives it that long,
    /// from its start, even when the operation itself is gone by then.
    pub(super) async fn connection(
        self: &Arc<Self>,
        runtime: Option<runtime::Id>,
        timeout: Duration,
    ) -> Result<(u64, SharedConnection), StoreError> {
        loop {
            let (mut outcome, start) = {
                let mut slots = self.slots();
                if let Some(found) = slots.find(runtime) {
                    return Ok(found);
                }
                let reconnect = &mut slots.reconnect;
                if let Some(in_flight) = reconnect.in_flight.iter().find(|i| i.runtime == runtime) {
                    (in_flight.outcome.clone(), None)
                } else {
                    let now = Instant::now();
                    if let Some((until, last)) = &reconnect.paused
                        && *until > now
                    {
                        let (last, next_in) = (last.to_string(), *until - now);
                        return Err(StoreError::unavailable(Reconnecting { last, next_in }));
                    }
                    let (sender, outcome) = watch::channel(None);
                    reconnect.in_flight.push(InFlight { runtime, outcome: outcome.clone() });
                    let deadline = now.checked_add(timeout).unwrap_or(now + NO_DEADLINE);
                    (outcome, Some((deadline, sender)))
                }
            };
            // Spawned with the lock released: a task its runtime drops at once ends the connect
            // in flight, which takes the lock.
            if let Some((deadline, sender)) = start {
                self.spawn_connect(runtime, deadline, sender);
            }
            let outcome =
                outcome.wait_for(Option::is_some).await.ok().and_then(|seen| seen.clone());
            match outcome {
                Some(Outcome::Connected(id, connection)) => return Ok((id, connection)),
                Some(Outcome::Failed(failure)) => return Err(failure.to_store(timeout)),
                // Its task ended with its runtime before it was done: look again.
                Some(Outcome::Ended) | None => {}
            }
        }
    }

    fn spawn_connect(
        self: &Arc<Self>,
        runtime: Option<runtime::Id>,
        deadline: Instant,
        sender: watch::Sender<Option<Outcome>>,
    ) {
        // Made before the task, so that a task dropped unpolled (its runtime ending) still
        // clears the connect in flight.
        let mut attempt = Attempt { connections: self.clone(), runtime, sender, told: false };
        tokio::spawn(async move {
            let connected = tokio::time::timeout_at(deadline, attempt.connections.connect()).await;
            attempt.tell(connected.unwrap_or(Err(StoreError::Timeout(Duration::ZERO))));
        });
    }

    /// Ends the connect in flight with `result` (`None`: its task ended first) and tells its
    /// callers. The connection to probe, when a pause begins.
    fn finish(
        &self,
        runtime: Option<runtime::Id>,
        result: Option<Result<SharedConnection, StoreError>>,
        sender: &watch::Sender<Option<Outcome>>,
    ) -> Option<SharedConnection> {
        let mut guard = self.slots();
        let slots = &mut *guard;
        let reconnect = &mut slots.reconnect;
        reconnect.in_flight.retain(|in_flight| in_flight.runtime != runtime);
        let mut probe = None;
        let outcome = match result {
            Some(Ok(connection)) => {
                (reconnect.failures, reconnect.paused, reconnect.suspect) = (0, None, None);
                let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let shared = &mut slots.shared;
                shared.retain(|shared| shared.runtime != runtime);
                if shared.len() >= RUNTIMES {
                    shared.remove(0);
                }
                shared.push(Shared { runtime, id, connection: connection.clone() });
                Outcome::Connected(id, connection)
            }
            Some(Err(error)) => {
                let failure = Failure::from_store(error);
                reconnect.failures = reconnect.failures.saturating_add(1);
                let until = Instant::now() + pause(reconnect.failures);
                reconnect.paused = Some((until, failure.clone()));
                probe = reconnect.suspect.take();
                Outcome::Failed(failure)
            }
            None => Outcome::Ended,
        };
        sender.send_replace(Some(outcome));
        probe
    }

    /// Asks `suspect` until the server answers, then ends the pause; gives up when it is
    /// gone, or when a connect succeeded first.
    async fn probe(connections: Weak<Self>, mut suspect: SharedConnection) {
        // A Cluster's connection keeps the node timeouts it was built with.
        #[cfg_attr(not(feature = "cluster"), allow(irrefutable_let_patterns))]
        if let SharedConnection::Standalone(connection) = &mut suspect {
            connection.set_response_timeout(PROBE_WAIT);
        }
        loop {
            let answer: Result<String, RedisError> =
                redis::cmd("PING").query_async(&mut suspect).await;
            let again = {
                let Some(connections) = connections.upgrade() else { return };
                let mut slots = connections.slots();
                let reconnect = &mut slots.reconnect;
                match answer {
                    _ if reconnect.failures == 0 => return,
                    Ok(_) => {
                        (reconnect.failures, reconnect.paused) = (0, None);
                        return;
                    }
                    Err(error) if error.is_timeout() => Duration::ZERO,
                    Err(error) if matches!(error.kind(), ErrorKind::Server(_)) => PROBE_AGAIN,
                    Err(_) => return,
                }
            };
            tokio::time::sleep(again).await;
        }
    }
}

/// A connect's task: tells its outcome, or, dropped before, that it ended.
struct Attempt {
    connections: Arc<Connections>,
    runtime: Option<runtime::Id>,
    sender: watch::Sender<Option<Outcome>>,
    told: bool,
}

impl Attempt {
    fn tell(&mut self, result: Result<SharedConnection, StoreError>) {
        self.told = true;
        if let Some(suspect) = self.connections.finish(self.runtime, Some(result), &self.sender) {
            tokio::spawn(Connections::probe(Arc::downgrade(&self.connections), suspect));
        }
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if !self.told {
            // No probe: a pause begins only after a failure.
            let _ = self.connections.finish(self.runtime, None, &self.sender);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pause_doubles_from_50_ms_to_a_second() {
        let pauses: Vec<_> = (1..=7).map(|n| pause(n).as_millis()).collect();
        assert_eq!(pauses, [50, 100, 200, 400, 800, 1000, 1000]);
        assert_eq!(pause(u32::MAX), LONGEST_PAUSE);
    }
}
