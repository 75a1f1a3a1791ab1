//! The receipts feed in the domain: its opaque cursor, its pages and
//! entries, and the bounds on a reader's page and wait.

use super::read::ReadError;
use super::receipt::{CorruptRow, PlanView, Receipt};
use crate::deadline::Deadline;
use crate::metrics::Metrics;
use crate::storage::Database;
use crate::storage::feed::{self as stored, FeedPosition, PageRows};

/// A place in the feed, handed to readers as an opaque string. The default
/// is the start of the feed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cursor(pub(crate) FeedPosition);

impl Cursor {
    /// Opaque to readers: hex of `v1:{feed_xid}:{id}`.
    pub fn encode(self) -> String {
        encode(self.0)
    }

    /// A cursor this service issued, or a message saying it is not one.
    pub fn decode(cursor: &str) -> Result<Self, String> {
        decode(cursor).map(Cursor)
    }
}

/// One entry of a feed page: the receipt, or with `expand=plan` the whole
/// plan (its receipt, approved inputs and content).
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum FeedEntry {
    Receipt(Receipt),
    Plan(PlanView),
}

/// A page of the feed and the cursor after it (the cursor sent, when the
/// page is empty).
#[derive(Debug, Clone)]
pub struct Page {
    pub entries: Vec<FeedEntry>,
    pub next: Cursor,
}

/// The end of the settled feed: a reader starting there misses nothing
/// still to come and pages through no history.
pub(super) fn end(db: &Database, deadline: &Deadline) -> Result<Cursor, ReadError> {
    Ok(Cursor(db.read(deadline, stored::feed_end)?))
}

/// Up to `limit` receipts after `after`, in feed order; with `expand`,
/// whole plans. Records how far the feed lags behind its writers.
pub(super) fn page(
    db: &Database,
    metrics: &Metrics,
    after: Cursor,
    limit: i64,
    expand: bool,
    deadline: &Deadline,
) -> Result<Page, ReadError> {
    let (rows, horizon) = db.read(deadline, |conn| {
        stored::feed_page(conn, after.0, limit, expand)
    })?;
    metrics.set_feed_lag(horizon.lag_seconds);
    let next = rows.last_position().map_or(after, Cursor);
    let entries = match &rows {
        PageRows::Receipts(rows) => rows
            .iter()
            .map(|(_, row)| Receipt::from_row(row, None).map(FeedEntry::Receipt))
            .collect::<Result<Vec<_>, CorruptRow>>()?,
        PageRows::Plans(rows) => rows
            .iter()
            .map(|(_, row)| PlanView::from_row(row).map(FeedEntry::Plan))
            .collect::<Result<Vec<_>, CorruptRow>>()?,
    };
    Ok(Page { entries, next })
}

pub const DEFAULT_LIMIT: i64 = 100;
pub const MAX_LIMIT: i64 = 1000;
const VERSION: &str = "v1";
/// `after=now`: start at the current end of the feed.
pub const NOW: &str = "now";

fn encode(position: FeedPosition) -> String {
    format!("{VERSION}:{}:{}", position.xid, position.id)
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn decode(cursor: &str) -> Result<FeedPosition, String> {
    let invalid = || "`after` is not a cursor this service issued".to_owned();
    if !cursor.len().is_multiple_of(2) || cursor.len() > 128 {
        return Err(invalid());
    }
    let bytes = (0..cursor.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(cursor.get(i..i + 2).unwrap_or("zz"), 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|_| invalid())?;
    let text = String::from_utf8(bytes).map_err(|_| invalid())?;
    let mut parts = text.split(':');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(VERSION), Some(xid), Some(id), None) => Ok(FeedPosition {
            xid: xid.parse().map_err(|_| invalid())?,
            id: id.parse().map_err(|_| invalid())?,
        }),
        _ => Err(invalid()),
    }
}

/// `limit` as sent (absent: the default), within 1–1000.
pub fn parse_limit(limit: Option<&str>) -> Result<i64, String> {
    let Some(limit) = limit else {
        return Ok(DEFAULT_LIMIT);
    };
    match limit.parse::<i64>() {
        Ok(n) if (1..=MAX_LIMIT).contains(&n) => Ok(n),
        _ => Err(format!("`limit` must be an integer from 1 to {MAX_LIMIT}")),
    }
}

/// The longest a reader may wait for a receipt, in seconds.
pub const MAX_WAIT_SECS: u64 = 60;

/// `wait` as sent (absent: 0), whole seconds within 0–60.
pub fn parse_wait(wait: Option<&str>) -> Result<std::time::Duration, String> {
    let Some(wait) = wait else {
        return Ok(std::time::Duration::ZERO);
    };
    match wait.parse::<u64>() {
        Ok(n) if n <= MAX_WAIT_SECS => Ok(std::time::Duration::from_secs(n)),
        _ => Err(format!(
            "`wait` must be a whole number of seconds from 0 to {MAX_WAIT_SECS}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_refuse_forgeries() {
        let position = FeedPosition {
            xid: 7_000_123,
            id: 42,
        };
        assert_eq!(decode(&encode(position)), Ok(position));
        for bad in ["", "zz", "abc", "76323a313a", &encode(position)[2..]] {
            assert!(decode(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn waits_are_bounded() {
        assert_eq!(parse_wait(None), Ok(std::time::Duration::ZERO));
        assert_eq!(
            parse_wait(Some("60")),
            Ok(std::time::Duration::from_secs(60))
        );
        for bad in ["61", "-1", "1.5", "x", ""] {
            assert!(parse_wait(Some(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn limits_are_bounded() {
        assert_eq!(parse_limit(None), Ok(100));
        assert_eq!(parse_limit(Some("1")), Ok(1));
        assert_eq!(parse_limit(Some("1000")), Ok(1000));
        for bad in ["0", "1001", "-1", "x", ""] {
            assert!(parse_limit(Some(bad)).is_err(), "{bad}");
        }
    }
}
