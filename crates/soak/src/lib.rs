//! The soak (issue 52): the whole system under random faults and routine
//! operations, its history checked. On Postgres (a primary and a
//! synchronous standby of the soak's own, or a database on a given
//! server), two instances signing receipts (one through a real
//! PgBouncer), each behind a fault proxy and on a socket the soak holds
//! across restarts; or one instance on SQLite.
//! Planners send through the client crate with duplicates the way real
//! planners make them; readers follow the feed (in process, `--exec` and
//! `--verify` processes); a nemesis draws from process faults, database
//! connection faults and the routine an operator runs. Every answer and
//! every fault goes to a history file; at the end a checker holds the
//! history and the database to the promise. Seeded: the same seed repeats
//! the same draws (not the interleaving, which the clock decides).
//! ARCHITECTURE.md, "How the product is checked".

mod checker;
mod cluster;
mod history;
mod nemesis;
mod pgbouncer;
mod proxy;
mod readers;
mod system;
mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What to run.
pub struct Options {
    /// The seed of every random draw.
    pub seed: u64,
    /// How long the workload and the nemesis run.
    pub seconds: u64,
    /// Service instances on the one database.
    pub instances: usize,
    /// Planner threads.
    pub planners: usize,
    /// The plan-intake binary to run.
    pub bin: PathBuf,
    /// What the instances keep their plans in.
    pub database: Database,
    /// Where the history goes (one JSON line per event).
    pub history: PathBuf,
    /// More environment for every process it starts, instances and
    /// readers (a test seam's defect switched on, to show the checker
    /// finds it).
    pub env: Vec<(String, String)>,
    /// The nemesis's kinds to draw from (`nemesis::kinds`); every kind
    /// when empty.
    pub faults: Vec<String>,
    /// On Postgres with two instances or more: the last through a real
    /// PgBouncer in transaction mode.
    pub pgbouncer: bool,
}

/// Where the soak's database is.
pub enum Database {
    /// A primary with a synchronous standby, both of the soak's own
    /// (`pg_createcluster`): the nemesis also restarts the primary
    /// immediately and fails over to the standby.
    Replicated,
    /// The checker's control for failovers: the standby asynchronous, and
    /// a second of the primary's WAL held back from it before each
    /// failover, so acknowledged plans are lost (what no synchronous
    /// standby allows).
    ReplicatedLossy,
    /// A database of the soak's own on this Postgres server (its URL,
    /// without a database name).
    Server(String),
    /// One instance on a SQLite file.
    Sqlite,
}

/// What a run found: its violations (one line each, with the seed) and
/// the lines of its summary, the last one such as `soak: seed 7, 22 s,
/// 12596 acknowledgements, 6 faults of 3 kinds, 0 violations`.
pub struct Outcome {
    pub violations: Vec<String>,
    pub summary: Vec<String>,
}

/// A thread joined when dropped (an early return waits for it, so what it
/// holds of the system is let go before the system is dropped).
struct Joined<T>(Option<std::thread::JoinHandle<T>>);

impl<T> Joined<T> {
    fn join(mut self) -> std::thread::Result<T> {
        match self.0.take() {
            Some(handle) => handle.join(),
            None => Err(Box::new("joined already")),
        }
    }
}

impl<T> Drop for Joined<T> {
    fn drop(&mut self) {
        if let Some(handle) = self.0.take() {
            let _ = handle.join();
        }
    }
}

/// Sets both flags when dropped.
struct Release(Arc<AtomicBool>, Arc<AtomicBool>);

impl Drop for Release {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
        self.1.store(true, Ordering::Relaxed);
    }
}

pub use nemesis::kinds as fault_kinds;

/// Runs the soak; `Err` when it could not run at all.
pub fn run(options: &Options) -> Result<Outcome, String> {
    if let Some(unknown) = options
        .faults
        .iter()
        .find(|f| !nemesis::kinds().contains(&f.as_str()))
    {
        return Err(format!(
            "no fault {unknown:?}: the kinds are {}",
            nemesis::kinds().join(", ")
        ));
    }
    let seed = options.seed;
    let history = Arc::new(history::History::create(&options.history)?);
    let system = Arc::new(system::System::start(
        &options.bin,
        &options.database,
        if matches!(options.database, Database::Sqlite) {
            1
        } else {
            options.instances
        },
        seed,
        options.planners,
        &options.env,
        options.pgbouncer,
    )?);
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let drain = Arc::new(AtomicBool::new(false));
    let follower = Joined(Some(workload::follower(
        system.clone(),
        history.clone(),
        stop.clone(),
        drain.clone(),
    )));
    let planners: Vec<Joined<usize>> =
        workload::planners(system.clone(), history.clone(), stop.clone(), seed)
            .into_iter()
            .map(|planner| Joined(Some(planner)))
            .collect();
    // On any early return (dropped first, as declared last) the threads
    // are told to end and joined, and the system (instances, database,
    // clusters) is dropped after them.
    let _release = Release(stop.clone(), drain.clone());
    let faults = nemesis::run(
        system.clone(),
        history.clone(),
        seed,
        started + Duration::from_secs(options.seconds),
        &options.faults,
    );
    stop.store(true, Ordering::Relaxed);
    let mut acknowledged = 0;
    for planner in planners {
        acknowledged += planner.join().map_err(|_| "a planner panicked")?;
    }
    history.record(serde_json::json!({"kind": "phase", "phase": "workload over"}));
    system.all_up()?;
    drain.store(true, Ordering::Relaxed);
    let followed = follower.join().map_err(|_| "the follower panicked")?;
    history.record(serde_json::json!({"kind": "phase", "phase": "follower drained"}));
    system.finish_readers();
    history.record(serde_json::json!({"kind": "phase", "phase": "readers drained"}));
    let violations: Vec<String> = checker::check(&system, &history, &followed)?
        .into_iter()
        .map(|violation| format!("violation: seed {seed}: {violation}"))
        .collect();
    history.record(serde_json::json!({"kind": "phase", "phase": "checked"}));
    let mut summary = faults.recovery_lines();
    summary.extend(checker::notes(&system, &history));
    summary.extend(system.pair.as_ref().map(cluster::Pair::describe));
    summary.push(format!(
        "soak: seed {seed}, {} s, {acknowledged} acknowledgements, {} faults of {} kinds, {} violations",
        started.elapsed().as_secs(),
        faults.count(),
        faults.kinds(),
        violations.len()
    ));
    Ok(Outcome {
        violations,
        summary,
    })
}
