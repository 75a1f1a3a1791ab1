//! The receipts feed in the domain: its opaque cursor, its pages and
//! entries, and the bounds on a reader's page and wait.

use super::read::ReadError;
use super::receipt::ReceiptOfRow;
use super::receipt::{CorruptRow, PlanView, Receipt};
use crate::deadline::Deadline;
use crate::metrics::Metrics;
use diesel::QueryResult;
/// The feed as readers see it: its page, cursor and bounds, shared with
/// the client.
pub use plan_intake_wire::feed::{
    CURSOR_NOT_IN_FEED, FeedCursor, FeedPage, parse_limit, parse_wait,
};

use crate::storage::feed::{self as stored, FeedPosition, PageRows, Standing};
use crate::storage::{Database, DbConn};

/// A place in the feed, handed to readers as an opaque string: the
/// position of the last receipt read and a short hash of that receipt's id,
/// so that a cursor is refused where it was not handed out (another
/// deployment, a database restored to an earlier state, a position past
/// the end) instead of answering pages that skip receipts. The default is
/// the start of the feed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cursor {
    pub(crate) position: FeedPosition,
    /// `None`: the start, or a `v1` cursor (issued before cursors carried
    /// their receipt), which is placed by its position alone.
    anchor: Option<Anchor>,
}

/// The first 8 bytes of blake3 over the receipt id at a cursor's position.
type Anchor = [u8; 8];

fn anchor_of(receipt_id: &str) -> Anchor {
    let mut anchor = [0u8; 8];
    anchor.copy_from_slice(&blake3::hash(receipt_id.as_bytes()).as_bytes()[..8]);
    anchor
}

impl Cursor {
    /// The cursor after the receipt `receipt_id`, stored at `position`.
    pub(crate) fn after_receipt(position: FeedPosition, receipt_id: &str) -> Self {
        Self {
            position,
            anchor: Some(anchor_of(receipt_id)),
        }
    }

    /// Opaque to readers: hex of `v2:{feed_xid}:{id}:{anchor}`.
    pub fn encode(self) -> FeedCursor {
        FeedCursor::new(encode(self))
    }

    /// A cursor this service issued, or a message saying it is not one.
    pub fn decode(cursor: &str) -> Result<Self, String> {
        decode(cursor)
    }

    /// Whether a plan stands where the cursor says, as it says: refused
    /// when it cannot be placed in this feed's history.
    fn placed(self, standing: &Standing) -> bool {
        match (standing, self.anchor) {
            (Standing::Start | Standing::PastAnEarlierTimeline, _) => true,
            (Standing::At(_), None) => true,
            (Standing::At(receipt_id), Some(anchor)) => anchor_of(receipt_id) == anchor,
            (Standing::Nowhere, _) => false,
        }
    }
}

/// A cursor that cannot be placed in this feed's history.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "this cursor was not handed out by this feed: it comes from another deployment, from a database restored to an earlier state, or lies past the feed's end; start again with `after=now` (the current end) or without `after` (the start)"
)]
pub struct CursorNotInFeed;

/// `Err` when `after` cannot be placed in the feed `conn` reads.
fn check_placed(conn: &mut DbConn, after: Cursor) -> QueryResult<Result<(), CursorNotInFeed>> {
    let standing = stored::standing(conn, after.position)?;
    Ok(if after.placed(&standing) {
        Ok(())
    } else {
        Err(CursorNotInFeed)
    })
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
    let (position, receipt_id) = db.read(deadline, stored::feed_end)?;
    Ok(receipt_id.map_or_else(Cursor::default, |receipt_id| {
        Cursor::after_receipt(position, &receipt_id)
    }))
}

/// How many plans after `after` one expanded page holds (up to `limit`,
/// within `budget` bytes of content, at least one) and their bytes.
pub(super) fn extent(
    db: &Database,
    after: Cursor,
    limit: i64,
    budget: u64,
    deadline: &Deadline,
) -> Result<Extent, ReadError> {
    let (rows, bytes) = db.read(deadline, |conn| {
        Ok(match check_placed(conn, after)? {
            Ok(()) => Ok(stored::page_extent(conn, after.position, limit, budget)?),
            Err(refused) => Err(refused),
        })
    })??;
    Ok(Extent { rows, bytes })
}

/// What an expanded page will hold: its plans and their bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub rows: i64,
    pub bytes: u64,
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
        Ok(match check_placed(conn, after)? {
            Ok(()) => Ok(stored::feed_page(conn, after.position, limit, expand)?),
            Err(refused) => Err(refused),
        })
    })??;
    metrics.set_feed_lag(horizon.lag_seconds);
    let next = rows
        .last_position()
        .map_or(after, |(position, receipt_id)| {
            Cursor::after_receipt(position, receipt_id)
        });
    let entries = match rows {
        PageRows::Receipts(rows) => rows
            .iter()
            .map(|(_, row)| Receipt::from_row(row, None).map(FeedEntry::Receipt))
            .collect::<Result<Vec<_>, CorruptRow>>()?,
        PageRows::Plans(rows) => rows
            .into_iter()
            .map(|(_, row)| PlanView::from_row(row).map(FeedEntry::Plan))
            .collect::<Result<Vec<_>, CorruptRow>>()?,
    };
    Ok(Page { entries, next })
}

/// `v2` cursors carry their receipt's anchor; `v1` cursors (before) are
/// still read, placed by their position alone, and handed back as `v1`
/// (an empty page's `next` is the cursor sent) until a page moves them.
const VERSION: &str = "v2";
const VERSION_1: &str = "v1";
fn encode(cursor: Cursor) -> String {
    let (xid, id) = (cursor.position.xid, cursor.position.id);
    let text = match cursor.anchor {
        Some(anchor) => {
            let anchor: String = anchor.iter().map(|b| format!("{b:02x}")).collect();
            format!("{VERSION}:{xid}:{id}:{anchor}")
        }
        None if cursor.position == FeedPosition::default() => format!("{VERSION}:0:0:"),
        None => format!("{VERSION_1}:{xid}:{id}"),
    };
    text.bytes().map(|b| format!("{b:02x}")).collect()
}

fn decode(cursor: &str) -> Result<Cursor, String> {
    let invalid = || "`after` is not a cursor this service issued".to_owned();
    if !cursor.len().is_multiple_of(2) || cursor.len() > 256 {
        return Err(invalid());
    }
    let bytes = (0..cursor.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(cursor.get(i..i + 2).unwrap_or("zz"), 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|_| invalid())?;
    let text = String::from_utf8(bytes).map_err(|_| invalid())?;
    let parts: Vec<&str> = text.split(':').collect();
    let (xid, id, anchor) = match parts.as_slice() {
        [VERSION_1, xid, id] => (*xid, *id, None),
        [VERSION, xid, id, anchor] => (*xid, *id, Some(*anchor)),
        _ => return Err(invalid()),
    };
    let position = FeedPosition {
        xid: xid.parse().map_err(|_| invalid())?,
        id: id.parse().map_err(|_| invalid())?,
    };
    let anchor = match anchor {
        None | Some("") => None,
        Some(hex) if hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
            let mut anchor = [0u8; 8];
            for (i, byte) in anchor.iter_mut().enumerate() {
                *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2).unwrap_or("zz"), 16)
                    .map_err(|_| invalid())?;
            }
            Some(anchor)
        }
        Some(_) => return Err(invalid()),
    };
    // Only the start has no receipt to anchor to.
    if anchor.is_none() && parts[0] == VERSION && position != FeedPosition::default() {
        return Err(invalid());
    }
    Ok(Cursor { position, anchor })
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
        let cursor = Cursor::after_receipt(position, "r-1");
        assert_eq!(decode(&encode(cursor)), Ok(cursor));
        assert_eq!(decode(&encode(Cursor::default())), Ok(Cursor::default()));
        // A `v1` cursor handed back (an empty page) is read again.
        let old = Cursor {
            position,
            anchor: None,
        };
        assert_eq!(decode(&encode(old)), Ok(old));
        let hex = |text: &str| -> String { text.bytes().map(|b| format!("{b:02x}")).collect() };
        // A cursor issued before cursors carried their receipt.
        assert_eq!(
            decode(&hex("v1:7000123:42")),
            Ok(Cursor {
                position,
                anchor: None
            })
        );
        for bad in [
            "",
            "zz",
            "abc",
            "76323a313a",
            &encode(cursor)[2..],
            &hex("v2:7000123:42:"),
            &hex("v2:7000123:42:0011"),
            &hex("v2:7000123:42:00112233445566zz"),
            &hex("v2:7000123:42:+f11223344556677"),
            &hex("v1:7000123:42:0011223344556677"),
        ] {
            assert!(decode(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_cursor_is_placed_only_where_its_receipt_stands() {
        let position = FeedPosition { xid: 0, id: 7 };
        let cursor = Cursor::after_receipt(position, "r-7");
        assert!(cursor.placed(&Standing::At("r-7".to_owned())));
        assert!(!cursor.placed(&Standing::At("r-other".to_owned())));
        assert!(!cursor.placed(&Standing::Nowhere));
        assert!(cursor.placed(&Standing::PastAnEarlierTimeline));
        let old = Cursor {
            position,
            anchor: None,
        };
        assert!(old.placed(&Standing::At("anything".to_owned())));
        assert!(!old.placed(&Standing::Nowhere));
    }
}
