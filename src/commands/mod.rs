//! The commands' bodies, one module each; `main.rs` holds the command line
//! and hands each its arguments. Here: what they share (their error and its
//! exit status, the database and service arguments, checked stdout lines).

pub mod evidence;
pub mod follow;
pub mod inbox;
pub mod keys;
pub mod logins;
pub mod migrate;
pub mod serve;
pub mod submit;

use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use clap::Args;
use plan_intake::config::{DEFAULT_DATABASE_URL, DEFAULT_SERVICE_URL};
use plan_intake::intake::login::LoginError;
use plan_intake::serve::ServeError;
use plan_intake::storage::{Database, MigrateOnOpen, PgPooler, PoolOptions, StorageError};
use plan_intake::verify::VerifyError;
use plan_intake_client::{Client, FollowError, SubmitError};

/// One line on stdout, checked and flushed: a closed, full or broken
/// stdout ends the command with one line on stderr and exit 74, never a
/// panic.
macro_rules! say {
    ($($arg:tt)*) => {
        plan_intake::stdout::line(&format!($($arg)*)).map_err($crate::commands::CommandError::Output)?
    };
}

pub(crate) use say;

/// Whether stderr speaks JSON (`--log-format json`): set once, by `main`,
/// before any command runs.
static STDERR_JSON: AtomicBool = AtomicBool::new(false);

pub fn stderr_in_json(json: bool) {
    STDERR_JSON.store(json, std::sync::atomic::Ordering::Relaxed);
}

/// One line for the operator on stderr, whatever the log filter: as it
/// is, or with `--log-format json` one JSON object shaped as the log's
/// own lines (`timestamp`, `level`, `message`, `target`), so that every
/// line on stderr parses alike. A stderr that is gone is not worth a panic.
pub fn tell_line(level: &str, message: &str, extra: &[(&str, serde_json::Value)]) {
    use std::io::Write as _;
    let line = if STDERR_JSON.load(std::sync::atomic::Ordering::Relaxed) {
        let mut object = serde_json::json!({
            "timestamp": plan_intake::intake::receipt::format_timestamp(
                &plan_intake::clock::now_micros()
            ),
            "level": level,
            "message": message,
            "target": "plan_intake",
        });
        for (name, value) in extra {
            object[*name] = value.clone();
        }
        object.to_string()
    } else {
        message.to_owned()
    };
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// `tell_line` at INFO with `format!`'s arguments.
macro_rules! tell {
    ($($arg:tt)*) => {
        $crate::commands::tell_line("INFO", &format!($($arg)*), &[])
    };
}

pub(crate) use tell;

/// What stops a command, with its causes: one line, exit 1.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error(transparent)]
    Login(#[from] LoginError),
    #[error(transparent)]
    Serve(#[from] ServeError),
    #[error(transparent)]
    Verify(#[from] VerifyError),
    #[error("{0} verify check(s) failed")]
    ChecksFailed(usize),
    #[error(transparent)]
    Submit(#[from] SubmitError),
    #[error(transparent)]
    Follow(#[from] FollowError),
    #[error(transparent)]
    Evidence(#[from] plan_intake::evidence::EvidenceError),
    /// A command line that parsed but cannot run: exit 2, like clap's own.
    #[error("{0}")]
    Usage(String),
    /// Stdout is closed, full or a broken pipe: exit 74.
    #[error("cannot write to stdout")]
    Output(#[source] std::io::Error),
}

impl CommandError {
    /// What the command line adds, in its own words, to an error told in
    /// storage's.
    pub fn hint(&self) -> &'static str {
        match self {
            Self::Storage(StorageError::NeedsOwner { .. })
            | Self::Serve(ServeError::Storage(StorageError::NeedsOwner { .. }))
            | Self::Login(LoginError::Storage(StorageError::NeedsOwner { .. })) => {
                " (the service's own role needs only the grants `plan-intake migrate grants ROLE` prints)"
            }
            Self::Serve(ServeError::Storage(StorageError::PendingMigrations(_)))
            | Self::Storage(StorageError::PendingMigrations(_))
            | Self::Login(LoginError::Storage(StorageError::PendingMigrations(_))) => {
                " (apply them first: `plan-intake migrate run` as the database's owner)"
            }
            Self::Serve(ServeError::Storage(StorageError::MigratingThroughPooler)) => {
                " (migrate with `plan-intake migrate run` over a URL that reaches Postgres directly, and start the service with --no-migrate)"
            }
            _ => "",
        }
    }

    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Submit(e) => e.exit_code(),
            Self::Follow(e) => e.exit_code(),
            Self::Evidence(e) => e.exit,
            Self::Usage(_) => 2,
            Self::Output(_)
            | Self::Login(LoginError::NotHandedOver(_))
            | Self::Verify(VerifyError::Output(_)) => 74,
            _ => 1,
        }
    }
}

#[derive(Args, Clone)]
pub struct DatabaseArgs {
    /// postgres://…, postgresql://…, sqlite://PATH or a plain SQLite path
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, default_value = DEFAULT_DATABASE_URL, global = true)]
    pub database_url: String,
    /// What sits between this process and Postgres: none, or a transaction-mode pooler (PgBouncer pool_mode = transaction)
    #[arg(long, env = "PLAN_INTAKE_PG_POOLER", value_enum, default_value_t = PgPooler::None, global = true)]
    pub pg_pooler: PgPooler,
}

/// Where the service is and who is calling. The token is never an argument
/// (arguments are visible to every user of the machine).
#[derive(Args, Clone)]
pub struct ServiceArgs {
    /// The service's root URL (http:// or https://)
    #[arg(long, env = "PLAN_INTAKE_URL", default_value = DEFAULT_SERVICE_URL)]
    pub url: String,
    /// A file holding the token; default: the environment variable PLAN_INTAKE_TOKEN
    #[arg(long, value_name = "PATH")]
    pub token_file: Option<PathBuf>,
}

/// An Idempotency-Key the service accepts, checked before anything is
/// sent, and then sent exactly as typed (bare, or an RFC 8941 string the
/// service unquotes itself).
pub fn parse_key(text: &str) -> Result<String, String> {
    plan_intake::intake::idempotency_key::IdempotencyKey::parse(text).map(|_| text.to_owned())
}

/// The client for `--url` with the token from `--token-file` or the environment.
pub fn connect(service: &ServiceArgs) -> Result<Client, CommandError> {
    let token = match &service.token_file {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| CommandError::Usage(format!("--token-file {}: {e}", path.display())))?,
        None => std::env::var("PLAN_INTAKE_TOKEN").map_err(|_| {
            CommandError::Usage(
                "no token: set PLAN_INTAKE_TOKEN or pass --token-file PATH".to_owned(),
            )
        })?,
    };
    Client::new(&service.url, &token).map_err(|e| CommandError::Usage(format!("--url {e}")))
}

/// The request body from FILE, or from stdin for `-` or no FILE.
pub fn read_request(file: Option<&std::path::Path>) -> Result<Vec<u8>, CommandError> {
    let mut body = Vec::new();
    match file {
        Some(path) if path.as_os_str() != "-" => {
            body = std::fs::read(path)
                .map_err(|e| CommandError::Usage(format!("{}: {e}", path.display())))?;
        }
        _ => {
            std::io::stdin()
                .read_to_end(&mut body)
                .map_err(|e| CommandError::Usage(format!("reading the request from stdin: {e}")))?;
        }
    }
    Ok(body)
}

/// A flag set by the first SIGTERM or SIGINT; a second one exits at once.
pub fn stop_on_signals() -> Result<Arc<AtomicBool>, CommandError> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [SIGTERM, SIGINT] {
        // Registered first, so it sees the flag as the previous signal left it.
        signal_hook::flag::register_conditional_shutdown(signal, 1, Arc::clone(&stop))
            .and_then(|_| signal_hook::flag::register(signal, Arc::clone(&stop)))
            .map_err(|e| CommandError::Usage(format!("cannot handle signals: {e}")))?;
    }
    Ok(stop)
}

pub fn open_single(
    db: &DatabaseArgs,
    migrate: MigrateOnOpen,
) -> Result<plan_intake::storage::PooledConn, StorageError> {
    let options = PoolOptions {
        max_size: 1,
        pg_pooler: db.pg_pooler,
        ..PoolOptions::default()
    };
    Database::open(&db.database_url, &options, migrate)?.conn()
}
