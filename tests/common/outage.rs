//! A TCP proxy in front of a server that can cut it off for a while: every connection through
//! it is closed at once, and new ones are refused (accepted and dropped), until the outage
//! ends. A store's commands then fail fast, as over a network partition or a failover,
//! rather than wait in a paused server's socket and land when it resumes.

use std::{sync::Arc, time::Duration};

use tokio::{
    net::{TcpListener, TcpStream},
    sync::watch,
};

pub struct OutageProxy {
    pub port: u16,
    /// `true` while the server is cut off.
    out: Arc<watch::Sender<bool>>,
}

impl OutageProxy {
    pub async fn start(target: u16) -> Self {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let out = Arc::new(watch::Sender::new(false));
        let watched = out.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *watched.borrow() {
                    continue;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await else { continue };
                let mut out = watched.subscribe();
                tokio::spawn(async move {
                    let (mut client, mut server) = (client, server);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = out.wait_for(|out| *out) => {}
                    }
                });
            }
        });
        Self { port, out }
    }

    /// Cuts the server off now, for `length`.
    pub fn cut_for(&self, length: Duration) {
        self.out.send_replace(true);
        let out = self.out.clone();
        tokio::spawn(async move {
            tokio::time::sleep(length).await;
            out.send_replace(false);
        });
    }
}
