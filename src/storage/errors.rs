//! Storage errors and the one place that classifies a database error.
//!
//! diesel exposes no SQLSTATE: 23505, 23503, 23502, 23514, 40001 and the
//! connection classes arrive as `DatabaseErrorKind`s, but deadlock (40P01),
//! lock timeout (55P03), statement cancel (57014) and SQLite's BUSY/LOCKED
//! arrive as `Unknown` and differ only in the server's English message text.
//! `classify` therefore reads those messages; each class has a test against a
//! real server (`tests/it/faults.rs`).

use diesel::result::{DatabaseErrorKind, Error as DieselError};

#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// A bad database URL or option: the operator's mistake, found at start.
    #[error("{0}")]
    Config(String),
    /// The database cannot be reached, or no pooled connection freed up in time.
    #[error("{0}")]
    Unavailable(String),
    #[error("migrations are pending: {}", .0.join(", "))]
    PendingMigrations(Vec<String>),
    #[error("migration failed: {0}")]
    Migration(String),
    #[error(transparent)]
    Query(#[from] DieselError),
}

/// What a failed write means, and so what the write path does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureClass {
    /// A unique rule refused the row: resolve by lookups after rollback.
    Conflict,
    /// The server rolled back (or nothing was sent): retry the whole transaction.
    Transient(TransientCause),
    /// A rule the request itself breaks (CHECK, NOT NULL, foreign key): never retried.
    Permanent,
    /// Lost or cancelled during COMMIT: it may have landed. Re-read before anything else.
    UnknownOutcome,
    /// The database is unreachable or read-only: stop and answer 503.
    Infrastructure,
    /// Anything else: a bug or a surprise; not retried.
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransientCause {
    Deadlock,
    SerializationFailure,
    LockTimeout,
    SqliteBusy,
    ConnectionLost,
    StatementCancelled,
}

impl TransientCause {
    /// The label under which retries of this cause are counted.
    pub fn as_str(self) -> &'static str {
        match self {
            TransientCause::Deadlock => "deadlock",
            TransientCause::SerializationFailure => "serialization_failure",
            TransientCause::LockTimeout => "lock_timeout",
            TransientCause::SqliteBusy => "sqlite_busy",
            TransientCause::ConnectionLost => "connection_lost",
            TransientCause::StatementCancelled => "statement_cancelled",
        }
    }
}

/// Classifies a failed write transaction. `commit_sent` is true when the
/// transaction's body had finished, so the error came from COMMIT itself
/// (diesel reports a cut during the body and one during COMMIT alike).
pub fn classify(error: &DieselError, commit_sent: bool) -> FailureClass {
    use DatabaseErrorKind as Kind;
    let lost_or_cancelled = |cause| {
        if commit_sent {
            FailureClass::UnknownOutcome
        } else {
            FailureClass::Transient(cause)
        }
    };
    match error {
        DieselError::DatabaseError(kind, info) => match kind {
            Kind::UniqueViolation => FailureClass::Conflict,
            Kind::SerializationFailure => {
                FailureClass::Transient(TransientCause::SerializationFailure)
            }
            Kind::CheckViolation | Kind::NotNullViolation | Kind::ForeignKeyViolation => {
                FailureClass::Permanent
            }
            Kind::ClosedConnection => lost_or_cancelled(TransientCause::ConnectionLost),
            Kind::ReadOnlyTransaction => FailureClass::Infrastructure,
            _ => classify_message(info.message(), commit_sent),
        },
        DieselError::BrokenTransactionManager => lost_or_cancelled(TransientCause::ConnectionLost),
        _ => FailureClass::Other,
    }
}

/// The classes diesel leaves as `Unknown`, told apart by the server's words.
fn classify_message(message: &str, commit_sent: bool) -> FailureClass {
    let message = message.to_ascii_lowercase();
    let transient = |cause| FailureClass::Transient(cause);
    if message.contains("deadlock detected") {
        transient(TransientCause::Deadlock)
    } else if message.contains("could not obtain lock")
        || message.contains("canceling statement due to lock timeout")
    {
        transient(TransientCause::LockTimeout)
    } else if message.contains("database is locked") || message.contains("database table is locked")
    {
        transient(TransientCause::SqliteBusy)
    } else if message.contains("canceling statement due to statement timeout")
        || message.contains("canceling statement due to user request")
    {
        // A cancel during COMMIT is exactly the unknown case; before it, the
        // server has rolled the transaction back.
        if commit_sent {
            FailureClass::UnknownOutcome
        } else {
            transient(TransientCause::StatementCancelled)
        }
    } else if message.contains("server closed the connection")
        || message.contains("terminating connection")
        || message.contains("connection to server")
        || message.contains("no connection to the server")
        || message.contains("ssl syscall error")
        || message.contains("could not receive data")
        || message.contains("could not send data")
    {
        if commit_sent {
            FailureClass::UnknownOutcome
        } else {
            transient(TransientCause::ConnectionLost)
        }
    } else if message.contains("read-only transaction") || message.contains("disk") {
        FailureClass::Infrastructure
    } else {
        FailureClass::Other
    }
}

/// True for a unique-constraint violation. The transaction that raised it has
/// already rolled back; the caller resolves it with lookups outside it.
pub fn is_unique_violation(error: &DieselError) -> bool {
    matches!(
        error,
        DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, _)
    )
}
