//! `GET /v1/receipts`: the ordering system's feed. Every receipt exactly
//! once, following `next`, even when transactions commit out of id order.

use std::collections::HashSet;

use actix_web::http::StatusCode;
use diesel::connection::SimpleConnection;
use plan_intake::intake::Permission;
use plan_intake::storage::MigrateOnOpen;
use serde_json::Value;

use crate::on_both_backends;
use crate::support::{TestApp, TestDb, get, hold_plan_and_key, plan_body, post_plan, send};

on_both_backends!(
    a_waiting_reader_is_answered_when_a_plan_lands,
    the_feed_starts_at_the_end_expands_plans_and_refuses_unknown_parameters,
    paging_with_every_limit_returns_each_receipt_once,
    the_feed_is_for_the_ordering_system_only,
);

/// Follows `next` from the start until an empty page; returns the receipt
/// ids in the order read and the final cursor.
async fn read_all<S>(service: &S, token: &str, limit: usize) -> (Vec<String>, String)
where
    S: actix_web::dev::Service<
            actix_http::Request,
            Response = actix_web::dev::ServiceResponse<actix_web::body::BoxBody>,
            Error = actix_web::Error,
        >,
{
    let mut seen = Vec::new();
    let mut uri = format!("/v1/receipts?limit={limit}");
    loop {
        let page = send(service, get(token, &uri)).await;
        assert_eq!(page.status, StatusCode::OK, "{:?}", page.body);
        let receipts = page.body["receipts"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert!(receipts.len() <= limit);
        let next = page.body["next"]
            .as_str()
            .expect("next is always present")
            .to_owned();
        if receipts.is_empty() {
            if let Some((_, sent)) = uri.split_once("after=") {
                assert_eq!(
                    next,
                    sent.split('&').next().unwrap_or_default(),
                    "an empty page returns the cursor sent"
                );
            }
            return (seen, next);
        }
        for receipt in &receipts {
            assert!(receipt.get("outcome").is_none());
            seen.push(
                receipt["receipt_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            );
        }
        uri = format!("/v1/receipts?after={next}&limit={limit}");
    }
}

/// Polls the feed until it holds `count` receipts (a receipt may
/// appear a moment after its 201). Fails after 20 s.
/// Posts `count` new plans as `token` (key and run `{prefix}-{i}`), each
/// answered 201; their receipt ids, in order.
async fn create_plans<S>(service: &S, token: &str, prefix: &str, count: usize) -> Vec<String>
where
    S: actix_web::dev::Service<
            actix_http::Request,
            Response = actix_web::dev::ServiceResponse<actix_web::body::BoxBody>,
            Error = actix_web::Error,
        >,
{
    let mut created = Vec::new();
    for i in 0..count {
        let name = format!("{prefix}-{i}");
        let sent = send(service, post_plan(token, &name, &plan_body(&name, prefix))).await;
        assert_eq!(sent.status, StatusCode::CREATED, "{:?}", sent.body);
        created.push(
            sent.body["receipt_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
    }
    created
}

async fn settle<S>(service: &S, token: &str, count: usize)
where
    S: actix_web::dev::Service<
            actix_http::Request,
            Response = actix_web::dev::ServiceResponse<actix_web::body::BoxBody>,
            Error = actix_web::Error,
        >,
{
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let page = send(service, get(token, "/v1/receipts?limit=1000")).await;
        if page.body["receipts"].as_array().map_or(0, Vec::len) >= count {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the feed never held {count} receipts"
        );
        actix_web::rt::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

async fn paging_with_every_limit_returns_each_receipt_once(db: TestDb) {
    let app = TestApp::new(db);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let reader = app.login("ordering", &[Permission::ReceiptsRead]);
    let service = app.service().await;
    let created = create_plans(&service, &planner, "run", 7).await;

    // On Postgres a receipt joins the feed once no older transaction in the
    // cluster is still open (other tests' included): wait until all 7 have.
    settle(&service, &reader, created.len()).await;
    let mut orders = Vec::new();
    for limit in 1..=5 {
        let (seen, _) = read_all(&service, &reader, limit).await;
        let unique: HashSet<_> = seen.iter().collect();
        assert_eq!(
            unique.len(),
            seen.len(),
            "limit {limit}: a receipt was read twice"
        );
        assert_eq!(
            unique,
            created.iter().collect(),
            "limit {limit}: receipts missing"
        );
        orders.push(seen);
    }
    assert!(
        orders.windows(2).all(|w| w[0] == w[1]),
        "the order is not stable"
    );
    assert_eq!(
        orders[0], created,
        "one writer at a time: feed order is creation order"
    );

    // Polling from the last cursor sees only what came after it.
    let (_, cursor) = read_all(&service, &reader, 100).await;
    send(
        &service,
        post_plan(&planner, "k-late", &plan_body("run-late", "x")),
    )
    .await;
    settle(&service, &reader, created.len() + 1).await;
    let page = send(
        &service,
        get(&reader, &format!("/v1/receipts?after={cursor}")),
    )
    .await;
    assert_eq!(page.body["receipts"].as_array().map(Vec::len), Some(1));
    assert_eq!(page.body["receipts"][0]["run_id"], "run-late");
}

async fn the_feed_is_for_the_ordering_system_only(db: TestDb) {
    let app = TestApp::new(db);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let reader = app.login("ordering", &[Permission::ReceiptsRead]);
    let service = app.service().await;

    assert_eq!(
        send(&service, get(&planner, "/v1/receipts")).await.status,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        send(&service, get("nope", "/v1/receipts")).await.status,
        StatusCode::UNAUTHORIZED
    );
    for query in ["limit=0", "limit=1001", "limit=ten", "after=not-a-cursor"] {
        let answer = send(&service, get(&reader, &format!("/v1/receipts?{query}"))).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{query}");
        assert_eq!(
            answer.header("content-type"),
            Some("application/problem+json")
        );
    }
    let empty = send(&service, get(&reader, "/v1/receipts")).await;
    assert_eq!(empty.body["receipts"], Value::Array(vec![]));
    assert!(empty.body["next"].is_string());
}

/// A transaction that took the lower id commits after one that took a higher
/// id. A reader that read between the two commits still gets the lower one.
#[actix_web::test]
async fn a_late_commit_with_a_lower_id_is_not_skipped() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let direct_url = scratch.url.clone();
    let app = TestApp::new(scratch);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let reader = app.login("ordering", &[Permission::ReceiptsRead]);
    let service = app.service().await;

    // The slow transaction takes the lower id.
    let mut slow = hold_plan_and_key(&direct_url, "", "rcpt_slow", "run-slow", "k-slow");
    let fast = send(
        &service,
        post_plan(&planner, "k-fast", &plan_body("run-fast", "x")),
    )
    .await;
    assert_eq!(fast.status, StatusCode::CREATED);

    let (first_read, cursor) = read_all(&service, &reader, 10).await;
    assert!(!first_read.contains(&"rcpt_slow".to_owned()));

    slow.batch_execute("COMMIT")
        .expect("the lower id commits last");
    settle(&service, &reader, 2).await;
    let mut all = first_read;
    let mut uri = format!("/v1/receipts?after={cursor}");
    loop {
        let page = send(&service, get(&reader, &uri)).await;
        let receipts = page.body["receipts"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if receipts.is_empty() {
            break;
        }
        all.extend(
            receipts
                .iter()
                .map(|r| r["receipt_id"].as_str().unwrap_or_default().to_owned()),
        );
        uri = format!(
            "/v1/receipts?after={}",
            page.body["next"].as_str().unwrap_or_default()
        );
    }
    let fast_id = fast.body["receipt_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert_eq!(
        all.iter().filter(|r| **r == "rcpt_slow").count(),
        1,
        "the late commit was skipped: {all:?}"
    );
    assert_eq!(all.iter().filter(|r| **r == fast_id).count(), 1, "{all:?}");
    assert_eq!(all.len(), 2);
}

/// `after=now` starts at the current end; `expand=plan` carries each plan;
/// unknown parameters and other `expand` values are refused.
async fn the_feed_starts_at_the_end_expands_plans_and_refuses_unknown_parameters(db: TestDb) {
    let app = TestApp::new(db);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let orders = app.login("orders", &[Permission::ReceiptsRead]);
    let service = app.service().await;
    create_plans(&service, &planner, "old", 3).await;
    let end = send(&service, get(&orders, "/v1/receipts?after=now")).await;
    assert_eq!(end.status, StatusCode::OK);
    assert_eq!(end.body["receipts"], serde_json::json!([]));
    let cursor = end.body["next"].as_str().unwrap_or_default().to_owned();

    let new = send(&service, post_plan(&planner, "new", &plan_body("new", "y"))).await;
    let page = send(
        &service,
        get(&orders, &format!("/v1/receipts?after={cursor}&expand=plan")),
    )
    .await;
    assert_eq!(page.status, StatusCode::OK, "{:?}", page.body);
    let entries = page.body["receipts"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        entries.len(),
        1,
        "only what came after the end: {:?}",
        page.body
    );
    assert_eq!(entries[0]["receipt"]["receipt_id"], new.body["receipt_id"]);
    assert_eq!(entries[0]["content"]["marker"], "y");
    assert_eq!(entries[0]["approved_inputs"][0]["id"], "forecast-v12");

    for bad in [
        "/v1/receipts?expand=everything",
        "/v1/receipts?limit=5&colour=red",
        "/v1/receipts?after=later",
    ] {
        let refused = send(&service, get(&orders, bad)).await;
        assert_eq!(
            refused.status,
            StatusCode::BAD_REQUEST,
            "{bad}: {:?}",
            refused.body
        );
    }
}

/// A reader waiting with nothing past its cursor is answered as soon as a
/// plan lands, holds no connection meanwhile, and is counted; with nothing
/// at all, it gets an empty page with its own cursor after `wait`.
async fn a_waiting_reader_is_answered_when_a_plan_lands(db: TestDb) {
    let app = TestApp::new(db);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let orders = app.login("orders", &[Permission::ReceiptsRead]);
    let service = app.service().await;
    let end = send(&service, get(&orders, "/v1/receipts?after=now")).await;
    let cursor = end.body["next"].as_str().unwrap_or_default().to_owned();

    let started = std::time::Instant::now();
    let empty = send(
        &service,
        get(&orders, &format!("/v1/receipts?after={cursor}&wait=1")),
    )
    .await;
    assert_eq!(empty.status, StatusCode::OK);
    assert_eq!(empty.body["receipts"], serde_json::json!([]));
    assert_eq!(empty.body["next"].as_str(), Some(cursor.as_str()));
    assert!(started.elapsed() >= std::time::Duration::from_millis(900));

    let metrics = app.metrics().clone();
    let pool = app.intake.database().pool_for_tests().clone();
    let waiting = send(
        &service,
        get(&orders, &format!("/v1/receipts?after={cursor}&wait=30")),
    );
    let write = async {
        crate::support::wait_until("the reader waits", || metrics.feed_waiting_count() == 1).await;
        let idle = pool.state();
        assert_eq!(
            idle.connections, idle.idle_connections,
            "a waiting reader holds no connection"
        );
        send(&service, post_plan(&planner, "k", &plan_body("run-1", "x"))).await
    };
    let started = std::time::Instant::now();
    let (page, written) = futures_util::join!(waiting, write);
    assert_eq!(written.status, StatusCode::CREATED);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    let receipts = page.body["receipts"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(receipts.len(), 1, "{:?}", page.body);
    assert_eq!(receipts[0]["receipt_id"], written.body["receipt_id"]);
    assert_eq!(app.metrics().feed_waiting_count(), 0);

    for bad in ["wait=61", "wait=-1", "wait=1.5"] {
        for after in ["", "after=now&"] {
            let refused = send(
                &service,
                get(&orders, &format!("/v1/receipts?{after}{bad}")),
            )
            .await;
            assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{after}{bad}");
        }
    }

    // The feed's tail long-polls like any cursor: `after=now&wait=S` is
    // answered with the next receipt once it lands.
    answered_by_the_next_write(
        (&service, &orders, "/v1/receipts?after=now&wait=30"),
        &metrics,
        (&service, &planner, "k2"),
    )
    .await;
}

/// A reader's long poll at `uri` (on `reader`'s service, with its token)
/// and, once `waiting` counts it, a new plan written under `key` (on the
/// writer's service): the poll is answered with exactly that plan. The
/// page and the write's answer.
async fn answered_by_the_next_write<R, W>(
    (reader, reader_token, uri): (&R, &str, &str),
    waiting: &plan_intake::metrics::Metrics,
    (writer, planner, key): (&W, &str, &str),
) -> (crate::support::Answer, crate::support::Answer)
where
    R: actix_web::dev::Service<
            actix_http::Request,
            Response = actix_web::dev::ServiceResponse<actix_web::body::BoxBody>,
            Error = actix_web::Error,
        >,
    W: actix_web::dev::Service<
            actix_http::Request,
            Response = actix_web::dev::ServiceResponse<actix_web::body::BoxBody>,
            Error = actix_web::Error,
        >,
{
    let polled = send(reader, get(reader_token, uri));
    let write = async {
        crate::support::wait_until("the reader waits", || waiting.feed_waiting_count() == 1).await;
        send(writer, post_plan(planner, key, &plan_body(key, key))).await
    };
    let (page, written) = futures_util::join!(polled, write);
    assert_eq!(written.status, StatusCode::CREATED);
    let receipts = page.body["receipts"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(receipts.len(), 1, "{:?}", page.body);
    assert_eq!(receipts[0]["receipt_id"], written.body["receipt_id"]);
    (page, written)
}

/// A plan written through one instance wakes a reader waiting on another:
/// two services, each with its own pool and listener, on one Postgres.
#[actix_web::test]
async fn a_write_through_another_instance_wakes_a_waiting_reader() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let url = scratch.url.clone();
    let first = TestApp::new(scratch);
    let planner = first.login("planner-a", &[Permission::PlansSubmit]);
    let orders = first.login("orders", &[Permission::ReceiptsRead]);
    let other = crate::support::instance(&url, MigrateOnOpen::Skip);
    // The second instance writes nothing: only its listener can bump this.
    let notified = other.database().feed_signal().subscribe();
    let other_metrics = other.metrics.clone();
    let writer_service = first.service().await;
    let reader_service = first.service_with(other).await;

    let end = send(&reader_service, get(&orders, "/v1/receipts?after=now")).await;
    let cursor = end.body["next"].as_str().unwrap_or_default().to_owned();
    answered_by_the_next_write(
        (
            &reader_service,
            &orders,
            &format!("/v1/receipts?after={cursor}&wait=30"),
        ),
        &other_metrics,
        (&writer_service, &planner, "k"),
    )
    .await;
    // The answer may also come from the half-second re-read; that the
    // other instance's listener heard the write is checked on its own.
    crate::support::wait_until("the other instance's listener hears the write", || {
        notified.has_changed().unwrap_or(false)
    })
    .await;
}

/// Nothing inside a write queues a notification (which would take
/// PostgreSQL's cluster-wide notify lock in every commit): a plan inserted
/// straight into the table, as the write inserts it, notifies nobody, so a
/// sentinel sent after its commit is the first notification to arrive.
/// Notifications arrive in commit order.
#[actix_web::test]
async fn inserting_a_plan_queues_no_notification_inside_its_transaction() {
    use diesel::{Connection, PgConnection, RunQueryDsl};
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let url = scratch.url.clone();
    let _app = TestApp::new(scratch);
    let mut listener = PgConnection::establish(&url).expect("connect the listener");
    let channel = plan_intake::storage::feed_channel(&mut listener).expect("the channel");
    // The channel a trigger of old used, too.
    let base = plan_intake::storage::FEED_CHANNEL_BASE;
    for listened in [channel.as_str(), base] {
        diesel::sql_query(format!("LISTEN \"{listened}\""))
            .execute(&mut listener)
            .expect("listen");
    }
    let mut writer = PgConnection::establish(&url).expect("connect the writer");
    writer
        .batch_execute(&crate::support::hand_written_plan_sql(
            "rcpt_around",
            "planner-a",
            "'run-1'",
            "blake3:around",
        ))
        .expect("a plan row, committed");
    writer
        .batch_execute(&format!("NOTIFY \"{channel}\", 'sentinel'"))
        .expect("the sentinel");
    let mut payloads = Vec::new();
    crate::support::wait_until("the sentinel arrives", || {
        payloads.extend(
            listener
                .notifications_iter()
                .filter_map(|n| n.ok())
                .map(|n| n.payload),
        );
        !payloads.is_empty()
    })
    .await;
    assert_eq!(payloads[0], "sentinel", "{payloads:?}");
}

/// Transactions that write elsewhere in the cluster (another database, an
/// idle-in-transaction session on another table) hold nothing back: a
/// receipt is in the feed as soon as its 201 is out.
#[actix_web::test]
async fn unrelated_open_transactions_do_not_hold_the_feed_back() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let direct_url = scratch.url.clone();
    let app = TestApp::new(scratch);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let orders = app.login("orders", &[Permission::ReceiptsRead]);
    let service = app.service().await;

    use diesel::Connection;
    let other_database = crate::support::postgres_url_for("postgres");
    let mut elsewhere = diesel::PgConnection::establish(&other_database).expect("connect");
    elsewhere
        .batch_execute(
            "BEGIN; CREATE TEMP TABLE batch_job (n int); INSERT INTO batch_job VALUES (1);",
        )
        .expect("a writing transaction in another database");
    let mut idle = diesel::PgConnection::establish(&direct_url).expect("connect");
    idle.batch_execute(
        "BEGIN; CREATE TEMP TABLE idle_work (n int); INSERT INTO idle_work VALUES (1);",
    )
    .expect("an idle-in-transaction session that wrote");

    let written = send(&service, post_plan(&planner, "k", &plan_body("run-1", "x"))).await;
    assert_eq!(written.status, StatusCode::CREATED);
    let page = send(&service, get(&orders, "/v1/receipts")).await;
    let receipts = page.body["receipts"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        receipts.len(),
        1,
        "the receipt waited for unrelated transactions: {:?}",
        page.body
    );
    elsewhere.batch_execute("ROLLBACK").expect("end");
    idle.batch_execute("ROLLBACK").expect("end");
}

/// The horizon reads its snapshot's end before it reads the writers in
/// pg_locks; a writer that took its id in between (every moment, under
/// load) holds nothing back. Made certain here by a reader whose snapshot
/// is its transaction's (REPEATABLE READ) and a writer that starts after
/// it: a plan committed before both is still settled. (Until 000017, such
/// a writer's id was read as one of the previous xid epoch and the horizon
/// fell 2^32 below every position: empty pages, and a log appender that
/// found nothing to append, while writers kept starting.)
#[actix_web::test]
async fn a_writer_newer_than_the_horizons_snapshot_holds_nothing_back() {
    use diesel::prelude::*;
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let direct_url = scratch.url.clone();
    let app = TestApp::new(scratch);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let service = app.service().await;
    let written = send(&service, post_plan(&planner, "k", &plan_body("run-1", "x"))).await;
    assert_eq!(written.status, StatusCode::CREATED);

    #[derive(QueryableByName)]
    struct Found {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let mut reader = diesel::PgConnection::establish(&direct_url).expect("connect");
    reader
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1;")
        .expect("a snapshot taken");
    let mut newer = hold_plan_and_key(&direct_url, "", "rcpt_newer", "run-newer", "k-newer");
    let settled = diesel::sql_query("SELECT MAX(feed_xid) AS n FROM plans")
        .get_result::<Found>(&mut reader)
        .expect("the committed plan's position")
        .n;
    let horizon = diesel::sql_query("SELECT horizon AS n FROM plan_intake_feed_horizon()")
        .get_result::<Found>(&mut reader)
        .expect("the horizon")
        .n;
    assert!(
        horizon > settled,
        "a writer newer than the snapshot put the horizon ({horizon}) below a committed plan ({settled})"
    );
    newer.batch_execute("ROLLBACK").expect("end");
    reader.batch_execute("ROLLBACK").expect("end");
}

/// The database is dumped and restored into another cluster whose
/// transaction ids are far lower: a reader continuing from its old cursor
/// sees every new receipt and no old one again, with no manual step.
#[actix_web::test]
async fn the_feed_survives_a_dump_restored_into_another_cluster() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let Some(cluster) = crate::support::cluster::TempCluster::create() else {
        return;
    };
    let schema = scratch.schema.clone().expect("schema");
    let app = TestApp::new(scratch);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let orders = app.login("orders", &[Permission::ReceiptsRead]);
    let service = app.service().await;
    create_plans(&service, &planner, "old", 3).await;
    let (old, cursor) = read_all(&service, &orders, 10).await;
    assert_eq!(old.len(), 3);

    let dump = std::process::Command::new("pg_dump")
        .args([
            "-d",
            &crate::support::postgres_base_url(),
            "-n",
            &schema,
            "--no-owner",
        ])
        .output()
        .expect("pg_dump");
    assert!(
        dump.status.success(),
        "{}",
        String::from_utf8_lossy(&dump.stderr)
    );
    let mut restore = std::process::Command::new("psql")
        .args(["-q", "-v", "ON_ERROR_STOP=1", &cluster.url("postgres")])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("psql");
    use std::io::Write;
    restore
        .stdin
        .take()
        .expect("stdin")
        .write_all(&dump.stdout)
        .expect("feed the dump");
    assert!(restore.wait().expect("psql").success(), "the dump restores");

    let restored_url = format!(
        "{}?options=-csearch_path%3D{schema}",
        cluster.url("postgres")
    );
    // Fully migrated as restored: nothing pending.
    let intake = crate::support::instance(&restored_url, MigrateOnOpen::RequireNonePending);
    let restored_service = app.service_with(intake).await;
    let new = create_plans(&restored_service, &planner, "new", 2).await;
    let page = send(
        &restored_service,
        get(&orders, &format!("/v1/receipts?after={cursor}")),
    )
    .await;
    let seen: Vec<String> = page.body["receipts"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|r| r["receipt_id"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(seen, new, "every new receipt, in order, and no old one");
    drop(restored_service);
    drop(cluster);
}

/// SQLite: a copy made with `VACUUM INTO` keeps the feed; a reader goes on
/// from its cursor on the copy.
#[actix_web::test]
async fn a_copied_sqlite_file_keeps_the_feed() {
    let scratch = TestDb::sqlite();
    let copy_dir = tempfile::tempdir().expect("dir");
    let copy = copy_dir.path().join("copy.db");
    let app = TestApp::new(scratch);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let orders = app.login("orders", &[Permission::ReceiptsRead]);
    let service = app.service().await;
    create_plans(&service, &planner, "old", 2).await;
    let (_, cursor) = read_all(&service, &orders, 10).await;
    crate::support::execute_batch(
        &mut app.conn(),
        &format!("VACUUM INTO '{}'", copy.display()),
    );
    let intake = crate::support::instance(
        &format!("sqlite://{}", copy.display()),
        MigrateOnOpen::RequireNonePending,
    );
    let copy_service = app.service_with(intake).await;
    let sent = send(
        &copy_service,
        post_plan(&planner, "new", &plan_body("new", "y")),
    )
    .await;
    let page = send(
        &copy_service,
        get(&orders, &format!("/v1/receipts?after={cursor}")),
    )
    .await;
    let receipts = page.body["receipts"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(receipts.len(), 1, "{:?}", page.body);
    assert_eq!(receipts[0]["receipt_id"], sent.body["receipt_id"]);
}

/// A copy of the database reached by a running service in another cluster
/// (no base recorded for it): the first writer records the base in its
/// own transaction. One that took its id before a newer transaction ended
/// still lands past every stored position, so no reader's cursor passes
/// it. (Until 000018, the base came from the writer's snapshot's xmax,
/// above its own id, and the plan landed behind the last one stored.)
#[actix_web::test]
async fn a_base_recorded_by_a_writer_places_it_past_every_position() {
    use diesel::prelude::*;
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let direct_url = scratch.url.clone();
    let app = TestApp::new(scratch);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let service = app.service().await;
    for run in ["run-1", "run-2"] {
        let written = send(&service, post_plan(&planner, run, &plan_body(run, "x"))).await;
        assert_eq!(written.status, StatusCode::CREATED);
    }
    #[derive(QueryableByName)]
    struct Found {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let mut writer = diesel::PgConnection::establish(&direct_url).expect("connect");
    // Another cluster, whose transaction ids are far lower than the
    // positions stored: no base recorded for it yet.
    writer
        .batch_execute("UPDATE plans SET feed_xid = feed_xid + 10000000; DELETE FROM feed_bases;")
        .expect("a copy in another cluster");
    let highest = diesel::sql_query("SELECT MAX(feed_xid) AS n FROM plans")
        .get_result::<Found>(&mut writer)
        .expect("the last position")
        .n;
    writer
        .batch_execute("BEGIN; SELECT pg_current_xact_id();")
        .expect("the writer takes its id");
    let mut newer = diesel::PgConnection::establish(&direct_url).expect("connect");
    newer
        .batch_execute("BEGIN; SELECT pg_current_xact_id(); COMMIT;")
        .expect("a newer transaction ends first");
    writer
        .batch_execute(&format!(
            "{}; COMMIT;",
            crate::support::hand_written_plan_sql(
                "rcpt_late",
                "planner-a",
                "'late'",
                "blake3:late"
            )
        ))
        .expect("the writer records the base and commits");
    let late = diesel::sql_query("SELECT feed_xid AS n FROM plans WHERE receipt_id = 'rcpt_late'")
        .get_result::<Found>(&mut writer)
        .expect("its position")
        .n;
    assert!(
        late > highest,
        "the plan landed at {late}, not past the last stored position {highest}"
    );
}

/// A failover that lost a reader's last receipt, simulated through the
/// timeline row: the reader's cursor stands past what the new timeline
/// replayed. Before any write on the new timeline, and after, the cursor is
/// placed (in the room the new timeline leaves for what the old one handed
/// out), and the reader gets every plan the new timeline keeps.
#[actix_web::test]
async fn a_cursor_past_what_a_failover_kept_reads_on_from_the_new_timeline() {
    use diesel::Connection;
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let direct_url = scratch.url.clone();
    let app = TestApp::new(scratch);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let reader = app.login("orders", &[Permission::ReceiptsRead]);
    let service = app.service().await;
    for run in ["run-1", "run-2", "run-3"] {
        let written = send(&service, post_plan(&planner, run, &plan_body(run, "x"))).await;
        assert_eq!(written.status, StatusCode::CREATED);
    }
    let page = send(&service, get(&reader, "/v1/receipts?limit=10")).await;
    assert_eq!(page.status, StatusCode::OK);
    let cursor = page.body["next"].as_str().expect("next").to_owned();
    let lost = page.body["receipts"][2]["receipt_id"]
        .as_str()
        .expect("an id")
        .to_owned();
    // The failover: the last plan was not replayed, and the timeline the
    // bases were recorded on is the old one.
    let mut conn = diesel::PgConnection::establish(&direct_url).expect("connect");
    conn.batch_execute(&format!(
        "DELETE FROM intake_keys WHERE plan_id = (SELECT id FROM plans WHERE receipt_id = '{lost}');
         DELETE FROM plans WHERE receipt_id = '{lost}';
         UPDATE feed_bases SET timeline_id = timeline_id - 1;"
    ))
    .expect("simulate the failover");

    let path = format!("/v1/receipts?limit=10&after={cursor}");
    let before = send(&service, get(&reader, &path)).await;
    assert_eq!(before.status, StatusCode::OK, "{:?}", before.body);
    assert_eq!(before.body["receipts"].as_array().map(Vec::len), Some(0));
    let written = send(
        &service,
        post_plan(&planner, "run-4", &plan_body("run-4", "x")),
    )
    .await;
    assert_eq!(written.status, StatusCode::CREATED);
    let after = send(&service, get(&reader, &path)).await;
    assert_eq!(after.status, StatusCode::OK, "{:?}", after.body);
    let receipts = after.body["receipts"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(receipts.len(), 1, "{:?}", after.body);
    assert_eq!(receipts[0]["receipt_id"], written.body["receipt_id"]);
}
