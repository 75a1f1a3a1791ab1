//! The receipts feed: `GET /v1/receipts?after=…&limit=…&wait=…&expand=plan`,
//! with the long poll that waits for the next receipt.

use actix_web::{HttpRequest, HttpResponse, web};

use super::admission::BodyBytes;
use super::problem::{Problem, Refusals};
use super::{ApiError, AppState, auth};
use crate::deadline::Deadline;
use crate::intake::Permission;
use crate::intake::feed::{self, Cursor, FeedCursor, FeedEntry};

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FeedQuery {
    after: Option<String>,
    limit: Option<String>,
    expand: Option<String>,
    wait: Option<String>,
}

/// A page as this service answers it.
type FeedPage = feed::FeedPage<FeedEntry>;

/// `GET /v1/receipts?after=CURSOR&limit=N&expand=plan`: every receipt once,
/// in feed order. `next` is always present; on an empty page it is the
/// cursor sent, so readers poll with it. `after=now` is the current end of
/// the feed, read like any cursor (`wait` included): what comes after it,
/// or an empty page whose `next` is the end.
#[utoipa::path(get, path = "/v1/receipts", tag = "reading",
    params(
        ("after" = Option<String>, Query, description = "The `next` of the previous page; `now`: the current end, read like any cursor (with `wait`, the first receipts to come after it; an empty page's `next` is the end); absent: from the start"),
        ("limit" = Option<i64>, Query, minimum = 1, maximum = 1000, description = "Receipts per page (default 100); with `expand=plan` a page also ends early, with its `next`, once its plans pass the service's page budget (`--feed-page-bytes`, 16 MiB by default; one larger plan is a page of one)"),
        ("wait" = Option<u32>, Query, minimum = 0, maximum = 60, description = "Seconds to wait, with nothing past the cursor, for a receipt to join the feed (default 0): the answer comes as soon as one is visible, else an empty page after this long. Any instance's write wakes the wait."),
        ("expand" = Option<String>, Query, pattern = "^plan$", description = "`plan`: each entry is the whole plan (`{receipt, approved_inputs, content}`), as `GET /v1/plans/{receipt_id}` answers it"),
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The next page; `next` is always present", body = FeedPage),
        (status = 400, description = "A cursor this service did not issue or one this feed cannot place (`cursor-not-in-feed`: another deployment's, a restored database's, past the end), a limit outside 1-1000, a wait outside 0-60, an `expand` other than `plan`, or an unknown query parameter", body = Problem, content_type = "application/problem+json"),
        Refusals,
    ))]
pub async fn list_receipts(
    req: HttpRequest,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let login = auth::authenticate(&req, &state).await?;
    auth::require(&login, Permission::ReceiptsRead)?;
    let query = super::query_of::<FeedQuery>(&req)?;
    let expand = match query.expand.as_deref() {
        None => false,
        Some("plan") => true,
        Some(_) => return Err(ApiError::BadQuery("`expand` takes only `plan`".to_owned())),
    };
    let limit = feed::parse_limit(query.limit.as_deref()).map_err(ApiError::BadQuery)?;
    let limit = i64::from(limit);
    let wait = feed::parse_wait(query.wait.as_deref()).map_err(ApiError::BadQuery)?;
    let deadline = super::deadline::of(&req, &state);
    let after = match query.after.as_deref() {
        // The feed's end is a cursor like any other: with `wait`, the answer
        // is the first receipt to come after it, or an empty page whose
        // `next` is the end.
        Some(FeedCursor::NOW) => {
            state
                .blocking(deadline, move |intake| intake.feed_end(&deadline))
                .await?
        }
        Some(cursor) => Cursor::decode(cursor).map_err(ApiError::BadQuery)?,
        None => Cursor::default(),
    };
    let reader = Reader {
        token: super::auth::bearer_token(req.headers())?.to_owned(),
    };
    let (page, room) = read_or_wait(&state, &reader, after, limit, expand, wait, deadline).await?;
    let page = FeedPage {
        receipts: page.entries,
        next: page.next.encode(),
    };
    match room {
        Some(room) => super::held_json(&page, room),
        None => Ok(HttpResponse::Ok().json(page)),
    }
}

/// Who waits on the feed: its token, looked up again before a page found
/// after a wait is handed out (a login revoked meanwhile gets none).
struct Reader {
    token: String,
}

/// A page past `after`; with nothing there, waits up to `wait` for a
/// receipt to join the feed, holding no connection while it waits. Woken by
/// any instance's write, and every `RECHECK` in any case (a write that
/// aborts sends no notification, yet may have been what held a committed
/// one back). An expanded page comes with its room among the bytes in
/// flight, to hold until it is sent.
async fn read_or_wait(
    state: &AppState,
    reader: &Reader,
    after: Cursor,
    limit: i64,
    expand: bool,
    wait: std::time::Duration,
    mut deadline: Deadline,
) -> Result<(feed::Page, Option<BodyBytes>), ApiError> {
    const RECHECK: std::time::Duration = std::time::Duration::from_millis(500);
    let until = std::time::Instant::now() + wait;
    let mut changes = state.intake.feed_changes();
    let mut stopping = state.stopping();
    let metrics = &state.intake.metrics;
    let mut waited = false;
    loop {
        changes.borrow_and_update();
        let (page, room) = if expand {
            expanded_page(state, after, limit, deadline).await?
        } else {
            let page = state
                .blocking(deadline, move |intake| {
                    intake.feed_page(after, limit, false, &deadline)
                })
                .await?;
            (page, None)
        };
        let left = until.saturating_duration_since(std::time::Instant::now());
        if !page.entries.is_empty() || left.is_zero() || *stopping.borrow_and_update() {
            if waited && !page.entries.is_empty() {
                still_a_reader(state, reader, deadline).await?;
            }
            return Ok((page, room));
        }
        waited = true;
        let _waiting = metrics.feed_reader_waiting();
        let woken = async {
            tokio::select! {
                changed = changes.changed() => changed.is_ok(),
                // A stop answers the page in hand (checked above, next turn).
                _ = stopping.changed() => false,
            }
        };
        if let Ok(true) = actix_web::rt::time::timeout(left.min(RECHECK), woken).await {
            metrics.feed_wakeup();
        }
        deadline = Deadline::after(state.http.request_timeout);
    }
}

/// The token of a reader that waited still names an active login that may
/// read the feed: a revocation during a long poll ends it (401), and no
/// page found after it is handed out.
async fn still_a_reader(
    state: &AppState,
    reader: &Reader,
    deadline: Deadline,
) -> Result<(), ApiError> {
    let token = reader.token.clone();
    let login = state
        .blocking(deadline, move |intake| {
            intake.authenticate(&deadline, &token)
        })
        .await?
        .ok_or(ApiError::Unauthorized("unknown or revoked token"))?;
    super::auth::require(&login, Permission::ReceiptsRead)
}

/// A page of whole plans, read in bounded memory: first how many plans fit
/// the page's byte budget (and how many bytes they are), then room for them
/// among the bytes in flight (503 without it), then the plans themselves.
async fn expanded_page(
    state: &AppState,
    after: Cursor,
    limit: i64,
    deadline: Deadline,
) -> Result<(feed::Page, Option<BodyBytes>), ApiError> {
    let budget = u64::try_from(state.http.feed_page_bytes).unwrap_or(u64::MAX);
    let extent = state
        .blocking(deadline, move |intake| {
            intake.feed_extent(after, limit, budget, &deadline)
        })
        .await?;
    if extent.rows == 0 {
        let empty = feed::Page {
            entries: Vec::new(),
            next: after,
        };
        return Ok((empty, None));
    }
    let room = state
        .room_to_read(extent.bytes, extent.rows, &deadline)
        .await?;
    let page = state
        .blocking(deadline, move |intake| {
            intake.feed_page(after, extent.rows, true, &deadline)
        })
        .await?;
    Ok((page, Some(room)))
}
