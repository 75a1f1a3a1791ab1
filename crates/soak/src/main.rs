//! `cargo run -p plan-intake-soak -- --seed 7 --seconds 60` after `cargo
//! build` (it runs `target/debug/plan-intake`, or `--bin PATH`). Exit 0
//! only without a violation; 2 when it could not run.

use std::path::PathBuf;

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
    /// A Postgres server to make the soak's database on (such as
    /// postgres://postgres@127.0.0.1:5432), instead of a primary and a
    /// synchronous standby of the soak's own (pg_createcluster, as root);
    /// without a standby the nemesis neither restarts the primary nor
    /// fails over
    #[arg(long)]
    postgres: Option<String>,
    /// Only these kinds of fault, comma-separated (every kind when not
    /// given): kill -9, SIGSTOP, graceful restart, database connections
    /// cut, cut after a COMMIT, database connections stalled, a kept plan
    /// under a held key, PgBouncer kill -9, primary restarted immediately,
    /// failover to the synchronous standby, failover after cancelled
    /// standby waits, kill -9 of a reader, logins rotate, keys prune,
    /// migrate run, audit, verify, signing key rotation
    #[arg(long, value_delimiter = ',')]
    faults: Vec<String>,
    /// One instance on a SQLite file instead of the instances on Postgres
    #[arg(long, conflicts_with = "postgres")]
    sqlite: bool,
    /// No PgBouncer in front of the last instance (on Postgres, with two
    /// instances or more, it is there by default)
    #[arg(long)]
    no_pgbouncer: bool,
    /// Where the history goes (one JSON line per event)
    #[arg(long, default_value = "target/soak-history.jsonl")]
    history: PathBuf,
}

fn main() {
    let args = Args::parse();
    let options = plan_intake_soak::Options {
        seed: args.seed.unwrap_or_else(rand::random),
        seconds: args.seconds,
        instances: args.instances,
        planners: args.planners,
        bin: args.bin,
        database: match (args.sqlite, args.postgres) {
            (true, _) => plan_intake_soak::Database::Sqlite,
            (false, Some(server)) => plan_intake_soak::Database::Server(server),
            (false, None) => plan_intake_soak::Database::Replicated,
        },
        history: args.history,
        env: Vec::new(),
        faults: args.faults,
        pgbouncer: !args.no_pgbouncer,
    };
    println!(
        "soak: seed {}, {} s, {} instances",
        options.seed, options.seconds, options.instances
    );
    let code = match plan_intake_soak::run(&options) {
        Ok(outcome) => {
            for line in outcome.violations.iter().chain(&outcome.summary) {
                println!("{line}");
            }
            i32::from(!outcome.violations.is_empty())
        }
        Err(e) => {
            eprintln!("soak: could not run: {e}");
            2
        }
    };
    std::process::exit(code);
}
