//! Storage errors and the one place that classifies a failed write.
//!
//! Classes are decided by codes, never by message text (a server's
//! `lc_messages` may be any language, and libpq's own wording varies):
//!
//! * diesel maps the SQLSTATEs 23505, 23503, 23502, 23514, 40001, 25006 and
//!   the 08xxx connection classes to a `DatabaseErrorKind`;
//! * every other Postgres error the write raises comes out of
//!   `plan_intake_write`, which re-raises it with its SQLSTATE in the hint
//!   (`plan-intake-sqlstate:40P01`, migration `…_plan_intake_write_timed`);
//! * a lost connection is told by the connection's own state (libpq reports
//!   no transaction status for a dead connection), whatever the message says;
//! * SQLite's BUSY and LOCKED are recognised by SQLite's own text for those
//!   result codes (`sqlite3_errstr`), which is what its error message is.
//!
//! Anything not recognised is `Unavailable`: a 503 asking for a retry with
//! the same key, never a 500.

use diesel::result::{DatabaseErrorKind, Error as DieselError};

#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// A bad database URL or option, or a command refused as given: the
    /// operator's mistake, told in the message (there is no cause below it).
    #[error("{0}")]
    Config(String),
    /// The database cannot be reached, or no pooled connection freed up in time.
    #[error("{what}")]
    Unavailable {
        what: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The request's deadline passed before the database answered.
    #[error("the request's deadline passed while {0}")]
    DeadlineExceeded(&'static str),
    #[error("migrations are pending: {}", .0.join(", "))]
    PendingMigrations(Vec<String>),
    /// The role lacks a privilege a command needs on a table: told with
    /// the `migrate grants` line that gives it (never read from an error's
    /// words: asked of the catalog first).
    #[error(
        "role `{role}` may not {privilege} `{table}`: as the owner, run `plan-intake migrate grants {role}{grants_flag}` and apply what it prints"
    )]
    MissingPrivilege {
        role: String,
        privilege: &'static str,
        table: &'static str,
        grants_flag: &'static str,
    },
    /// The service's role lacks grants it needs (an upgrade that added
    /// tables, without `migrate grants` run again).
    #[error(
        "role `{role}` lacks {}: as the owner, run `plan-intake migrate grants {role}` and apply what it prints (again after every upgrade)",
        .missing.join(", ")
    )]
    MissingGrants { role: String, missing: Vec<String> },
    /// A SQLite file that does not exist, asked of a command that does not
    /// create databases.
    #[error(
        "no SQLite database at {0}: nothing was created (`plan-intake migrate run` creates and migrates one; only it and `serve` create a database)"
    )]
    NoDatabase(String),
    /// A migration could not be applied, reverted or read.
    #[error("migration failed while {step}")]
    Migration {
        step: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A change of the schema or of the logins, asked of a role that may
    /// only read and write rows (the service's).
    #[error(
        "{change} needs the owner of the database objects, and role `{role}` is not: connect as the owner"
    )]
    NeedsOwner { change: &'static str, role: String },
    /// A migration asked over a transaction-mode pooler, which cannot keep
    /// the session-level lock migrations hold.
    #[error(
        "migrations hold a session-level lock, which a transaction-mode pooler does not keep: connect directly to Postgres to migrate"
    )]
    MigratingThroughPooler,
    #[error(transparent)]
    Query(#[from] DieselError),
}

impl StorageError {
    pub fn migration(
        step: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        StorageError::Migration {
            step: step.into(),
            source: source.into(),
        }
    }

    pub fn unavailable(
        what: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        StorageError::Unavailable {
            what: what.into(),
            source: Some(Box::new(source)),
        }
    }
}

/// What a failed write means, and so what the write path does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureClass {
    /// A unique rule refused the row: resolve by lookups after rollback.
    Conflict,
    /// The server rolled back (or nothing was sent): retry the whole write.
    Transient(TransientCause),
    /// A CHECK rule of the table refuses this plan: the request itself is
    /// refused (422) and never retried.
    Refused,
    /// Lost or cancelled during COMMIT: it may have landed. Re-read before anything else.
    UnknownOutcome,
    /// The database's storage is full (Postgres `disk_full` 53100,
    /// SQLite `SQLITE_FULL`): nothing was written; 503 saying so, retry
    /// later with the same key once an operator freed space.
    StorageFull,
    /// Anything else (a missing privilege, a rule the schema gained): 503,
    /// retry later with the same key; not retried here.
    Unavailable,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransientCause {
    Deadlock,
    SerializationFailure,
    LockTimeout,
    SqliteBusy,
    ConnectionLost,
    StatementCancelled,
    /// The connection's server is read-only now (a demoted or fenced
    /// primary, SQLSTATE 25006): discard it; a fresh one finds the primary.
    ReadOnlyNode,
}

impl TransientCause {
    pub const ALL: [TransientCause; 7] = [
        TransientCause::Deadlock,
        TransientCause::SerializationFailure,
        TransientCause::LockTimeout,
        TransientCause::SqliteBusy,
        TransientCause::ConnectionLost,
        TransientCause::StatementCancelled,
        TransientCause::ReadOnlyNode,
    ];

    /// The label under which retries of this cause are counted.
    pub fn as_str(self) -> &'static str {
        match self {
            TransientCause::Deadlock => "deadlock",
            TransientCause::SerializationFailure => "serialization_failure",
            TransientCause::LockTimeout => "lock_timeout",
            TransientCause::SqliteBusy => "sqlite_busy",
            TransientCause::ConnectionLost => "connection_lost",
            TransientCause::StatementCancelled => "statement_cancelled",
            TransientCause::ReadOnlyNode => "read_only_node",
        }
    }
}

/// The prefix of the hint `plan_intake_write` puts on every error it raises.
pub const SQLSTATE_HINT: &str = "plan-intake-sqlstate:";

/// The SQLSTATE `plan_intake_write` attached to `error`, if it raised it.
pub fn marked_sqlstate(error: &DieselError) -> Option<&str> {
    match error {
        DieselError::DatabaseError(_, info) => info.hint()?.strip_prefix(SQLSTATE_HINT),
        _ => None,
    }
}

/// Classifies a failed write. `commit_sent`: the statement that commits had
/// been sent, so a lost connection leaves the outcome unknown (diesel reports
/// a cut before and during COMMIT alike). `connection_lost`: the connection
/// was found dead after the failure.
pub fn classify(error: &DieselError, commit_sent: bool, connection_lost: bool) -> FailureClass {
    use DatabaseErrorKind as Kind;
    let lost = if commit_sent {
        FailureClass::UnknownOutcome
    } else {
        FailureClass::Transient(TransientCause::ConnectionLost)
    };
    if let Some(code) = marked_sqlstate(error) {
        // Raised by the server inside the write function: the statement's
        // transaction rolled back, whatever the code.
        return class_of_sqlstate(code).unwrap_or(FailureClass::Unavailable);
    }
    // SQLite's FULL, at a statement or at COMMIT: either way the
    // transaction did not commit.
    if is_storage_full(error) {
        return FailureClass::StorageFull;
    }
    match error {
        DieselError::DatabaseError(kind, info) => match kind {
            Kind::UniqueViolation => FailureClass::Conflict,
            Kind::SerializationFailure => {
                FailureClass::Transient(TransientCause::SerializationFailure)
            }
            Kind::CheckViolation => FailureClass::Refused,
            Kind::ReadOnlyTransaction => FailureClass::Transient(TransientCause::ReadOnlyNode),
            Kind::ClosedConnection | Kind::UnableToSendCommand => lost,
            _ if connection_lost => lost,
            _ if is_sqlite_busy(info.message()) => {
                FailureClass::Transient(TransientCause::SqliteBusy)
            }
            // Raised outside the write function's body with the connection
            // alive: at COMMIT (a deferred rule, a cancel) it may have been
            // a commit, so re-read; before it, nothing was written.
            Kind::Unknown if commit_sent => FailureClass::UnknownOutcome,
            _ => FailureClass::Unavailable,
        },
        DieselError::BrokenTransactionManager => lost,
        _ if connection_lost => lost,
        _ => FailureClass::Unavailable,
    }
}

/// The class of a Postgres SQLSTATE raised inside the write function (so the
/// statement's transaction is known to have rolled back).
pub fn class_of_sqlstate(code: &str) -> Option<FailureClass> {
    use FailureClass::*;
    use TransientCause::*;
    Some(match code {
        "23505" => Conflict,
        "23514" => Refused,
        "40P01" => Transient(Deadlock),
        "40001" => Transient(SerializationFailure),
        "55P03" => Transient(LockTimeout),
        // statement_timeout or a cancel request: the function's work rolled back.
        "57014" => Transient(StatementCancelled),
        // A read-only server (a standby, or a primary fenced by
        // default_transaction_read_only): nothing was written.
        "25006" => Transient(ReadOnlyNode),
        // Shutting down, crashed, or not yet accepting: the server goes away.
        "57P01" | "57P02" | "57P03" => Transient(ConnectionLost),
        // disk_full: the write's rows rolled back with the statement.
        "53100" => StorageFull,
        code if code.starts_with("08") => Transient(ConnectionLost),
        _ => return None,
    })
}

/// SQLite's message for a BUSY or LOCKED result is the library's own fixed
/// text for that code; compare with it rather than with a copy of the words.
fn is_sqlite_busy(message: &str) -> bool {
    use libsqlite3_sys::{SQLITE_BUSY, SQLITE_LOCKED};
    sqlite_text_of_any(message, &[SQLITE_BUSY, SQLITE_LOCKED])
}

/// Whether `message` is SQLite's own fixed text for one of `codes`.
fn sqlite_text_of_any(message: &str, codes: &[std::os::raw::c_int]) -> bool {
    codes.iter().any(|&code| {
        // SAFETY: sqlite3_errstr returns a static, NUL-terminated string for
        // every result code, valid for the life of the process.
        let text = unsafe { std::ffi::CStr::from_ptr(libsqlite3_sys::sqlite3_errstr(code)) };
        text.to_str().is_ok_and(|text| text == message)
    })
}

/// True when the database's storage is full: Postgres's `disk_full`
/// (53100, as the write function marks it) or SQLite's FULL (by its own
/// text for that code).
pub fn is_storage_full(error: &DieselError) -> bool {
    marked_sqlstate(error) == Some("53100")
        || matches!(error, DieselError::DatabaseError(_, info)
            if sqlite_text_of_any(info.message(), &[libsqlite3_sys::SQLITE_FULL]))
}

/// True for SQLite's BUSY/LOCKED, by result code (see [`classify`]).
pub fn is_busy(error: &DieselError) -> bool {
    matches!(error, DieselError::DatabaseError(DatabaseErrorKind::Unknown, info) if is_sqlite_busy(info.message()))
}

/// True for a unique-constraint violation. The transaction that raised it has
/// already rolled back; the caller resolves it with lookups outside it.
pub fn is_unique_violation(error: &DieselError) -> bool {
    matches!(
        error,
        DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, _)
    )
}

/// True when the connection is gone: by the error's kind, or by the state
/// the connection was left in.
pub fn is_connection_lost(error: &DieselError, connection_broken: bool) -> bool {
    connection_broken
        || matches!(
            error,
            DieselError::DatabaseError(
                DatabaseErrorKind::ClosedConnection | DatabaseErrorKind::UnableToSendCommand,
                _
            ) | DieselError::BrokenTransactionManager
        )
}

/// A copy of `error` for each of several writers that shared one failed
/// statement (diesel's errors are not `Clone`): its kind and every field
/// classification or a log reads, the SQLSTATE mark in the hint included.
pub fn copy_error(error: &DieselError) -> DieselError {
    match error {
        DieselError::DatabaseError(kind, info) => DieselError::DatabaseError(
            *kind,
            Box::new(CopiedInfo {
                message: info.message().to_owned(),
                details: info.details().map(str::to_owned),
                hint: info.hint().map(str::to_owned),
                table_name: info.table_name().map(str::to_owned),
                column_name: info.column_name().map(str::to_owned),
                constraint_name: info.constraint_name().map(str::to_owned),
                statement_position: info.statement_position(),
            }),
        ),
        DieselError::BrokenTransactionManager => DieselError::BrokenTransactionManager,
        other => DieselError::QueryBuilderError(other.to_string().into()),
    }
}

#[derive(Debug)]
struct CopiedInfo {
    message: String,
    details: Option<String>,
    hint: Option<String>,
    table_name: Option<String>,
    column_name: Option<String>,
    constraint_name: Option<String>,
    statement_position: Option<i32>,
}

impl diesel::result::DatabaseErrorInformation for CopiedInfo {
    fn message(&self) -> &str {
        &self.message
    }
    fn details(&self) -> Option<&str> {
        self.details.as_deref()
    }
    fn hint(&self) -> Option<&str> {
        self.hint.as_deref()
    }
    fn table_name(&self) -> Option<&str> {
        self.table_name.as_deref()
    }
    fn column_name(&self) -> Option<&str> {
        self.column_name.as_deref()
    }
    fn constraint_name(&self) -> Option<&str> {
        self.constraint_name.as_deref()
    }
    fn statement_position(&self) -> Option<i32> {
        self.statement_position
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A database error as diesel would report it, with an optional hint.
    #[derive(Debug)]
    struct Info {
        message: &'static str,
        hint: Option<&'static str>,
    }

    impl diesel::result::DatabaseErrorInformation for Info {
        fn message(&self) -> &str {
            self.message
        }
        fn details(&self) -> Option<&str> {
            None
        }
        fn hint(&self) -> Option<&str> {
            self.hint
        }
        fn table_name(&self) -> Option<&str> {
            None
        }
        fn column_name(&self) -> Option<&str> {
            None
        }
        fn constraint_name(&self) -> Option<&str> {
            None
        }
        fn statement_position(&self) -> Option<i32> {
            None
        }
    }

    fn error(
        kind: DatabaseErrorKind,
        message: &'static str,
        hint: Option<&'static str>,
    ) -> DieselError {
        DieselError::DatabaseError(kind, Box::new(Info { message, hint }))
    }

    #[test]
    fn a_marked_sqlstate_decides_whatever_the_language() {
        let cases = [
            (
                "plan-intake-sqlstate:40P01",
                FailureClass::Transient(TransientCause::Deadlock),
            ),
            (
                "plan-intake-sqlstate:55P03",
                FailureClass::Transient(TransientCause::LockTimeout),
            ),
            (
                "plan-intake-sqlstate:57014",
                FailureClass::Transient(TransientCause::StatementCancelled),
            ),
            (
                "plan-intake-sqlstate:40001",
                FailureClass::Transient(TransientCause::SerializationFailure),
            ),
            ("plan-intake-sqlstate:23505", FailureClass::Conflict),
            ("plan-intake-sqlstate:23514", FailureClass::Refused),
            ("plan-intake-sqlstate:23502", FailureClass::Unavailable),
            ("plan-intake-sqlstate:42501", FailureClass::Unavailable),
            ("plan-intake-sqlstate:53100", FailureClass::StorageFull),
        ];
        for (hint, class) in cases {
            for commit_sent in [false, true] {
                let e = error(
                    DatabaseErrorKind::Unknown,
                    "FEHLER: Verklemmung (Deadlock) entdeckt",
                    Some(hint),
                );
                assert_eq!(classify(&e, commit_sent, false), class, "{hint}");
            }
        }
    }

    #[test]
    fn a_lost_connection_is_known_by_state_not_by_words() {
        let e = error(
            DatabaseErrorKind::Unknown,
            "keine Verbindung zum Server",
            None,
        );
        assert_eq!(
            classify(&e, false, true),
            FailureClass::Transient(TransientCause::ConnectionLost)
        );
        assert_eq!(classify(&e, true, true), FailureClass::UnknownOutcome);
        let closed = error(DatabaseErrorKind::ClosedConnection, "", None);
        assert_eq!(classify(&closed, true, false), FailureClass::UnknownOutcome);
    }

    #[test]
    fn an_unrecognised_error_is_unavailable_or_unknown_never_a_bug() {
        let e = error(DatabaseErrorKind::Unknown, "irgendwas", None);
        assert_eq!(classify(&e, false, false), FailureClass::Unavailable);
        assert_eq!(classify(&e, true, false), FailureClass::UnknownOutcome);
        let fk = error(DatabaseErrorKind::ForeignKeyViolation, "", None);
        assert_eq!(classify(&fk, true, false), FailureClass::Unavailable);
        let read_only = error(DatabaseErrorKind::ReadOnlyTransaction, "", None);
        assert_eq!(
            classify(&read_only, false, false),
            FailureClass::Transient(TransientCause::ReadOnlyNode)
        );
        let other = DieselError::NotFound;
        assert_eq!(classify(&other, false, false), FailureClass::Unavailable);
    }

    #[test]
    fn sqlite_busy_is_recognised_by_its_result_code_text() {
        let busy = error(DatabaseErrorKind::Unknown, "database is locked", None);
        assert_eq!(
            classify(&busy, false, false),
            FailureClass::Transient(TransientCause::SqliteBusy)
        );
        assert!(is_busy(&busy));
        let locked = error(DatabaseErrorKind::Unknown, "database table is locked", None);
        assert!(is_busy(&locked));
    }

    /// SQLite's FULL, by its own text, at a statement or at COMMIT alike.
    #[test]
    fn sqlite_full_is_recognised_by_its_result_code_text() {
        let full = error(DatabaseErrorKind::Unknown, "database or disk is full", None);
        for commit_sent in [false, true] {
            assert_eq!(
                classify(&full, commit_sent, false),
                FailureClass::StorageFull
            );
        }
        assert!(is_storage_full(&full));
        let other = error(DatabaseErrorKind::Unknown, "disk I/O error", None);
        assert!(!is_storage_full(&other));
    }
}
