//! `plan-intake serve`: open the database, then run the HTTP service.

use actix_web::HttpServer;

use crate::config::ServeConfig;
use crate::deadline::Deadline;
use crate::http::{self, AppState};
use crate::intake::Intake;
use crate::metrics::Metrics;
use crate::storage::{Database, MigrateOnOpen, StorageError};

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
    let intake = Intake::new(db, config.retry.clone(), Metrics::new());
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
    let state = AppState::new(intake, config.http.clone());
    actix_web::rt::System::new().block_on(async move {
        // SIGTERM or Ctrl-C: actix stops accepting, lets the requests in
        // flight finish (up to the shutdown timeout), then `run` returns and
        // the pool is dropped, closing its connections.
        // TCP_NODELAY: a small answer (a receipt, a long-polled feed page)
        // goes out at once instead of waiting for the client's delayed ACK.
        // A client that sends its head too slowly is answered 408 by actix;
        // its body's pace is bounded by the handler (`http::plans`).
        let mut server = HttpServer::new(move || http::app(state.clone()))
            .tcp_nodelay(true)
            .client_request_timeout(config.http.client_timeout)
            .client_disconnect_timeout(std::time::Duration::from_secs(1))
            .keep_alive(crate::config::KEEP_ALIVE)
            .shutdown_timeout(config.shutdown_timeout_secs);
        if let Some(workers) = config.workers {
            server = server.workers(workers);
        }
        let server = server
            .bind(&config.bind)
            .map_err(|source| ServeError::Bind {
                bind: config.bind.clone(),
                source,
            })?;
        for addr in server.addrs() {
            tracing::info!(%addr, "listening");
        }
        server.run().await.map_err(ServeError::Server)?;
        tracing::info!("stopped");
        Ok(())
    })
}
