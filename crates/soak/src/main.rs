//! The soak (issue 52, a first step): a Postgres database of its own, two
//! service instances on it, planners sending through the client crate with
//! duplicates the way real planners make them, a follower of the feed, and
//! a nemesis drawing at random from kill -9, SIGSTOP and a graceful
//! restart of an instance. Every answer and every fault goes to a history
//! file; at the end a checker holds the history and the database to the
//! promise. Seeded: `--seed` repeats the same draws.
//!
//! `cargo run -p plan-intake-soak -- --seed 7 --seconds 60` after `cargo
//! build` (it runs `target/debug/plan-intake`, or `--bin PATH`).

mod checker;
mod history;
mod nemesis;
mod system;
mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;

#[derive(Parser)]
#[command(about = "plan-intake under random faults, its history checked")]
struct Args {
    /// The seed of every random draw (printed; random when not given)
    #[arg(long)]
    seed: Option<u64>,
    /// How long the workload and the nemesis run
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Service instances on the one database
    #[arg(long, default_value_t = 2)]
    instances: usize,
    /// Planner threads
    #[arg(long, default_value_t = 4)]
    planners: usize,
    /// The plan-intake binary to run
    #[arg(long, default_value = "target/debug/plan-intake")]
    bin: PathBuf,
    /// The Postgres server (a database of the soak's own is made on it)
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432")]
    postgres: String,
    /// Where the history goes (one JSON line per event)
    #[arg(long, default_value = "target/soak-history.jsonl")]
    history: PathBuf,
}

fn main() {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(rand::random);
    println!(
        "soak: seed {seed}, {} s, {} instances",
        args.seconds, args.instances
    );
    let code = match run(&args, seed) {
        Ok(0) => 0,
        Ok(_) => 1,
        Err(e) => {
            eprintln!("soak: could not run: {e}");
            2
        }
    };
    std::process::exit(code);
}

/// The run: the violations found.
fn run(args: &Args, seed: u64) -> Result<usize, String> {
    let history = Arc::new(history::History::create(&args.history)?);
    let system = Arc::new(system::System::start(
        &args.bin,
        &args.postgres,
        args.instances,
        seed,
        args.planners,
    )?);
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let drain = Arc::new(AtomicBool::new(false));
    let follower = workload::follower(system.clone(), history.clone(), stop.clone(), drain.clone());
    let planners = workload::planners(system.clone(), history.clone(), stop.clone(), seed);
    let faults = nemesis::run(
        system.clone(),
        history.clone(),
        seed,
        started + Duration::from_secs(args.seconds),
    );
    stop.store(true, Ordering::Relaxed);
    let mut acknowledged = 0;
    for planner in planners {
        acknowledged += planner.join().map_err(|_| "a planner panicked")?;
    }
    system.all_up()?;
    drain.store(true, Ordering::Relaxed);
    let followed = follower.join().map_err(|_| "the follower panicked")?;
    let violations = checker::check(&system, &history, &followed)?;
    for violation in &violations {
        println!("violation: seed {seed}: {violation}");
    }
    for line in faults.recovery_lines() {
        println!("{line}");
    }
    println!(
        "soak: seed {seed}, {} s, {acknowledged} acknowledgements, {} faults of {} kinds, {} violations",
        started.elapsed().as_secs(),
        faults.count(),
        faults.kinds(),
        violations.len()
    );
    Ok(violations.len())
}
