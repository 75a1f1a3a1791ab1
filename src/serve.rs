//! `plan-intake serve`: open the database, then run the HTTP service.

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use actix_http::HttpService;
use actix_server::{Server, ServerHandle};
use actix_service::{IntoServiceFactory, ServiceFactoryExt, fn_service, map_config};
use actix_web::dev::AppConfig;
use socket2::{Domain, Protocol, Socket, Type};
use tokio::signal::unix::{Signal, SignalKind, signal};

use crate::config::HttpConfig;
use crate::deadline::Deadline;
use crate::http::{self, AppState};
use crate::intake::{Intake, RetryPolicy};
use crate::metrics::Metrics;
use crate::storage::{Database, MigrateOnOpen, PoolOptions, StorageError};

/// Everything `serve` runs with, filled from flags and environment by
/// `commands::serve`.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub bind: String,
    pub database_url: String,
    pub pool: PoolOptions,
    pub http: HttpConfig,
    pub retry: RetryPolicy,
    /// Apply pending migrations at start (false: refuse to start while any are pending).
    pub migrate: bool,
    /// How long a stopping server waits for requests in flight.
    pub shutdown_timeout_secs: u64,
    /// HTTP worker threads; `None`: one per CPU.
    pub workers: Option<usize>,
    /// Keys loaded at start: the first signs new receipts and checkpoints,
    /// the rest stay published (rotation). Empty: nothing is signed.
    pub signing_keys: Vec<std::sync::Arc<crate::intake::signing::SigningKey>>,
    /// The first line of every checkpoint of the receipt log.
    pub log_origin: String,
    /// Where this instance keeps the last checkpoint it signed, outside
    /// the database: a tree that does not extend it is never signed.
    pub checkpoint_file: Option<std::path::PathBuf>,
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
/// until the process is stopped.
pub fn run(config: ServeConfig) -> Result<(), ServeError> {
    let migrate = if config.migrate {
        MigrateOnOpen::Apply
    } else {
        MigrateOnOpen::RequireNonePending
    };
    let db = Database::open(&config.database_url, &config.pool, migrate)?;
    tracing::info!(
        backend = %db.backend,
        database = %crate::storage::redact(&config.database_url),
        file = %sqlite_file(&config.database_url),
        bind = %config.bind,
        "plan-intake starting"
    );
    let mut intake = Intake::new(db, config.retry.clone(), Metrics::new());
    let at_start_deadline = Deadline::after(config.http.request_timeout);
    match config.signing_keys.split_first() {
        Some((signer, others)) => {
            intake = intake.signing_with(signer.clone());
            tracing::info!(
                key = signer.key_id(),
                origin = %config.log_origin,
                "receipts are signed, and appended to the receipt log"
            );
            for key in others {
                if let Err(error) = intake.publish_key(key, false, &at_start_deadline) {
                    tracing::warn!(%error, key = key.key_id(), "cannot publish this key yet");
                }
            }
            keep_receipt_log_appended(
                intake.clone(),
                config.log_origin.clone(),
                config.checkpoint_file.clone(),
            );
        }
        None => tracing::warn!(
            "receipts are not signed and no receipt log is kept: start with --signing-key PATH (`plan-intake signing-keys generate --out PATH` makes one)"
        ),
    }
    // Said once at start, where an operator looks; `/readyz` and the gauge
    // keep saying it.
    match intake.readiness(&Deadline::after(config.http.request_timeout)) {
        Ok(readiness) => {
            if let Some(warning) = readiness.warning {
                tracing::warn!("{warning}");
            }
        }
        Err(error) => tracing::warn!(%error, "not ready yet"),
    }
    // Every active login's token is familiar from the start, so that after
    // a restart planners are never counted among the strangers.
    let at_start = std::time::Instant::now();
    if let Err(error) =
        intake.remember_active_logins(at_start, &Deadline::after(config.http.request_timeout))
    {
        tracing::warn!(%error, "cannot read the active logins yet");
    }
    let state = AppState::new(intake, config.http.clone());
    actix_web::rt::System::new().block_on(async move {
        let server = server(&config, state.clone())?;
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
/// How often this instance's key is recorded as in use.
const KEY_USE_EVERY: Duration = Duration::from_secs(60);

/// Appends settled receipts to the log every second (again after a
/// breather while it is behind), on a thread of its own: one round is one
/// transaction, so the process may stop anywhere. Instances take turns
/// (the state row's lock); a round that fails is logged and tried again.
/// With `checkpoint_file`, the last checkpoint signed is kept there too,
/// and read back at start: a database restored to before it (or a
/// failover that lost it) is then never signed over.
fn keep_receipt_log_appended(intake: Intake, origin: String, checkpoint_file: Option<PathBuf>) {
    let limit = APPEND_LIMIT;
    let appender = move || {
        let mut signed = match checkpoint_file.as_deref().map(|f| last_signed(f, &origin)) {
            None => None,
            Some(Ok(found)) => found,
            Some(Err(error)) => {
                tracing::error!(%error, "the receipt log is not appended to");
                return;
            }
        };
        let mut key_used: Option<std::time::Instant> = None;
        loop {
            if key_used.is_none_or(|at| at.elapsed() >= KEY_USE_EVERY) {
                match intake.record_key_use(&Deadline::after(Duration::from_secs(10))) {
                    Ok(()) => key_used = Some(std::time::Instant::now()),
                    Err(error) => tracing::warn!(%error, "cannot record the signing key's use"),
                }
            }
            let behind = match intake.append_receipts(&origin, limit, signed) {
                Ok(Some(appended)) => {
                    if let Some((size, root)) = appended.checkpoint {
                        signed = Some((size, root));
                        intake.metrics.set_receipt_log_size(size);
                        if let (Some(file), Ok(Some(note))) = (
                            checkpoint_file.as_deref(),
                            intake.checkpoint(&Deadline::after(Duration::from_secs(10))),
                        ) && let Err(error) = keep_checkpoint(file, &note)
                        {
                            tracing::error!(%error, file = %file.display(), "cannot keep the checkpoint signed");
                        }
                    }
                    appended.to - appended.from == limit as u64
                }
                Ok(None) => false,
                Err(error) => {
                    intake.metrics.receipt_log_round_failed();
                    tracing::error!(error = %crate::report::chain(error.as_ref()), "the receipt log was not appended to");
                    false
                }
            };
            std::thread::sleep(if behind {
                APPEND_BREATHER
            } else {
                APPEND_EVERY
            });
        }
    };
    if let Err(error) = std::thread::Builder::new()
        .name("receipt-log".to_owned())
        .spawn(appender)
    {
        tracing::error!(%error, "cannot start the receipt log's appender");
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
    let temporary = file.with_extension("tmp");
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
fn server(config: &ServeConfig, state: AppState) -> Result<Server, ServeError> {
    let bind_error = |source| ServeError::Bind {
        bind: config.bind.clone(),
        source,
    };
    let signals = stop_signals();
    let mut builder = Server::build()
        .shutdown_timeout(config.shutdown_timeout_secs)
        .disable_signals();
    if let Some(workers) = config.workers {
        builder = builder.workers(workers);
    }
    // Told when a graceful stop begins: each connection then ends once its
    // request in flight is answered, an idle one at once.
    let stopping = builder.graceful_shutdown_signal();
    let http = config.http.clone();
    for listener in listeners(&config.bind).map_err(bind_error)? {
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
    actix_web::rt::spawn(stop_on_signals(signals, server.handle()));
    Ok(server)
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

/// Stops the server at the first of `signals`.
async fn stop_on_signals(mut signals: Vec<(Signal, &'static str, bool)>, server: ServerHandle) {
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
    let stopped = server.stop(graceful);
    if graceful {
        tracing::info!(signal = name, "stopping: requests in flight may finish");
    } else {
        tracing::info!(signal = name, "stopping at once");
    }
    stopped.await;
}
