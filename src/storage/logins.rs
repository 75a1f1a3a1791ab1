//! The `logins` table. Tokens never touch it: only their blake3 hashes do.

use chrono::NaiveDateTime;
use diesel::prelude::*;

use super::schema::logins;
use super::{DbConn, StorageError};
use crate::with_conn;

#[derive(Debug, Clone, Queryable, Selectable)]
#[diesel(table_name = logins)]
pub struct LoginRow {
    pub name: String,
    pub token_hash: String,
    pub permissions: String,
    pub created_at: NaiveDateTime,
    pub revoked_at: Option<NaiveDateTime>,
    pub previous_token_hash: Option<String>,
    pub previous_token_expires_at: Option<NaiveDateTime>,
}

#[derive(Debug, Insertable)]
#[diesel(table_name = logins)]
pub struct NewLogin<'a> {
    pub name: &'a str,
    pub token_hash: &'a str,
    pub permissions: &'a str,
    pub created_at: NaiveDateTime,
}

pub fn insert(conn: &mut DbConn, login: &NewLogin<'_>) -> QueryResult<()> {
    with_conn!(conn, c => diesel::insert_into(logins::table).values(login).execute(c)).map(|_| ())
}

/// The query for the active (not revoked) login whose token hashes to
/// `token_hash`: its current token, or its previous one while that is in
/// its grace period. Index lookups on the hashes, so no code compares
/// secrets.
macro_rules! active_by_token_hash {
    ($token_hash:expr, $now:expr) => {
        logins::table
            .filter(
                logins::token_hash
                    .eq($token_hash)
                    .or(logins::previous_token_hash
                        .eq($token_hash)
                        .and(logins::previous_token_expires_at.gt($now))),
            )
            .filter(logins::revoked_at.is_null())
            .select(LoginRow::as_select())
    };
}

/// The active login whose token hashes to `token_hash`, as of `now`
/// (`get_result`, not `first`: see `plans::by_key` on SQLite's `LIMIT ?`).
pub fn find_active_by_token_hash(
    conn: &mut DbConn,
    token_hash: &str,
    now: NaiveDateTime,
) -> QueryResult<Option<LoginRow>> {
    with_conn!(conn, c => active_by_token_hash!(token_hash, now).get_result(c).optional())
}

/// Every active (not revoked) login.
pub fn all_active(conn: &mut DbConn) -> QueryResult<Vec<LoginRow>> {
    with_conn!(conn, c => logins::table
        .filter(logins::revoked_at.is_null())
        .select(LoginRow::as_select())
        .load(c))
}

/// SQLite: [`find_active_by_token_hash`] on the connection that writes.
pub(super) fn find_active_on_sqlite(
    lite: &mut diesel::SqliteConnection,
    token_hash: &str,
    now: NaiveDateTime,
) -> QueryResult<Option<LoginRow>> {
    active_by_token_hash!(token_hash, now)
        .get_result(lite)
        .optional()
}

/// Whether a stored login may submit plans (the write's own check; the
/// door reads the same permission from the parsed login).
pub(super) fn may_submit(row: &LoginRow) -> bool {
    serde_json::from_str::<Vec<String>>(&row.permissions)
        .is_ok_and(|names| names.iter().any(|n| n == "plans:submit"))
}

/// Gives the active login `name` the token hashed `new_token_hash`; its
/// current token stays valid until `previous_valid_until` (a previous
/// token still in its grace period is replaced: only the token just
/// replaced is kept). Returns false when no active login has that name: a
/// revoked login is never made active by a rotation.
pub fn rotate(
    conn: &mut DbConn,
    name: &str,
    new_token_hash: &str,
    previous_valid_until: NaiveDateTime,
) -> QueryResult<bool> {
    with_conn!(conn, c => diesel::update(logins::table)
        .filter(logins::name.eq(name))
        .filter(logins::revoked_at.is_null())
        .set((
            logins::previous_token_hash.eq(logins::token_hash.nullable()),
            logins::previous_token_expires_at.eq(Some(previous_valid_until)),
            logins::token_hash.eq(new_token_hash),
        ))
        .execute(c))
    .map(|rows| rows == 1)
}

/// Makes the revoked login `name` active again under the token hashed
/// `new_token_hash` only (no token it had before works again). Returns
/// false when no revoked login has that name.
pub fn reinstate(conn: &mut DbConn, name: &str, new_token_hash: &str) -> QueryResult<bool> {
    with_conn!(conn, c => diesel::update(logins::table)
        .filter(logins::name.eq(name))
        .filter(logins::revoked_at.is_not_null())
        .set((
            logins::previous_token_hash.eq(None::<String>),
            logins::previous_token_expires_at.eq(None::<NaiveDateTime>),
            logins::token_hash.eq(new_token_hash),
            logins::revoked_at.eq(None::<NaiveDateTime>),
        ))
        .execute(c))
    .map(|rows| rows == 1)
}

/// Whether a login named `name` exists and is revoked.
pub fn is_revoked(conn: &mut DbConn, name: &str) -> QueryResult<bool> {
    let revoked: Option<Option<NaiveDateTime>> = with_conn!(conn, c => logins::table
        .filter(logins::name.eq(name))
        .select(logins::revoked_at)
        .get_result(c)
        .optional())?;
    Ok(matches!(revoked, Some(Some(_))))
}

pub fn list(conn: &mut DbConn) -> QueryResult<Vec<LoginRow>> {
    with_conn!(conn, c => logins::table
        .order(logins::name.asc())
        .select(LoginRow::as_select())
        .load(c))
}

/// Marks the login revoked; returns false when no active login has that name.
pub fn revoke(conn: &mut DbConn, name: &str, at: NaiveDateTime) -> QueryResult<bool> {
    with_conn!(conn, c => diesel::update(logins::table)
        .filter(logins::name.eq(name))
        .filter(logins::revoked_at.is_null())
        .set(logins::revoked_at.eq(at))
        .execute(c))
    .map(|rows| rows == 1)
}

/// Refuses, in one line, a role that may not change logins (the service's
/// role may only read them). SQLite has no roles.
pub fn require_admin(conn: &mut DbConn) -> Result<(), StorageError> {
    match conn {
        DbConn::Postgres(pg) => super::migrations::require(
            pg,
            "changing logins",
            "SELECT has_table_privilege('logins', 'INSERT') AND has_table_privilege('logins', 'UPDATE') AS flag",
        ),
        DbConn::Sqlite(_) => Ok(()),
    }
}
