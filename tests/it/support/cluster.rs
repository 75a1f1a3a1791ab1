//! A Postgres cluster of a test's own (`pg_createcluster`), for what must
//! not touch the shared server: crashing it, restoring a dump into it,
//! replicating it to a standby (`pg_basebackup -R`) and failing over.
//! Trust auth on 127.0.0.1; stopped and dropped when the value is dropped.

use std::process::Command;

pub struct TempCluster {
    version: String,
    name: String,
    pub port: u16,
}

fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl TempCluster {
    /// A new running cluster, or `None` (after a loud note) where this
    /// machine cannot make one and Postgres is not required.
    pub fn create() -> Option<Self> {
        match Self::try_create() {
            Ok(cluster) => Some(cluster),
            Err(e) if std::env::var_os(super::REQUIRE_POSTGRES_VAR).is_some() => {
                panic!("cannot create a Postgres cluster for this test: {e}")
            }
            Err(e) => {
                eprintln!("SKIPPING a test that needs its own Postgres cluster: {e}");
                None
            }
        }
    }

    fn try_create() -> Result<Self, String> {
        let cluster = Self::try_make()?;
        cluster.ctl(&["start"])?;
        Ok(cluster)
    }

    /// A streaming standby of `primary` (`pg_basebackup -R`), running.
    pub fn standby_of(primary: &TempCluster) -> Self {
        let standby = Self::try_make().expect("make the standby's cluster");
        let data = format!("/var/lib/postgresql/{}/{}", standby.version, standby.name);
        run("sh", &["-c", &format!("rm -rf {data}/*")])
            .expect("empty the standby's data directory");
        let port = primary.port.to_string();
        run(
            "runuser",
            &[
                "-u",
                "postgres",
                "--",
                "pg_basebackup",
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-D",
                &data,
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
            ],
        )
        .expect("pg_basebackup");
        standby.ctl(&["start"]).expect("start the standby");
        standby
    }

    /// `pg_ctl ACTION ARGS` (start, stop -m immediate, promote, restart),
    /// waiting for it to finish, on the cluster's configuration directory
    /// (pg_ctl finds the data directory from it): what `pg_ctlcluster` does,
    /// without the two seconds it adds to every start. A failure says the
    /// end of the server's log.
    pub fn ctl(&self, action: &[&str]) -> Result<(), String> {
        // The configuration's socket directory, as `pg_ctlcluster` makes it.
        run(
            "install",
            &[
                "-d",
                "-o",
                "postgres",
                "-g",
                "postgres",
                "-m",
                "2775",
                "/var/run/postgresql",
            ],
        )?;
        let pg_ctl = format!("/usr/lib/postgresql/{}/bin/pg_ctl", self.version);
        let config = format!("/etc/postgresql/{}/{}", self.version, self.name);
        let log = format!(
            "/var/log/postgresql/postgresql-{}-{}.log",
            self.version, self.name
        );
        let mut args = vec![
            "-u", "postgres", "--", &pg_ctl, "-D", &config, "-l", &log, "-w",
        ];
        args.extend_from_slice(action);
        run("runuser", &args).map_err(|e| {
            let said = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = said.lines().rev().take(10).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            format!("{e}\n{log}:\n{}", tail.join("\n"))
        })
    }

    /// Runs `sql` as the superuser in `postgres`; its output, trimmed.
    pub fn psql(&self, sql: &str) -> String {
        self.psql_in("postgres", sql)
    }

    /// Runs `sql` as the superuser in `database`; its output, trimmed.
    #[track_caller]
    pub fn psql_in(&self, database: &str, sql: &str) -> String {
        self.try_psql_in(database, sql)
            .unwrap_or_else(|e| panic!("psql {sql}: {e}"))
    }

    /// [`TempCluster::psql_in`], or what stopped it (say, a server still
    /// restarting its recovery).
    pub fn try_psql_in(&self, database: &str, sql: &str) -> Result<String, String> {
        let port = self.port.to_string();
        let out = Command::new("psql")
            .args(["-h", "127.0.0.1", "-p", &port, "-U", "postgres"])
            .args(["-d", database, "-qAtc", sql])
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// SIGSTOPs this standby's WAL receiver until the value is dropped: the
    /// standby stays connected but takes no more WAL, so a commit that
    /// waits for it waits.
    pub fn pause_wal_receiver(&self) -> Paused {
        let pattern = format!("{}/{}: walreceiver", self.version, self.name);
        let out = Command::new("pgrep")
            .args(["-f", &pattern])
            .output()
            .expect("run pgrep");
        let pid = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        assert!(
            !pid.is_empty() && !pid.contains('\n'),
            "one walreceiver: {pid:?}"
        );
        run("kill", &["-STOP", &pid]).expect("SIGSTOP the walreceiver");
        Paused { pid }
    }

    /// Made, not started.
    fn try_make() -> Result<Self, String> {
        let version = std::fs::read_dir("/etc/postgresql")
            .map_err(|e| format!("no /etc/postgresql: {e}"))?
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .max()
            .ok_or("no Postgres version installed")?;
        let port = super::process::free_port();
        let name = format!(
            "pi_{}_{:06x}",
            std::process::id(),
            rand::random::<u32>() & 0xff_ffff
        );
        let port_text = port.to_string();
        run(
            "pg_createcluster",
            &[
                &version,
                &name,
                "-p",
                &port_text,
                "--",
                "--auth-host=trust",
                "--auth-local=trust",
            ],
        )?;
        Ok(Self {
            version,
            name,
            port,
        })
    }

    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Crashes the server (`restart -m immediate`: no checkpoint, every
    /// session cut) and waits until it accepts connections again.
    pub fn restart_immediate(&self) {
        self.ctl(&["restart", "-m", "immediate"])
            .expect("restart the cluster");
    }
}

/// A process held with SIGSTOP; SIGCONT when dropped.
pub struct Paused {
    pid: String,
}

impl Paused {
    /// SIGKILL instead: what it had received but not yet written (a WAL
    /// receiver's socket buffer) is gone with it, as with a cut link.
    pub fn kill(self) {
        run("kill", &["-KILL", &self.pid]).expect("SIGKILL");
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        let _ = run("kill", &["-CONT", &self.pid]);
    }
}

impl Drop for TempCluster {
    fn drop(&mut self) {
        if let Err(e) = run("pg_dropcluster", &["--stop", &self.version, &self.name]) {
            eprintln!("could not drop the test cluster {}: {e}", self.name);
        }
    }
}
