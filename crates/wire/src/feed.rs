//! The receipts feed as readers see it (`GET /v1/receipts`): a page, the
//! opaque cursor after it, and the bounds of a page and of a wait, which the
//! service enforces and the client offers.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Receipts per page when a request names no `limit`.
pub const DEFAULT_LIMIT: u32 = 100;
/// The most receipts one page holds.
pub const MAX_LIMIT: u32 = 1000;
/// The longest one request may wait for a receipt to join the feed.
pub const MAX_WAIT: Duration = Duration::from_secs(60);
/// The problem type (after `https://plan-intake.dev/problems/`) of a cursor
/// the feed cannot place: another deployment's, a restored database's, or
/// one past the end.
pub const CURSOR_NOT_IN_FEED: &str = "cursor-not-in-feed";

/// A place in the feed, opaque to readers: the `next` of a page, sent back
/// as `after` for the next one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(transparent)]
pub struct FeedCursor(String);

impl FeedCursor {
    /// `after=now`: the end of the settled feed (the answer is an empty
    /// page whose `next` is that end).
    pub const NOW: &str = "now";

    /// A cursor as issued (a page's `next`) or as saved.
    pub fn new(text: impl Into<String>) -> Self {
        Self(text.into())
    }

    /// The cursor's text, as the service wrote it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for FeedCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A page of the feed: up to `limit` entries in feed order (receipts, or
/// whole plans with `expand=plan`) and the cursor after them. On an empty
/// page `next` is where the reader stands (the cursor sent; with
/// `after=now`, the feed's end), so a reader polls with it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FeedPage<Entry> {
    /// The page's entries, in feed order.
    pub receipts: Vec<Entry>,
    /// Where the next page starts: send it as `after`.
    pub next: FeedCursor,
}

/// By hand, so that the schema is `FeedPage` whatever its entries (the
/// derive would name it `FeedPage_{Entry}` and copy the entry's schema in).
#[cfg(feature = "openapi")]
mod schema {
    use std::borrow::Cow;

    use utoipa::openapi::RefOr;
    use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, Ref, Schema};
    use utoipa::{PartialSchema, ToSchema};

    use super::{FeedCursor, FeedPage};

    impl<Entry: ToSchema> PartialSchema for FeedPage<Entry> {
        fn schema() -> RefOr<Schema> {
            ObjectBuilder::new()
                .description(Some(
                    "A page of the feed: up to `limit` entries in feed order (receipts, or whole plans with `expand=plan`) and the cursor after them. On an empty page `next` is where the reader stands (the cursor sent; with `after=now`, the feed's end), so a reader polls with it.",
                ))
                .property(
                    "receipts",
                    ArrayBuilder::new().items(Ref::from_schema_name(Entry::name())),
                )
                .required("receipts")
                .property("next", Ref::from_schema_name(FeedCursor::name()))
                .required("next")
                .into()
        }
    }

    impl<Entry: ToSchema> ToSchema for FeedPage<Entry> {
        fn name() -> Cow<'static, str> {
            Cow::Borrowed("FeedPage")
        }

        fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
            schemas.push((Entry::name().into(), Entry::schema()));
            Entry::schemas(schemas);
            schemas.push((FeedCursor::name().into(), FeedCursor::schema()));
        }
    }
}

/// `limit` as sent (absent: [`DEFAULT_LIMIT`]), from 1 to [`MAX_LIMIT`].
pub fn parse_limit(limit: Option<&str>) -> Result<u32, String> {
    let Some(limit) = limit else {
        return Ok(DEFAULT_LIMIT);
    };
    match limit.parse::<u32>() {
        Ok(n) if (1..=MAX_LIMIT).contains(&n) => Ok(n),
        _ => Err(format!("`limit` must be an integer from 1 to {MAX_LIMIT}")),
    }
}

/// `wait` as sent (absent: no wait), whole seconds up to [`MAX_WAIT`].
pub fn parse_wait(wait: Option<&str>) -> Result<Duration, String> {
    let Some(wait) = wait else {
        return Ok(Duration::ZERO);
    };
    let most = MAX_WAIT.as_secs();
    match wait.parse::<u64>() {
        Ok(n) if n <= most => Ok(Duration::from_secs(n)),
        _ => Err(format!(
            "`wait` must be a whole number of seconds from 0 to {most}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_are_bounded() {
        assert_eq!(parse_wait(None), Ok(Duration::ZERO));
        assert_eq!(parse_wait(Some("60")), Ok(Duration::from_secs(60)));
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

    #[test]
    fn a_page_reads_as_it_is_written() {
        let page: FeedPage<serde_json::Value> =
            serde_json::from_str(r#"{"receipts":[{"receipt_id":"r-1"}],"next":"7632"}"#)
                .expect("a page");
        assert_eq!(page.next.as_str(), "7632");
        assert_eq!(page.receipts.len(), 1);
        assert_eq!(
            serde_json::to_string(&page).expect("serializes"),
            r#"{"receipts":[{"receipt_id":"r-1"}],"next":"7632"}"#
        );
    }
}
