//! PostgreSQL for the tests: a database of each test's own on the server `DATABASE_URL` names
//! (default `postgres://postgres@127.0.0.1:5432/postgres`, a role that may create databases),
//! dropped when the test ends, and the harness that runs the suites on `PostgresStore`.

use std::sync::atomic::{AtomicUsize, Ordering};

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// A database of the test's own; dropped (its connections with it) when the test ends,
/// whether it passed or not. Fails loudly when no server answers.
pub struct TestDatabase {
    pub admin: tokio_postgres::Config,
    pub name: String,
}

impl TestDatabase {
    /// A new database named `axum_idempotency_{purpose}_{pid}_{n}`; databases of earlier runs
    /// of `purpose` whose process is gone are dropped first.
    pub async fn create(purpose: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
        let admin: tokio_postgres::Config = url.parse().expect("DATABASE_URL is a PostgreSQL URL");
        let prefix = format!("axum_idempotency_{purpose}_");
        let name =
            format!("{prefix}{}_{}", std::process::id(), NEXT.fetch_add(1, Ordering::SeqCst));
        let client = connect(&admin).await.unwrap_or_else(|error| {
            panic!(
                "these tests need PostgreSQL at {url} (DATABASE_URL), a role that may create databases: {error}"
            )
        });
        // Databases of earlier runs that were killed before they could drop theirs.
        let sql = "SELECT datname FROM pg_database WHERE starts_with(datname, $1)";
        for row in client.query(sql, &[&prefix]).await.unwrap() {
            let stale: String = row.get(0);
            let pid = stale.trim_start_matches(&prefix).split('_').next();
            if pid.is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists()) {
                let _ = client
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {stale} WITH (FORCE)"))
                    .await;
            }
        }
        client.batch_execute(&format!("CREATE DATABASE {name}")).await.unwrap();
        Self { admin, name }
    }

    /// The database's connection string (key=value), for a process or a client.
    pub fn url(&self) -> String {
        let password = match self.admin.get_password() {
            Some(password) => format!(" password='{}'", String::from_utf8_lossy(password)),
            None => String::new(),
        };
        format!(
            "host={} port={} user={}{password} dbname={}",
            self.host(),
            self.port(),
            self.user(),
            self.name
        )
    }

    /// The database's connection URL (`postgres://…`), for a process that takes only URLs
    /// (sqlx).
    pub fn uri(&self) -> String {
        let encode = |text: &[u8]| -> String {
            text.iter()
                .map(|&b| {
                    if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                        char::from(b).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect()
        };
        let password = self.admin.get_password().map(|p| format!(":{}", encode(p)));
        format!(
            "postgres://{}{}@{}:{}/{}",
            encode(self.user().as_bytes()),
            password.unwrap_or_default(),
            encode(self.host().as_bytes()),
            self.port(),
            self.name
        )
    }

    /// The database's connection options for a sqlx pool: the server's host, port, user and
    /// password (a fresh Debian install asks TCP clients for one), and the database.
    #[cfg(feature = "postgres")]
    pub fn options(&self) -> axum_idempotency::store::sqlx::postgres::PgConnectOptions {
        self.uri().parse().expect("the database's URL")
    }

    /// The password `DATABASE_URL` gives, if any.
    pub fn password(&self) -> Option<String> {
        self.admin.get_password().map(|password| String::from_utf8_lossy(password).into_owned())
    }

    pub fn host(&self) -> String {
        match &self.admin.get_hosts()[0] {
            tokio_postgres::config::Host::Tcp(host) => host.clone(),
            #[cfg(unix)]
            tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
        }
    }

    pub fn port(&self) -> u16 {
        self.admin.get_ports().first().copied().unwrap_or(5432)
    }

    pub fn user(&self) -> &str {
        self.admin.get_user().unwrap_or("postgres")
    }

    pub async fn client(&self) -> tokio_postgres::Client {
        connect(&self.url().parse().unwrap()).await.unwrap()
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let (admin, name) = (self.admin.clone(), self.name.clone());
        // Drop runs inside the test's runtime: a thread with a runtime of its own does the I/O.
        let dropped = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(
                async move {
                    let client = connect(&admin).await?;
                    client
                        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .await
                },
            )
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) && !std::thread::panicking() {
            panic!("database {} was not dropped: {dropped:?}", self.name);
        }
    }
}

pub async fn connect(
    config: &tokio_postgres::Config,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

#[cfg(feature = "postgres")]
pub use self::store::*;

#[cfg(feature = "postgres")]
mod store {
    use axum_idempotency::store::{
        PostgresStore, RecordKey,
        sqlx::{
            PgPool,
            postgres::{PgConnectOptions, PgPoolOptions},
        },
    };

    use super::TestDatabase;
    use crate::common::{Harness, Held};

    /// `PostgresStore` in a database of the test's own, migrated.
    pub struct PostgresHarness {
        pub database: TestDatabase,
        pub store: PostgresStore,
    }

    impl PostgresHarness {
        /// A pool of its own over the test's database: another instance's.
        pub fn pool(&self) -> PgPool {
            pool_for(&self.database)
        }
    }

    /// A pool over `d` (connections are made when first used).
    pub fn pool_for(d: &TestDatabase) -> PgPool {
        {
            let mut options = PgConnectOptions::new()
                .host(&d.host())
                .port(d.port())
                .username(d.user())
                .database(&d.name);
            if let Some(password) = d.admin.get_password() {
                options = options.password(&String::from_utf8_lossy(password));
            }
            // No ping before each checkout: one round trip a statement, as its docs advise.
            PgPoolOptions::new().test_before_acquire(false).connect_lazy_with(options)
        }
    }

    impl Harness for PostgresHarness {
        type Store = PostgresStore;

        async fn start() -> Self {
            let database = TestDatabase::create("pgstore").await;
            let store = PostgresStore::new(pool_for(&database));
            store.migrate().await.expect("the schema migrates");
            Self { database, store }
        }

        fn store(&self) -> PostgresStore {
            self.store.clone()
        }

        fn second_store(&self) -> PostgresStore {
            PostgresStore::new(self.pool())
        }

        fn store_shared_by_runtimes(&self) -> PostgresStore {
            // sqlx's default: a ping before each checkout finds most connections whose runtime
            // ended, and opens others.
            let options = self.pool().connect_options();
            PostgresStore::new(PgPoolOptions::new().connect_lazy_with((*options).clone()))
        }

        const LENDS_CONNECTIONS_OF_ENDED_RUNTIMES: bool = true;

        async fn held(&self, key: &RecordKey) -> Option<Held> {
            let sql = "SELECT state::text FROM idempotency_records \
                       WHERE key = $1 AND expires_at > clock_timestamp()";
            let row =
                self.database.client().await.query_opt(sql, &[&key.as_str()]).await.unwrap()?;
            Some(match row.get::<_, String>(0).as_str() {
                "P" => Held::InProgress,
                "C" => Held::Completed,
                "X" => Held::Abandoned,
                other => panic!("unknown state {other:?}"),
            })
        }

        async fn record_count(&self) -> usize {
            let sql = "SELECT count(*) FROM idempotency_records WHERE expires_at > clock_timestamp() AND state <> 'F'";
            let count: i64 = self.database.client().await.query_one(sql, &[]).await.unwrap().get(0);
            usize::try_from(count).unwrap()
        }
    }
}

/// A PostgreSQL server of the test's own (`initdb` into a temporary folder, `postgres` on a
/// free loopback port), for the faults that must not touch the shared server: a pause
/// (SIGSTOP to every process of the server) and a crash (SIGKILL, then a start that recovers
/// from the WAL). Run as the `postgres` user when the tests run as root (PostgreSQL refuses
/// root). Stopped by its process group when dropped. Fails loudly when the binaries are
/// missing (`apt-get install postgresql`).
pub struct PrivatePostgres {
    pub port: u16,
    dir: std::path::PathBuf,
    bin: std::path::PathBuf,
    server: Option<std::process::Child>,
}

impl PrivatePostgres {
    pub fn start() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .ok()
            .and_then(|versions| versions.filter_map(Result::ok).map(|v| v.path()).max())
            .map(|version| version.join("bin"))
            .expect("a private PostgreSQL needs its binaries in /usr/lib/postgresql/*/bin (apt-get install postgresql)");
        let dir = std::env::temp_dir().join(format!(
            "axum-idempotency-pg-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let root = std::process::Command::new("id").arg("-u").output().map(|o| o.stdout == b"0\n");
        let server = Self { port: crate::common::free_port(), dir, bin, server: None };
        if root.unwrap_or(false) {
            let owned = std::process::Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&server.dir)
                .status();
            assert!(
                owned.is_ok_and(|s| s.success()),
                "chown of the private PostgreSQL folder failed"
            );
        }
        let initdb = server
            .command("initdb")
            .args(["--auth=trust", "--username=postgres", "--no-sync", "-D"])
            .arg(server.dir.join("data"))
            .stdout(std::process::Stdio::null())
            .status()
            .expect("initdb runs");
        assert!(initdb.success(), "initdb failed");
        let mut server = server;
        server.run();
        server
    }

    /// `program` of the server's binaries, as the `postgres` user when this process is root.
    fn command(&self, program: &str) -> std::process::Command {
        let root =
            std::process::Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout == b"0\n");
        let mut command = if root {
            let mut command = std::process::Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(self.bin.join(program));
            command
        } else {
            std::process::Command::new(self.bin.join(program))
        };
        // A group of its own: a signal to the group reaches every backend.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        command
    }

    /// Starts the server (after a crash, it recovers from its WAL) and waits until it answers.
    pub fn run(&mut self) {
        let child = self
            .command("postgres")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-p", &self.port.to_string(), "-c", "listen_addresses=127.0.0.1", "-k"])
            .arg(&self.dir)
            .stdout(std::process::Stdio::null())
            .stderr(self.log())
            .spawn()
            .expect("postgres starts");
        self.server = Some(child);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let ready = std::process::Command::new(self.bin.join("pg_isready"))
                .args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string()])
                .status();
            if ready.is_ok_and(|s| s.success()) {
                return;
            }
            if std::time::Instant::now() > deadline {
                let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                panic!("the private PostgreSQL did not start; its log ends:\n{}", tail.join("\n"));
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    /// The server's log, appended to across restarts.
    fn log(&self) -> std::fs::File {
        std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.dir.join("server.log"))
            .expect("the private PostgreSQL's log")
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Sends `signal` (`-STOP`, `-CONT`, `-KILL`) to every process of the server: the
    /// postmaster (its pid from `postmaster.pid`), each of its children (not a process group:
    /// every backend calls `setsid()`), and `runuser`, which stops itself when its child stops.
    pub fn signal(&self, signal: &str) {
        let pid_file =
            std::fs::read_to_string(self.dir.join("data/postmaster.pid")).unwrap_or_default();
        let mut pids: Vec<String> = Vec::new();
        if let Some(postmaster) = pid_file.lines().next().filter(|pid| !pid.is_empty()) {
            // The children first, listed while they are still the postmaster's.
            let children = std::process::Command::new("pgrep").args(["-P", postmaster]).output();
            let children = children.map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
            pids.extend(children.unwrap_or_default().split_whitespace().map(str::to_owned));
            pids.push(postmaster.to_owned());
        }
        // Not killed: `runuser` reaps the postmaster it started, and so leaves no zombie
        // whose pid would keep `postmaster.pid` alive for the restart.
        if let Some(server) = self.server.as_ref().filter(|_| signal != "-KILL") {
            pids.push(server.id().to_string());
        }
        if !pids.is_empty() {
            // A backend may exit between the listing and the signal.
            let _ = std::process::Command::new("kill")
                .arg(signal)
                .args(&pids)
                .stderr(std::process::Stdio::null())
                .status();
        }
    }

    /// SIGKILL to every process of the server: a crash.
    pub fn crash(&mut self) {
        self.signal("-CONT");
        self.signal("-KILL");
        if let Some(mut server) = self.server.take() {
            // `runuser` exits once it reaped the postmaster; past a bound, it goes too.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while matches!(server.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let _ = server.kill();
            let _ = server.wait();
        }
        // The backends die with their group; wait until the port is free for the restart.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        // The postmaster is dead: its lock file must not stop the restart.
        let _ = std::fs::remove_file(self.dir.join("data/postmaster.pid"));
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        self.crash();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
