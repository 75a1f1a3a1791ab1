//! Behind Patroni, as SREs run Postgres: two nodes and one etcd started by
//! `deploy/patroni/cluster.sh` (synchronous mode, strict), the service on
//! a libpq multi-host URL with `target_session_attrs=read-write`, never
//! restarted, 8 clients writing throughout:
//!
//! - the leader's Patroni and Postgres SIGKILLed: Patroni promotes the
//!   other node; while that node is alone (strict mode holds every commit)
//!   `/readyz` says commits are blocked; the killed node rejoins as the
//!   synchronous standby;
//! - then `patronictl switchover` back;
//! - every answer is 201, 200 or 503; every 201 is on the final leader;
//!   every request resent with its key lands once; a reader following the
//!   feed throughout saw every stored receipt exactly once.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::REQUIRE_POSTGRES_VAR;
use crate::support::load::{Load, assert_each_answered, every_acknowledged_plan_is_kept_once};
use crate::support::process::{ServeProcess, client, get, login_via_cli, run_cli_at};

const CLIENTS: usize = 8;
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/patroni/cluster.sh");
const NODES: [&str; 2] = ["node1", "node2"];

/// Whether Patroni and etcd are installed; a loud notice when not (a
/// failure when the suite must run everything).
fn patroni_installed() -> bool {
    let found = |program: &str| {
        Command::new(program)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if found("patroni") && found("etcd") {
        return true;
    }
    if std::env::var_os(REQUIRE_POSTGRES_VAR).is_some() {
        panic!(
            "{REQUIRE_POSTGRES_VAR} is set but patroni or etcd is not installed (apt-get install patroni etcd-server)"
        );
    }
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "\n!!!!!!!!\n!!! SKIPPING the Patroni test: patroni or etcd is not installed (apt-get install patroni etcd-server).\n!!!!!!!!\n"
    );
    false
}

/// A member of the cluster as Patroni's REST API reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Member {
    name: String,
    role: String,
    state: String,
}

/// The cluster `cluster.sh` started; stopped and removed when dropped.
struct Cluster {
    dir: PathBuf,
    base: u16,
    _tmp: tempfile::TempDir,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(SCRIPT)
            .arg("stop")
            .arg(&self.dir)
            .status();
    }
}

/// A base port with every port the cluster takes free, below the kernel's
/// ephemeral range: a port in that range, free when checked, can be taken
/// by any outgoing connection (the suite makes hundreds) before Postgres or
/// etcd binds it, and the node then never starts.
fn free_base() -> u16 {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let (low, high) = (10_000u16, ephemeral_low.saturating_sub(100).max(10_100));
    for _ in 0..100 {
        let base = low + rand::random::<u16>() % (high - low);
        let all_free = [0, 1, 10, 11, 20, 21]
            .iter()
            .all(|offset| std::net::TcpListener::bind(("127.0.0.1", base + offset)).is_ok());
        if all_free {
            return base;
        }
    }
    panic!("no free ports for the cluster");
}

impl Cluster {
    fn start() -> Self {
        let tmp = tempfile::tempdir().expect("a directory");
        let dir = tmp.path().join("cluster");
        let base = free_base();
        let status = Command::new("bash")
            .arg(SCRIPT)
            .arg("start")
            .arg(&dir)
            .arg(base.to_string())
            .status()
            .expect("run cluster.sh");
        assert!(status.success(), "cluster.sh start");
        let cluster = Self {
            dir,
            base,
            _tmp: tmp,
        };
        cluster.wait_for(
            "a leader and its synchronous standby",
            Duration::from_secs(90),
            |m| {
                roles(m)
                    == ["leader", "sync_standby"]
                        .map(str::to_owned)
                        .into_iter()
                        .collect()
            },
        );
        // Strict from here on, as the recipe says (bootstrapped strict,
        // Debian's Patroni 3.0.2 can hang in its post-bootstrap step).
        let status = Command::new("bash")
            .arg(SCRIPT)
            .arg("strict")
            .arg(&cluster.dir)
            .status()
            .expect("run cluster.sh strict");
        assert!(status.success(), "cluster.sh strict\n{}", cluster.logs());
        let started = Instant::now();
        while !cluster.strict() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "synchronous_mode_strict not on after 30 s\n{}",
                cluster.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        cluster
    }

    /// Whether the DCS says strict synchronous mode (`GET /config`).
    fn strict(&self) -> bool {
        NODES.iter().any(|node| {
            ureq::get(&format!("http://127.0.0.1:{}/config", self.rest_port(node)))
                .timeout(Duration::from_secs(2))
                .call()
                .ok()
                .and_then(|r| r.into_string().ok())
                .and_then(|text| serde_json::from_str::<Value>(&text).ok())
                .is_some_and(|config| config["synchronous_mode_strict"] == Value::Bool(true))
        })
    }

    fn pg_port(&self, node: &str) -> u16 {
        self.base + 10 + u16::from(node == "node2")
    }

    fn rest_port(&self, node: &str) -> u16 {
        self.base + 20 + u16::from(node == "node2")
    }

    /// Both nodes, the writable one chosen by libpq.
    fn url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{database}?target_session_attrs=read-write",
            self.pg_port("node1"),
            self.pg_port("node2")
        )
    }

    fn node_url(&self, node: &str, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{database}",
            self.pg_port(node)
        )
    }

    /// The members as any node that answers sees them.
    fn members(&self) -> Vec<Member> {
        for node in NODES {
            let answer = ureq::get(&format!(
                "http://127.0.0.1:{}/cluster",
                self.rest_port(node)
            ))
            .timeout(Duration::from_secs(2))
            .call()
            .ok()
            .and_then(|r| r.into_string().ok())
            .and_then(|text| serde_json::from_str::<Value>(&text).ok());
            if let Some(cluster) = answer {
                return cluster["members"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|m| Member {
                        name: m["name"].as_str().unwrap_or_default().to_owned(),
                        role: m["role"].as_str().unwrap_or_default().to_owned(),
                        state: m["state"].as_str().unwrap_or_default().to_owned(),
                    })
                    .collect();
            }
        }
        Vec::new()
    }

    #[track_caller]
    fn wait_for(
        &self,
        what: &str,
        within: Duration,
        done: impl Fn(&[Member]) -> bool,
    ) -> Vec<Member> {
        let started = Instant::now();
        loop {
            let members = self.members();
            if done(&members) {
                return members;
            }
            assert!(
                started.elapsed() < within,
                "no {what} after {within:?}: {members:?}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Every log the cluster writes, enough to find a cause: each node's
    /// Patroni log (with its Postgres's own lines: the nodes log to stderr,
    /// which Patroni's log takes) from its bootstrap (initdb, the
    /// postmaster's start), every FATAL, PANIC or ERROR line in it, and
    /// its end; any log file Postgres kept in its data directory; etcd's;
    /// the ports in use.
    fn logs(&self) -> String {
        let tail = |path: &Path, lines: usize| {
            let log = std::fs::read_to_string(path).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(lines).collect();
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        };
        let bootstrap_and_failures = |path: &Path| {
            let log = std::fs::read_to_string(path).unwrap_or_default();
            let head: Vec<&str> = log.lines().take(80).collect();
            let failures: Vec<&str> = log
                .lines()
                .skip(80)
                .filter(|l| ["FATAL", "PANIC", "ERROR"].iter().any(|w| l.contains(w)))
                .collect();
            format!(
                "{}\n... failures after that:\n{}",
                head.join("\n"),
                failures.join("\n")
            )
        };
        let mut told = vec![format!("base port {}", self.base)];
        for node in NODES {
            let log = self.dir.join(format!("{node}.log"));
            told.push(format!(
                "--- {node} (Patroni and Postgres), from its start:\n{}",
                bootstrap_and_failures(&log)
            ));
            told.push(format!("--- {node}, its end:\n{}", tail(&log, 40)));
            let kept = std::fs::read_dir(self.dir.join(node).join("log"))
                .into_iter()
                .flatten()
                .flatten();
            for file in kept {
                told.push(format!(
                    "--- {node} {}:\n{}",
                    file.path().display(),
                    tail(&file.path(), 40)
                ));
            }
        }
        told.push(format!(
            "--- etcd:\n{}",
            tail(&self.dir.join("etcd.log"), 15)
        ));
        told.join("\n")
    }

    fn leader(&self) -> String {
        self.members()
            .into_iter()
            .find(|m| m.role == "leader" && m.state == "running")
            .map(|m| m.name)
            .expect("a leader")
    }

    /// SIGKILL to the node's Patroni and its Postgres.
    fn kill(&self, node: &str) {
        let read_pid = |path: &Path| {
            std::fs::read_to_string(path)
                .ok()
                .and_then(|text| text.lines().next()?.trim().parse::<i32>().ok())
        };
        let patroni = read_pid(&self.dir.join(format!("{node}.patroni.pid")));
        let postmaster = read_pid(&self.dir.join(node).join("postmaster.pid"));
        for pid in [patroni, postmaster].into_iter().flatten() {
            let _ = Command::new("pkill")
                .args(["-KILL", "-P", &pid.to_string()])
                .status();
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }

    /// Starts the node's Patroni again (it rejoins, rewinding if it must).
    fn restart(&self, node: &str) {
        let status = Command::new("bash")
            .arg(SCRIPT)
            .arg("node")
            .arg(&self.dir)
            .arg(node)
            .status()
            .expect("run cluster.sh");
        assert!(status.success(), "cluster.sh node {node}");
    }

    /// A planned switchover to `candidate`, as an operator runs it.
    fn switchover(&self, candidate: &str) {
        let leader = self.leader();
        let out = Command::new("runuser")
            .args(["-u", "postgres", "--", "patronictl", "-c"])
            .arg(self.dir.join("node1.yml"))
            .args([
                "switchover",
                "--leader",
                &leader,
                "--candidate",
                candidate,
                "--force",
            ])
            .output()
            .expect("run patronictl");
        assert!(
            out.status.success(),
            "patronictl switchover: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn wait_for_pair(&self, leader: &str, within: Duration) {
        self.wait_for(
            &format!("{leader} leading a synchronous standby"),
            within,
            |members| {
                members
                    .iter()
                    .any(|m| m.name == leader && m.role == "leader" && m.state == "running")
                    && members.iter().any(|m| {
                        m.name != leader && m.role == "sync_standby" && m.state == "running"
                    })
            },
        );
    }
}

fn roles(members: &[Member]) -> HashSet<String> {
    members
        .iter()
        .filter(|m| m.state == "running")
        .map(|m| m.role.clone())
        .collect()
}

/// A reader following the feed from the start until told to stop, then to
/// its end: every receipt id in the order it came.
fn follow_feed(
    addr: String,
    token: String,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Vec<String>> {
    std::thread::spawn(move || {
        let agent = client();
        let mut seen = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let path = match &cursor {
                Some(c) => format!("/v1/receipts?after={c}&limit=1000&wait=1"),
                None => "/v1/receipts?limit=1000&wait=1".to_owned(),
            };
            let (status, page) = get(&agent, &addr, &token, &path);
            if status != 200 {
                assert_eq!(status, 503, "the feed: {page}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            let receipts = page["receipts"].as_array().cloned().unwrap_or_default();
            seen.extend(
                receipts
                    .iter()
                    .filter_map(|r| r["receipt_id"].as_str().map(str::to_owned)),
            );
            cursor = page["next"].as_str().map(str::to_owned);
            if receipts.is_empty() && stop.load(Ordering::SeqCst) {
                return seen;
            }
        }
    })
}

#[test]
fn behind_patroni_a_killed_leader_and_a_switchover_lose_nothing() {
    if !patroni_installed() {
        return;
    }
    let cluster = Cluster::start();
    let first_leader = cluster.leader();
    let mut admin = {
        use diesel::Connection;
        diesel::PgConnection::establish(&cluster.node_url(&first_leader, "postgres"))
            .expect("connect")
    };
    {
        use diesel::RunQueryDsl;
        diesel::sql_query("CREATE DATABASE intake")
            .execute(&mut admin)
            .expect("create the database");
    }
    // On the standby too before anyone connects (a synchronous commit is
    // flushed there, not yet replayed; libpq may try the standby first).
    for node in NODES {
        let started = Instant::now();
        while {
            use diesel::Connection;
            diesel::PgConnection::establish(&cluster.node_url(node, "intake")).is_err()
        } {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the database never reached {node}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let url = cluster.url("intake");
    let migrated = run_cli_at(&url, &["migrate", "run"]);
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let planner = login_via_cli(&url, "planner-a", "plans:submit");
    let reader = login_via_cli(&url, "orders", "receipts:read");
    let service = ServeProcess::start_with(&url, &["--request-timeout-ms", "3000"]);
    let (status, ready) = get(&client(), &service.addr, "", "/readyz");
    assert_eq!(
        (status, &ready["commit_waits_for_standby"]),
        (200, &Value::Bool(true)),
        "{ready}"
    );

    let stop_feed = Arc::new(AtomicBool::new(false));
    let feed = follow_feed(service.addr.clone(), reader, Arc::clone(&stop_feed));
    let load = Load::start(CLIENTS, &planner, |_| service.addr.clone());
    load.wait_for_created(150);

    // The leader dies; Patroni promotes the other node.
    cluster.kill(&first_leader);
    let other = NODES
        .into_iter()
        .find(|n| *n != first_leader)
        .expect("the other node");
    cluster.wait_for(
        "the other node promoted",
        Duration::from_secs(60),
        |members| {
            members
                .iter()
                .any(|m| m.name == other && m.role == "leader" && m.state == "running")
        },
    );
    // Alone under strict mode, the new leader holds every commit: the
    // service says so instead of looking ready.
    let started = Instant::now();
    loop {
        let (status, problem) = get(&client(), &service.addr, "", "/readyz");
        if status == 503 && problem["type"] == "https://plan-intake.dev/problems/commits-blocked" {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "/readyz never said commits are blocked: {status} {problem}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let alone_since = Instant::now();
    cluster.restart(&first_leader);
    cluster.wait_for_pair(other, Duration::from_secs(90));
    eprintln!(
        "the new leader was alone (commits held) for {:?} from /readyz saying so until the old leader rejoined as its synchronous standby",
        alone_since.elapsed()
    );
    let (status, ready) = get(&client(), &service.addr, "", "/readyz");
    assert_eq!(status, 200, "{ready}");
    load.wait_for_answers(150);

    // A planned switchover back.
    cluster.switchover(&first_leader);
    cluster.wait_for_pair(&first_leader, Duration::from_secs(90));
    load.wait_for_answers(150);
    let sent = load.stop();

    assert_each_answered(&sent, &[200, 201, 503]);
    let leader_url = cluster.node_url(&first_leader, "intake");
    let sent =
        every_acknowledged_plan_is_kept_once(sent, &leader_url, &service.addr, &planner, CLIENTS);

    stop_feed.store(true, Ordering::SeqCst);
    let seen = feed.join().expect("the feed reader");
    let unique: HashSet<&String> = seen.iter().collect();
    assert_eq!(
        unique.len(),
        seen.len(),
        "a receipt came twice through the feed"
    );
    let stored = {
        use diesel::Connection;
        let mut conn = plan_intake::storage::DbConn::Postgres(
            diesel::PgConnection::establish(&leader_url).expect("connect"),
        );
        crate::support::stored_receipt_ids(&mut conn)
    };
    let seen: HashSet<String> = seen.into_iter().collect();
    let missed: Vec<&String> = stored.iter().filter(|id| !seen.contains(*id)).collect();
    assert!(
        missed.is_empty(),
        "the feed skipped {} of {} receipts",
        missed.len(),
        stored.len()
    );
    assert_eq!(stored.len(), sent.len(), "one plan per request");
}
