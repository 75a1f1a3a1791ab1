//! `plan-intake keys prune`: idempotency-key retention.

use std::time::Duration;

use clap::Subcommand;
use plan_intake::intake::retention::MIN_RETENTION;
use plan_intake::storage::MigrateOnOpen;

use super::{CommandError, DatabaseArgs, open_single, tell};

#[derive(Subcommand)]
pub enum KeysAction {
    /// Delete idempotency keys older than DURATION in small batches; plans,
    /// receipts and the feed stay. A retry under a pruned key is
    /// already_received; another body under it is a new plan.
    Prune {
        /// e.g. 30d, 72h: keys created longer ago than this are deleted
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Duration,
        /// Keys deleted per transaction
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        batch_size: u32,
        /// Only count what the real run would be allowed to delete (the same
        /// floor and privilege apply)
        #[arg(long)]
        dry_run: bool,
        #[arg(long, help = format!(
            "Take an --older-than below the minimum ({}h, twice submit's longest retry window); only when no client retries that long",
            MIN_RETENTION.as_secs() / 3600
        ))]
        allow_short_retention: bool,
    },
}

pub fn run(db: &DatabaseArgs, action: KeysAction) -> Result<(), CommandError> {
    let KeysAction::Prune {
        older_than,
        batch_size,
        dry_run,
        allow_short_retention,
    } = action;
    let minimum = MIN_RETENTION;
    // A dry run counts what the real run would be allowed to delete, so it
    // is held to the same floor.
    if older_than < minimum && !allow_short_retention {
        return Err(CommandError::Usage(format!(
            "--older-than {} is below the minimum retention of {}h: a client still retrying a request whose key was pruned would store a second plan for other content; keep keys longer than any client retries, or pass --allow-short-retention",
            humantime::format_duration(older_than),
            minimum.as_secs() / 3600
        )));
    }
    let mut conn = open_single(db, MigrateOnOpen::RequireNonePending)?;
    let pruned =
        plan_intake::intake::retention::prune_keys(&mut conn, older_than, batch_size, dry_run)?;
    if pruned.dry_run {
        tell!("would delete {} idempotency keys", pruned.keys);
    } else {
        tell!("deleted {} idempotency keys", pruned.keys);
    }
    Ok(())
}
