//! Logins: who is calling and what they may do (both come from the login,
//! never from the request body), and the login's life: created, listed,
//! rotated and revoked by the command line, found by token hash on every
//! request. A token is shown once and stored only as its hash.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::deadline::Deadline;
use crate::storage::logins::{self as repo, LoginRow, NewLogin};
use crate::storage::{Database, DbConn, StorageError};

pub const MAX_NAME_CHARS: usize = 64;
const TOKEN_PREFIX: &str = "pit_";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Permission {
    /// Submit plans and read one's own receipts.
    PlansSubmit,
    /// Read every receipt and plan: the ordering system.
    ReceiptsRead,
}

impl Permission {
    pub const ALL: [Permission; 2] = [Permission::PlansSubmit, Permission::ReceiptsRead];

    pub fn as_str(self) -> &'static str {
        match self {
            Permission::PlansSubmit => "plans:submit",
            Permission::ReceiptsRead => "receipts:read",
        }
    }
}

impl fmt::Display for Permission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A permission name this service does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown permission `{0}`: use plans:submit or receipts:read")]
pub struct UnknownPermission(String);

impl FromStr for Permission {
    type Err = UnknownPermission;

    fn from_str(s: &str) -> Result<Self, UnknownPermission> {
        Permission::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| UnknownPermission(s.to_owned()))
    }
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Login {
    pub name: String,
    /// Sorted, without duplicates.
    pub permissions: Vec<Permission>,
}

impl Login {
    pub fn has(&self, permission: Permission) -> bool {
        self.permissions.contains(&permission)
    }

    /// The permissions as stored with a plan and shown in its receipt.
    pub fn permission_names(&self) -> Vec<&'static str> {
        self.permissions.iter().map(|p| p.as_str()).collect()
    }
}

/// Why a login's stored `permissions` column cannot be read back.
#[derive(Debug, thiserror::Error)]
pub enum StoredPermissionsError {
    #[error("not a JSON array of names")]
    NotJson(#[from] serde_json::Error),
    #[error(transparent)]
    Unknown(#[from] UnknownPermission),
}

/// Parses the JSON array of permission names stored in `logins.permissions`.
pub fn parse_permissions(stored: &str) -> Result<Vec<Permission>, StoredPermissionsError> {
    let names: Vec<String> = serde_json::from_str(stored)?;
    let mut permissions = names
        .iter()
        .map(|n| n.parse())
        .collect::<Result<Vec<Permission>, _>>()?;
    permissions.sort();
    permissions.dedup();
    Ok(permissions)
}

#[derive(Debug, thiserror::Error)]
pub enum LoginError {
    #[error("{0}")]
    Invalid(String),
    #[error("a login named `{0}` already exists")]
    Exists(String),
    #[error("no login named `{0}` (or it is already revoked)")]
    NotFound(String),
    #[error(
        "login `{0}` is revoked, and a rotation never lets a revoked login in again; to bring it back on purpose, with a new token only: plan-intake logins reinstate {0}"
    )]
    Revoked(String),
    #[error("no revoked login named `{0}` (only a revoked login is reinstated)")]
    NotRevoked(String),
    /// A stored login whose permissions cannot be read back: never the caller's fault.
    #[error("login `{name}` has unreadable permissions")]
    Corrupt {
        name: String,
        #[source]
        source: StoredPermissionsError,
    },
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The token could not be written out, so nothing was committed.
    #[error("the token could not be written to stdout, so nothing was changed")]
    NotHandedOver(#[source] std::io::Error),
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
    create_handed_over(conn, name, permissions, |_| Ok(()))
}

/// Creates a login, handing its token to `hand_over` (the command line
/// prints it) before the login is committed: when the token cannot be
/// handed over, no login is created, so a login exists only when someone
/// received its token.
pub fn create_handed_over(
    conn: &mut DbConn,
    name: &str,
    permissions: &[Permission],
    hand_over: impl FnOnce(&str) -> std::io::Result<()>,
) -> Result<String, LoginError> {
    validate_name(name)?;
    repo::require_admin(conn)?;
    if permissions.is_empty() {
        return Err(LoginError::Invalid(
            "a login needs at least one permission".to_owned(),
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
        created_at: crate::clock::now_micros(),
    };
    crate::storage::in_transaction(conn, |conn| {
        match repo::insert(conn, &login) {
            Ok(()) => {}
            Err(e) if crate::storage::errors::is_unique_violation(&e) => {
                return Err(LoginError::Exists(name.to_owned()));
            }
            Err(e) => return Err(e.into()),
        }
        hand_over(&token).map_err(LoginError::NotHandedOver)
    })?;
    Ok(token)
}

/// The active login whose token hashes to `hash`, if any. A pooled
/// connection found dead is replaced and the lookup made again, within the
/// deadline.
pub(crate) fn find_by_hash(
    db: &Database,
    deadline: &Deadline,
    hash: &str,
) -> Result<Option<Login>, LoginError> {
    let now = crate::clock::now_micros();
    let row = db.read(deadline, |conn| {
        repo::find_active_by_token_hash(conn, hash, now)
    })?;
    row.map(login_of).transpose()
}

/// A caller signed in to submit: its login, and the hash of the token it
/// signed in with, which the write checks again in the same step, so a
/// revocation takes effect at once however the login was found.
#[derive(Debug, Clone)]
pub struct Caller {
    pub login: Login,
    pub(super) token_hash: String,
}

/// Logins recently found active, by token hash: what lets the door refuse a
/// stranger before reading a body without a lookup for every planner's
/// request, and tell a familiar token (shown by a login within the last
/// hour, or read with every active login) from a stranger's, whose lookups
/// are bounded ([`StrangerBudget`]). Only ever a hint: the write checks the
/// token again in its own statement, so a revoked or rotated token is
/// refused at once even while it is remembered here. Unknown tokens are
/// never remembered (a new login works at once).
pub struct KnownLogins {
    entries: Mutex<HashMap<String, (Login, Instant)>>,
}

impl KnownLogins {
    /// How long a found login is trusted to decide whether to read a body.
    pub const TTL: Duration = Duration::from_secs(5);
    /// At most this many remembered; when full, all are forgotten at once.
    pub const CAPACITY: usize = 10_000;

    pub fn new() -> Self {
        Self {
            entries: Mutex::default(),
        }
    }

    fn entries(&self) -> MutexGuard<'_, HashMap<String, (Login, Instant)>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn get(&self, token_hash: &str) -> Option<Login> {
        let entries = self.entries();
        let (login, found_at) = entries.get(token_hash)?;
        (found_at.elapsed() < Self::TTL).then(|| login.clone())
    }

    pub fn remember(&self, token_hash: &str, login: &Login) {
        let mut entries = self.entries();
        if entries.len() >= Self::CAPACITY {
            entries.clear();
        }
        entries.insert(token_hash.to_owned(), (login.clone(), Instant::now()));
    }

    pub fn forget(&self, token_hash: &str) {
        self.entries().remove(token_hash);
    }
}

impl KnownLogins {
    /// How long a token a login has shown stays familiar: its lookups are
    /// never held back by the strangers' budget.
    pub const FAMILIAR: Duration = Duration::from_secs(3600);

    /// Whether a login showed this token within [`Self::FAMILIAR`].
    pub fn familiar(&self, token_hash: &str) -> bool {
        self.entries()
            .get(token_hash)
            .is_some_and(|(_, found_at)| found_at.elapsed() < Self::FAMILIAR)
    }
}

/// Lookups of unfamiliar tokens, at most [`Self::PER_SECOND`] a second (a
/// token bucket of one second's worth): a flood of strangers with random
/// tokens costs the database that many indexed reads a second, and past it
/// they are turned away before they reach the pool, while familiar tokens
/// are looked up as always. With the budget spent, an unfamiliar token
/// waits for a read of every active login begun after it arrived (one at a
/// time, at most every [`Self::REREAD`], shared by everyone waiting), so a
/// new login's token is found among them and not turned away; a stranger's
/// is turned away then, having cost no lookup of its own.
pub struct StrangerBudget {
    lookups: TokenBucket,
    /// When the last read of every active login began.
    reread_begun: Mutex<Option<Instant>>,
    /// When the last completed read of every active login began.
    reread_done: tokio::sync::watch::Sender<Option<Instant>>,
}

/// What an unfamiliar token that arrived at some instant does next, with
/// the strangers' lookups used up.
pub enum Reread {
    /// A read of every active login begun since it arrived has completed:
    /// if the token is still unfamiliar, it names no login.
    Covered,
    /// Make that read now (it began at this instant), then look again.
    Mine(Instant),
    /// Another read is under way or not yet due: wait at most this long
    /// for one to complete, then look again.
    Wait(Duration, tokio::sync::watch::Receiver<Option<Instant>>),
}

impl StrangerBudget {
    pub const PER_SECOND: f64 = 200.0;
    /// The shortest time between two reads of every active login.
    pub const REREAD: Duration = Duration::from_millis(50);

    pub fn new() -> Self {
        Self {
            lookups: TokenBucket::new(Self::PER_SECOND),
            reread_begun: Mutex::new(None),
            reread_done: tokio::sync::watch::Sender::new(None),
        }
    }

    /// What a token that arrived at `since` does next (see [`Reread`]).
    pub fn reread_for(&self, since: Instant) -> Reread {
        if self
            .reread_done
            .borrow()
            .is_some_and(|begun| begun >= since)
        {
            return Reread::Covered;
        }
        let mut begun = self
            .reread_begun
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        match *begun {
            // Under way, or failed: wait for it, or until another is due.
            Some(at) if at >= since => Reread::Wait(Self::REREAD, self.reread_done.subscribe()),
            Some(at) if now.duration_since(at) < Self::REREAD => Reread::Wait(
                Self::REREAD - now.duration_since(at),
                self.reread_done.subscribe(),
            ),
            _ => {
                *begun = Some(now);
                Reread::Mine(now)
            }
        }
    }

    /// The read of every active login begun at `begun` has completed.
    pub fn reread_completed(&self, begun: Instant) {
        self.reread_done.send_if_modified(|done| {
            let newer = done.is_none_or(|at| at < begun);
            if newer {
                *done = Some(begun);
            }
            newer
        });
    }

    /// Takes one lookup if one is left.
    pub fn try_take(&self) -> bool {
        self.lookups.try_take()
    }
}

/// So many a second, with a second's worth as a burst: the strangers'
/// lookups, the public evidence's reads.
pub struct TokenBucket {
    per_second: f64,
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    pub fn new(per_second: f64) -> Self {
        Self {
            per_second,
            state: Mutex::new((per_second, Instant::now())),
        }
    }

    /// Takes one if one is left.
    pub fn try_take(&self) -> bool {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let (tokens, refilled) = &mut *state;
        let now = Instant::now();
        *tokens = (*tokens + now.duration_since(*refilled).as_secs_f64() * self.per_second)
            .min(self.per_second);
        *refilled = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

impl Default for StrangerBudget {
    fn default() -> Self {
        Self::new()
    }
}

impl Default for KnownLogins {
    fn default() -> Self {
        Self::new()
    }
}

/// Remembers every active login under its token's hash (and its previous
/// token's, in its grace period): one read of `logins`.
pub(crate) fn remember_active(
    db: &Database,
    known: &KnownLogins,
    deadline: &Deadline,
) -> Result<(), LoginError> {
    let now = crate::clock::now_micros();
    let rows = db.read(deadline, repo::all_active)?;
    for row in rows {
        let hashes = [
            Some(row.token_hash.clone()),
            row.previous_token_hash.clone().filter(|_| {
                row.previous_token_expires_at
                    .is_some_and(|until| until > now)
            }),
        ];
        let login = login_of(row)?;
        for hash in hashes.into_iter().flatten() {
            known.remember(&hash, &login);
        }
    }
    Ok(())
}

/// The active login that owns `token`, if any, looked up outside any
/// request (tests, tools), with a deadline of its own.
pub fn login_for_token(db: &Database, token: &str) -> Result<Option<Login>, LoginError> {
    let deadline = Deadline::after(Duration::from_secs(10));
    find_by_hash(db, &deadline, &token_hash(token))
}

/// The login a stored row describes.
fn login_of(row: LoginRow) -> Result<Login, LoginError> {
    let permissions =
        parse_permissions(&row.permissions).map_err(|source| LoginError::Corrupt {
            name: row.name.clone(),
            source,
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
    repo::require_admin(conn)?;
    if repo::revoke(conn, name, crate::clock::now_micros())? {
        Ok(())
    } else {
        Err(LoginError::NotFound(name.to_owned()))
    }
}

/// Issues a new token for the active login `name` and returns it. Its
/// current token keeps working for `grace` (zero: not at all), or until the
/// login is revoked; a token still in the grace of an earlier rotation
/// stops at once (only the token just replaced is kept). A revoked login is
/// refused ([`LoginError::Revoked`]): only [`reinstate`] brings one back.
/// Keys and receipts stay the login's.
pub fn rotate(conn: &mut DbConn, name: &str, grace: Duration) -> Result<String, LoginError> {
    rotate_handed_over(conn, name, grace, |_| Ok(()))
}

/// Rotates, handing the new token to `hand_over` before the rotation is
/// committed: when it cannot be handed over, nothing changes.
pub fn rotate_handed_over(
    conn: &mut DbConn,
    name: &str,
    grace: Duration,
    hand_over: impl FnOnce(&str) -> std::io::Result<()>,
) -> Result<String, LoginError> {
    repo::require_admin(conn)?;
    let grace = chrono::TimeDelta::from_std(grace)
        .map_err(|_| LoginError::Invalid("the grace period is too long".to_owned()))?;
    let until = crate::clock::now_micros()
        .checked_add_signed(grace)
        .ok_or_else(|| LoginError::Invalid("the grace period is too long".to_owned()))?;
    let token = new_token();
    crate::storage::in_transaction(conn, |conn| {
        if !repo::rotate(conn, name, &token_hash(&token), until)? {
            return Err(if repo::is_revoked(conn, name)? {
                LoginError::Revoked(name.to_owned())
            } else {
                LoginError::NotFound(name.to_owned())
            });
        }
        hand_over(&token).map_err(LoginError::NotHandedOver)
    })?;
    Ok(token)
}

/// Makes the revoked login `name` active again, on purpose, under a new
/// token handed to `hand_over` before the change is committed; no token it
/// had before works again. The one way back for a revoked login.
pub fn reinstate_handed_over(
    conn: &mut DbConn,
    name: &str,
    hand_over: impl FnOnce(&str) -> std::io::Result<()>,
) -> Result<String, LoginError> {
    repo::require_admin(conn)?;
    let token = new_token();
    crate::storage::in_transaction(conn, |conn| {
        if !repo::reinstate(conn, name, &token_hash(&token))? {
            return Err(LoginError::NotRevoked(name.to_owned()));
        }
        hand_over(&token).map_err(LoginError::NotHandedOver)
    })?;
    Ok(token)
}

/// A login name: 1–64 of `A-Z a-z 0-9 - _ .`.
pub fn validate_name(name: &str) -> Result<(), LoginError> {
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
