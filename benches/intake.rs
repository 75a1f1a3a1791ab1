//! `cargo bench --bench intake -- [--backend sqlite|postgres|both]
//!  [--concurrency N] [--duration SECS] [--quick]`
//!
//! `--quick` runs only the baselines and the write scenarios (new plans at
//! N, 64 and 256 clients, replays), for iterating on the write path.
//! `--verified-follow` runs only the followers' scenario: new plans at N
//! clients on a signing service, read by `plan-intake follow` and by
//! `plan-intake follow --verify` side by side.
//! `--inbox-follow` runs only the inbox's scenario: new plans at N clients
//! on a signing service, read by `plan-intake follow` to stdout (the
//! baseline) and by `plan-intake follow --into` with and without
//! `--verify`, once into a Postgres inbox and once into a SQLite one.
//! `--public-flood` runs only the stranger's budget: N planner clients on
//! a signing service alone, then beside a flood with no token on every
//! public route (entry and hash tiles, checkpoints, extension waits,
//! `/readyz`), and the planners' rate and p99 of the two side by side;
//! `--flood-routes checkpoint,readyz` (also `signing-keys`) and
//! `--flood-waiters N` choose what the flood asks, `--flood-rate N` how
//! many requests a second (2,000).
//!
//! For each backend: a fresh database, the real service (this build's
//! binary) on a random port, N keep-alive HTTP/1.1 clients through three
//! scenarios (new plans, replays, one contended key), and in the same run
//! the baseline: the same two-row transaction straight through diesel with
//! the same concurrency and no HTTP. Prints one table and writes the same
//! figures to `target/bench-intake.json`.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use diesel::PgConnection;
use diesel::connection::SimpleConnection;
use diesel::prelude::*;
use plan_intake::intake::Permission;
use plan_intake::storage::DbConn;
use plan_intake::storage::plans::NewPlan;
use plan_intake::storage::schema::{intake_keys, plans};
use plan_intake::storage::{Database, MigrateOnOpen, PoolOptions, ScratchSchema};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_plan-intake");
/// Plans timed from their 201 to a waiting reader, per push scenario.
const PUSH_SAMPLES: usize = 200;
/// The service logs as it does in production: one line per request.
const SERVICE_LOG: &str = "info";
/// Plans loaded by SQL before the growth run.
const GROWTH_PLANS: u64 = 3_000_000;
/// The plan sizes of the size scenarios: (name, small objects in content).
const PLAN_SIZES: [(&str, usize); 3] = [("1 KiB", 110), ("64 KiB", 8_100), ("1 MiB", 125_000)];

struct Options {
    backends: Vec<&'static str>,
    concurrency: usize,
    duration: Duration,
    postgres_url: String,
    /// Only the baselines and the write scenarios.
    quick: bool,
    /// Only the verifying and the plain follower, side by side.
    verified_follow: bool,
    /// Only the stdout follower and the inbox followers, side by side.
    inbox_follow: bool,
    /// Only the planners alone and beside a flood of requests with no
    /// token on every public route.
    public_flood: bool,
    /// The public routes the flood asks, in turn.
    flood_routes: Vec<String>,
    /// Extension waiters beside the flood.
    flood_waiters: usize,
    /// Requests a second the flood sends.
    flood_rate: u64,
}

fn options() -> Options {
    let mut options = Options {
        backends: vec!["sqlite", "postgres"],
        concurrency: 16,
        duration: Duration::from_secs(10),
        postgres_url: std::env::var("PLAN_INTAKE_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
        quick: false,
        verified_follow: false,
        inbox_follow: false,
        public_flood: false,
        flood_routes: [
            "entry-tile",
            "hash-tile",
            "checkpoint",
            "extension",
            "readyz",
        ]
        .map(String::from)
        .to_vec(),
        flood_waiters: FLOOD_WAITERS,
        flood_rate: FLOOD_PER_SECOND,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let value = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--backend" => {
                options.backends = match value.as_str() {
                    "sqlite" => vec!["sqlite"],
                    "postgres" => vec!["postgres"],
                    _ => vec!["sqlite", "postgres"],
                };
                i += 1;
            }
            "--concurrency" => {
                options.concurrency = value.parse().expect("--concurrency N");
                i += 1;
            }
            "--duration" => {
                options.duration = Duration::from_secs(value.parse().expect("--duration SECS"));
                i += 1;
            }
            "--quick" => options.quick = true,
            "--verified-follow" => options.verified_follow = true,
            "--inbox-follow" => options.inbox_follow = true,
            "--public-flood" => options.public_flood = true,
            "--flood-routes" => {
                options.flood_routes = value.split(',').map(String::from).collect();
                i += 1;
            }
            "--flood-rate" => {
                options.flood_rate = value.parse().expect("--flood-rate N");
                i += 1;
            }
            "--flood-waiters" => {
                options.flood_waiters = value.parse().expect("--flood-waiters N");
                i += 1;
            }
            _ => {} // cargo passes `--bench`
        }
        i += 1;
    }
    options
}

/// Latencies of one scenario, and its errors.
struct Run {
    latencies: Vec<Duration>,
    errors: u64,
    elapsed: Duration,
    /// Requests counted without their latencies (pgbench reports a rate).
    counted: Option<u64>,
}

impl Run {
    fn rate(&self) -> f64 {
        self.counted.unwrap_or(self.latencies.len() as u64) as f64 / self.elapsed.as_secs_f64()
    }

    fn percentile(&self, p: f64) -> Option<Duration> {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        if sorted.is_empty() {
            return None;
        }
        let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
        Some(sorted[index])
    }
}

/// Runs `work(client, sequence)` from `concurrency` threads for `duration`.
fn drive<S: Send + 'static>(
    concurrency: usize,
    duration: Duration,
    setup: impl Fn(usize) -> S + Send + Sync + 'static,
    work: impl Fn(&mut S, usize, u64) -> bool + Send + Sync + 'static,
) -> Run {
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let setup = Arc::new(setup);
    let work = Arc::new(work);
    let started = Instant::now();
    let threads: Vec<_> = (0..concurrency)
        .map(|client| {
            let (stop, errors, setup, work) = (
                Arc::clone(&stop),
                Arc::clone(&errors),
                Arc::clone(&setup),
                Arc::clone(&work),
            );
            thread::spawn(move || {
                let mut state = setup(client);
                let mut latencies = Vec::new();
                let mut sequence = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let begun = Instant::now();
                    if work(&mut state, client, sequence) {
                        latencies.push(begun.elapsed());
                    } else {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                    sequence += 1;
                }
                latencies
            })
        })
        .collect();
    thread::sleep(duration);
    stop.store(true, Ordering::Relaxed);
    let latencies = threads
        .into_iter()
        .flat_map(|t| t.join().expect("client thread"))
        .collect();
    Run {
        latencies,
        errors: errors.load(Ordering::Relaxed),
        elapsed: started.elapsed(),
        counted: None,
    }
}

fn hand_rolled_insert(conn: &mut DbConn, plan: &NewPlan, key: &str) -> diesel::QueryResult<()> {
    macro_rules! both_rows {
        ($c:expr, $begin:ident) => {
            $c.$begin(|c| -> diesel::QueryResult<()> {
                let id: i64 = diesel::insert_into(plans::table)
                    .values(plan)
                    .returning(plans::id)
                    .get_result(c)?;
                diesel::insert_into(intake_keys::table)
                    .values((
                        intake_keys::maker.eq(&plan.maker),
                        intake_keys::idempotency_key.eq(key),
                        intake_keys::request_hash.eq(&plan.request_hash),
                        intake_keys::plan_id.eq(id),
                        intake_keys::created_at.eq(plan.received_at),
                    ))
                    .execute(c)?;
                Ok(())
            })
        };
    }
    match conn {
        DbConn::Postgres(c) => both_rows!(c, transaction),
        DbConn::Sqlite(c) => both_rows!(c, immediate_transaction),
    }
}

fn body(run: &str) -> String {
    json!({
        "run_id": run,
        "approved_inputs": [{"id": "forecast-v12", "digest": "blake3:00ff"}, {"id": "prices-v3"}],
        "content": {"lines": [{"sku": "A-1", "qty": 3}, {"sku": "B-2", "qty": 1.5}], "note": "benchmark"},
    })
    .to_string()
}

fn post(
    agent: &ureq::Agent,
    addr: &str,
    token: &str,
    key: &str,
    body: &str,
    expect: &[u16],
) -> bool {
    post_status(agent, addr, token, key, body).is_some_and(|status| expect.contains(&status))
}

/// The status of one submission; `None` when no answer came. A 429 or 503
/// counts only with its `Retry-After`.
fn post_status(agent: &ureq::Agent, addr: &str, token: &str, key: &str, body: &str) -> Option<u16> {
    let answer = agent
        .post(&format!("http://{addr}/v1/plans"))
        .set("Authorization", &format!("Bearer {token}"))
        .set("Idempotency-Key", key)
        .set("Content-Type", "application/json")
        .send_string(body);
    let (status, retry_after, response) = match answer {
        Ok(response) => (response.status(), true, response),
        Err(ureq::Error::Status(status, response)) => {
            (status, response.header("retry-after").is_some(), response)
        }
        Err(_) => return None,
    };
    let _ = response.into_string();
    match status {
        429 | 503 if !retry_after => Some(0),
        status => Some(status),
    }
}

/// Push latency: one writer posts a plan at a time (paced), one reader
/// follows the feed with `wait=30`; for each plan, the time from its 201
/// at the writer to its arrival at the reader. The reader may be on
/// another instance than the writer.
fn push_latency(
    writer_addr: &str,
    reader_addr: &str,
    planner: &str,
    orders: &str,
    samples: usize,
) -> Run {
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(60))
        .build();
    let start = json_of(
        agent
            .get(&format!("http://{reader_addr}/v1/receipts?after=now"))
            .set("Authorization", &format!("Bearer {orders}"))
            .call(),
    )
    .expect("the end of the feed");
    let mut cursor = start["next"].as_str().unwrap_or_default().to_owned();
    let arrivals: Arc<std::sync::Mutex<std::collections::HashMap<String, Instant>>> =
        Arc::default();
    let (reader_addr, orders, seen) = (
        reader_addr.to_owned(),
        orders.to_owned(),
        Arc::clone(&arrivals),
    );
    let reader = thread::spawn(move || {
        let agent = ureq::AgentBuilder::new()
            .timeout(Duration::from_secs(60))
            .build();
        while seen.lock().map(|m| m.len()).unwrap_or(samples) < samples {
            let Some(page) = json_of(
                agent
                    .get(&format!(
                        "http://{reader_addr}/v1/receipts?after={cursor}&wait=30"
                    ))
                    .set("Authorization", &format!("Bearer {orders}"))
                    .call(),
            ) else {
                continue;
            };
            let now = Instant::now();
            if let Ok(mut seen) = seen.lock() {
                for receipt in page["receipts"].as_array().into_iter().flatten() {
                    if let Some(id) = receipt["receipt_id"].as_str() {
                        seen.insert(id.to_owned(), now);
                    }
                }
            }
            cursor = page["next"].as_str().unwrap_or(&cursor).to_owned();
        }
    });
    let started = Instant::now();
    let mut created = Vec::new();
    for i in 0..samples {
        let key = format!("push-{}-{i}", rand::random::<u32>());
        let answer = agent
            .post(&format!("http://{writer_addr}/v1/plans"))
            .set("Authorization", &format!("Bearer {planner}"))
            .set("Idempotency-Key", &key)
            .set("Content-Type", "application/json")
            .send_string(&body(&key));
        let at = Instant::now();
        if let Some(receipt) = json_of(answer)
            && let Some(id) = receipt["receipt_id"].as_str()
        {
            created.push((id.to_owned(), at));
        }
        thread::sleep(Duration::from_millis(20));
    }
    let _ = reader.join();
    let seen = arrivals.lock().map(|m| m.clone()).unwrap_or_default();
    let latencies: Vec<Duration> = created
        .iter()
        .filter_map(|(id, at)| {
            seen.get(id)
                .map(|arrived| arrived.saturating_duration_since(*at))
        })
        .collect();
    Run {
        errors: (created.len() - latencies.len()) as u64 + (samples - created.len()) as u64,
        latencies,
        elapsed: started.elapsed(),
        counted: None,
    }
}

/// A successful answer's body as JSON.
fn json_of(answer: Result<ureq::Response, ureq::Error>) -> Option<serde_json::Value> {
    let text = answer.ok()?.into_string().ok()?;
    serde_json::from_str(&text).ok()
}

struct Service {
    child: Child,
    addr: String,
}

/// A PgBouncer in transaction mode in front of a database of its own
/// (created, migrated and given a login directly; dropped afterwards).
struct Bouncer {
    url: String,
    token: String,
    database: String,
    admin_url: String,
    pid_file: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Bouncer {
    fn start(postgres_url: &str) -> Option<Self> {
        let admin_url = postgres_url
            .split_once('?')
            .map_or(postgres_url, |(b, _)| b)
            .to_owned();
        let database = format!("bench_pgb_{}", std::process::id());
        let mut admin = PgConnection::establish(&admin_url).ok()?;
        admin
            .batch_execute(&format!("CREATE DATABASE {database}"))
            .ok()?;
        let direct = format!("{}/{database}", &admin_url[..admin_url.rfind('/')?]);
        let db = Database::open(&direct, &PoolOptions::default(), MigrateOnOpen::Apply).ok()?;
        let token = plan_intake::intake::login::create(
            &mut *db.conn().ok()?,
            "bench",
            &[Permission::PlansSubmit],
        )
        .ok()?;
        drop(db);
        let dir = tempfile::tempdir().ok()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .ok()?
            .local_addr()
            .ok()?
            .port();
        let path = |name: &str| dir.path().join(name);
        std::fs::write(path("users.txt"), "\"postgres\" \"\"\n").ok()?;
        std::fs::write(
            path("pgbouncer.ini"),
            format!(
                "[databases]\n{database} = host=127.0.0.1 port=5432 dbname={database}\n\n[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\nauth_type = trust\nauth_file = {}\npool_mode = transaction\nmax_client_conn = 400\ndefault_pool_size = 20\npidfile = {}\nlogfile = {}\n",
                path("users.txt").display(),
                path("pgbouncer.pid").display(),
                path("pgbouncer.log").display(),
            ),
        )
        .ok()?;
        Command::new("chown")
            .args(["-R", "postgres", &dir.path().display().to_string()])
            .status()
            .ok()?;
        let started = Command::new("pgbouncer")
            .args(["-d", "-u", "postgres"])
            .arg(path("pgbouncer.ini"))
            .status();
        if !started.is_ok_and(|s| s.success()) {
            eprintln!("pgbouncer did not start: PgBouncer scenarios skipped");
            return None;
        }
        for _ in 0..500 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            thread::sleep(Duration::from_millis(10));
        }
        Some(Self {
            url: format!("postgres://postgres@127.0.0.1:{port}/{database}"),
            token,
            database,
            admin_url,
            pid_file: path("pgbouncer.pid"),
            _dir: dir,
        })
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(&self.pid_file) {
            let _ = Command::new("kill").args(["-KILL", pid.trim()]).status();
        }
        if let Ok(mut admin) = PgConnection::establish(&self.admin_url) {
            let _ = admin.batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.database
            ));
        }
    }
}

impl Service {
    fn start(url: &str, pool_size: u32) -> Self {
        Self::start_with(url, pool_size, &[])
    }

    fn start_with(url: &str, pool_size: u32, extra: &[&str]) -> Self {
        let mut child = Command::new(BIN)
            .args([
                "serve",
                "--bind",
                "127.0.0.1:0",
                "--pool-size",
                &pool_size.to_string(),
            ])
            .args(extra)
            .env("DATABASE_URL", url)
            .env("PLAN_INTAKE_LOG", SERVICE_LOG)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the service");
        let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let addr = loop {
            let line = lines.next().expect("service exited").expect("read");
            if let Some((_, rest)) = line.split_once("listening addr=") {
                break rest
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_owned();
            }
        };
        thread::spawn(move || for _ in lines {});
        Self { child, addr }
    }

    /// Write batches so far and the plans they held, from `/metrics`.
    fn batches(&self) -> (f64, f64) {
        let text = ureq::get(&format!("http://{}/metrics", self.addr))
            .call()
            .ok()
            .and_then(|r| r.into_string().ok())
            .unwrap_or_default();
        let total = |series: &str| -> f64 {
            text.lines()
                .filter(|l| l.starts_with(series))
                .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
                .sum()
        };
        (
            total("plan_intake_write_batch_plans_count"),
            total("plan_intake_write_batch_plans_sum"),
        )
    }

    /// Plans per write batch since `mark` (what `batches` said then).
    fn mean_batch_since(&self, mark: (f64, f64)) -> Option<f64> {
        let now = self.batches();
        (now.0 > mark.0).then(|| (now.1 - mark.1) / (now.0 - mark.0))
    }

    /// CPU seconds the service has used so far (user + system).
    fn cpu_seconds(&self) -> f64 {
        cpu_seconds_of(&self.child.id().to_string())
    }

    /// Peak resident set (VmHWM), in MiB.
    fn peak_rss_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    }
}

/// User + system CPU seconds of a process, from `/proc/PID/stat`.
fn cpu_seconds_of(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the `(comm)`, which may hold spaces: utime and stime are 14 and 15.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|i| fields.get(*i)?.parse::<f64>().ok())
        .sum();
    ticks / 100.0
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh database for one backend: URL, and how to remove it.
fn fresh_database(backend: &str, options: &Options) -> (String, Box<dyn FnOnce()>) {
    let tag = format!("{}_{}", std::process::id(), rand::random::<u32>());
    match backend {
        "sqlite" => {
            let dir = std::env::temp_dir().join(format!("plan-intake-bench-{tag}"));
            std::fs::create_dir_all(&dir).expect("temp dir");
            let url = format!("sqlite://{}", dir.join("bench.db").display());
            (url, Box::new(move || drop(std::fs::remove_dir_all(dir))))
        }
        _ => {
            let schema = ScratchSchema::create(&options.postgres_url, "bench")
                .expect("create the benchmark schema (is Postgres running?)");
            (schema.url.clone(), Box::new(move || drop(schema)))
        }
    }
}

struct Row {
    backend: &'static str,
    scenario: String,
    run: Run,
    rss_mib: Option<f64>,
    /// Against the naive two-row transaction (Postgres: pgbench; SQLite:
    /// the hand-rolled `BEGIN IMMEDIATE` loop).
    ratio: Option<f64>,
    /// Postgres: against pgbench writing both rows in one statement.
    of_ceiling: Option<f64>,
    /// CPU ms per request: (service, load generator).
    cpu: Option<(f64, f64)>,
    /// Plans per write batch, on average, while the scenario ran.
    batch: Option<f64>,
}

fn main() {
    // Before any Postgres connection (pgbench's runs aside): as the service.
    plan_intake::storage::keep_tls_state_past_exit();
    let options = options();
    let mut rows: Vec<Row> = Vec::new();
    let mut push_rows: Vec<PushRow> = Vec::new();
    if options.verified_follow {
        for backend in options.backends.clone() {
            let pool_size = if backend == "postgres" {
                options.concurrency as u32
            } else {
                8
            };
            let kinds = [Follower::Stdout, Follower::StdoutVerified];
            print_followers(
                backend,
                &followers_side_by_side(backend, &options, pool_size, &kinds),
            );
        }
        return;
    }
    if options.inbox_follow {
        for backend in options.backends.clone() {
            let pool_size = if backend == "postgres" {
                options.concurrency as u32
            } else {
                8
            };
            for consumer in ["postgres", "sqlite"] {
                // An inbox each: one follower writes an inbox.
                let (plain, plain_cleanup) = inbox_of(consumer, &options);
                let (verified, verified_cleanup) = inbox_of(consumer, &options);
                let kinds = [
                    Follower::Stdout,
                    Follower::Inbox(consumer, plain, false),
                    Follower::Inbox(consumer, verified, true),
                ];
                let followers = followers_side_by_side(backend, &options, pool_size, &kinds);
                print_followers(backend, &followers);
                plain_cleanup();
                verified_cleanup();
            }
        }
        return;
    }
    if options.public_flood {
        for backend in options.backends.clone() {
            public_flood(backend, &options);
        }
        return;
    }
    for backend in options.backends.clone() {
        let (url, cleanup) = fresh_database(backend, &options);
        bench_backend(backend, &url, &options, &mut rows, &mut push_rows);
        cleanup();
    }
    print_report(&options, &rows, &push_rows);
}

/// A fresh database of `consumer`'s kind with the inbox's tables made by
/// `plan-intake inbox migrate`: its URL, and how to remove it.
fn inbox_of(consumer: &str, options: &Options) -> (String, Box<dyn FnOnce()>) {
    let (url, cleanup) = fresh_database(consumer, options);
    let url = url
        .strip_prefix("sqlite://")
        .map_or(url.clone(), str::to_owned);
    let made = Command::new(BIN)
        .args(["inbox", "migrate", "--into", &url])
        .output()
        .expect("run inbox migrate");
    assert!(made.status.success(), "inbox migrate: {made:?}");
    (url, cleanup)
}

/// A push-latency run: backend, where the reader is, the run.
type PushRow = (&'static str, &'static str, Run);

/// Every scenario on one backend's fresh database, in the order the table
/// shows them.
fn bench_backend(
    backend: &'static str,
    url: &str,
    options: &Options,
    rows: &mut Vec<Row>,
    push_rows: &mut Vec<PushRow>,
) {
    let postgres = backend == "postgres";
    let pool_size = if postgres {
        options.concurrency as u32
    } else {
        8
    };
    let db = Database::open(
        url,
        &PoolOptions {
            max_size: pool_size,
            ..PoolOptions::default()
        },
        MigrateOnOpen::Apply,
    )
    .expect("open the benchmark database");
    let token = add_login(&db, "bench", Permission::PlansSubmit);
    let mut table = Table {
        backend,
        rows: Vec::new(),
    };
    // The naive two-row transaction, and (Postgres) both rows in one
    // statement: what the database can write, measured by pgbench.
    let (naive, one_statement) = if postgres {
        (
            pgbench(url, NAIVE_TWO_ROWS, options),
            pgbench(url, ONE_STATEMENT, options),
        )
    } else {
        (None, None)
    };
    let (diesel_baseline, written) = without_http(&db, options, &token, "first");
    let push = (postgres && !options.quick).then(|| push_on_and_off(url, &db, options, &token));
    let base_rate = naive.as_ref().unwrap_or(&diesel_baseline).rate();
    let ceiling_rate = one_statement.as_ref().map(|run| run.rate());
    if let Some(naive) = naive {
        table.add("pgbench: BEGIN; INSERT; INSERT; COMMIT", naive, None, None);
    }
    if let Some(one) = one_statement {
        table.add(
            "pgbench: both rows in one statement (ceiling)",
            one,
            None,
            None,
        );
    }
    table.add(
        "diesel: the two-row transaction, no HTTP",
        diesel_baseline,
        None,
        None,
    );
    table.add("the service's write, no HTTP", written, None, None);
    if let Some((on, off)) = push {
        println!(
            "push: the write with the push on runs at {:.3} x the write with it off and every trigger on plans disabled",
            on.rate() / off.rate()
        );
        table.add(
            "the service's write, no HTTP, push to other instances on",
            on,
            None,
            None,
        );
        table.add(
            "the service's write, no HTTP, push off, every trigger on plans disabled",
            off,
            None,
            None,
        );
    }

    let service = Service::start(url, pool_size);
    let http = through_http(&service, &token, options);
    let empty_table_rate = http.scenarios[0].1.0.rate();
    for (scenario, (run, cpu, batch)) in http.scenarios {
        table.add(scenario, run, Some(http.rss_mib), Some(cpu));
        table.batch(batch);
    }
    let evidence = evidence_on_and_off(backend, options, pool_size);
    println!(
        "{backend}: evidence: new plans with receipts signed and logged run at {:.3} x the same service without (each on a fresh database, {EVIDENCE_ROUNDS} alternating rounds); the log covers an acknowledged plan after p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms ({} plans; it caught up {:.1} s after the load stopped)",
        evidence.on.rate() / evidence.off.rate(),
        ms(evidence.lag.percentile(0.5)).unwrap_or(f64::NAN),
        ms(evidence.lag.percentile(0.99)).unwrap_or(f64::NAN),
        ms(evidence.lag.percentile(1.0)).unwrap_or(f64::NAN),
        evidence.lag.latencies.len(),
        evidence.caught_up_after.as_secs_f64(),
    );
    table.add(
        "new plans, unsigned (own database, rounds alternating with the next row)",
        evidence.off,
        None,
        Some(evidence.off_cpu),
    );
    table.add(
        "new plans, receipts signed and logged (own database)",
        evidence.on,
        None,
        Some(evidence.on_cpu),
    );
    print_followers(
        backend,
        &followers_side_by_side(
            backend,
            options,
            pool_size,
            &[Follower::Stdout, Follower::StdoutVerified],
        ),
    );
    // Many more clients than the pool has connections, spread over 16
    // logins so that no login's share (16 in flight) turns them away.
    let tokens: Vec<String> = (0..16)
        .map(|i| add_login(&db, &format!("bench-many-{i}"), Permission::PlansSubmit))
        .collect();
    for clients in [64, 256] {
        let mark = service.batches();
        let (run, cpu, refused) = new_plans_from(
            &service,
            &tokens,
            clients,
            &format!("many{clients}"),
            &body,
            options.duration,
        );
        println!(
            "{backend}: {clients} clients: new plans at {:.2} x the {}-client rate; {refused} answers 429 or 503 with Retry-After, {} other answers",
            run.rate() / empty_table_rate,
            options.concurrency,
            run.errors
        );
        table.add(
            &format!("new plans, {clients} clients over 16 logins"),
            run,
            Some(service.peak_rss_mib()),
            Some(cpu),
        );
        table.batch(service.mean_batch_since(mark));
    }
    // A planner on 8 clients alone, then beside strangers with random
    // tokens at a fixed rate: what the strangers cost it.
    let (alone, among, strangers) = beside_strangers(&service, &token, options.duration);
    println!(
        "{backend}: strangers: the planner's p99 {:.2} ms alone, {:.2} ms among {STRANGERS_PER_SECOND} strangers a second ({:.2}x); {} strangers sent, answered {:?}",
        ms(alone.percentile(0.99)).unwrap_or(f64::NAN),
        ms(among.percentile(0.99)).unwrap_or(f64::NAN),
        ms(among.percentile(0.99)).unwrap_or(f64::NAN)
            / ms(alone.percentile(0.99)).unwrap_or(f64::NAN),
        strangers.values().sum::<u64>(),
        strangers,
    );
    table.add("new plans, 8 clients, alone", alone, None, None);
    table.add(
        &format!("new plans, 8 clients, among {STRANGERS_PER_SECOND} strangers a second"),
        among,
        None,
        None,
    );
    if options.quick {
        drop(service);
        table.finish(rows, base_rate, ceiling_rate);
        return;
    }
    for (scenario, run, cpu) in plan_sizes(&service, &token, options) {
        table.add(&scenario, run, Some(service.peak_rss_mib()), Some(cpu));
    }
    let orders = add_login(&db, "bench-orders", Permission::ReceiptsRead);
    let (run, cpu) = feed_pages(&service, &orders, options);
    table.add("feed page of 100 receipts", run, None, Some(cpu));
    push_rows.push((
        backend,
        "the same instance",
        push_latency(&service.addr, &service.addr, &token, &orders, PUSH_SAMPLES),
    ));
    if postgres {
        let other = Service::start(url, pool_size);
        push_rows.push((
            backend,
            "another instance",
            push_latency(&service.addr, &other.addr, &token, &orders, PUSH_SAMPLES),
        ));
    }
    if postgres && let Some(bouncer) = Bouncer::start(&options.postgres_url) {
        for (scenario, run, rss) in through_pgbouncer(&bouncer, pool_size, options) {
            table.add(scenario, run, Some(rss), None);
        }
    }
    if postgres {
        load_stored_plans(&db, GROWTH_PLANS);
        let (run, cpu) = new_plans(&service, &token, "grown", &body, options);
        println!(
            "growth: new plans at {GROWTH_PLANS} stored plans run at {:.2} x the empty-table rate",
            run.rate() / empty_table_rate
        );
        table.add(
            &format!(
                "new plans, {}M plans already stored",
                GROWTH_PLANS / 1_000_000
            ),
            run,
            None,
            Some(cpu),
        );
        let (run, cpu) = feed_pages(&service, &orders, options);
        table.add(
            &format!(
                "feed page of 100 receipts, {}M plans stored",
                GROWTH_PLANS / 1_000_000
            ),
            run,
            None,
            Some(cpu),
        );
    }
    drop(service);
    table.finish(rows, base_rate, ceiling_rate);
}

/// One backend's rows, as they are measured.
struct Table {
    backend: &'static str,
    rows: Vec<Row>,
}

impl Table {
    fn add(&mut self, scenario: &str, run: Run, rss_mib: Option<f64>, cpu: Option<(f64, f64)>) {
        self.rows.push(Row {
            backend: self.backend,
            scenario: scenario.to_owned(),
            run,
            rss_mib,
            ratio: None,
            of_ceiling: None,
            cpu,
            batch: None,
        });
    }

    /// Each row with its ratios to the baselines, onto `rows`.
    fn finish(self, rows: &mut Vec<Row>, base_rate: f64, ceiling_rate: Option<f64>) {
        for mut row in self.rows {
            row.ratio = Some(row.run.rate() / base_rate);
            row.of_ceiling = ceiling_rate.map(|c| row.run.rate() / c);
            rows.push(row);
        }
    }

    /// The last row's mean write batch size.
    fn batch(&mut self, mean: Option<f64>) {
        if let Some(row) = self.rows.last_mut() {
            row.batch = mean;
        }
    }
}

fn execute(db: &Database, sql: &str) {
    let mut conn = db.conn().expect("connection");
    let DbConn::Postgres(pg) = &mut *conn else {
        panic!("{sql}: a Postgres statement");
    };
    pg.batch_execute(sql).expect(sql);
}

/// The naive two-row transaction, as pgbench runs it.
const NAIVE_TWO_ROWS: &str = r#"BEGIN;
INSERT INTO plans (receipt_id, maker, run_id, content_hash, request_hash, content, approved_inputs, permissions, received_at) VALUES ('rcpt_' || gen_random_uuid(), 'bench', 'pgb-' || gen_random_uuid(), 'blake3:pgb', 'blake3:pgb', '{"lines":[{"qty":3,"sku":"A-1"},{"qty":1.5,"sku":"B-2"}],"note":"benchmark"}', '[{"digest":"blake3:00ff","id":"forecast-v12"},{"id":"prices-v3"}]', '["plans:submit"]', now()) RETURNING id \gset
INSERT INTO intake_keys (maker, idempotency_key, request_hash, plan_id, created_at) VALUES ('bench', 'pgb-' || gen_random_uuid(), 'blake3:pgb', :id, now());
COMMIT;
"#;

/// Both rows in one statement: the shape of `plan_intake_write`'s work.
const ONE_STATEMENT: &str = r#"WITH p AS (INSERT INTO plans (receipt_id, maker, run_id, content_hash, request_hash, content, approved_inputs, permissions, received_at) VALUES ('rcpt_' || gen_random_uuid(), 'bench', 'pgb1-' || gen_random_uuid(), 'blake3:pgb', 'blake3:pgb', '{"lines":[{"qty":3,"sku":"A-1"},{"qty":1.5,"sku":"B-2"}],"note":"benchmark"}', '[{"digest":"blake3:00ff","id":"forecast-v12"},{"id":"prices-v3"}]', '["plans:submit"]', now()) RETURNING id, maker, request_hash, received_at) INSERT INTO intake_keys (maker, idempotency_key, request_hash, plan_id, created_at) SELECT maker, 'pgb1-' || gen_random_uuid(), request_hash, id, received_at FROM p;
"#;

/// pgbench running `script` with the benchmark's concurrency against the
/// schema `url` selects; `None` (with a note) where pgbench is missing.
fn pgbench(url: &str, script: &str, options: &Options) -> Option<Run> {
    let file = tempfile::NamedTempFile::new().ok()?;
    std::fs::write(file.path(), script).ok()?;
    let output = Command::new("pgbench")
        .args([
            "-n",
            "-c",
            &options.concurrency.to_string(),
            "-j",
            "2",
            "-T",
        ])
        .arg(options.duration.as_secs().to_string())
        .arg("-f")
        .arg(file.path())
        .arg(url)
        .output();
    let output = match output {
        Ok(output) if output.status.success() => output,
        Ok(output) => {
            eprintln!(
                "pgbench failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            return None;
        }
        Err(e) => {
            eprintln!("pgbench cannot run ({e}): its rows are left out");
            return None;
        }
    };
    let text = String::from_utf8_lossy(&output.stdout);
    let field = |name: &str| -> Option<f64> {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
    };
    let processed = field("number of transactions actually processed:")? as u64;
    let failed = field("number of failed transactions:").unwrap_or(0.0) as u64;
    let elapsed = Duration::from_secs_f64(processed as f64 / field("tps =")?);
    Some(Run {
        latencies: Vec::new(),
        errors: failed,
        elapsed,
        counted: Some(processed),
    })
}

/// A plan body whose content holds `objects` small objects.
fn sized_body(run: &str, objects: usize) -> String {
    let items = vec![r#"{"a":1}"#; objects].join(",");
    format!(
        r#"{{"run_id":"{run}","approved_inputs":[{{"id":"forecast-v12"}}],"content":{{"items":[{items}]}}}}"#
    )
}

/// New plans of each size in `PLAN_SIZES`, with their CPU per request.
fn plan_sizes(service: &Service, token: &str, options: &Options) -> Vec<(String, Run, (f64, f64))> {
    PLAN_SIZES
        .iter()
        .map(|&(name, objects)| {
            let template = sized_body("RUN", objects);
            let (run, cpu) = new_plans(
                service,
                token,
                &format!("size{objects}"),
                &move |key: &str| template.replacen("RUN", key, 1),
                options,
            );
            (
                format!(
                    "new plans, {name} ({} bytes)",
                    sized_body("", objects).len()
                ),
                run,
                cpu,
            )
        })
        .collect()
}

/// New plans through HTTP, keys `{tag}-{client}-{sequence}`, bodies made
/// by `body`; the run and its CPU ms per request (service, load generator).
fn new_plans(
    service: &Service,
    token: &str,
    tag: &str,
    body: &(dyn Fn(&str) -> String + Sync),
    options: &Options,
) -> (Run, (f64, f64)) {
    let tokens = [token.to_owned()];
    let (mut run, cpu, refused) = new_plans_from(
        service,
        &tokens,
        options.concurrency,
        tag,
        body,
        options.duration,
    );
    run.errors += refused;
    (run, cpu)
}

/// New plans from `clients` clients, client `c` signed in as
/// `tokens[c % len]`: the run of 201s (errors: any answer but 201, 429 or
/// 503 with `Retry-After`), its CPU ms per plan, and how many 429 and 503
/// answers came.
fn new_plans_from(
    service: &Service,
    tokens: &[String],
    clients: usize,
    tag: &str,
    body: &(dyn Fn(&str) -> String + Sync),
    duration: Duration,
) -> (Run, (f64, f64), u64) {
    new_plans_logged(service, tokens, clients, tag, body, duration, None)
}

/// [`new_plans_from`], adding when each 201 arrived to `completed`.
fn new_plans_logged(
    service: &Service,
    tokens: &[String],
    clients: usize,
    tag: &str,
    body: &(dyn Fn(&str) -> String + Sync),
    duration: Duration,
    completed: Option<&std::sync::Mutex<Vec<(String, Instant)>>>,
) -> (Run, (f64, f64), u64) {
    let mark = (service.cpu_seconds(), cpu_seconds_of("self"));
    let stop = AtomicBool::new(false);
    let (run, refused) = thread::scope(|scope| {
        let started = Instant::now();
        let clients: Vec<_> = (0..clients)
            .map(|c| {
                let stop = &stop;
                let token = &tokens[c % tokens.len()];
                scope.spawn(move || {
                    let agent = http_client(c);
                    let mut latencies = Vec::new();
                    let mut done_at = Vec::new();
                    let (mut errors, mut refused) = (0, 0);
                    let mut s = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let key = format!("{tag}-{c}-{s}");
                        let begun = Instant::now();
                        match post_status(&agent, &service.addr, token, &key, &body(&key)) {
                            Some(201) => {
                                latencies.push(begun.elapsed());
                                done_at.push((key, Instant::now()));
                            }
                            Some(429 | 503) => refused += 1,
                            _ => errors += 1,
                        }
                        s += 1;
                    }
                    if let Some(completed) = completed {
                        completed.lock().expect("completions").extend(done_at);
                    }
                    (latencies, errors, refused)
                })
            })
            .collect();
        thread::sleep(duration);
        stop.store(true, Ordering::Relaxed);
        let mut run = Run {
            latencies: Vec::new(),
            errors: 0,
            elapsed: Duration::ZERO,
            counted: None,
        };
        let mut refused = 0;
        for client in clients {
            let (latencies, errors, turned_away) = client.join().expect("client");
            run.latencies.extend(latencies);
            run.errors += errors;
            refused += turned_away;
        }
        run.elapsed = started.elapsed();
        (run, refused)
    });
    let per = |seconds: f64| seconds * 1000.0 / run.latencies.len().max(1) as f64;
    let cpu = (
        per(service.cpu_seconds() - mark.0),
        per(cpu_seconds_of("self") - mark.1),
    );
    (run, cpu, refused)
}

/// A signing key made by `signing-keys generate` in `dir` (its public
/// half beside it, `.pub`).
fn generated_key(dir: &std::path::Path) -> std::path::PathBuf {
    let key = dir.join("bench.key");
    let made = Command::new(BIN)
        .args(["signing-keys", "generate", "--out"])
        .arg(&key)
        .output()
        .expect("generate a key");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    key
}

/// Rounds of each in the signing comparison, alternating.
const EVIDENCE_ROUNDS: u32 = 4;

/// New plans with receipts signed and logged, and without.
struct Evidence {
    off: Run,
    off_cpu: (f64, f64),
    on: Run,
    on_cpu: (f64, f64),
    /// From each acknowledged plan (signed service) to the first
    /// checkpoint that covers it, as sampled every 50 ms.
    lag: Run,
    /// From the load's end until the log covered every plan.
    caught_up_after: Duration,
}

/// The service with a signing key (receipts signed, the log appended)
/// against the same service without, each on a fresh database of its own
/// so neither table is larger, in alternating rounds so a drift of the
/// host falls on both; and, while the signed one is loaded, how long after
/// a plan's 201 a signed checkpoint covers it. The log appends in feed
/// order, which is commit order here, so the k-th acknowledged plan is
/// taken to be covered once a checkpoint has k leaves.
fn evidence_on_and_off(backend: &str, options: &Options, pool_size: u32) -> Evidence {
    let (off_url, off_cleanup) = fresh_database(backend, options);
    let (on_url, on_cleanup) = fresh_database(backend, options);
    let key_dir = tempfile::tempdir().expect("temp dir");
    let key = generated_key(key_dir.path());
    let login = |url: &str| {
        let db = Database::open(url, &PoolOptions::default(), MigrateOnOpen::Apply)
            .expect("open the database");
        add_login(&db, "bench", Permission::PlansSubmit)
    };
    let (off_token, on_token) = ([login(&off_url)], [login(&on_url)]);
    let off = Service::start(&off_url, pool_size);
    let on = Service::start_with(
        &on_url,
        pool_size,
        &["--signing-key", key.to_str().expect("utf-8 path")],
    );
    let round = options.duration / EVIDENCE_ROUNDS;
    let completed = std::sync::Mutex::new(Vec::new());
    let samples = std::sync::Mutex::new(Vec::<(Instant, u64)>::new());
    let checkpoint_size = |addr: &str| -> u64 {
        ureq::get(&format!("http://{addr}/v1/checkpoint"))
            .call()
            .ok()
            .and_then(|r| r.into_string().ok())
            .and_then(|note| note.lines().nth(1)?.parse().ok())
            .unwrap_or(0)
    };
    let (mut offs, mut ons) = (Vec::new(), Vec::new());
    let sampling = AtomicBool::new(true);
    let load_ended = thread::scope(|scope| {
        scope.spawn(|| {
            while sampling.load(Ordering::Relaxed) {
                let size = checkpoint_size(&on.addr);
                samples
                    .lock()
                    .expect("samples")
                    .push((Instant::now(), size));
                thread::sleep(Duration::from_millis(50));
            }
        });
        for r in 0..EVIDENCE_ROUNDS {
            let (run, cpu, refused) = new_plans_from(
                &off,
                &off_token,
                options.concurrency,
                &format!("ev-off-{r}"),
                &body,
                round,
            );
            offs.push((run, cpu, refused));
            let (run, cpu, refused) = new_plans_logged(
                &on,
                &on_token,
                options.concurrency,
                &format!("ev-on-{r}"),
                &body,
                round,
                Some(&completed),
            );
            ons.push((run, cpu, refused));
        }
        let ended = Instant::now();
        let created = completed.lock().expect("completions").len() as u64;
        while checkpoint_size(&on.addr) < created && ended.elapsed() < Duration::from_secs(60) {
            thread::sleep(Duration::from_millis(50));
        }
        let caught_up = ended.elapsed();
        samples
            .lock()
            .expect("samples")
            .push((Instant::now(), checkpoint_size(&on.addr)));
        sampling.store(false, Ordering::Relaxed);
        caught_up
    });
    let together = |runs: Vec<(Run, (f64, f64), u64)>| {
        let n = runs.len().max(1) as f64;
        let cpu = runs
            .iter()
            .fold((0.0, 0.0), |(a, b), (_, c, _)| (a + c.0 / n, b + c.1 / n));
        let run = Run {
            errors: runs.iter().map(|(r, _, refused)| r.errors + refused).sum(),
            elapsed: runs.iter().map(|(r, _, _)| r.elapsed).sum(),
            latencies: runs.into_iter().flat_map(|(r, _, _)| r.latencies).collect(),
            counted: None,
        };
        (run, cpu)
    };
    let mut completed: Vec<Instant> = completed
        .into_inner()
        .expect("completions")
        .into_iter()
        .map(|(_, at)| at)
        .collect();
    completed.sort();
    let samples = samples.into_inner().expect("samples");
    let mut lag = Vec::with_capacity(completed.len());
    let mut sample = 0;
    for (k, done) in completed.iter().enumerate() {
        while sample < samples.len() && samples[sample].1 < k as u64 + 1 {
            sample += 1;
        }
        if let Some((covered_at, _)) = samples.get(sample) {
            lag.push(covered_at.saturating_duration_since(*done));
        }
    }
    let (off_run, off_cpu) = together(offs);
    let (on_run, on_cpu) = together(ons);
    drop((off, on));
    off_cleanup();
    on_cleanup();
    Evidence {
        lag: Run {
            errors: (completed.len() - lag.len()) as u64,
            elapsed: Duration::from_secs(1),
            latencies: lag,
            counted: None,
        },
        off: off_run,
        off_cpu,
        on: on_run,
        on_cpu,
        caught_up_after: load_ended,
    }
}

/// A follower's view of the load: when each plan (by `run_id`) was
/// handed on, and what the process cost.
struct Followed {
    /// Milliseconds from each plan's 201 to its line on the follower's
    /// stdout.
    delay: Run,
    /// Plans acknowledged but never handed on within a minute of the load.
    missing: usize,
    /// CPU ms per 1,000 receipts handed on (user + system, whole process).
    cpu_ms_per_1000: f64,
}

/// Followers read side by side from one run.
struct Followers {
    plans: usize,
    rate: f64,
    /// Each follower's name and what it did; the first is the baseline.
    followed: Vec<(String, Followed)>,
    limit: u32,
}

/// Receipts per page every follower asks for (the default).
const FOLLOW_LIMIT: u32 = 100;

/// One follower of the followers' scenarios.
enum Follower {
    /// `plan-intake follow` to stdout: the baseline.
    Stdout,
    /// `plan-intake follow --verify --keys KEY.pub` to stdout.
    StdoutVerified,
    /// `plan-intake follow --into URL` (the consumer's backend, its URL),
    /// with `--verify` or not.
    Inbox(&'static str, String, bool),
}

impl Follower {
    fn name(&self) -> String {
        match self {
            Self::Stdout => "follow (baseline, unverified)".to_owned(),
            Self::StdoutVerified => "follow --verify --keys KEY.pub".to_owned(),
            Self::Inbox(consumer, _, false) => format!("follow --into {consumer}"),
            Self::Inbox(consumer, _, true) => format!("follow --into {consumer} --verify"),
        }
    }
}

/// When each run_id arrived where a follower hands it on.
type Arrivals = Arc<std::sync::Mutex<std::collections::HashMap<String, Instant>>>;

/// The run_id of a feed entry (a receipt, or an expanded plan's).
fn run_id_of(entry: &str) -> Option<String> {
    let entry = serde_json::from_str::<serde_json::Value>(entry).ok()?;
    let receipt = entry.get("receipt").unwrap_or(&entry);
    Some(receipt.get("run_id")?.as_str()?.to_owned())
}

/// Each line on a follower's stdout, timed as it comes.
fn time_lines(out: std::process::ChildStdout) -> Arrivals {
    let seen = Arrivals::default();
    let into = seen.clone();
    thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            let at = Instant::now();
            if let Some(run) = run_id_of(&line) {
                into.lock().expect("seen").insert(run, at);
            }
        }
    });
    seen
}

/// Each row committed in an inbox, timed by a reader polling it every
/// 5 ms (so each time is late by up to 5 ms) until `done`.
fn time_rows(consumer: &str, url: &str, done: Arc<AtomicBool>) -> Arrivals {
    #[derive(QueryableByName)]
    struct Kept {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        inbox_seq: i64,
        #[diesel(sql_type = diesel::sql_types::Text)]
        receipt: String,
    }
    let seen = Arrivals::default();
    let into = seen.clone();
    let (consumer, url) = (consumer.to_owned(), url.to_owned());
    thread::spawn(move || {
        let mut pg = (consumer == "postgres")
            .then(|| PgConnection::establish(&url).expect("the Postgres inbox"));
        let mut lite = (consumer == "sqlite")
            .then(|| SqliteConnection::establish(&url).expect("the SQLite inbox"));
        let mut last = 0i64;
        while !done.load(Ordering::SeqCst) {
            let query = format!(
                "SELECT inbox_seq, receipt FROM plan_intake_inbox WHERE inbox_seq > {last} ORDER BY inbox_seq"
            );
            let rows: Vec<Kept> = match (&mut pg, &mut lite) {
                (Some(conn), _) => diesel::sql_query(query).load(conn),
                (_, Some(conn)) => diesel::sql_query(query).load(conn),
                _ => Ok(Vec::new()),
            }
            .unwrap_or_default();
            let at = Instant::now();
            for row in rows {
                last = row.inbox_seq;
                if let Some(run) = run_id_of(&row.receipt) {
                    into.lock().expect("seen").insert(run, at);
                }
            }
            thread::sleep(Duration::from_millis(5));
        }
    });
    seen
}

/// A signing service under new plans at N clients for the run's duration,
/// followed from the feed's start by each of `kinds`, each a process of
/// its own with the same page size; for every plan, the time from its 201
/// to where each follower hands it on (its stdout, its inbox), and each
/// follower's CPU per receipt.
fn followers_side_by_side(
    backend: &str,
    options: &Options,
    pool_size: u32,
    kinds: &[Follower],
) -> Followers {
    let (url, cleanup) = fresh_database(backend, options);
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generated_key(dir.path());
    let (token, orders) = {
        let db = Database::open(&url, &PoolOptions::default(), MigrateOnOpen::Apply)
            .expect("open the database");
        (
            add_login(&db, "bench", Permission::PlansSubmit),
            add_login(&db, "bench-orders", Permission::ReceiptsRead),
        )
    };
    let token_file = dir.path().join("orders.token");
    std::fs::write(&token_file, &orders).expect("write the token");
    let service = Service::start_with(
        &url,
        pool_size,
        &["--signing-key", key.to_str().expect("utf-8 path")],
    );
    let public = format!("{}.pub", key.display());
    let polling = Arc::new(AtomicBool::new(false));
    let mut followers: Vec<(Child, Arrivals)> = kinds
        .iter()
        .enumerate()
        .map(|(n, kind)| {
            let mut command = Command::new(BIN);
            command
                .args([
                    "follow",
                    "--from-start",
                    "--limit",
                    &FOLLOW_LIMIT.to_string(),
                ])
                .arg("--url")
                .arg(format!("http://{}", service.addr))
                .arg("--token-file")
                .arg(&token_file);
            match kind {
                Follower::Inbox(_, url, _) => command.args(["--into", url]),
                _ => command
                    .arg("--cursor-file")
                    .arg(dir.path().join(format!("{n}.cursor"))),
            };
            if matches!(kind, Follower::StdoutVerified | Follower::Inbox(_, _, true)) {
                command.args(["--verify", "--keys", &public]);
            }
            let mut child = command
                .env("PLAN_INTAKE_LOG", "warn")
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("start a follower");
            let seen = match kind {
                Follower::Inbox(consumer, url, _) => time_rows(consumer, url, polling.clone()),
                _ => time_lines(child.stdout.take().expect("stdout")),
            };
            (child, seen)
        })
        .collect();
    let completed = std::sync::Mutex::new(Vec::new());
    let (run, _, _) = new_plans_logged(
        &service,
        &[token],
        options.concurrency,
        "followed",
        &body,
        options.duration,
        Some(&completed),
    );
    let completed = completed.into_inner().expect("completions");
    let ended = Instant::now();
    while ended.elapsed() < Duration::from_secs(60)
        && followers
            .iter()
            .any(|(_, seen)| seen.lock().expect("seen").len() < completed.len())
    {
        thread::sleep(Duration::from_millis(50));
    }
    polling.store(true, Ordering::SeqCst);
    let cpu: Vec<f64> = followers
        .iter()
        .map(|(child, _)| cpu_seconds_of(&child.id().to_string()))
        .collect();
    for (child, _) in &mut followers {
        let _ = child.kill();
        let _ = child.wait();
    }
    let followed = |seen: &Arrivals, cpu: f64| {
        let seen = seen.lock().expect("seen");
        let delays: Vec<Duration> = completed
            .iter()
            .filter_map(|(run, done)| Some(seen.get(run)?.saturating_duration_since(*done)))
            .collect();
        Followed {
            missing: completed.len() - delays.len(),
            cpu_ms_per_1000: cpu * 1000.0 * 1000.0 / seen.len().max(1) as f64,
            delay: Run {
                latencies: delays,
                errors: 0,
                elapsed: Duration::from_secs(1),
                counted: None,
            },
        }
    };
    let result = Followers {
        plans: completed.len(),
        rate: run.rate(),
        followed: kinds
            .iter()
            .zip(&followers)
            .zip(&cpu)
            .map(|((kind, (_, seen)), cpu)| (kind.name(), followed(seen, *cpu)))
            .collect(),
        limit: FOLLOW_LIMIT,
    };
    drop(service);
    cleanup();
    result
}

fn print_followers(backend: &str, followers: &Followers) {
    println!(
        "{backend}: followers: {} new plans at {:.0}/s on a signing service, pages of {}",
        followers.plans, followers.rate, followers.limit
    );
    let baseline = followers.followed.first().map(|(_, f)| f.cpu_ms_per_1000);
    for (name, f) in &followers.followed {
        println!(
            "{backend}: {name:<38} from 201 to handed on: p50 {:>6.0} ms, p99 {:>6.0} ms, max {:>6.0} ms; {} not handed on; CPU {:.1} ms per 1,000 receipts ({:.2}x the baseline's)",
            ms(f.delay.percentile(0.5)).unwrap_or(f64::NAN),
            ms(f.delay.percentile(0.99)).unwrap_or(f64::NAN),
            ms(f.delay.percentile(1.0)).unwrap_or(f64::NAN),
            f.missing,
            f.cpu_ms_per_1000,
            baseline.map_or(f64::NAN, |b| f.cpu_ms_per_1000 / b),
        );
    }
}

/// Readers asking for the first 100 receipts of the feed, 4 at a time.
fn feed_pages(service: &Service, orders: &str, options: &Options) -> (Run, (f64, f64)) {
    let mark = (service.cpu_seconds(), cpu_seconds_of("self"));
    let (addr, token) = (service.addr.clone(), orders.to_owned());
    let run = drive(
        4,
        options.duration.min(Duration::from_secs(5)),
        http_client,
        move |agent, _, _| {
            agent
                .get(&format!("http://{addr}/v1/receipts?limit=100"))
                .set("Authorization", &format!("Bearer {token}"))
                .call()
                .ok()
                .and_then(|r| r.into_string().ok())
                .is_some_and(|body| body.matches("receipt_id").count() == 100)
        },
    );
    let per = |seconds: f64| seconds * 1000.0 / run.latencies.len().max(1) as f64;
    let cpu = (
        per(service.cpu_seconds() - mark.0),
        per(cpu_seconds_of("self") - mark.1),
    );
    (run, cpu)
}

/// Stores `count` plans (and their key rows) by SQL, around the service,
/// as years of use would leave them, then refreshes the planner's figures.
fn load_stored_plans(db: &Database, count: u64) {
    let started = Instant::now();
    execute(
        db,
        &format!(
            "INSERT INTO plans (receipt_id, maker, run_id, content_hash, request_hash, content,
                                approved_inputs, permissions, received_at)
             SELECT 'rcpt_grown_' || g, 'bench', 'grown-' || g, 'blake3:grown' || g,
                    'blake3:grown' || g,
                    '{{\"lines\":[{{\"qty\":3,\"sku\":\"A-1\"}}],\"note\":\"stored\"}}',
                    '[{{\"id\":\"forecast-v12\"}}]', '[\"plans:submit\"]', now()
               FROM generate_series(1, {count}) g;
             INSERT INTO intake_keys (maker, idempotency_key, request_hash, plan_id, created_at)
             SELECT maker, run_id, request_hash, id, received_at FROM plans
              WHERE receipt_id LIKE 'rcpt_grown_%';"
        ),
    );
    // Each on its own: VACUUM cannot run inside a transaction block.
    execute(db, "VACUUM ANALYZE plans");
    execute(db, "VACUUM ANALYZE intake_keys");
    println!(
        "growth: {count} plans stored by SQL in {:.0} s",
        started.elapsed().as_secs_f64()
    );
}

fn add_login(db: &Database, name: &str, permission: Permission) -> String {
    let mut conn = db.conn().expect("connection");
    plan_intake::intake::login::create(&mut conn, name, &[permission]).expect("login")
}

/// A plan as the runs without HTTP write it: `{tag}-{client}-{sequence}`
/// makes its receipt, run and hashes unique.
fn bench_plan(tag: &str, client: usize, sequence: u64) -> NewPlan {
    let unique = format!("{tag}-{client}-{sequence}");
    NewPlan {
        receipt_id: format!("rcpt_{tag}_{client}_{sequence}"),
        maker: "bench".to_owned(),
        run_id: unique.clone(),
        content_hash: format!("blake3:{unique}"),
        request_hash: format!("blake3:{unique}"),
        content: r#"{"lines":[{"qty":3,"sku":"A-1"},{"qty":1.5,"sku":"B-2"}],"note":"benchmark"}"#
            .to_owned(),
        approved_inputs: r#"[{"digest":"blake3:00ff","id":"forecast-v12"},{"id":"prices-v3"}]"#
            .to_owned(),
        permissions: r#"["plans:submit"]"#.to_owned(),
        received_at: plan_intake::clock::now_micros(),
        receipt_signature: None,
    }
}

/// The baseline (the same two-row transaction, straight through diesel)
/// and the database's own ceiling for the service's write (the call the
/// service makes, `Database::write_plan`), both without HTTP.
fn without_http(db: &Database, options: &Options, token: &str, tag: &str) -> (Run, Run) {
    let base_tag = format!("{tag}-base");
    let baseline_db = db.clone();
    let baseline = drive(
        options.concurrency,
        options.duration,
        |_| (),
        move |_, client, sequence| {
            let Ok(mut conn) = baseline_db.conn() else {
                return false;
            };
            let plan = bench_plan(&base_tag, client, sequence);
            hand_rolled_insert(&mut conn, &plan, &plan.run_id).is_ok()
        },
    );
    (
        baseline,
        write_only(db, options.duration, options, token, &format!("{tag}-ceil")),
    )
}

/// `Database::write_plan` (the call the service makes) for `duration`,
/// without HTTP; plans tagged `tag`.
fn write_only(db: &Database, duration: Duration, options: &Options, token: &str, tag: &str) -> Run {
    let token_hash = plan_intake::intake::login::token_hash(token);
    let (tag, ceiling_db) = (tag.to_owned(), db.clone());
    drive(
        options.concurrency,
        duration,
        |_| (),
        move |_, client, sequence| {
            let plan = std::sync::Arc::new(bench_plan(&tag, client, sequence));
            let deadline = plan_intake::deadline::Deadline::after(Duration::from_secs(10));
            matches!(
                ceiling_db.write_plan(&plan, &plan.run_id, &token_hash, &deadline),
                Ok(plan_intake::storage::plans::Written::Created(_))
            )
        },
    )
}

/// Postgres: the write with the push to other instances on (this process
/// notifying as a service instance does) against the same write with the
/// push off and every trigger on `plans` disabled, alternated in four
/// rounds so that drift favours neither; each is the rounds together.
fn push_on_and_off(url: &str, db: &Database, options: &Options, token: &str) -> (Run, Run) {
    let pushing = Database::open(
        url,
        &PoolOptions {
            max_size: options.concurrency as u32,
            feed_listener: true,
            ..PoolOptions::default()
        },
        MigrateOnOpen::Skip,
    )
    .expect("open the pushing instance's database");
    let round = options.duration / 4;
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for r in 0..4 {
        on.push(write_only(
            &pushing,
            round,
            options,
            token,
            &format!("push-on-{r}"),
        ));
        execute(db, "ALTER TABLE plans DISABLE TRIGGER ALL");
        off.push(write_only(
            db,
            round,
            options,
            token,
            &format!("push-off-{r}"),
        ));
        execute(db, "ALTER TABLE plans ENABLE TRIGGER ALL");
    }
    let together = |runs: Vec<Run>| Run {
        errors: runs.iter().map(|r| r.errors).sum(),
        elapsed: runs.iter().map(|r| r.elapsed).sum(),
        latencies: runs.into_iter().flat_map(|r| r.latencies).collect(),
        counted: None,
    };
    (together(on), together(off))
}

/// A scenario's run, its CPU ms per request (service, load generator) and
/// its mean write batch size.
type Measured = (Run, (f64, f64), Option<f64>);

/// The HTTP scenarios against one service, each with its CPU cost per
/// request (service, load generator), and the service's peak RSS.
struct HttpRuns {
    /// Each scenario: its run, CPU ms per request (service, load
    /// generator), and its mean write batch size.
    scenarios: Vec<(&'static str, Measured)>,
    rss_mib: f64,
}

/// Requests a second with tokens no login has, in the strangers scenario.
const STRANGERS_PER_SECOND: u64 = 2_000;
/// Connections the strangers come over.
const STRANGER_CONNECTIONS: u64 = 64;

/// New plans from one planner on 8 clients for `duration` alone, then as
/// long again while strangers (well-formed random tokens) post at
/// `STRANGERS_PER_SECOND`, paced so the load is the same whatever the
/// service does; both runs, and how the strangers were answered.
fn beside_strangers(
    service: &Service,
    token: &str,
    duration: Duration,
) -> (Run, Run, std::collections::BTreeMap<u16, u64>) {
    let tokens = [token.to_owned()];
    let (alone, _, _) = new_plans_from(service, &tokens, 8, "alone", &body, duration);
    let stop = AtomicBool::new(false);
    let (among, answers) = thread::scope(|scope| {
        let senders: Vec<_> = (0..STRANGER_CONNECTIONS)
            .map(|c| {
                let stop = &stop;
                scope.spawn(move || {
                    let agent = http_client(0);
                    let every = Duration::from_secs_f64(
                        STRANGER_CONNECTIONS as f64 / STRANGERS_PER_SECOND as f64,
                    );
                    let mut answers = std::collections::BTreeMap::new();
                    let mut next = Instant::now();
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let token = format!("pit_{:032x}", rand::random::<u128>());
                        let key = format!("stranger-{c}-{i}");
                        let status = post_status(&agent, &service.addr, &token, &key, &body(&key))
                            .unwrap_or(0);
                        *answers.entry(status).or_insert(0u64) += 1;
                        i += 1;
                        next += every;
                        if let Some(wait) = next.checked_duration_since(Instant::now()) {
                            thread::sleep(wait);
                        }
                    }
                    answers
                })
            })
            .collect();
        let (among, _, _) = new_plans_from(service, &tokens, 8, "among", &body, duration);
        stop.store(true, Ordering::Relaxed);
        let mut answers = std::collections::BTreeMap::new();
        for sender in senders {
            for (status, n) in sender.join().expect("a stranger") {
                *answers.entry(status).or_insert(0) += n;
            }
        }
        (among, answers)
    });
    (alone, among, answers)
}

/// Connections the public flood comes over, paced together at
/// `FLOOD_PER_SECOND` so that the load is the same whatever the service
/// does (and the load generator leaves the service its cores).
const FLOOD_CONNECTIONS: usize = 200;
const FLOOD_PER_SECOND: u64 = 2_000;
/// Threads the flood's connections are shared among.
const FLOOD_THREADS: usize = 4;

/// One keep-alive HTTP/1.1 connection spoken by hand: a GET, and its
/// answer's status once the whole answer has arrived (0: the connection
/// failed, and is made again).
struct RawHttp {
    stream: Option<std::net::TcpStream>,
    read: Vec<u8>,
}

impl RawHttp {
    fn connect(addr: &str) -> Self {
        Self {
            stream: std::net::TcpStream::connect(addr).ok(),
            read: Vec::new(),
        }
    }

    fn send(&mut self, addr: &str, path: &str) {
        use std::io::Write as _;
        if self.stream.is_none() {
            self.stream = std::net::TcpStream::connect(addr).ok();
        }
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n");
        let sent = self
            .stream
            .as_mut()
            .is_some_and(|s| s.write_all(request.as_bytes()).is_ok());
        if !sent {
            self.stream = None;
        }
        self.read.clear();
    }

    /// The answer's status if it has all arrived, without waiting.
    fn try_answer(&mut self) -> Option<u16> {
        use std::io::Read as _;
        let Some(stream) = self.stream.as_mut() else {
            return Some(0);
        };
        let _ = stream.set_nonblocking(true);
        let mut buffer = [0u8; 16 * 1024];
        loop {
            match stream.read(&mut buffer) {
                Ok(0) => {
                    self.stream = None;
                    return Some(0);
                }
                Ok(n) => self.read.extend_from_slice(&buffer[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    self.stream = None;
                    return Some(0);
                }
            }
        }
        let _ = stream.set_nonblocking(false);
        self.complete()
    }

    /// A GET, waiting for its answer.
    fn get(&mut self, addr: &str, path: &str) -> u16 {
        use std::io::Read as _;
        self.send(addr, path);
        let mut buffer = [0u8; 64 * 1024];
        loop {
            if let Some(status) = self.complete() {
                return status;
            }
            let Some(stream) = self.stream.as_mut() else {
                return 0;
            };
            match stream.read(&mut buffer) {
                Ok(n) if n > 0 => self.read.extend_from_slice(&buffer[..n]),
                _ => {
                    self.stream = None;
                    return 0;
                }
            }
        }
    }

    /// The status of the answer read so far, once its head and
    /// `Content-Length` bytes of body are in.
    fn complete(&self) -> Option<u16> {
        let end = self.read.windows(4).position(|w| w == b"\r\n\r\n")?;
        let head = std::str::from_utf8(&self.read[..end]).ok()?;
        let status = head.split(' ').nth(1)?.parse().ok()?;
        let length: usize = head
            .lines()
            .find_map(|line| {
                let (name, value) = line.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse().ok())
                    .flatten()
            })
            .unwrap_or(0);
        (self.read.len() >= end + 4 + length).then_some(status)
    }
}

/// Of those, how many wait on `/v1/checkpoint/extension` for a size the
/// log has not reached.
const FLOOD_WAITERS: usize = 500;

/// The stranger's budget (issue 50): planners on `options.concurrency`
/// clients of a signing service alone, then beside `FLOOD_CONNECTIONS`
/// connections with no token cycling through the public routes and
/// `FLOOD_WAITERS` waiting readers, then alone again; prints their rate
/// and p99 beside each other and against the budget (rate >= 0.9x,
/// p99 <= 1.5x of alone, alone taken as the better of the two runs).
fn public_flood(backend: &'static str, options: &Options) {
    let (url, cleanup) = fresh_database(backend, options);
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generated_key(dir.path());
    let token = {
        let db = Database::open(&url, &PoolOptions::default(), MigrateOnOpen::Apply)
            .expect("open the database");
        add_login(&db, "bench", Permission::PlansSubmit)
    };
    let pool_size = if backend == "postgres" {
        options.concurrency as u32
    } else {
        8
    };
    let service = Service::start_with(
        &url,
        pool_size,
        &["--signing-key", key.to_str().expect("utf-8 path")],
    );
    let tokens = [token];
    let clients = options.concurrency;
    // Some receipts first, so that full tiles exist to be asked for.
    let (warm, _, _) = new_plans_from(&service, &tokens, clients, "warm", &body, options.duration);
    let logged = checkpoint_size_of(&service.addr, warm.latencies.len() as u64);
    let (before, _, _) = new_plans_from(
        &service,
        &tokens,
        clients,
        "before",
        &body,
        options.duration,
    );
    let stop = AtomicBool::new(false);
    let routes: Vec<&str> = options.flood_routes.iter().map(String::as_str).collect();
    let routes = routes.as_slice();
    let (among, answers) = thread::scope(|scope| {
        let stop = &stop;
        let addr = service.addr.as_str();
        // A lean generator, so that what the planners lose is the
        // service's cost and not the load generator's: FLOOD_THREADS
        // threads pacing requests over FLOOD_CONNECTIONS raw keep-alive
        // sockets, and one thread holding every waiter's socket.
        let floods: Vec<_> = (0..FLOOD_THREADS)
            .map(|t| {
                scope.spawn(move || {
                    let full_tiles = (logged / 256).max(1);
                    let mut answers = std::collections::BTreeMap::<(&str, u16), u64>::new();
                    let mut sockets: Vec<RawHttp> = (0..FLOOD_CONNECTIONS / FLOOD_THREADS)
                        .map(|_| RawHttp::connect(addr))
                        .collect();
                    let every =
                        Duration::from_secs_f64(FLOOD_THREADS as f64 / options.flood_rate as f64);
                    let mut next = Instant::now();
                    let mut i = t as u64;
                    while !stop.load(Ordering::Relaxed) {
                        let tile = tile_path(i % full_tiles);
                        let pick = routes[(i % routes.len() as u64) as usize];
                        let (route, path) = match pick {
                            "entry-tile" => ("entry tile", format!("/v1/log/tile/entries/{tile}")),
                            "hash-tile" => ("hash tile", format!("/v1/log/tile/0/{tile}")),
                            "checkpoint" => ("checkpoint", "/v1/checkpoint".to_owned()),
                            "extension" => (
                                "extension",
                                format!("/v1/checkpoint/extension?size={}", logged.max(1)),
                            ),
                            "signing-keys" => ("signing keys", "/v1/signing-keys".to_owned()),
                            _ => ("readyz", "/readyz".to_owned()),
                        };
                        let n = sockets.len();
                        let socket = &mut sockets[(i as usize / FLOOD_THREADS) % n];
                        let status = socket.get(addr, &path);
                        *answers.entry((route, status)).or_insert(0) += 1;
                        i += FLOOD_THREADS as u64;
                        next += every;
                        if let Some(wait) = next.checked_duration_since(Instant::now()) {
                            thread::sleep(wait);
                        }
                    }
                    answers
                })
            })
            .collect();
        let waiters = scope.spawn(move || {
            let path = "/v1/checkpoint/extension?size=1000000000&wait=10";
            let mut answers = std::collections::BTreeMap::<(&str, u16), u64>::new();
            // Each waiter: its socket, and when it asks again (None: asking).
            let mut waiting: Vec<(RawHttp, Option<Instant>)> = (0..options.flood_waiters)
                .map(|_| (RawHttp::connect(addr), Some(Instant::now())))
                .collect();
            while !stop.load(Ordering::Relaxed) {
                for (socket, again) in &mut waiting {
                    match again {
                        Some(at) if *at <= Instant::now() => {
                            socket.send(addr, path);
                            *again = None;
                        }
                        Some(_) => {}
                        None => {
                            if let Some(status) = socket.try_answer() {
                                *answers.entry(("extension wait", status)).or_insert(0) += 1;
                                // As a poller would: again a second after
                                // a quick answer, at once after a wait.
                                *again = Some(Instant::now() + Duration::from_secs(1));
                            }
                        }
                    }
                }
                thread::sleep(Duration::from_millis(5));
            }
            answers
        });
        let (among, _, _) =
            new_plans_from(&service, &tokens, clients, "among", &body, options.duration);
        stop.store(true, Ordering::Relaxed);
        let mut answers = std::collections::BTreeMap::new();
        for sender in floods.into_iter().chain([waiters]) {
            for (route, n) in sender.join().expect("a stranger") {
                *answers.entry(route).or_insert(0u64) += n;
            }
        }
        (among, answers)
    });
    let (after, _, _) =
        new_plans_from(&service, &tokens, clients, "after", &body, options.duration);
    let p99 = |run: &Run| ms(run.percentile(0.99)).unwrap_or(f64::NAN);
    let alone_rate = before.rate().max(after.rate());
    let alone_p99 = p99(&before).min(p99(&after));
    let rate_ratio = among.rate() / alone_rate;
    let p99_ratio = p99(&among) / alone_p99;
    for (name, run) in [
        ("alone", &before),
        ("among strangers", &among),
        ("alone again", &after),
    ] {
        println!(
            "{backend}: public flood: {clients} planner clients {name}: {:.0} new plans/s, p99 {:.2} ms, {} errors",
            run.rate(),
            p99(run),
            run.errors
        );
    }
    println!(
        "{backend}: public flood: {} requests a second with no token over {FLOOD_CONNECTIONS} connections ({}) and {} extension waiters, answered {answers:?}",
        options.flood_rate,
        options.flood_routes.join(", "),
        options.flood_waiters
    );
    let met = rate_ratio >= 0.9 && p99_ratio <= 1.5;
    println!(
        "{backend}: public flood: planners' rate {rate_ratio:.2}x and p99 {p99_ratio:.2}x of alone (budget: rate >= 0.90x, p99 <= 1.50x): {}",
        if met { "met" } else { "MISSED" }
    );
    drop(service);
    cleanup();
}

/// A tile index in the log's path form (`x001/234`).
fn tile_path(index: u64) -> String {
    let digits = format!("{index}");
    let padded = format!("{:0>width$}", digits, width = digits.len().div_ceil(3) * 3);
    let groups: Vec<&str> = padded
        .as_bytes()
        .chunks(3)
        .map(|g| std::str::from_utf8(g).expect("digits"))
        .collect();
    let (last, rest) = groups.split_last().expect("one group");
    rest.iter().map(|g| format!("x{g}/")).collect::<String>() + last
}

/// The status of one GET without a token; 0 when no answer came.
fn get_status(agent: &ureq::Agent, addr: &str, path: &str) -> u16 {
    match agent.get(&format!("http://{addr}{path}")).call() {
        Ok(response) => {
            let status = response.status();
            let _ = response.into_string();
            status
        }
        Err(ureq::Error::Status(status, response)) => {
            let _ = response.into_string();
            status
        }
        Err(_) => 0,
    }
}

/// Waits until the service's newest checkpoint holds `at_least` leaves
/// (the appender signs every few seconds), and gives its size.
fn checkpoint_size_of(addr: &str, at_least: u64) -> u64 {
    let agent = http_client(0);
    let path = format!("/v1/checkpoint/extension?size={}&wait=30", at_least.max(1));
    let _ = get_status(&agent, addr, &path);
    let note = agent
        .get(&format!("http://{addr}/v1/checkpoint"))
        .call()
        .expect("the checkpoint")
        .into_string()
        .expect("its text");
    note.lines()
        .nth(1)
        .and_then(|line| line.parse().ok())
        .expect("a checkpoint's size")
}

fn http_client(_: usize) -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(30))
        .build()
}

fn through_http(service: &Service, token: &str, options: &Options) -> HttpRuns {
    // CPU milliseconds per request, of the service and of this load generator.
    let measured = |run: Run, (mark, batches): ((f64, f64), (f64, f64))| {
        let per = |seconds: f64| seconds * 1000.0 / run.latencies.len().max(1) as f64;
        let cpu = (
            per(service.cpu_seconds() - mark.0),
            per(cpu_seconds_of("self") - mark.1),
        );
        (run, cpu, service.mean_batch_since(batches))
    };
    let cpu_mark = || {
        (
            (service.cpu_seconds(), cpu_seconds_of("self")),
            service.batches(),
        )
    };
    let sender = || (service.addr.clone(), token.to_owned());

    let (a, t) = sender();
    let mark = cpu_mark();
    let new_plans = measured(
        drive(
            options.concurrency,
            options.duration,
            http_client,
            move |agent, c, s| {
                let key = format!("new-{c}-{s}");
                post(agent, &a, &t, &key, &body(&key), &[201])
            },
        ),
        mark,
    );

    let (a, t) = sender();
    let mark = cpu_mark();
    let replays = measured(
        drive(
            options.concurrency,
            options.duration,
            http_client,
            move |agent, c, s| {
                // Replays of keys the new-plan scenario created (client c, its first 200).
                let key = format!("new-{c}-{}", s % 200);
                post(agent, &a, &t, &key, &body(&key), &[200])
            },
        ),
        mark,
    );

    let (a, t) = sender();
    let contended_body = body("contended");
    let mark = cpu_mark();
    let contended = measured(
        drive(
            options.concurrency,
            options.duration,
            http_client,
            move |agent, _, _| post(agent, &a, &t, "one-key", &contended_body, &[200, 201]),
        ),
        mark,
    );
    let rss_mib = service.peak_rss_mib();
    HttpRuns {
        scenarios: vec![
            ("new plans", new_plans),
            ("replays", replays),
            ("one contended key", contended),
        ],
        rss_mib,
    }
}

/// New plans through PgBouncer to 1 and to 4 instances: the scenario, the
/// run and the highest peak RSS among the instances.
fn through_pgbouncer(
    bouncer: &Bouncer,
    pool_size: u32,
    options: &Options,
) -> Vec<(&'static str, Run, f64)> {
    [
        (1usize, "new plans, PgBouncer, 1 instance"),
        (4, "new plans, PgBouncer, 4 instances"),
    ]
    .into_iter()
    .map(|(instances, scenario)| {
        let fleet: Vec<Service> = (0..instances)
            .map(|_| {
                Service::start_with(
                    &bouncer.url,
                    pool_size,
                    &["--no-migrate", "--pg-pooler", "transaction"],
                )
            })
            .collect();
        let addrs: Vec<String> = fleet.iter().map(|s| s.addr.clone()).collect();
        let t = bouncer.token.clone();
        let run = drive(
            options.concurrency,
            options.duration,
            http_client,
            move |agent, c, s| {
                let key = format!("pgb{instances}-{c}-{s}");
                post(
                    agent,
                    &addrs[c % addrs.len()],
                    &t,
                    &key,
                    &body(&key),
                    &[201],
                )
            },
        );
        let rss = fleet.iter().map(Service::peak_rss_mib).fold(0.0, f64::max);
        (scenario, run, rss)
    })
    .collect()
}

fn ms(d: Option<Duration>) -> Option<f64> {
    d.map(|d| d.as_secs_f64() * 1000.0)
}

/// A figure for the table, `-` where there is none.
fn cell(value: Option<f64>, decimals: usize) -> String {
    value.map_or("-".to_owned(), |v| format!("{v:.decimals$}"))
}

/// Both tables on stdout, and the figures as JSON in `target/bench-intake.json`.
fn print_report(options: &Options, rows: &[Row], push_rows: &[PushRow]) {
    println!(
        "\nconcurrency {}, {} s per scenario, {} cores, the service logging at `{SERVICE_LOG}`\n",
        options.concurrency,
        options.duration.as_secs(),
        thread::available_parallelism().map_or(0, |n| n.get())
    );
    let json_rows = print_throughput(rows);
    let json_push = print_push(push_rows);
    let report = json!({
        "concurrency": options.concurrency,
        "duration_seconds": options.duration.as_secs(),
        "service_log_level": SERVICE_LOG,
        "rows": json_rows,
        "push": json_push,
    });
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/target/bench-intake.json");
    match std::fs::write(
        path,
        serde_json::to_string_pretty(&report).unwrap_or_default(),
    ) {
        Ok(()) => println!("\nwritten to {path}"),
        Err(e) => eprintln!("cannot write {path}: {e}"),
    }
}

fn print_throughput(rows: &[Row]) -> Vec<serde_json::Value> {
    println!(
        "| backend | scenario | requests/s | p50 ms | p99 ms | max ms | errors | service peak RSS MiB | / naive two-row | / one-statement ceiling | CPU ms/request: service, load generator | plans per write batch |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut json_rows = Vec::new();
    for row in rows {
        let (p50, p99, max) = (
            ms(row.run.percentile(0.5)),
            ms(row.run.percentile(0.99)),
            ms(row.run.percentile(1.0)),
        );
        println!(
            "| {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            row.backend,
            row.scenario,
            row.run.rate(),
            cell(p50, 2),
            cell(p99, 2),
            cell(max, 2),
            row.run.errors,
            cell(row.rss_mib, 1),
            cell(row.ratio, 2),
            cell(row.of_ceiling, 2),
            row.cpu.map_or("-".to_owned(), |(service, client)| format!(
                "{service:.3}, {client:.3}"
            )),
            cell(row.batch, 1),
        );
        json_rows.push(json!({
            "backend": row.backend,
            "scenario": row.scenario,
            "requests_per_second": row.run.rate(),
            "p50_ms": p50,
            "p99_ms": p99,
            "max_ms": max,
            "errors": row.run.errors,
            "service_peak_rss_mib": row.rss_mib,
            "over_naive_two_row": row.ratio,
            "over_one_statement_ceiling": row.of_ceiling,
            "service_cpu_ms_per_request": row.cpu.map(|c| c.0),
            "load_generator_cpu_ms_per_request": row.cpu.map(|c| c.1),
            "plans_per_write_batch": row.batch,
        }));
    }
    json_rows
}

fn print_push(push_rows: &[PushRow]) -> Vec<serde_json::Value> {
    println!(
        "\npush: from a plan's 201 to a waiting reader's answer (`wait=30`), {PUSH_SAMPLES} plans one at a time\n"
    );
    println!("| backend | reader on | plans seen | p50 ms | p99 ms | max ms | not seen |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    let mut json_push = Vec::new();
    for (backend, reader, run) in push_rows {
        let (p50, p99, max) = (
            ms(run.percentile(0.5)),
            ms(run.percentile(0.99)),
            ms(run.percentile(1.0)),
        );
        println!(
            "| {backend} | {reader} | {} | {} | {} | {} | {} |",
            run.latencies.len(),
            cell(p50, 2),
            cell(p99, 2),
            cell(max, 2),
            run.errors
        );
        json_push.push(json!({
            "backend": backend, "reader_on": reader, "seen": run.latencies.len(),
            "p50_ms": p50, "p99_ms": p99, "max_ms": max, "not_seen": run.errors,
        }));
    }
    json_push
}
