//! Key retention, for DBAs: idempotency keys older than a retention period
//! are deleted in small batches. Plans, receipts and the feed never change.
//! A request retried under a pruned key is `already_received` (by maker,
//! run and content); another body under it is a new plan.

use std::time::Duration;

/// The shortest retention `keys prune` takes without being told it is
/// meant: twice the longest retry window a `submit` can have
/// (`SubmitOptions::MAX_TIMEOUT` in the client, 24 h; a test holds the
/// two together). A key pruned while its client still
/// retries turns that client's retry with other content into a second plan.
pub const MIN_RETENTION: Duration = Duration::from_secs(48 * 3600);

use crate::storage::plans;
use crate::storage::{DbConn, StorageError};

/// What a prune did, or would do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pruned {
    pub keys: u64,
    pub dry_run: bool,
}

/// Deletes the keys created more than `older_than` ago, `batch` at a time,
/// each batch its own short transaction, so no lock is held between
/// batches and the service's writes go on meanwhile. With `dry_run`, only
/// counts them.
pub fn prune_keys(
    conn: &mut DbConn,
    older_than: Duration,
    batch: u32,
    dry_run: bool,
) -> Result<Pruned, StorageError> {
    let age = chrono::TimeDelta::from_std(older_than).map_err(|_| too_old(older_than))?;
    let before = crate::clock::now_micros()
        .checked_sub_signed(age)
        .ok_or_else(|| too_old(older_than))?;
    // A dry run counts what the real run would be allowed to delete: none
    // without the privilege.
    crate::storage::migrations::require_table_privilege(
        conn,
        "intake_keys",
        "DELETE",
        " --pruner",
    )?;
    if dry_run {
        let keys = plans::count_keys_before(conn, before)?;
        return Ok(Pruned {
            keys: u64::try_from(keys).unwrap_or(0),
            dry_run,
        });
    }
    let mut keys = 0u64;
    loop {
        let deleted = plans::prune_keys_batch(conn, before, i64::from(batch))?;
        keys += deleted as u64;
        if deleted < batch as usize {
            return Ok(Pruned { keys, dry_run });
        }
    }
}

/// An age that reaches before the calendar's start.
fn too_old(older_than: Duration) -> StorageError {
    StorageError::Config(format!(
        "keys older than {} would reach before the calendar's start",
        humantime::format_duration(older_than)
    ))
}
