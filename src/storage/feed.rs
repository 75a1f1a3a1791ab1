//! The receipts feed in the database: positions, the horizon below which
//! they are settled, pages in feed order, the feed's invariant (`verify`),
//! and (`signal`) what wakes readers waiting for the next receipt.
//! How positions are made is in ARCHITECTURE.md, "The receipts feed".

pub mod signal;

use diesel::prelude::*;

use super::DbConn;
use super::plans::{PlanRow, ReceiptRow};
use super::schema::plans;
use crate::with_conn;

/// A place in the receipts feed: the `(feed_xid, id)` of the last plan read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FeedPosition {
    pub xid: i64,
    pub id: i64,
}

/// Records this cluster's feed base in a statement of its own (committed at
/// once), so that after a restore into another cluster no writer makes the
/// others wait while it records it inside its own transaction.
pub fn record_feed_base(pg: &mut diesel::PgConnection) -> QueryResult<()> {
    diesel::sql_query("SELECT plan_intake_feed_base(true)")
        .execute(pg)
        .map(|_| ())
}

/// Where the settled part of the feed ends, and how far behind it is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Horizon {
    /// Positions below this are settled for good; `None` (SQLite): every
    /// committed plan is.
    pub below: Option<i64>,
    /// Age of the oldest write still holding the feed back, in seconds.
    pub lag_seconds: f64,
}

/// Postgres: the lowest position a plan still being written can take (see
/// `plan_intake_feed_horizon`, migrations `…_feed_positions_by_cluster`,
/// `…_plan_intake_write_holds_the_horizon` and
/// `…_feed_horizon_counts_writers_newer_than_its_snapshot`).
///
/// The invariant it rests on: **every transaction that writes a plan holds
/// a `RowExclusiveLock` on this database's `plans` from before it is given
/// a transaction id until its commit is visible.** `plan_intake_write`
/// makes it true for every call, alone or in a batch: it takes that lock
/// itself before its first write, in the block whose locks pass to the
/// transaction (an INSERT's own lock is released with its subtransaction
/// when it meets a unique violation, while the id stays). So a writer
/// with a lower id is either still in pg_locks, holding the horizon below
/// its rows, or has committed; and it must be read in a statement of its
/// own, before the page: a writer that left pg_locks by then is visible to
/// the page's newer snapshot, so no late commit is ever skipped. Only
/// writers of `plans` count, so unrelated transactions anywhere in the
/// cluster (other databases, idle sessions, batch jobs) hold nothing back;
/// a plan inserted around the service by a transaction that had an id
/// before it touched `plans` is not covered. SQLite commits one writer at
/// a time in id order: every committed plan is settled.
pub fn feed_horizon(conn: &mut DbConn) -> QueryResult<Horizon> {
    #[derive(QueryableByName)]
    struct Found {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        horizon: i64,
        #[diesel(sql_type = diesel::sql_types::Double)]
        lag_seconds: f64,
    }
    match conn {
        DbConn::Postgres(pg) => {
            let found =
                diesel::sql_query("SELECT horizon, lag_seconds FROM plan_intake_feed_horizon()")
                    .get_result::<Found>(pg)?;
            Ok(Horizon {
                below: Some(found.horizon),
                lag_seconds: found.lag_seconds,
            })
        }
        DbConn::Sqlite(_) => Ok(Horizon {
            below: None,
            lag_seconds: 0.0,
        }),
    }
}

/// The position of the last settled plan and its receipt id (`None` on an
/// empty feed): a reader starting there misses nothing still to come, and
/// pages through no history.
pub fn feed_end(conn: &mut DbConn) -> QueryResult<(FeedPosition, Option<String>)> {
    let horizon = feed_horizon(conn)?;
    let below = horizon.below.unwrap_or(i64::MAX);
    let last: Option<(i64, i64, String)> = with_conn!(conn, c => plans::table
        .filter(plans::feed_xid.lt(below))
        .order((plans::feed_xid.desc(), plans::id.desc()))
        .select((plans::feed_xid, plans::id, plans::receipt_id))
        .first(c)
        .optional())?;
    Ok(
        last.map_or((FeedPosition::default(), None), |(xid, id, receipt_id)| {
            (FeedPosition { xid, id }, Some(receipt_id))
        }),
    )
}

/// Where a cursor's position stands in this feed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Standing {
    /// The feed's start: before every plan.
    Start,
    /// A plan is at the position: its receipt id.
    At(String),
    /// No plan is there, but the position is past the end of an earlier
    /// timeline's positions that this database kept (Postgres, after a
    /// failover to a standby that was behind): the reader goes on from the
    /// next timeline's first plan.
    PastAnEarlierTimeline,
    /// No plan is there and it belongs to no earlier timeline: another
    /// feed's position, one a restore took back, or one past the end.
    Nowhere,
}

/// Where `position` stands: one lookup on `plans_feed_ix` (and, when no
/// plan is there on Postgres, the current timeline's base recorded if it is
/// not yet, one lookup on `feed_bases` and one more on the index).
pub fn standing(conn: &mut DbConn, position: FeedPosition) -> QueryResult<Standing> {
    if position == FeedPosition::default() {
        return Ok(Standing::Start);
    }
    let there: Option<String> = with_conn!(conn, c => plans::table
        .filter(plans::feed_xid.eq(position.xid))
        .filter(plans::id.eq(position.id))
        .select(plans::receipt_id)
        .get_result(c)
        .optional())?;
    if let Some(receipt_id) = there {
        return Ok(Standing::At(receipt_id));
    }
    let DbConn::Postgres(pg) = conn else {
        return Ok(Standing::Nowhere);
    };
    // The timeline this server is on records its start now if no writer
    // has yet (a failover reached without a restart): a cursor the old
    // timeline handed out and this one lost is placed before its first
    // write as after it.
    diesel::sql_query("SELECT plan_intake_feed_base(true)").execute(pg)?;
    // A later timeline starting above the position, and no kept plan
    // between the position and that start: the position is in the room a
    // new timeline leaves for what the old one handed out and this one
    // lost. (A base recorded before `starts_at` existed stands in for its
    // start.)
    #[derive(QueryableByName)]
    struct Later {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        past_an_earlier_timeline: bool,
    }
    let later = diesel::sql_query(
        "SELECT COALESCE((
             SELECT NOT EXISTS (
                        SELECT 1 FROM plans
                         WHERE (feed_xid, id) > ($1, $2) AND feed_xid < b.base)
               FROM (SELECT MIN(COALESCE(starts_at, base)) AS base FROM feed_bases
                      WHERE COALESCE(starts_at, base) > $1) b
              WHERE b.base IS NOT NULL), false) AS past_an_earlier_timeline",
    )
    .bind::<diesel::sql_types::BigInt, _>(position.xid)
    .bind::<diesel::sql_types::BigInt, _>(position.id)
    .get_result::<Later>(pg)?;
    Ok(if later.past_an_earlier_timeline {
        Standing::PastAnEarlierTimeline
    } else {
        Standing::Nowhere
    })
}

/// A feed page's rows: receipts only, or whole plans (`expand`).
pub enum PageRows {
    Receipts(Vec<(i64, ReceiptRow)>),
    Plans(Vec<(i64, PlanRow)>),
}

impl PageRows {
    /// The feed position of the page's last row, and its receipt id.
    pub fn last_position(&self) -> Option<(FeedPosition, &str)> {
        let last = match self {
            Self::Receipts(rows) => rows
                .last()
                .map(|(xid, row)| (*xid, row.id, row.receipt_id.as_str())),
            Self::Plans(rows) => rows
                .last()
                .map(|(xid, row)| (*xid, row.id, row.receipt_id.as_str())),
        };
        last.map(|(xid, id, receipt_id)| (FeedPosition { xid, id }, receipt_id))
    }
}

/// Up to `limit` settled plans after `after`, in feed order `(feed_xid,
/// id)`, each as `$row` (a plan's content is read only when the page
/// shows it).
macro_rules! page_rows {
    ($conn:expr, $after:expr, $below:expr, $limit:expr, $row:ty) => {{
        use diesel::sql_types::{BigInt, Bool};
        let (after, below, limit): (FeedPosition, i64, i64) = ($after, $below, $limit);
        match $conn {
            // A row comparison: one range on `plans_feed_ix` in every plan.
            // The equivalent `a > x OR (a = x AND b > y)` made Postgres's
            // generic plan scan the index from its start (30 ms at 60k
            // plans, growing with the table).
            DbConn::Postgres(pg) => plans::table
                .filter(
                    diesel::dsl::sql::<Bool>("(feed_xid, id) > (")
                        .bind::<BigInt, _>(after.xid)
                        .sql(", ")
                        .bind::<BigInt, _>(after.id)
                        .sql(")"),
                )
                .filter(plans::feed_xid.lt(below))
                .order((plans::feed_xid.asc(), plans::id.asc()))
                .limit(limit)
                .select((plans::feed_xid, <$row>::as_select()))
                .load::<(i64, $row)>(pg),
            // SQLite seeks the index only on its first column for either
            // form of "after (x, y)" (measured: a page 290k plans deep
            // scanned all of them, 50 ms); split, each half is a seek: the
            // rest of x's positions, then the positions past x (none on
            // SQLite, where feed_xid is 0 and the order is id's).
            DbConn::Sqlite(lite) => plans::table
                .filter(plans::feed_xid.eq(after.xid))
                .filter(plans::id.gt(after.id))
                .filter(plans::feed_xid.lt(below))
                .order((plans::feed_xid.asc(), plans::id.asc()))
                .limit(limit)
                .select((plans::feed_xid, <$row>::as_select()))
                .load::<(i64, $row)>(lite)
                .and_then(|mut rows| {
                    let missing = limit - rows.len() as i64;
                    if missing > 0 {
                        rows.extend(
                            plans::table
                                .filter(plans::feed_xid.gt(after.xid))
                                .filter(plans::feed_xid.lt(below))
                                .order((plans::feed_xid.asc(), plans::id.asc()))
                                .limit(missing)
                                .select((plans::feed_xid, <$row>::as_select()))
                                .load::<(i64, $row)>(lite)?,
                        );
                    }
                    Ok(rows)
                }),
        }
    }};
}

/// What one stored plan adds to an expanded page: its content and approved
/// inputs, in bytes (read from the row's header, not the text).
#[derive(Debug, Clone, Copy, Queryable, Selectable)]
#[diesel(table_name = plans)]
pub struct PlanBytes {
    pub id: i64,
    #[diesel(select_expression = diesel::dsl::sql::<diesel::sql_types::BigInt>(
        "CAST(octet_length(content) + octet_length(approved_inputs) AS BIGINT)"
    ))]
    #[diesel(select_expression_type = diesel::expression::SqlLiteral<diesel::sql_types::BigInt>)]
    pub bytes: i64,
}

/// How much of the feed after `after` one expanded page may hold: up to
/// `limit` plans whose bytes together stay within `budget` (at least one,
/// however large), and those bytes. A page of that many plans read after
/// this holds exactly these plans: any plan still to commit sorts after them.
pub fn page_extent(
    conn: &mut DbConn,
    after: FeedPosition,
    limit: i64,
    budget: u64,
) -> QueryResult<(i64, u64)> {
    let horizon = feed_horizon(conn)?;
    let below = horizon.below.unwrap_or(i64::MAX);
    let sizes = page_rows!(conn, after, below, limit, PlanBytes)?;
    let (mut rows, mut bytes) = (0i64, 0u64);
    for (_, plan) in sizes {
        let size = u64::try_from(plan.bytes).unwrap_or(0);
        if rows > 0 && bytes.saturating_add(size) > budget {
            break;
        }
        rows += 1;
        bytes = bytes.saturating_add(size);
    }
    Ok((rows, bytes))
}

/// Up to `limit` settled plans after `after`, in feed order `(feed_xid,
/// id)`, with their content only when `with_content`, and the horizon they
/// were read under. Any plan still to commit takes a position at or above
/// the horizon, so it sorts after everything returned, and a reader
/// following the cursor never skips one, even when ids commit out of order.
pub fn feed_page(
    conn: &mut DbConn,
    after: FeedPosition,
    limit: i64,
    with_content: bool,
) -> QueryResult<(PageRows, Horizon)> {
    let horizon = feed_horizon(conn)?;
    let below = horizon.below.unwrap_or(i64::MAX);
    let rows = if with_content {
        PageRows::Plans(page_rows!(conn, after, below, limit, PlanRow)?)
    } else {
        PageRows::Receipts(page_rows!(conn, after, below, limit, ReceiptRow)?)
    };
    Ok((rows, horizon))
}

/// The feed's invariant: every stored position is behind what the next
/// write would get, so new receipts sort after every cursor already handed
/// out. `Err((highest stored, next))` when broken (Postgres: positions
/// written past this cluster's base, say by hand). SQLite orders by `id`,
/// which AUTOINCREMENT never reuses.
pub fn feed_invariant(conn: &mut DbConn) -> QueryResult<Result<(), (i64, i64)>> {
    #[derive(QueryableByName)]
    struct Positions {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        highest: i64,
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        next: i64,
    }
    let DbConn::Postgres(pg) = conn else {
        return Ok(Ok(()));
    };
    let found = diesel::sql_query(
        "SELECT COALESCE(MAX(feed_xid), 0) AS highest,
                pg_snapshot_xmax(pg_current_snapshot())::text::bigint
                    + plan_intake_feed_base(false) AS next
           FROM plans",
    )
    .get_result::<Positions>(pg)?;
    Ok(if found.highest < found.next {
        Ok(())
    } else {
        Err((found.highest, found.next))
    })
}
