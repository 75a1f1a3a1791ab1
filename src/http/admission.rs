//! Who may start a request now: each login's share of the requests in
//! flight (429 past it), and the bytes of request bodies held at once (a
//! short wait, then 503 past it). Both are answered before a body is read,
//! so neither a flooding planner nor a crowd of large bodies can take the
//! pool, the memory or the workers from everyone else.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The limits and what is in flight against them; one per service, shared
/// by every worker.
pub struct Admission {
    per_login: Mutex<HashMap<String, usize>>,
    max_per_login: usize,
    body_bytes: Arc<Semaphore>,
    max_body_bytes: usize,
    /// Large bodies parsed at once: see [`large_parses_at_once`].
    large_parses: Arc<Semaphore>,
}

/// One per CPU but one, at least one: parsing is CPU-bound, so more at once
/// gains nothing but memory (each holds its body, its canonical text and
/// the row being written: a few times its size); and one CPU stays free
/// for the async workers, so `/healthz` and small requests are answered
/// meanwhile.
pub fn large_parses_at_once() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1))
}

/// Bodies up to this size are parsed without waiting for a turn: they
/// cost little CPU and memory.
pub const LARGE_BODY: usize = 64 * 1024;

/// A turn to parse and write one large body, held until dropped.
pub struct LargeParse(#[allow(dead_code)] OwnedSemaphorePermit); // ok: held, never read

/// One request of a login, in flight until dropped.
pub struct LoginSlot {
    admission: Arc<Admission>,
    login: String,
}

/// Bytes of one request's body, held until dropped.
pub struct BodyBytes(#[allow(dead_code)] OwnedSemaphorePermit); // ok: held, never read

/// What an expanded read holds for `bytes` of plans in `rows` rows: the rows
/// read and the page written from them, each about the plans' size, and a
/// receipt's worth per row.
pub fn read_room(bytes: u64, rows: i64) -> usize {
    let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
    let rows = usize::try_from(rows).unwrap_or(0);
    bytes
        .saturating_mul(2)
        .saturating_add(rows.saturating_mul(1024))
}

/// A response body that keeps its room among the bytes in flight until it
/// has been handed to the connection (or dropped with it).
pub struct HeldBody {
    bytes: actix_web::web::Bytes,
    _room: BodyBytes,
}

impl HeldBody {
    pub fn new(bytes: Vec<u8>, room: BodyBytes) -> Self {
        Self {
            bytes: bytes.into(),
            _room: room,
        }
    }
}

impl actix_web::body::MessageBody for HeldBody {
    type Error = std::convert::Infallible;

    fn size(&self) -> actix_web::body::BodySize {
        actix_web::body::BodySize::Sized(self.bytes.len() as u64)
    }

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<actix_web::web::Bytes, Self::Error>>> {
        let this = self.get_mut();
        std::task::Poll::Ready(
            (!this.bytes.is_empty()).then(|| Ok(std::mem::take(&mut this.bytes))),
        )
    }
}

impl Admission {
    pub fn new(max_per_login: usize, max_body_bytes: usize) -> Arc<Self> {
        Arc::new(Self {
            per_login: Mutex::default(),
            max_per_login,
            body_bytes: Arc::new(Semaphore::new(max_body_bytes.min(Semaphore::MAX_PERMITS))),
            max_body_bytes,
            large_parses: Arc::new(Semaphore::new(large_parses_at_once())),
        })
    }

    /// A turn to parse a body of `bytes` (none needed for a small one),
    /// waiting at most `patience`; `Err` when no turn came in time.
    pub async fn parse_turn(
        &self,
        bytes: usize,
        patience: Duration,
    ) -> Result<Option<LargeParse>, ()> {
        if bytes <= LARGE_BODY {
            return Ok(None);
        }
        let acquire = Arc::clone(&self.large_parses).acquire_owned();
        match actix_web::rt::time::timeout(patience, acquire).await {
            Ok(Ok(permit)) => Ok(Some(LargeParse(permit))),
            _ => Err(()),
        }
    }

    fn counts(&self) -> MutexGuard<'_, HashMap<String, usize>> {
        self.per_login
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot for one more request of `login`, or `None` when it already
    /// has its share in flight.
    pub fn enter(self: &Arc<Self>, login: &str) -> Option<LoginSlot> {
        let mut counts = self.counts();
        let count = counts.entry(login.to_owned()).or_insert(0);
        if *count >= self.max_per_login {
            return None;
        }
        *count += 1;
        Some(LoginSlot {
            admission: Arc::clone(self),
            login: login.to_owned(),
        })
    }

    /// Room for a body of `bytes`, waiting at most `patience` for other
    /// bodies to be done with; `None` when there is none by then.
    pub async fn reserve_body(&self, bytes: usize, patience: Duration) -> Option<BodyBytes> {
        let wanted = u32::try_from(bytes.clamp(1, self.max_body_bytes)).unwrap_or(u32::MAX);
        let acquire = Arc::clone(&self.body_bytes).acquire_many_owned(wanted);
        match actix_web::rt::time::timeout(patience, acquire).await {
            Ok(Ok(permit)) => Some(BodyBytes(permit)),
            _ => None,
        }
    }
}

impl Drop for LoginSlot {
    fn drop(&mut self) {
        let mut counts = self.admission.counts();
        if let Some(count) = counts.get_mut(&self.login) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.login);
            }
        }
    }
}
