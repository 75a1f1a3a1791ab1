//! The receipt log's tables: leaves in feed order, the tree's stored
//! hashes (Go tlog's numbering), signed checkpoints, the appenders' one
//! state row, and the keys that have signed.
//!
//! An append is one transaction: take the state row (Postgres: `FOR UPDATE
//! SKIP LOCKED`, so a second instance skips the round instead of queueing;
//! SQLite: a write to it first, which takes the file's write lock before
//! anything is read), read the settled feed after its position,
//! add the leaves and the hashes they complete, sign a checkpoint of the new
//! size once it is shown consistent with the last one signed, move the
//! state on, commit. A crash anywhere before COMMIT leaves the tree as it
//! was: the next round resumes from the same state, so the tree is never
//! forked.

use std::cell::RefCell;
use std::collections::HashMap;

use chrono::NaiveDateTime;
use diesel::prelude::*;
use tlog_tiles::{Hash, HashReader};

use super::DbConn;
use super::feed::{FeedPosition, PageRows, feed_page};
use super::plans::{PlanRow, ReceiptRow};
use super::schema::{
    plans, receipt_log, receipt_log_checkpoints, receipt_log_hashes, receipt_log_state,
    signing_keys,
};
use crate::with_conn;

/// A signed checkpoint as stored.
#[derive(Debug, Clone, PartialEq, Eq, Queryable, Selectable)]
#[diesel(table_name = receipt_log_checkpoints)]
pub struct CheckpointRow {
    pub tree_size: i64,
    pub root_hash: Vec<u8>,
    pub note: String,
    pub signed_at: NaiveDateTime,
}

impl CheckpointRow {
    pub fn root(&self) -> Option<Hash> {
        <[u8; 32]>::try_from(self.root_hash.as_slice())
            .ok()
            .map(Hash)
    }
}

/// A leaf as stored.
#[derive(Debug, Clone, PartialEq, Eq, Queryable, Selectable)]
#[diesel(table_name = receipt_log)]
pub struct LeafRow {
    pub leaf_index: i64,
    pub receipt_id: String,
    pub leaf_hash: Vec<u8>,
}

#[derive(Queryable, Selectable)]
#[diesel(table_name = receipt_log_state)]
struct StateRow {
    tree_size: i64,
    after_feed_xid: i64,
    after_plan_id: i64,
}

/// Why an append round wrote nothing.
#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    #[error(transparent)]
    Database(#[from] diesel::result::Error),
    #[error("the receipt log's stored hashes do not make a tree: {0}")]
    Tree(String),
    /// The tree as stored is not an extension of a checkpoint already
    /// signed: nothing is signed until an operator looks.
    #[error(
        "the receipt log at size {size} is not an extension of the checkpoint of size {signed} already signed; no checkpoint is signed until this is explained"
    )]
    Inconsistent { size: u64, signed: u64 },
    /// A receipt that cannot be made into a leaf (a row that does not read
    /// back as a receipt).
    #[error("receipt {receipt_id} cannot be made into a leaf")]
    Leaf {
        receipt_id: String,
        #[source]
        source: WriterError,
    },
    #[error("the checkpoint cannot be signed")]
    Signing(#[source] WriterError),
}

/// What a round did: the tree's size before and after, and the
/// checkpoint it signed (none when nothing was appended).
#[derive(Debug, Clone, PartialEq)]
pub struct Appended {
    pub from: u64,
    pub to: u64,
    pub checkpoint: Option<(u64, Hash)>,
}

/// What an append needs from the domain: each receipt's leaf bytes, and a
/// signed checkpoint note for a size and root.
pub trait LogWriter {
    fn leaf(&self, row: &ReceiptRow) -> Result<Vec<u8>, WriterError>;
    fn checkpoint(&self, size: u64, root: Hash) -> Result<String, WriterError>;
}

/// Why the domain could not make a leaf or a checkpoint, kept whole.
pub type WriterError = Box<dyn std::error::Error + Send + Sync>;

/// Reads stored hashes inside the caller's connection, after the ones an
/// append is about to store.
/// A read's database error is kept: the tree code sees only that a hash
/// could not be read, and what it makes of that (a proof that fails, a
/// tree that does not extend) is the database's failure, to be retried on
/// another connection, never a verdict on the log.
struct StoredHashes<'c> {
    conn: RefCell<&'c mut DbConn>,
    known: RefCell<HashMap<u64, Hash>>,
    failed: RefCell<Option<diesel::result::Error>>,
}

impl<'c> StoredHashes<'c> {
    fn new(conn: &'c mut DbConn) -> Self {
        Self {
            conn: RefCell::new(conn),
            known: RefCell::default(),
            failed: RefCell::default(),
        }
    }

    /// Why a proof could not be made of the stored hashes: the database's
    /// error if a read met one, else the tree's.
    fn proof_error(&self, e: tlog_tiles::Error) -> ProofError {
        match self.failed.borrow_mut().take() {
            Some(database) => ProofError::Database(database),
            None => ProofError::Tree(e.to_string()),
        }
    }

    /// [`StoredHashes::proof_error`] for an append round.
    fn append_error(&self, e: tlog_tiles::Error) -> AppendError {
        match self.failed.borrow_mut().take() {
            Some(database) => AppendError::Database(database),
            None => AppendError::Tree(e.to_string()),
        }
    }
}

impl HashReader for StoredHashes<'_> {
    fn read_hashes(&self, indexes: &[u64]) -> Result<Vec<Hash>, tlog_tiles::Error> {
        let mut known = self.known.borrow_mut();
        let missing: Vec<i64> = indexes
            .iter()
            .filter(|i| !known.contains_key(i))
            .filter_map(|&i| i64::try_from(i).ok())
            .collect();
        if !missing.is_empty() {
            let mut conn = self.conn.borrow_mut();
            let found: Vec<(i64, Vec<u8>)> = with_conn!(&mut **conn, c => {
                receipt_log_hashes::table
                    .filter(receipt_log_hashes::hash_index.eq_any(&missing))
                    .select((receipt_log_hashes::hash_index, receipt_log_hashes::hash))
                    .load(c)
            })
            .map_err(|e| {
                let said = tlog_tiles::Error::InvalidInput(format!("reading stored hashes: {e}"));
                *self.failed.borrow_mut() = Some(e);
                said
            })?;
            for (index, bytes) in found {
                let hash = <[u8; 32]>::try_from(bytes.as_slice())
                    .map_err(|_| tlog_tiles::Error::MalformedHash)?;
                known.insert(u64::try_from(index).unwrap_or(0), Hash(hash));
            }
        }
        indexes
            .iter()
            .map(|i| {
                known
                    .get(i)
                    .copied()
                    .ok_or(tlog_tiles::Error::IndexesNotInTree)
            })
            .collect()
    }
}

/// One append round of up to `limit` settled receipts (see the module's
/// comment). `Ok(None)`: another instance holds the log now. `signed`: the
/// last checkpoint this process signed, which the new one must extend too.
pub fn append(
    conn: &mut DbConn,
    limit: i64,
    writer: &dyn LogWriter,
    signed: Option<(u64, Hash)>,
    now: NaiveDateTime,
) -> Result<Option<Appended>, AppendError> {
    let work = |conn: &mut DbConn| -> Result<Option<Appended>, AppendError> {
        let Some(state) = take_state(conn)? else {
            return Ok(None);
        };
        let after = FeedPosition {
            xid: state.after_feed_xid,
            id: state.after_plan_id,
        };
        let (PageRows::Receipts(rows), _) = feed_page(conn, after, limit, false)? else {
            return Ok(Some(Appended::nothing(state.tree_size)));
        };
        let from = u64::try_from(state.tree_size).unwrap_or(0);
        let Some((last_xid, last_row)) = rows.last().map(|(xid, row)| (*xid, row.id)) else {
            return Ok(Some(Appended::nothing(state.tree_size)));
        };
        #[cfg(feature = "test-seams")]
        if holds_round(from + rows.len() as u64) {
            return Ok(Some(Appended::nothing(state.tree_size)));
        }
        let last_checkpoint = latest_checkpoint(conn)?;
        let tree = StoredHashes::new(conn);
        let (leaves, new_hashes) = add_leaves(&tree, from, &rows, &|row| writer.leaf(row))?;
        let to = from + rows.len() as u64;
        let root = tlog_tiles::tree_hash(to, &tree).map_err(|e| tree.append_error(e))?;
        let stored_signed = last_checkpoint
            .as_ref()
            .and_then(|c| Some((u64::try_from(c.tree_size).ok()?, c.root()?)));
        for (size, signed_root) in [stored_signed, signed].into_iter().flatten() {
            extends(&tree, to, root, size, signed_root)?;
        }
        let note = writer.checkpoint(to, root).map_err(AppendError::Signing)?;
        drop(tree);
        with_conn!(conn, c => {
            for chunk in leaves.chunks(1000) {
                let rows: Vec<_> = chunk
                    .iter()
                    .map(|(index, id, hash)| {
                        (
                            receipt_log::leaf_index.eq(index),
                            receipt_log::receipt_id.eq(id),
                            receipt_log::leaf_hash.eq(hash),
                        )
                    })
                    .collect();
                diesel::insert_into(receipt_log::table).values(&rows).execute(c)?;
            }
            for chunk in new_hashes.chunks(1000) {
                let rows: Vec<_> = chunk
                    .iter()
                    .map(|(index, hash)| {
                        (
                            receipt_log_hashes::hash_index.eq(index),
                            receipt_log_hashes::hash.eq(hash),
                        )
                    })
                    .collect();
                diesel::insert_into(receipt_log_hashes::table).values(&rows).execute(c)?;
            }
            diesel::insert_into(receipt_log_checkpoints::table)
                .values((
                    receipt_log_checkpoints::tree_size.eq(to_i64(to)),
                    receipt_log_checkpoints::root_hash.eq(root.0.to_vec()),
                    receipt_log_checkpoints::note.eq(&note),
                    receipt_log_checkpoints::signed_at.eq(now),
                ))
                .execute(c)?;
            diesel::update(receipt_log_state::table.filter(receipt_log_state::id.eq(1)))
                .set((
                    receipt_log_state::tree_size.eq(to_i64(to)),
                    receipt_log_state::after_feed_xid.eq(last_xid),
                    receipt_log_state::after_plan_id.eq(last_row),
                ))
                .execute(c)
        })?;
        #[cfg(feature = "test-seams")]
        stall_mid_append(to, root);
        Ok(Some(Appended {
            from,
            to,
            checkpoint: Some((to, root)),
        }))
    };
    super::in_transaction(conn, work)
}

/// New leaves (`(leaf_index, receipt_id, leaf_hash)`) and the stored
/// hashes they complete (`(hash_index, hash)`).
type NewLeaves = (Vec<(i64, String, Vec<u8>)>, Vec<(i64, Vec<u8>)>);

/// Appends `rows` as leaves `from..` to `tree` (in memory: `tree.known`),
/// for the caller to store.
fn add_leaves(
    tree: &StoredHashes<'_>,
    from: u64,
    rows: &[(i64, ReceiptRow)],
    leaf_of: &dyn Fn(&ReceiptRow) -> Result<Vec<u8>, WriterError>,
) -> Result<NewLeaves, AppendError> {
    let mut leaves = Vec::with_capacity(rows.len());
    let mut new_hashes: Vec<(i64, Vec<u8>)> = Vec::new();
    for (at, (_, row)) in rows.iter().enumerate() {
        let n = from + at as u64;
        let leaf = leaf_of(row).map_err(|source| AppendError::Leaf {
            receipt_id: row.receipt_id.clone(),
            source,
        })?;
        let hashes = tlog_tiles::stored_hashes(n, &leaf, tree).map_err(|e| tree.append_error(e))?;
        let first = tlog_tiles::stored_hash_index(0, n);
        let mut known = tree.known.borrow_mut();
        for (k, hash) in hashes.iter().enumerate() {
            known.insert(first + k as u64, *hash);
            new_hashes.push((to_i64(first + k as u64), hash.0.to_vec()));
        }
        leaves.push((to_i64(n), row.receipt_id.clone(), hashes[0].0.to_vec()));
    }
    Ok((leaves, new_hashes))
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Appended {
    fn nothing(size: i64) -> Self {
        let size = u64::try_from(size).unwrap_or(0);
        Self {
            from: size,
            to: size,
            checkpoint: None,
        }
    }
}

/// The state row, taken for this transaction: Postgres skips the round
/// when another appender holds it; SQLite's first write takes the file's
/// write lock (waiting as every writer does) before anything is read.
fn take_state(conn: &mut DbConn) -> QueryResult<Option<StateRow>> {
    match conn {
        DbConn::Postgres(pg) => {
            // An appender that hangs inside its round (a stopped process, a
            // partition) must not hold the log for the other instances for
            // good: its session ends after a minute idle, and the round
            // with it.
            diesel::sql_query(
                "SELECT set_config('idle_in_transaction_session_timeout', '60000', true)",
            )
            .execute(pg)?;
            receipt_log_state::table
                .filter(receipt_log_state::id.eq(1))
                .select(StateRow::as_select())
                .for_update()
                .skip_locked()
                .first(pg)
                .optional()
        }
        DbConn::Sqlite(lite) => {
            diesel::update(receipt_log_state::table.filter(receipt_log_state::id.eq(1)))
                .set(receipt_log_state::tree_size.eq(receipt_log_state::tree_size))
                .execute(lite)?;
            receipt_log_state::table
                .filter(receipt_log_state::id.eq(1))
                .select(StateRow::as_select())
                .first(lite)
                .optional()
        }
    }
}

/// Whether the tree of `size` with `root` extends the signed tree of
/// `signed` leaves with `signed_root`, by a consistency proof read from the
/// stored hashes.
fn extends(
    tree: &StoredHashes<'_>,
    size: u64,
    root: Hash,
    signed: u64,
    signed_root: Hash,
) -> Result<(), AppendError> {
    let inconsistent = AppendError::Inconsistent { size, signed };
    if signed > size {
        return Err(inconsistent);
    }
    if signed == 0 {
        return Ok(());
    }
    let proof = tlog_tiles::prove_tree(size, signed, tree).map_err(|e| {
        match tree.append_error(e) {
            // A hash the database would not give is no inconsistency.
            database @ AppendError::Database(_) => database,
            _ => AppendError::Inconsistent { size, signed },
        }
    })?;
    tlog_tiles::check_tree(&proof, size, root, signed, signed_root).map_err(|_| inconsistent)
}

/// Whether the log as stored extends the checkpoint of `signed` leaves and
/// root (one kept outside the database): read, nothing written. A
/// database restored to before it, or a log that forked from it, does not.
/// A log short of it does if the receipts settled after its last leaf
/// make that very tree (`leaf_of` makes their leaves): the checkpoint is
/// kept before its round commits, so a process stopped in between leaves
/// the file one round ahead of a database that still holds every receipt
/// of that round. A restore lost some of them, or holds others.
pub fn check_extends(
    conn: &mut DbConn,
    signed: (u64, Hash),
    leaf_of: &dyn Fn(&ReceiptRow) -> Result<Vec<u8>, WriterError>,
) -> Result<(), AppendError> {
    let state: StateRow = with_conn!(conn, c => receipt_log_state::table
        .filter(receipt_log_state::id.eq(1))
        .select(StateRow::as_select())
        .first(c))?;
    let size = u64::try_from(state.tree_size).unwrap_or(0);
    if size < signed.0 {
        let after = FeedPosition {
            xid: state.after_feed_xid,
            id: state.after_plan_id,
        };
        let short = AppendError::Inconsistent {
            size,
            signed: signed.0,
        };
        let wanted = i64::try_from(signed.0 - size).map_err(|_| short)?;
        let (PageRows::Receipts(rows), _) = feed_page(conn, after, wanted, false)? else {
            return Err(AppendError::Inconsistent {
                size,
                signed: signed.0,
            });
        };
        let reached = size + rows.len() as u64;
        let tree = StoredHashes::new(conn);
        add_leaves(&tree, size, &rows, leaf_of)?;
        let root = tlog_tiles::tree_hash(reached, &tree).map_err(|e| tree.append_error(e))?;
        return extends(&tree, reached, root, signed.0, signed.1);
    }
    let tree = StoredHashes::new(conn);
    let root = tlog_tiles::tree_hash(size, &tree).map_err(|e| tree.append_error(e))?;
    extends(&tree, size, root, signed.0, signed.1)
}

/// What the receipt log holds: its leaves and checkpoints, and its newest
/// checkpoint.
pub fn log_extent(conn: &mut DbConn) -> QueryResult<(u64, u64, Option<CheckpointRow>)> {
    let (size, _) = log_position(conn)?;
    let checkpoints: i64 = with_conn!(conn, c => receipt_log_checkpoints::table
        .count()
        .get_result(c))?;
    Ok((
        size,
        u64::try_from(checkpoints).unwrap_or(0),
        latest_checkpoint(conn)?,
    ))
}

/// Empties the receipt log (as the database's owner: the service's role
/// may not): its leaves, stored hashes and checkpoints, and its state
/// back to the feed's start, in one transaction that first takes the
/// state row from any appender. The next signing `serve` logs every plan
/// again, from the first, under the origin it is given. Plans, their
/// signatures and the published keys stay. The old newest checkpoint.
pub fn start_new_log(conn: &mut DbConn) -> QueryResult<Option<CheckpointRow>> {
    super::in_transaction(conn, |conn| {
        with_conn!(conn, c => diesel::update(receipt_log_state::table.filter(receipt_log_state::id.eq(1)))
            .set((
                receipt_log_state::tree_size.eq(0i64),
                receipt_log_state::after_feed_xid.eq(0i64),
                receipt_log_state::after_plan_id.eq(0i64),
            ))
            .execute(c))?;
        let newest = latest_checkpoint(conn)?;
        with_conn!(conn, c => {
            diesel::delete(receipt_log_checkpoints::table).execute(c)?;
            diesel::delete(receipt_log_hashes::table).execute(c)?;
            diesel::delete(receipt_log::table).execute(c)
        })?;
        Ok(newest)
    })
}

/// The stored hashes rewritten (as the database's owner, every instance
/// stopped), in one transaction that first takes the state row from any
/// appender: `mend` is given the leaves' hashes in order, the newest
/// checkpoint and the stored hashes, and answers the hashes to store in
/// their place (`Ok(None)`: nothing to change) or why it will not.
pub fn rewrite_hashes<T>(
    conn: &mut DbConn,
    mend: impl FnOnce(u64, &[Vec<u8>], Option<&CheckpointRow>, &[HashRow]) -> MendAnswer<T>,
) -> Result<Option<T>, RewriteError> {
    super::in_transaction(conn, |conn| {
        let Some(state) = take_state(conn)? else {
            return Err(RewriteError::Busy);
        };
        if let DbConn::Postgres(pg) = conn {
            // A large log is read and hashed inside this transaction: the
            // appender's one-minute idle limit is not for it.
            diesel::sql_query(
                "SELECT set_config('idle_in_transaction_session_timeout', '0', true)",
            )
            .execute(pg)?;
        }
        let state_size = u64::try_from(state.tree_size).unwrap_or(u64::MAX);
        let leaves: Vec<Vec<u8>> = leaves(conn)?.into_iter().map(|l| l.leaf_hash).collect();
        let newest = latest_checkpoint(conn)?;
        let stored = with_conn!(conn, c => receipt_log_hashes::table
            .order(receipt_log_hashes::hash_index.asc())
            .select((receipt_log_hashes::hash_index, receipt_log_hashes::hash))
            .load(c))?;
        let Some((hashes, said)) = mend(state_size, &leaves, newest.as_ref(), &stored)? else {
            return Ok(None);
        };
        with_conn!(conn, c => diesel::delete(receipt_log_hashes::table).execute(c))?;
        for chunk in hashes.chunks(500) {
            let rows: Vec<_> = chunk
                .iter()
                .map(|(index, hash)| {
                    (
                        receipt_log_hashes::hash_index.eq(*index),
                        receipt_log_hashes::hash.eq(hash.as_slice()),
                    )
                })
                .collect();
            with_conn!(conn, c => diesel::insert_into(receipt_log_hashes::table)
                .values(&rows)
                .execute(c))?;
        }
        Ok(Some(said))
    })
}

/// A stored hash as a row: (index, hash).
pub type HashRow = (i64, Vec<u8>);
/// What a mend of the stored hashes answers: the rows to store and what
/// to say, nothing to change, or why it will not.
pub type MendAnswer<T> = Result<Option<(Vec<HashRow>, T)>, RewriteError>;

#[derive(Debug, thiserror::Error)]
pub enum RewriteError {
    /// The log is not what a rewrite of its hashes can mend.
    #[error("{0}")]
    Refused(String),
    /// Something to write, not asked to write it (nothing was written).
    #[error("{0}")]
    WouldWrite(String),
    /// An appender holds the log's state row right now.
    #[error("an appender holds the receipt log: stop every instance first")]
    Busy,
    #[error(transparent)]
    Database(#[from] diesel::result::Error),
}

/// When the oldest receipt settled in the feed but not yet in the log was
/// received (`None`: the log holds every settled receipt).
pub fn oldest_unlogged(conn: &mut DbConn) -> QueryResult<Option<NaiveDateTime>> {
    let state: StateRow = with_conn!(conn, c => receipt_log_state::table
        .filter(receipt_log_state::id.eq(1))
        .select(StateRow::as_select())
        .first(c))?;
    let after = FeedPosition {
        xid: state.after_feed_xid,
        id: state.after_plan_id,
    };
    Ok(match feed_page(conn, after, 1, false)?.0 {
        PageRows::Receipts(rows) => rows.first().map(|(_, row)| row.received_at),
        PageRows::Plans(rows) => rows.first().map(|(_, row)| row.received_at),
    })
}

/// The newest checkpoint signed, if any.
pub fn latest_checkpoint(conn: &mut DbConn) -> QueryResult<Option<CheckpointRow>> {
    with_conn!(conn, c => receipt_log_checkpoints::table
        .order(receipt_log_checkpoints::tree_size.desc())
        .select(CheckpointRow::as_select())
        .first(c)
        .optional())
}

/// Every checkpoint signed, oldest first.
fn checkpoints(conn: &mut DbConn) -> QueryResult<Vec<CheckpointRow>> {
    with_conn!(conn, c => receipt_log_checkpoints::table
        .order(receipt_log_checkpoints::tree_size.asc())
        .select(CheckpointRow::as_select())
        .load(c))
}

/// Every leaf, in the log's order.
fn leaves(conn: &mut DbConn) -> QueryResult<Vec<LeafRow>> {
    with_conn!(conn, c => receipt_log::table
        .order(receipt_log::leaf_index.asc())
        .select(LeafRow::as_select())
        .load(c))
}

/// Everything an audit reads, from one snapshot.
pub struct AuditData {
    pub plans: Vec<(i64, PlanRow)>,
    pub leaves: Vec<LeafRow>,
    pub checkpoints: Vec<CheckpointRow>,
    /// Every stored hash of the tree, by index.
    pub hashes: Vec<(i64, Vec<u8>)>,
    pub state_size: u64,
    pub logged_to: FeedPosition,
    pub keys: Vec<KeyRow>,
}

/// Reads the plans, the log and the keys in one read-only transaction
/// (Postgres: REPEATABLE READ, one snapshot; SQLite: one read transaction),
/// so an append or a write meanwhile cannot look like a removal.
pub fn audit_data(conn: &mut DbConn) -> QueryResult<AuditData> {
    super::in_transaction(conn, |conn| {
        if let DbConn::Postgres(pg) = conn {
            diesel::sql_query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                .execute(pg)?;
        }
        let (state_size, logged_to) = log_position(conn)?;
        let hashes = with_conn!(conn, c => receipt_log_hashes::table
            .order(receipt_log_hashes::hash_index.asc())
            .select((receipt_log_hashes::hash_index, receipt_log_hashes::hash))
            .load(c))?;
        Ok(AuditData {
            checkpoints: checkpoints(conn)?,
            leaves: leaves(conn)?,
            plans: plans_in_feed_order(conn)?,
            keys: signing_keys(conn)?,
            hashes,
            state_size,
            logged_to,
        })
    })
}

/// Every plan, in feed order, with its feed position: what an audit
/// recomputes the log from.
fn plans_in_feed_order(conn: &mut DbConn) -> QueryResult<Vec<(i64, PlanRow)>> {
    with_conn!(conn, c => plans::table
        .order((plans::feed_xid.asc(), plans::id.asc()))
        .select((plans::feed_xid, PlanRow::as_select()))
        .load(c))
}

/// How far the log has come: its size and the feed position of its last leaf.
pub fn log_position(conn: &mut DbConn) -> QueryResult<(u64, FeedPosition)> {
    let state: StateRow = with_conn!(conn, c => receipt_log_state::table
        .filter(receipt_log_state::id.eq(1))
        .select(StateRow::as_select())
        .first(c))?;
    Ok((
        u64::try_from(state.tree_size).unwrap_or(0),
        FeedPosition {
            xid: state.after_feed_xid,
            id: state.after_plan_id,
        },
    ))
}

/// Why no proof is answered.
#[derive(Debug, thiserror::Error)]
pub enum ProofError {
    #[error(transparent)]
    Database(#[from] diesel::result::Error),
    /// The receipt is not in the log yet, or not yet under a checkpoint.
    #[error("not in a signed checkpoint yet")]
    NotYet,
    #[error("the receipt log's stored hashes do not make a tree: {0}")]
    Tree(String),
    /// Asked from a checkpoint of `since` leaves, more than the newest.
    #[error("the newest checkpoint holds {newest} leaves, fewer than the {since} asked from")]
    RolledBack { since: u64, newest: u64 },
}

/// An inclusion proof of `receipt_id` in the newest checkpoint: its leaf
/// index, the proof's hashes and the checkpoint.
pub fn inclusion_proof(
    conn: &mut DbConn,
    receipt_id: &str,
) -> Result<(u64, Vec<Hash>, CheckpointRow), ProofError> {
    let index: Option<i64> = with_conn!(conn, c => receipt_log::table
        .filter(receipt_log::receipt_id.eq(receipt_id))
        .select(receipt_log::leaf_index)
        .first(c)
        .optional())?;
    let checkpoint = latest_checkpoint(conn)?.ok_or(ProofError::NotYet)?;
    let index = index
        .and_then(|i| u64::try_from(i).ok())
        .filter(|&i| i < u64::try_from(checkpoint.tree_size).unwrap_or(0))
        .ok_or(ProofError::NotYet)?;
    let size = u64::try_from(checkpoint.tree_size).unwrap_or(0);
    let tree = StoredHashes::new(conn);
    let proof = tlog_tiles::prove_record(size, index, &tree).map_err(|e| tree.proof_error(e))?;
    Ok((index, proof, checkpoint))
}

/// A consistency proof from the tree of `old` leaves to the one of `new`
/// (both at most the newest checkpoint's size).
pub fn consistency_proof(conn: &mut DbConn, old: u64, new: u64) -> Result<Vec<Hash>, ProofError> {
    let size = latest_checkpoint(conn)?
        .and_then(|c| u64::try_from(c.tree_size).ok())
        .unwrap_or(0);
    if old == 0 || old > new || new > size {
        return Err(ProofError::NotYet);
    }
    let tree = StoredHashes::new(conn);
    tlog_tiles::prove_tree(new, old, &tree).map_err(|e| tree.proof_error(e))
}

/// The newest checkpoint, the proof from a tree of `size` leaves, and the
/// one from a tree of `since` leaves if asked and possible.
pub type Extension = (CheckpointRow, Vec<Hash>, Option<Vec<Hash>>);

/// The newest checkpoint and the consistency proofs to it from the trees
/// of `size` leaves and of `since` leaves (a proof from 0 leaves, or from
/// the checkpoint's own size, is empty). `NotYet` while the newest
/// checkpoint holds fewer than `size`; `RolledBack` when it holds fewer
/// than `since`, which a checkpoint signed before held: no wait mends it.
pub fn extension(
    conn: &mut DbConn,
    size: u64,
    since: Option<u64>,
) -> Result<Extension, ProofError> {
    let Some(checkpoint) = latest_checkpoint(conn)? else {
        return Err(match since {
            Some(since) if since > 0 => ProofError::RolledBack { since, newest: 0 },
            _ => ProofError::NotYet,
        });
    };
    let newest = u64::try_from(checkpoint.tree_size).unwrap_or(0);
    if let Some(since) = since.filter(|&since| since > newest) {
        return Err(ProofError::RolledBack { since, newest });
    }
    if size > newest {
        return Err(ProofError::NotYet);
    }
    let mut prove = |old: u64| -> Result<Vec<Hash>, ProofError> {
        if old == 0 || old == newest {
            return Ok(Vec::new());
        }
        let tree = StoredHashes::new(conn);
        tlog_tiles::prove_tree(newest, old, &tree).map_err(|e| tree.proof_error(e))
    };
    let proof = prove(size)?;
    let since_proof = since
        .filter(|&since| since <= newest)
        .map(&mut prove)
        .transpose()?;
    Ok((checkpoint, proof, since_proof))
}

/// A tree's right edge, and its last leaf's feed position and receipt.
pub type Start = (Vec<Hash>, Option<(FeedPosition, String)>);

/// Where a reader starts at the tree of `size` leaves (at most the newest
/// checkpoint's, else `NotYet`): the roots of its perfect subtrees,
/// largest first, and the feed position and receipt of its last leaf
/// whose plan is still there (`None` for the empty tree, or when every
/// leaf's plan is gone).
pub fn start_at(conn: &mut DbConn, size: u64) -> Result<Start, ProofError> {
    let newest = latest_checkpoint(conn)?
        .and_then(|c| u64::try_from(c.tree_size).ok())
        .unwrap_or(0);
    if size > newest {
        return Err(ProofError::NotYet);
    }
    let mut indexes = Vec::new();
    let mut start = 0u64;
    for level in (0..64u8).rev() {
        if size & (1 << level) != 0 {
            indexes.push(tlog_tiles::stored_hash_index(level, start >> level));
            start += 1 << level;
        }
    }
    let tree = StoredHashes::new(conn);
    let edge = tree
        .read_hashes(&indexes)
        .map_err(|e| tree.proof_error(e))?;
    drop(tree);
    let Some(last) = size.checked_sub(1).and_then(|n| i64::try_from(n).ok()) else {
        return Ok((edge, None));
    };
    // The last leaf's plan; if it is gone (deleted around the service),
    // the last plan still there among the leaves before it: the feed skips
    // the gone ones, so after that one is after the last leaf too.
    let receipt_id: String = with_conn!(conn, c => receipt_log::table
        .filter(receipt_log::leaf_index.eq(last))
        .select(receipt_log::receipt_id)
        .first(c))?;
    let position: Option<(i64, i64)> = with_conn!(conn, c => plans::table
        .filter(plans::receipt_id.eq(&receipt_id))
        .select((plans::feed_xid, plans::id))
        .first(c)
        .optional())?;
    if let Some((xid, id)) = position {
        return Ok((edge, Some((FeedPosition { xid, id }, receipt_id))));
    }
    let last_there: Option<(i64, i64, String)> = with_conn!(conn, c => plans::table
        .filter(plans::receipt_id.eq_any(
            receipt_log::table
                .filter(receipt_log::leaf_index.le(last))
                .select(receipt_log::receipt_id),
        ))
        .order((plans::feed_xid.desc(), plans::id.desc()))
        .select((plans::feed_xid, plans::id, plans::receipt_id))
        .first(c)
        .optional())?;
    Ok((
        edge,
        last_there.map(|(xid, id, receipt_id)| (FeedPosition { xid, id }, receipt_id)),
    ))
}

/// The newest checkpoint's size and what a tile of the log holds at it:
/// the data of hash tile `Tile` (`None` beyond the tree).
pub fn hash_tile(
    conn: &mut DbConn,
    level: u8,
    index: u64,
    width: u32,
) -> Result<Option<Vec<u8>>, ProofError> {
    let size = latest_checkpoint(conn)?
        .and_then(|c| u64::try_from(c.tree_size).ok())
        .unwrap_or(0);
    let available = size.checked_shr(8 * u32::from(level)).unwrap_or(0);
    let end = index
        .checked_mul(256)
        .and_then(|start| start.checked_add(u64::from(width)));
    if end.is_none_or(|end| end > available) {
        return Ok(None);
    }
    let tree = StoredHashes::new(conn);
    tlog_tiles::Tile::new(8, level, index, width, false)
        .read_data(&tree)
        .map(Some)
        .map_err(|e| tree.proof_error(e))
}

/// The receipts of leaves `from..from + count` in the log's order, if the
/// newest checkpoint holds them all (`None` otherwise); a leaf whose plan
/// is gone has no receipt.
pub fn logged_receipts(
    conn: &mut DbConn,
    from: u64,
    count: u32,
) -> Result<Option<Vec<Option<ReceiptRow>>>, ProofError> {
    let size = latest_checkpoint(conn)?
        .and_then(|c| u64::try_from(c.tree_size).ok())
        .unwrap_or(0);
    let Some(end) = from
        .checked_add(u64::from(count))
        .filter(|&end| end <= size)
    else {
        return Ok(None);
    };
    let (Ok(from), Ok(to)) = (i64::try_from(from), i64::try_from(end)) else {
        return Ok(None);
    };
    let ids: Vec<String> = with_conn!(conn, c => receipt_log::table
        .filter(receipt_log::leaf_index.ge(from))
        .filter(receipt_log::leaf_index.lt(to))
        .order(receipt_log::leaf_index.asc())
        .select(receipt_log::receipt_id)
        .load(c))?;
    let rows: Vec<ReceiptRow> = with_conn!(conn, c => plans::table
        .filter(plans::receipt_id.eq_any(&ids))
        .select(ReceiptRow::as_select())
        .load(c))?;
    let mut by_id: HashMap<String, ReceiptRow> = rows
        .into_iter()
        .map(|r| (r.receipt_id.clone(), r))
        .collect();
    Ok(Some(ids.iter().map(|id| by_id.remove(id)).collect()))
}

/// A key in `signing_keys`: `(key_id, verifier_key, first_used_at, last_used_at)`.
pub type KeyRow = (String, String, NaiveDateTime, NaiveDateTime);

/// Records `key_id` as published (first use kept); with `signs_now`, its
/// last use moves on to `now`, else a known key's times stay.
pub fn publish_key(
    conn: &mut DbConn,
    key_id: &str,
    verifier_key: &str,
    now: NaiveDateTime,
    signs_now: bool,
) -> QueryResult<()> {
    let insert = diesel::insert_into(signing_keys::table)
        .values((
            signing_keys::key_id.eq(key_id),
            signing_keys::verifier_key.eq(verifier_key),
            signing_keys::first_used_at.eq(now),
            signing_keys::last_used_at.eq(now),
        ))
        .on_conflict(signing_keys::key_id);
    with_conn!(conn, c => if signs_now {
        insert
            .do_update()
            .set(signing_keys::last_used_at.eq(now))
            .execute(c)
    } else {
        insert.do_nothing().execute(c)
    })?;
    Ok(())
}

/// Every key that has signed, oldest first.
pub fn signing_keys(conn: &mut DbConn) -> QueryResult<Vec<KeyRow>> {
    with_conn!(conn, c => signing_keys::table
        .order(signing_keys::first_used_at.asc())
        .select((
            signing_keys::key_id,
            signing_keys::verifier_key,
            signing_keys::first_used_at,
            signing_keys::last_used_at,
        ))
        .load(c))
}

/// Test seam: with `PLAN_INTAKE_TEST_APPEND_FROM=N`, a round that would
/// reach fewer than N leaves appends nothing (so that plans a test writes
/// one after another join one round, whatever the machine's speed).
#[cfg(feature = "test-seams")]
fn holds_round(size: u64) -> bool {
    std::env::var("PLAN_INTAKE_TEST_APPEND_FROM")
        .ok()
        .and_then(|n| n.parse::<u64>().ok())
        .is_some_and(|n| size < n)
}

/// Test seam: with `PLAN_INTAKE_TEST_STALL_APPEND=N`, an append that
/// reaches N leaves or more says so on stderr and waits there, its
/// transaction written but not committed, for a test to kill the process.
#[cfg(feature = "test-seams")]
fn stall_mid_append(size: u64, root: Hash) {
    let threshold = std::env::var("PLAN_INTAKE_TEST_STALL_APPEND")
        .ok()
        .and_then(|n| n.parse::<u64>().ok());
    if threshold.is_some_and(|n| size >= n) {
        eprintln!(
            "plan-intake test seam: append to {size} leaves written, not committed, root {root}"
        );
        loop {
            std::thread::park();
        }
    }
}
