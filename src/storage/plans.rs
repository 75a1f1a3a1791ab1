//! The `plans` and `intake_keys` tables: the two-row write and its lookups.

use std::cell::Cell;

use chrono::NaiveDateTime;
use diesel::prelude::*;

use super::DbConn;
use super::schema::{intake_keys, plans};
use crate::{with_conn, write_transaction};

/// A plan row as stored. Every column, so the whole row can be compared.
#[derive(Debug, Clone, PartialEq, Eq, Queryable, Selectable)]
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
    }
}

/// A failed two-row write, and whether the transaction's body had finished:
/// if so, the error came from COMMIT and its outcome is unknown.
#[derive(Debug)]
pub struct WriteFailure {
    pub error: diesel::result::Error,
    pub commit_sent: bool,
}

/// Writes the plan row and its key row in one transaction: both or neither.
///
/// Errors leave the closure untouched: a unique violation swallowed inside a
/// Postgres transaction would turn COMMIT into a silent ROLLBACK.
pub fn insert_plan_with_key(
    conn: &mut DbConn,
    plan: &NewPlan,
    idempotency_key: &str,
) -> Result<PlanRow, WriteFailure> {
    // Set as the body's last step: diesel reports a connection cut during the
    // body and one during COMMIT with the same error.
    let body_done = Cell::new(false);
    write_transaction!(conn, c => {
        let row: PlanRow = diesel::insert_into(plans::table)
            .values(plan)
            .returning(PlanRow::as_returning())
            .get_result(c)?;
        diesel::insert_into(intake_keys::table)
            .values(NewIntakeKey {
                maker: &plan.maker,
                idempotency_key,
                request_hash: &plan.request_hash,
                plan_id: row.id,
                created_at: plan.received_at,
            })
            .execute(c)?;
        body_done.set(true);
        Ok(row)
    })
    .map_err(|error| WriteFailure {
        error,
        commit_sent: body_done.get(),
    })
}

/// The key row's request hash and the plan it points at.
pub fn find_by_key(
    conn: &mut DbConn,
    maker: &str,
    idempotency_key: &str,
) -> QueryResult<Option<(String, PlanRow)>> {
    with_conn!(conn, c => intake_keys::table
        .inner_join(plans::table)
        .filter(intake_keys::maker.eq(maker))
        .filter(intake_keys::idempotency_key.eq(idempotency_key))
        .select((intake_keys::request_hash, PlanRow::as_select()))
        .first(c)
        .optional())
}

/// The plan already kept for this maker, run and content. `run_id` is never
/// optional here: a lookup that skipped a missing run would reopen the hole
/// the NOT NULL column closes.
pub fn find_by_content(
    conn: &mut DbConn,
    maker: &str,
    run_id: &str,
    content_hash: &str,
) -> QueryResult<Option<PlanRow>> {
    with_conn!(conn, c => plans::table
        .filter(plans::maker.eq(maker))
        .filter(plans::run_id.eq(run_id))
        .filter(plans::content_hash.eq(content_hash))
        .select(PlanRow::as_select())
        .first(c)
        .optional())
}

pub fn find_by_receipt(conn: &mut DbConn, receipt_id: &str) -> QueryResult<Option<PlanRow>> {
    with_conn!(conn, c => plans::table
        .filter(plans::receipt_id.eq(receipt_id))
        .select(PlanRow::as_select())
        .first(c)
        .optional())
}

/// A place in the receipts feed: the `(feed_xid, id)` of the last plan read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FeedPosition {
    pub xid: i64,
    pub id: i64,
}

/// Up to `limit` plans after `after`, in feed order.
///
/// Postgres: only plans whose writing transaction is older than every
/// transaction still running (`pg_snapshot_xmin`) are returned. Those are
/// settled for good, and any plan still to commit has a larger `feed_xid`
/// than all of them, so a reader following the cursor never skips one, even
/// when ids commit out of order. SQLite commits one writer at a time in id
/// order, so there every committed plan is settled.
pub fn feed_page(
    conn: &mut DbConn,
    after: FeedPosition,
    limit: i64,
) -> QueryResult<Vec<(i64, PlanRow)>> {
    use diesel::dsl::sql;
    use diesel::sql_types::Bool;
    let settled = match conn.backend() {
        super::Backend::Postgres => {
            "feed_xid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint"
        }
        super::Backend::Sqlite => "1 = 1",
    };
    with_conn!(conn, c => plans::table
        .filter(
            plans::feed_xid
                .gt(after.xid)
                .or(plans::feed_xid.eq(after.xid).and(plans::id.gt(after.id))),
        )
        .filter(sql::<Bool>(settled))
        .order((plans::feed_xid.asc(), plans::id.asc()))
        .limit(limit)
        .select((plans::feed_xid, PlanRow::as_select()))
        .load(c))
}
