//! The `plans` and `intake_keys` tables: the two-row write and its lookups.

use chrono::NaiveDateTime;
use diesel::prelude::*;

use super::DbConn;
use super::schema::{intake_keys, plans};
use crate::with_conn;

/// A plan row as stored. Every column, so the whole row can be compared.
#[derive(Debug, Clone, PartialEq, Eq, Queryable, QueryableByName, Selectable)]
#[diesel(table_name = plans)]
pub struct PlanRow {
    pub id: i64,
    pub receipt_id: String,
    pub maker: String,
    pub run_id: String,
    pub content_hash: String,
    pub request_hash: String,
    pub content: String,
    pub approved_inputs: String,
    pub permissions: String,
    pub received_at: NaiveDateTime,
    pub receipt_signature: Option<String>,
}

/// What a receipt shows of a stored plan: every column but the content.
#[derive(Debug, Clone, PartialEq, Eq, Queryable, QueryableByName, Selectable)]
#[diesel(table_name = plans)]
pub struct ReceiptRow {
    pub id: i64,
    pub receipt_id: String,
    pub maker: String,
    pub run_id: String,
    pub content_hash: String,
    pub request_hash: String,
    pub approved_inputs: String,
    pub permissions: String,
    pub received_at: NaiveDateTime,
    pub receipt_signature: Option<String>,
}

impl PlanRow {
    /// The receipt's part of this row.
    pub fn receipt_row(&self) -> ReceiptRow {
        ReceiptRow {
            id: self.id,
            receipt_id: self.receipt_id.clone(),
            maker: self.maker.clone(),
            run_id: self.run_id.clone(),
            content_hash: self.content_hash.clone(),
            request_hash: self.request_hash.clone(),
            approved_inputs: self.approved_inputs.clone(),
            permissions: self.permissions.clone(),
            received_at: self.received_at,
            receipt_signature: self.receipt_signature.clone(),
        }
    }
}

/// A plan about to be written; `receipt_id` and `received_at` are made by
/// the service before the attempt, so a re-read can recognise its own row.
#[derive(Debug, Clone, PartialEq, Eq, Insertable)]
#[diesel(table_name = plans)]
pub struct NewPlan {
    pub receipt_id: String,
    pub maker: String,
    pub run_id: String,
    pub content_hash: String,
    pub request_hash: String,
    pub content: String,
    pub approved_inputs: String,
    pub permissions: String,
    pub received_at: NaiveDateTime,
    /// The receipt's signature as stored (`ReceiptSignature::stored`).
    pub receipt_signature: Option<String>,
}

#[derive(Debug, Insertable)]
#[diesel(table_name = intake_keys)]
struct NewIntakeKey<'a> {
    maker: &'a str,
    idempotency_key: &'a str,
    request_hash: &'a str,
    plan_id: i64,
    created_at: NaiveDateTime,
}

impl NewPlan {
    /// True when `row` is exactly this plan as written: its own receipt id
    /// and every column. A row that merely shares the key is another attempt's.
    pub fn is_stored_as(&self, row: &PlanRow) -> bool {
        let NewPlan {
            receipt_id,
            maker,
            run_id,
            content_hash,
            request_hash,
            content,
            approved_inputs,
            permissions,
            received_at,
            receipt_signature,
        } = self;
        *receipt_id == row.receipt_id
            && *maker == row.maker
            && *run_id == row.run_id
            && *content_hash == row.content_hash
            && *request_hash == row.request_hash
            && *content == row.content
            && *approved_inputs == row.approved_inputs
            && *permissions == row.permissions
            && *received_at == row.received_at
            && *receipt_signature == row.receipt_signature
    }
}

/// A failed two-row write, with what classification needs besides the
/// error: whether the statement that commits had been sent (a lost
/// connection then leaves the outcome unknown) and whether the connection
/// was found dead afterwards.
#[derive(Debug)]
pub struct WriteFailure {
    pub error: diesel::result::Error,
    pub commit_sent: bool,
    pub connection_lost: bool,
    /// SQLite: the shared batch this write was queued in failed as a whole.
    pub batch: Option<BatchFailure>,
}

impl WriteFailure {
    pub fn new(error: diesel::result::Error, commit_sent: bool) -> Self {
        Self {
            error,
            commit_sent,
            connection_lost: false,
            batch: None,
        }
    }
}

/// Why a group-commit batch answered its writers without writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchFailure {
    /// The batch's writer panicked (SQLite); its transaction was abandoned.
    LeaderPanicked,
    /// The batch's COMMIT failed; SQLite rolled it back, so nothing landed.
    CommitFailed,
    /// The request's deadline passed while it was still queued.
    NotWrittenInTime,
    /// No pooled connection freed up for the batch in time.
    NoConnection,
}

impl BatchFailure {
    pub const ALL: [BatchFailure; 4] = [
        BatchFailure::LeaderPanicked,
        BatchFailure::CommitFailed,
        BatchFailure::NotWrittenInTime,
        BatchFailure::NoConnection,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            BatchFailure::LeaderPanicked => "leader_panicked",
            BatchFailure::CommitFailed => "commit_failed",
            BatchFailure::NotWrittenInTime => "deadline",
            BatchFailure::NoConnection => "no_connection",
        }
    }
}

/// What a write found or made; each plan as its receipt shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Written {
    /// This attempt wrote the plan and its key row.
    Created(ReceiptRow),
    /// The key row was already committed: nothing was written. Its request
    /// hash and the plan it points at decide replay or refusal.
    KeyHeld {
        request_hash: String,
        plan: ReceiptRow,
    },
    /// The plan was already kept for this maker, run and content: only this
    /// request's key row was written, pointing at it, so the key is bound
    /// from now on.
    AlreadyReceived(ReceiptRow),
    /// The token no longer names this maker's active login with
    /// `plans:submit` (revoked, rotated past its grace period): nothing was
    /// read or written.
    Unauthorized,
}

/// One row of `plan_intake_write`: what it did (`created`, `key_held`,
/// `already_received` or `unauthorized`), the key's request hash and the
/// plan's receipt columns.
#[derive(QueryableByName)]
struct WriteRow {
    #[diesel(sql_type = diesel::sql_types::Text)]
    outcome: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    key_request_hash: String,
    #[diesel(embed)]
    plan: ReceiptRow,
}

/// Postgres: `SELECT * FROM plan_intake_write(…)`, one statement outside any
/// explicit transaction, one round trip for every outcome (migration
/// `…_plan_intake_write_checks_login`): the login that `token_hash` names
/// is checked first (this maker's, active, with `plans:submit`); a
/// committed key row is answered from a read, without writing; otherwise
/// both rows are written, both or neither. A unique violation rolls both
/// back and is resolved in the same statement: the committed key row
/// decides, else the plan kept for the content gets this request's key
/// row. Its locks wait at most `lock_timeout_ms`.
pub(super) fn write_postgres(
    pg: &mut diesel::PgConnection,
    plan: &NewPlan,
    idempotency_key: &str,
    token_hash: &str,
    lock_timeout_ms: u32,
) -> Result<Written, WriteFailure> {
    use diesel::sql_types::{Integer, Nullable, Text, Timestamp};
    diesel::sql_query(
        "SELECT outcome, key_request_hash, id, receipt_id, maker, run_id, content_hash,
                request_hash, approved_inputs, permissions, received_at, receipt_signature
           FROM plan_intake_write($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
    )
    .bind::<Text, _>(&plan.receipt_id)
    .bind::<Text, _>(&plan.maker)
    .bind::<Text, _>(&plan.run_id)
    .bind::<Text, _>(&plan.content_hash)
    .bind::<Text, _>(&plan.request_hash)
    .bind::<Text, _>(&plan.content)
    .bind::<Text, _>(&plan.approved_inputs)
    .bind::<Text, _>(&plan.permissions)
    .bind::<Timestamp, _>(plan.received_at)
    .bind::<Text, _>(idempotency_key)
    .bind::<Integer, _>(i32::try_from(lock_timeout_ms).unwrap_or(i32::MAX))
    .bind::<Text, _>(token_hash)
    .bind::<Nullable<Text>, _>(plan.receipt_signature.as_deref())
    .get_result::<WriteRow>(pg)
    .and_then(WriteRow::written)
    .map_err(|error| statement_failed(pg, error))
}

/// A failed statement that commits itself: once sent, its outcome is
/// unknown if the connection goes. Whether it went is asked of the
/// connection, only when the error itself does not say (no kind, no
/// SQLSTATE mark).
fn statement_failed(pg: &mut diesel::PgConnection, error: diesel::result::Error) -> WriteFailure {
    let mut failure = WriteFailure::new(error, true);
    let unexplained = matches!(
        &failure.error,
        diesel::result::Error::DatabaseError(diesel::result::DatabaseErrorKind::Unknown, _)
    ) && super::errors::marked_sqlstate(&failure.error).is_none();
    if unexplained {
        failure.connection_lost = !super::is_alive(pg);
    }
    failure
}

impl WriteRow {
    fn written(self) -> QueryResult<Written> {
        match self.outcome.as_str() {
            "created" => Ok(Written::Created(self.plan)),
            "key_held" => Ok(Written::KeyHeld {
                request_hash: self.key_request_hash,
                plan: self.plan,
            }),
            "already_received" => Ok(Written::AlreadyReceived(self.plan)),
            "unauthorized" => Ok(Written::Unauthorized),
            other => Err(diesel::result::Error::DeserializationError(
                format!("plan_intake_write answered an unknown outcome {other:?}").into(),
            )),
        }
    }
}

/// One plan of a Postgres batch: the plan, its key, the caller's token
/// hash and how long its locks may wait.
pub(super) struct BatchEntry<'a> {
    pub plan: &'a NewPlan,
    pub idempotency_key: &'a str,
    pub token_hash: &'a str,
    pub lock_timeout_ms: u32,
}

/// One row of the batch statement: the plan's place in the batch and what
/// `plan_intake_write` did for it.
#[derive(QueryableByName)]
struct BatchRow {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    ord: i64,
    #[diesel(embed)]
    row: WriteRow,
}

/// Postgres group commit: `plan_intake_write_batch` (migration 000019) in
/// one statement that commits itself, so the batch costs one round trip and
/// one commit. Its new plans are written set-based (one INSERT for the
/// plans, one for their key rows, each `ON CONFLICT DO NOTHING`, both rolled
/// back together if a key row met a conflict); what did not land that way
/// (refused, key held, a conflict, a repeat inside the batch) goes through
/// `plan_intake_write` one by one, in the order given, after it, so
/// duplicates inside the batch settle as if sent one after the other. An
/// error none of it resolves fails the whole statement (nothing lands); the
/// caller decides what then. The set-based part keeps two subtransaction
/// ids and each call after it at most two, so a batch stays under the 64 a
/// backend caches while it has at most 31 plans (`MAX_PG_BATCH`).
pub(super) fn write_postgres_batch(
    pg: &mut diesel::PgConnection,
    batch: &[BatchEntry<'_>],
) -> Result<Vec<Written>, WriteFailure> {
    use diesel::sql_types::{Array, Integer, Nullable, Text, Timestamp};
    fn column<'a>(
        batch: &'a [BatchEntry<'a>],
        field: fn(&'a BatchEntry<'a>) -> &'a str,
    ) -> Vec<&'a str> {
        batch.iter().map(field).collect()
    }
    let texts = |field| column(batch, field);
    let rows = diesel::sql_query(
        "SELECT w.ord, w.outcome, w.key_request_hash, w.id, w.receipt_id, w.maker, w.run_id,
                w.content_hash, w.request_hash, w.approved_inputs, w.permissions, w.received_at,
                w.receipt_signature
           FROM plan_intake_write_batch($1::text[], $2::text[], $3::text[], $4::text[],
                       $5::text[], $6::text[], $7::text[], $8::text[], $9::timestamp[],
                       $10::text[], $11::int[], $12::text[], $13::text[]) AS w
          ORDER BY w.ord",
    )
    .bind::<Array<Text>, _>(texts(|e| &e.plan.receipt_id))
    .bind::<Array<Text>, _>(texts(|e| &e.plan.maker))
    .bind::<Array<Text>, _>(texts(|e| &e.plan.run_id))
    .bind::<Array<Text>, _>(texts(|e| &e.plan.content_hash))
    .bind::<Array<Text>, _>(texts(|e| &e.plan.request_hash))
    .bind::<Array<Text>, _>(texts(|e| &e.plan.content))
    .bind::<Array<Text>, _>(texts(|e| &e.plan.approved_inputs))
    .bind::<Array<Text>, _>(texts(|e| &e.plan.permissions))
    .bind::<Array<Timestamp>, _>(batch.iter().map(|e| e.plan.received_at).collect::<Vec<_>>())
    .bind::<Array<Text>, _>(texts(|e| e.idempotency_key))
    .bind::<Array<Integer>, _>(
        batch
            .iter()
            .map(|e| i32::try_from(e.lock_timeout_ms).unwrap_or(i32::MAX))
            .collect::<Vec<_>>(),
    )
    .bind::<Array<Text>, _>(texts(|e| e.token_hash))
    .bind::<Array<Nullable<Text>>, _>(
        batch
            .iter()
            .map(|e| e.plan.receipt_signature.as_deref())
            .collect::<Vec<_>>(),
    )
    .load::<BatchRow>(pg)
    .map_err(|error| statement_failed(pg, error))?;
    let answered_in_order = rows.len() == batch.len()
        && rows
            .iter()
            .enumerate()
            .all(|(at, row)| usize::try_from(row.ord).is_ok_and(|ord| ord == at + 1));
    if !answered_in_order {
        return Err(WriteFailure::new(
            diesel::result::Error::DeserializationError(
                format!(
                    "the batch of {} plans answered {} rows out of order",
                    batch.len(),
                    rows.len()
                )
                .into(),
            ),
            true,
        ));
    }
    rows.into_iter()
        .map(|row| row.row.written())
        .collect::<QueryResult<Vec<_>>>()
        .map_err(|error| WriteFailure::new(error, true))
}

/// SQLite: the plan row, then its key row, inside a transaction (or
/// savepoint) the caller holds. Errors go back to the caller untouched: a
/// violation swallowed inside a transaction would let COMMIT keep half of it.
pub(super) fn insert_both_rows(
    c: &mut diesel::SqliteConnection,
    plan: &NewPlan,
    idempotency_key: &str,
) -> QueryResult<ReceiptRow> {
    let row: ReceiptRow = diesel::insert_into(plans::table)
        .values(plan)
        .returning(ReceiptRow::as_returning())
        .get_result(c)?;
    insert_key_row(c, plan, idempotency_key, row.id)?;
    Ok(row)
}

/// SQLite: this request's key row, pointing at `plan_id`.
pub(super) fn insert_key_row(
    c: &mut diesel::SqliteConnection,
    plan: &NewPlan,
    idempotency_key: &str,
    plan_id: i64,
) -> QueryResult<usize> {
    diesel::insert_into(intake_keys::table)
        .values(NewIntakeKey {
            maker: &plan.maker,
            idempotency_key,
            request_hash: &plan.request_hash,
            plan_id,
            created_at: plan.received_at,
        })
        .execute(c)
}

/// The query for a key row's request hash and the plan it points at (as
/// `$row`: `PlanRow` or `ReceiptRow`), for any backend's connection.
///
/// Lookups by a unique key take the row with `get_result`, never `first`:
/// `first` adds `LIMIT ?`, and SQLite built with STAT4 (the bundled one)
/// counts a bound LIMIT as shaping the plan, so it expires the cached
/// statement at every bind and compiles it again at every step. That was
/// two fifths of the service's CPU per plan on SQLite (profiled). A unique
/// key matches one row at most either way.
macro_rules! by_key {
    ($maker:expr, $idempotency_key:expr, $row:ty) => {
        intake_keys::table
            .inner_join(plans::table)
            .filter(intake_keys::maker.eq($maker))
            .filter(intake_keys::idempotency_key.eq($idempotency_key))
            .select((intake_keys::request_hash, <$row>::as_select()))
    };
}

/// The query for the plan kept for a maker, run and content. `run_id` is
/// never optional here: a lookup that skipped a missing run would reopen
/// the hole the NOT NULL column closes.
macro_rules! by_content {
    ($maker:expr, $run_id:expr, $content_hash:expr) => {
        plans::table
            .filter(plans::maker.eq($maker))
            .filter(plans::run_id.eq($run_id))
            .filter(plans::content_hash.eq($content_hash))
            .select(ReceiptRow::as_select())
    };
}

/// The key row's request hash and the whole plan it points at (to compare
/// with a plan this attempt may have written).
pub fn find_by_key(
    conn: &mut DbConn,
    maker: &str,
    idempotency_key: &str,
) -> QueryResult<Option<(String, PlanRow)>> {
    with_conn!(conn, c => by_key!(maker, idempotency_key, PlanRow).get_result(c).optional())
}

/// SQLite: the key row's request hash and the receipt of the plan it
/// points at, on the connection that writes.
pub(super) fn find_receipt_by_key_on_sqlite(
    lite: &mut diesel::SqliteConnection,
    maker: &str,
    idempotency_key: &str,
) -> QueryResult<Option<(String, ReceiptRow)>> {
    by_key!(maker, idempotency_key, ReceiptRow)
        .get_result(lite)
        .optional()
}

/// SQLite, inside the group-commit transaction, after `plan`'s savepoint
/// rolled back on a unique violation: the row that won decides. A committed
/// key row means replay or refusal; else the plan kept for the same content
/// gets this request's key row (in a savepoint of its own), binding the key
/// to its first answer. `None`: neither row exists, the violation stands.
pub(super) fn resolve_in_transaction(
    c: &mut diesel::SqliteConnection,
    plan: &NewPlan,
    idempotency_key: &str,
) -> QueryResult<Option<Written>> {
    if let Some((request_hash, row)) = by_key!(&plan.maker, idempotency_key, ReceiptRow)
        .get_result(c)
        .optional()?
    {
        return Ok(Some(Written::KeyHeld {
            request_hash,
            plan: row,
        }));
    }
    let Some(kept) = by_content!(&plan.maker, &plan.run_id, &plan.content_hash)
        .get_result::<ReceiptRow>(c)
        .optional()?
    else {
        return Ok(None);
    };
    c.transaction(|c| insert_key_row(c, plan, idempotency_key, kept.id))?;
    Ok(Some(Written::AlreadyReceived(kept)))
}

/// How many key rows hold a request hash other than that of the plan they
/// point at (always 0 for rows the service wrote).
pub fn keys_not_matching_their_plans(conn: &mut DbConn) -> QueryResult<i64> {
    with_conn!(conn, c => intake_keys::table
        .inner_join(plans::table)
        .filter(intake_keys::request_hash.ne(plans::request_hash))
        .count()
        .get_result(c))
}

/// Deletes up to `batch` key rows created before `before`, oldest first, in
/// one short transaction of its own (SQLite: `BEGIN IMMEDIATE`); returns
/// how many. Plans are never touched.
pub fn prune_keys_batch(
    conn: &mut DbConn,
    before: NaiveDateTime,
    batch: i64,
) -> QueryResult<usize> {
    use diesel::sql_types::{BigInt, Timestamp};
    // One statement, its oldest rows first (the primary key's order is
    // creation order); diesel's DSL cannot delete through a limited subquery.
    const PRUNE: &str = "DELETE FROM intake_keys WHERE id IN
                           (SELECT id FROM intake_keys WHERE created_at < {before}
                             ORDER BY id LIMIT {batch})";
    match conn {
        DbConn::Postgres(pg) => {
            diesel::sql_query(PRUNE.replace("{before}", "$1").replace("{batch}", "$2"))
                .bind::<Timestamp, _>(before)
                .bind::<BigInt, _>(batch)
                .execute(pg)
        }
        DbConn::Sqlite(lite) => lite.immediate_transaction(|c| {
            diesel::sql_query(PRUNE.replace("{before}", "?").replace("{batch}", "?"))
                .bind::<Timestamp, _>(before)
                .bind::<BigInt, _>(batch)
                .execute(c)
        }),
    }
}

/// How many key rows were created before `before`.
pub fn count_keys_before(conn: &mut DbConn, before: NaiveDateTime) -> QueryResult<i64> {
    with_conn!(conn, c => intake_keys::table
        .filter(intake_keys::created_at.lt(before))
        .count()
        .get_result(c))
}

/// The query for the plan `$receipt_id` as `$row` (`PlanRow`, or
/// `ReceiptRow` to leave its content unread).
macro_rules! by_receipt {
    ($conn:expr, $receipt_id:expr, $row:ty) => {
        with_conn!($conn, c => plans::table
            .filter(plans::receipt_id.eq($receipt_id))
            .select(<$row>::as_select())
            .get_result(c)
            .optional())
    };
}

pub fn find_by_receipt(conn: &mut DbConn, receipt_id: &str) -> QueryResult<Option<PlanRow>> {
    by_receipt!(conn, receipt_id, PlanRow)
}

/// The maker of the plan `receipt_id` and the bytes of its content and
/// approved inputs, read from the row, not its text.
pub fn stored_bytes(conn: &mut DbConn, receipt_id: &str) -> QueryResult<Option<(String, i64)>> {
    with_conn!(conn, c => plans::table
        .filter(plans::receipt_id.eq(receipt_id))
        .select((plans::maker, super::feed::PlanBytes::as_select()))
        .get_result::<(String, super::feed::PlanBytes)>(c)
        .optional())
    .map(|found| found.map(|(maker, plan)| (maker, plan.bytes)))
}

/// The receipt columns of the plan `receipt_id`, its content unread.
pub fn find_receipt(conn: &mut DbConn, receipt_id: &str) -> QueryResult<Option<ReceiptRow>> {
    by_receipt!(conn, receipt_id, ReceiptRow)
}
