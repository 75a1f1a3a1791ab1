//! A real PgBouncer in transaction mode, in front of the shared Postgres,
//! and a database of the test's own behind it (dropped at the end).
//! Started as `postgres` (PgBouncer refuses root), stopped by its pid.

use std::path::PathBuf;
use std::process::Command;

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};

pub struct PgBouncer {
    dir: tempfile::TempDir,
    pub port: u16,
    pub database: String,
    /// The scratch database it made on the shared Postgres, dropped with it.
    owns_database: bool,
}

impl PgBouncer {
    /// A scratch database, migrated directly, and a PgBouncer for it; `None`
    /// (after a loud note) where PgBouncer is missing and Postgres is not
    /// required.
    pub fn start() -> Option<Self> {
        if !super::postgres_available() {
            return None;
        }
        if Command::new("pgbouncer").arg("--version").output().is_err() {
            if std::env::var_os(super::REQUIRE_POSTGRES_VAR).is_some() {
                panic!("pgbouncer is not installed (apt-get install pgbouncer)");
            }
            eprintln!("SKIPPING a PgBouncer test: pgbouncer is not installed");
            return None;
        }
        let database = format!(
            "it_pgb_{}_{:06x}",
            std::process::id(),
            rand::random::<u32>() & 0xff_ffff
        );
        let mut admin = PgConnection::establish(&super::postgres_base_url()).expect("connect");
        admin
            .batch_execute(&format!("CREATE DATABASE {database}"))
            .expect("create the scratch database");
        let (host, pg_port) = super::postgres_host_port();
        Some(Self::launch(&host, pg_port, database, true))
    }

    /// A PgBouncer in transaction mode for `database` on the Postgres at
    /// 127.0.0.1:`pg_port` (a cluster of the test's own), which it leaves
    /// in place.
    pub fn in_front_of(pg_port: u16, database: &str) -> Self {
        Self::launch("127.0.0.1", pg_port, database.to_owned(), false)
    }

    fn launch(host: &str, pg_port: u16, database: String, owns_database: bool) -> Self {
        let dir = tempfile::tempdir().expect("dir");
        let port = super::process::free_port();
        let bouncer = Self {
            dir,
            port,
            database,
            owns_database,
        };
        std::fs::write(bouncer.path("users.txt"), "\"postgres\" \"\"\n").expect("users file");
        std::fs::write(
            bouncer.path("pgbouncer.ini"),
            format!(
                "[databases]\n{db} = host={host} port={pg_port} dbname={db}\n\n\
                 [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {users}\npool_mode = transaction\n\
                 max_client_conn = 400\ndefault_pool_size = 20\nserver_login_retry = 1\n\
                 pidfile = {pid}\nlogfile = {log}\n",
                db = bouncer.database,
                users = bouncer.path("users.txt").display(),
                pid = bouncer.path("pgbouncer.pid").display(),
                log = bouncer.path("pgbouncer.log").display(),
            ),
        )
        .expect("ini");
        Command::new("chown")
            .args(["-R", "postgres", &bouncer.dir.path().display().to_string()])
            .status()
            .expect("chown");
        bouncer.run();
        bouncer
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn run(&self) {
        let _ = std::fs::remove_file(self.path("pgbouncer.pid"));
        let started = Command::new("pgbouncer")
            .args(["-d", "-u", "postgres"])
            .arg(self.path("pgbouncer.ini"))
            .status()
            .expect("start pgbouncer");
        assert!(started.success(), "pgbouncer did not start");
        for _ in 0..500 {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("pgbouncer does not listen on {}", self.port);
    }

    fn pid(&self) -> Option<String> {
        std::fs::read_to_string(self.path("pgbouncer.pid"))
            .ok()
            .map(|pid| pid.trim().to_owned())
    }

    /// The scratch database through PgBouncer.
    pub fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{}",
            self.port, self.database
        )
    }

    /// The scratch database straight to Postgres (migrations, checks).
    pub fn direct_url(&self) -> String {
        super::postgres_url_for(&self.database)
    }

    /// SIGKILL: every client and server connection cut at once; then a new
    /// PgBouncer on the same port.
    pub fn kill_9_and_restart(&self) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
        }
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        self.run();
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
        }
        if !self.owns_database {
            return;
        }
        if let Ok(mut admin) = PgConnection::establish(&super::postgres_base_url()) {
            let _ = admin.batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.database
            ));
        }
    }
}
