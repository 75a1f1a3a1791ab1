//! Reads by id and their rule of who may see what, whether the service is
//! ready, and the errors every read answers with. The entry points are
//! [`super::Intake`]'s, in `intake/mod.rs`.

use super::login::LoginError;
use super::receipt::CorruptRow;
use super::{Login, Permission, PlanView, Receipt};
use crate::deadline::Deadline;
use crate::storage::plans::{self, PlanRow, ReceiptRow};
use crate::storage::{Database, DbConn, Durability, StorageError};

/// A read that could not answer.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The request's deadline passed first: retry later.
    #[error("the request's deadline passed")]
    TimedOut(#[source] StorageError),
    /// The database could not answer: retry later.
    #[error("the database could not answer")]
    Unavailable(#[source] StorageError),
    /// The database is not set up for this service: migrations pending, or
    /// grants its role lacks. An operator must act; retry later.
    #[error(transparent)]
    NotSetUp(NotSetUp),
    /// A stored row cannot be read back: never the caller's fault.
    #[error("a stored row cannot be read back")]
    Corrupt(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The feed cursor sent cannot be placed in this feed: the caller's.
    #[error(transparent)]
    CursorNotInFeed(#[from] super::feed::CursorNotInFeed),
    /// The caller holds a checkpoint of more leaves than the log's newest:
    /// the log was rolled back (a restore, a failover that lost commits).
    #[error("{0}")]
    RolledBack(String),
}

impl From<StorageError> for ReadError {
    fn from(error: StorageError) -> Self {
        match error {
            StorageError::DeadlineExceeded(_) => ReadError::TimedOut(error),
            StorageError::PendingMigrations(pending) => {
                ReadError::NotSetUp(NotSetUp::MigrationsPending(pending))
            }
            StorageError::MissingGrants { role, missing } => {
                ReadError::NotSetUp(NotSetUp::MissingGrants { role, missing })
            }
            other => ReadError::Unavailable(other),
        }
    }
}

/// Why the database is not set up for the service, in the operator's
/// words: what is missing and the command that mends it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotSetUp {
    #[error(
        "migrations are pending: {}: apply them with `plan-intake migrate run` as the owner",
        .0.join(", ")
    )]
    MigrationsPending(Vec<String>),
    #[error(
        "role `{role}` lacks {}: as the owner, run `plan-intake migrate grants {role}` and apply what it prints (again after every upgrade)",
        .missing.join(", ")
    )]
    MissingGrants { role: String, missing: Vec<String> },
    /// The receipt log's appender cannot go on (set by the appender).
    #[error(
        "the receipt log is not appended to: {0}; receipts are still signed and kept, and join the log once this is mended (docs/OPERATIONS.md, PlanIntakeReceiptLogStuck)"
    )]
    ReceiptLogStuck(String),
    /// The signing key cannot be recorded as published (set by its
    /// recorder): receipts it signs could not be checked against
    /// `GET /v1/signing-keys`.
    #[error(
        "the signing key cannot be published at GET /v1/signing-keys: {0}; receipts signed meanwhile cannot be checked against the published keys"
    )]
    SigningKeyUnpublished(String),
    /// This instance signs nothing, and the database's receipt log (named
    /// here) is signed: its receipts would be unsigned leaves that stop
    /// every verifying reader.
    #[error(
        "the database's receipt log {0:?} is signed, and this instance has no --signing-key: restart it with the log's key, as every other instance on this database"
    )]
    UnsignedOnSignedLog(String),
    /// A write found the database's storage full lately (Postgres
    /// `disk_full`, SQLite `SQLITE_FULL`), and none landed since.
    #[error(
        "the database's storage is full: writes fail and nothing is written until an operator frees space (docs/OPERATIONS.md, PlanIntakeStorageFull)"
    )]
    StorageFull,
}

impl From<CorruptRow> for ReadError {
    fn from(error: CorruptRow) -> Self {
        ReadError::Corrupt(Box::new(error))
    }
}

impl From<LoginError> for ReadError {
    fn from(error: LoginError) -> Self {
        match error {
            LoginError::Storage(e) => e.into(),
            other => ReadError::Corrupt(Box::new(other)),
        }
    }
}

/// What a read by receipt id hands out: the receipt alone, or the plan
/// with it. The one place that choice is made: each shape names the row
/// it reads and how the row becomes the answer; who may see it, the
/// barrier and the facade's method are shared. Sealed: only the domain's
/// two shapes are ones, and nothing outside it sees their rows.
pub trait ReadById: shape::Shape {}

impl ReadById for Receipt {}
impl ReadById for PlanView {}

mod shape {
    use super::{CorruptRow, DbConn, PlanRow, PlanView, Receipt, ReceiptRow, plans};
    use crate::intake::receipt::ReceiptOfRow;

    pub trait Shape: Sized {
        /// The stored columns this shape needs (the plan's content or not).
        type Row;
        fn find(conn: &mut DbConn, receipt_id: &str) -> diesel::QueryResult<Option<Self::Row>>;
        fn maker(row: &Self::Row) -> &str;
        fn answer(row: Self::Row) -> Result<Self, CorruptRow>;
    }

    impl Shape for Receipt {
        type Row = ReceiptRow;
        fn find(conn: &mut DbConn, receipt_id: &str) -> diesel::QueryResult<Option<ReceiptRow>> {
            plans::find_receipt(conn, receipt_id)
        }
        fn maker(row: &ReceiptRow) -> &str {
            &row.maker
        }
        fn answer(row: ReceiptRow) -> Result<Self, CorruptRow> {
            Receipt::from_row(&row, None)
        }
    }

    impl Shape for PlanView {
        type Row = PlanRow;
        fn find(conn: &mut DbConn, receipt_id: &str) -> diesel::QueryResult<Option<PlanRow>> {
            plans::find_by_receipt(conn, receipt_id)
        }
        fn maker(row: &PlanRow) -> &str {
            &row.maker
        }
        fn answer(row: PlanRow) -> Result<Self, CorruptRow> {
            PlanView::from_row(row)
        }
    }
}

/// The row of `receipt_id` in shape `T`, if `login` may see it:
/// `receipts:read` sees every plan, a planner only its own; anything else
/// is as if it did not exist, so a planner cannot learn that another
/// maker's receipt exists.
pub(super) fn readable<T: ReadById>(
    db: &Database,
    login: &Login,
    receipt_id: &str,
    deadline: &Deadline,
) -> Result<Option<T::Row>, ReadError> {
    let row = db.read(deadline, |conn| T::find(conn, receipt_id))?;
    Ok(row.filter(|row| may_see(login, T::maker(row))))
}

pub(super) fn may_see(login: &Login, maker: &str) -> bool {
    login.has(Permission::ReceiptsRead)
        || (login.has(Permission::PlansSubmit) && maker == login.name)
}

/// What the database's commit settings mean for an acknowledged plan.
pub(super) fn readiness_of(durability: &Durability) -> Readiness {
    let waits = durability.waits_for_standby();
    let warning = match durability {
        Durability::Postgres {
            synchronous_standby_names,
            synchronous_commit,
            ..
        } if !waits => Some(format!(
            "acknowledged commits do not wait for a synchronous standby \
             (synchronous_standby_names = '{synchronous_standby_names}', synchronous_commit = {synchronous_commit}): \
             a failover may lose acknowledged plans"
        )),
        _ => None,
    };
    Readiness {
        commit_waits_for_standby: waits,
        commits_blocked: durability.commits_blocked(),
        warning,
    }
}

/// What `/readyz` tells beyond "ready".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Readiness {
    /// Every acknowledged commit is on a synchronous standby too.
    pub commit_waits_for_standby: bool,
    /// Commits wait for a synchronous standby and none can confirm them
    /// now: no write completes until one is attached.
    pub commits_blocked: bool,
    /// On Postgres when it is not: what a failover may lose, and why.
    pub warning: Option<String>,
}
