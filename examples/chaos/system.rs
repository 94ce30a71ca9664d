//! The processes of a run, each on a free loopback port and stopped by pid: Redis (one server
//! with AOF, or a Cluster of three masters and three replicas), the service instances and the
//! workers, and a PostgreSQL database of the run's own, dropped at the end.

use std::{
    fs::File,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use axum_idempotency::recovery::BoxError;

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .expect("a free loopback port")
}

/// Sends `signal` (`-STOP`, `-CONT`, `-KILL`) to `pid`.
pub(crate) fn signal(pid: u32, signal: &str) {
    let _ = Command::new("kill").args([signal, &pid.to_string()]).status();
}

/// A child process that can be killed and started again on the same port.
pub(crate) struct Proc {
    pub(crate) name: String,
    pub(crate) port: u16,
    program: PathBuf,
    args: Vec<String>,
    envs: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
    /// The write end of the child's stdin: the child exits when it closes, so that a runner
    /// that dies (Ctrl-C) takes its services with it.
    _stdin: Option<std::process::ChildStdin>,
}

impl Proc {
    pub(crate) fn new(name: &str, port: u16, program: &Path, args: &[String], dir: &Path) -> Self {
        Self {
            name: name.to_owned(),
            port,
            program: program.to_owned(),
            args: args.to_vec(),
            envs: Vec::new(),
            log: dir.join(format!("{name}.log")),
            child: None,
            _stdin: None,
        }
    }

    pub(crate) fn env(mut self, name: &str, value: &str) -> Self {
        self.envs.push((name.to_owned(), value.to_owned()));
        self
    }

    pub(crate) fn log(&self) -> &Path {
        &self.log
    }

    /// Starts the process (its output appended to its log) and waits until its port answers.
    pub(crate) fn start(&mut self) -> Result<(), BoxError> {
        let log = File::options().create(true).append(true).open(&self.log)?;
        let mut child = Command::new(&self.program)
            .args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start {} ({}): {e}", self.name, self.program.display()))?;
        self._stdin = child.stdin.take();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(
                    format!("{} exited ({status}): see {}", self.name, self.log.display()).into()
                );
            }
            if Instant::now() > deadline {
                return Err(format!("{} did not listen within 30 s", self.name).into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub(crate) fn signal(&self, sig: &str) {
        if let Some(pid) = self.pid() {
            signal(pid, sig);
        }
    }

    /// SIGKILL, and reaps the process.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // A stopped process does not die of SIGKILL until it is continued on some systems'
        // tracers; continue it first.
        self.signal("-CONT");
        self.kill();
    }
}

/// A `redis-server`; with `aof`, `appendfsync always`: a restart keeps every acknowledged
/// write. Without, a restart loses every record.
pub(crate) fn redis(name: &str, port: u16, dir: &Path, aof: bool, extra: &[&str]) -> Proc {
    let node_dir = dir.join(name);
    std::fs::create_dir_all(&node_dir).expect("a directory for redis");
    let mut args: Vec<String> = [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        if aof { "yes" } else { "no" },
        "--appendfsync",
        "always",
        "--maxmemory-policy",
        "noeviction",
        "--dir",
        node_dir.to_str().expect("a UTF-8 path"),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    Proc::new(name, port, Path::new("redis-server"), &args, dir)
}

/// Runs `redis-cli -p port args…`, and returns what it printed.
pub(crate) fn redis_cli(port: u16, args: &[&str]) -> String {
    let output = Command::new("redis-cli").args(["-p", &port.to_string()]).args(args).output();
    output.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default()
}

/// Six nodes made into a cluster of three masters with a replica each.
pub(crate) fn cluster(dir: &Path) -> Result<Vec<Proc>, BoxError> {
    let mut nodes = Vec::new();
    for i in 0..6 {
        let port = free_port();
        let mut node = redis(
            &format!("redis-{i}"),
            port,
            dir,
            true,
            &[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "1000",
                "--cluster-require-full-coverage",
                "no",
                "--repl-diskless-sync-delay",
                "0",
            ],
        );
        node.start()?;
        nodes.push(node);
    }
    let addresses: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
    let status = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&addresses)
        .args(["--cluster-replicas", "1", "--cluster-yes"])
        .stdout(Stdio::null())
        .status()?;
    if !status.success() {
        return Err("redis-cli --cluster create failed".into());
    }
    wait_for_cluster(&nodes, Duration::from_secs(30))?;
    Ok(nodes)
}

/// Waits until every live node sees every slot served.
pub(crate) fn wait_for_cluster(nodes: &[Proc], within: Duration) -> Result<(), BoxError> {
    let deadline = Instant::now() + within;
    for node in nodes.iter().filter(|n| n.pid().is_some()) {
        loop {
            let info = redis_cli(node.port, &["cluster", "info"]);
            if info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384") {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("the cluster did not become ok: {info}").into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(())
}

/// Whether the node on `port` is a master now.
pub(crate) fn is_master(port: u16) -> bool {
    redis_cli(port, &["role"]).lines().next() == Some("master")
}

/// A process that, should this one die without cleaning up (Ctrl-C), shuts the Redis servers
/// down and drops the run's database. Services exit by themselves: their stdin closes. A
/// clean end drops it first, so it never touches a port that another program took since.
pub(crate) struct Watchdog(Child);

impl Drop for Watchdog {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn watchdog(ports: &[u16], admin: &str, database: &str) -> std::io::Result<Watchdog> {
    // Each command ends with its own `;`: with no Redis (a PostgreSQL run) there is none.
    let shutdowns: String = ports
        .iter()
        .map(|p| format!("redis-cli -p {p} shutdown nosave >/dev/null 2>&1; "))
        .collect();
    let script = format!(
        "while kill -0 {} 2>/dev/null; do sleep 1; done; {shutdowns}\
         psql '{admin}' -qc 'DROP DATABASE IF EXISTS {database} WITH (FORCE)' >/dev/null 2>&1",
        std::process::id(),
    );
    Command::new("sh").args(["-c", &script]).stdin(Stdio::null()).spawn().map(Watchdog)
}

/// A database of the run's own on the server of `DATABASE_URL`, dropped when this is dropped.
pub(crate) struct Database {
    pub(crate) url: String,
    pub(crate) admin: String,
    pub(crate) name: String,
}

impl Database {
    pub(crate) async fn create(admin: &str, schema: &str) -> Result<Self, BoxError> {
        let name = format!("chaos_{}_{}", std::process::id(), super::service::now_ms());
        let client = connect(admin).await.map_err(|e| {
            format!("the chaos run needs PostgreSQL at DATABASE_URL ({admin}): {e}")
        })?;
        client.batch_execute(&format!("CREATE DATABASE {name}")).await?;
        let url = with_database(admin, &name);
        connect(&url).await?.batch_execute(schema).await?;
        Ok(Self { url, admin: admin.to_owned(), name })
    }

    pub(crate) async fn drop_now(&self) -> Result<(), BoxError> {
        let client = connect(&self.admin).await?;
        client
            .batch_execute(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name))
            .await?;
        Ok(())
    }
}

pub(crate) async fn connect(url: &str) -> Result<tokio_postgres::Client, BoxError> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

/// `url` with its database replaced by `name`.
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url.split_once('?').map_or((url, None), |(b, q)| (b, Some(q)));
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[scheme_end..].find('/').map_or(base.len(), |i| scheme_end + i);
    let mut out = format!("{}/{name}", &base[..path_start]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}
