//! Load for the fault tests: eight clients sending keyed POSTs to `/pay` while a test injects
//! its faults, every answer kept with when it was sent and came back.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::Router;
use tokio::task::JoinHandle;

use super::{keyed, send};

/// What one client saw of one request.
pub struct Answer {
    pub key: String,
    pub status: u16,
    pub retry_after: bool,
    pub replayed: bool,
    pub sent: Instant,
    pub done: Instant,
}

/// The clients, started: half their requests share five hot keys per `window`, half are
/// fresh. A request that takes longer than `timeout` fails the test as hung.
pub struct Load {
    pub start: Instant,
    pub answers: Arc<Mutex<Vec<Answer>>>,
    clients: Vec<JoinHandle<()>>,
}

impl Load {
    pub fn start(app: &Router, load_for: Duration, window: Duration, timeout: Duration) -> Self {
        let start = Instant::now();
        let answers: Arc<Mutex<Vec<Answer>>> = Arc::default();
        let clients = (0..8)
            .map(|client| {
                let (app, answers) = (app.clone(), answers.clone());
                tokio::spawn(async move {
                    let mut n = 0u32;
                    while start.elapsed() < load_for {
                        n += 1;
                        let key = if n.is_multiple_of(2) {
                            let at = start.elapsed().as_millis() / window.as_millis();
                            format!("hot-{at}-{}", n % 5)
                        } else {
                            format!("fresh-{client}-{n}")
                        };
                        let sent = Instant::now();
                        let seen = tokio::time::timeout(
                            timeout,
                            send(&app, keyed("POST", "/pay", &key, "{}")),
                        )
                        .await
                        .unwrap_or_else(|_| panic!("request for {key} hung"));
                        answers.lock().unwrap().push(Answer {
                            status: seen.status.as_u16(),
                            retry_after: seen.header("retry-after").is_some(),
                            replayed: seen.replayed(),
                            key,
                            sent,
                            done: Instant::now(),
                        });
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                })
            })
            .collect();
        Self { start, answers, clients }
    }

    /// Waits for the clients to finish, and hands over what they saw.
    pub async fn finish(self) -> Vec<Answer> {
        for client in self.clients {
            client.await.unwrap();
        }
        std::mem::take(&mut *self.answers.lock().unwrap())
    }
}
