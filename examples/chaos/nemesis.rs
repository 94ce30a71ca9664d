//! The nemesis: faults at random intervals, on two threads at once, one for the service's
//! processes and one for the store, so that faults overlap. Every fault is logged with when it
//! started and ended.

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use serde::Serialize;

use crate::{
    proxy::{Proxy, Weather},
    service::{LEASE, now_ms},
    system::{Proc, is_master, redis_cli, wait_for_cluster},
};

/// One fault: what, on which process, from when to when.
#[derive(Serialize, Clone, Debug)]
pub(crate) struct Fault {
    pub(crate) kind: &'static str,
    pub(crate) target: String,
    pub(crate) start_ms: i64,
    pub(crate) end_ms: i64,
}

pub(crate) struct Nemesis {
    pub(crate) instances: Arc<Mutex<Vec<Proc>>>,
    pub(crate) workers: Arc<Mutex<Vec<Proc>>>,
    pub(crate) redis: Arc<Mutex<Vec<Proc>>>,
    /// The proxy in front of a single Redis (none in front of a Cluster).
    pub(crate) proxy: Option<Proxy>,
    pub(crate) stop: Arc<AtomicBool>,
    /// A run that counts what losses cost: restarts (without AOF) come more often.
    pub(crate) lossy: bool,
    /// The server's admin URL and the run's database: where `PostgresStore`'s connections are.
    pub(crate) database: (String, String),
    pub(crate) faults: Mutex<Vec<Fault>>,
    pub(crate) errors: Mutex<Vec<String>>,
}

fn between(low_ms: u64, high_ms: u64) -> Duration {
    Duration::from_millis(low_ms + rand::random::<u64>() % (high_ms - low_ms).max(1))
}

fn pick(of: usize) -> usize {
    usize::from(rand::random::<u16>()) % of
}

impl Nemesis {
    /// Runs `fault` between its start and its end, and logs it.
    fn fault(&self, kind: &'static str, target: &str, fault: impl FnOnce()) {
        let start_ms = now_ms();
        fault();
        let end_ms = now_ms();
        self.faults.lock().unwrap().push(Fault {
            kind,
            target: target.to_owned(),
            start_ms,
            end_ms,
        });
    }

    fn rest(&self) {
        std::thread::sleep(between(500, 2500));
    }

    fn error(&self, what: String) {
        eprintln!("nemesis: {what}");
        self.errors.lock().unwrap().push(what);
    }

    /// SIGKILL an instance or a worker and start it again; pause a worker past its lease.
    pub(crate) fn processes(&self) {
        while !self.stop.load(Ordering::SeqCst) {
            self.rest();
            match pick(3) {
                0 => self.kill_and_restart("kill-instance", &self.instances),
                1 => self.kill_and_restart("kill-worker", &self.workers),
                _ => {
                    let workers = self.workers.lock().unwrap();
                    let worker = &workers[pick(workers.len())];
                    let past_lease = LEASE + between(500, 2000);
                    self.fault("pause-worker", &worker.name, || {
                        worker.signal("-STOP");
                        std::thread::sleep(past_lease);
                        worker.signal("-CONT");
                    });
                }
            }
        }
    }

    fn kill_and_restart(&self, kind: &'static str, procs: &Mutex<Vec<Proc>>) {
        let mut procs = procs.lock().unwrap();
        let i = pick(procs.len());
        let proc = &mut procs[i];
        let mut failed = None;
        self.fault(kind, &proc.name.clone(), || {
            proc.kill();
            std::thread::sleep(between(200, 1500));
            failed = proc.start().err();
        });
        if let Some(error) = failed {
            self.error(format!("{kind}: {error}"));
        }
    }

    /// A fault of the store's network, through the proxy: 0 slow, 1 silent, 2 down, else reset.
    fn network(&self, proxy: &Proxy, which: usize) {
        match which {
            0 => self.fault("slow-network", "proxy", || {
                proxy.set(Weather::Slow(between(50, 500)));
                std::thread::sleep(between(1000, 4000));
                proxy.set(Weather::Clear);
            }),
            1 => self.fault("silent-network", "proxy", || {
                proxy.set(Weather::Silent);
                std::thread::sleep(between(300, 3000));
                proxy.set(Weather::Clear);
            }),
            // Longer than a settle's old retry budget (50 + 200 + 800 ms), shorter than the
            // lease less a renewal period: the settles of the handlers that finish meanwhile
            // fail fast and keep trying, their leases held.
            2 => self.fault("store-down", "proxy", || {
                proxy.set(Weather::Down);
                std::thread::sleep(between(1200, LEASE.as_millis() as u64 - 1200));
                proxy.set(Weather::Clear);
            }),
            _ => self.fault("reset-connections", "proxy", || proxy.reset_all()),
        }
    }

    /// A single Redis: pause it, restart it (AOF keeps its data), or make its network slow,
    /// silent, down or reset.
    pub(crate) fn single_redis(&self) {
        let proxy = self.proxy.as_ref().expect("a single Redis runs behind the proxy");
        while !self.stop.load(Ordering::SeqCst) {
            self.rest();
            let mut redis = self.redis.lock().unwrap();
            let server = &mut redis[0];
            let fault = if self.lossy && rand::random::<bool>() { 1 } else { pick(6) };
            match fault {
                0 => self.fault("pause-redis", &server.name, || {
                    server.signal("-STOP");
                    std::thread::sleep(between(300, 4000));
                    server.signal("-CONT");
                }),
                1 => {
                    let mut failed = None;
                    self.fault("restart-redis", &server.name.clone(), || {
                        server.kill();
                        std::thread::sleep(between(100, 1000));
                        failed = server.start().err();
                    });
                    if let Some(error) = failed {
                        self.error(format!("restart-redis: {error}"));
                    }
                }
                network => self.network(proxy, network - 2),
            }
        }
    }

    /// A Cluster, without losing a write: pause a master within the node timeout (no
    /// failover), hand a master's slots to its replica with `CLUSTER FAILOVER` (the replica
    /// catches up first), or kill a replica and start it again. In a lossy run, failovers
    /// that can lose writes instead: a master paused past the node timeout (it takes writes
    /// after it resumes, until it learns of its demotion), or killed.
    pub(crate) fn cluster(&self) {
        while !self.stop.load(Ordering::SeqCst) {
            self.rest();
            let mut nodes = self.redis.lock().unwrap();
            let (masters, replicas): (Vec<usize>, Vec<usize>) =
                (0..nodes.len()).partition(|&i| is_master(nodes[i].port));
            if masters.is_empty() || replicas.is_empty() {
                self.error(format!("masters {masters:?}, replicas {replicas:?}: waiting"));
                drop(nodes);
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
            let master = masters[pick(masters.len())];
            let replica = replicas[pick(replicas.len())];
            let mut failed = None;
            match (self.lossy, pick(3)) {
                (false, 0) => {
                    let node = &nodes[master];
                    self.fault("pause-master", &node.name, || {
                        node.signal("-STOP");
                        // The node timeout is 1 s: no failover.
                        std::thread::sleep(between(200, 700));
                        node.signal("-CONT");
                    });
                }
                (false, 1) => {
                    let node = &nodes[replica];
                    self.fault("manual-failover", &node.name, || {
                        let answer = redis_cli(node.port, &["cluster", "failover"]);
                        if !answer.starts_with("OK") {
                            failed = Some(format!("CLUSTER FAILOVER: {answer}"));
                        }
                        // Promoted once it caught up; wait for it, within bounds.
                        for _ in 0..50 {
                            if is_master(node.port) {
                                break;
                            }
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    });
                }
                (false, _) => {
                    let node = &mut nodes[replica];
                    self.fault("kill-replica", &node.name.clone(), || {
                        node.kill();
                        std::thread::sleep(between(500, 2000));
                        failed = node.start().err().map(|e| e.to_string());
                    });
                }
                (true, 0) => {
                    let node = &nodes[master];
                    self.fault("pause-master-past-timeout", &node.name, || {
                        node.signal("-STOP");
                        std::thread::sleep(between(1500, 3000));
                        node.signal("-CONT");
                    });
                }
                (true, _) => {
                    let node = &mut nodes[master];
                    self.fault("kill-master", &node.name.clone(), || {
                        node.kill();
                        std::thread::sleep(between(2000, 4000));
                        failed = node.start().err().map(|e| e.to_string());
                    });
                }
            }
            if let Some(error) = failed {
                self.error(error);
            }
            // One shard changing at a time: the next fault waits until every slot is served.
            if let Err(error) = wait_for_cluster(&nodes, Duration::from_secs(20)) {
                self.error(error.to_string());
            }
        }
    }

    /// `PostgresStore`: its network slow, silent, down or reset (the proxy), or its connections
    /// terminated by the server (`pg_terminate_backend`). The database itself is the machine's
    /// own server, shared with the system of record: it is neither paused nor restarted.
    pub(crate) fn postgres(&self) {
        let proxy = self.proxy.as_ref().expect("PostgresStore runs behind the proxy");
        let (admin, database) = &self.database;
        while !self.stop.load(Ordering::SeqCst) {
            self.rest();
            match pick(5) {
                network @ 0..=3 => self.network(proxy, network),
                _ => {
                    let mut failed = None;
                    self.fault("terminate-backends", database, || {
                        let sql = format!(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                             WHERE datname = '{database}' AND application_name = 'chaos-store'"
                        );
                        let done = std::process::Command::new("psql")
                            .args([admin.as_str(), "-qAtc", &sql])
                            .stdout(std::process::Stdio::null())
                            .status();
                        if !done.as_ref().is_ok_and(std::process::ExitStatus::success) {
                            failed = Some(format!("psql could not terminate backends: {done:?}"));
                        }
                    });
                    if let Some(error) = failed {
                        self.error(error);
                    }
                }
            }
        }
    }

    pub(crate) fn counts(&self) -> BTreeMap<&'static str, usize> {
        let mut counts = BTreeMap::new();
        for fault in self.faults.lock().unwrap().iter() {
            *counts.entry(fault.kind).or_default() += 1;
        }
        counts
    }
}
