//! `plan-intake serve`: its settings (`ServeSettings`, the flags clap
//! fills), then the database opened and the HTTP service run.

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use actix_http::HttpService;
use actix_server::{Server, ServerHandle};
use actix_service::{IntoServiceFactory, ServiceFactoryExt, fn_service, map_config};
use actix_web::dev::AppConfig;
use socket2::{Domain, Protocol, Socket, Type};
use tokio::signal::unix::{Signal, SignalKind, signal};

use crate::config::{
    BODY_BYTES_PATIENCE, DEFAULT_BIND, DEFAULT_BODY_LIMIT, DEFAULT_CLIENT_TIMEOUT,
    DEFAULT_FEED_PAGE_BYTES, DEFAULT_LOG_ORIGIN, DEFAULT_MAX_BODY_BYTES_IN_FLIGHT,
    DEFAULT_MAX_INFLIGHT_PER_LOGIN, DEFAULT_REQUEST_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT_SECS,
    HttpConfig, millis, parse_bind, parse_body_limit, parse_bytes_in_flight, parse_origin,
};
use crate::deadline::Deadline;
use crate::http::{self, AppState};
use crate::intake::receipt_log::KeepCheckpoint;
use crate::intake::signing::SigningKey;
use crate::intake::{Intake, RetryPolicy};
use crate::metrics::Metrics;
use crate::storage::write_queue::{DEFAULT_PG_BATCH, MAX_PG_BATCH};
use crate::storage::{Database, MigrateOnOpen, PgPooler, PoolOptions, StorageError};

/// `serve`'s settings: one typed struct, filled by clap from flags and
/// environment, each default written once (here from `config`, `storage`
/// and `intake`); `serve --help` shows them.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeSettings {
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
    #[arg(long, help = format!(
        "Bytes of request bodies and expanded reads held at once; past it a request waits up to {} s, then gets 503 with Retry-After",
        BODY_BYTES_PATIENCE.as_secs()
    ), env = "PLAN_INTAKE_MAX_BODY_BYTES_IN_FLIGHT", default_value_t = DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, value_parser = parse_bytes_in_flight)]
    pub max_body_bytes_in_flight: usize,
    /// Bytes of plans one `expand=plan` feed page holds; past it the page ends early with its `next` (one larger plan is a page of one)
    #[arg(long, env = "PLAN_INTAKE_FEED_PAGE_BYTES", default_value_t = DEFAULT_FEED_PAGE_BYTES, value_parser = parse_bytes_in_flight)]
    pub feed_page_bytes: usize,
    #[arg(long, help = format!(
        "Postgres: the most plans written together in one statement and one commit (group commit); a lone plan is written at once. At most {MAX_PG_BATCH}, so each batch's subtransactions stay within what Postgres caches"
    ), env = "PLAN_INTAKE_PG_WRITE_BATCH", default_value_t = DEFAULT_PG_BATCH as u32, value_parser = clap::value_parser!(u32).range(1..=MAX_PG_BATCH as i64))]
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
    /// The receipt log's origin, the first line of every checkpoint it signs: name the deployment (e.g. intake.example.com/receipts). Default: the origin of the log in the database, else one derived from the signing key (plan-intake/KEYID), said at start
    #[arg(long, env = "PLAN_INTAKE_LOG_ORIGIN", value_parser = parse_origin)]
    pub log_origin: Option<String>,
    /// A file where this instance keeps each checkpoint it signs, before it is handed out, outside the database: after a restore or a lossy failover, a tree that does not extend it is never signed. Default: beside the SQLite file (FILE.checkpoint), else in systemd's state directory ($STATE_DIRECTORY/receipt-log.checkpoint), else none (said at start)
    #[arg(long, env = "PLAN_INTAKE_CHECKPOINT_FILE", value_name = "PATH")]
    pub checkpoint_file: Option<PathBuf>,
    /// Keep no checkpoint file, not even the default one (a database restored to before a checkpoint handed out is then signed over)
    #[arg(long, conflicts_with = "checkpoint_file")]
    pub no_checkpoint_file: bool,
}

/// Where the last checkpoint signed is kept: `--checkpoint-file`; else,
/// unless `--no-checkpoint-file`, beside the SQLite file or in the state
/// directory systemd gives the unit (`StateDirectory=`), where operators
/// keep what outlives a restore.
fn checkpoint_file_of(config: &ServeSettings, database_url: &str) -> Option<PathBuf> {
    if config.no_checkpoint_file {
        return None;
    }
    if let Some(file) = &config.checkpoint_file {
        return Some(file.clone());
    }
    if let Ok(crate::storage::DatabaseTarget::Sqlite(path)) =
        crate::storage::DatabaseTarget::parse(database_url)
        && path != ":memory:"
    {
        return Some(PathBuf::from(format!("{path}.checkpoint")));
    }
    let state = std::env::var_os("STATE_DIRECTORY")?;
    let first = std::env::split_paths(&state).next()?;
    Some(first.join("receipt-log.checkpoint"))
}

impl ServeSettings {
    /// The pool the service runs on, behind `pg_pooler`.
    fn pool(&self, pg_pooler: PgPooler) -> PoolOptions {
        PoolOptions {
            max_size: self.pool_size,
            checkout_timeout: Duration::from_millis(self.checkout_timeout_ms),
            sqlite_busy_timeout: Duration::from_millis(self.sqlite_busy_timeout_ms),
            request_timeout: Some(Duration::from_millis(self.request_timeout_ms)),
            feed_listener: true,
            feed_listen_url: self.feed_listen_url.clone(),
            pg_pooler,
            pg_write_batch: self.pg_write_batch as usize,
        }
    }

    /// The door's settings.
    fn http(&self) -> HttpConfig {
        HttpConfig {
            body_limit: self.body_limit,
            request_timeout: Duration::from_millis(self.request_timeout_ms),
            max_inflight_per_login: self.max_inflight_per_login as usize,
            max_body_bytes_in_flight: self.max_body_bytes_in_flight,
            feed_page_bytes: self.feed_page_bytes,
            client_timeout: Duration::from_millis(self.client_timeout_ms),
        }
    }

    /// How a transiently failed write is retried.
    fn retry(&self) -> RetryPolicy {
        RetryPolicy {
            max_attempts: self.retry_attempts,
            base_delay: Duration::from_millis(self.retry_base_delay_ms),
            max_delay: Duration::from_millis(self.retry_max_delay_ms),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error("cannot listen on {bind}")]
    Bind {
        bind: String,
        source: std::io::Error,
    },
    #[error("the server stopped with an error")]
    Server(#[source] std::io::Error),
    /// The receipt log could never be appended to as things stand.
    #[error("{0}")]
    ReceiptLog(String),
    /// The database is not set up for what the service was started to do.
    #[error(transparent)]
    NotSetUp(crate::intake::read::NotSetUp),
}

/// SQLite: the database file's absolute path (a relative default resolved
/// from another directory would silently be another database); else "-".
fn sqlite_file(url: &str) -> String {
    match crate::storage::DatabaseTarget::parse(url) {
        Ok(crate::storage::DatabaseTarget::Sqlite(path)) => std::fs::canonicalize(&path)
            .map(|p| p.display().to_string())
            .unwrap_or(path),
        _ => "-".to_owned(),
    }
}

/// Opens the database (migrating first unless told not to), then serves
/// until the process is stopped. `signing_keys`: the first signs new
/// receipts and checkpoints, the rest stay published (rotation); none:
/// nothing is signed.
pub fn run(
    database_url: &str,
    pg_pooler: PgPooler,
    config: &ServeSettings,
    signing_keys: Vec<Arc<SigningKey>>,
    inherited: Vec<TcpListener>,
) -> Result<(), ServeError> {
    let migrate = if config.no_migrate {
        MigrateOnOpen::RequireNonePending
    } else {
        MigrateOnOpen::Apply
    };
    let db = Database::open(database_url, &config.pool(pg_pooler), migrate)?;
    tracing::info!(
        backend = %db.backend,
        database = %crate::storage::redact(database_url),
        file = %sqlite_file(database_url),
        // Socket activation: systemd's sockets, not --bind (said when listening).
        bind = %if inherited.is_empty() { config.bind.as_str() } else { "-" },
        "plan-intake starting"
    );
    let http_config = config.http();
    let mut intake = Intake::new(db, config.retry(), Metrics::new());
    let at_start_deadline = Deadline::after(http_config.request_timeout);
    match signing_keys.split_first() {
        Some((signer, others)) => {
            intake = intake
                .signing_with(signer.clone())
                .cosigning_with(others.to_vec());
            let origin = log_origin(
                &intake,
                config.log_origin.as_deref(),
                signer,
                &at_start_deadline,
            )?;
            tracing::info!(
                key = signer.key_id(),
                origin = %origin,
                "receipts are signed, and appended to the receipt log"
            );
            for key in others {
                if let Err(error) = intake.publish_key(key, false, &at_start_deadline) {
                    tracing::warn!(%error, key = key.key_id(), "cannot publish this key yet");
                }
            }
            // What the appender could never get past is refused now: a
            // checkpoint file of another log, a stored log that does not
            // extend the checkpoint kept there.
            let checkpoint_file = checkpoint_file_of(config, database_url);
            match &checkpoint_file {
                Some(file) => {
                    tracing::info!(file = %file.display(), "each checkpoint is kept in this file before it is handed out")
                }
                None => tracing::warn!(
                    "no checkpoint file: a database restored to before a checkpoint this service handed out would be signed over (a fork only `audit` names); keep one with --checkpoint-file PATH"
                ),
            }
            // One log, one name: renaming a log that has checkpoints would
            // sign one tree under two, and stop every verifying reader.
            if let Some(stored) = intake
                .stored_log_origin(&at_start_deadline)
                .ok()
                .flatten()
                .filter(|stored| *stored != origin)
            {
                return Err(ServeError::ReceiptLog(format!(
                    "the receipt log in the database is named {stored:?}, not {origin:?}: keep --log-origin {stored} (a new name belongs to a new log and a new key: `plan-intake receipts new-log` empties the log's tables for one, docs/OPERATIONS.md \"Back up and restore\")"
                )));
            }
            let signed = match checkpoint_file.as_deref() {
                Some(file) => last_signed(file, &origin).map_err(ServeError::ReceiptLog)?,
                None => None,
            };
            if let Some(signed) = signed {
                intake.check_receipt_log_extends(signed).map_err(|error| {
                    ServeError::ReceiptLog(format!(
                        "the receipt log in the database does not extend the checkpoint kept in {} ({}): restored to before it, or changed; `plan-intake audit` names what changed",
                        checkpoint_file
                            .as_deref()
                            .map(|f| f.display().to_string())
                            .unwrap_or_default(),
                        crate::report::chain(error.as_ref())
                    ))
                })?;
            }
            // Recorded before the first request: a reader not pinned to
            // this key checks its receipts under what GET /v1/signing-keys
            // lists. Until it can be, `/readyz` says why.
            let recorded = intake.record_key_use(&at_start_deadline);
            if let Err(error) = &recorded {
                tracing::warn!(%error, "cannot record the signing key yet");
            }
            keep_signing_key_recorded(intake.clone(), recorded.is_ok());
            keep_receipt_log_appended(intake.clone(), origin, checkpoint_file, signed);
        }
        None => {
            // A log already signed must not take leaves unsigned: every
            // verifying reader would stop at the first for good.
            // (A database that cannot be read yet, or has migrations
            // pending, is told by `/readyz` as before.)
            if let Ok(Some(origin)) = intake.stored_log_origin(&at_start_deadline) {
                return Err(ServeError::ReceiptLog(format!(
                    "the database's receipt log {origin:?} is signed, and this instance has no --signing-key: its receipts would be unsigned leaves, and every verifying reader stops at the first of them. Start it with the log's signing key (--signing-key PATH or --signing-key-env NAME), as every other instance on this database"
                )));
            }
            tracing::warn!(
                "receipts are not signed and no receipt log is kept: start with --signing-key PATH (`plan-intake signing-keys generate --out PATH` makes one)"
            );
            keep_watching_for_a_signed_log(intake.clone());
        }
    }
    // Said once at start, where an operator looks; `/readyz` and the gauge
    // keep saying it. Grants the role lacks for what it was started to do
    // are refused at start (the service would sign receipts it cannot log,
    // or fail every write); later, they make it not ready.
    match intake.readiness(&Deadline::after(http_config.request_timeout)) {
        Ok(readiness) => {
            if let Some(warning) = readiness.warning {
                tracing::warn!("{warning}");
            }
        }
        Err(crate::intake::ReadError::NotSetUp(
            missing @ crate::intake::read::NotSetUp::MissingGrants { .. },
        )) => return Err(ServeError::NotSetUp(missing)),
        Err(error) => tracing::warn!(%error, "not ready yet"),
    }
    // Every active login's token is familiar from the start, so that after
    // a restart planners are never counted among the strangers.
    let at_start = std::time::Instant::now();
    if let Err(error) =
        intake.remember_active_logins(at_start, &Deadline::after(http_config.request_timeout))
    {
        tracing::warn!(%error, "cannot read the active logins yet");
    }
    let state = AppState::new(intake, http_config);
    actix_web::rt::System::new().block_on(async move {
        let server = server(config, state.clone(), inherited)?;
        actix_web::rt::spawn(keep_readiness_current(state));
        server.await.map_err(ServeError::Server)?;
        tracing::info!("stopped");
        Ok(())
    })
}

/// How often the readiness gauges (`plan_intake_commit_waits_for_standby`,
/// `plan_intake_commits_blocked`) are brought up to date when nobody asks
/// `/readyz`: one short query.
const READINESS_EVERY: Duration = Duration::from_secs(5);

/// Keeps the readiness gauges current, so the alerts on them never read a
/// stale value; `/readyz` refreshes them too.
async fn keep_readiness_current(state: AppState) {
    loop {
        actix_web::rt::time::sleep(READINESS_EVERY).await;
        let deadline = Deadline::after(state.http.request_timeout);
        let refreshed = state
            .blocking(deadline, move |intake| intake.readiness(&deadline))
            .await;
        if let Err(error) = refreshed {
            tracing::debug!(%error, "readiness not refreshed");
        }
    }
}

/// How often the receipt log takes in what the feed settled since.
const APPEND_EVERY: Duration = Duration::from_secs(1);
/// The most receipts one append round (one transaction) takes. Each round
/// signs and stores one checkpoint, so smaller rounds cost more per plan
/// (SQLite, `--quick`: new plans at 0.85x those without the log at 1,000
/// a round, 0.91x at 5,000).
const APPEND_LIMIT: i64 = 5_000;
/// Between two rounds of a log that is behind: room for the plans' writes.
const APPEND_BREATHER: Duration = Duration::from_millis(20);
/// The shortest pause between two rounds a reader waiting for a checkpoint
/// asked for: under load, at most ten checkpoints a second, each taking
/// what settled meanwhile.
const WANTED_ROUND_GAP: Duration = Duration::from_millis(100);
/// How often this instance's key is recorded as in use.
const KEY_USE_EVERY: Duration = Duration::from_secs(60);

/// Records this instance's key as in use every minute, on a thread of its
/// own: whatever the appender does (stuck, or busy with a long round), `GET
/// /v1/signing-keys` tells when the key signed receipts.
fn keep_signing_key_recorded(intake: Intake, recorded: bool) {
    let recorder = move || {
        if recorded {
            std::thread::sleep(KEY_USE_EVERY);
        }
        loop {
            if let Err(error) = intake.record_key_use(&Deadline::after(Duration::from_secs(10))) {
                tracing::warn!(%error, "cannot record the signing key's use");
                std::thread::sleep(APPEND_EVERY);
                continue;
            }
            std::thread::sleep(KEY_USE_EVERY);
        }
    };
    if let Err(error) = std::thread::Builder::new()
        .name("signing-key-use".to_owned())
        .spawn(recorder)
    {
        tracing::error!(%error, "cannot start recording the signing key's use");
    }
}

/// How long rounds may fail one after another (a database restarting, a
/// failover) before the log counts as stuck.
const STUCK_AFTER: Duration = Duration::from_secs(30);

/// Appends settled receipts to the log every second (again after a
/// breather while it is behind, or as soon as a reader waiting for a
/// checkpoint asks, `WANTED_ROUND_GAP` after the last), on a thread of its own: one round is one
/// transaction, so the process may stop anywhere. Instances take turns
/// (the state row's lock); a round that fails is logged and tried again.
/// The thread never ends while the service runs: what it cannot get past
/// (a tree that does not extend what was signed, one that cannot be read,
/// a signing failure, or rounds failing for `STUCK_AFTER`) makes the
/// service not ready, with the reason, until a round succeeds again.
/// After each round it measures the log's lag behind the feed. With
/// `checkpoint_file`, the last checkpoint signed is kept there too (`signed`:
/// the one read from it at start, checked then): a database restored to
/// before it (or a failover that lost it) is then never signed over.
fn keep_receipt_log_appended(
    intake: Intake,
    origin: String,
    checkpoint_file: Option<PathBuf>,
    mut signed: Option<(u64, tlog_tiles::Hash)>,
) {
    let limit = APPEND_LIMIT;
    let told = intake.clone();
    // Kept before the round commits (`LogSigner::keep`): what readers are
    // handed is never ahead of the file.
    let keep = checkpoint_file.map(|file| {
        Box::new(move |note: &str| keep_checkpoint(&file, note)) as Box<KeepCheckpoint>
    });
    let appender = move || {
        let mut failing_since: Option<std::time::Instant> = None;
        let mut lag_measured: Option<std::time::Instant> = None;
        loop {
            let round_began = std::time::Instant::now();
            // Made before the round: the barrier then proves its COMMIT.
            let round_deadline = Deadline::after(Duration::from_secs(10));
            let behind = match intake.append_receipts(&origin, limit, signed, keep.as_deref()) {
                Ok(appended) => {
                    tracing::debug!(
                        receipts = appended.as_ref().map_or(0, |a| a.to - a.from),
                        another_instance_appends = appended.is_none(),
                        ms = round_began.elapsed().as_millis() as u64,
                        "a receipt log round"
                    );
                    if failing_since.take().is_some() {
                        tracing::info!("the receipt log is appended to again");
                    }
                    intake.set_receipt_log_stuck(None);
                    match appended {
                        Some(appended) => {
                            if let Some((size, root)) = appended.checkpoint {
                                // Held against the next rounds only once the
                                // standby has it: a round whose COMMIT stopped
                                // waiting for the standby (cancelled, a
                                // failover) may be lost, and holding its
                                // checkpoint would leave the log stuck where
                                // no reader was shown it (they are shown
                                // only past the barrier too).
                                match intake.await_replicated(&round_deadline) {
                                    Ok(()) => signed = Some((size, root)),
                                    Err(error) => tracing::warn!(
                                        size,
                                        %error,
                                        "a receipt log round's checkpoint is not known to be on the standby; the next round is held to the one before"
                                    ),
                                }
                                intake.metrics.set_receipt_log_size(size);
                                intake.log_rounds().signed(size);
                            }
                            appended.to - appended.from == limit as u64
                        }
                        None => false,
                    }
                }
                Err(error) => {
                    intake.metrics.receipt_log_round_failed();
                    let reason = crate::report::chain(error.as_ref());
                    tracing::error!(error = %reason, "the receipt log was not appended to");
                    let since = *failing_since.get_or_insert_with(std::time::Instant::now);
                    if cannot_get_past(error.as_ref()) || since.elapsed() >= STUCK_AFTER {
                        intake.set_receipt_log_stuck(Some(reason));
                    }
                    false
                }
            };
            // Once a second, however often readers ask for rounds.
            if lag_measured.is_none_or(|at| at.elapsed() >= APPEND_EVERY) {
                lag_measured = Some(std::time::Instant::now());
                match intake.receipt_log_lag(&Deadline::after(Duration::from_secs(10))) {
                    Ok(lag) => intake.metrics.set_receipt_log_lag(lag),
                    Err(error) => tracing::debug!(%error, "the receipt log's lag not measured"),
                }
            }
            if behind {
                std::thread::sleep(APPEND_BREATHER);
            } else if failing_since.is_some() {
                // Not sooner for a reader's asking: one error line a second.
                std::thread::sleep(APPEND_EVERY);
            } else {
                std::thread::sleep(WANTED_ROUND_GAP);
                intake.log_rounds().pause(APPEND_EVERY - WANTED_ROUND_GAP);
            }
        }
    };
    if let Err(error) = std::thread::Builder::new()
        .name("receipt-log".to_owned())
        .spawn(appender)
    {
        tracing::error!(%error, "cannot start the receipt log's appender");
        told.set_receipt_log_stuck(Some(format!("its thread could not start: {error}")));
    }
}

/// An instance without a key looks every few seconds whether another has
/// signed the database's log since; once it has, this one refuses plans
/// (503 `unsigned-on-a-signed-log`, said once at ERROR) rather than keep
/// them unsigned after signed leaves.
fn keep_watching_for_a_signed_log(intake: Intake) {
    let watcher = move || {
        loop {
            std::thread::sleep(APPEND_EVERY * 5);
            if let Ok(Some(origin)) =
                intake.find_signed_log(&Deadline::after(Duration::from_secs(10)))
            {
                tracing::error!(
                    origin = %origin,
                    "the database's receipt log is now signed, and this instance has no --signing-key: it refuses plans (503 unsigned-on-a-signed-log) until restarted with the log's key"
                );
                return;
            }
        }
    };
    if let Err(error) = std::thread::Builder::new()
        .name("signed-log-watch".to_owned())
        .spawn(watcher)
    {
        tracing::error!(%error, "cannot start the watch for a signed receipt log");
    }
}

/// A round's failure no retry mends: the tree as stored does not extend
/// what was signed, cannot be read, or a checkpoint cannot be signed.
fn cannot_get_past(error: &(dyn std::error::Error + 'static)) -> bool {
    use crate::storage::receipt_log::AppendError;
    matches!(
        error.downcast_ref::<AppendError>(),
        Some(
            AppendError::Inconsistent { .. }
                | AppendError::Tree(_)
                | AppendError::Leaf { .. }
                | AppendError::Signing(_)
        )
    )
}

/// The receipt log's origin: the one given (never the shared default for
/// a new log: a checkpoint of another deployment, signed by a key of the
/// same name, could pass for this one's); else the one the log in the
/// database has; else one derived from the signing key, unique to it.
fn log_origin(
    intake: &Intake,
    given: Option<&str>,
    signer: &crate::intake::signing::SigningKey,
    deadline: &Deadline,
) -> Result<String, ServeError> {
    let stored = intake.stored_log_origin(deadline).map_err(|error| {
        ServeError::ReceiptLog(format!(
            "cannot read the receipt log's origin from the database: {}",
            crate::report::chain(&error)
        ))
    })?;
    match (given, stored) {
        (Some(given), stored)
            if given == DEFAULT_LOG_ORIGIN && stored.as_deref() != Some(given) =>
        {
            Err(ServeError::ReceiptLog(format!(
                "--log-origin {given} is every deployment's default: name this deployment's log (e.g. intake.example.com/receipts), or leave it out to have one derived from the signing key"
            )))
        }
        (Some(given), _) => Ok(given.to_owned()),
        (None, Some(stored)) => {
            if stored == DEFAULT_LOG_ORIGIN {
                tracing::warn!(
                    origin = %stored,
                    "the receipt log is named by the shared default: its checkpoints do not say which deployment signed them; a new log (new key and --log-origin) would"
                );
            }
            Ok(stored)
        }
        (None, None) => {
            let id = signer.key_id().rsplit('+').next().unwrap_or_default();
            let derived = format!("{DEFAULT_LOG_ORIGIN}/{id}");
            tracing::warn!(
                origin = %derived,
                "the receipt log is named after the signing key's id (unique to the key); name the deployment with --log-origin before its first checkpoint"
            );
            Ok(derived)
        }
    }
}

/// The size and root of the checkpoint kept in `file`, if there is one yet.
fn last_signed(
    file: &std::path::Path,
    origin: &str,
) -> Result<Option<(u64, tlog_tiles::Hash)>, String> {
    let note = match std::fs::read(file) {
        Ok(note) => note,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read {}: {e}", file.display())),
    };
    let unreadable = || format!("{} holds no checkpoint", file.display());
    let note = signed_note::Note::from_bytes(&note).map_err(|_| unreadable())?;
    let checkpoint = tlog_tiles::Checkpoint::from_bytes(note.text()).map_err(|_| unreadable())?;
    if checkpoint.origin() != origin {
        return Err(format!(
            "{} holds a checkpoint of {:?}, not of {origin:?}",
            file.display(),
            checkpoint.origin()
        ));
    }
    Ok(Some((checkpoint.size(), *checkpoint.hash())))
}

/// Replaces `file` with `note`: a temporary file, fsync, rename, and an
/// fsync of the directory, so a crash leaves the old checkpoint or the new.
fn keep_checkpoint(file: &std::path::Path, note: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut temporary = file.as_os_str().to_owned();
    temporary.push(".tmp");
    let temporary = std::path::PathBuf::from(temporary);
    let mut out = std::fs::File::create(&temporary)?;
    out.write_all(note.as_bytes())?;
    out.sync_all()?;
    std::fs::rename(&temporary, file)?;
    let directory = file
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    std::fs::File::open(directory)?.sync_all()
}

/// The HTTP server, bound and started: what actix-web's `HttpServer` would
/// build, plus the door's own answer to `Expect: 100-continue`
/// (`http::expect_continue`), which `HttpServer` has no place for.
///
/// TCP_NODELAY: a small answer (a receipt, a long-polled feed page) goes
/// out at once instead of waiting for the client's delayed ACK. A client
/// that sends its head too slowly is answered 408 by actix; its body's pace
/// is bounded by the handler (`http::plans`). SIGTERM or Ctrl-C: stop
/// accepting, let the requests in flight finish (up to the shutdown
/// timeout; idle keep-alive connections are closed at once), then the
/// server's future ends and the pool is dropped, closing its connections.
fn server(
    config: &ServeSettings,
    state: AppState,
    inherited: Vec<TcpListener>,
) -> Result<Server, ServeError> {
    let bind_error = |source| ServeError::Bind {
        bind: config.bind.clone(),
        source,
    };
    let signals = stop_signals();
    let mut builder = Server::build()
        .shutdown_timeout(config.shutdown_timeout_secs)
        .disable_signals();
    if let Some(workers) = config.workers.map(usize::from) {
        builder = builder.workers(workers);
    }
    // Told when a graceful stop begins: each connection then ends once its
    // request in flight is answered, an idle one at once.
    let stopping = builder.graceful_shutdown_signal();
    let http = state.http.clone();
    let listeners = if inherited.is_empty() {
        listeners(&config.bind).map_err(bind_error)?
    } else {
        tracing::info!(
            sockets = inherited.len(),
            "listening on the sockets systemd handed over (--bind is not used)"
        );
        inherited
    };
    for listener in listeners {
        listener.set_nonblocking(true).map_err(bind_error)?;
        let addr = listener.local_addr().map_err(bind_error)?;
        tracing::info!(%addr, "listening");
        let (state, stopping, http) = (state.clone(), stopping.clone(), http.clone());
        builder = builder
            .listen(format!("plan-intake-{addr}"), listener, move || {
                // What `HttpServer` gives its apps: not secure, the host
                // and the local address this listener is bound to.
                // `AppConfig`'s only constructor taking them is doc-hidden
                // (`Default` would say localhost:8080 and 127.0.0.1:8080
                // whatever the listener).
                let app_config = AppConfig::__priv_test_new(false, addr.to_string(), addr);
                let stopping = stopping.clone();
                let routes = http::app(state.clone())
                    .into_factory()
                    .map_err(|error| error.error_response());
                let routes_config = app_config.clone();
                let client_timeout_ms = http.client_timeout.as_millis();
                let service = HttpService::build()
                    // Doc-hidden, as `HttpServer` itself calls it.
                    .graceful_shutdown_signal(move || {
                        let stopping = stopping.clone();
                        async move { stopping.notified().await }
                    })
                    .keep_alive(crate::config::KEEP_ALIVE)
                    .client_request_timeout(http.client_timeout)
                    .client_disconnect_timeout(Duration::from_secs(1))
                    .tcp_nodelay(true)
                    .local_addr(addr)
                    .expect(http::expect_continue(state.clone(), app_config))
                    .finish(map_config(routes, move |()| routes_config.clone()));
                // What `HttpService::tcp` does, with each connection wrapped
                // so that actix's own 400, 408 and 431 carry problem+json.
                fn_service(move |io: actix_web::rt::net::TcpStream| async move {
                    if let Err(error) = io.set_nodelay(true) {
                        tracing::debug!(%error, "cannot set TCP_NODELAY");
                    }
                    let peer = io.peer_addr().ok();
                    let io = http::own_answers::ProblemStream::new(io, client_timeout_ms);
                    Ok::<_, actix_http::error::DispatchError>((
                        io,
                        actix_http::Protocol::Http1,
                        peer,
                    ))
                })
                .and_then(service)
            })
            .map_err(bind_error)?;
    }
    let server = builder.run();
    actix_web::rt::spawn(stop_on_signals(signals, server.handle(), state));
    Ok(server)
}

/// The listening sockets systemd handed over (socket activation: the
/// `LISTEN_FDS` protocol, `plan-intake.socket`), if any. While the service
/// restarts, the socket stays open in systemd, so connections wait in its
/// backlog instead of being refused. Call it first, before any thread
/// starts: it clears the protocol's variables from the environment.
pub fn inherited_listeners() -> std::io::Result<Vec<TcpListener>> {
    let mut handed = listenfd::ListenFd::from_env();
    let mut listeners = Vec::new();
    for index in 0..handed.len() {
        match handed.take_tcp_listener(index)? {
            Some(listener) => listeners.push(listener),
            None => {
                return Err(std::io::Error::other(format!(
                    "socket {index} handed over by systemd is not a TCP listener"
                )));
            }
        }
    }
    Ok(listeners)
}

/// Listening sockets for every address `bind` names (at least one must
/// bind), made as `HttpServer` makes them: `SO_REUSEADDR`, a backlog of
/// 1,024 connections.
fn listeners(bind: &str) -> std::io::Result<Vec<TcpListener>> {
    let mut bound = Vec::new();
    let mut failed = None;
    for addr in bind.to_socket_addrs()? {
        match listener(addr) {
            Ok(listener) => bound.push(listener),
            Err(error) => failed = Some(error),
        }
    }
    match (bound.is_empty(), failed) {
        (false, _) => Ok(bound),
        (true, Some(error)) => Err(error),
        (true, None) => Err(std::io::Error::other("the address names no socket address")),
    }
}

fn listener(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(TcpListener::from(socket))
}

/// The signals that stop the service, each with its name and whether the
/// stop lets requests in flight finish: SIGTERM and SIGINT (Ctrl-C) do,
/// SIGQUIT does not. Listened for from here on (call it before the service
/// says it is listening, inside the runtime).
fn stop_signals() -> Vec<(Signal, &'static str, bool)> {
    let kinds = [
        (SignalKind::terminate(), "SIGTERM", true),
        (SignalKind::interrupt(), "SIGINT", true),
        (SignalKind::quit(), "SIGQUIT", false),
    ];
    let mut streams = Vec::new();
    for (kind, name, graceful) in kinds {
        match signal(kind) {
            Ok(stream) => streams.push((stream, name, graceful)),
            Err(error) => tracing::error!(%error, signal = name, "cannot listen for a signal"),
        }
    }
    streams
}

/// Stops the server at the first of `signals`, answering every waiting
/// long poll at once.
async fn stop_on_signals(
    mut signals: Vec<(Signal, &'static str, bool)>,
    server: ServerHandle,
    state: AppState,
) {
    if signals.is_empty() {
        return;
    }
    let (name, graceful) = std::future::poll_fn(|cx| {
        for (stream, name, graceful) in &mut signals {
            if stream.poll_recv(cx).is_ready() {
                return std::task::Poll::Ready((*name, *graceful));
            }
        }
        std::task::Poll::Pending
    })
    .await;
    // Told to stop before anything is logged: a log line written to a
    // stderr nobody reads any more must not keep the service running.
    state.begin_stop();
    let stopped = server.stop(graceful);
    if graceful {
        tracing::info!(signal = name, "stopping: requests in flight may finish");
    } else {
        tracing::info!(signal = name, "stopping at once");
    }
    stopped.await;
}
