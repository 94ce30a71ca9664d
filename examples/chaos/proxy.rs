//! A TCP proxy between the services and Redis that the nemesis can make slow, silent (bytes
//! held, not forwarded), down (every command's connection reset, new ones refused: commands
//! fail at once) or reset (every connection closed at once).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::watch,
};

/// What the proxy does to the bytes now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Weather {
    Clear,
    /// Each chunk, either way, waits this long.
    Slow(Duration),
    /// Nothing is forwarded (a partition that drops packets): bytes wait until it clears.
    Silent,
    /// The store is gone (a failover, a crash before the restart): a connection that carries
    /// bytes is reset, and new ones are refused, so every command fails at once.
    Down,
}

/// A handle on a running proxy.
#[derive(Clone)]
pub(crate) struct Proxy {
    pub(crate) port: u16,
    weather: watch::Sender<Weather>,
    resets: Arc<AtomicU64>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    pub(crate) async fn start(upstream: u16) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let (weather, _) = watch::channel(Weather::Clear);
        let proxy = Self { port, weather, resets: Arc::new(AtomicU64::new(0)) };
        let accepting = proxy.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *accepting.weather.borrow() == Weather::Down {
                    drop(client);
                    continue;
                }
                let proxy = accepting.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await {
                        proxy.pipe(client, server).await;
                    }
                });
            }
        });
        Ok(proxy)
    }

    pub(crate) fn set(&self, weather: Weather) {
        self.weather.send_replace(weather);
    }

    /// Closes every open connection now (with RST: linger zero).
    pub(crate) fn reset_all(&self) {
        self.resets.fetch_add(1, Ordering::SeqCst);
    }

    async fn pipe(&self, client: TcpStream, server: TcpStream) {
        let generation = self.resets.load(Ordering::SeqCst);
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let (client_read, client_write) = client.into_split();
        let (server_read, server_write) = server.into_split();
        let up = self.forward(client_read, server_write, generation);
        let down = self.forward(server_read, client_write, generation);
        tokio::select! {
            () = up => {}
            () = down => {}
        }
    }

    async fn forward(
        &self,
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        generation: u64,
    ) {
        let mut weather = self.weather.subscribe();
        let mut buffer = vec![0u8; 16 * 1024];
        let was_reset = || self.resets.load(Ordering::SeqCst) != generation;
        loop {
            let read = tokio::select! {
                read = from.read(&mut buffer) => read,
                () = tokio::time::sleep(Duration::from_millis(50)) => {
                    if was_reset() { break } else { continue }
                }
            };
            let Ok(n @ 1..) = read else { break };
            loop {
                if was_reset() {
                    reset(&to);
                    return;
                }
                let now = *weather.borrow_and_update();
                match now {
                    Weather::Clear => break,
                    Weather::Slow(by) => {
                        tokio::time::sleep(by).await;
                        break;
                    }
                    Weather::Silent => {
                        let _ = tokio::time::timeout(Duration::from_millis(50), weather.changed())
                            .await;
                    }
                    Weather::Down => {
                        reset(&to);
                        return;
                    }
                }
            }
            if to.write_all(&buffer[..n]).await.is_err() {
                break;
            }
        }
        reset(&to);
    }
}

/// Closes with RST rather than FIN, as a middlebox that drops a connection does.
#[allow(deprecated)] // tokio warns that a lingering close blocks; a zero linger does not
fn reset(stream: &tokio::net::tcp::OwnedWriteHalf) {
    let _ = stream.as_ref().set_linger(Some(Duration::ZERO));
}
