//! The read side, as the door asks for it: who is calling, a plan or its
//! receipt by id (with the rule of who may see it), the feed, and whether
//! the service is ready. Answers are domain types; rows and connections
//! stay below.

use tokio::sync::watch;

use super::feed::{Cursor, FeedEntry, Page};
use super::login::{self, LoginError};
use super::receipt::{CorruptRow, PlanView, Receipt};
use super::submit::Intake;
use super::{Login, Permission};
use crate::deadline::Deadline;
use crate::storage::Durability;
use crate::storage::StorageError;
use crate::storage::plans::{self, PlanRow};

/// A read that could not answer.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The request's deadline passed first: retry later.
    #[error("the request's deadline passed")]
    TimedOut(#[source] StorageError),
    /// The database could not answer (or migrations are pending): retry later.
    #[error("the database could not answer")]
    Unavailable(#[source] StorageError),
    /// A stored row cannot be read back: never the caller's fault.
    #[error("a stored row cannot be read back")]
    Corrupt(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl From<StorageError> for ReadError {
    fn from(error: StorageError) -> Self {
        match error {
            StorageError::DeadlineExceeded(_) => ReadError::TimedOut(error),
            other => ReadError::Unavailable(other),
        }
    }
}

impl From<CorruptRow> for ReadError {
    fn from(error: CorruptRow) -> Self {
        ReadError::Corrupt(Box::new(error))
    }
}

impl From<LoginError> for ReadError {
    fn from(error: LoginError) -> Self {
        match error {
            LoginError::Storage(e) => e.into(),
            other => ReadError::Corrupt(Box::new(other)),
        }
    }
}

/// A caller signed in to submit: its login, and the hash of the token it
/// signed in with, which the write checks again in the same step, so a
/// revocation takes effect at once however the login was found.
#[derive(Debug, Clone)]
pub struct Caller {
    pub login: Login,
    pub(super) token_hash: String,
}

impl Intake {
    /// The caller that owns `token`, if a recent lookup found its login
    /// active: no database work, so the door may ask before it reads a
    /// body. `None` means "look it up", never "refuse".
    pub fn known_caller(&self, token: &str) -> Option<Caller> {
        let token_hash = login::token_hash(token);
        let login = self.known.get(&token_hash)?;
        Some(Caller { login, token_hash })
    }

    /// The caller that owns `token`, if its login is active: one indexed
    /// lookup, remembered for [`Intake::known_caller`].
    pub fn sign_in(&self, deadline: &Deadline, token: &str) -> Result<Option<Caller>, ReadError> {
        let token_hash = login::token_hash(token);
        let Some(login) = login::find_by_hash(&self.db, deadline, &token_hash)?.0 else {
            return Ok(None);
        };
        self.known.remember(&token_hash, &login);
        Ok(Some(Caller { login, token_hash }))
    }

    /// The active login that owns `token`, if any.
    pub fn authenticate(
        &self,
        deadline: &Deadline,
        token: &str,
    ) -> Result<Option<Login>, ReadError> {
        Ok(login::find(&self.db, deadline, token)?.0)
    }

    /// The receipt `receipt_id`, if `login` may see it.
    pub fn receipt(
        &self,
        login: &Login,
        receipt_id: &str,
        deadline: &Deadline,
    ) -> Result<Option<Receipt>, ReadError> {
        self.readable(login, receipt_id, deadline)?
            .map(|row| Receipt::from_row(&row.receipt_row(), None).map_err(Into::into))
            .transpose()
    }

    /// The plan behind `receipt_id`, if `login` may see it.
    pub fn plan(
        &self,
        login: &Login,
        receipt_id: &str,
        deadline: &Deadline,
    ) -> Result<Option<PlanView>, ReadError> {
        self.readable(login, receipt_id, deadline)?
            .map(|row| PlanView::from_row(&row).map_err(Into::into))
            .transpose()
    }

    /// `receipts:read` sees every plan, a planner only its own; anything
    /// else is as if it did not exist, so a planner cannot learn that
    /// another maker's receipt exists.
    fn readable(
        &self,
        login: &Login,
        receipt_id: &str,
        deadline: &Deadline,
    ) -> Result<Option<PlanRow>, ReadError> {
        let row = self
            .db
            .read(deadline, |conn| plans::find_by_receipt(conn, receipt_id))?;
        Ok(row.filter(|row| {
            login.has(Permission::ReceiptsRead)
                || (login.has(Permission::PlansSubmit) && row.maker == login.name)
        }))
    }

    /// The end of the settled feed: a reader starting there misses nothing
    /// still to come and pages through no history.
    pub fn feed_end(&self, deadline: &Deadline) -> Result<Cursor, ReadError> {
        Ok(Cursor(self.db.read(deadline, plans::feed_end)?))
    }

    /// Up to `limit` receipts after `after`, in feed order; with `expand`,
    /// whole plans. Records how far the feed lags behind its writers.
    pub fn feed_page(
        &self,
        after: Cursor,
        limit: i64,
        expand: bool,
        deadline: &Deadline,
    ) -> Result<Page, ReadError> {
        let (rows, horizon) = self
            .db
            .read(deadline, |conn| plans::feed_page(conn, after.0, limit))?;
        self.metrics.set_feed_lag(horizon.lag_seconds);
        let next = rows
            .last()
            .map(|(xid, row)| {
                Cursor(plans::FeedPosition {
                    xid: *xid,
                    id: row.id,
                })
            })
            .unwrap_or(after);
        let entries = rows
            .iter()
            .map(|(_, row)| -> Result<FeedEntry, CorruptRow> {
                Ok(if expand {
                    FeedEntry::Plan(PlanView::from_row(row)?)
                } else {
                    FeedEntry::Receipt(Receipt::from_row(&row.receipt_row(), None)?)
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Page { entries, next })
    }

    /// Changes whenever a plan may have joined the feed, written by this
    /// instance or (heard by its listener) another.
    pub fn feed_changes(&self) -> watch::Receiver<u64> {
        self.db.feed_signal().subscribe()
    }

    /// Ready to serve: the database answers and no migration is pending;
    /// and whether an acknowledged plan survives a failover (the gauge
    /// `plan_intake_commit_waits_for_standby` follows).
    pub fn readiness(&self, deadline: &Deadline) -> Result<Readiness, ReadError> {
        let durability = self.db.readiness(deadline)?;
        let waits = durability.waits_for_standby();
        self.metrics.set_commit_waits_for_standby(waits);
        let warning = match durability {
            Durability::Postgres {
                synchronous_standby_names,
                synchronous_commit,
            } if !waits => Some(format!(
                "acknowledged commits do not wait for a synchronous standby \
                 (synchronous_standby_names = '{synchronous_standby_names}', synchronous_commit = {synchronous_commit}): \
                 a failover may lose acknowledged plans"
            )),
            _ => None,
        };
        Ok(Readiness {
            commit_waits_for_standby: waits,
            warning,
        })
    }

    /// Brings the pool's gauges up to date, for a scrape.
    pub fn record_pool_gauges(&self) {
        let pool = self.db.pool.state();
        self.metrics
            .set_pool(pool.connections, pool.idle_connections, self.db.waiters());
    }
}

/// What `/readyz` tells beyond "ready".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Readiness {
    /// Every acknowledged commit is on a synchronous standby too.
    pub commit_waits_for_standby: bool,
    /// On Postgres when it is not: what a failover may lose, and why.
    pub warning: Option<String>,
}
