//! `plan-intake serve`: its flags, one typed struct, and how they become
//! the service's settings.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use plan_intake::config::{
    DEFAULT_BIND, DEFAULT_BODY_LIMIT, DEFAULT_CLIENT_TIMEOUT, DEFAULT_FEED_PAGE_BYTES,
    DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, DEFAULT_MAX_INFLIGHT_PER_LOGIN, DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_SHUTDOWN_TIMEOUT_SECS, HttpConfig,
};
use plan_intake::evidence;
use plan_intake::intake::RetryPolicy;
use plan_intake::serve::{self, ServeConfig};
use plan_intake::storage::PoolOptions;

use super::{
    CommandError, DatabaseArgs, millis, parse_bind, parse_body_limit, parse_bytes_in_flight,
    parse_origin,
};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub db: DatabaseArgs,
    /// Address to listen on
    #[arg(long, env = "PLAN_INTAKE_BIND", default_value = DEFAULT_BIND, value_parser = parse_bind)]
    pub bind: String,
    /// Refuse to start while migrations are pending instead of applying them
    #[arg(long)]
    pub no_migrate: bool,
    /// Most database connections held at once
    #[arg(long, env = "PLAN_INTAKE_POOL_SIZE", default_value_t = PoolOptions::default().max_size, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub pool_size: u32,
    /// Milliseconds to wait for a free connection before answering 503
    #[arg(long, env = "PLAN_INTAKE_CHECKOUT_TIMEOUT_MS", default_value_t = millis(PoolOptions::default().checkout_timeout), value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub checkout_timeout_ms: u64,
    /// Largest accepted request body in bytes (larger is a 413)
    #[arg(long, env = "PLAN_INTAKE_BODY_LIMIT", default_value_t = DEFAULT_BODY_LIMIT, value_parser = parse_body_limit)]
    pub body_limit: usize,
    /// Attempts in all for a write that fails transiently (deadlock, busy, lost connection)
    #[arg(long, env = "PLAN_INTAKE_RETRY_ATTEMPTS", default_value_t = RetryPolicy::default().max_attempts, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub retry_attempts: u32,
    /// Cap of the first retry's random delay, in ms; doubles per retry
    #[arg(long, env = "PLAN_INTAKE_RETRY_BASE_DELAY_MS", default_value_t = millis(RetryPolicy::default().base_delay), value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub retry_base_delay_ms: u64,
    /// No retry waits longer than this, in ms
    #[arg(long, env = "PLAN_INTAKE_RETRY_MAX_DELAY_MS", default_value_t = millis(RetryPolicy::default().max_delay), value_parser = clap::value_parser!(u64).range(0..=600_000))]
    pub retry_max_delay_ms: u64,
    /// How long a SQLite write waits for the lock before failing as busy, in ms
    #[arg(
        long,
        env = "PLAN_INTAKE_SQLITE_BUSY_TIMEOUT_MS",
        default_value_t = millis(PoolOptions::default().sqlite_busy_timeout),
        value_parser = clap::value_parser!(u64).range(1..=600_000)
    )]
    pub sqlite_busy_timeout_ms: u64,
    /// Every request that touches the database is answered within this many ms (503 + Retry-After when it cannot finish)
    #[arg(long, env = "PLAN_INTAKE_REQUEST_TIMEOUT_MS", default_value_t = millis(DEFAULT_REQUEST_TIMEOUT), value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub request_timeout_ms: u64,
    /// Postgres URL for the connection that listens for other instances' writes (to wake waiting feed readers); needed behind a transaction-mode pooler, which cannot carry LISTEN
    #[arg(long, env = "PLAN_INTAKE_FEED_LISTEN_URL", hide_env_values = true)]
    pub feed_listen_url: Option<String>,
    /// Submissions one login may have in flight; past it, 429 with Retry-After and nothing written
    #[arg(long, env = "PLAN_INTAKE_MAX_INFLIGHT_PER_LOGIN", default_value_t = DEFAULT_MAX_INFLIGHT_PER_LOGIN as u32, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub max_inflight_per_login: u32,
    /// Bytes of request bodies and expanded reads held at once; past it a request waits up to 1 s, then gets 503 with Retry-After
    #[arg(long, env = "PLAN_INTAKE_MAX_BODY_BYTES_IN_FLIGHT", default_value_t = DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, value_parser = parse_bytes_in_flight)]
    pub max_body_bytes_in_flight: usize,
    /// Bytes of plans one `expand=plan` feed page holds; past it the page ends early with its `next` (one larger plan is a page of one)
    #[arg(long, env = "PLAN_INTAKE_FEED_PAGE_BYTES", default_value_t = DEFAULT_FEED_PAGE_BYTES, value_parser = parse_bytes_in_flight)]
    pub feed_page_bytes: usize,
    /// Postgres: the most plans written together in one statement and one commit (group commit); a lone plan is written at once. At most 31, so each batch's subtransactions stay within what Postgres caches
    #[arg(long, env = "PLAN_INTAKE_PG_WRITE_BATCH", default_value_t = plan_intake::storage::pg_batch::DEFAULT_PG_BATCH as u32, value_parser = clap::value_parser!(u32).range(1..=plan_intake::storage::pg_batch::MAX_PG_BATCH as i64))]
    pub pg_write_batch: u32,
    /// A connection's first request head, and then each body, must arrive within this many ms (408 otherwise)
    #[arg(long, env = "PLAN_INTAKE_CLIENT_TIMEOUT_MS", default_value_t = millis(DEFAULT_CLIENT_TIMEOUT), value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub client_timeout_ms: u64,
    /// HTTP worker threads (default: one per CPU)
    #[arg(long, env = "PLAN_INTAKE_WORKERS", value_parser = clap::value_parser!(u16).range(1..=256))]
    pub workers: Option<u16>,
    /// On SIGTERM or Ctrl-C, seconds to let requests in flight finish
    #[arg(long, env = "PLAN_INTAKE_SHUTDOWN_TIMEOUT_SECS", default_value_t = DEFAULT_SHUTDOWN_TIMEOUT_SECS, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub shutdown_timeout_secs: u64,
    /// A signing key file (as `signing-keys generate` writes it): receipts are signed and logged. Repeat for a rotation: the first signs, the others stay published
    #[arg(long = "signing-key", value_name = "PATH")]
    pub signing_key: Vec<PathBuf>,
    /// The name of an environment variable holding a signing key (instead of a file; signs before any --signing-key)
    #[arg(long, value_name = "VAR")]
    pub signing_key_env: Option<String>,
    /// The receipt log's origin: the first line of every checkpoint it signs
    #[arg(long, env = "PLAN_INTAKE_LOG_ORIGIN", default_value = plan_intake::config::DEFAULT_LOG_ORIGIN, value_parser = parse_origin)]
    pub log_origin: String,
    /// A file where this instance keeps the last checkpoint it signed, outside the database: after a restore or a lossy failover, a tree that does not extend it is never signed
    #[arg(long, env = "PLAN_INTAKE_CHECKPOINT_FILE", value_name = "PATH")]
    pub checkpoint_file: Option<PathBuf>,
}

/// Runs the service with `args` until it is stopped.
pub fn run(args: ServeArgs) -> Result<(), CommandError> {
    let ServeArgs {
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
        request_timeout_ms,
        feed_listen_url,
        max_inflight_per_login,
        max_body_bytes_in_flight,
        feed_page_bytes,
        pg_write_batch,
        client_timeout_ms,
        workers,
        shutdown_timeout_secs,
        signing_key,
        signing_key_env,
        log_origin,
        checkpoint_file,
    } = args;
    Ok(serve::run(ServeConfig {
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
    })?)
}
