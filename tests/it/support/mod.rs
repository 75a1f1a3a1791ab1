//! Real-database fixtures. Every test gets its own SQLite file or its own
//! Postgres schema, built by the real migrations and removed on drop.

pub mod cluster;
pub mod http_proxy;
pub mod load;
pub mod pgbouncer;
pub mod process;
pub mod proxy;

use std::sync::OnceLock;
use std::time::Duration;

use actix_web::body::BoxBody;
use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::http::header::HeaderMap;
use actix_web::test;
use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection, RunQueryDsl};
use plan_intake::config::HttpConfig;
use plan_intake::http::{self, AppState};
use plan_intake::intake::{Intake, Permission, RetryPolicy};
use plan_intake::metrics::Metrics;
use plan_intake::storage::{Backend, Database, DbConn, MigrateOnOpen, PoolOptions, ScratchSchema};
use serde_json::Value;

/// Where the Postgres tests find a server: this variable, or the local default.
pub const POSTGRES_URL_VAR: &str = "PLAN_INTAKE_TEST_POSTGRES_URL";
pub const DEFAULT_POSTGRES_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
/// Set by `.ci/run`: an unreachable Postgres fails the run instead of skipping.
pub const REQUIRE_POSTGRES_VAR: &str = "PLAN_INTAKE_REQUIRE_POSTGRES";

pub fn postgres_base_url() -> String {
    std::env::var(POSTGRES_URL_VAR).unwrap_or_else(|_| DEFAULT_POSTGRES_URL.to_owned())
}

/// The configured Postgres URL with `database` in place of its own.
pub fn postgres_url_for(database: &str) -> String {
    let mut url = url::Url::parse(&postgres_base_url()).expect("the test Postgres URL parses");
    url.set_path(&format!("/{database}"));
    url.to_string()
}

/// Host and port of the configured Postgres (5432 when it names none).
pub fn postgres_host_port() -> (String, u16) {
    let url = url::Url::parse(&postgres_base_url()).expect("the test Postgres URL parses");
    (
        url.host_str().unwrap_or("127.0.0.1").to_owned(),
        url.port().unwrap_or(5432),
    )
}

/// Whether Postgres answers; checked once per test run. Skipping is loud,
/// and a failure when `PLAN_INTAKE_REQUIRE_POSTGRES` is set.
pub fn postgres_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    // Before this process's first Postgres connection: OpenSSL's state
    // then outlives the test binary's exit (`keep_tls_state_past_exit`).
    plan_intake::storage::keep_tls_state_past_exit();
    *AVAILABLE.get_or_init(|| match PgConnection::establish(&postgres_base_url()) {
        Ok(_) => true,
        Err(e) => {
            if std::env::var_os(REQUIRE_POSTGRES_VAR).is_some() {
                panic!("{REQUIRE_POSTGRES_VAR} is set but Postgres at {} is unreachable: {e}", postgres_base_url());
            }
            // Written to the process's stderr itself, past the test
            // harness's capture, so a passing run still shows it.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "\n!!!!!!!!\n!!! SKIPPING every Postgres test: {} is unreachable ({e}).\n!!! Set {POSTGRES_URL_VAR} to a reachable server, or {REQUIRE_POSTGRES_VAR}=1 to fail instead.\n!!!!!!!!\n",
                postgres_base_url()
            );
            false
        }
    })
}

/// A scratch database: a temp SQLite file, or a fresh schema in Postgres
/// (selected through `search_path` in the URL). Removed on drop.
pub struct TestDb {
    pub backend: Backend,
    pub url: String,
    /// Postgres: the scratch schema's name.
    pub schema: Option<String>,
    _scratch: Option<ScratchSchema>,
    _dir: Option<tempfile::TempDir>,
}

impl TestDb {
    pub fn sqlite() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("intake.db");
        Self {
            backend: Backend::Sqlite,
            url: format!("sqlite://{}", path.display()),
            schema: None,
            _scratch: None,
            _dir: Some(dir),
        }
    }

    /// SQLite: makes the file, empty (a database with every migration
    /// pending), as only `migrate run` and `serve` would; Postgres: nothing
    /// (the scratch schema is there).
    pub fn create_empty(&self) {
        if let Some(path) = self.url.strip_prefix("sqlite://") {
            std::fs::File::create(path).expect("an empty database file");
        }
    }

    /// None (after a loud note) when Postgres is unreachable and not required.
    pub fn postgres() -> Option<Self> {
        if !postgres_available() {
            return None;
        }
        let scratch =
            ScratchSchema::create(&postgres_base_url(), "it").expect("create test schema");
        Some(Self {
            backend: Backend::Postgres,
            url: scratch.url.clone(),
            schema: Some(scratch.name.clone()),
            _scratch: Some(scratch),
            _dir: None,
        })
    }

    /// This Postgres scratch URL with server settings added (`-c name=value`)
    /// and the schema as `application_name`, so its sessions can be found.
    pub fn postgres_url_with(&self, settings: &[(&str, &str)]) -> String {
        let schema = self.schema.as_deref().expect("a Postgres scratch database");
        let extra: String = settings
            .iter()
            .map(|(name, value)| format!("%20-c{name}%3D{value}"))
            .collect();
        format!("{}{extra}&application_name={schema}", self.url)
    }

    /// Opens the database through the service's own code, migrating it first.
    pub fn open(&self) -> Database {
        self.open_with(MigrateOnOpen::Apply)
    }

    pub fn open_with(&self, migrate: MigrateOnOpen) -> Database {
        let options = PoolOptions {
            max_size: 40,
            // A test's own view of the database: on a busy machine (the
            // suite beside a CPU hog, a Postgres cleaning up after a killed
            // service) a connection may take longer than the service's 2 s.
            checkout_timeout: Duration::from_secs(15),
            ..PoolOptions::default()
        };
        Database::open(&self.url, &options, migrate).expect("open test database")
    }
}

/// Runs `body(TestDb)` once on SQLite and once on Postgres, as two tests.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[actix_web::test]
            async fn sqlite() {
                super::$name($crate::support::TestDb::sqlite()).await
            }
            #[actix_web::test]
            async fn postgres() {
                if let Some(db) = $crate::support::TestDb::postgres() {
                    super::$name(db).await
                }
            }
        }
    )*};
}

/// How the service under test reaches its database.
pub struct AppOptions {
    pub pool: PoolOptions,
    pub retry: RetryPolicy,
    /// Another URL for the same scratch database (a fault proxy, extra settings).
    pub url: Option<String>,
    /// The service's request deadline (and its Postgres sessions' timeouts).
    pub request_timeout: Duration,
}

impl Default for AppOptions {
    fn default() -> Self {
        Self {
            pool: PoolOptions {
                max_size: 40,
                ..PoolOptions::default()
            },
            retry: RetryPolicy::default(),
            url: None,
            request_timeout: plan_intake::config::DEFAULT_REQUEST_TIMEOUT,
        }
    }
}

/// As `on_both_backends!`, for plain (not async) test bodies.
#[macro_export]
macro_rules! on_both_backends_sync {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn sqlite() {
                super::$name($crate::support::TestDb::sqlite())
            }
            #[test]
            fn postgres() {
                if let Some(db) = $crate::support::TestDb::postgres() {
                    super::$name(db)
                }
            }
        }
    )*};
}

/// Another service instance's write path over `url` (its own pool and feed
/// listener), opened without migrating unless `migrate` says otherwise.
pub fn instance(url: &str, migrate: MigrateOnOpen) -> Intake {
    let options = PoolOptions {
        feed_listener: true,
        ..PoolOptions::default()
    };
    let db = Database::open(url, &options, migrate).expect("open the instance's database");
    Intake::new(db, RetryPolicy::default(), Metrics::new())
}

/// The service's routes over a migrated scratch database, with helpers to
/// create logins and count rows.
pub struct TestApp {
    /// Straight to the database (never through a fault proxy): for setup and counting.
    pub direct: Database,
    /// The service's write path, over `AppOptions::url` when one is given.
    pub intake: Intake,
    pub http: HttpConfig,
    /// Held so the scratch database is removed only after the app is done with it.
    _scratch: TestDb,
}

impl TestApp {
    pub fn new(scratch: TestDb) -> Self {
        Self::with(scratch, AppOptions::default())
    }

    /// A Postgres app whose service sessions carry the scratch schema as
    /// `application_name`, so a test can find them in `pg_stat_activity`;
    /// and that name.
    pub fn named(scratch: TestDb) -> (Self, String) {
        let schema = scratch.schema.clone().expect("a Postgres scratch database");
        let url = scratch.postgres_url_with(&[]);
        let app = Self::with(
            scratch,
            AppOptions {
                url: Some(url),
                ..AppOptions::default()
            },
        );
        (app, schema)
    }

    pub fn with(scratch: TestDb, options: AppOptions) -> Self {
        let direct = scratch.open();
        let pool = PoolOptions {
            request_timeout: Some(options.request_timeout),
            feed_listener: true,
            ..options.pool
        };
        let url = options.url.as_deref().unwrap_or(&scratch.url);
        let service_db =
            Database::open(url, &pool, MigrateOnOpen::Skip).expect("open the service's database");
        Self {
            intake: Intake::new(service_db, options.retry, Metrics::new()),
            http: HttpConfig {
                request_timeout: options.request_timeout,
                // These tests race many requests of one login on purpose;
                // the share itself is tested against the real binary.
                max_inflight_per_login: 1000,
                ..HttpConfig::default()
            },
            direct,
            _scratch: scratch,
        }
    }

    /// The scratch database this app runs on (for the command line).
    pub fn db_ref(&self) -> &TestDb {
        &self._scratch
    }

    pub fn metrics(&self) -> &Metrics {
        &self.intake.metrics
    }

    pub async fn service(
        &self,
    ) -> impl Service<actix_http::Request, Response = ServiceResponse<BoxBody>, Error = actix_web::Error>
    {
        self.service_with(self.intake.clone()).await
    }

    /// The routes over another write path (say, another retry policy).
    pub async fn service_with(
        &self,
        intake: Intake,
    ) -> impl Service<actix_http::Request, Response = ServiceResponse<BoxBody>, Error = actix_web::Error>
    {
        let state = AppState::new(intake, self.http.clone());
        test::init_service(http::app(state)).await
    }

    pub fn login(&self, name: &str, permissions: &[Permission]) -> String {
        let mut conn = self.direct.conn().expect("connection");
        plan_intake::intake::login::create(&mut conn, name, permissions).expect("create login")
    }

    pub fn conn(&self) -> plan_intake::storage::PooledConn {
        self.direct.conn().expect("connection")
    }

    pub fn count(&self, table: &str) -> i64 {
        count_rows(&mut self.conn(), table)
    }

    /// Asserts how many plan rows and key rows the database holds.
    #[track_caller]
    pub fn assert_rows(&self, plans: i64, keys: i64) {
        assert_eq!(
            (self.count("plans"), self.count("intake_keys")),
            (plans, keys),
            "(plans, intake_keys)"
        );
    }

    /// The stored plan behind a receipt id, read directly.
    pub fn stored(&self, receipt_id: &str) -> Option<plan_intake::storage::plans::PlanRow> {
        plan_intake::storage::plans::find_by_receipt(&mut self.conn(), receipt_id).expect("query")
    }
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

pub fn count_rows(conn: &mut DbConn, table: &str) -> i64 {
    let sql = format!("SELECT COUNT(*) AS n FROM {table}");
    plan_intake::with_conn!(conn, c => diesel::sql_query(&sql).get_result::<Count>(c))
        .expect("count rows")
        .n
}

/// One HTTP answer, body parsed as JSON (Null when empty).
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Value,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Asserts a problem+json answer of this status whose type ends in
    /// `/{problem}`.
    #[track_caller]
    pub fn assert_problem(&self, status: StatusCode, problem: &str) {
        assert_eq!(self.status, status, "{:?}", self.body);
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        assert!(
            self.body["type"]
                .as_str()
                .is_some_and(|t| t.ends_with(&format!("/{problem}"))),
            "{:?}",
            self.body
        );
    }

    /// Asserts the 422 for a key reused for another request.
    #[track_caller]
    pub fn assert_key_reused(&self) {
        self.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency-key-reused");
        assert!(
            self.body["detail"]
                .as_str()
                .is_some_and(|d| d.contains("send the new content under a new Idempotency-Key")),
            "the refusal says what to do: {:?}",
            self.body
        );
    }
}

pub async fn send<S>(app: &S, req: test::TestRequest) -> Answer
where
    S: Service<actix_http::Request, Response = ServiceResponse<BoxBody>, Error = actix_web::Error>,
{
    let response = test::call_service(app, req.to_request()).await;
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = test::read_body(response).await;
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
    };
    Answer {
        status,
        headers,
        body,
    }
}

pub fn post_plan(token: &str, key: &str, body: &str) -> test::TestRequest {
    test::TestRequest::post()
        .uri("/v1/plans")
        .insert_header(("Authorization", format!("Bearer {token}")))
        .insert_header(("Idempotency-Key", key))
        .insert_header(("Content-Type", "application/json"))
        .set_payload(body.to_owned())
}

pub fn get(token: &str, uri: &str) -> test::TestRequest {
    test::TestRequest::get()
        .uri(uri)
        .insert_header(("Authorization", format!("Bearer {token}")))
}

/// A valid body for `run`, whose content differs with `marker`.
pub fn plan_body(run: &str, marker: &str) -> String {
    serde_json::json!({
        "run_id": run,
        "approved_inputs": [{"id": "forecast-v12", "digest": "blake3:00ff"}, {"id": "prices-v3"}],
        "content": {"marker": marker, "lines": [{"sku": "A-1", "qty": 3}, {"sku": "B-2", "qty": 1.5}]},
    })
    .to_string()
}

/// One number from `sql` (a query returning a single bigint column `n`).
pub fn scalar(conn: &mut DbConn, sql: &str) -> i64 {
    plan_intake::with_conn!(conn, c => diesel::sql_query(sql).get_result::<Count>(c))
        .expect("scalar query")
        .n
}

/// Polls `condition` until it holds: synchronization on an observable state
/// (a lock wait, a counter), never a fixed sleep. Fails after 20 s.
pub async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !condition() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        actix_web::rt::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

/// A plan as the service would store it for `body` sent by `maker`, under
/// another attempt's receipt id: for writing around the service.
pub fn competing_plan(maker: &str, body: &str) -> plan_intake::storage::plans::NewPlan {
    let submission = plan_intake::intake::body::parse(body.as_bytes()).expect("valid body");
    let parts = plan_intake::intake::hashing::canonicalize(&submission);
    plan_intake::storage::plans::NewPlan {
        receipt_id: format!("rcpt_competitor_{:08x}", rand::random::<u32>()),
        maker: maker.to_owned(),
        run_id: submission.run_id.as_str().to_owned(),
        content_hash: parts.hashes.content_hash,
        request_hash: parts.hashes.request_hash,
        content: parts.content.to_owned(),
        approved_inputs: parts.approved_inputs,
        permissions: r#"["plans:submit"]"#.to_owned(),
        received_at: plan_intake::clock::now_micros(),
        receipt_signature: None,
    }
}

pub fn execute_batch(conn: &mut DbConn, sql: &str) {
    plan_intake::with_conn!(conn, c => c.batch_execute(sql)).expect("execute batch");
}

#[derive(diesel::QueryableByName)]
struct ReceiptIdRow {
    #[diesel(sql_type = diesel::sql_types::Text)]
    receipt_id: String,
}

/// Every receipt id in `plans`, read directly (not through the feed).
pub fn stored_receipt_ids(conn: &mut DbConn) -> std::collections::HashSet<String> {
    plan_intake::with_conn!(conn, c => diesel::sql_query("SELECT receipt_id FROM plans").load::<ReceiptIdRow>(c))
        .expect("read receipt ids")
        .into_iter()
        .map(|r| r.receipt_id)
        .collect()
}

/// An INSERT of a plan row written by hand, around the service, as a DBA
/// or another program would: `run_id` is an SQL expression (so tests can
/// write NULL or blanks), the content `{}`, no approved inputs. The
/// timestamp is a literal both backends take.
pub fn hand_written_plan_sql(
    receipt_id: &str,
    maker: &str,
    run_id: &str,
    content_hash: &str,
) -> String {
    format!(
        "INSERT INTO plans (receipt_id, maker, run_id, content_hash, request_hash, content,
                            approved_inputs, permissions, received_at)
              VALUES ('{receipt_id}', '{maker}', {run_id}, '{content_hash}', '{content_hash}',
                      '{{}}', '[]', '[\"plans:submit\"]', '2026-11-30 10:00:00')"
    )
}

/// A plan under planner-a's `key-1` (run `run-1`) sent through `service`
/// while another transaction holds that key (uncommitted, `holder-run`):
/// our read misses it, our plan row goes in, our key row waits on the
/// unique index, and the holder commits once `pg_stat_activity` shows the
/// wait (the app's sessions are named `schema`). The answer.
pub async fn answer_to_a_key_committed_while_waiting<S>(
    app: &TestApp,
    service: &S,
    token: &str,
    direct_url: &str,
    schema: &str,
) -> Answer
where
    S: Service<actix_http::Request, Response = ServiceResponse<BoxBody>, Error = actix_web::Error>,
{
    let mut holder = hold_plan_and_key(direct_url, "", "rcpt_holder", "holder-run", "key-1");
    let waiting = format!(
        "SELECT COUNT(*) AS n FROM pg_stat_activity WHERE application_name = '{schema}' AND wait_event_type = 'Lock'"
    );
    let commit_the_holder = async {
        wait_until("our key row waits on the holder's", || {
            scalar(&mut app.conn(), &waiting) == 1
        })
        .await;
        holder.batch_execute("COMMIT").expect("the holder commits");
    };
    let (answer, ()) = futures_util::join!(
        send(service, post_plan(token, "key-1", &plan_body("run-1", "x"))),
        commit_the_holder
    );
    answer
}

/// Opens a direct Postgres session (running `settings` first) that begins a
/// transaction and writes, without committing, a plan under `receipt_id` for
/// `run_id` and its key row for planner-a's `key`: the session holds that
/// key and that plan until it commits or rolls back.
pub fn hold_plan_and_key(
    url: &str,
    settings: &str,
    receipt_id: &str,
    run_id: &str,
    key: &str,
) -> PgConnection {
    let mut session = PgConnection::establish(url).expect("connect");
    session
        .batch_execute(&format!(
            "{settings}
             BEGIN;
             {};
             INSERT INTO intake_keys (maker, idempotency_key, request_hash, plan_id, created_at)
                  SELECT 'planner-a', '{key}', 'blake3:held', id, now() FROM plans
                   WHERE receipt_id = '{receipt_id}';",
            hand_written_plan_sql(
                receipt_id,
                "planner-a",
                &format!("'{run_id}'"),
                "blake3:held"
            )
        ))
        .expect("the session holds the plan and the key");
    session
}
