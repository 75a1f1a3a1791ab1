//! A Postgres of the soak's own, as operators run one: a primary and a
//! synchronous standby (`pg_createcluster`, `pg_basebackup -R`,
//! `synchronous_standby_names` naming it, so no commit is acknowledged before
//! the standby has it), reached through one address that follows the
//! primary (a forwarder standing for a virtual IP, or for a proxy that
//! asks Patroni who leads); the standby streams through a forwarder too
//! (the network between the nodes). Its own, so the nemesis may restart
//! the primary immediately and fail over without touching any other
//! test's server. Both clusters are dropped with the value.
//!
//! Lossy, the checker's control: the standby is asynchronous and each
//! failover comes after a second of the primary's WAL held back from it,
//! so it loses what the primary acknowledged meanwhile.

use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::proxy::FaultProxy;

struct Node {
    name: String,
    port: u16,
}

pub struct Pair {
    version: String,
    nodes: [Node; 2],
    /// Which of `nodes` is the primary now.
    primary: Mutex<usize>,
    /// The one address every client uses.
    address: FaultProxy,
    /// The standby's way to the primary.
    replication: FaultProxy,
    lossy: bool,
}

/// What every node runs with: a standby that reconnects within half a
/// second, and room for the instances' pools, PgBouncer's and the
/// readers'. Synchronous replication to whichever standby is connected
/// comes after, unless lossy.
/// Both nodes stream under one name (`cluster_name`, which a standby's
/// WAL receiver takes for its `application_name`), and that name alone is
/// synchronous: `pg_basebackup`'s own stream of WAL is never taken for
/// the standby.
const SETTINGS: &str = "wal_retrieve_retry_interval = '500ms'\n\
                        max_connections = 300\n\
                        cluster_name = 'soak_standby'\n";
const SYNCHRONOUS: &str = "synchronous_standby_names = 'soak_standby'\n\
                           synchronous_commit = on\n";

impl Pair {
    /// Both clusters made and running, the standby in sync (streaming,
    /// when `lossy`).
    pub fn create(lossy: bool) -> Result<Self, String> {
        let version = std::fs::read_dir("/etc/postgresql")
            .map_err(|e| format!("no Postgres installed here (/etc/postgresql: {e})"))?
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .max()
            .ok_or("no Postgres version in /etc/postgresql")?;
        sweep(&version);
        let stem = format!("soak_{}_{:04x}", std::process::id(), rand::random::<u16>());
        let mut nodes = Vec::new();
        for side in ["a", "b"] {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| e.to_string())?
                .port();
            nodes.push(Node {
                name: format!("{stem}_{side}"),
                port,
            });
        }
        let [a, b]: [Node; 2] = nodes.try_into().map_err(|_| "two nodes")?;
        let address = FaultProxy::forwarder(format!("127.0.0.1:{}", a.port))?;
        let replication = FaultProxy::forwarder(format!("127.0.0.1:{}", a.port))?;
        let pair = Self {
            version,
            nodes: [a, b],
            primary: Mutex::new(0),
            address,
            replication,
            lossy,
        };
        // Dropped on any failure below: whatever was made is removed.
        for node in &pair.nodes {
            pair.make(node)?;
        }
        pair.ctl(&pair.nodes[0], &["start"])?;
        pair.rebuild_as_standby(1, 0)?;
        Ok(pair)
    }

    /// The server's URL for clients (the address that follows the primary).
    pub fn server_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}", self.address.port)
    }

    /// Which node leads, on which timeline (one more for each
    /// failover), and whether its standby is in sync: for the summary.
    pub fn describe(&self) -> String {
        let primary = self.primary();
        let timeline = self
            .psql(primary, "SELECT timeline_id FROM pg_control_checkpoint()")
            .unwrap_or_else(|e| format!("unknown ({e})"));
        let in_sync = self.await_sync(primary).is_ok();
        format!(
            "soak: database: {} leads on timeline {timeline}, its standby {}",
            self.nodes[primary].name,
            if in_sync { "in sync" } else { "NOT in sync" }
        )
    }

    fn primary(&self) -> usize {
        self.primary.lock().map(|p| *p).unwrap_or(0)
    }

    /// `pg_ctl restart -m immediate` of the primary: a crash and its
    /// recovery; the standby reconnects and commits wait for it meanwhile.
    pub fn restart_primary_immediately(&self) -> Result<(), String> {
        let primary = &self.nodes[self.primary()];
        self.ctl(primary, &["restart", "-m", "immediate"])?;
        self.address.cut_all();
        self.await_sync(self.primary())
    }

    /// A failover as a careful operator (or Patroni) makes one: only to a
    /// standby in sync, so no acknowledged commit is lost. The primary is
    /// stopped immediately, the standby promoted, the address pointed at
    /// it, and the old primary rebuilt from the new one as its standby.
    /// Commits wait meanwhile (synchronous, and no standby yet).
    pub fn fail_over(&self) -> Result<(), String> {
        let old = self.primary();
        self.await_sync(old)?;
        if self.lossy {
            // A partition between the nodes: the standby falls behind
            // while the primary goes on acknowledging.
            self.replication.set_stalled(true);
            std::thread::sleep(Duration::from_secs(1));
        }
        self.promote_the_standby(old)
    }

    /// A failover that the synchronous standby alone does not make safe:
    /// the link between the nodes held, and every commit then waiting for
    /// the standby cancelled (`pg_cancel_backend`, as a DBA clearing
    /// sessions that look stuck does): each is then committed on the
    /// primary alone, and its session told it succeeded. Then the primary
    /// stops and the standby, without those commits, is promoted. Only
    /// what the service does beyond its COMMIT keeps such a plan from being
    /// acknowledged. The number of waits cancelled.
    pub fn fail_over_after_cancelled_waits(&self) -> Result<usize, String> {
        let old = self.primary();
        self.await_sync(old)?;
        self.replication.set_stalled(true);
        let mut cancelled = 0;
        let until = Instant::now() + Duration::from_secs(2);
        while Instant::now() < until {
            cancelled += self
                .psql(
                    old,
                    "SELECT count(pg_cancel_backend(pid)) FROM pg_stat_activity \
                     WHERE wait_event = 'SyncRep'",
                )
                .ok()
                .and_then(|n| n.parse::<usize>().ok())
                .unwrap_or(0);
            std::thread::sleep(Duration::from_millis(20));
        }
        self.promote_the_standby(old)?;
        Ok(cancelled)
    }

    /// Node `old` (the primary) stopped immediately, the other promoted and
    /// the address pointed at it, `old` rebuilt as its standby.
    fn promote_the_standby(&self, old: usize) -> Result<(), String> {
        let new = 1 - old;
        self.ctl(&self.nodes[old], &["stop", "-m", "immediate"])?;
        // What the partition held back never arrives.
        self.replication.cut_all();
        self.replication.set_stalled(false);
        self.ctl(&self.nodes[new], &["promote"])?;
        let new_primary = format!("127.0.0.1:{}", self.nodes[new].port);
        self.address.set_upstream(new_primary.clone());
        self.replication.set_upstream(new_primary);
        self.address.cut_all();
        if let Ok(mut primary) = self.primary.lock() {
            *primary = new;
        }
        self.rebuild_as_standby(old, new)
    }

    /// Node `standby`'s data replaced by a base backup of node `primary`
    /// through the replication forwarder (`-R`: it starts as that one's
    /// standby, streaming the same way), started, and in sync.
    fn rebuild_as_standby(&self, standby: usize, primary: usize) -> Result<(), String> {
        let data = format!(
            "/var/lib/postgresql/{}/{}",
            self.version, self.nodes[standby].name
        );
        run("sh", &["-c", &format!("rm -rf {data}/*")])?;
        let port = self.replication.port.to_string();
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
        )?;
        self.ctl(&self.nodes[standby], &["start"])?;
        self.await_sync(primary)
    }

    /// Waits (30 s at most) until node `primary` has a standby streaming
    /// in sync (streaming at all, when lossy).
    fn await_sync(&self, primary: usize) -> Result<(), String> {
        let until = Instant::now() + Duration::from_secs(30);
        let sql = if self.lossy {
            "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
        } else {
            "SELECT count(*) FROM pg_stat_replication \
             WHERE state = 'streaming' AND sync_state = 'sync'"
        };
        loop {
            if self.psql(primary, sql).is_ok_and(|n| n == "1") {
                return Ok(());
            }
            if Instant::now() > until {
                return Err(format!(
                    "no standby in sync with {} within 30 s",
                    self.nodes[primary].name
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn psql(&self, node: usize, sql: &str) -> Result<String, String> {
        let port = self.nodes[node].port.to_string();
        let out = Command::new("psql")
            .args(["-h", "127.0.0.1", "-p", &port, "-U", "postgres"])
            .args(["-d", "postgres", "-qAtXc", sql])
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    fn make(&self, node: &Node) -> Result<(), String> {
        let port = node.port.to_string();
        run(
            "pg_createcluster",
            &[
                &self.version,
                &node.name,
                "-p",
                &port,
                // Never started at boot: a run killed before it dropped
                // them leaves nothing that comes back (and `create` sweeps).
                "--start-conf=manual",
                "--",
                "--auth-host=trust",
                "--auth-local=trust",
            ],
        )?;
        let conf = format!(
            "/etc/postgresql/{}/{}/conf.d/soak.conf",
            self.version, node.name
        );
        let settings = if self.lossy {
            SETTINGS.to_owned()
        } else {
            format!("{SETTINGS}{SYNCHRONOUS}")
        };
        std::fs::write(&conf, settings).map_err(|e| format!("{conf}: {e}"))
    }

    /// `pg_ctl ACTION` on `node`, waiting for it (`pg_ctlcluster` without
    /// the seconds it adds); a failure says the end of the node's log.
    fn ctl(&self, node: &Node, action: &[&str]) -> Result<(), String> {
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
        let config = format!("/etc/postgresql/{}/{}", self.version, node.name);
        let log = format!(
            "/var/log/postgresql/postgresql-{}-{}.log",
            self.version, node.name
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
}

impl Drop for Pair {
    fn drop(&mut self) {
        for node in &self.nodes {
            let _ = run("pg_dropcluster", &[&self.version, &node.name, "--stop"]);
        }
    }
}

/// Drops the clusters of soaks whose process is gone (killed before they
/// could drop their own).
fn sweep(version: &str) {
    let Ok(entries) = std::fs::read_dir(format!("/etc/postgresql/{version}")) else {
        return;
    };
    for name in entries.filter_map(|e| e.ok()?.file_name().into_string().ok()) {
        let Some(pid) = name
            .strip_prefix("soak_")
            .and_then(|rest| rest.split('_').next())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = run("pg_dropcluster", &[version, &name, "--stop"]);
        }
    }
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
