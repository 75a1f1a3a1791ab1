//! The `plans` and `intake_keys` tables: the two-row write and its lookups.

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

/// Writes the plan row and its key row in one transaction: both or neither.
///
/// Errors leave the closure untouched: a unique violation swallowed inside a
/// Postgres transaction would turn COMMIT into a silent ROLLBACK.
pub fn insert_plan_with_key(
    conn: &mut DbConn,
    plan: &NewPlan,
    idempotency_key: &str,
) -> QueryResult<PlanRow> {
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
        Ok(row)
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
