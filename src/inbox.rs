//! The ordering system's inbox (`plan-intake follow --into`): each page of
//! the feed kept in the consumer's own database in one transaction with the
//! follower's position, so that every receipt lands there exactly once, in
//! feed order, whatever crashes in between. The tables are the consumer's:
//! their migrations are ours to ship (`inbox/`) and theirs to run
//! (`plan-intake inbox migrate`, or `inbox sql` for their DBA); the
//! follower only reads and writes rows.
//!
//! A page's transaction first reads the stored position (on Postgres
//! `FOR UPDATE`): the one this follower saved last means go on; the one it
//! is about to save means a COMMIT whose answer was lost did land (nothing
//! is written twice); anything else means someone else moved it, and the
//! follower stops rather than guess.

use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{Array, BigInt, Nullable, Text};
use diesel::{PgConnection, SqliteConnection, sql_query};
use serde_json::value::RawValue;

use plan_intake_client::wire::feed::FeedCursor;
use plan_intake_client::{FollowError, Page, Position, Refusal, Sink};

use crate::storage::DatabaseTarget;

/// One migration of the inbox's tables, for each backend.
pub struct Migration {
    pub version: &'static str,
    pub postgres: &'static str,
    pub sqlite: &'static str,
}

/// The inbox's migrations, in order; named as the service's own.
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: "2026-12-05-000001_create_plan_intake_inbox",
    postgres: include_str!("../inbox/postgres/2026-12-05-000001_create_plan_intake_inbox/up.sql"),
    sqlite: include_str!("../inbox/sqlite/2026-12-05-000001_create_plan_intake_inbox/up.sql"),
}];

/// Which migrations ran, in a table of the inbox's own (not diesel's:
/// the consumer may run diesel migrations of their own in that database).
const TRACKING_POSTGRES: &str = "CREATE TABLE IF NOT EXISTS plan_intake_inbox_migrations (\n    version TEXT PRIMARY KEY,\n    run_on TIMESTAMPTZ NOT NULL DEFAULT now()\n)";
const TRACKING_SQLITE: &str = "CREATE TABLE IF NOT EXISTS plan_intake_inbox_migrations (\n    version TEXT PRIMARY KEY,\n    run_on TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))\n)";

/// The consumer's database kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    Postgres,
    Sqlite,
}

/// Every migration as one script for a DBA to read and run: the tracking
/// table, each migration, and its row there, in one transaction.
pub fn sql(backend: Backend) -> String {
    let tracking = match backend {
        Backend::Postgres => TRACKING_POSTGRES,
        Backend::Sqlite => TRACKING_SQLITE,
    };
    let mut script = format!("BEGIN;\n\n{tracking};\n");
    for migration in MIGRATIONS {
        let up = match backend {
            Backend::Postgres => migration.postgres,
            Backend::Sqlite => migration.sqlite,
        };
        script.push_str(&format!(
            "\n-- {version}\n{up}\nINSERT INTO plan_intake_inbox_migrations (version) VALUES ('{version}');\n",
            version = migration.version
        ));
    }
    script.push_str("\nCOMMIT;\n");
    script
}

/// Why the inbox cannot be opened or migrated.
#[derive(Debug, thiserror::Error)]
pub enum InboxError {
    #[error("{0}")]
    Url(String),
    /// The database cannot be reached (yet): worth waiting out.
    #[error("cannot connect to the inbox's database: {0}")]
    Connect(#[source] diesel::ConnectionError),
    #[error("the inbox's database: {0}")]
    Database(#[source] DieselError),
    #[error("the inbox's stored position: {0}")]
    BadPosition(String),
    #[error(
        "the inbox's position cannot be read ({0}): are the inbox's tables in this database (`plan-intake inbox migrate --into URL`, or what `plan-intake inbox sql` prints, run by a DBA), and may this role read and write them (README: the inbox's GRANTs)?"
    )]
    NoTables(String),
}

enum Conn {
    Postgres(PgConnection),
    Sqlite(SqliteConnection),
}

fn connect(target: &DatabaseTarget) -> Result<Conn, InboxError> {
    match target {
        DatabaseTarget::Postgres(url) => {
            let conn = PgConnection::establish(url).map_err(InboxError::Connect)?;
            Ok(Conn::Postgres(conn))
        }
        DatabaseTarget::Sqlite(path) => {
            let mut conn = SqliteConnection::establish(path).map_err(InboxError::Connect)?;
            // Durable at COMMIT whatever journal the DBA chose; a consumer
            // writing at the same time is waited for, not failed.
            conn.batch_execute("PRAGMA busy_timeout = 5000; PRAGMA synchronous = FULL;")
                .map_err(InboxError::Database)?;
            Ok(Conn::Sqlite(conn))
        }
    }
}

fn target_of(url: &str) -> Result<DatabaseTarget, InboxError> {
    DatabaseTarget::parse(url).map_err(|e| InboxError::Url(e.to_string()))
}

#[derive(QueryableByName)]
struct Version {
    #[diesel(sql_type = Text)]
    version: String,
}

/// Runs the migrations not yet run, each once (two at once: one waits on
/// Postgres's lock, SQLite's write lock). The versions it ran.
pub fn migrate(url: &str) -> Result<Vec<&'static str>, InboxError> {
    fn pending<C>(conn: &mut C, backend: Backend) -> Result<Vec<&'static str>, DieselError>
    where
        C: Connection,
        for<'a> diesel::query_builder::SqlQuery: diesel::query_dsl::LoadQuery<'a, C, Version>,
    {
        if backend == Backend::Postgres {
            // Before the tracking table may exist: two first runs at once
            // would race on its CREATE (SQLite's write lock orders them).
            conn.batch_execute(
                "SELECT pg_advisory_xact_lock(hashtext('plan_intake_inbox_migrations'))",
            )?;
        }
        conn.batch_execute(match backend {
            Backend::Postgres => TRACKING_POSTGRES,
            Backend::Sqlite => TRACKING_SQLITE,
        })?;
        let done: Vec<String> = sql_query("SELECT version FROM plan_intake_inbox_migrations")
            .load::<Version>(conn)?
            .into_iter()
            .map(|v| v.version)
            .collect();
        let mut ran = Vec::new();
        for migration in MIGRATIONS {
            if done.iter().any(|v| v == migration.version) {
                continue;
            }
            let up = match backend {
                Backend::Postgres => migration.postgres,
                Backend::Sqlite => migration.sqlite,
            };
            conn.batch_execute(up)?;
            conn.batch_execute(&format!(
                "INSERT INTO plan_intake_inbox_migrations (version) VALUES ('{}')",
                migration.version
            ))?;
            ran.push(migration.version);
        }
        Ok(ran)
    }
    match connect(&target_of(url)?)? {
        Conn::Postgres(mut conn) => conn.transaction(|c| pending(c, Backend::Postgres)),
        Conn::Sqlite(mut conn) => conn.immediate_transaction(|c| pending(c, Backend::Sqlite)),
    }
    .map_err(InboxError::Database)
}

#[derive(QueryableByName)]
struct Stored {
    #[diesel(sql_type = Nullable<Text>)]
    position: Option<String>,
}

/// One feed entry as the inbox keeps it.
struct Row {
    receipt_id: String,
    receipt: String,
    approved_inputs: Option<String>,
    content: Option<String>,
}

fn rows_of(page: &Page, expand: bool) -> Result<Vec<Row>, FollowError> {
    #[derive(serde::Deserialize)]
    struct Receipt {
        receipt_id: String,
    }
    #[derive(serde::Deserialize)]
    struct Expanded<'a> {
        #[serde(borrow)]
        receipt: &'a RawValue,
        #[serde(borrow, default)]
        approved_inputs: Option<&'a RawValue>,
        #[serde(borrow, default)]
        content: Option<&'a RawValue>,
    }
    let receipt_id = |receipt: &RawValue| {
        serde_json::from_str::<Receipt>(receipt.get())
            .map(|r| r.receipt_id)
            .map_err(|e| {
                FollowError::Unexpected(format!("a feed entry without its receipt_id: {e}"))
            })
    };
    page.receipts
        .iter()
        .map(|entry| {
            if !expand {
                return Ok(Row {
                    receipt_id: receipt_id(entry)?,
                    receipt: entry.get().to_owned(),
                    approved_inputs: None,
                    content: None,
                });
            }
            let expanded: Expanded<'_> = serde_json::from_str(entry.get()).map_err(|e| {
                FollowError::Unexpected(format!("an expanded feed entry without its receipt: {e}"))
            })?;
            Ok(Row {
                receipt_id: receipt_id(expanded.receipt)?,
                receipt: expanded.receipt.get().to_owned(),
                approved_inputs: expanded.approved_inputs.map(|v| v.get().to_owned()),
                content: expanded.content.map(|v| v.get().to_owned()),
            })
        })
        .collect()
}

/// What one page's transaction found.
enum Kept {
    /// The page and its position, committed now.
    Now,
    /// Committed before: a COMMIT whose answer was lost had landed.
    Before,
}

/// Why one page's transaction did not commit.
enum NotKept {
    /// The stored position is neither the one this follower saved last nor
    /// the one it is saving.
    Moved(Option<String>),
    Database(DieselError),
}

impl From<DieselError> for NotKept {
    fn from(error: DieselError) -> Self {
        Self::Database(error)
    }
}

/// `follow --into`: the consumer's database as the follower's sink.
pub struct Inbox {
    target: DatabaseTarget,
    conn: Option<Conn>,
    expand: bool,
    /// The position stored as of this follower's last transaction.
    held: Option<Position>,
}

impl Inbox {
    /// Connects and reads the stored position; the tables must exist.
    /// `expand`: entries are `{receipt, approved_inputs, content}`.
    pub fn open(url: &str, expand: bool) -> Result<Self, InboxError> {
        let target = target_of(url)?;
        // Connecting would create the file: the follower creates nothing.
        if let DatabaseTarget::Sqlite(path) = &target
            && !std::path::Path::new(path).exists()
        {
            return Err(InboxError::NoTables(format!(
                "no SQLite database at {path}"
            )));
        }
        let mut conn = connect(&target)?;
        let stored = match &mut conn {
            Conn::Postgres(c) => stored_position(c, ""),
            Conn::Sqlite(c) => stored_position(c, ""),
        }
        .map_err(|e| match e {
            DieselError::DatabaseError(
                DatabaseErrorKind::ClosedConnection | DatabaseErrorKind::UnableToSendCommand,
                info,
            ) => InboxError::Connect(diesel::ConnectionError::BadConnection(
                info.message().to_owned(),
            )),
            DieselError::DatabaseError(_, info) => InboxError::NoTables(info.message().to_owned()),
            DieselError::NotFound => InboxError::NoTables(
                "plan_intake_inbox_position has no row; `inbox migrate` makes it".to_owned(),
            ),
            other => InboxError::Database(other),
        })?;
        let held = stored
            .map(Position::from_saved)
            .transpose()
            .map_err(|e| InboxError::BadPosition(e.to_string()))?;
        // No position beside kept receipts (set to NULL, restored from a
        // backup): a start as the options say could skip or repeat them.
        if held.is_none() {
            let kept = match &mut conn {
                Conn::Postgres(c) => count_rows(c),
                Conn::Sqlite(c) => count_rows(c),
            }
            .map_err(InboxError::Database)?;
            if kept > 0 {
                return Err(InboxError::BadPosition(format!(
                    "it holds no position but {kept} receipt(s): reconcile them with the feed and empty the inbox, or set the position they stand at, before following into it"
                )));
            }
        }
        Ok(Self {
            target,
            conn: Some(conn),
            expand,
            held,
        })
    }

    fn keep(&mut self, rows: &[Row], position: &Position) -> Result<Kept, NotKept> {
        let conn = match &mut self.conn {
            Some(conn) => conn,
            None => self.conn.insert(connect(&self.target).map_err(|e| {
                NotKept::Database(DieselError::QueryBuilderError(e.to_string().into()))
            })?),
        };
        let held = self.held.as_ref().map(Position::as_str);
        match conn {
            Conn::Postgres(c) => c.transaction(|c| {
                // A page's transaction is short: one left open by a
                // follower that vanished (a half-open connection) is ended
                // by the server, and a wait on its lock gives up and is
                // tried again. Per transaction, so a pooler keeps them.
                c.batch_execute(
                    "SET LOCAL idle_in_transaction_session_timeout = '60s'; SET LOCAL lock_timeout = '30s'",
                )?;
                let stored = stored_position(c, " FOR UPDATE")?;
                let kept = judge_stored(stored, held, position)?;
                if matches!(kept, Kept::Now) {
                    seam("begun");
                    insert_rows_postgres(c, rows)?;
                    seam("rows");
                    save_position(Backend::Postgres, position).execute(c)?;
                    seam("position");
                }
                Ok(kept)
            }),
            Conn::Sqlite(c) => c.immediate_transaction(|c| {
                let stored = stored_position(c, "")?;
                let kept = judge_stored(stored, held, position)?;
                if matches!(kept, Kept::Now) {
                    seam("begun");
                    for row in rows {
                        sql_query(
                            "INSERT INTO plan_intake_inbox (receipt_id, receipt, approved_inputs, content) VALUES (?, ?, ?, ?)",
                        )
                        .bind::<Text, _>(&row.receipt_id)
                        .bind::<Text, _>(&row.receipt)
                        .bind::<Nullable<Text>, _>(&row.approved_inputs)
                        .bind::<Nullable<Text>, _>(&row.content)
                        .execute(c)?;
                    }
                    seam("rows");
                    save_position(Backend::Sqlite, position).execute(c)?;
                    seam("position");
                }
                Ok(kept)
            }),
        }
    }
}

/// Test seam: with `PLAN_INTAKE_TEST_INBOX_CRASH_AT=SEAM:N` the follower
/// aborts (as a kill -9 would end it) at `SEAM` of its `N`th transaction
/// that writes: `begun`, `rows`, `position` (each before COMMIT) or
/// `committed` (after it, before the follower learns it); at `lost` it
/// goes on as if the COMMIT's answer was lost (`lost_answer`).
fn seam(at: &str) {
    if at != "lost" && seam_reached(at) {
        std::process::abort();
    }
}

/// Test seam `lost`: the COMMIT landed but its answer is treated as lost
/// (the connection dropped), so the page is tried again.
fn lost_answer() -> bool {
    seam_reached("lost")
}

fn seam_reached(at: &str) -> bool {
    #[cfg(feature = "test-seams")]
    {
        use std::sync::atomic::{AtomicU64, Ordering};
        static BEGUN: AtomicU64 = AtomicU64::new(0);
        let Ok(wanted) = std::env::var("PLAN_INTAKE_TEST_INBOX_CRASH_AT") else {
            return false;
        };
        let Some((seam, nth)) = wanted.split_once(':') else {
            return false;
        };
        let count = if at == "begun" {
            BEGUN.fetch_add(1, Ordering::SeqCst) + 1
        } else {
            BEGUN.load(Ordering::SeqCst)
        };
        seam == at && nth.parse() == Ok(count)
    }
    #[cfg(not(feature = "test-seams"))]
    {
        let _ = at;
        false
    }
}

/// The stored position: `None` before the first page (the row the
/// migration made holds none). No row at all is `NotFound`.
fn stored_position<C>(conn: &mut C, lock: &str) -> Result<Option<String>, DieselError>
where
    C: Connection,
    for<'a> diesel::query_builder::SqlQuery: diesel::query_dsl::LoadQuery<'a, C, Stored>,
{
    sql_query(format!(
        "SELECT position FROM plan_intake_inbox_position{lock}"
    ))
    .get_result::<Stored>(conn)
    .map(|stored| stored.position)
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

fn count_rows<C>(conn: &mut C) -> Result<i64, DieselError>
where
    C: Connection,
    for<'a> diesel::query_builder::SqlQuery: diesel::query_dsl::LoadQuery<'a, C, Count>,
{
    sql_query("SELECT count(*) AS n FROM plan_intake_inbox")
        .get_result::<Count>(conn)
        .map(|c| c.n)
}

fn judge_stored(
    stored: Option<String>,
    held: Option<&str>,
    position: &Position,
) -> Result<Kept, NotKept> {
    if stored.as_deref() == Some(position.as_str()) {
        return Ok(Kept::Before);
    }
    if stored.as_deref() != held {
        return Err(NotKept::Moved(stored));
    }
    Ok(Kept::Now)
}

fn insert_rows_postgres(conn: &mut PgConnection, rows: &[Row]) -> Result<(), DieselError> {
    if rows.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = rows.iter().map(|r| r.receipt_id.as_str()).collect();
    let receipts: Vec<&str> = rows.iter().map(|r| r.receipt.as_str()).collect();
    let inputs: Vec<Option<&str>> = rows.iter().map(|r| r.approved_inputs.as_deref()).collect();
    let contents: Vec<Option<&str>> = rows.iter().map(|r| r.content.as_deref()).collect();
    // One statement a page, in feed order (the identity follows ORDER BY).
    sql_query(
        "INSERT INTO plan_intake_inbox (receipt_id, receipt, approved_inputs, content) \
         SELECT r, t, a, c FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) \
         WITH ORDINALITY AS page (r, t, a, c, n) ORDER BY n",
    )
    .bind::<Array<Text>, _>(ids)
    .bind::<Array<Text>, _>(receipts)
    .bind::<Array<Nullable<Text>>, _>(inputs)
    .bind::<Array<Nullable<Text>>, _>(contents)
    .execute(conn)
    .map(|_| ())
}

/// The statement that saves the position (the row the migration made).
fn position_statement(backend: Backend) -> &'static str {
    match backend {
        Backend::Postgres => {
            "UPDATE plan_intake_inbox_position SET position = $1, verified_leaves = $2, checkpoint = $3, updated_at = now()"
        }
        Backend::Sqlite => {
            "UPDATE plan_intake_inbox_position SET position = ?, verified_leaves = ?, checkpoint = ?, updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
        }
    }
}

/// The statement that saves `position`, bound: its text, and with
/// --verify the leaves proven and the last checkpoint, for the consumer to
/// read.
fn save_position<'a, DB>(
    backend: Backend,
    position: &'a Position,
) -> diesel::query_builder::BoxedSqlQuery<'a, DB, diesel::query_builder::SqlQuery>
where
    DB: diesel::backend::Backend,
    &'a str: diesel::serialize::ToSql<Text, DB>,
    Option<i64>: diesel::serialize::ToSql<Nullable<BigInt>, DB>,
    Option<&'a str>: diesel::serialize::ToSql<Nullable<Text>, DB>,
{
    sql_query(position_statement(backend))
        .into_boxed::<DB>()
        .bind::<Text, _>(position.as_str())
        .bind::<Nullable<BigInt>, _>(
            position
                .verified_leaves()
                .and_then(|n| i64::try_from(n).ok()),
        )
        .bind::<Nullable<Text>, _>(position.checkpoint())
}

impl Sink for Inbox {
    fn saved(&mut self) -> Result<Option<Position>, FollowError> {
        Ok(self.held.clone())
    }

    fn take(
        &mut self,
        page: &Page,
        _after: Option<&FeedCursor>,
        position: &Position,
    ) -> Result<(), Refusal> {
        let rows = rows_of(page, self.expand)?;
        match self.keep(&rows, position) {
            Ok(kept) => {
                if matches!(kept, Kept::Now) {
                    seam("committed");
                    if lost_answer() {
                        self.conn = None;
                        return Err(Refusal::Again(
                            "(test seam) the COMMIT's answer was lost".to_owned(),
                        ));
                    }
                }
                self.held = Some(position.clone());
                Ok(())
            }
            Err(NotKept::Moved(Some(stored))) => {
                self.held = Some(Position::from_saved(stored).map_err(|e| {
                    FollowError::BadCursor(format!("the inbox's stored position: {e}"))
                })?);
                Err(Refusal::Moved)
            }
            // Emptied under a follower that had kept pages (set to NULL, or
            // the database restored from before its first page): going on
            // from the options' start could skip receipts. Not guessed.
            Err(NotKept::Moved(None)) => Err(Refusal::Stop(FollowError::BadCursor(
                "the inbox's stored position was emptied under this follower (set to NULL, or the inbox's database restored from before it kept anything): nothing of the page was kept; reconcile the inbox with the feed, then start the follower again".to_owned(),
            ))),
            Err(NotKept::Database(DieselError::DatabaseError(
                DatabaseErrorKind::UniqueViolation,
                info,
            ))) => Err(Refusal::Stop(FollowError::Sink(format!(
                "the inbox already holds a receipt of this page, past its stored position ({}): nothing of the page was kept",
                info.message()
            )))),
            Err(NotKept::Database(error)) => {
                // The connection may be gone (a database restarted): the
                // next try connects again and reads what was committed.
                self.conn = None;
                Err(Refusal::Again(format!("the inbox's database: {error}")))
            }
        }
    }

    fn keeper(&self) -> String {
        "the inbox's stored position".to_owned()
    }
}
