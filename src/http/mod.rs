//! The HTTP door: routes, bearer-token sign-in and `Idempotency-Key`
//! parsing (`auth`, `plans`), problem+json errors, request logging and the
//! OpenAPI document. Handlers
//! translate HTTP to a domain call and back; every blocking database call
//! runs inside `web::block` (a submission's first write is awaited on the
//! writers' queue instead).

mod admission;
mod auth;
mod deadline;
pub mod evidence;
mod expect;
mod feed;
pub mod observe;
pub mod openapi;
pub mod own_answers;
mod plans;
pub mod problem;
mod reads;

use actix_web::body::BoxBody;
use actix_web::dev::{ServiceFactory, ServiceRequest, ServiceResponse};
use actix_web::middleware::from_fn;
use actix_web::{App, HttpResponse, web};

use crate::config::HttpConfig;
use crate::deadline::Deadline;
use crate::intake::Intake;
pub use problem::ApiError;

/// What every handler shares. Cloned per worker; holds no request state
/// but the admission counts, which every worker shares.
#[derive(Clone)]
pub struct AppState {
    pub intake: Intake,
    pub http: HttpConfig,
    admission: std::sync::Arc<admission::Admission>,
    /// True once the service stops: long polls answer at once.
    stopping: std::sync::Arc<tokio::sync::watch::Sender<bool>>,
    /// Full tiles of the receipt log, kept once read.
    pub(crate) full_tiles: std::sync::Arc<evidence::FullTiles>,
    /// The newest checkpoint's size, one read shared by waiting readers.
    pub(crate) newest_checkpoint: std::sync::Arc<evidence::NewestCheckpoint>,
    /// Readers waiting for a checkpoint, bounded.
    pub(crate) extension_waiters: std::sync::Arc<evidence::ExtensionWaiters>,
    /// The last reason `/readyz` logged for not being ready.
    not_ready_told: std::sync::Arc<std::sync::Mutex<String>>,
    /// `/readyz` as told to callers without a login, shared.
    strangers_readiness: std::sync::Arc<SharedAnswer>,
    /// `GET /v1/checkpoint`, shared.
    pub(crate) checkpoint_answer: std::sync::Arc<SharedAnswer>,
    /// The public evidence routes' reads a second for unfamiliar callers.
    pub(crate) public_reads: std::sync::Arc<evidence::PublicReads>,
}

/// An answer that costs the database a read, shared by callers so that a
/// flood of public requests costs it few reads: at most one caller
/// computes it at a time, and a caller takes an answer whose computation
/// began after it arrived (so it is never older than the caller's own
/// read would have been), or, in a crowd (more than `quiet_per_second`
/// callers this second), one begun within `fresh_for`. With `fresh_for`
/// zero it only joins callers that arrive together. A timed-out or unreadable answer is handed to its own caller
/// alone, never kept.
pub(crate) struct SharedAnswer {
    fresh_for: std::time::Duration,
    quiet_per_second: u32,
    /// Callers in the current second: its start, and how many.
    callers: std::sync::Mutex<(std::time::Instant, u32)>,
    last: tokio::sync::Mutex<Option<KeptAnswer>>,
}

struct KeptAnswer {
    /// When its computation began.
    began: std::time::Instant,
    status: actix_web::http::StatusCode,
    headers: actix_web::http::header::HeaderMap,
    body: actix_web::web::Bytes,
}

impl KeptAnswer {
    fn response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status).body(self.body.clone());
        let headers = response.headers_mut();
        headers.clear();
        for (name, value) in &self.headers {
            headers.append(name.clone(), value.clone());
        }
        response
    }
}

impl SharedAnswer {
    pub(crate) fn new(fresh_for: std::time::Duration, quiet_per_second: u32) -> Self {
        Self {
            fresh_for,
            quiet_per_second,
            callers: std::sync::Mutex::new((std::time::Instant::now(), 0)),
            last: tokio::sync::Mutex::new(None),
        }
    }

    /// Whether more callers than a quiet second holds came this second.
    fn crowded(&self) -> bool {
        let mut callers = self
            .callers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (since, count) = &mut *callers;
        if since.elapsed() >= std::time::Duration::from_secs(1) {
            *since = std::time::Instant::now();
            *count = 0;
        }
        *count = count.saturating_add(1);
        *count > self.quiet_per_second
    }

    pub(crate) async fn answer<F>(&self, make: F) -> HttpResponse
    where
        F: std::future::Future<Output = HttpResponse>,
    {
        let arrived = std::time::Instant::now();
        let crowded = self.crowded();
        let mut last = self.last.lock().await;
        if let Some(kept) = last.as_ref() {
            let joined = kept.began >= arrived;
            let fresh = crowded && kept.began.elapsed() < self.fresh_for;
            if joined || fresh {
                return kept.response();
            }
        }
        let began = std::time::Instant::now();
        let response = make.await;
        if response.extensions().get::<problem::TimedOut>().is_some() {
            return response;
        }
        let status = response.status();
        let headers = response.headers().clone();
        let Ok(body) = actix_web::body::to_bytes(response.into_body()).await else {
            return HttpResponse::InternalServerError().finish();
        };
        let kept = KeptAnswer {
            began,
            status,
            headers,
            body,
        };
        let answer = kept.response();
        *last = Some(kept);
        answer
    }
}

impl AppState {
    pub fn new(intake: Intake, http: HttpConfig) -> Self {
        let checkpoint_waiting = intake.metrics.checkpoint_waiting();
        let admission =
            admission::Admission::new(http.max_inflight_per_login, http.max_body_bytes_in_flight);
        Self {
            intake,
            http,
            admission,
            stopping: std::sync::Arc::new(tokio::sync::watch::Sender::new(false)),
            full_tiles: std::sync::Arc::new(evidence::FullTiles::new()),
            newest_checkpoint: std::sync::Arc::default(),
            extension_waiters: std::sync::Arc::new(evidence::ExtensionWaiters::new(
                checkpoint_waiting,
            )),
            not_ready_told: std::sync::Arc::default(),
            // A few load balancers polling each get a fresh verdict; past
            // 10 callers a second they share one, at most a second old.
            strangers_readiness: std::sync::Arc::new(SharedAnswer::new(
                std::time::Duration::from_secs(1),
                10,
            )),
            // Never older than the caller's own read would be: a reader
            // that verified a newer checkpoint must not be shown an older
            // one (it would take the log for rolled back). Callers that
            // arrive together share one read.
            checkpoint_answer: std::sync::Arc::new(SharedAnswer::new(std::time::Duration::ZERO, 0)),
            public_reads: std::sync::Arc::default(),
        }
    }

    /// The service stops: every waiting long poll is answered now (the page
    /// so far: an empty one with the reader's own cursor), so a graceful
    /// stop waits only for requests that do work.
    pub fn begin_stop(&self) {
        self.stopping.send_replace(true);
    }

    /// Says at WARN why the service is not ready, once per reason (and at
    /// INFO when it is ready again: `reason` empty), so that `/readyz`
    /// polled every second does not fill the log.
    pub(crate) fn tell_not_ready(&self, reason: &str) {
        let mut told = self
            .not_ready_told
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if *told == reason {
            return;
        }
        if reason.is_empty() {
            tracing::info!("ready again");
        } else {
            tracing::warn!(reason, "not ready");
        }
        reason.clone_into(&mut told);
    }

    /// Changes to true when the service stops.
    pub(crate) fn stopping(&self) -> tokio::sync::watch::Receiver<bool> {
        self.stopping.subscribe()
    }

    /// Runs blocking database work off the async workers (a pool checkout
    /// that waits pins only a blocking thread) and answers 503 at the
    /// deadline if the work has not. Work still running then goes on until
    /// its own database timeouts end it, and starts no new write.
    pub(crate) async fn blocking<T, E, F>(&self, deadline: Deadline, work: F) -> Result<T, ApiError>
    where
        F: FnOnce(&Intake) -> Result<T, E> + Send + 'static,
        T: Send + 'static,
        E: Into<ApiError> + Send + 'static,
    {
        let intake = self.intake.clone();
        let work = web::block(move || work(&intake));
        match actix_web::rt::time::timeout(deadline.remaining(), work).await {
            Ok(Ok(result)) => result.map_err(Into::into),
            Ok(Err(e)) => Err(ApiError::Internal(Box::new(e))),
            Err(_elapsed) => Err(ApiError::Timeout(
                "the database work had not answered".into(),
            )),
        }
    }
}

impl AppState {
    /// Room among the bytes in flight for an expanded read of `bytes` of
    /// plans in `rows` rows, waiting as a body would; 503 without it.
    pub(crate) async fn room_to_read(
        &self,
        bytes: u64,
        rows: i64,
        deadline: &Deadline,
    ) -> Result<admission::BodyBytes, ApiError> {
        self.admission
            .reserve_body(
                admission::read_room(bytes, rows),
                crate::config::BODY_BYTES_PATIENCE.min(deadline.remaining()),
            )
            .await
            .ok_or(ApiError::BodiesInFlight)
    }
}

/// A 200 with `value` as JSON whose body keeps `room` until it is sent.
/// The request's query string as `T`, or a 400 naming what is wrong.
pub(crate) fn query_of<T: serde::de::DeserializeOwned>(
    req: &actix_web::HttpRequest,
) -> Result<T, ApiError> {
    web::Query::<T>::from_query(req.query_string())
        .map(web::Query::into_inner)
        .map_err(|e| ApiError::BadQuery(format!("invalid query string: {e}")))
}

pub(crate) fn held_json<T: serde::Serialize>(
    value: &T,
    room: admission::BodyBytes,
) -> Result<HttpResponse, ApiError> {
    let body = serde_json::to_vec(value).map_err(|e| ApiError::Internal(Box::new(e)))?;
    Ok(HttpResponse::Ok()
        .content_type("application/json")
        .body(admission::HeldBody::new(body, room)))
}

/// The whole application: every route, wrapped in request logging. The
/// service and the tests both build it here.
pub fn app(
    state: AppState,
) -> App<
    impl ServiceFactory<
        ServiceRequest,
        Config = (),
        Response = ServiceResponse<BoxBody>,
        Error = actix_web::Error,
        InitError = (),
    >,
> {
    App::new()
        .wrap(from_fn(deadline::enforce))
        .wrap(from_fn(observe::observe))
        .configure(configure(state))
}

/// actix's handler of `Expect: 100-continue` for the service (`serve`): a
/// submission is told to send its body only once it would be read
/// (`expect`). `config` is the one the routes run with.
pub fn expect_continue(
    state: AppState,
    config: actix_web::dev::AppConfig,
) -> impl ServiceFactory<
    actix_http::Request,
    Config = (),
    Response = actix_http::Request,
    Error = actix_http::Response<BoxBody>,
    InitError = (),
> {
    use actix_service::IntoServiceFactory;
    expect::ExpectContinue::new(state.clone(), app(state).into_factory(), config)
}

fn configure(state: AppState) -> impl FnOnce(&mut web::ServiceConfig) {
    move |cfg| {
        cfg.app_data(web::Data::new(state))
            .service(resource(plans::PATH, "POST").route(web::post().to(plans::submit_plan)))
            .service(readable("/v1/plans/{receipt_id}", reads::get_plan))
            .service(readable("/v1/receipts", feed::list_receipts))
            .service(readable("/v1/receipts/{receipt_id}", reads::get_receipt))
            .service(readable(
                "/v1/receipts/{receipt_id}/proof",
                evidence::receipt_proof,
            ))
            .service(readable("/v1/signing-keys", evidence::signing_keys))
            .service(readable("/v1/checkpoint", evidence::checkpoint))
            .service(readable(
                "/v1/checkpoint/consistency",
                evidence::consistency,
            ))
            .service(readable("/v1/checkpoint/extension", evidence::extension))
            .service(readable("/v1/checkpoint/start", evidence::start))
            .service(readable("/v1/log/checkpoint", evidence::log_checkpoint))
            .service(readable("/v1/log/tile/{tile:.+}", evidence::log_tile))
            .service(readable("/healthz", healthz))
            .service(readable("/readyz", readyz))
            .service(readable("/metrics", metrics))
            .service(readable("/openapi.json", openapi::document))
            .default_service(web::to(not_found));
    }
}

/// A known path: any method it does not serve is a 405 naming the ones it
/// does (`Allow`), not a 404.
fn resource(path: &str, allow: &'static str) -> actix_web::Resource {
    web::resource(path).default_service(web::to(move || async move {
        Err::<HttpResponse, _>(ApiError::MethodNotAllowed(allow))
    }))
}

/// A path read with GET, and HEAD wherever GET is served (load balancers
/// probe with HEAD; actix sends the head of the GET answer, no body).
fn readable<F, Args>(path: &str, handler: F) -> actix_web::Resource
where
    F: actix_web::Handler<Args>,
    Args: actix_web::FromRequest + 'static,
    F::Output: actix_web::Responder + 'static,
{
    use actix_web::guard;
    resource(path, "GET, HEAD").route(
        web::route()
            .guard(guard::Any(guard::Get()).or(guard::Head()))
            .to(handler),
    )
}

#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct Health {
    /// `ok`
    status: &'static str,
}

/// The process is alive.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "The process is alive", body = Health)))]
pub async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(Health { status: "ok" })
}

/// `/readyz`: ready, and whether an acknowledged plan survives a failover.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct Ready {
    /// `ready`
    status: &'static str,
    /// Every acknowledged commit is on a synchronous standby too (always
    /// false on SQLite, which has none)
    commit_waits_for_standby: bool,
    /// Commits wait for a synchronous standby and none is attached: no
    /// write can complete now (answered 503, so a load balancer sees it)
    commits_blocked: bool,
    /// New receipts carry a signature and join the receipt log; false: the
    /// service was started without `--signing-key` and signs nothing
    receipts_signed: bool,
    /// The key new receipts are signed with (`name+id`)
    #[serde(skip_serializing_if = "Option::is_none")]
    signing_key: Option<String>,
    /// Postgres without a synchronous standby: what a failover may lose
    #[serde(skip_serializing_if = "Option::is_none")]
    warning: Option<String>,
}

/// The database answers and no migration is pending.
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, description = "Ready to take plans", body = Ready),
        (status = 503, description = "Not ready, the reason named by the problem's type (to everyone) and told in its detail (to a caller with a valid token; others are pointed to the service's log, where it is said once when it changes): `unavailable` (the database cannot be reached: why), `migrations-pending` (which, and `plan-intake migrate run`), `missing-grants` (which privileges on which tables the service's role lacks, and the `plan-intake migrate grants ROLE` line that gives them), `commits-blocked` (they wait for a synchronous standby and none is attached), `receipt-log-stuck` (the receipt log's appender cannot go on: why), `signing-key-unpublished` (the signing key cannot be recorded at `GET /v1/signing-keys`: why)", body = problem::Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
    ))]
pub async fn readyz(req: actix_web::HttpRequest, state: web::Data<AppState>) -> HttpResponse {
    // The reason's type is for everyone (a load balancer needs no more);
    // its detail names hosts, roles, tables and settings, so it is for a
    // caller with a login, and in the service's log (said when it changes).
    let insider = match auth::bearer_token(req.headers()) {
        Ok(_) => auth::authenticate(&req, &state).await.is_ok(),
        Err(_) => false,
    };
    if insider {
        return answer_of(readiness_answer(&req, &state, true).await);
    }
    // Everyone else: a few callers a second each get a verdict of their
    // own; a crowd shares one at most a second old, so a flood of
    // strangers costs the database about a dozen rounds a second.
    state
        .strangers_readiness
        .answer(async { answer_of(readiness_answer(&req, &state, false).await) })
        .await
}

fn answer_of(answer: Result<HttpResponse, ApiError>) -> HttpResponse {
    answer.unwrap_or_else(|e| actix_web::ResponseError::error_response(&e))
}

async fn readiness_answer(
    req: &actix_web::HttpRequest,
    state: &AppState,
    insider: bool,
) -> Result<HttpResponse, ApiError> {
    let deadline = deadline::of(req, state);
    let readiness = state
        .blocking(deadline, move |intake| intake.readiness(&deadline))
        .await;
    let readiness = readiness.map_err(|e| {
        let (problem, detail) = match e {
            ApiError::NotSetUp(reason) => (problem::not_set_up(&reason), reason.to_string()),
            ApiError::Internal(cause) | ApiError::Unavailable(cause) => (
                "unavailable",
                format!(
                    "the database is unavailable: {}",
                    crate::report::chain(cause.as_ref())
                ),
            ),
            other => return other,
        };
        state.tell_not_ready(&detail);
        ApiError::NotReady {
            problem,
            detail: if insider {
                detail
            } else {
                format!(
                    "not ready ({problem}); the reason is in the service's log, and in this answer to a caller with a login"
                )
            },
        }
    })?;
    state.tell_not_ready("");
    if readiness.commits_blocked {
        return Err(ApiError::CommitsBlocked);
    }
    Ok(HttpResponse::Ok().json(Ready {
        status: "ready",
        commit_waits_for_standby: readiness.commit_waits_for_standby,
        commits_blocked: false,
        receipts_signed: state.intake.signing_key().is_some(),
        signing_key: state
            .intake
            .signing_key()
            .map(|key| key.key_id().to_owned()),
        warning: readiness.warning.map(|warning| {
            if insider {
                warning
            } else {
                "the database is set up in a way that may weaken a guarantee; the service's log and a caller with a login are told which".to_owned()
            }
        }),
    }))
}

/// Prometheus text exposition.
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus text format", body = String, content_type = "text/plain; version=0.0.4")))]
pub async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    state.intake.record_pool_gauges();
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(state.intake.metrics.render())
}

async fn not_found() -> Result<HttpResponse, ApiError> {
    Err(ApiError::NotFound)
}

#[cfg(test)]
mod tests {
    use super::SharedAnswer;
    use actix_web::HttpResponse;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Callers at once share one computation, reused while fresh in a
    /// crowd; while callers are few, each is answered afresh.
    #[actix_web::test]
    async fn a_shared_answer_is_made_once_for_every_caller() {
        let shared = SharedAnswer::new(std::time::Duration::from_secs(60), 0);
        let made = AtomicUsize::new(0);
        let make = |n: &'static str| {
            let made = &made;
            async move {
                made.fetch_add(1, Ordering::SeqCst);
                // Work that yields, so that the other callers arrive
                // while it is being made.
                actix_web::rt::task::yield_now().await;
                HttpResponse::Ok()
                    .insert_header(("retry-after", "1"))
                    .body(n)
            }
        };
        let answers =
            futures_util::future::join_all((0..20).map(|_| shared.answer(make("first")))).await;
        assert_eq!(made.load(Ordering::SeqCst), 1);
        for answer in answers {
            assert_eq!(
                answer.headers().get("retry-after").map(|v| v.as_bytes()),
                Some(&b"1"[..])
            );
            let body = actix_web::body::to_bytes(answer.into_body()).await.ok();
            assert_eq!(body.as_deref(), Some(&b"first"[..]));
        }
        // A crowd's later caller takes the answer while it is fresh.
        let again = shared.answer(make("second")).await;
        assert_eq!(made.load(Ordering::SeqCst), 1);
        let body = actix_web::body::to_bytes(again.into_body()).await.ok();
        assert_eq!(body.as_deref(), Some(&b"first"[..]));

        let quiet = SharedAnswer::new(std::time::Duration::from_secs(60), 3);
        let made_before = made.load(Ordering::SeqCst);
        for _ in 0..5 {
            let _ = quiet.answer(make("quiet")).await;
        }
        // Three callers in a quiet second each made it; the two past
        // them reused the last.
        assert_eq!(made.load(Ordering::SeqCst) - made_before, 3);

        // Never older than a caller's own read: one after another, each
        // makes its own.
        let never_older = SharedAnswer::new(std::time::Duration::ZERO, 0);
        let made_before = made.load(Ordering::SeqCst);
        for _ in 0..3 {
            let _ = never_older.answer(make("own")).await;
        }
        assert_eq!(made.load(Ordering::SeqCst) - made_before, 3);
    }
}
