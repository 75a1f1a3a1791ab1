//! Storage errors and the one place that reads a database error's kind.

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

/// True for a unique-constraint violation. The transaction that raised it has
/// already rolled back; the caller resolves it with lookups outside it.
pub fn is_unique_violation(error: &DieselError) -> bool {
    matches!(
        error,
        DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, _)
    )
}
