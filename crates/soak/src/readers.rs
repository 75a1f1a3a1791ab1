//! The readers: `plan-intake follow` as an ordering system runs it, each a
//! process of its own that the nemesis kills with kill -9 (its process
//! group: a reader's `--exec` command dies with it, as on a crashed host).
//! One hands each page to a slow command (`--exec`, a consumer writing to
//! its own database takes a while); one verifies every page against the
//! signed log (`--verify`) and writes to a file; one keeps every receipt
//! exactly once in an inbox (`--into`, a SQLite file: the page and the
//! position in one transaction), where no kill may repeat one. At the end
//! each is stopped with SIGTERM, which must end it 0, and drained.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One reader: how it runs, and its process while it runs.
pub struct Reader {
    pub name: &'static str,
    /// Where every receipt it handed on ends up, one JSON line each (the
    /// inbox: its SQLite file).
    pub out: PathBuf,
    /// `--into`: it keeps each receipt exactly once in `out`, an inbox,
    /// so not even a kill may repeat one.
    pub exactly_once: bool,
    cursor: PathBuf,
    args: Vec<String>,
    instance: usize,
    child: Mutex<Option<Child>>,
    /// How often the nemesis killed it.
    pub kills: Mutex<u32>,
    /// At each kill, how many receipts its output held: only right after
    /// one may a page come again.
    pub kill_marks: Mutex<Vec<usize>>,
    /// Each time it ended otherwise than the soak ended it.
    pub exits: Mutex<Vec<String>>,
}

impl Reader {
    /// The readers the soak runs: their files in `dir`, `keys` the signing
    /// keys pinned for `--verify`.
    pub fn all(dir: &Path, keys: &Path) -> Vec<Reader> {
        let exec_out = dir.join("orders-exec.jsonl");
        // A consumer that takes its time (an ordering system's own
        // transaction) before the page is recorded: a kill meanwhile finds
        // the page taken from the pipe but not recorded, and the cursor not
        // yet saved, so the page must come again.
        let exec = format!(
            "page=$(cat) && sleep 0.2 && printf '%s\\n' \"$page\" >> '{}'",
            exec_out.display()
        );
        vec![
            Reader::new(dir, "exec", exec_out, 0, vec!["--exec".to_owned(), exec]),
            Reader::new(
                dir,
                "verify",
                dir.join("orders-verify.jsonl"),
                1,
                vec![
                    "--verify".to_owned(),
                    "--keys".to_owned(),
                    keys.display().to_string(),
                ],
            ),
            Reader {
                exactly_once: true,
                ..Reader::new(dir, "inbox", dir.join("orders-inbox.db"), 0, Vec::new())
            },
        ]
    }

    fn new(
        dir: &Path,
        name: &'static str,
        out: PathBuf,
        instance: usize,
        args: Vec<String>,
    ) -> Reader {
        Reader {
            name,
            out,
            exactly_once: false,
            cursor: dir.join(format!("orders-{name}.cursor")),
            args,
            instance,
            child: Mutex::new(None),
            kills: Mutex::new(0),
            kill_marks: Mutex::new(Vec::new()),
            exits: Mutex::new(Vec::new()),
        }
    }

    fn command(&self, bin: &Path, url: &str, token: &str, env: &[(String, String)]) -> Command {
        let mut command = Command::new(bin);
        command.arg("follow");
        if self.exactly_once {
            command.arg("--into").arg(&self.out);
        } else {
            command.arg("--cursor-file").arg(&self.cursor);
        }
        command
            .args(["--from-start", "--wait-secs", "1"])
            .args(&self.args)
            .env("PLAN_INTAKE_URL", url)
            .env("PLAN_INTAKE_TOKEN", token)
            .env("PLAN_INTAKE_LOG", "warn")
            .envs(env.iter().map(|(k, v)| (k, v)));
        match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.out.with_extension("log"))
        {
            Ok(log) => command.stderr(log),
            Err(_) => command.stderr(Stdio::null()),
        };
        if self.exactly_once || self.args.iter().any(|a| a == "--exec") {
            command.stdout(Stdio::null());
        } else {
            match std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.out)
            {
                Ok(file) => command.stdout(file),
                Err(_) => command.stdout(Stdio::null()),
            };
        }
        command
    }

    /// Starts it (through instance `self.instance`'s URL in `urls`).
    pub fn start(
        &self,
        bin: &Path,
        urls: &[String],
        token: &str,
        env: &[(String, String)],
    ) -> Result<(), String> {
        use std::os::unix::process::CommandExt as _;
        self.mend_torn_line();
        // The inbox's tables, made once by its owner before its first run.
        if self.exactly_once && !self.out.exists() {
            let made = Command::new(bin)
                .args(["inbox", "migrate", "--into"])
                .arg(&self.out)
                .output()
                .map_err(|e| format!("reader {}: inbox migrate: {e}", self.name))?;
            if !made.status.success() {
                return Err(format!(
                    "reader {}: inbox migrate: {}",
                    self.name,
                    String::from_utf8_lossy(&made.stderr).trim()
                ));
            }
        }
        let mut command = self.command(bin, &urls[self.instance % urls.len()], token, env);
        command.process_group(0);
        // SAFETY: only prctl(2), async-signal-safe, between fork and exec:
        // a reader dies with the soak, whatever ends it.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = command
            .spawn()
            .map_err(|e| format!("reader {}: {e}", self.name))?;
        if let Ok(mut slot) = self.child.lock() {
            *slot = Some(child);
        }
        Ok(())
    }

    /// A page a kill cut short ends its last line: what comes again
    /// starts on a line of its own.
    fn mend_torn_line(&self) {
        use std::io::Write as _;
        if self.exactly_once {
            return;
        }
        let text = std::fs::read(&self.out).unwrap_or_default();
        if text.last().is_some_and(|b| *b != b'\n')
            && let Ok(mut file) = std::fs::OpenOptions::new().append(true).open(&self.out)
        {
            let _ = file.write_all(b"\n");
        }
    }

    /// Whether it verifies (pins the signing keys).
    pub fn verifies(&self) -> bool {
        self.args.iter().any(|a| a == "--verify")
    }

    /// SIGTERM, which finishes the page in hand and must end it 0 within
    /// 30 s (else it is killed, and that is noted); `Err` then.
    fn stop(&self) -> Result<(), String> {
        self.ended_on_its_own();
        let Some(mut child) = self.child.lock().ok().and_then(|mut slot| slot.take()) else {
            return Ok(());
        };
        let Ok(pid) = i32::try_from(child.id()) else {
            return Ok(());
        };
        // SAFETY: kill(2) on the leader alone, a child this process
        // started and has not reaped.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
        let until = Instant::now() + Duration::from_secs(30);
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(20)),
                _ => break None,
            }
        };
        if status.is_some_and(|s| s.success()) {
            return Ok(());
        }
        if status.is_none() {
            // SAFETY: as above; it did not stop in 30 s.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
            }
            let _ = child.wait();
        }
        let what = format!("reader {} did not end 0 on SIGTERM: {status:?}", self.name);
        if let Ok(mut exits) = self.exits.lock() {
            exits.push(what.clone());
        }
        Err(what)
    }

    /// Stopped with SIGTERM and started again (new keys pinned).
    pub fn restart(
        &self,
        bin: &Path,
        urls: &[String],
        token: &str,
        env: &[(String, String)],
    ) -> Result<(), String> {
        self.stop()?;
        self.start(bin, urls, token, env)
    }

    /// Notes an exit nobody caused (a reader that stopped on its own: 76 on
    /// an honest log, a crash); true when it had ended.
    pub fn ended_on_its_own(&self) -> bool {
        let ended = self.child.lock().ok().and_then(|mut slot| {
            let status = slot.as_mut()?.try_wait().ok().flatten()?;
            slot.take();
            Some(status)
        });
        match ended {
            Some(status) => {
                if let Ok(mut exits) = self.exits.lock() {
                    exits.push(format!(
                        "reader {} ended {status}: {}",
                        self.name,
                        self.last_said()
                    ));
                }
                true
            }
            None => false,
        }
    }

    /// kill -9 of its process group, then started again.
    pub fn kill_9(
        &self,
        bin: &Path,
        urls: &[String],
        token: &str,
        env: &[(String, String)],
    ) -> Result<(), String> {
        self.ended_on_its_own();
        if let Some(mut child) = self.child.lock().ok().and_then(|mut slot| slot.take())
            && let Ok(pid) = i32::try_from(child.id())
        {
            // The host crashes: the follower stopped first (it starts no
            // command meanwhile), then its `--exec` command, which runs in
            // a process group of its own, then the follower.
            // SAFETY: kill(2) on a child this process started (the leader
            // of its group) and has not reaped, and on the groups its own
            // children lead.
            unsafe {
                libc::kill(pid, libc::SIGSTOP);
            }
            wait_stopped(pid);
            // SAFETY: as above.
            unsafe {
                for command in children_of(pid) {
                    libc::kill(-command, libc::SIGKILL);
                }
                libc::kill(-pid, libc::SIGKILL);
            }
            let _ = child.wait();
            if let Ok(mut kills) = self.kills.lock() {
                *kills += 1;
            }
            let handed = self.handed_on().0.len();
            if let Ok(mut marks) = self.kill_marks.lock() {
                marks.push(handed);
            }
        }
        self.start(bin, urls, token, env)
    }

    /// SIGTERM, which finishes the page in hand and must end it 0; then
    /// `follow --drain` until it has handed on `stored` receipts (30 s at
    /// most, as a write a killed instance's backend held keeps the feed's
    /// horizon back for a moment).
    pub fn finish(
        &self,
        bin: &Path,
        urls: &[String],
        token: &str,
        env: &[(String, String)],
        stored: impl Fn() -> Option<usize>,
    ) {
        let _ = self.stop();
        let until = Instant::now() + Duration::from_secs(30);
        let mut progress = (0, Instant::now());
        loop {
            self.mend_torn_line();
            let mut command = self.command(bin, &urls[self.instance % urls.len()], token, env);
            // A drain that never ends is a violation, not a hang.
            let status = command
                .args(["--drain"])
                .spawn()
                .map_err(|e| e.to_string())
                .and_then(|mut drain| {
                    let began = Instant::now();
                    loop {
                        match drain.try_wait() {
                            Ok(Some(status)) => return Ok(status),
                            Ok(None) if began.elapsed() < Duration::from_secs(60) => {
                                std::thread::sleep(Duration::from_millis(20))
                            }
                            _ => {
                                let _ = drain.kill();
                                let _ = drain.wait();
                                return Err("it did not end within 60 s".to_owned());
                            }
                        }
                    }
                });
            if !matches!(&status, Ok(s) if s.success()) {
                if let Ok(mut exits) = self.exits.lock() {
                    let said = match &status {
                        Ok(status) => format!("ended {status}"),
                        Err(error) => error.clone(),
                    };
                    exits.push(format!("reader {}'s drain {said}", self.name));
                }
                return;
            }
            // Done once it has every stored receipt; or when 3 s brought
            // nothing more (the log's rounds come every second): what is
            // missing then is the checker's to name.
            // Receipts, not lines: a page again after a kill counts once.
            let handed = self
                .handed_on()
                .0
                .iter()
                .collect::<std::collections::HashSet<_>>()
                .len();
            if handed > progress.0 {
                progress = (handed, Instant::now());
            }
            if stored().is_some_and(|stored| handed >= stored)
                || Instant::now() >= until
                || progress.1.elapsed() >= Duration::from_secs(3)
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The receipt ids it handed on, in order, repeats included; and how
    /// many lines were torn (a page cut short by a kill, to come again).
    pub fn handed_on(&self) -> (Vec<String>, usize) {
        if self.exactly_once {
            return (inbox_rows(&self.out), 0);
        }
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        let mut ids = Vec::new();
        let mut torn = 0;
        for line in text.lines() {
            match serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v["receipt_id"].as_str().map(str::to_owned))
            {
                Some(id) => ids.push(id),
                None => torn += 1,
            }
        }
        (ids, torn)
    }

    /// The last line it wrote to stderr.
    fn last_said(&self) -> String {
        std::fs::read_to_string(self.out.with_extension("log"))
            .unwrap_or_default()
            .lines()
            .last()
            .unwrap_or_default()
            .to_owned()
    }

    /// Kills it (the soak is ending early).
    pub fn kill(&self) {
        if let Some(mut child) = self.child.lock().ok().and_then(|mut slot| slot.take())
            && let Ok(pid) = i32::try_from(child.id())
        {
            // SAFETY: as in `kill_9`.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
            }
            let _ = child.wait();
        }
    }
}

/// The receipt ids an inbox holds, in its order (`inbox_seq`: the order the
/// follower kept them in), read as the ordering system reads them.
fn inbox_rows(inbox: &Path) -> Vec<String> {
    use diesel::{Connection, QueryableByName, RunQueryDsl};
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Text)]
        receipt_id: String,
    }
    if !inbox.exists() {
        return Vec::new();
    }
    let Ok(mut conn) = diesel::SqliteConnection::establish(&inbox.display().to_string()) else {
        return Vec::new();
    };
    let _ = diesel::sql_query("PRAGMA busy_timeout = 5000").execute(&mut conn);
    // A read the follower's write kept waiting past the busy timeout is
    // tried again: an empty answer would read as receipts missing.
    for _ in 0..5 {
        if let Ok(rows) =
            diesel::sql_query("SELECT receipt_id FROM plan_intake_inbox ORDER BY inbox_seq")
                .load::<Row>(&mut conn)
        {
            return rows.into_iter().map(|r| r.receipt_id).collect();
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Vec::new()
}

/// The children of process `pid` (of each of its threads), from /proc.
fn children_of(pid: i32) -> Vec<i32> {
    let mut children = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            let listed = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            children.extend(
                listed
                    .split_whitespace()
                    .filter_map(|c| c.parse::<i32>().ok()),
            );
        }
    }
    children
}

/// Waits (1 s at most) until `pid` is stopped: a SIGSTOP takes effect
/// asynchronously, and a follower still running could start a command
/// after its children were listed.
fn wait_stopped(pid: i32) {
    let until = Instant::now() + Duration::from_secs(1);
    while Instant::now() < until {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The state follows the command's closing parenthesis.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next());
        if matches!(state, Some('T' | 't') | None) {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
