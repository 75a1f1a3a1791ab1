//! The evidence: `GET /v1/signing-keys` (the public keys receipts and
//! checkpoints are signed with), `GET /v1/checkpoint` (the newest signed
//! checkpoint of the receipt log), `GET /v1/checkpoint/consistency` and
//! `GET /v1/receipts/{receipt_id}/proof` (C2SP `tlog-proof`). The keys and
//! checkpoints are public, as an auditor needs them; a receipt's proof is
//! read under the receipt's own rule.

use actix_web::{HttpRequest, HttpResponse, web};

use super::problem::{NotYours, Problem, Refusals};
use super::{ApiError, AppState};
use crate::intake::signing::PublishedKeys;

const TEXT: &str = "text/plain; charset=utf-8";

#[utoipa::path(get, path = "/v1/signing-keys", tag = "evidence",
    responses(
        (status = 200, description = "Every key that has signed receipts or checkpoints, as C2SP signed-note verifier keys, with when each was in use", body = PublishedKeys),
        (status = 503, description = "The database could not answer, or (`busy`, with `Retry-After`) a caller that is not a familiar login found this second's public reads spent", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn signing_keys(
    req: HttpRequest,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    admit_public_read(&req, &state)?;
    let deadline = super::deadline::of(&req, &state);
    let keys = state
        .blocking(deadline, move |intake| intake.published_keys(&deadline))
        .await?;
    // A verifying reader asks when it meets a key it does not pin: a
    // cached list would lack a key just rotated in.
    Ok(with_cache(HttpResponse::Ok().json(keys), "no-cache"))
}

#[utoipa::path(get, path = "/v1/checkpoint", tag = "evidence",
    responses(
        (status = 200, description = "The newest checkpoint of the receipt log: a C2SP tlog-checkpoint signed note (origin, size, base64 root hash; a blank line; signature lines)", body = String, content_type = "text/plain"),
        (status = 404, description = "No checkpoint signed yet (`not-logged-yet`; the service signs none without a key)", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The database could not answer, or the synchronous standby has not confirmed the checkpoint within the deadline (a checkpoint is handed out only once a failover would keep it)", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn checkpoint(req: HttpRequest, state: web::Data<AppState>) -> HttpResponse {
    // Public and polled: callers that arrive together share one read.
    state
        .checkpoint_answer
        .answer(async {
            newest_checkpoint(&req, &state)
                .await
                .unwrap_or_else(|e| actix_web::ResponseError::error_response(&e))
        })
        .await
}

async fn newest_checkpoint(req: &HttpRequest, state: &AppState) -> Result<HttpResponse, ApiError> {
    let deadline = super::deadline::of(req, state);
    let note = state
        .blocking(deadline, move |intake| intake.checkpoint(&deadline))
        .await?
        .ok_or(ApiError::NotLoggedYet(
            "the receipt log has no checkpoint yet",
        ))?;
    Ok(HttpResponse::Ok().content_type(TEXT).body(note))
}

#[derive(serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct ConsistencyQuery {
    /// The smaller tree's size (at least 1)
    old: u64,
    /// The larger tree's size, at most the newest checkpoint's
    new: u64,
}

#[utoipa::path(get, path = "/v1/checkpoint/consistency", tag = "evidence",
    params(ConsistencyQuery),
    responses(
        (status = 200, description = "The RFC 6962 consistency proof from the tree of `old` leaves to the tree of `new`: one base64 hash a line", body = String, content_type = "text/plain"),
        (status = 400, description = "`old` or `new` missing, not a number, `old` of 0 or above `new`, or `new` past the newest checkpoint", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The database could not answer, or (`busy`, with `Retry-After`) a caller that is not a familiar login found this second's public reads spent", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn consistency(
    req: HttpRequest,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let query = super::query_of::<ConsistencyQuery>(&req)?;
    admit_public_read(&req, &state)?;
    let deadline = super::deadline::of(&req, &state);
    let (old, new) = (query.old, query.new);
    let proof = state
        .blocking(deadline, move |intake| {
            intake.consistency_proof(old, new, &deadline)
        })
        .await?
        .ok_or_else(|| {
            ApiError::BadQuery(format!(
                "no consistency proof from {old} to {new} leaves: 0 < old <= new <= the newest checkpoint's size"
            ))
        })?;
    Ok(HttpResponse::Ok().content_type(TEXT).body(proof))
}

#[derive(serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct ExtensionQuery {
    /// The size of the tree the reader verified up to (0 from the start)
    size: u64,
    /// The size of the last checkpoint the reader saved, if any
    since: Option<u64>,
    /// Seconds to wait for a checkpoint that holds `size` leaves (0-60,
    /// default 0); the log takes a round for the asker at once
    #[param(value_type = Option<u32>, minimum = 0, maximum = 60)]
    wait: Option<String>,
}

#[utoipa::path(get, path = "/v1/checkpoint/extension", tag = "evidence",
    params(ExtensionQuery),
    responses(
        (status = 200, description = "The newest checkpoint and the RFC 6962 consistency proofs to it from the tree of `size` leaves and from that of `since` leaves, in one answer: what a verifying follower asks once per page (`plan-intake follow --verify`)", body = crate::intake::receipt_log::CheckpointExtension),
        (status = 400, description = "`size` missing or not a number, a wait outside 0-60, or an unknown parameter", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No checkpoint holds `size` leaves yet, after `wait` (`not-logged-yet`, with `Retry-After`); a service that signs nothing answers at once", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The newest checkpoint holds fewer leaves than `since` (`log-rolled-back`): a checkpoint signed before held more, so the log was rolled back (a restore, or a failover that lost commits); no wait mends it", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The database could not answer, or the synchronous standby has not confirmed the checkpoint within the deadline, or (`busy`, with `Retry-After`) a caller that is not a familiar login found this second's public reads spent", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn extension(
    req: HttpRequest,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let query = super::query_of::<ExtensionQuery>(&req)?;
    let wait =
        crate::intake::feed::parse_wait(query.wait.as_deref()).map_err(ApiError::BadQuery)?;
    let familiar = familiar_caller(&req, &state);
    if !familiar {
        take_public_read(&state)?;
    }
    let deadline = super::deadline::of(&req, &state);
    let peer = req.peer_addr().map(|address| address.ip());
    let caller = Caller { peer, familiar };
    let extension = extension_or_wait(&state, caller, query.size, query.since, wait, deadline)
        .await?
        .ok_or(ApiError::NotLoggedYet(
            "no checkpoint holds that many leaves yet; the log takes a few seconds",
        ))?;
    Ok(HttpResponse::Ok().json(extension))
}

/// The extension, once a checkpoint holds `size` leaves; with none yet,
/// asks this instance's appender for a round and waits up to `wait`,
/// holding no connection. A waiter asks for one round, then costs no
/// read of its own until the log moves: it is woken when this instance
/// signs, and otherwise looks at the newest checkpoint's size that one
/// read shared by every waiter keeps (`NewestCheckpoint`, at most one read
/// per `RECHECK`); only once that holds `size` leaves does it read its
/// proofs. Waiters are bounded in
/// number and per address (`ExtensionWaiters`); one past them is answered
/// at once, as if its wait were 0.
/// Who waits: its address (for the waiters' bounds) and whether its reads
/// are counted among the public ones.
struct Caller {
    peer: Option<std::net::IpAddr>,
    familiar: bool,
}

async fn extension_or_wait(
    state: &AppState,
    caller: Caller,
    size: u64,
    since: Option<u64>,
    wait: std::time::Duration,
    deadline: crate::deadline::Deadline,
) -> Result<Option<crate::intake::receipt_log::CheckpointExtension>, ApiError> {
    const RECHECK: std::time::Duration = std::time::Duration::from_millis(250);
    let until = std::time::Instant::now() + wait;
    let mut signed = state.intake.log_rounds().subscribe();
    let mut stopping = state.stopping();
    let read = |deadline: crate::deadline::Deadline| {
        state.blocking(deadline, move |intake| {
            intake.checkpoint_extension(size, since, &deadline)
        })
    };
    signed.borrow_and_update();
    let found = read(deadline).await?;
    // A service that signs nothing appends nothing for the asker.
    let signs = state.intake.signing_key().is_some();
    if found.is_some() || wait.is_zero() || !signs {
        return Ok(found);
    }
    let Some(_waiter) = state.extension_waiters.enter(caller.peer) else {
        return Ok(None);
    };
    // One round asked for, now: the appender then runs at its own pace.
    state.intake.log_rounds().want();
    loop {
        let left = until.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() || *stopping.borrow_and_update() {
            return Ok(None);
        }
        let woken = async {
            tokio::select! {
                _ = signed.changed() => {}
                _ = stopping.changed() => {}
            }
        };
        let _ = actix_web::rt::time::timeout(left.min(RECHECK), woken).await;
        let deadline = crate::deadline::Deadline::after(state.http.request_timeout);
        let here = *signed.borrow_and_update();
        let newest = if here >= size {
            here
        } else {
            state
                .newest_checkpoint
                .size(state, RECHECK, deadline)
                .await?
        };
        // (No checkpoint reads as 0: a reader of `size=0` waits for one.)
        if newest >= size.max(1) {
            // Woken with the others: its proofs are a read of its own,
            // counted as its first was.
            if !caller.familiar {
                take_public_read(state)?;
            }
            return read(deadline).await;
        }
    }
}

/// The newest checkpoint's size as last read, shared by every waiting
/// reader: whoever finds it older than asked reads it again for all.
#[derive(Default)]
pub struct NewestCheckpoint {
    read: tokio::sync::Mutex<Option<(std::time::Instant, u64)>>,
}

impl NewestCheckpoint {
    async fn size(
        &self,
        state: &AppState,
        fresh_for: std::time::Duration,
        deadline: crate::deadline::Deadline,
    ) -> Result<u64, ApiError> {
        let mut read = self.read.lock().await;
        if let Some((at, size)) = *read
            && at.elapsed() < fresh_for
        {
            return Ok(size);
        }
        let size = state
            .blocking(deadline, move |intake| {
                intake.newest_checkpoint_size(&deadline)
            })
            .await?;
        *read = Some((std::time::Instant::now(), size));
        Ok(size)
    }
}

/// How many readers may wait for a checkpoint at once, in all and from one
/// address: the evidence is public, so its waiting is bounded like the
/// door's strangers.
pub struct ExtensionWaiters {
    counts: std::sync::Mutex<(usize, std::collections::HashMap<std::net::IpAddr, usize>)>,
    gauge: prometheus::IntGauge,
}

impl ExtensionWaiters {
    pub const MAX: usize = 512;
    pub const MAX_PER_ADDRESS: usize = 32;

    pub fn new(gauge: prometheus::IntGauge) -> Self {
        Self {
            counts: std::sync::Mutex::new((0, std::collections::HashMap::new())),
            gauge,
        }
    }

    fn counts(
        &self,
    ) -> std::sync::MutexGuard<'_, (usize, std::collections::HashMap<std::net::IpAddr, usize>)>
    {
        self.counts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A place to wait, given back when dropped; `None` past the bounds.
    fn enter(&self, peer: Option<std::net::IpAddr>) -> Option<Waiting<'_>> {
        let mut counts = self.counts();
        let (all, by_address) = &mut *counts;
        if *all >= Self::MAX {
            return None;
        }
        if let Some(peer) = peer {
            let mine = by_address.entry(peer).or_default();
            if *mine >= Self::MAX_PER_ADDRESS {
                return None;
            }
            *mine += 1;
        }
        *all += 1;
        self.gauge.inc();
        Some(Waiting {
            waiters: self,
            peer,
        })
    }
}

struct Waiting<'a> {
    waiters: &'a ExtensionWaiters,
    peer: Option<std::net::IpAddr>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut counts = self.waiters.counts();
        let (all, by_address) = &mut *counts;
        *all = all.saturating_sub(1);
        self.waiters.gauge.dec();
        if let Some(peer) = self.peer
            && let Some(mine) = by_address.get_mut(&peer)
        {
            *mine = mine.saturating_sub(1);
            if *mine == 0 {
                by_address.remove(&peer);
            }
        }
    }
}

/// `GET /v1/checkpoint/start?size=N`.
#[derive(serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct StartQuery {
    /// The size of the checkpoint the reader trusts
    size: u64,
}

#[utoipa::path(get, path = "/v1/checkpoint/start", tag = "evidence",
    params(StartQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Where a verifying follower starts at a checkpoint of `size` leaves it trusts (`follow --verify --from-checkpoint FILE`, or the first checkpoint it sees): the roots of that tree's perfect subtrees, which hash to the checkpoint's root, and the feed cursor after its last leaf (a feed cursor: for the feed's readers, `receipts:read`)", body = crate::intake::receipt_log::CheckpointStart),
        (status = 400, description = "`size` missing or not a number, or an unknown parameter", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No valid token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "A login without `receipts:read`", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No checkpoint holds `size` leaves yet (`not-logged-yet`, with `Retry-After`)", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The database could not answer, or the synchronous standby has not confirmed the checkpoint within the deadline", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn start(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    // Its `after` is a feed cursor (it places a reader in the feed): for
    // the feed's readers only, as the feed itself is.
    let login = super::auth::authenticate(&req, &state).await?;
    super::auth::require(&login, crate::intake::Permission::ReceiptsRead)?;
    let query = super::query_of::<StartQuery>(&req)?;
    let deadline = super::deadline::of(&req, &state);
    let size = query.size;
    let start = state
        .blocking(deadline, move |intake| {
            intake.checkpoint_start(size, &deadline)
        })
        .await?
        .ok_or(ApiError::NotLoggedYet(
            "no checkpoint holds that many leaves yet; the log takes a few seconds",
        ))?;
    Ok(HttpResponse::Ok().json(start))
}

#[utoipa::path(get, path = "/v1/log/checkpoint", tag = "evidence",
    responses(
        (status = 200, description = "The newest checkpoint, as C2SP tlog-tiles serves it (the same note as `GET /v1/checkpoint`)", body = String, content_type = "text/plain"),
        (status = 404, description = "No checkpoint signed yet (`not-logged-yet`)", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The database could not answer, or the synchronous standby has not confirmed the checkpoint", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn log_checkpoint(req: HttpRequest, state: web::Data<AppState>) -> HttpResponse {
    let answer = checkpoint(req, state).await;
    if answer.status().is_success() {
        with_cache(answer, "no-cache")
    } else {
        answer
    }
}

#[utoipa::path(get, path = "/v1/log/tile/{tile}", tag = "evidence",
    params(("tile" = String, Path, description = "C2SP tlog-tiles: `<L>/<N>[.p/<W>]` (a hash tile of level L, height 8: public) or `entries/<N>[.p/<W>]` (an entry bundle: each leaf, a receipt's signed form, after its length as 16 big-endian bits; the receipts themselves, so only for a login that may read every receipt, `receipts:read`); N in groups of three digits, all but the last prefixed with `x`. One spelling per tile, as C2SP writes it, and no query string: anything else is refused")),
    security((), ("bearer" = [])),
    responses(
        (status = 200, description = "The tile at the newest checkpoint; a full tile never changes (cached for a year, immutable, and kept in memory by the service)", body = Vec<u8>, content_type = "application/octet-stream"),
        (status = 400, description = "A query string: a tile has one URL (`invalid-query`)", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "An entry bundle asked without a valid token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "An entry bundle asked by a login without `receipts:read`", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such tile in the layout, or not spelled as C2SP spells it (`not-found`), or no signed checkpoint holds it yet (`not-logged-yet`, with `Retry-After`)", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The database could not answer, or the synchronous standby has not confirmed the checkpoint, or (`busy`, with `Retry-After`) a caller that is not a familiar login found this second's public reads spent", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn log_tile(
    req: HttpRequest,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    // One URL per tile, so a cache in front keeps one copy: the path as
    // sent (not percent-decoded) must be the tile's C2SP spelling.
    if !req.query_string().is_empty() {
        return Err(ApiError::BadQuery(
            "a tile takes no query string: each tile has one URL".to_owned(),
        ));
    }
    let sent = req
        .uri()
        .path()
        .strip_prefix("/v1/log/")
        .ok_or(ApiError::NotFound)?;
    let tile = crate::intake::receipt_log::TileRequest::parse(sent).ok_or(ApiError::NotFound)?;
    // Entry bundles are the receipts: held to the receipts' own rule for
    // what crosses makers, a login that may read every receipt. Hash tiles
    // (and checkpoints) reveal nothing and stay public.
    if matches!(
        tile,
        crate::intake::receipt_log::TileRequest::Entries { .. }
    ) {
        let login = super::auth::authenticate(&req, &state).await?;
        super::auth::require(&login, crate::intake::Permission::ReceiptsRead)?;
    }
    let answer = |data: actix_web::web::Bytes| {
        let answer = HttpResponse::Ok()
            .content_type("application/octet-stream")
            .body(data);
        // An entry bundle answers a login: a shared cache must not hand it
        // to the next caller, so it is private to the asker's own cache.
        let entries = matches!(
            tile,
            crate::intake::receipt_log::TileRequest::Entries { .. }
        );
        with_cache(
            answer,
            match (tile.is_full(), entries) {
                (true, false) => "public, max-age=31536000, immutable",
                (true, true) => "private, max-age=31536000, immutable",
                (false, _) => "no-cache",
            },
        )
    };
    if tile.is_full()
        && let Some(data) = state.full_tiles.get(&tile.path())
    {
        // Kept from a tree the log may no longer reach (a database
        // restored under this instance): only while the newest checkpoint
        // still holds it (one read shared with the waiting readers).
        let deadline = super::deadline::of(&req, &state);
        let newest = state
            .newest_checkpoint
            .size(&state, std::time::Duration::from_millis(250), deadline)
            .await?;
        if newest >= tile.end() {
            return Ok(answer(data));
        }
    }
    admit_public_read(&req, &state)?;
    let deadline = super::deadline::of(&req, &state);
    let data = state
        .blocking(deadline, move |intake| intake.log_tile(tile, &deadline))
        .await?
        .ok_or(ApiError::NotLoggedYet(
            "no signed checkpoint holds that tile yet",
        ))?;
    let data = actix_web::web::Bytes::from(data);
    if tile.is_full() {
        state.full_tiles.keep(tile.path(), data.clone());
    }
    Ok(answer(data))
}

/// Reads of the database the public evidence routes may make a second for
/// callers that are not familiar logins (monitors, witnesses, strangers):
/// the evidence is public, so its cost is bounded as the door bounds
/// strangers' token lookups. Past it, 503 `busy` with `Retry-After`,
/// before any connection is taken. Answers from memory (shared
/// checkpoints, kept full tiles) cost none.
pub struct PublicReads(crate::intake::login::TokenBucket);

impl PublicReads {
    pub const PER_SECOND: f64 = 200.0;

    fn try_take(&self) -> bool {
        self.0.try_take()
    }
}

impl Default for PublicReads {
    fn default() -> Self {
        Self(crate::intake::login::TokenBucket::new(Self::PER_SECOND))
    }
}

/// A database read for a public evidence answer: free for a familiar
/// login's token (a reader or planner the service knows), else taken from
/// [`PublicReads`].
fn admit_public_read(req: &HttpRequest, state: &AppState) -> Result<(), ApiError> {
    if familiar_caller(req, state) {
        return Ok(());
    }
    take_public_read(state)
}

/// Whether the caller's token is one this instance has seen lately (a
/// login's): its public reads are not counted.
fn familiar_caller(req: &HttpRequest, state: &AppState) -> bool {
    super::auth::bearer_token(req.headers()).is_ok_and(|token| state.intake.familiar(token))
}

fn take_public_read(state: &AppState) -> Result<(), ApiError> {
    if state.public_reads.try_take() {
        Ok(())
    } else {
        state.intake.metrics.public_read_refused();
        Err(ApiError::PublicReadsSpent)
    }
}

/// Full tiles, kept in memory once read: a full tile never changes, and an
/// entry bundle costs 256 rows and as many receipts made again. Bounded in
/// bytes; the oldest kept goes first.
pub struct FullTiles {
    kept: std::sync::Mutex<FullTilesInner>,
}

#[derive(Default)]
struct FullTilesInner {
    by_path: std::collections::HashMap<String, actix_web::web::Bytes>,
    order: std::collections::VecDeque<String>,
    bytes: usize,
}

impl FullTiles {
    /// At most this many bytes of tiles are kept.
    pub const MAX_BYTES: usize = 64 * 1024 * 1024;

    pub fn new() -> Self {
        Self {
            kept: std::sync::Mutex::new(FullTilesInner::default()),
        }
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, FullTilesInner> {
        self.kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn get(&self, path: &str) -> Option<actix_web::web::Bytes> {
        self.inner().by_path.get(path).cloned()
    }

    pub fn keep(&self, path: String, data: actix_web::web::Bytes) {
        let mut inner = self.inner();
        if data.len() > Self::MAX_BYTES || inner.by_path.contains_key(&path) {
            return;
        }
        while inner.bytes + data.len() > Self::MAX_BYTES {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            if let Some(gone) = inner.by_path.remove(&oldest) {
                inner.bytes -= gone.len();
            }
        }
        inner.bytes += data.len();
        inner.order.push_back(path.clone());
        inner.by_path.insert(path, data);
    }
}

impl Default for FullTiles {
    fn default() -> Self {
        Self::new()
    }
}

fn with_cache(mut answer: HttpResponse, rule: &'static str) -> HttpResponse {
    answer.headers_mut().insert(
        actix_web::http::header::CACHE_CONTROL,
        actix_web::http::header::HeaderValue::from_static(rule),
    );
    answer
}

#[utoipa::path(get, path = "/v1/receipts/{receipt_id}/proof", tag = "evidence",
    params(("receipt_id" = String, Path, description = "The receipt id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The receipt's inclusion in the newest checkpoint, as C2SP tlog-proof text (`c2sp.org/tlog-proof@v1`, `index N`, the proof's base64 hashes, a blank line, the checkpoint). The leaf is the receipt's RFC 8785 form without `signature` and `outcome`", body = String, content_type = "text/plain"),
        (status = 404, description = "No such receipt visible to this login (`not-found`), or not under a signed checkpoint yet (`not-logged-yet`, with `Retry-After`)", body = Problem, content_type = "application/problem+json"),
        NotYours, Refusals,
    ))]
pub async fn receipt_proof(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let proof = super::reads::readable(
        &req,
        &state,
        path.into_inner(),
        |intake, login, id, deadline| intake.receipt_proof(login, id, deadline),
    )
    .await?
    .ok_or(ApiError::NotLoggedYet(
        "the receipt is not under a signed checkpoint yet; the log takes a few seconds",
    ))?;
    Ok(HttpResponse::Ok().content_type(TEXT).body(proof))
}
