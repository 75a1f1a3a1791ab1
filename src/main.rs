//! The command line: `serve`, `migrate`, `verify`, `keys`, `logins` for the
//! service and its DBA; `submit` and `follow` for its callers. Informational
//! output goes to stderr; an error is one line and a non-zero exit.

use std::io::{IsTerminal, Read};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use plan_intake::client::{self, Client, FollowError, FollowOptions, SubmitError, SubmitOptions};
use plan_intake::config::{
    DEFAULT_BIND, DEFAULT_BODY_LIMIT, DEFAULT_CLIENT_TIMEOUT, DEFAULT_DATABASE_URL,
    DEFAULT_FEED_PAGE_BYTES, DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, DEFAULT_MAX_INFLIGHT_PER_LOGIN,
    DEFAULT_REQUEST_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT_SECS, HttpConfig,
};
use plan_intake::evidence;
use plan_intake::intake::login::{self as logins, LoginError};
use plan_intake::intake::receipt::format_timestamp;
use plan_intake::intake::{Permission, RetryPolicy};
use plan_intake::serve::{self, ServeConfig, ServeError};
use plan_intake::storage::{
    Database, DbConn, MigrateOnOpen, PgPooler, PoolOptions, StorageError, migrations,
};
use plan_intake::verify::{self, VerifyError};

/// Each request allocates and frees many small strings and JSON nodes;
/// glibc's malloc spent about 15 % of the service's CPU on them (`perf`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "plan-intake",
    version,
    about = "Takes plans from planner services and keeps each one exactly once",
    arg_required_else_help = true
)]
struct Cli {
    /// Log format on stderr
    #[arg(long, env = "PLAN_INTAKE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Args, Clone)]
struct DatabaseArgs {
    /// postgres://…, postgresql://…, sqlite://PATH or a plain SQLite path
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, default_value = DEFAULT_DATABASE_URL, global = true)]
    database_url: String,
    /// What sits between this process and Postgres: none, or a transaction-mode pooler (PgBouncer pool_mode = transaction)
    #[arg(long, env = "PLAN_INTAKE_PG_POOLER", value_enum, default_value_t = PgPooler::None, global = true)]
    pg_pooler: PgPooler,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP service (applies pending migrations first unless --no-migrate)
    Serve {
        #[command(flatten)]
        db: DatabaseArgs,
        /// Address to listen on
        #[arg(long, env = "PLAN_INTAKE_BIND", default_value = DEFAULT_BIND, value_parser = parse_bind)]
        bind: String,
        /// Refuse to start while migrations are pending instead of applying them
        #[arg(long)]
        no_migrate: bool,
        /// Most database connections held at once
        #[arg(long, env = "PLAN_INTAKE_POOL_SIZE", default_value_t = PoolOptions::default().max_size, value_parser = clap::value_parser!(u32).range(1..=1000))]
        pool_size: u32,
        /// Milliseconds to wait for a free connection before answering 503
        #[arg(long, env = "PLAN_INTAKE_CHECKOUT_TIMEOUT_MS", default_value_t = millis(PoolOptions::default().checkout_timeout), value_parser = clap::value_parser!(u64).range(1..=600_000))]
        checkout_timeout_ms: u64,
        /// Largest accepted request body in bytes (larger is a 413)
        #[arg(long, env = "PLAN_INTAKE_BODY_LIMIT", default_value_t = DEFAULT_BODY_LIMIT, value_parser = parse_body_limit)]
        body_limit: usize,
        /// Attempts in all for a write that fails transiently (deadlock, busy, lost connection)
        #[arg(long, env = "PLAN_INTAKE_RETRY_ATTEMPTS", default_value_t = RetryPolicy::default().max_attempts, value_parser = clap::value_parser!(u32).range(1..=100))]
        retry_attempts: u32,
        /// Cap of the first retry's random delay, in ms; doubles per retry
        #[arg(long, env = "PLAN_INTAKE_RETRY_BASE_DELAY_MS", default_value_t = millis(RetryPolicy::default().base_delay), value_parser = clap::value_parser!(u64).range(0..=60_000))]
        retry_base_delay_ms: u64,
        /// No retry waits longer than this, in ms
        #[arg(long, env = "PLAN_INTAKE_RETRY_MAX_DELAY_MS", default_value_t = millis(RetryPolicy::default().max_delay), value_parser = clap::value_parser!(u64).range(0..=600_000))]
        retry_max_delay_ms: u64,
        /// How long a SQLite write waits for the lock before failing as busy, in ms
        #[arg(
            long,
            env = "PLAN_INTAKE_SQLITE_BUSY_TIMEOUT_MS",
            default_value_t = millis(PoolOptions::default().sqlite_busy_timeout),
            value_parser = clap::value_parser!(u64).range(1..=600_000)
        )]
        sqlite_busy_timeout_ms: u64,
        /// Every request that touches the database is answered within this many ms (503 + Retry-After when it cannot finish)
        #[arg(long, env = "PLAN_INTAKE_REQUEST_TIMEOUT_MS", default_value_t = millis(DEFAULT_REQUEST_TIMEOUT), value_parser = clap::value_parser!(u64).range(100..=600_000))]
        request_timeout_ms: u64,
        /// Postgres URL for the connection that listens for other instances' writes (to wake waiting feed readers); needed behind a transaction-mode pooler, which cannot carry LISTEN
        #[arg(long, env = "PLAN_INTAKE_FEED_LISTEN_URL", hide_env_values = true)]
        feed_listen_url: Option<String>,
        /// Submissions one login may have in flight; past it, 429 with Retry-After and nothing written
        #[arg(long, env = "PLAN_INTAKE_MAX_INFLIGHT_PER_LOGIN", default_value_t = DEFAULT_MAX_INFLIGHT_PER_LOGIN as u32, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        max_inflight_per_login: u32,
        /// Bytes of request bodies and expanded reads held at once; past it a request waits up to 1 s, then gets 503 with Retry-After
        #[arg(long, env = "PLAN_INTAKE_MAX_BODY_BYTES_IN_FLIGHT", default_value_t = DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, value_parser = parse_bytes_in_flight)]
        max_body_bytes_in_flight: usize,
        /// Bytes of plans one `expand=plan` feed page holds; past it the page ends early with its `next` (one larger plan is a page of one)
        #[arg(long, env = "PLAN_INTAKE_FEED_PAGE_BYTES", default_value_t = DEFAULT_FEED_PAGE_BYTES, value_parser = parse_bytes_in_flight)]
        feed_page_bytes: usize,
        /// Postgres: the most plans written together in one statement and one commit (group commit); a lone plan is written at once. At most 31, so each batch's subtransactions stay within what Postgres caches
        #[arg(long, env = "PLAN_INTAKE_PG_WRITE_BATCH", default_value_t = plan_intake::storage::pg_batch::DEFAULT_PG_BATCH as u32, value_parser = clap::value_parser!(u32).range(1..=plan_intake::storage::pg_batch::MAX_PG_BATCH as i64))]
        pg_write_batch: u32,
        /// A connection's first request head, and then each body, must arrive within this many ms (408 otherwise)
        #[arg(long, env = "PLAN_INTAKE_CLIENT_TIMEOUT_MS", default_value_t = millis(DEFAULT_CLIENT_TIMEOUT), value_parser = clap::value_parser!(u64).range(100..=600_000))]
        client_timeout_ms: u64,
        /// HTTP worker threads (default: one per CPU)
        #[arg(long, env = "PLAN_INTAKE_WORKERS", value_parser = clap::value_parser!(u16).range(1..=256))]
        workers: Option<u16>,
        /// On SIGTERM or Ctrl-C, seconds to let requests in flight finish
        #[arg(long, env = "PLAN_INTAKE_SHUTDOWN_TIMEOUT_SECS", default_value_t = DEFAULT_SHUTDOWN_TIMEOUT_SECS, value_parser = clap::value_parser!(u64).range(1..=3600))]
        shutdown_timeout_secs: u64,
        /// A signing key file (as `signing-keys generate` writes it): receipts are signed and logged. Repeat for a rotation: the first signs, the others stay published
        #[arg(long = "signing-key", value_name = "PATH")]
        signing_key: Vec<PathBuf>,
        /// The name of an environment variable holding a signing key (instead of a file; signs before any --signing-key)
        #[arg(long, value_name = "VAR")]
        signing_key_env: Option<String>,
        /// The receipt log's origin: the first line of every checkpoint it signs
        #[arg(long, env = "PLAN_INTAKE_LOG_ORIGIN", default_value = plan_intake::config::DEFAULT_LOG_ORIGIN, value_parser = parse_origin)]
        log_origin: String,
        /// A file where this instance keeps the last checkpoint it signed, outside the database: after a restore or a lossy failover, a tree that does not extend it is never signed
        #[arg(long, env = "PLAN_INTAKE_CHECKPOINT_FILE", value_name = "PATH")]
        checkpoint_file: Option<PathBuf>,
    },
    /// Signing keys for receipts and the receipt log
    #[command(name = "signing-keys", arg_required_else_help = true)]
    SigningKeys {
        #[command(subcommand)]
        action: SigningKeysAction,
    },
    /// Check receipts offline, with no service or database
    #[command(arg_required_else_help = true)]
    Receipts {
        #[command(subcommand)]
        action: ReceiptsAction,
    },
    /// Recompute the receipt log from the tables and hold it against every signed checkpoint; one line per finding, exit 65 if any
    Audit {
        #[command(flatten)]
        db: DatabaseArgs,
        /// The keys to trust: what `GET /v1/signing-keys` answered, or verifier keys one per line
        #[arg(long, value_name = "KEYS")]
        keys: PathBuf,
        /// A checkpoint kept outside the database (`GET /v1/checkpoint`), held against the log too; repeatable
        #[arg(long, value_name = "FILE")]
        checkpoint: Vec<PathBuf>,
    },
    /// Apply or inspect migrations
    #[command(arg_required_else_help = true)]
    Migrate {
        #[command(flatten)]
        db: DatabaseArgs,
        #[command(subcommand)]
        action: MigrateAction,
    },
    /// Check that the database upholds the guarantees (one line per check)
    Verify {
        #[command(flatten)]
        db: DatabaseArgs,
    },
    /// One of verify's contending processes (internal)
    #[command(hide = true)]
    VerifyContender {
        #[command(flatten)]
        db: DatabaseArgs,
    },
    /// Idempotency-key retention (run as the owner, or a role with the --pruner grant)
    #[command(arg_required_else_help = true)]
    Keys {
        #[command(flatten)]
        db: DatabaseArgs,
        #[command(subcommand)]
        action: KeysAction,
    },
    /// Submit a plan, retrying under one Idempotency-Key until the service keeps it; prints the receipt
    #[command(after_help = SUBMIT_EXITS)]
    Submit {
        #[command(flatten)]
        service: ServiceArgs,
        /// The request `{run_id, approved_inputs, content}`; `-` or absent: stdin
        file: Option<PathBuf>,
        /// The Idempotency-Key (default: derived from the request, so the same request is a replay)
        #[arg(long, value_parser = parse_key)]
        key: Option<String>,
        /// Cap of the first retry's random delay, in ms; doubles per retry up to 5 s
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(0..=60_000))]
        retry_base_ms: u64,
        /// Attempts in all, the first included
        #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1000))]
        max_attempts: u32,
        /// Seconds for the whole call, every attempt and wait included
        #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400))]
        timeout_secs: u64,
    },
    /// Follow the feed: every receipt at least once, in order, the cursor saved after each page
    #[command(after_help = FOLLOW_EXITS)]
    Follow {
        #[command(flatten)]
        service: ServiceArgs,
        /// Where the cursor is kept; when it does not exist, start at the feed's current end
        #[arg(long)]
        cursor_file: PathBuf,
        /// When the cursor file does not exist, start at the feed's first receipt instead
        #[arg(long)]
        from_start: bool,
        /// Each entry is {receipt, approved_inputs, content} (expand=plan)
        #[arg(long)]
        expand: bool,
        /// Receipts per page
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: u32,
        /// Seconds one request waits for a receipt (default 30; 0 with --drain)
        #[arg(long, value_parser = clap::value_parser!(u64).range(0..=60))]
        wait_secs: Option<u64>,
        /// Run `sh -c CMD` once per non-empty page, its receipts as JSON lines on CMD's stdin; the cursor advances only when CMD exits 0
        #[arg(long, value_name = "CMD")]
        exec: Option<String>,
        /// Exit 0 at the first empty page (for batch jobs)
        #[arg(long)]
        drain: bool,
    },
    /// Manage logins (the only way to create one)
    #[command(arg_required_else_help = true)]
    Logins {
        #[command(flatten)]
        db: DatabaseArgs,
        #[command(subcommand)]
        action: LoginsAction,
    },
}

/// Where the service is and who is calling. The token is never an argument
/// (arguments are visible to every user of the machine).
#[derive(Args, Clone)]
struct ServiceArgs {
    /// The service's root URL (http:// or https://)
    #[arg(long, env = "PLAN_INTAKE_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// A file holding the token; default: the environment variable PLAN_INTAKE_TOKEN
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,
}

const SUBMIT_EXITS: &str = "Exit status: 0 created, replayed or already_received (the receipt on stdout); \
65 refused (400, 413, 415, 422: fix the request); 77 not allowed (401, 403); \
75 attempts or time ran out (safe to run again: same request, same key); 2 a bad command line; 1 otherwise.";

const FOLLOW_EXITS: &str = "SIGTERM or SIGINT finishes the page in hand, saves the cursor and exits 0. \
Exit status: 0 stopped or drained; 65 a cursor the service refuses; 77 not allowed (401, 403); \
74 the cursor file or the output cannot be written; 71 CMD cannot be started; 2 a bad command line; 1 otherwise.";

#[derive(Subcommand)]
enum MigrateAction {
    /// Apply every pending migration
    Run,
    /// List applied and pending migrations
    Status,
    /// Print the SQL of the pending migrations (or, with --revert, what
    /// `migrate revert` would run) without changing anything
    Print {
        #[arg(long)]
        revert: bool,
    },
    /// Revert the most recent migration (shows its SQL first; refuses to
    /// drop tables that hold rows unless --yes)
    Revert {
        /// Drop tables even if they hold rows
        #[arg(long)]
        yes: bool,
    },
    /// Print the GRANT statements that let ROLE run the service and nothing more (Postgres)
    Grants {
        role: String,
        /// Print only the one extra grant a role needs to run `keys prune`
        #[arg(long)]
        pruner: bool,
    },
}

#[derive(Subcommand)]
enum KeysAction {
    /// Delete idempotency keys older than DURATION in small batches; plans,
    /// receipts and the feed stay. A retry under a pruned key is
    /// already_received; another body under it is a new plan.
    Prune {
        /// e.g. 30d, 72h: keys created longer ago than this are deleted
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Duration,
        /// Keys deleted per transaction
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        batch_size: u32,
        /// Only count what would be deleted
        #[arg(long)]
        dry_run: bool,
        /// Take an --older-than below the minimum (48h, twice submit's longest retry window); only when no client retries that long
        #[arg(long)]
        allow_short_retention: bool,
    },
}

#[derive(Subcommand)]
enum LoginsAction {
    /// Create a login; prints only its token on stdout
    Add {
        name: String,
        /// plans:submit or receipts:read; repeat for several
        #[arg(long = "permission", required = true)]
        permissions: Vec<Permission>,
    },
    /// List logins (never tokens)
    List,
    /// Revoke a login's token at once
    Revoke { name: String },
    /// Issue a new token for a login (prints only the token); the old one
    /// keeps working for the grace period. Keys and receipts stay the login's.
    Rotate {
        name: String,
        /// How long the old token keeps working, e.g. 24h, 30m, 0s
        #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
        grace: Duration,
    },
}

#[derive(Subcommand)]
enum SigningKeysAction {
    /// Write a new Ed25519 key pair: PATH (private, mode 0600) and PATH.pub (its C2SP signed-note verifier key)
    Generate {
        /// Where the private key goes; never overwritten
        #[arg(long, value_name = "PATH")]
        out: PathBuf,
        /// The key's name, shown in signatures (no spaces or `+`)
        #[arg(long, default_value = "plan-intake")]
        name: String,
    },
}

#[derive(Subcommand)]
enum ReceiptsAction {
    /// Check a receipt's signature and, with --proof, its inclusion in a signed checkpoint; exit 0, or 65 with the reason
    Verify {
        /// The receipt as the service answered it (or a plan read with its receipt)
        file: PathBuf,
        /// The keys to trust: what `GET /v1/signing-keys` answered, or verifier keys one per line
        #[arg(long, value_name = "KEYS")]
        keys: PathBuf,
        /// The receipt's proof, as `GET /v1/receipts/{id}/proof` answered it
        #[arg(long, value_name = "PROOF")]
        proof: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // clap's own message, whole: what is wrong, the allowed values, the
        // usage (or the help, for a bare command); exit 2. --help and
        // --version go to stdout with exit 0.
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    if let Err(e) = init_tracing(cli.log_format) {
        eprintln!("plan-intake: {}", plan_intake::report::chain(&e));
        return ExitCode::from(2);
    }
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            use std::io::Write;
            // A broken stderr is not worth a panic: the exit status tells.
            let _ = writeln!(
                std::io::stderr(),
                "plan-intake: error: {}{}",
                plan_intake::report::chain(&e),
                e.hint()
            );
            ExitCode::from(e.exit_code())
        }
    }
}

/// One line on stdout, checked and flushed: a closed, full or broken
/// stdout ends the command with one line on stderr and exit 74, never a
/// panic.
macro_rules! say {
    ($($arg:tt)*) => {
        plan_intake::stdout::line(&format!($($arg)*)).map_err(CommandError::Output)?
    };
}

/// What stops a command, with its causes: one line, exit 1.
#[derive(Debug, thiserror::Error)]
enum CommandError {
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
    Evidence(#[from] evidence::EvidenceError),
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
    fn hint(&self) -> &'static str {
        match self {
            Self::Storage(StorageError::NeedsOwner { .. })
            | Self::Serve(ServeError::Storage(StorageError::NeedsOwner { .. }))
            | Self::Login(LoginError::Storage(StorageError::NeedsOwner { .. })) => {
                " (the service's own role needs only the grants `plan-intake migrate grants ROLE` prints)"
            }
            _ => "",
        }
    }

    fn exit_code(&self) -> u8 {
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

#[derive(Debug, thiserror::Error)]
#[error("PLAN_INTAKE_LOG `{filter}` is not a tracing filter")]
struct BadLogFilter {
    filter: String,
    #[source]
    source: tracing_subscriber::filter::ParseError,
}

/// A default duration as the whole milliseconds a flag takes.
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Logging to stderr; an unreadable `PLAN_INTAKE_LOG` is refused, not ignored.
fn init_tracing(format: LogFormat) -> Result<(), BadLogFilter> {
    let filter = match std::env::var("PLAN_INTAKE_LOG") {
        Ok(text) => {
            tracing_subscriber::EnvFilter::try_new(&text).map_err(|source| BadLogFilter {
                filter: text,
                source,
            })?
        }
        Err(_) => tracing_subscriber::EnvFilter::new("info"),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
    Ok(())
}

/// An address to listen on that resolves: `HOST:PORT`.
fn parse_bind(text: &str) -> Result<String, &'static str> {
    use std::net::ToSocketAddrs;
    let resolves = text
        .to_socket_addrs()
        .is_ok_and(|mut addrs| addrs.next().is_some());
    if resolves {
        Ok(text.to_owned())
    } else {
        Err("must be HOST:PORT, e.g. 127.0.0.1:8080")
    }
}

/// An Idempotency-Key the service accepts, checked before anything is
/// sent, and then sent exactly as typed (bare, or an RFC 8941 string the
/// service unquotes itself).
fn parse_key(text: &str) -> Result<String, String> {
    plan_intake::intake::idempotency_key::IdempotencyKey::parse(text).map(|_| text.to_owned())
}

/// 1 MiB to 4 GiB (one permit a byte).
fn parse_bytes_in_flight(text: &str) -> Result<usize, &'static str> {
    match text.parse::<usize>() {
        Ok(n) if (1024 * 1024..=u32::MAX as usize).contains(&n) => Ok(n),
        _ => Err("must be a number of bytes from 1048576 to 4294967295"),
    }
}

/// A checkpoint's first line: printable, no spaces at its ends, at most 255 bytes.
fn parse_origin(text: &str) -> Result<String, &'static str> {
    let printable = text.chars().all(|c| !c.is_control());
    if text.is_empty() || text.len() > 255 || !printable || text.trim() != text {
        return Err("must be 1 to 255 printable bytes, no spaces at either end");
    }
    Ok(text.to_owned())
}

/// 1 byte to 64 MiB.
fn parse_body_limit(text: &str) -> Result<usize, &'static str> {
    match text.parse::<usize>() {
        Ok(n) if (1..=64 * 1024 * 1024).contains(&n) => Ok(n),
        _ => Err("must be a number of bytes from 1 to 67108864"),
    }
}

fn run(command: Command) -> Result<(), CommandError> {
    match command {
        Command::Serve {
            db,
            bind,
            no_migrate,
            pool_size,
            checkout_timeout_ms,
            body_limit,
            retry_attempts,
            retry_base_delay_ms,
            retry_max_delay_ms,
            sqlite_busy_timeout_ms,
            shutdown_timeout_secs,
            request_timeout_ms,
            feed_listen_url,
            workers,
            max_inflight_per_login,
            max_body_bytes_in_flight,
            feed_page_bytes,
            pg_write_batch,
            client_timeout_ms,
            signing_key,
            signing_key_env,
            log_origin,
            checkpoint_file,
        } => Ok(serve::run(ServeConfig {
            checkpoint_file,
            signing_keys: signing_key_env
                .iter()
                .map(|name| evidence::load_key_env(name))
                .chain(signing_key.iter().map(|path| evidence::load_key_file(path)))
                .collect::<Result<_, _>>()?,
            log_origin,
            bind,
            database_url: db.database_url,
            pool: PoolOptions {
                max_size: pool_size,
                checkout_timeout: Duration::from_millis(checkout_timeout_ms),
                sqlite_busy_timeout: Duration::from_millis(sqlite_busy_timeout_ms),
                request_timeout: Some(Duration::from_millis(request_timeout_ms)),
                feed_listener: true,
                feed_listen_url,
                pg_pooler: db.pg_pooler,
                pg_write_batch: pg_write_batch as usize,
            },
            http: HttpConfig {
                body_limit,
                request_timeout: Duration::from_millis(request_timeout_ms),
                max_inflight_per_login: max_inflight_per_login as usize,
                max_body_bytes_in_flight,
                feed_page_bytes,
                client_timeout: Duration::from_millis(client_timeout_ms),
            },
            retry: RetryPolicy {
                max_attempts: retry_attempts,
                base_delay: Duration::from_millis(retry_base_delay_ms),
                max_delay: Duration::from_millis(retry_max_delay_ms),
            },
            migrate: !no_migrate,
            shutdown_timeout_secs,
            workers: workers.map(usize::from),
        })?),
        Command::Submit {
            service,
            file,
            key,
            retry_base_ms,
            max_attempts,
            timeout_secs,
        } => {
            let client = connect(&service)?;
            let body = read_request(file.as_deref())?;
            let key = key.unwrap_or_else(|| client::derive_key(&body));
            eprintln!("idempotency-key: {key}");
            let submitted = client.submit(
                &body,
                &SubmitOptions {
                    key: Some(key),
                    max_attempts,
                    retry_base: Duration::from_millis(retry_base_ms),
                    timeout: Duration::from_secs(timeout_secs),
                },
            )?;
            say!("{}", submitted.receipt);
            Ok(())
        }
        Command::Follow {
            service,
            cursor_file,
            from_start,
            expand,
            limit,
            wait_secs,
            exec,
            drain,
        } => {
            let client = connect(&service)?;
            let default_wait = if drain { 0 } else { 30 };
            let options = FollowOptions {
                from_start,
                expand,
                limit,
                wait: Duration::from_secs(wait_secs.unwrap_or(default_wait)),
                exec,
                drain,
                ..FollowOptions::new(cursor_file)
            };
            let stop = stop_on_signals()?;
            // With --exec nothing goes to stdout, whatever it leads to
            // (a daemon's stdout is /dev/null opened for reading and writing).
            let followed = if options.exec.is_some() {
                client::follow(&client, &options, &stop, &mut std::io::sink())?
            } else {
                let mut out = plan_intake::stdout::open().map_err(FollowError::Output)?;
                client::follow(&client, &options, &stop, &mut out)?
            };
            eprintln!(
                "stopped after {} receipt(s) in {} page(s); {}",
                followed.receipts,
                followed.pages,
                if followed.cursor_saved {
                    "the cursor is saved"
                } else {
                    "the cursor is unchanged"
                }
            );
            Ok(())
        }
        Command::Migrate { db, action } => migrate(&db, action),
        Command::Logins { db, action } => manage_logins(&db, action),
        Command::Keys { db, action } => manage_keys(&db, action),
        Command::SigningKeys {
            action: SigningKeysAction::Generate { out, name },
        } => {
            say!("{}", evidence::generate(&out, &name)?);
            Ok(())
        }
        Command::Receipts {
            action: ReceiptsAction::Verify { file, keys, proof },
        } => {
            say!("{}", evidence::verify(&file, &keys, proof.as_deref())?);
            Ok(())
        }
        Command::Audit {
            db,
            keys,
            checkpoint,
        } => match evidence::audit(&db.database_url, &keys, &checkpoint) {
            Ok(lines) => {
                for line in lines {
                    say!("{line}");
                }
                Ok(())
            }
            Err((lines, error)) => {
                for line in lines {
                    say!("{line}");
                }
                Err(error.into())
            }
        },
        Command::Verify { db } => match verify::run(&db.database_url)? {
            0 => Ok(()),
            failed => Err(CommandError::ChecksFailed(failed)),
        },
        Command::VerifyContender { db } => {
            say!("{}", verify::contend(&db.database_url)?);
            Ok(())
        }
    }
}

/// The client for `--url` with the token from `--token-file` or the environment.
fn connect(service: &ServiceArgs) -> Result<Client, CommandError> {
    let token = match &service.token_file {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| CommandError::Usage(format!("--token-file {}: {e}", path.display())))?,
        None => std::env::var("PLAN_INTAKE_TOKEN").map_err(|_| {
            CommandError::Usage(
                "no token: set PLAN_INTAKE_TOKEN or pass --token-file PATH".to_owned(),
            )
        })?,
    };
    Client::new(&service.url, &token).map_err(|e| CommandError::Usage(e.to_string()))
}

/// The request body from FILE, or from stdin for `-` or no FILE.
fn read_request(file: Option<&std::path::Path>) -> Result<Vec<u8>, CommandError> {
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
fn stop_on_signals() -> Result<Arc<AtomicBool>, CommandError> {
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

fn open_single(
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

fn migrate(db: &DatabaseArgs, action: MigrateAction) -> Result<(), CommandError> {
    let changes_schema = matches!(action, MigrateAction::Run | MigrateAction::Revert { .. });
    if changes_schema && db.pg_pooler == PgPooler::Transaction {
        return Err(CommandError::Storage(StorageError::Config(
            "`migrate run` and `migrate revert` hold a session-level lock, which a transaction-mode pooler does not keep: connect directly to Postgres for migrations".to_owned(),
        )));
    }
    let mut conn = open_single(db, MigrateOnOpen::Skip)?;
    let conn: &mut DbConn = &mut conn;
    match action {
        MigrateAction::Run => {
            let applied = migrations::run_pending(conn)?;
            if applied.is_empty() {
                eprintln!("no pending migrations");
            }
            for name in applied {
                eprintln!("applied {name}");
            }
        }
        MigrateAction::Status => {
            let pending = migrations::pending(conn)?;
            for name in migrations::applied(conn)? {
                say!("applied  {name}");
            }
            for name in pending {
                say!("pending  {name}");
            }
        }
        MigrateAction::Print { revert: false } => {
            let planned = migrations::pending_sql(conn)?;
            if planned.is_empty() {
                eprintln!("no pending migrations");
            }
            for (name, sql) in planned {
                say!("-- {name}\n{}\n", sql.trim_end());
            }
        }
        MigrateAction::Print { revert: true } => match migrations::revert_sql(conn)? {
            Some((name, sql)) => say!("-- revert {name}\n{}\n", sql.trim_end()),
            None => eprintln!("no applied migrations"),
        },
        MigrateAction::Revert { yes } => {
            migrations::require_owner(conn)?;
            let Some((name, sql)) = migrations::revert_sql(conn)? else {
                eprintln!("no applied migrations");
                return Ok(());
            };
            eprintln!("-- reverting {name}:\n{}", sql.trim_end());
            let holding = migrations::tables_with_rows_dropped_by(conn, &sql)?;
            if !holding.is_empty() && !yes {
                let tables: Vec<String> = holding
                    .iter()
                    .map(|(t, n)| format!("{t} ({n} rows)"))
                    .collect();
                return Err(CommandError::Storage(StorageError::Config(format!(
                    "reverting {name} would drop {}; run `migrate revert --yes` to drop them",
                    tables.join(", ")
                ))));
            }
            let name = migrations::revert_last(conn)?;
            eprintln!("reverted {name}");
        }
        MigrateAction::Grants { role, pruner: true } => {
            say!("{}", migrations::pruner_grant_for(conn, &role)?);
        }
        MigrateAction::Grants {
            role,
            pruner: false,
        } => {
            for statement in migrations::grants_for(conn, &role)? {
                say!("{statement}");
            }
        }
    }
    Ok(())
}

fn manage_keys(db: &DatabaseArgs, action: KeysAction) -> Result<(), CommandError> {
    let KeysAction::Prune {
        older_than,
        batch_size,
        dry_run,
        allow_short_retention,
    } = action;
    let minimum = plan_intake::intake::retention::MIN_RETENTION;
    // A dry run deletes nothing: it may count what a short retention would.
    if older_than < minimum && !allow_short_retention && !dry_run {
        return Err(CommandError::Usage(format!(
            "--older-than {} is below the minimum retention of {}: a client still retrying a request whose key was pruned would store a second plan for other content; keep keys longer than any client retries, or pass --allow-short-retention",
            humantime::format_duration(older_than),
            humantime::format_duration(minimum)
        )));
    }
    let mut conn = open_single(db, MigrateOnOpen::RequireNonePending)?;
    let pruned =
        plan_intake::intake::retention::prune_keys(&mut conn, older_than, batch_size, dry_run)?;
    if pruned.dry_run {
        eprintln!("would delete {} idempotency keys", pruned.keys);
    } else {
        eprintln!("deleted {} idempotency keys", pruned.keys);
    }
    Ok(())
}

fn manage_logins(db: &DatabaseArgs, action: LoginsAction) -> Result<(), CommandError> {
    // Logins live in the migrated schema; a fresh database is made ready
    // first (directly; through a transaction pooler it must be migrated).
    let migrate = match db.pg_pooler {
        PgPooler::None => MigrateOnOpen::Apply,
        PgPooler::Transaction => MigrateOnOpen::RequireNonePending,
    };
    // Input is checked before anything is opened: a refused command
    // creates no database file.
    if let LoginsAction::Add { name, .. } = &action {
        logins::validate_name(name)?;
    }
    let mut conn = open_single(db, migrate)?;
    match action {
        LoginsAction::Add { name, permissions } => {
            // Printed before the login is committed: no login without its token.
            logins::create_handed_over(&mut conn, &name, &permissions, |token| {
                plan_intake::stdout::line(token)
            })?;
            eprintln!("created login `{name}`; the token above is shown only once");
        }
        LoginsAction::List => {
            for login in logins::list(&mut conn)? {
                let state = match login.revoked_at {
                    Some(at) => format!("revoked {}", format_timestamp(&at)),
                    None => "active".to_owned(),
                };
                say!(
                    "{}\t{}\tcreated {}\t{state}",
                    login.name,
                    login.permissions,
                    format_timestamp(&login.created_at)
                );
            }
        }
        LoginsAction::Revoke { name } => {
            logins::revoke(&mut conn, &name)?;
            eprintln!("revoked login `{name}`");
        }
        LoginsAction::Rotate { name, grace } => {
            logins::rotate_handed_over(&mut conn, &name, grace, |token| {
                plan_intake::stdout::line(token)
            })?;
            eprintln!(
                "new token for login `{name}`, shown only once; the previous one works for {} more",
                humantime::format_duration(grace)
            );
        }
    }
    Ok(())
}
