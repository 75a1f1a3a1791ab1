//! Logins: created, listed and revoked by the CLI; looked up by token hash
//! on every request. A token is shown once and stored only as its hash.

use std::time::Duration;

use crate::deadline::Deadline;
use crate::intake::login::parse_permissions;
use crate::intake::{Login, Permission};
use crate::storage::logins::{self as repo, LoginRow, NewLogin};
use crate::storage::{Database, DbConn, PooledConn, StorageError};

pub const MAX_NAME_CHARS: usize = 64;
const TOKEN_PREFIX: &str = "pit_";

#[derive(Debug, thiserror::Error)]
pub enum LoginError {
    #[error("{0}")]
    Invalid(String),
    #[error("a login named `{0}` already exists")]
    Exists(String),
    #[error("no login named `{0}` (or it is already revoked)")]
    NotFound(String),
    #[error(transparent)]
    Storage(#[from] StorageError),
}

impl From<diesel::result::Error> for LoginError {
    fn from(e: diesel::result::Error) -> Self {
        LoginError::Storage(StorageError::Query(e))
    }
}

/// The blake3 hash under which a token is stored and found.
pub fn token_hash(token: &str) -> String {
    blake3::hash(token.as_bytes()).to_hex().to_string()
}

/// 256 random bits from the operating system's CSPRNG-seeded generator, in hex.
fn new_token() -> String {
    let bytes: [u8; 32] = rand::random();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("{TOKEN_PREFIX}{hex}")
}

/// Creates a login and returns its token, which is never stored or shown again.
pub fn create(
    conn: &mut DbConn,
    name: &str,
    permissions: &[Permission],
) -> Result<String, LoginError> {
    validate_name(name)?;
    repo::require_admin(conn, "logins add")?;
    if permissions.is_empty() {
        return Err(LoginError::Invalid(
            "a login needs at least one --permission".to_owned(),
        ));
    }
    let mut permissions = permissions.to_vec();
    permissions.sort();
    permissions.dedup();
    let names: Vec<&str> = permissions.iter().map(|p| p.as_str()).collect();
    let stored_permissions = serde_json::Value::from(names).to_string();
    let token = new_token();
    let hash = token_hash(&token);
    let login = NewLogin {
        name,
        token_hash: &hash,
        permissions: &stored_permissions,
        created_at: crate::intake::submit::now_micros(),
    };
    match repo::insert(conn, &login) {
        Ok(()) => Ok(token),
        Err(e) if crate::storage::errors::is_unique_violation(&e) => {
            Err(LoginError::Exists(name.to_owned()))
        }
        Err(e) => Err(e.into()),
    }
}

/// The active login that owns `token`, if any, and the connection it was
/// found on (for the request's next step). A pooled connection found dead is
/// replaced and the lookup made again, within the deadline.
pub fn authenticate(
    db: &Database,
    deadline: &Deadline,
    token: &str,
) -> Result<(Option<Login>, PooledConn), LoginError> {
    let hash = token_hash(token);
    let now = crate::intake::submit::now_micros();
    let (row, conn) = db.read_on(deadline, |conn| {
        repo::find_active_by_token_hash(conn, &hash, now)
    })?;
    let login = row.map(login_of).transpose()?;
    Ok((login, conn))
}

/// The active login that owns `token`, if any: for the command line and
/// tests, with a deadline of its own.
pub fn login_for_token(db: &Database, token: &str) -> Result<Option<Login>, LoginError> {
    let deadline = Deadline::after(std::time::Duration::from_secs(10));
    Ok(authenticate(db, &deadline, token)?.0)
}

fn login_of(row: LoginRow) -> Result<Login, LoginError> {
    let permissions = parse_permissions(&row.permissions).map_err(|e| {
        LoginError::Storage(StorageError::Config(format!("login `{}`: {e}", row.name)))
    })?;
    Ok(Login {
        name: row.name,
        permissions,
    })
}

pub fn list(conn: &mut DbConn) -> Result<Vec<LoginRow>, LoginError> {
    Ok(repo::list(conn)?)
}

pub fn revoke(conn: &mut DbConn, name: &str) -> Result<(), LoginError> {
    repo::require_admin(conn, "logins revoke")?;
    if repo::revoke(conn, name, crate::intake::submit::now_micros())? {
        Ok(())
    } else {
        Err(LoginError::NotFound(name.to_owned()))
    }
}

/// Issues a new token for the login `name` and returns it. Its current
/// token keeps working for `grace` (zero: not at all), or until the login is
/// revoked. A revoked login is active again under the new token only; no
/// token it had before comes back. Keys and receipts stay the login's.
pub fn rotate(conn: &mut DbConn, name: &str, grace: Duration) -> Result<String, LoginError> {
    repo::require_admin(conn, "logins rotate")?;
    let grace = chrono::TimeDelta::from_std(grace)
        .map_err(|_| LoginError::Invalid("the grace period is too long".to_owned()))?;
    let until = crate::intake::submit::now_micros()
        .checked_add_signed(grace)
        .ok_or_else(|| LoginError::Invalid("the grace period is too long".to_owned()))?;
    let token = new_token();
    if repo::rotate(conn, name, &token_hash(&token), until)? {
        Ok(token)
    } else {
        Err(LoginError::NotFound(name.to_owned()))
    }
}

fn validate_name(name: &str) -> Result<(), LoginError> {
    let ok = !name.is_empty()
        && name.chars().count() <= MAX_NAME_CHARS
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(LoginError::Invalid(format!(
            "login name must be 1-{MAX_NAME_CHARS} characters of A-Z, a-z, 0-9, '-', '_' or '.'"
        )))
    }
}
