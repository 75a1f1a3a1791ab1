//! The `logins` table. Tokens never touch it: only their blake3 hashes do.

use chrono::NaiveDateTime;
use diesel::prelude::*;

use super::DbConn;
use super::schema::logins;
use crate::with_conn;

#[derive(Debug, Clone, Queryable, Selectable)]
#[diesel(table_name = logins)]
pub struct LoginRow {
    pub name: String,
    pub token_hash: String,
    pub permissions: String,
    pub created_at: NaiveDateTime,
    pub revoked_at: Option<NaiveDateTime>,
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

/// The active (not revoked) login whose token hashes to `token_hash`.
/// Found by an index lookup on the hash, so no code compares secrets.
pub fn find_active_by_token_hash(
    conn: &mut DbConn,
    token_hash: &str,
) -> QueryResult<Option<LoginRow>> {
    with_conn!(conn, c => logins::table
        .filter(logins::token_hash.eq(token_hash))
        .filter(logins::revoked_at.is_null())
        .select(LoginRow::as_select())
        .first(c)
        .optional())
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
