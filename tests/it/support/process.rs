//! The real binary as a child process, and a plain HTTP client for it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use std::sync::{Arc, Mutex};

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_plan-intake");

/// Runs `plan-intake ARGS…` to completion against a scratch database.
pub fn run_cli(db: &super::TestDb, args: &[&str]) -> std::process::Output {
    run_cli_at(&db.url, args)
}

/// Runs `plan-intake ARGS…` to completion against `url`.
pub fn run_cli_at(url: &str, args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .env("DATABASE_URL", url)
        .env("PLAN_INTAKE_LOG", "warn")
        .output()
        .expect("run plan-intake")
}

/// `plan-intake migrate run` (a no-op once nothing is pending; its failure
/// shows in the next step), then `plan-intake logins add NAME --permission
/// P` against `url`, as an operator does: the token.
pub fn login_via_cli(url: &str, name: &str, permission: &str) -> String {
    run_cli_at(url, &["migrate", "run"]);
    let out = run_cli_at(url, &["logins", "add", name, "--permission", permission]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// `plan-intake serve ARGS…` against `url`, which must refuse to start:
/// what it said on stderr.
#[track_caller]
pub fn serve_refused(url: &str, args: &[&str]) -> String {
    let out = Command::new(BIN)
        .args(["serve", "--bind", "127.0.0.1:0"])
        .args(args)
        .env("DATABASE_URL", url)
        .env("PLAN_INTAKE_LOG", "warn")
        .output()
        .expect("run serve");
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "it started: {said}");
    said
}

/// A running `plan-intake serve` on a port the OS picked.
pub struct ServeProcess {
    child: Child,
    pub addr: String,
    /// Every line the service wrote to stderr so far.
    pub log: Arc<Mutex<Vec<String>>>,
    /// The thread that moves stderr's lines into `log`; it ends at the
    /// pipe's end, once the process has exited.
    drain: Option<std::thread::JoinHandle<()>>,
}

impl ServeProcess {
    pub fn start(database_url: &str) -> Self {
        Self::start_with(database_url, &[])
    }

    pub fn start_with(database_url: &str, extra_args: &[&str]) -> Self {
        Self::start_on(database_url, "127.0.0.1:0", extra_args)
    }

    /// Listening on `bind`, e.g. the same port again after a restart.
    pub fn start_on(database_url: &str, bind: &str, extra_args: &[&str]) -> Self {
        Self::start_env(database_url, bind, extra_args, &[])
    }

    /// As [`ServeProcess::start_on`], with more environment variables.
    pub fn start_env(
        database_url: &str,
        bind: &str,
        extra_args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let mut command = Command::new(BIN);
        command.args(["serve", "--bind", bind]);
        Self::spawn(command, database_url, extra_args, env)
    }

    /// Serving on `socket`, handed over as systemd's socket activation
    /// does: the socket as file descriptor 3, `LISTEN_FDS=1` and
    /// `LISTEN_PID` the service's own pid (set by the shell that `exec`s
    /// it, so the pid is the service's). The caller keeps `socket` open
    /// across restarts, as systemd does, so connections made meanwhile wait
    /// in its backlog.
    pub fn start_inheriting(
        database_url: &str,
        socket: &std::net::TcpListener,
        extra_args: &[&str],
    ) -> Self {
        use std::os::fd::AsRawFd as _;
        use std::os::unix::process::CommandExt as _;
        let fd = socket.as_raw_fd();
        let mut command = Command::new("sh");
        command
            .args([
                "-c",
                r#"LISTEN_PID=$$ LISTEN_FDS=1 exec "$0" serve "$@""#,
                BIN,
            ])
            .env_remove("LISTEN_FDNAMES");
        // SAFETY: between fork and exec only async-signal-safe calls
        // (dup2, fcntl) are made, on descriptors this process owns.
        unsafe {
            command.pre_exec(move || {
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
        Self::spawn(command, database_url, extra_args, &[])
    }

    /// `command` (a wrapper such as `setpriv … BIN serve …`) as the
    /// service, its first listening line read as `start` reads it.
    pub fn start_command(command: Command, database_url: &str, env: &[(&str, &str)]) -> Self {
        Self::spawn(command, database_url, &[], env)
    }

    fn spawn(
        mut command: Command,
        database_url: &str,
        extra_args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let mut child = command
            .args(extra_args)
            .envs(env.iter().copied())
            .env("DATABASE_URL", database_url)
            .env("PLAN_INTAKE_LOG", "plan_intake=info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start plan-intake serve");
        let stderr = child.stderr.take().expect("stderr");
        let mut lines = BufReader::new(stderr).lines();
        let log: Arc<Mutex<Vec<String>>> = Arc::default();
        let addr = loop {
            let line = match lines.next() {
                Some(Ok(line)) => line,
                _ => panic!(
                    "plan-intake serve exited before listening: {:?}",
                    child.try_wait()
                ),
            };
            log.lock().expect("log").push(line.clone());
            let found = line
                .split_once("listening addr=")
                .map(|(_, rest)| rest)
                .or_else(|| line.split_once(r#""addr":""#).map(|(_, rest)| rest));
            if let Some(rest) = found {
                break rest
                    .split(|c: char| c.is_whitespace() || c == '"')
                    .next()
                    .unwrap_or_default()
                    .to_owned();
            }
        };
        // Keep draining (a full pipe would block the service's logging) and keep the lines.
        let sink = Arc::clone(&log);
        let drain = std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                sink.lock().expect("log").push(line);
            }
        });
        Self {
            child,
            addr,
            log,
            drain: Some(drain),
        }
    }

    /// Whether a line the service wrote to stderr so far holds `text`.
    pub fn said(&self, text: &str) -> bool {
        self.log
            .lock()
            .expect("log")
            .iter()
            .any(|l| l.contains(text))
    }

    /// Waits (30 s at most) until the service has written a line holding
    /// `text`; that line.
    #[track_caller]
    pub fn await_said(&self, text: &str) -> String {
        let start = std::time::Instant::now();
        loop {
            let found = self
                .log
                .lock()
                .expect("log")
                .iter()
                .find(|l| l.contains(text))
                .cloned();
            if let Some(line) = found {
                return line;
            }
            assert!(
                start.elapsed() < std::time::Duration::from_secs(30),
                "the service never said {text:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// SIGTERM, then the exit status once the process has stopped and
    /// every line it wrote is in `log`.
    /// The service's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn terminate(self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -TERM failed");
        self.wait()
    }

    /// Waits for the service to exit (told to stop by someone else).
    pub fn wait(mut self) -> std::process::ExitStatus {
        let status = self.child.wait().expect("wait for plan-intake");
        if let Some(drain) = self.drain.take() {
            drain.join().expect("the log drain");
        }
        status
    }

    /// CPU seconds the service has used so far (user + system), from
    /// `/proc/PID/stat` (in clock ticks of 1/100 s).
    pub fn cpu_seconds(&self) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()))
            .expect("the service's /proc stat");
        // After `(comm)`, which may hold spaces: utime and stime are fields 14 and 15.
        let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let fields: Vec<&str> = after.split_whitespace().collect();
        [11, 12]
            .iter()
            .map(|i| fields[*i].parse::<f64>().expect("ticks"))
            .sum::<f64>()
            / 100.0
    }

    /// The service's peak resident set so far (`VmHWM`), in MiB.
    pub fn peak_rss_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("the service's /proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    }

    /// The service's `/metrics`, as Prometheus text.
    pub fn metrics_text(&self) -> String {
        client()
            .get(&format!("http://{}/metrics", self.addr))
            .call()
            .expect("metrics")
            .into_string()
            .expect("metrics text")
    }

    /// SIGKILL: no shutdown, no flush, transactions cut wherever they are.
    pub fn kill_9(mut self) {
        self.child.kill().expect("kill -9");
        let _ = self.child.wait();
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A local port nothing listens on right now (the OS's pick, released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

/// A service on a new SQLite database, a planner's token and a reader's.
pub fn served_sqlite() -> (crate::support::TestApp, ServeProcess, String, String) {
    use plan_intake::intake::Permission;
    let scratch = crate::support::TestDb::sqlite();
    let url = scratch.url.clone();
    let app = crate::support::TestApp::new(scratch);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let reader = app.login("orders", &[Permission::ReceiptsRead]);
    let server = ServeProcess::start(&url);
    (app, server, planner, reader)
}

/// A keep-alive HTTP/1.1 client.
pub fn client() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(30))
        .build()
}

/// POSTs a plan; `Err` only when no HTTP answer came back.
pub fn post_plan(
    agent: &ureq::Agent,
    addr: &str,
    token: &str,
    key: &str,
    body: &str,
) -> Result<(u16, Value), String> {
    let response = agent
        .post(&format!("http://{addr}/v1/plans"))
        .set("Authorization", &format!("Bearer {token}"))
        .set("Idempotency-Key", key)
        .set("Content-Type", "application/json")
        .send_string(body);
    let response = match response {
        Ok(response) => response,
        Err(ureq::Error::Status(_, response)) => response,
        Err(e) => return Err(e.to_string()),
    };
    let status = response.status();
    // Every 503 tells the caller when to retry.
    assert!(
        status != 503 || response.header("retry-after").is_some(),
        "a 503 without Retry-After"
    );
    let text = response.into_string().map_err(|e| e.to_string())?;
    let body = serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))?;
    Ok((status, body))
}

/// How often a planner retries a 503 (same key) before a test calls it
/// lost: a busy machine may time one request out, never three in a row.
const PLANNER_RETRIES: usize = 2;

/// POSTs a plan as a planner does: a 503 is retried under the same key, so
/// the answer is 201, or 200 (a replay) when a 503 came first. The receipt.
#[track_caller]
pub fn keep_plan(agent: &ureq::Agent, addr: &str, token: &str, key: &str, body: &str) -> Value {
    let mut busy = 0;
    loop {
        let (status, receipt) = post_plan(agent, addr, token, key, body).expect("an answer");
        match status {
            503 if busy < PLANNER_RETRIES => busy += 1,
            201 => return receipt,
            200 if busy > 0 => return receipt,
            _ => panic!("{status} after {busy} 503s: {receipt}"),
        }
    }
}

/// GETs `path`; the status and the body parsed as JSON (Null when not JSON).
pub fn get(agent: &ureq::Agent, addr: &str, token: &str, path: &str) -> (u16, Value) {
    let response = match agent
        .get(&format!("http://{addr}{path}"))
        .set("Authorization", &format!("Bearer {token}"))
        .call()
    {
        Ok(response) => response,
        Err(ureq::Error::Status(_, response)) => response,
        Err(e) => panic!("GET {path}: {e}"),
    };
    let status = response.status();
    let body = response
        .into_string()
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or(Value::Null);
    (status, body)
}
