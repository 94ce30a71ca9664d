//! Chaos with a checker: real clients, real processes, faults at random and overlapping, and a
//! checker that reads the whole history afterwards.
//!
//! ```sh
//! cargo run --example chaos --features cluster,postgres                         # 60 s, one Redis (AOF)
//! cargo run --example chaos --features cluster,postgres -- --store cluster      # 60 s, a 3-master Cluster
//! cargo run --example chaos --features cluster,postgres -- --store postgres     # 60 s, PostgresStore
//! cargo run --example chaos --features cluster,postgres -- --seconds 600        # the 10-minute run
//! ```
//!
//! It starts everything on free loopback ports and stops it by pid: Redis (one server with
//! `appendonly yes`, `appendfsync always`, behind a TCP proxy the nemesis controls; or a Cluster
//! of three masters with a replica each; or `PostgresStore`, its connections behind that proxy),
//! three instances of a payments service behind
//! `IdempotencyLayer`, two workers behind `Idempotent`, and a PostgreSQL database of its own on
//! the server at `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`), dropped
//! at the end. The side effect is a row per execution there, with no unique constraint: a double
//! run shows.
//!
//! For `--seconds`, clients create payments and retry them (`clients.rs`), a broker delivers
//! events to the workers at least once, and the nemesis (`nemesis.rs`) kills and restarts
//! instances and workers, pauses workers past their lease, pauses and restarts Redis, makes
//! its network slow, silent or reset, and on a Cluster pauses and kills masters. Then the
//! faults heal, the clients finish the keys they hold, and the checker (`checker.rs`) decides.
//! It prints one table, and exits 1 on any violation, keeping the run's folder with
//! `history.jsonl` (every attempt, answer and fault) and each process's log.
//!
//! `--lossy` runs what GUARANTEES.md says can cost a rerun, to count it: the single Redis without
//! AOF (a restart loses every record), and on both stores only takeovers ask the database. A
//! rerun of a key after such a loss is counted apart, not as a violation.
//!
//! `--unfenced --expect-violations` is the negative control: `--unfenced` wraps the Redis store
//! in one that gives every holder's calls the same owner token (`unfenced.rs`), so no fence
//! tells a lapsed holder from the new owner, and the checker must find the double runs that
//! follow; `--expect-violations` inverts the exit status.

mod checker;
mod clients;
mod nemesis;
mod proxy;
mod service;
mod system;
mod unfenced;

use std::{
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use axum_idempotency::recovery::BoxError;

use crate::{
    checker::Row,
    clients::{History, Targets},
    nemesis::Nemesis,
    system::{Database, Proc, free_port},
};

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

struct Options {
    store: String,
    seconds: u64,
    clients: usize,
    deliveries: usize,
    lossy: bool,
    expect_violations: bool,
    /// The negative control: every holder's store calls carry one owner token.
    unfenced: bool,
    keep: bool,
}

impl Options {
    fn parse(args: &[String]) -> Result<Self, BoxError> {
        let value = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1));
        let store = value("--store").cloned().unwrap_or_else(|| "redis".to_owned());
        if !matches!(store.as_str(), "redis" | "cluster" | "postgres") {
            return Err(format!("--store {store}: redis, cluster or postgres").into());
        }
        if store == "postgres" && args.iter().any(|a| a == "--unfenced") {
            // Its transactional commit is fenced by the context's own token, not the store's.
            return Err("--unfenced runs over Redis (--store redis or cluster)".into());
        }
        Ok(Self {
            store,
            seconds: value("--seconds").map_or(Ok(60), |s| s.parse())?,
            clients: value("--clients").map_or(Ok(24), |s| s.parse())?,
            deliveries: value("--deliveries").map_or(Ok(8), |s| s.parse())?,
            lossy: args.iter().any(|a| a == "--lossy"),
            expect_violations: args.iter().any(|a| a == "--expect-violations"),
            unfenced: args.iter().any(|a| a == "--unfenced"),
            keep: args.iter().any(|a| a == "--keep"),
        })
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("serve") {
        let door = args.get(1).ok_or("serve http|consumer --port N")?;
        let port = args.get(3).ok_or("serve http|consumer --port N")?.parse()?;
        return service::serve(door, port).await;
    }
    let options = Options::parse(&args)?;
    let violations = run(&options).await?;
    let failed = if options.expect_violations { violations == 0 } else { violations > 0 };
    if failed {
        std::process::exit(1);
    }
    Ok(())
}

async fn run(options: &Options) -> Result<usize, BoxError> {
    let dir =
        PathBuf::from("target/chaos").join(format!("{}-{}", options.store, service::now_ms()));
    std::fs::create_dir_all(&dir)?;
    let dir = dir.canonicalize()?;
    let admin = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned());
    let database = Database::create(&admin, service::SCHEMA).await?;
    let outcome = run_in(options, &dir, &database).await;
    if let Err(error) = database.drop_now().await {
        eprintln!("could not drop the run's database: {error}");
    }
    let violations = outcome?;
    if violations == 0 && !options.keep {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        println!("\nthe run's history and logs: {}", dir.display());
    }
    Ok(violations)
}

async fn run_in(
    options: &Options,
    dir: &std::path::Path,
    database: &Database,
) -> Result<usize, BoxError> {
    // The store, and what the services are told to reach it by.
    let (redis, proxy, spec, every_claim) = if options.store == "cluster" {
        let nodes = system::cluster(dir)?;
        let urls: Vec<String> =
            nodes.iter().map(|n| format!("redis://127.0.0.1:{}", n.port)).collect();
        // A failover after a master died can lose its last writes: every claim asks the
        // system of record, as the docs advise for stores that lose records (not when the
        // run is to count what such losses cost).
        (nodes, None, format!("cluster:{}", urls.join(",")), !options.lossy)
    } else if options.store == "postgres" {
        // The store's connections go through the proxy; the system of record's do not.
        let target: tokio_postgres::Config = database.url.parse()?;
        let port = target.get_ports().first().copied().unwrap_or(5432);
        let proxy = proxy::Proxy::start(port).await?;
        let user = target.get_user().unwrap_or("postgres");
        let password = target.get_password().map(|p| format!(":{}", String::from_utf8_lossy(p)));
        let spec = format!(
            "postgres://{user}{}@127.0.0.1:{}/{}?application_name=chaos-store",
            password.unwrap_or_default(),
            proxy.port,
            database.name
        );
        (Vec::new(), Some(proxy), spec, false)
    } else {
        let mut server = system::redis("redis", free_port(), dir, !options.lossy, &[]);
        server.start()?;
        let proxy = proxy::Proxy::start(server.port).await?;
        let spec = format!("redis://127.0.0.1:{}", proxy.port);
        (vec![server], Some(proxy), spec, false)
    };
    let ports: Vec<u16> = redis.iter().map(|r| r.port).collect();
    let _watchdog = system::watchdog(&ports, &database.admin, &database.name)?;
    let exe = std::env::current_exe()?;
    let service = |door: &str, name: String| -> Result<Proc, BoxError> {
        let port = free_port();
        let args = ["serve", door, "--port", &port.to_string()].map(str::to_owned);
        let mut proc = Proc::new(&name, port, &exe, &args, dir)
            .env("CHAOS_STORE", &spec)
            .env("CHAOS_DATABASE_URL", &database.url)
            .env("CHAOS_PROCESS", &name)
            .env("CHAOS_EVERY_CLAIM", if every_claim { "1" } else { "0" })
            .env("CHAOS_UNFENCED", if options.unfenced { "1" } else { "0" });
        proc.start()?;
        Ok(proc)
    };
    let instances =
        (1..=3).map(|i| service("http", format!("instance-{i}"))).collect::<Result<Vec<_>, _>>()?;
    let workers = (1..=2)
        .map(|i| service("consumer", format!("worker-{i}")))
        .collect::<Result<Vec<_>, _>>()?;
    let http = Targets {
        door: "http",
        path: "/payments",
        ports: instances.iter().map(|p| p.port).collect(),
    };
    let consumer = Targets {
        door: "consumer",
        path: "/deliver",
        ports: workers.iter().map(|p| p.port).collect(),
    };

    let stop = Arc::new(AtomicBool::new(false));
    let nemesis = Arc::new(Nemesis {
        instances: Arc::new(Mutex::new(instances)),
        workers: Arc::new(Mutex::new(workers)),
        redis: Arc::new(Mutex::new(redis)),
        proxy,
        stop: stop.clone(),
        lossy: options.lossy,
        database: (database.admin.clone(), database.name.clone()),
        faults: Mutex::default(),
        errors: Mutex::default(),
    });
    let history = Arc::new(History::default());
    let started = Instant::now();
    let mut clients = Vec::new();
    for id in 0..options.clients {
        clients.push(tokio::spawn(clients::client(
            id,
            http.clone(),
            history.clone(),
            stop.clone(),
        )));
    }
    for id in 0..options.deliveries {
        clients.push(tokio::spawn(clients::client(
            id,
            consumer.clone(),
            history.clone(),
            stop.clone(),
        )));
    }
    let threads = [
        std::thread::spawn({
            let nemesis = nemesis.clone();
            move || nemesis.processes()
        }),
        std::thread::spawn({
            let nemesis = nemesis.clone();
            let store = options.store.clone();
            move || match store.as_str() {
                "cluster" => nemesis.cluster(),
                "postgres" => nemesis.postgres(),
                _ => nemesis.single_redis(),
            }
        }),
    ];
    tokio::time::sleep(Duration::from_secs(options.seconds)).await;
    stop.store(true, Ordering::SeqCst);
    let faulted = started.elapsed();
    // The faults heal: each thread ends the fault it is in.
    for thread in threads {
        thread.join().map_err(|_| "a nemesis thread panicked")?;
    }
    history.healed.set(Instant::now()).expect("the faults heal once");
    for client in clients {
        client.await?;
    }
    let drained = started.elapsed() - faulted;
    // A worker that was paused may still commit: let the stragglers land.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let rows = read_rows(&database.url).await?;
    let attempts = history.attempts.lock().unwrap().clone();
    let ends = history.ends.lock().unwrap().clone();
    if ends.iter().any(|end| !end.answered) {
        // A key left unanswered: what held it, while the processes still run.
        let snapshot = database_snapshot(&database.url).await;
        std::fs::write(dir.join("database.txt"), snapshot)?;
    }
    let faults = nemesis.faults.lock().unwrap().clone();
    let mut logs: Vec<PathBuf> = Vec::new();
    for procs in [&nemesis.instances, &nemesis.workers, &nemesis.redis] {
        logs.extend(procs.lock().unwrap().iter().map(|p| p.log().to_owned()));
    }
    let verdict = checker::check(&attempts, &ends, &rows, &faults, &logs, options.lossy);
    write_history(&dir.join("history.jsonl"), &attempts, &faults)?;
    let summary = Summary {
        store: match (options.store.as_str(), options.lossy) {
            ("cluster", false) => {
                "a Redis Cluster (3 masters, 3 replicas, AOF); every claim asks the database"
            }
            ("cluster", true) => {
                "a Redis Cluster (3 masters, 3 replicas); only takeovers ask the database (lossy)"
            }
            ("postgres", _) => {
                "PostgresStore behind a faulty proxy, its connections terminated; takeovers ask the database"
            }
            (_, false) => {
                "one Redis (AOF, appendfsync always) behind a faulty proxy; takeovers ask the database"
            }
            (_, true) => {
                "one Redis without AOF behind a faulty proxy; only takeovers ask the database (lossy)"
            }
        },
        seconds: faulted.as_secs(),
        drained,
        counts: nemesis.counts(),
        errors: nemesis.errors.lock().unwrap().clone(),
    };
    summary.print(&attempts, &ends, &rows, &verdict);
    Ok(verdict.total())
}

async fn read_rows(url: &str) -> Result<Vec<Row>, BoxError> {
    let client = system::connect(url).await?;
    let sql = "SELECT id, door, key, amount, process, started_ms, written_ms FROM executions";
    Ok(client
        .query(sql, &[])
        .await?
        .iter()
        .map(|r| Row {
            id: r.get(0),
            door: r.get(1),
            key: r.get(2),
            amount: r.get(3),
            process: r.get(4),
            started_ms: r.get(5),
            written_ms: r.get(6),
        })
        .collect())
}

/// The records still in progress (PostgresStore's table) and every session of the run's
/// database with its transaction and what it waits for: what a key left unanswered waited on.
async fn database_snapshot(url: &str) -> String {
    let queries = [
        "SELECT key, state, encode(owner, 'hex'), lease_until - clock_timestamp(), \
         expires_at - clock_timestamp(), waited FROM idempotency_records WHERE state <> 'C'",
        "SELECT pid, application_name, state, clock_timestamp() - xact_start, \
         clock_timestamp() - state_change, wait_event_type, wait_event, left(query, 300) \
         FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
        "SELECT l.pid, l.locktype, l.mode, l.granted, c.relname FROM pg_locks l \
         LEFT JOIN pg_class c ON c.oid = l.relation WHERE l.pid <> pg_backend_pid()",
    ];
    let client = match system::connect(url).await {
        Ok(client) => client,
        Err(error) => return format!("no connection: {error}\n"),
    };
    let mut snapshot = String::new();
    for sql in queries {
        snapshot.push_str(&format!("-- {sql}\n"));
        match client.simple_query(sql).await {
            Ok(messages) => {
                for message in messages {
                    if let tokio_postgres::SimpleQueryMessage::Row(row) = message {
                        let columns = (0..row.len()).map(|i| row.get(i).unwrap_or("NULL"));
                        snapshot.push_str(&columns.collect::<Vec<_>>().join(" | "));
                        snapshot.push('\n');
                    }
                }
            }
            Err(error) => snapshot.push_str(&format!("failed: {error}\n")),
        }
    }
    snapshot
}

fn write_history(
    path: &std::path::Path,
    attempts: &[clients::Attempt],
    faults: &[nemesis::Fault],
) -> Result<(), BoxError> {
    use std::io::Write as _;
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    for fault in faults {
        writeln!(file, "{}", serde_json::json!({ "fault": fault }))?;
    }
    for attempt in attempts {
        writeln!(file, "{}", serde_json::json!({ "attempt": attempt }))?;
    }
    file.flush()?;
    Ok(())
}

struct Summary {
    store: &'static str,
    seconds: u64,
    drained: Duration,
    counts: std::collections::BTreeMap<&'static str, usize>,
    errors: Vec<String>,
}

impl Summary {
    fn print(
        &self,
        attempts: &[clients::Attempt],
        ends: &[clients::KeyEnd],
        rows: &[Row],
        verdict: &checker::Verdict,
    ) {
        println!("\n## Chaos run: {}\n", self.store);
        println!(
            "{} s of faults; then the faults healed and the clients finished their keys in {:.1} s\n",
            self.seconds,
            self.drained.as_secs_f64()
        );
        println!("| faults injected | count |\n|---|---:|");
        for (kind, count) in &self.counts {
            println!("| {kind} | {count} |");
        }
        let total: usize = self.counts.values().sum();
        println!("| **all** | **{total}** |\n");

        println!(
            "| door | keys | attempts | executions | 2xx answer | 202 | 409 | 503 | other status | no answer (timeout, refused, reset) |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for door in ["http", "consumer"] {
            let of_door: Vec<_> = attempts.iter().filter(|a| a.door == door).collect();
            let status = |pick: &dyn Fn(u16) -> bool| {
                of_door.iter().filter(|a| a.status.is_some_and(pick)).count()
            };
            println!(
                "| {door} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                ends.iter().filter(|e| e.door == door).count(),
                of_door.len(),
                rows.iter().filter(|r| r.door == door).count(),
                status(&clients::is_answer),
                status(&|s| s == 202),
                status(&|s| s == 409),
                status(&|s| s == 503),
                status(&|s| !clients::is_answer(s) && !matches!(s, 202 | 409 | 503)),
                of_door.iter().filter(|a| a.status.is_none()).count(),
            );
        }
        println!("\n| check | violations |\n|---|---:|");
        for (check, found) in &verdict.violations {
            println!("| {check} | {} |", found.len());
        }
        println!(
            "| (not a violation) reruns of a worker paused past its lease, which GUARANTEES.md allows: at most once per lease | {} |",
            verdict.lease_reruns.len()
        );
        println!(
            "| (not a violation) reruns after Redis lost records (a restart without AOF, a failover), which GUARANTEES.md allows without `Recovery::every_claim` | {} |",
            verdict.loss_reruns.len()
        );
        for (check, found) in &verdict.violations {
            for what in found.iter().take(20) {
                println!("violation: {check}: {what}");
            }
        }
        for what in &verdict.lease_reruns {
            println!("lease rerun: {what}");
        }
        for what in &verdict.loss_reruns {
            println!("rerun after a loss: {what}");
        }
        for error in &self.errors {
            println!("nemesis error: {error}");
        }
        println!("\nviolations: {}", verdict.total());
    }
}
