//! What the soak runs: a Postgres database of its own (or a SQLite file), made by the real
//! migrations, its logins made by the real CLI, and the service instances
//! on sockets the soak holds and hands to each start (socket activation:
//! a restart comes back where callers look for it, refusing nothing).

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub struct System {
    bin: PathBuf,
    /// Postgres: the server's admin URL and the soak's database on it;
    /// `None`: a SQLite file in `dir`.
    postgres: Option<(String, String)>,
    pub database_url: String,
    dir: tempfile::TempDir,
    ports: Vec<u16>,
    /// Each instance's listening socket, held by the soak as systemd's
    /// `plan-intake.socket` holds it: handed to every start of the
    /// instance, so a restart refuses no connection (they wait in its
    /// backlog).
    sockets: Vec<std::net::TcpListener>,
    instances: Mutex<Vec<Option<Child>>>,
    /// Each planner's current token (`logins rotate` replaces it).
    pub planner_tokens: Mutex<Vec<String>>,
    pub reader_token: String,
    /// The signing keys every instance starts with (the first signs; a
    /// rotation adds one), and the public keys of every key that ever
    /// signed, one per line (pinned by the verifying reader
    /// and `audit`).
    signing_keys: Mutex<Vec<PathBuf>>,
    pub keys: PathBuf,
    /// More environment for every process the soak starts.
    pub env: Vec<(String, String)>,
    pub readers: Vec<crate::readers::Reader>,
    /// Postgres: each instance's fault proxy, and the URL it connects to
    /// the database through.
    pub proxies: Vec<(crate::proxy::FaultProxy, String)>,
    /// Postgres with `pgbouncer`: the last instance's PgBouncer (transaction
    /// mode), between its fault proxy and the database.
    pub pgbouncer: Option<crate::pgbouncer::PgBouncer>,
    /// Instances that ended otherwise than the nemesis ended them.
    crashes: Mutex<Vec<String>>,
    /// The primary and its synchronous standby, when the soak made its
    /// own (dropped last: after the database on it).
    pub pair: Option<crate::cluster::Pair>,
}

impl System {
    pub fn start(
        bin: &Path,
        database: &crate::Database,
        instances: usize,
        seed: u64,
        planners: usize,
        env: &[(String, String)],
        pgbouncer: bool,
    ) -> Result<Self, String> {
        if !bin.exists() {
            return Err(format!(
                "{} is not there: build it first (cargo build)",
                bin.display()
            ));
        }
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let pair = match database {
            crate::Database::Replicated => Some(crate::cluster::Pair::create(false)?),
            crate::Database::ReplicatedLossy => Some(crate::cluster::Pair::create(true)?),
            _ => None,
        };
        let server = match database {
            crate::Database::Sqlite => None,
            crate::Database::Server(url) => Some(url.clone()),
            crate::Database::Replicated | crate::Database::ReplicatedLossy => {
                pair.as_ref().map(crate::cluster::Pair::server_url)
            }
        };
        let (postgres, database_url) = match server.as_deref() {
            Some(server) => {
                let database = format!(
                    "soak_{}_{}_{:04x}",
                    std::process::id(),
                    seed % 1_000_000,
                    rand::random::<u16>()
                );
                let admin_url = format!("{server}/postgres");
                psql(&admin_url, &format!("CREATE DATABASE {database}"))?;
                let url = format!("{server}/{database}");
                (Some((admin_url, database)), url)
            }
            None => (
                None,
                format!("sqlite://{}", dir.path().join("soak.db").display()),
            ),
        };
        let sockets = (0..instances)
            .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let ports = sockets
            .iter()
            .map(|l| l.local_addr().map(|a| a.port()).map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()?;
        let mut system = Self {
            bin: bin.to_owned(),
            postgres,
            database_url,
            dir,
            ports,
            sockets,
            instances: Mutex::new((0..instances).map(|_| None).collect()),
            planner_tokens: Mutex::new(Vec::new()),
            reader_token: String::new(),
            signing_keys: Mutex::new(Vec::new()),
            keys: PathBuf::new(),
            env: env.to_vec(),
            readers: Vec::new(),
            proxies: Vec::new(),
            pgbouncer: None,
            crashes: Mutex::new(Vec::new()),
            pair,
        };
        if let Some((_, database)) = &system.postgres {
            let upstream = host_port(&system.database_url)?;
            let user = system
                .database_url
                .split_once("://")
                .and_then(|(_, rest)| rest.split_once('@'))
                .map_or("postgres", |(user, _)| user);
            if pgbouncer && instances >= 2 {
                system.pgbouncer = Some(crate::pgbouncer::PgBouncer::start(&upstream, database)?);
            }
            for i in 0..instances {
                let behind_pgbouncer = system
                    .pgbouncer
                    .as_ref()
                    .filter(|_| i == instances - 1)
                    .map(|bouncer| format!("127.0.0.1:{}", bouncer.port));
                let proxy = crate::proxy::FaultProxy::start(
                    behind_pgbouncer.unwrap_or_else(|| upstream.clone()),
                )?;
                let url = format!(
                    "postgres://{user}@127.0.0.1:{}/{database}?sslmode=disable&gssencmode=disable",
                    proxy.port
                );
                system.proxies.push((proxy, url));
            }
        }
        system.cli(&["migrate", "run"])?;
        if system
            .env
            .iter()
            .any(|(k, _)| k == "PLAN_INTAKE_TEST_DEFECT_NO_HORIZON_LOCK")
        {
            // A known defect for the checker to find: the write as before
            // migration 000016, taking no lock on `plans` of its own (its
            // feed's horizon not held while a batch's key row waits), and
            // every plan of a batch written by it, as before 000019.
            psql(
                &system.database_url,
                "DO $$ BEGIN EXECUTE replace(pg_get_functiondef('plan_intake_write'::regproc), \
                 'LOCK TABLE plans IN ROW EXCLUSIVE MODE;', ''); END $$",
            )?;
            psql(&system.database_url, ONE_BY_ONE_BATCH)?;
        }
        for p in 0..planners {
            let token = system.cli(&[
                "logins",
                "add",
                &format!("planner-{p}"),
                "--permission",
                "plans:submit",
            ])?;
            if let Ok(mut tokens) = system.planner_tokens.lock() {
                tokens.push(token);
            }
        }
        let key = system.dir.path().join("receipts.key");
        system.cli(&[
            "signing-keys",
            "generate",
            "--out",
            &key.display().to_string(),
        ])?;
        system.keys = system.dir.path().join("keys.pub");
        std::fs::copy(key.with_extension("key.pub"), &system.keys).map_err(|e| e.to_string())?;
        if let Ok(mut keys) = system.signing_keys.lock() {
            keys.push(key);
        }
        system.reader_token =
            system.cli(&["logins", "add", "orders", "--permission", "receipts:read"])?;
        for i in 0..instances {
            system.start_instance(i)?;
        }
        system.readers = crate::readers::Reader::all(system.dir.path(), &system.keys);
        for reader in &system.readers {
            reader.start(
                &system.bin,
                &system.urls(),
                &system.reader_token,
                &system.env,
            )?;
        }
        Ok(system)
    }

    /// Runs the CLI against the database: its stdout, trimmed.
    pub fn cli(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new(&self.bin)
            .args(args)
            .env("DATABASE_URL", &self.database_url)
            .env("PLAN_INTAKE_LOG", "warn")
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "plan-intake {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    pub fn count(&self) -> usize {
        self.ports.len()
    }

    pub fn url(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.ports[i])
    }

    pub fn urls(&self) -> Vec<String> {
        (0..self.count()).map(|i| self.url(i)).collect()
    }

    /// Planner `p`'s current token.
    pub fn planner_token(&self, p: usize) -> String {
        self.planner_tokens
            .lock()
            .map(|tokens| tokens[p].clone())
            .unwrap_or_default()
    }

    /// `logins rotate` of planner `p`'s login while it sends: the new
    /// token is used from now on; requests in flight with the old one are
    /// still taken (its grace period).
    pub fn rotate_planner(&self, p: usize) -> Result<(), String> {
        let token = self.cli(&["logins", "rotate", &format!("planner-{p}")])?;
        if let Ok(mut tokens) = self.planner_tokens.lock() {
            tokens[p] = token;
        }
        Ok(())
    }

    /// A signing-key rotation in the documented order (OPERATIONS, "Rotate
    /// the signing key"): a new key; its `.pub` beside the old ones for
    /// the verifying reader, restarted; each instance restarted with the
    /// new key first and the old one after; then each with the new one
    /// alone. `n` names the new key's file.
    pub fn rotate_signing_key(&self, n: u32) -> Result<(), String> {
        let key = self.dir.path().join(format!("receipts-{n}.key"));
        self.cli(&[
            "signing-keys",
            "generate",
            "--out",
            &key.display().to_string(),
        ])?;
        let public =
            std::fs::read_to_string(key.with_extension("key.pub")).map_err(|e| e.to_string())?;
        let mut pinned = std::fs::read_to_string(&self.keys).map_err(|e| e.to_string())?;
        if !pinned.ends_with('\n') {
            pinned.push('\n');
        }
        pinned.push_str(public.trim());
        pinned.push('\n');
        std::fs::write(&self.keys, pinned).map_err(|e| e.to_string())?;
        for reader in self.readers.iter().filter(|r| r.verifies()) {
            reader.restart(&self.bin, &self.urls(), &self.reader_token, &self.env)?;
        }
        let old = self
            .signing_keys
            .lock()
            .map(|keys| keys.first().cloned())
            .ok()
            .flatten()
            .ok_or("no signing key")?;
        for keys in [vec![key.clone(), old], vec![key]] {
            if let Ok(mut signing) = self.signing_keys.lock() {
                *signing = keys;
            }
            for i in 0..self.count() {
                self.restart(i)?;
            }
        }
        Ok(())
    }

    /// kill -9 of reader `r`, then started again.
    pub fn kill_reader(&self, r: usize) -> Result<(), String> {
        self.readers[r].kill_9(&self.bin, &self.urls(), &self.reader_token, &self.env)
    }

    /// Readers that ended on their own are noted and started again.
    pub fn keep_readers_running(&self) -> Result<(), String> {
        for reader in &self.readers {
            if reader.ended_on_its_own() {
                reader.start(&self.bin, &self.urls(), &self.reader_token, &self.env)?;
            }
        }
        Ok(())
    }

    /// Every reader stopped (SIGTERM) and drained to the feed's end.
    pub fn finish_readers(&self) {
        let stored = || {
            self.query("SELECT count(*) FROM plans")
                .ok()
                .and_then(|rows| rows.first().and_then(|n| n.parse::<usize>().ok()))
        };
        for reader in &self.readers {
            reader.finish(
                &self.bin,
                &self.urls(),
                &self.reader_token,
                &self.env,
                stored,
            );
        }
    }

    /// Calls `each` with every request line the instances logged (JSON,
    /// its instance added), across restarts, one at a time: a long run
    /// logs millions.
    pub fn each_request_line(&self, mut each: impl FnMut(&serde_json::Value)) {
        self.each_log_line(|event| {
            if event["message"] == "request" {
                each(event);
            }
        });
    }

    /// Calls `each` with every line the instances logged as JSON (its
    /// instance added).
    pub fn each_log_line(&self, mut each: impl FnMut(&serde_json::Value)) {
        use std::io::BufRead as _;
        for i in 0..self.count() {
            let Ok(file) = std::fs::File::open(self.dir.path().join(format!("instance-{i}.log")))
            else {
                continue;
            };
            for line in std::io::BufReader::new(file).lines().map_while(Result::ok) {
                if let Ok(mut event) = serde_json::from_str::<serde_json::Value>(&line) {
                    event["instance"] = serde_json::json!(i);
                    each(&event);
                }
            }
        }
    }

    /// Every line an instance wrote that tells of a panic (a panic's
    /// message is plain text, not one of its JSON lines).
    pub fn panics(&self) -> Vec<String> {
        let mut panics = Vec::new();
        for i in 0..self.count() {
            let text = std::fs::read_to_string(self.dir.path().join(format!("instance-{i}.log")))
                .unwrap_or_default();
            panics.extend(
                text.lines()
                    .filter(|line| line.contains("panicked at"))
                    .map(|line| format!("instance {i}: {line}")),
            );
        }
        panics
    }

    /// Runs the CLI: its exit code and stderr (for `audit`, `verify`,
    /// `keys prune`, `migrate run` while the system runs).
    pub fn cli_status(&self, args: &[&str]) -> (Option<i32>, String) {
        match Command::new(&self.bin)
            .args(args)
            .env("DATABASE_URL", &self.database_url)
            .env("PLAN_INTAKE_LOG", "warn")
            .stdout(Stdio::null())
            .output()
        {
            Ok(out) => (
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            ),
            Err(e) => (None, e.to_string()),
        }
    }

    fn start_instance(&self, i: usize) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("instance-{i}.log")))
            .map_err(|e| e.to_string())?;
        // Socket activation, as systemd does it: the socket as descriptor
        // 3, LISTEN_FDS=1 and LISTEN_PID the service's own pid (set by the
        // shell that execs it).
        let mut command = Command::new("sh");
        command
            .args(["-c", r#"LISTEN_PID=$$ LISTEN_FDS=1 exec "$0" serve "$@""#])
            .arg(&self.bin)
            .args(
                self.signing_keys
                    .lock()
                    .map(|keys| keys.clone())
                    .unwrap_or_default()
                    .iter()
                    .flat_map(|key| [PathBuf::from("--signing-key"), key.clone()]),
            )
            .args(["--log-format", "json"])
            .env(
                "DATABASE_URL",
                self.proxies
                    .get(i)
                    .map_or(&self.database_url, |(_, url)| url),
            )
            // Every request line (its status and Retry-After), for the checker.
            .env("PLAN_INTAKE_LOG", "warn,plan_intake::http::observe=info")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log);
        if self.pgbouncer.is_some() && i == self.count() - 1 {
            // As operators run an instance behind a transaction-mode
            // pooler: no migrations through it, the feed's LISTEN straight
            // to the database.
            command
                .args(["--no-migrate", "--pg-pooler", "transaction"])
                .env("PLAN_INTAKE_FEED_LISTEN_URL", &self.database_url);
        }
        let fd = {
            use std::os::fd::AsRawFd as _;
            self.sockets[i].as_raw_fd()
        };
        // SAFETY: only async-signal-safe calls (prctl, fcntl, dup2) on
        // descriptors this process owns, between fork and exec: an instance
        // dies with the soak, whatever ends it, and gets its socket as 3.
        unsafe {
            use std::os::unix::process::CommandExt as _;
            command.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if fd == 3 {
                    // dup2 onto itself keeps close-on-exec: clear it.
                    if libc::fcntl(3, libc::F_SETFD, 0) == -1 {
                        return Err(std::io::Error::last_os_error());
                    }
                } else if libc::dup2(fd, 3) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().map_err(|e| e.to_string())?;
        if let Ok(mut instances) = self.instances.lock() {
            instances[i] = Some(child);
        }
        self.await_ready(i, Duration::from_secs(30))
    }

    /// Waits until instance `i` answers `/readyz` 200.
    pub fn await_ready(&self, i: usize, within: Duration) -> Result<(), String> {
        let until = Instant::now() + within;
        while Instant::now() < until {
            match ready(self.ports[i], &self.reader_token) {
                Readiness::Ready => return Ok(()),
                Readiness::LogStuck => {
                    // A finding, not a hang: the run goes on without it.
                    let what = format!(
                        "instance {i}: /readyz 503 receipt-log-stuck (its receipt log no longer extends a checkpoint it signed)"
                    );
                    if self.crashes().iter().all(|c| c != &what) {
                        self.crashed(what);
                    }
                    return Ok(());
                }
                Readiness::Not => {}
            }
            let exited = self.instances.lock().ok().and_then(|mut all| {
                all[i]
                    .as_mut()
                    .and_then(|child| child.try_wait().ok().flatten())
            });
            if let Some(status) = exited {
                return Err(format!(
                    "instance {i} exited before it was ready ({status}); its log: {}",
                    self.dir.path().join(format!("instance-{i}.log")).display()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(format!("instance {i} was not ready within {within:?}"))
    }

    /// Instance `i`'s pid while it runs.
    pub fn pid(&self, i: usize) -> Option<i32> {
        self.instances
            .lock()
            .ok()
            .and_then(|all| all[i].as_ref().and_then(|c| i32::try_from(c.id()).ok()))
    }

    fn signal(&self, i: usize, signal: i32) {
        if let Ok(instances) = self.instances.lock()
            && let Some(child) = &instances[i]
            && let Ok(pid) = i32::try_from(child.id())
        {
            // SAFETY: kill(2) on a child this process started and has not
            // reaped: the pid is still its.
            unsafe {
                libc::kill(pid, signal);
            }
        }
    }

    /// kill -9, then started again.
    pub fn kill_9(&self, i: usize) -> Result<(), String> {
        self.signal(i, libc::SIGKILL);
        if let Some(status) = self.reap(i) {
            use std::os::unix::process::ExitStatusExt as _;
            if status.signal() != Some(libc::SIGKILL) {
                self.crashed(format!("instance {i} had ended ({status}) before kill -9"));
            }
        }
        self.start_instance(i)
    }

    /// SIGTERM (the graceful stop), then started again.
    pub fn restart(&self, i: usize) -> Result<(), String> {
        self.signal(i, libc::SIGTERM);
        if let Some(status) = self.reap(i)
            && !status.success()
        {
            self.crashed(format!(
                "instance {i}'s graceful stop ended {status}, not 0"
            ));
        }
        self.start_instance(i)
    }

    fn crashed(&self, what: String) {
        if let Ok(mut crashes) = self.crashes.lock() {
            crashes.push(what);
        }
    }

    /// Every instance that ended otherwise than the nemesis ended it.
    pub fn crashes(&self) -> Vec<String> {
        self.crashes.lock().map(|c| c.clone()).unwrap_or_default()
    }

    pub fn pause(&self, i: usize) {
        self.signal(i, libc::SIGSTOP);
    }

    pub fn resume(&self, i: usize) {
        self.signal(i, libc::SIGCONT);
    }

    /// Waits for instance `i` to end, for 30 s at most: past that it is
    /// killed, said as a crash (a stop that never ends), and its status
    /// is that of the kill.
    fn reap(&self, i: usize) -> Option<std::process::ExitStatus> {
        let mut child = self
            .instances
            .lock()
            .ok()
            .and_then(|mut all| all[i].take())?;
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
                _ => break,
            }
        }
        self.crashed(format!(
            "instance {i} did not end within 30 s of its signal"
        ));
        let _ = child.kill();
        child.wait().ok()
    }

    /// Another session holds `key`'s row for `maker`, naming the plan
    /// `receipt_id`, uncommitted for `hold`, then rolls it back: returns
    /// once the row is held, with the session's thread (its outcome).
    pub fn hold_key_row(
        &self,
        maker: &str,
        key: &str,
        receipt_id: &str,
        hold: Duration,
    ) -> Result<std::thread::JoinHandle<Result<(), String>>, String> {
        let marker = format!("soak holds {key}");
        let script = format!(
            "BEGIN; \
             INSERT INTO intake_keys (maker, idempotency_key, request_hash, plan_id, created_at) \
                  SELECT '{maker}', '{key}', 'blake3:held', id, now() FROM plans \
                   WHERE receipt_id = '{receipt_id}'; \
             SELECT pg_sleep({}) AS \"{marker}\"; ROLLBACK;",
            hold.as_secs_f64()
        );
        let url = self.database_url.clone();
        let holder = std::thread::spawn(move || psql(&url, &script).map(|_| ()));
        // Held once its session sleeps (the INSERT is done by then).
        let until = Instant::now() + Duration::from_secs(10);
        let asleep = format!(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%{marker}%' \
               AND wait_event = 'PgSleep'"
        );
        while Instant::now() < until {
            if self.query(&asleep)?.first().is_some_and(|n| n == "1") {
                return Ok(holder);
            }
            if holder.is_finished() {
                return match holder.join() {
                    Ok(Err(e)) => Err(e),
                    _ => Err(format!("the session holding {key} ended early")),
                };
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(format!("the session holding {key} never slept"))
    }

    /// Waits (10 s at most) until at least `sessions` sessions wait for a
    /// lock on the soak's database.
    pub fn await_lock_waits(&self, sessions: usize) -> Result<(), String> {
        let until = Instant::now() + Duration::from_secs(10);
        let waiting = "SELECT count(*) FROM pg_stat_activity \
                        WHERE datname = current_database() AND wait_event_type = 'Lock'";
        while Instant::now() < until {
            if self
                .query(waiting)?
                .first()
                .and_then(|n| n.parse::<usize>().ok())
                .is_some_and(|n| n >= sessions)
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(format!("{sessions} sessions never waited for a lock"))
    }

    /// Every instance ready within `within` (after a fault of the
    /// database, which all of them meet).
    pub fn all_ready(&self, within: Duration) -> Result<(), String> {
        (0..self.count()).try_for_each(|i| self.await_ready(i, within))
    }

    /// Every instance running and ready.
    pub fn all_up(&self) -> Result<(), String> {
        for i in 0..self.count() {
            self.resume(i);
            let exited = self
                .instances
                .lock()
                .map(|mut all| {
                    all[i]
                        .as_mut()
                        .is_none_or(|child| child.try_wait().ok().flatten().is_some())
                })
                .unwrap_or(true);
            if exited {
                let status = self.reap(i);
                self.crashed(format!("instance {i} was found ended ({status:?})"));
                self.start_instance(i)?;
            }
            self.await_ready(i, Duration::from_secs(30))?;
        }
        Ok(())
    }

    /// One column of `sql`'s rows, through `psql` or `sqlite3`.
    pub fn query(&self, sql: &str) -> Result<Vec<String>, String> {
        let text = match self.database_url.strip_prefix("sqlite://") {
            Some(file) => sqlite3(file, sql)?,
            None => psql(&self.database_url, sql)?,
        };
        Ok(text.lines().map(str::to_owned).collect())
    }
}

impl Drop for System {
    fn drop(&mut self) {
        for reader in &self.readers {
            reader.kill();
        }
        for i in 0..self.count() {
            self.resume(i);
            self.signal(i, libc::SIGKILL);
            self.reap(i);
        }
        if let Some((admin_url, database)) = &self.postgres {
            let _ = psql(
                admin_url,
                &format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"),
            );
        }
    }
}

fn psql(url: &str, sql: &str) -> Result<String, String> {
    // An explicit host keeps Debian's pg_wrapper from reading every local
    // cluster's configuration to pick a default, which fails while another
    // test drops a cluster of its own ("Invalid data directory for
    // cluster"); the URL's own host, the same, is what psql connects to.
    let host = host_port(url)
        .ok()
        .and_then(|address| address.rsplit_once(':').map(|(host, _)| host.to_owned()));
    let out = Command::new("psql")
        .args(host.iter().flat_map(|host| ["-h", host.as_str()]))
        .args([url, "-qAtX", "-v", "ON_ERROR_STOP=1", "-c", sql])
        .output()
        .map_err(|e| format!("psql: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "psql {sql}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The `host:port` of a Postgres URL (5432 when it names none).
fn host_port(url: &str) -> Result<String, String> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, rest)| rest);
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    match authority {
        "" => Err(format!("{url} names no host")),
        a if a.contains(':') => Ok(a.to_owned()),
        a => Ok(format!("{a}:5432")),
    }
}

fn sqlite3(file: &str, sql: &str) -> Result<String, String> {
    let out = Command::new("sqlite3")
        .args(["-batch", "-noheader", "-cmd", ".timeout 10000", file, sql])
        .output()
        .map_err(|e| format!("sqlite3: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "sqlite3 {sql}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether `/readyz` on `port` answers 200 within a second. With a
/// login's token: a verdict of its own, not one shared by a crowd of
/// callers without one (up to a second old).
/// What `/readyz` answered.
#[derive(PartialEq)]
enum Readiness {
    Ready,
    /// 503 `receipt-log-stuck`: serving, but its receipt log no longer
    /// extends a checkpoint it signed (a failover that lost commits); no
    /// wait mends it.
    LogStuck,
    Not,
}

fn ready(port: u16, token: &str) -> Readiness {
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return Readiness::Not;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let request = format!(
        "GET /readyz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
    );
    if stream.write_all(request.as_bytes()).is_err() {
        return Readiness::Not;
    }
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    if answer.starts_with(b"HTTP/1.1 200") {
        Readiness::Ready
    } else if answer.starts_with(b"HTTP/1.1 503")
        && String::from_utf8_lossy(&answer).contains("receipt-log-stuck")
    {
        Readiness::LogStuck
    } else {
        Readiness::Not
    }
}

/// `plan_intake_write_batch` as before migration 000019: every plan
/// through `plan_intake_write`, one after the other (the horizon defect's
/// batch).
const ONE_BY_ONE_BATCH: &str = "CREATE OR REPLACE FUNCTION plan_intake_write_batch(
    p_receipt_id TEXT[], p_maker TEXT[], p_run_id TEXT[], p_content_hash TEXT[],
    p_request_hash TEXT[], p_content TEXT[], p_approved_inputs TEXT[], p_permissions TEXT[],
    p_received_at TIMESTAMP[], p_idempotency_key TEXT[], p_lock_timeout_ms INTEGER[],
    p_token_hash TEXT[], p_receipt_signature TEXT[])
RETURNS TABLE (ord BIGINT, outcome TEXT, key_request_hash TEXT, id BIGINT, receipt_id TEXT,
    maker TEXT, run_id TEXT, content_hash TEXT, request_hash TEXT, approved_inputs TEXT,
    permissions TEXT, received_at TIMESTAMP, receipt_signature TEXT)
LANGUAGE sql AS $$
SELECT b.ord, w.*
  FROM unnest(p_receipt_id, p_maker, p_run_id, p_content_hash, p_request_hash, p_content,
              p_approved_inputs, p_permissions, p_received_at, p_idempotency_key,
              p_lock_timeout_ms, p_token_hash, p_receipt_signature)
       WITH ORDINALITY AS b(receipt_id, maker, run_id, content_hash, request_hash, content,
                            approved_inputs, permissions, received_at, idempotency_key,
                            lock_timeout_ms, token_hash, receipt_signature, ord)
 CROSS JOIN LATERAL plan_intake_write(b.receipt_id, b.maker, b.run_id, b.content_hash,
       b.request_hash, b.content, b.approved_inputs, b.permissions, b.received_at,
       b.idempotency_key, b.lock_timeout_ms, b.token_hash, b.receipt_signature) AS w
 ORDER BY b.ord
$$";
