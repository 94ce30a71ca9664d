//! One pub/sub connection per store, shared by every waiter of the process: it subscribes to a
//! record's settle channel while the record has waiters here, and wakes them when the settle
//! is published.
//!
//! Standalone Redis: `SUBSCRIBE` on a dedicated connection, reopened when it is lost. Cluster:
//! `SSUBSCRIBE` (sharded pub/sub, Redis 7) on a RESP3 cluster connection, which follows each
//! channel to the shard that owns its slot and resubscribes on its own after a failover.
//! After a lost connection every waiter is woken: a settle may have been missed, and a woken
//! waiter claims again to find out.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use deadpool_redis::redis::Client;
use futures_util::StreamExt as _;
use tokio::sync::{mpsc, oneshot};

use crate::store::{OnLastLeave, Subscription, Waiters};

/// Where the listening connection goes.
#[derive(Clone)]
pub(super) enum Listen {
    // Boxed: with TLS parameters a client is far larger than the cluster's URL list.
    Standalone(Box<Client>),
    #[cfg(feature = "cluster")]
    Cluster(Vec<String>),
}

enum Command {
    /// Subscribe, and answer once the server confirmed (or the attempt failed).
    Subscribe(String, oneshot::Sender<()>),
    Unsubscribe(String),
}

/// The waiters of one store, and the task that listens for them.
pub(super) struct Subscriber {
    listen: Listen,
    waiters: Waiters,
    /// The listening task's commands. Started on the first subscription, inside its
    /// runtime, and again on the next subscription after that runtime shut down (the task
    /// went with it): a store shared by runtimes one after another still wakes its waiters.
    commands: Arc<Mutex<Option<mpsc::UnboundedSender<Command>>>>,
}

/// How long to wait before reopening a lost connection.
const RECONNECT_DELAY: Duration = Duration::from_millis(100);

impl Subscriber {
    pub(super) fn new(listen: Listen) -> Self {
        Self { listen, waiters: Waiters::default(), commands: Arc::default() }
    }

    /// The listening task's commands, the task started when there is none running.
    fn commands(&self) -> mpsc::UnboundedSender<Command> {
        let mut commands = self.commands.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(running) = commands.as_ref().filter(|sender| !sender.is_closed()) {
            return running.clone();
        }
        let (sender, received) = mpsc::unbounded_channel();
        let (listen, waiters) = (self.listen.clone(), self.waiters.clone());
        drop(tokio::spawn(async move {
            match listen {
                Listen::Standalone(client) => standalone(*client, waiters, received).await,
                #[cfg(feature = "cluster")]
                Listen::Cluster(urls) => cluster(urls, waiters, received).await,
            }
        }));
        commands.insert(sender).clone()
    }

    /// Subscribes to `channel`; returns once the server confirmed it, or after `timeout` (the
    /// waiter's deadline then decides).
    pub(super) async fn subscribe(&self, channel: String, timeout: Duration) -> Subscription {
        // To the task running when the last waiter leaves, which may be a later one.
        let commands = self.commands.clone();
        let on_last_leave: OnLastLeave = Arc::new(move |channel: &str| {
            let commands = commands.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(commands) = commands.as_ref() {
                let _ = commands.send(Command::Unsubscribe(channel.to_owned()));
            }
        });
        let (subscription, _) = self.waiters.register(&channel, Some(on_last_leave));
        let (confirmed, confirmation) = oneshot::channel();
        if self.commands().send(Command::Subscribe(channel, confirmed)).is_ok()
            && tokio::time::timeout(timeout, confirmation).await.is_err()
        {
            tracing::warn!("idempotency: subscribing to a settle channel timed out");
        }
        subscription
    }
}

/// Standalone Redis: a dedicated pub/sub connection, reopened when it is lost.
async fn standalone(
    client: Client,
    waiters: Waiters,
    mut commands: mpsc::UnboundedReceiver<Command>,
) {
    let mut reconnected = false;
    loop {
        let pubsub = match client.get_async_pubsub().await {
            Ok(pubsub) => pubsub,
            Err(error) => {
                tracing::warn!(%error, "idempotency: settle subscriber cannot connect; retrying");
                // Waiters asking meanwhile are answered at once; their deadline decides.
                if drain_until(&mut commands, RECONNECT_DELAY).await.is_none() {
                    return;
                }
                continue;
            }
        };
        let (mut sink, mut messages) = pubsub.split();
        let mut subscribed = HashSet::new();
        let mut lost = false;
        for channel in waiters.channels() {
            if sink.subscribe(&channel).await.is_err() {
                lost = true;
                break;
            }
            subscribed.insert(channel);
        }
        if reconnected {
            waiters.notify_all();
        }
        reconnected = true;
        while !lost {
            tokio::select! {
                command = commands.recv() => match command {
                    None => return,
                    Some(Command::Subscribe(channel, confirmed)) => {
                        if !subscribed.contains(&channel) {
                            if sink.subscribe(&channel).await.is_err() {
                                lost = true;
                            } else {
                                subscribed.insert(channel);
                            }
                        }
                        let _ = confirmed.send(());
                    }
                    Some(Command::Unsubscribe(channel)) => {
                        if !waiters.is_waited(&channel) && subscribed.remove(&channel) {
                            lost = sink.unsubscribe(&channel).await.is_err();
                        }
                    }
                },
                message = messages.next() => match message {
                    Some(message) => waiters.notify(message.get_channel_name()),
                    None => lost = true,
                },
            }
        }
        tracing::warn!("idempotency: settle subscriber connection lost; reconnecting");
    }
}

/// Redis Cluster: sharded pub/sub on a RESP3 cluster connection.
#[cfg(feature = "cluster")]
async fn cluster(
    urls: Vec<String>,
    waiters: Waiters,
    mut commands: mpsc::UnboundedReceiver<Command>,
) {
    use deadpool_redis::redis::{ProtocolVersion, PushKind, cluster::ClusterClientBuilder};

    let (pushes, mut pushed) = mpsc::unbounded_channel();
    let client = ClusterClientBuilder::new(urls)
        .use_protocol(ProtocolVersion::RESP3)
        .push_sender(pushes)
        .connection_timeout(Duration::from_millis(500))
        .response_timeout(Duration::from_millis(500))
        .build();
    let mut connection = loop {
        let connected = match &client {
            Ok(client) => client.get_async_connection().await,
            Err(error) => Err(error.clone()),
        };
        match connected {
            Ok(connection) => break connection,
            Err(error) => {
                tracing::warn!(%error, "idempotency: settle subscriber cannot connect; retrying");
                if drain_until(&mut commands, RECONNECT_DELAY).await.is_none() {
                    return;
                }
            }
        }
    };
    let mut subscribed = HashSet::new();
    loop {
        tokio::select! {
            command = commands.recv() => match command {
                None => return,
                Some(Command::Subscribe(channel, confirmed)) => {
                    if !subscribed.contains(&channel) && connection.ssubscribe(&channel).await.is_ok() {
                        subscribed.insert(channel);
                    }
                    let _ = confirmed.send(());
                }
                Some(Command::Unsubscribe(channel)) => {
                    if !waiters.is_waited(&channel) && subscribed.remove(&channel) {
                        let _ = connection.sunsubscribe(&channel).await;
                    }
                }
            },
            Some(push) = pushed.recv() => match push.kind {
                PushKind::SMessage | PushKind::Message => {
                    if let Some(deadpool_redis::redis::Value::BulkString(channel)) = push.data.first() {
                        waiters.notify(&String::from_utf8_lossy(channel));
                    }
                }
                // The connection resubscribes on its own; a settle may have been missed.
                PushKind::Disconnection => waiters.notify_all(),
                _ => {}
            },
        }
    }
}

/// Answers subscription requests at once for `delay` (no connection to subscribe on). `None`
/// when the store is gone.
async fn drain_until(
    commands: &mut mpsc::UnboundedReceiver<Command>,
    delay: Duration,
) -> Option<()> {
    let until = tokio::time::Instant::now() + delay;
    loop {
        tokio::select! {
            command = commands.recv() => match command? {
                Command::Subscribe(_, confirmed) => drop(confirmed.send(())),
                Command::Unsubscribe(_) => {}
            },
            () = tokio::time::sleep_until(until) => return Some(()),
        }
    }
}
