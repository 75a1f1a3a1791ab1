//! A real PgBouncer in transaction mode between one instance and the
//! soak's database, as operators run it. Started as `postgres` when the
//! soak runs as root (PgBouncer refuses root), stopped by its pid.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

pub struct PgBouncer {
    /// Its own directory (owned by `postgres` when it runs as that user).
    dir: tempfile::TempDir,
    pub port: u16,
}

impl PgBouncer {
    /// PgBouncer for `database` on the Postgres at `upstream`
    /// (`host:port`), listening on a free port.
    pub fn start(upstream: &str, database: &str) -> Result<Self, String> {
        if Command::new("pgbouncer").arg("--version").output().is_err() {
            return Err(
                "pgbouncer is not installed (apt-get install pgbouncer), or pass --no-pgbouncer"
                    .to_owned(),
            );
        }
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?
            .port();
        let (host, pg_port) = upstream.rsplit_once(':').unwrap_or((upstream, "5432"));
        let bouncer = Self { dir, port };
        std::fs::write(bouncer.path("users.txt"), "\"postgres\" \"\"\n")
            .map_err(|e| e.to_string())?;
        std::fs::write(
            bouncer.path("pgbouncer.ini"),
            format!(
                "[databases]\n{database} = host={host} port={pg_port} dbname={database}\n\n\
                 [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {users}\npool_mode = transaction\n\
                 max_client_conn = 400\ndefault_pool_size = 20\nserver_login_retry = 1\n\
                 pidfile = {pid}\nlogfile = {log}\n",
                users = bouncer.path("users.txt").display(),
                pid = bouncer.path("pgbouncer.pid").display(),
                log = bouncer.path("pgbouncer.log").display(),
            ),
        )
        .map_err(|e| e.to_string())?;
        if as_root() {
            let owned = Command::new("chown")
                .args(["-R", "postgres"])
                .arg(bouncer.dir.path())
                .status()
                .map_err(|e| e.to_string())?;
            if !owned.success() {
                return Err(format!(
                    "chown postgres {}: {owned}",
                    bouncer.dir.path().display()
                ));
            }
        }
        bouncer.run()?;
        Ok(bouncer)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn run(&self) -> Result<(), String> {
        let _ = std::fs::remove_file(self.path("pgbouncer.pid"));
        let mut command = Command::new("pgbouncer");
        command.arg("-d");
        if as_root() {
            command.args(["-u", "postgres"]);
        }
        let started = command
            .arg(self.path("pgbouncer.ini"))
            .status()
            .map_err(|e| e.to_string())?;
        if !started.success() {
            return Err(format!(
                "pgbouncer did not start ({started}); its log: {}",
                self.path("pgbouncer.log").display()
            ));
        }
        for _ in 0..500 {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(format!("pgbouncer does not listen on {}", self.port))
    }

    fn pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.path("pgbouncer.pid"))
            .ok()
            .and_then(|pid| pid.trim().parse().ok())
    }

    /// kill -9: every connection through it cut at once; then a new
    /// PgBouncer on the same port.
    pub fn kill_9_and_restart(&self) -> Result<(), String> {
        self.kill();
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
            if std::time::Instant::now() >= until {
                return Err(format!(
                    "the killed pgbouncer still listens on {}",
                    self.port
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.run()
    }

    fn kill(&self) {
        if let Some(pid) = self.pid() {
            // SAFETY: kill(2) on the pid PgBouncer wrote for itself.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn as_root() -> bool {
    // SAFETY: geteuid(2) cannot fail.
    unsafe { libc::geteuid() == 0 }
}
