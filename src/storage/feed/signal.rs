//! Wakes readers waiting on the receipts feed (`wait=S`) when a plan may
//! have joined it. A waiting reader holds no database connection: it waits
//! on this signal, then reads a page again.
//!
//! The signal is a generation counter. This process's own writes bump it as
//! they succeed. On Postgres, one listener connection per process bumps it
//! for writes made through any instance: after its writes have committed,
//! each instance sends a `NOTIFY` on its schema's channel (see [`channel`])
//! from a connection of its own, at most once per [`NOTIFY_EVERY`] however
//! many plans it wrote, in a transaction that does not wait for its flush.
//! A reader marks the counter seen *before* it reads its page, so a write
//! that lands between the read and the wait still wakes it.
//!
//! Never inside the write: PostgreSQL serializes every committing
//! transaction that has queued a notification on one lock for the whole
//! cluster, taken before commit and held until the commit is flushed
//! (`PreCommit_Notify` in `src/backend/commands/async.c`; it also forces an
//! xid). A `NOTIFY` in every write (the trigger this replaced) halved what
//! the database could write and serialized every other application's
//! `NOTIFY` on the same cluster with it.

use std::sync::{Arc, Condvar, Mutex, PoisonError, Weak};
use std::time::Duration;

use diesel::{Connection, PgConnection, RunQueryDsl};
use tokio::sync::watch;

use crate::storage::StorageError;

/// How often the listener asks its connection for notifications: each ask
/// is one non-blocking read on the socket.
const LISTEN_POLL: Duration = Duration::from_millis(5);
/// How long the listener waits before connecting again after losing its
/// connection.
const LISTEN_RECONNECT: Duration = Duration::from_millis(500);
/// The notification channel of the tables in the `public` schema; tables in
/// another schema get `plan_intake_receipts:SCHEMA` (see [`channel`]), so
/// deployments sharing a database never wake each other's readers.
pub const CHANNEL: &str = "plan_intake_receipts";
/// The shortest time between two notifications from one instance: under
/// load the database sees at most 50 `NOTIFY` transactions a second per
/// instance, each waking other instances within this much plus their
/// listener's poll (the target is 50 ms). At 5 ms (200 a second) the
/// benchmark measured the write 7 % slower than with no push at all.
pub const NOTIFY_EVERY: Duration = Duration::from_millis(20);
/// How long the notifier sleeps with nothing to send before it checks
/// whether its signal is gone.
const NOTIFIER_IDLE: Duration = Duration::from_secs(1);

#[derive(Clone)]
pub struct FeedSignal {
    generation: Arc<watch::Sender<u64>>,
    /// Postgres: tells other instances about this one's writes.
    outbox: Option<Arc<Outbox>>,
}

impl Default for FeedSignal {
    fn default() -> Self {
        Self {
            generation: Arc::new(watch::channel(0).0),
            outbox: None,
        }
    }
}

/// Whether this instance has written since its last notification.
#[derive(Default)]
struct Outbox {
    pending: Mutex<bool>,
    wake: Condvar,
}

impl FeedSignal {
    /// Something may have joined the feed: wakes this instance's readers
    /// now, and other instances' with the next notification.
    pub fn bump(&self) {
        self.generation.send_modify(|g| *g = g.wrapping_add(1));
        if let Some(outbox) = &self.outbox {
            *outbox
                .pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = true;
            outbox.wake.notify_one();
        }
    }

    /// Tells other instances about this one's writes, from a connection of
    /// its own to `url` (Postgres; a transaction-mode pooler is fine), until
    /// every clone of this signal is dropped.
    pub fn notify_others(&mut self, url: String) {
        let outbox = Arc::new(Outbox::default());
        let weak = Arc::downgrade(&outbox);
        let spawned = std::thread::Builder::new()
            .name("feed-notifier".to_owned())
            .spawn(move || notify_until_dropped(&weak, &url));
        match spawned {
            Ok(_) => self.outbox = Some(outbox),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the feed notifier; other instances' waiting readers see this one's writes every half second")
            }
        }
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

fn notify_until_dropped(outbox: &Weak<Outbox>, url: &str) {
    let mut conn: Option<Notifier> = None;
    loop {
        let Some(held) = outbox.upgrade() else {
            return;
        };
        let mut pending = held.pending.lock().unwrap_or_else(PoisonError::into_inner);
        if !*pending {
            pending = held
                .wake
                .wait_timeout(pending, NOTIFIER_IDLE)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        let send = std::mem::take(&mut *pending);
        drop(pending);
        drop(held);
        if !send {
            continue;
        }
        if let Err(e) = notify(&mut conn, url) {
            conn = None;
            tracing::warn!(error = %crate::report::chain(&e), "the feed notifier cannot notify; other instances' readers see this one's writes within half a second");
            std::thread::sleep(LISTEN_RECONNECT);
        }
        // Writes made meanwhile go out together with the next notification.
        std::thread::sleep(NOTIFY_EVERY);
    }
}

/// The notifier's connection, with its `NOTIFY` transaction: the channel
/// is asked of the server once per connection, not once per notification.
struct Notifier {
    conn: PgConnection,
    statement: String,
}

/// One `NOTIFY`, in a transaction of its own that does not wait for its
/// commit to be flushed (it writes no data), on `notifier`'s connection or
/// a new one.
fn notify(notifier: &mut Option<Notifier>, url: &str) -> Result<(), StorageError> {
    use diesel::connection::SimpleConnection;
    let connected = match notifier.take() {
        Some(connected) => connected,
        None => {
            let mut conn = PgConnection::establish(url)
                .map_err(|e| StorageError::unavailable("the feed notifier cannot connect", e))?;
            let statement = format!(
                "BEGIN; SET LOCAL synchronous_commit = off; NOTIFY \"{}\"; COMMIT",
                channel(&mut conn)?
            );
            Notifier { conn, statement }
        }
    };
    let connected = notifier.insert(connected);
    connected.conn.batch_execute(&connected.statement)?;
    Ok(())
}

/// The channel for the tables this connection reaches: its schema's.
pub fn channel(conn: &mut PgConnection) -> diesel::QueryResult<String> {
    #[derive(diesel::QueryableByName)]
    struct Schema {
        #[diesel(sql_type = diesel::sql_types::Text)]
        name: String,
    }
    let schema = diesel::sql_query("SELECT current_schema() AS name").get_result::<Schema>(conn)?;
    Ok(match schema.name.as_str() {
        "public" => CHANNEL.to_owned(),
        // A quoted identifier: a double quote inside is doubled.
        other => format!("{CHANNEL}:{}", other.replace('"', "\"\"")),
    })
}

fn listen_until_dropped(signal: &Weak<watch::Sender<u64>>, url: &str) {
    while signal.strong_count() > 0 {
        let listening = PgConnection::establish(url)
            .map_err(|e| StorageError::unavailable("the feed listener cannot connect", e))
            .and_then(|mut conn| {
                let channel = channel(&mut conn)?;
                diesel::sql_query(format!("LISTEN \"{channel}\"")).execute(&mut conn)?;
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
