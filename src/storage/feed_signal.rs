//! Wakes readers waiting on the receipts feed (`wait=S`) when a plan may
//! have joined it. A waiting reader holds no database connection: it waits
//! on this signal, then reads a page again.
//!
//! The signal is a generation counter. This process's own writes bump it as
//! they succeed. On Postgres every insert into `plans` also sends a
//! `NOTIFY plan_intake_receipts` (a statement trigger, delivered at COMMIT),
//! and one listener connection per process bumps the counter for writes made
//! through any instance. A reader marks the counter seen *before* it reads
//! its page, so a write that lands between the read and the wait still
//! wakes it.

use std::sync::{Arc, Weak};
use std::time::Duration;

use diesel::{Connection, PgConnection, RunQueryDsl};
use tokio::sync::watch;

use super::StorageError;

/// How often the listener asks its connection for notifications: each ask
/// is one non-blocking read on the socket.
const LISTEN_POLL: Duration = Duration::from_millis(5);
/// How long the listener waits before connecting again after losing its
/// connection.
const LISTEN_RECONNECT: Duration = Duration::from_millis(500);
pub const CHANNEL: &str = "plan_intake_receipts";

#[derive(Clone)]
pub struct FeedSignal {
    generation: Arc<watch::Sender<u64>>,
}

impl Default for FeedSignal {
    fn default() -> Self {
        Self {
            generation: Arc::new(watch::channel(0).0),
        }
    }
}

impl FeedSignal {
    /// Something may have joined the feed.
    pub fn bump(&self) {
        self.generation.send_modify(|g| *g = g.wrapping_add(1));
    }

    /// A receiver with the current generation already seen.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// Listens for other instances' writes on `url` (Postgres) until this
    /// signal is dropped, reconnecting whenever the connection is lost.
    pub fn listen(&self, url: String) {
        let weak: Weak<watch::Sender<u64>> = Arc::downgrade(&self.generation);
        let spawned = std::thread::Builder::new()
            .name("feed-listener".to_owned())
            .spawn(move || listen_until_dropped(&weak, &url));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the feed listener; waiting readers wake on this instance's writes and every half second");
        }
    }
}

fn listen_until_dropped(signal: &Weak<watch::Sender<u64>>, url: &str) {
    while signal.strong_count() > 0 {
        let listening = PgConnection::establish(url)
            .map_err(|e| StorageError::unavailable("the feed listener cannot connect", e))
            .and_then(|mut conn| {
                diesel::sql_query(format!("LISTEN {CHANNEL}")).execute(&mut conn)?;
                Ok(conn)
            });
        match listening {
            Ok(mut conn) => {
                if let Err(e) = relay(&mut conn, signal) {
                    tracing::warn!(error = %e, "the feed listener lost its connection; reconnecting");
                }
            }
            Err(e) => {
                tracing::warn!(error = %crate::report::chain(&e), "the feed listener cannot listen; retrying")
            }
        }
        std::thread::sleep(LISTEN_RECONNECT);
    }
}

/// Bumps the signal for every batch of notifications, until the signal is
/// dropped (Ok) or the connection fails.
fn relay(conn: &mut PgConnection, signal: &Weak<watch::Sender<u64>>) -> diesel::QueryResult<()> {
    loop {
        let Some(sender) = signal.upgrade() else {
            return Ok(());
        };
        let mut woke = false;
        for notification in conn.notifications_iter() {
            notification?;
            woke = true;
        }
        if woke {
            sender.send_modify(|g| *g = g.wrapping_add(1));
        }
        drop(sender);
        std::thread::sleep(LISTEN_POLL);
    }
}
