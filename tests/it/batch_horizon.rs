//! The feed's horizon holds for Postgres write batches: no plan is ever
//! written behind a position a reader (or the receipt log) was handed. A
//! call of `plan_intake_write` whose own plan met a kept one (a unique
//! violation, rolled back in its subtransaction) and whose key row then
//! waits, once let its batch's transaction keep its id while it held no
//! lock on `plans`, so the horizon did not see it; a later plan of the same
//! batch then committed behind a cursor already handed out.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use actix_web::http::StatusCode;
use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection, RunQueryDsl};
use futures_util::future::join_all;
use plan_intake::intake::signing::SigningKey;
use plan_intake::intake::{Intake, Permission};
use plan_intake::storage::{PgPooler, PoolOptions};
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};

use crate::support::{
    Answer, AppOptions, TestApp, TestDb, get, plan_body, post_plan, scalar, send, wait_until,
};

const PLANNER: &[Permission] = &[Permission::PlansSubmit];
const READER: &[Permission] = &[Permission::ReceiptsRead];
const ORIGIN: &str = "plan-intake.test/batch-horizon";

/// A session that holds planner-a's `keys` for the plan `receipt_id`,
/// uncommitted, as a racing instance does whose own plan met the kept one:
/// key rows only, no plan, so it holds no lock on `plans` itself.
fn hold_keys(url: &str, receipt_id: &str, keys: &[String]) -> PgConnection {
    let mut session = PgConnection::establish(url).expect("connect");
    let mut sql = "BEGIN;".to_owned();
    for key in keys {
        sql.push_str(&format!(
            "INSERT INTO intake_keys (maker, idempotency_key, request_hash, plan_id, created_at)
                  SELECT 'planner-a', '{key}', 'blake3:held', id, now() FROM plans
                   WHERE receipt_id = '{receipt_id}';"
        ));
    }
    session.batch_execute(&sql).expect("hold the keys");
    session
}

/// How many of the service's sessions (named after the scratch schema)
/// wait for a lock.
fn waiting_on_locks(app: &TestApp, schema: &str) -> i64 {
    scalar(
        &mut app.conn(),
        &format!(
            "SELECT count(*) AS n FROM pg_stat_activity
              WHERE application_name = '{schema}' AND wait_event_type = 'Lock'"
        ),
    )
}

/// How many of the service's sessions wait for a lock `holder` holds.
fn blocked_by(app: &TestApp, schema: &str, holder: &mut PgConnection) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct Pid {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        pid: i32,
    }
    let pid = diesel::sql_query("SELECT pg_backend_pid() AS pid")
        .get_result::<Pid>(holder)
        .expect("the holder's pid")
        .pid;
    scalar(
        &mut app.conn(),
        &format!(
            "SELECT count(*) AS n FROM pg_stat_activity
              WHERE application_name = '{schema}' AND {pid} = ANY(pg_blocking_pids(pid))"
        ),
    )
}

#[derive(diesel::QueryableByName)]
struct ReceiptId {
    #[diesel(sql_type = diesel::sql_types::Text)]
    receipt_id: String,
}

fn receipt_ids(app: &TestApp, sql: &str) -> Vec<String> {
    plan_intake::with_conn!(&mut *app.conn(), c => diesel::sql_query(sql).load::<ReceiptId>(c))
        .expect("read receipt ids")
        .into_iter()
        .map(|r| r.receipt_id)
        .collect()
}

/// Every plan in the table, in feed order.
fn table_in_feed_order(app: &TestApp) -> Vec<String> {
    receipt_ids(app, "SELECT receipt_id FROM plans ORDER BY feed_xid, id")
}

/// Every receipt in the log, in leaf order.
fn log_leaves(app: &TestApp) -> Vec<String> {
    receipt_ids(
        app,
        "SELECT receipt_id FROM receipt_log ORDER BY leaf_index",
    )
}

/// The service's write path, signing, so that it keeps a receipt log.
fn signing(app: &TestApp) -> Intake {
    let (key, _private) = SigningKey::generate("batch-horizon").expect("a key");
    app.intake.clone().signing_with(Arc::new(key))
}

/// Append rounds until one takes nothing more.
fn append_all(intake: &Intake) {
    loop {
        match intake.append_receipts(ORIGIN, 5_000, None, None) {
            Ok(Some(appended)) if appended.to > appended.from => continue,
            Ok(_) => return,
            Err(error) => panic!("an append round failed: {error}"),
        }
    }
}

/// A reader following the feed from its own cursor, as `follow` does.
#[derive(Default)]
struct Follower {
    cursor: Option<String>,
    seen: Vec<String>,
}

impl Follower {
    /// One page of up to `limit` after the cursor; how many it held.
    async fn page<S>(&mut self, service: &S, token: &str, limit: usize) -> usize
    where
        S: actix_web::dev::Service<
                actix_http::Request,
                Response = actix_web::dev::ServiceResponse<actix_web::body::BoxBody>,
                Error = actix_web::Error,
            >,
    {
        let uri = match &self.cursor {
            Some(cursor) => format!("/v1/receipts?after={cursor}&limit={limit}"),
            None => format!("/v1/receipts?limit={limit}"),
        };
        let page = send(service, get(token, &uri)).await;
        assert_eq!(page.status, StatusCode::OK, "{:?}", page.body);
        let receipts = page.body["receipts"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        self.seen.extend(
            receipts
                .iter()
                .map(|r| r["receipt_id"].as_str().unwrap_or_default().to_owned()),
        );
        self.cursor = page.body["next"].as_str().map(str::to_owned);
        receipts.len()
    }

    /// Pages until a page comes back empty.
    async fn catch_up<S>(&mut self, service: &S, token: &str)
    where
        S: actix_web::dev::Service<
                actix_http::Request,
                Response = actix_web::dev::ServiceResponse<actix_web::body::BoxBody>,
                Error = actix_web::Error,
            >,
    {
        while self.page(service, token, 100).await > 0 {}
    }
}

fn receipt_id(answer: &Answer) -> String {
    answer.body["receipt_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// The interleaving of issue 39, step by step: a batch whose first plan
/// meets a kept plan and waits for a key row another session holds, its
/// second a new plan; meanwhile the other writer commits a plan and a
/// reader and the receipt log page to the end; then the key is let go.
/// The batch's new plan must reach the reader after its cursor, and the
/// log, in feed order.
#[actix_web::test]
async fn a_batch_waiting_for_a_held_key_holds_back_every_reader() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let direct_url = scratch.url.clone();
    let (app, schema) = TestApp::named(scratch);
    let planner = app.login("planner-a", PLANNER);
    let reader = app.login("ordering", READER);
    let intake = signing(&app);
    let service = app.service_with(intake.clone()).await;

    let kept = send(
        &service,
        post_plan(&planner, "k-kept", &plan_body("run-a", "kept")),
    )
    .await;
    assert_eq!(kept.status, StatusCode::CREATED, "{:?}", kept.body);
    let mut follower = Follower::default();
    follower.catch_up(&service, &reader).await;
    assert_eq!(follower.seen, [receipt_id(&kept)]);

    let mut holder = hold_keys(&direct_url, &receipt_id(&kept), &["k-held".to_owned()]);
    // One batch, in the order of its conflict keys: the kept content under
    // the held key (run-a), then a new plan (run-b).
    app.intake.database().gather_next_batch(2);
    let batch = join_all([
        send(
            &service,
            post_plan(&planner, "k-held", &plan_body("run-a", "kept")),
        ),
        send(
            &service,
            post_plan(&planner, "k-batch", &plan_body("run-b", "batch")),
        ),
    ]);
    let meanwhile = async {
        wait_until("the batch waits for the held key", || {
            waiting_on_locks(&app, &schema) > 0
        })
        .await;
        // The other writer is free: this plan commits while the batch waits.
        let other = send(
            &service,
            post_plan(&planner, "k-other", &plan_body("run-c", "other")),
        )
        .await;
        assert_eq!(other.status, StatusCode::CREATED, "{:?}", other.body);
        follower.catch_up(&service, &reader).await;
        append_all(&intake);
        holder.batch_execute("ROLLBACK").expect("let the key go");
        other
    };
    let (batch, other) = futures_util::join!(batch, meanwhile);
    assert_eq!(batch[0].status, StatusCode::OK, "{:?}", batch[0].body);
    assert_eq!(batch[0].body["outcome"], "already_received");
    assert_eq!(batch[0].body["receipt_id"], kept.body["receipt_id"]);
    assert_eq!(batch[1].status, StatusCode::CREATED, "{:?}", batch[1].body);

    follower.catch_up(&service, &reader).await;
    append_all(&intake);
    let table = table_in_feed_order(&app);
    assert_eq!(table.len(), 3);
    assert!(table.contains(&receipt_id(&batch[1])) && table.contains(&receipt_id(&other)));
    assert_eq!(
        follower.seen, table,
        "a plan of the batch landed behind the reader's cursor (the reader's order, then the table's)"
    );
    assert_eq!(
        log_leaves(&app),
        table,
        "a plan of the batch landed behind the log's end"
    );
}

/// Many batches with duplicates (one key twice, one content under two
/// keys, replays) and key rows held by another session (let go by
/// rolling back or by committing), plans from the other writer meanwhile,
/// three followers paging at their own pace with pages of their own size,
/// and an appender running throughout. At the end each follower has seen
/// every plan in the table once, in the table's feed order, and so has
/// the log.
#[actix_web::test]
async fn batches_with_held_keys_hide_no_plan_from_followers_or_the_log() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let direct_url = scratch.url.clone();
    let (app, schema) = TestApp::named(scratch);
    let planner = app.login("planner-a", PLANNER);
    let reader = app.login("ordering", READER);
    let intake = signing(&app);
    let service = app.service_with(intake.clone()).await;
    let seed: u64 = rand::random();
    eprintln!("batch horizon: seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);

    let stop = Arc::new(AtomicBool::new(false));
    let appender = std::thread::spawn({
        let intake = intake.clone();
        let stop = stop.clone();
        move || {
            while !stop.load(Ordering::Relaxed) {
                if let Err(error) = intake.append_receipts(ORIGIN, 5_000, None, None) {
                    return Err(error.to_string());
                }
                // Pacing, not synchronization: rounds as often as the
                // service's appender would under load, and more.
                std::thread::sleep(std::time::Duration::from_millis(3));
            }
            Ok(())
        }
    });

    let mut followers: Vec<Follower> = (0..3).map(|_| Follower::default()).collect();
    // (key, run, marker, receipt id) of plans kept so far.
    let mut kept: Vec<(String, String, String, String)> = Vec::new();
    for round in 0..16 {
        let held: Vec<(String, String, String, String)> = if kept.is_empty() {
            Vec::new()
        } else {
            let count = rng.random_range(0..=2).min(kept.len());
            let mut picked = kept.clone();
            picked.shuffle(&mut rng);
            picked.truncate(count);
            picked
        };
        // Several held keys point at one kept plan each; one session holds
        // them all.
        let mut holders: Vec<PgConnection> = held
            .iter()
            .enumerate()
            .map(|(i, (_, _, _, receipt))| {
                hold_keys(&direct_url, receipt, &[format!("held-{round}-{i}")])
            })
            .collect();

        let mut requests: Vec<(String, String)> = held
            .iter()
            .enumerate()
            .map(|(i, (_, run, marker, _))| (format!("held-{round}-{i}"), plan_body(run, marker)))
            .collect();
        for i in 0..rng.random_range(1..=4) {
            let run = format!("run-{round}-{i}");
            requests.push((
                format!("new-{round}-{i}"),
                plan_body(&run, &format!("m{i}")),
            ));
        }
        if rng.random_bool(0.5) {
            let again = requests[requests.len() - 1].clone();
            requests.push(again);
        }
        if rng.random_bool(0.5) {
            let body = requests[requests.len() - 1].1.clone();
            requests.push((format!("same-content-{round}"), body));
        }
        if let Some((key, run, marker, _)) = kept.first().filter(|_| rng.random_bool(0.3)) {
            requests.push((key.clone(), plan_body(run, marker)));
        }
        requests.shuffle(&mut rng);

        app.intake.database().gather_next_batch(requests.len());
        let batch = join_all(
            requests
                .iter()
                .map(|(key, body)| send(&service, post_plan(&planner, key, body))),
        );
        let singles = rng.random_range(1..=3);
        let commit_held = rng.random_bool(0.5);
        let limits: Vec<usize> = (0..followers.len())
            .map(|_| rng.random_range(1..=7))
            .collect();
        let meanwhile = async {
            if !holders.is_empty() {
                wait_until("the batch waits for a held key", || {
                    waiting_on_locks(&app, &schema) > 0
                })
                .await;
            }
            let mut answers = Vec::new();
            for i in 0..singles {
                let run = format!("single-{round}-{i}");
                answers
                    .push(send(&service, post_plan(&planner, &run, &plan_body(&run, "s"))).await);
            }
            for (follower, limit) in followers.iter_mut().zip(&limits) {
                follower.page(&service, &reader, *limit).await;
            }
            for holder in &mut holders {
                holder
                    .batch_execute(if commit_held { "COMMIT" } else { "ROLLBACK" })
                    .expect("let the keys go");
            }
            answers
        };
        let (batch, singles) = futures_util::join!(batch, meanwhile);
        let answered = [
            StatusCode::CREATED,
            StatusCode::OK,
            StatusCode::UNPROCESSABLE_ENTITY,
        ];
        for single in &singles {
            assert_eq!(
                single.status,
                StatusCode::CREATED,
                "round {round}: {:?}",
                single.body
            );
        }
        for ((key, body), answer) in requests.iter().zip(&batch) {
            assert!(
                answered.contains(&answer.status),
                "round {round}, key {key:?}: {:?}",
                answer.body
            );
            if answer.status == StatusCode::CREATED {
                let value: serde_json::Value = serde_json::from_str(body).expect("a body");
                kept.push((
                    key.clone(),
                    value["run_id"].as_str().unwrap_or_default().to_owned(),
                    value["content"]["marker"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    receipt_id(answer),
                ));
            }
        }
        for (follower, limit) in followers.iter_mut().zip(&limits) {
            follower.page(&service, &reader, *limit).await;
        }
    }

    for follower in &mut followers {
        follower.catch_up(&service, &reader).await;
    }
    stop.store(true, Ordering::Relaxed);
    appender
        .join()
        .expect("the appender thread")
        .expect("every append round");
    append_all(&intake);

    let table = table_in_feed_order(&app);
    assert!(table.len() > 16, "every round kept plans: {}", table.len());
    for (n, follower) in followers.iter().enumerate() {
        assert_eq!(
            follower.seen, table,
            "follower {n} (seed {seed}): the order it read, then the table's"
        );
    }
    assert_eq!(log_leaves(&app), table, "the log (seed {seed})");
}

/// A plan late in a batch waits only for what its own request has left,
/// with no session limit to fall back on (a transaction-mode pooler sets
/// none): the batch's first plan waits two seconds of its three for a held
/// key, then the second meets another held key. It may wait one more
/// second, not three: the batch ends at the requests' deadline, and the
/// second plan never lands.
#[actix_web::test]
async fn a_plan_late_in_a_batch_waits_only_for_what_its_request_has_left() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    const DEADLINE: Duration = Duration::from_secs(3);
    let direct_url = scratch.url.clone();
    let schema = scratch.schema.clone().expect("a Postgres scratch schema");
    let named_url = scratch.postgres_url_with(&[]);
    let app = TestApp::with(
        scratch,
        AppOptions {
            url: Some(named_url),
            request_timeout: DEADLINE,
            pool: PoolOptions {
                max_size: 40,
                pg_pooler: PgPooler::Transaction,
                ..PoolOptions::default()
            },
            ..AppOptions::default()
        },
    );
    let planner = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let mut kept = Vec::new();
    for run in ["run-a", "run-b"] {
        let answer = send(&service, post_plan(&planner, run, &plan_body(run, run))).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
        kept.push(receipt_id(&answer));
    }
    let mut first = hold_keys(&direct_url, &kept[0], &["k-a".to_owned()]);
    let mut second = hold_keys(&direct_url, &kept[1], &["k-b".to_owned()]);

    app.intake.database().gather_next_batch(2);
    let started = Instant::now();
    let batch = join_all([
        send(
            &service,
            post_plan(&planner, "k-a", &plan_body("run-a", "run-a")),
        ),
        send(
            &service,
            post_plan(&planner, "k-b", &plan_body("run-b", "run-b")),
        ),
    ]);
    let meanwhile = async {
        wait_until("the batch's first plan waits for its key", || {
            blocked_by(&app, &schema, &mut first) > 0
        })
        .await;
        // Not synchronization: the first plan spends two thirds of its
        // budget waiting.
        actix_web::rt::time::sleep(DEADLINE * 2 / 3).await;
        first
            .batch_execute("ROLLBACK")
            .expect("let the first key go");
        wait_until("the batch's second plan waits for its key", || {
            blocked_by(&app, &schema, &mut second) > 0
        })
        .await;
    };
    let (answers, ()) = futures_util::join!(batch, meanwhile);
    // Both requests are answered (at their deadline at the latest); the
    // second key is still held. Nothing of the service may wait for it
    // past the deadline: a plan's wait is bounded by its own budget.
    let released = loop {
        if blocked_by(&app, &schema, &mut second) == 0 {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < DEADLINE + Duration::from_secs(1),
            "the batch's second plan still waits for a lock {:?} after its request came, past its deadline of {DEADLINE:?}",
            started.elapsed()
        );
        actix_web::rt::time::sleep(Duration::from_millis(10)).await;
    };
    second
        .batch_execute("ROLLBACK")
        .expect("let the second key go");
    eprintln!("the batch's last wait ended {released:?} after its requests came");
    // The failed batch is written again plan by plan: the first may still
    // land within its deadline, the second meets its held key again.
    if answers[0].status == StatusCode::OK {
        assert_eq!(answers[0].body["outcome"], "already_received");
    } else {
        answers[0].assert_problem(StatusCode::SERVICE_UNAVAILABLE, "timeout");
    }
    answers[1].assert_problem(StatusCode::SERVICE_UNAVAILABLE, "timeout");
    assert_eq!(app.count("plans"), 2);
    assert_eq!(
        scalar(
            &mut app.conn(),
            "SELECT count(*) AS n FROM intake_keys WHERE idempotency_key = 'k-b'"
        ),
        0
    );
}
