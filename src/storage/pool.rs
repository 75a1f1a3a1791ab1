//! The connection type, the URL that picks a backend, and the r2d2 pool.

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::r2d2::{self, ManageConnection, R2D2Connection};
use diesel::{Connection, PgConnection, SqliteConnection};

use super::StorageError;

/// Which database a URL names. Chosen from the scheme alone, so a down
/// Postgres reports its own connection error instead of "invalid URL".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DatabaseTarget {
    Postgres(String),
    Sqlite(String),
}

impl DatabaseTarget {
    /// `postgres://…` / `postgresql://…` is Postgres; `sqlite://PATH` or a plain path is SQLite.
    pub fn parse(url: &str) -> Result<Self, StorageError> {
        let url = url.trim();
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return Ok(Self::Postgres(url.to_owned()));
        }
        let path = match url.strip_prefix("sqlite://") {
            Some(path) => path,
            None if url.contains("://") => {
                return Err(StorageError::Config(format!(
                    "unsupported database URL scheme in `{}`: use postgres://, postgresql:// or sqlite://",
                    redact(url)
                )));
            }
            None => url,
        };
        if path.is_empty() {
            return Err(StorageError::Config(
                "the SQLite database URL names no file".to_owned(),
            ));
        }
        if path == ":memory:" {
            // Every pooled connection would see its own empty database.
            return Err(StorageError::Config(
                "an in-memory SQLite database cannot be shared by a pool; name a file".to_owned(),
            ));
        }
        Ok(Self::Sqlite(path.to_owned()))
    }

    pub fn backend(&self) -> Backend {
        match self {
            Self::Postgres(_) => Backend::Postgres,
            Self::Sqlite(_) => Backend::Sqlite,
        }
    }
}

/// What stands in for a password in anything printed.
const MASK: &str = "***";

/// A URL with every password replaced, fit for logs, error lines and help:
/// the one in its user info (`user:pass@`, percent-encoded or not) and any
/// `password` parameter of its query. Parsed by the `url` crate; a URL it
/// refuses (libpq's multi-host form `h1:5432,h2:5432`) is masked the same
/// way by its structure: all of the user info after the first `:`.
pub fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) if parsed.has_authority() => {
            if parsed.password().is_some() {
                // Only fails for URLs without a host, excluded above.
                let _ = parsed.set_password(Some(MASK));
            }
            let pairs: Vec<(String, String)> = parsed
                .query_pairs()
                .map(|(name, value)| (name.into_owned(), value.into_owned()))
                .collect();
            if pairs.iter().any(|(name, _)| is_password(name)) {
                parsed.query_pairs_mut().clear().extend_pairs(
                    pairs
                        .iter()
                        .map(|(name, value)| (name, if is_password(name) { MASK } else { value })),
                );
            }
            parsed.to_string()
        }
        _ => redact_by_structure(url),
    }
}

fn is_password(name: &str) -> bool {
    name.eq_ignore_ascii_case("password")
}

/// [`redact`] for a URL the parser refuses.
fn redact_by_structure(url: &str) -> String {
    let (head, query) = match url.split_once('?') {
        Some((head, query)) => (head, Some(query)),
        None => (url, None),
    };
    let mut out = match head.split_once("://") {
        Some((scheme, rest)) => {
            let authority_end = rest.find('/').unwrap_or(rest.len());
            let (authority, path) = rest.split_at(authority_end);
            match authority.rsplit_once('@') {
                Some((userinfo, hosts)) => {
                    let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
                    let masked = if userinfo.contains(':') {
                        format!("{user}:{MASK}")
                    } else {
                        user.to_owned()
                    };
                    format!("{scheme}://{masked}@{hosts}{path}")
                }
                None => head.to_owned(),
            }
        }
        None => head.to_owned(),
    };
    if let Some(query) = query {
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| {
                let name = pair.split('=').next().unwrap_or_default();
                let decoded: String = url::form_urlencoded::parse(name.as_bytes())
                    .map(|(name, _)| name.into_owned())
                    .collect();
                if is_password(&decoded) {
                    format!("{name}={MASK}")
                } else {
                    pair.to_owned()
                }
            })
            .collect();
        out.push('?');
        out.push_str(&pairs.join("&"));
    }
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Postgres => "postgres",
            Backend::Sqlite => "sqlite",
        })
    }
}

/// One open connection to either backend. Code that must differ per backend
/// matches on this in one small place (the two-row write, the migrations).
pub enum DbConn {
    Postgres(PgConnection),
    Sqlite(SqliteConnection),
}

impl DbConn {
    pub fn backend(&self) -> Backend {
        match self {
            DbConn::Postgres(_) => Backend::Postgres,
            DbConn::Sqlite(_) => Backend::Sqlite,
        }
    }
}

/// Expands `$body` once per backend with `$conn` bound to the concrete
/// connection, so diesel's full DSL (RETURNING included) type-checks for each.
#[macro_export]
macro_rules! with_conn {
    ($db:expr, $conn:ident => $body:expr) => {
        match $db {
            $crate::storage::DbConn::Postgres($conn) => $body,
            $crate::storage::DbConn::Sqlite($conn) => $body,
        }
    };
}

#[derive(Debug, Clone)]
pub struct PoolOptions {
    pub max_size: u32,
    pub checkout_timeout: Duration,
    pub sqlite_busy_timeout: Duration,
    /// The service's request deadline. Postgres sessions then get a
    /// `statement_timeout` and `lock_timeout` of this much, so no statement
    /// outlives a request by more than one deadline even if the service
    /// stops waiting for it. `None` (the command line tools): no limit.
    pub request_timeout: Option<Duration>,
    /// The service, not a command line tool: on Postgres, record this
    /// cluster's feed base at open, and keep one connection listening for
    /// other instances' writes to wake readers waiting on the feed.
    pub feed_listener: bool,
    /// Where that listener connects, when not the database URL (which
    /// cannot carry `LISTEN` through a transaction-mode pooler).
    pub feed_listen_url: Option<String>,
    /// What sits between the service and Postgres.
    pub pg_pooler: PgPooler,
    /// Postgres: the most plans one group-commit batch writes
    /// (1..=`write_queue::MAX_PG_BATCH`).
    pub pg_write_batch: usize,
}

/// A connection pooler in front of Postgres.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PgPooler {
    /// Straight to Postgres (or a session-mode pooler).
    #[default]
    None,
    /// A transaction-mode pooler (PgBouncer `pool_mode = transaction`): the
    /// service keeps no named prepared statement and sets no session state;
    /// each statement may run on another server connection.
    Transaction,
}

pub const DEFAULT_MAX_SIZE: u32 = 8;
pub const DEFAULT_CHECKOUT_TIMEOUT: Duration = Duration::from_secs(2);
pub const DEFAULT_SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

impl Default for PoolOptions {
    fn default() -> Self {
        Self {
            max_size: DEFAULT_MAX_SIZE,
            checkout_timeout: DEFAULT_CHECKOUT_TIMEOUT,
            sqlite_busy_timeout: DEFAULT_SQLITE_BUSY_TIMEOUT,
            request_timeout: None,
            feed_listener: false,
            feed_listen_url: None,
            pg_pooler: PgPooler::None,
            pg_write_batch: super::write_queue::DEFAULT_PG_BATCH,
        }
    }
}

/// libpq settings every Postgres connection gets unless its URL sets them:
/// a connect timeout, and TCP keepalives plus a user timeout so a half-open
/// connection (a server that vanished, a cut cable) is noticed in seconds
/// rather than after the kernel's two hours.
const LIBPQ_DEFAULTS: [(&str, &str); 6] = [
    ("connect_timeout", "5"),
    ("keepalives", "1"),
    ("keepalives_idle", "5"),
    ("keepalives_interval", "2"),
    ("keepalives_count", "3"),
    ("tcp_user_timeout", "10000"),
];

/// `url` with each of [`LIBPQ_DEFAULTS`] it does not set itself.
pub fn with_libpq_defaults(url: &str) -> String {
    let query = url.split_once('?').map(|(_, q)| q).unwrap_or("");
    let set: Vec<&str> = query
        .split('&')
        .filter_map(|pair| pair.split('=').next())
        .collect();
    let mut out = url.to_owned();
    let mut separator = if url.contains('?') { '&' } else { '?' };
    for (name, value) in LIBPQ_DEFAULTS {
        if !set.contains(&name) {
            out.push(separator);
            out.push_str(name);
            out.push('=');
            out.push_str(value);
            separator = '&';
        }
    }
    out
}

/// Opens connections for the pool; SQLite pragmas are set on every new
/// connection, before anything else runs on it.
#[derive(Debug, Clone)]
pub struct Manager {
    target: DatabaseTarget,
    sqlite_busy_timeout: Duration,
    request_timeout: Option<Duration>,
    pg_pooler: PgPooler,
}

impl Manager {
    pub fn new(target: DatabaseTarget, options: &PoolOptions) -> Self {
        Self {
            target,
            sqlite_busy_timeout: options.sqlite_busy_timeout,
            request_timeout: options.request_timeout,
            pg_pooler: options.pg_pooler,
        }
    }

    pub fn target(&self) -> &DatabaseTarget {
        &self.target
    }
}

impl ManageConnection for Manager {
    type Connection = DbConn;
    type Error = r2d2::Error;

    fn connect(&self) -> Result<DbConn, r2d2::Error> {
        match &self.target {
            DatabaseTarget::Postgres(url) => {
                let mut conn = PgConnection::establish(&with_libpq_defaults(url))
                    .map_err(r2d2::Error::ConnectionError)?;
                if self.pg_pooler == PgPooler::Transaction {
                    // Unnamed statements only (parse, bind and execute in one
                    // message sequence), and no session settings: the next
                    // statement may run on another server connection. The
                    // write's lock timeout is set inside its own statement.
                    conn.set_prepared_statement_cache_size(diesel::connection::CacheSize::Disabled);
                    // Nor can the isolation be pinned: the server's default
                    // must be READ COMMITTED, which every argument of the
                    // write, the feed and the log relies on.
                    let default = default_isolation(&mut conn).map_err(r2d2::Error::QueryError)?;
                    if default != READ_COMMITTED {
                        return Err(r2d2::Error::QueryError(
                            diesel::result::Error::QueryBuilderError(
                                format!(
                                    "the database's or role's default_transaction_isolation is '{default}', and behind a transaction pooler the service cannot pin READ COMMITTED on its sessions: ALTER ROLE (or DATABASE) … SET default_transaction_isolation = 'read committed'"
                                )
                                .into(),
                            ),
                        ));
                    }
                    return Ok(DbConn::Postgres(conn));
                }
                // Every transaction and statement of the service runs at
                // READ COMMITTED, whatever a DBA set as the database's or
                // role's default: the write's conflict resolution, the
                // feed's horizon and the log's rounds each rely on a new
                // snapshot per statement (ARCHITECTURE.md, "Guarantees").
                let mut settings =
                    format!("SET default_transaction_isolation = '{READ_COMMITTED}';");
                if let Some(limit) = self.request_timeout {
                    let ms = limit.as_millis().max(1);
                    settings.push_str(&format!(
                        " SET statement_timeout = {ms}; SET lock_timeout = {ms};"
                    ));
                }
                conn.batch_execute(&settings)
                    .map_err(r2d2::Error::QueryError)?;
                Ok(DbConn::Postgres(conn))
            }
            DatabaseTarget::Sqlite(path) => {
                let mut conn =
                    SqliteConnection::establish(path).map_err(r2d2::Error::ConnectionError)?;
                // busy_timeout first: what follows may wait for a lock.
                // foreign_keys is ignored inside a transaction, so it is set
                // here, per connection, before any migration runs.
                let pragmas = format!(
                    "PRAGMA busy_timeout = {};
                     PRAGMA synchronous = FULL;
                     PRAGMA foreign_keys = ON;",
                    self.sqlite_busy_timeout.as_millis()
                );
                conn.batch_execute(&pragmas)
                    .map_err(r2d2::Error::QueryError)?;
                enable_wal(&mut conn, self.sqlite_busy_timeout).map_err(r2d2::Error::QueryError)?;
                Ok(DbConn::Sqlite(conn))
            }
        }
    }

    fn is_valid(&self, conn: &mut DbConn) -> Result<(), r2d2::Error> {
        with_conn!(conn, c => c.ping()).map_err(r2d2::Error::QueryError)
    }

    fn has_broken(&self, conn: &mut DbConn) -> bool {
        // A connection whose transaction manager is in error (say, cut during
        // COMMIT) must never be handed out again.
        with_conn!(conn, c => c.is_broken())
    }
}

/// The isolation level the service's arguments rely on.
pub const READ_COMMITTED: &str = "read committed";

#[derive(diesel::QueryableByName)]
struct Setting {
    #[diesel(sql_type = diesel::sql_types::Text)]
    value: String,
}

/// The session's default isolation as the server set it at connection
/// (`reset_val`: postgresql.conf, then the database's, the role's and the
/// connection's own settings), whatever the session set since.
pub fn default_isolation(conn: &mut PgConnection) -> diesel::QueryResult<String> {
    use diesel::RunQueryDsl;
    diesel::sql_query(
        "SELECT reset_val AS value FROM pg_settings WHERE name = 'default_transaction_isolation'",
    )
    .get_result::<Setting>(conn)
    .map(|s| s.value)
}

#[derive(diesel::QueryableByName)]
struct JournalMode {
    #[diesel(sql_type = diesel::sql_types::Text)]
    journal_mode: String,
}

/// WAL mode is a property of the file and stays once set, so only the first
/// connection to a new file sets it. Switching needs the file to itself and
/// SQLite answers "database is locked" at once, busy handler or not, when
/// another process is doing the same (two `migrate run` on a new file): so
/// this retries within the busy timeout.
fn enable_wal(conn: &mut SqliteConnection, patience: Duration) -> diesel::QueryResult<()> {
    use diesel::RunQueryDsl;
    let deadline = std::time::Instant::now() + patience;
    loop {
        let attempt = diesel::sql_query("PRAGMA journal_mode")
            .get_result::<JournalMode>(conn)
            .and_then(|mode| {
                if mode.journal_mode.eq_ignore_ascii_case("wal") {
                    Ok(())
                } else {
                    conn.batch_execute("PRAGMA journal_mode = WAL")
                }
            });
        match attempt {
            Err(e) if super::errors::is_busy(&e) && std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            other => return other,
        }
    }
}

pub type DbPool = r2d2::Pool<Manager>;
pub type PooledConn = r2d2::PooledConnection<Manager>;

/// Builds the pool without connecting; callers connect once first through
/// [`Manager::connect`] so that a bad URL or a down server shows its real error.
pub fn build_pool(manager: Manager, options: &PoolOptions) -> DbPool {
    r2d2::Pool::builder()
        .max_size(options.max_size)
        .min_idle(Some(0))
        .connection_timeout(options.checkout_timeout)
        // No ping per checkout (a round trip on every request): a connection a
        // restarted server closed fails its first statement, the write path
        // classifies that as a lost connection and retries on a fresh one,
        // and the pool drops the broken connection (`has_broken`).
        .test_on_check_out(false)
        .build_unchecked(manager)
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn every_form_of_password_is_masked() {
        for (url, shown) in [
            (
                "postgres://u:s3cret@h:5432/db",
                "postgres://u:***@h:5432/db",
            ),
            (
                "postgres://u:s3%63ret@h/db?sslmode=require",
                "postgres://u:***@h/db?sslmode=require",
            ),
            (
                "postgresql://u@h/db?application_name=x&password=s3cret",
                "postgresql://u@h/db?application_name=x&password=***",
            ),
            (
                "postgres://u:s3cret@h1:5432,h2:5432/db?PassWord=s3cret&target_session_attrs=read-write",
                "postgres://u:***@h1:5432,h2:5432/db?PassWord=***&target_session_attrs=read-write",
            ),
            ("postgres://u@h/db", "postgres://u@h/db"),
            ("sqlite://plan-intake.db", "sqlite://plan-intake.db"),
            ("plan-intake.db", "plan-intake.db"),
        ] {
            assert_eq!(redact(url), shown, "{url}");
        }
    }
}
