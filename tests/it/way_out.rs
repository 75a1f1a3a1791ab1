//! The way out: what the ordering system reads is the text the service
//! stored (its `content_hash` checks out), in bounded pages, and a cursor
//! is refused where it was not handed out instead of answering pages that
//! skip receipts.

use actix_web::http::StatusCode;
use actix_web::test as actix_test;
use plan_intake::intake::Permission;
use plan_intake_wire::feed::FeedPage;
use serde_json::value::RawValue;

use crate::on_both_backends;
use crate::support::{TestApp, TestDb, execute_batch, get, plan_body, post_plan, send};

on_both_backends!(
    a_plan_is_read_back_as_stored_and_its_content_hash_checks_out,
    an_expanded_page_ends_at_its_byte_budget_and_next_reads_on,
    another_deployments_cursor_is_refused,
    a_cursor_past_the_end_is_refused_and_an_old_cursor_is_still_read,
);

/// A plan entry as a reader that checks hashes keeps it: the two parts the
/// hash covers, as received.
#[derive(serde::Deserialize)]
struct ReceivedPlan {
    receipt: Receipt,
    approved_inputs: Box<RawValue>,
    content: Box<RawValue>,
}

#[derive(serde::Deserialize)]
struct Receipt {
    receipt_id: String,
    content_hash: String,
}

#[derive(serde::Deserialize)]
struct ReceivedPage {
    receipts: Vec<ReceivedPlan>,
    next: String,
}

/// What a reader computes from what it received: RFC 8785's
/// `{"approved_inputs":…,"content":…}` over the received texts.
fn hash_as_received(plan: &ReceivedPlan) -> String {
    let mut hasher = blake3::Hasher::new();
    hasher.update(br#"{"approved_inputs":"#);
    hasher.update(plan.approved_inputs.get().as_bytes());
    hasher.update(br#","content":"#);
    hasher.update(plan.content.get().as_bytes());
    hasher.update(b"}");
    format!("blake3:{}", hasher.finalize().to_hex())
}

/// The raw body of a GET.
async fn raw_get<S>(service: &S, token: &str, uri: &str) -> (StatusCode, Vec<u8>)
where
    S: actix_web::dev::Service<
            actix_http::Request,
            Response = actix_web::dev::ServiceResponse<actix_web::body::BoxBody>,
            Error = actix_web::Error,
        >,
{
    let response = actix_test::call_service(service, get(token, uri).to_request()).await;
    let status = response.status();
    (status, actix_test::read_body(response).await.to_vec())
}

/// Member names across the BMP and the astral planes, whose RFC 8785 order
/// (UTF-16 code units) differs from UTF-8 byte order: "😀" (U+1F600, a
/// surrogate pair from 0xD83D) sorts before "ﬁ" (U+FB01) in RFC 8785 and
/// after it by bytes.
fn plans_with_unicode_names() -> Vec<String> {
    let names = [
        "ﬁ",
        "😀",
        "a",
        "é",
        "\u{10000}",
        "\u{FFFF}",
        "\u{E000}",
        "z",
    ];
    (0..4)
        .map(|i| {
            let mut content = serde_json::Map::new();
            for (j, name) in names.iter().enumerate() {
                let nested = serde_json::json!({ names[(j + i) % names.len()]: j, "😀x": [i, {"ﬁ": 1, "𝄞": 2}] });
                content.insert(format!("{name}{i}"), nested);
            }
            serde_json::json!({
                "run_id": format!("run-{i}"),
                "approved_inputs": [{"id": "ﬁ-input"}, {"id": "😀-input", "digest": "blake3:00"}],
                "content": content,
            })
            .to_string()
        })
        .collect()
}

/// `GET /v1/plans/{id}` and an expanded page hand out the stored RFC 8785
/// text byte for byte: a reader's blake3 over what it received is the
/// receipt's `content_hash`, and both reads are the same bytes.
async fn a_plan_is_read_back_as_stored_and_its_content_hash_checks_out(db: TestDb) {
    let app = TestApp::new(db);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let reader = app.login("orders", &[Permission::ReceiptsRead]);
    let service = app.service().await;
    let mut receipt_ids = Vec::new();
    for (i, body) in plans_with_unicode_names().iter().enumerate() {
        let created = send(&service, post_plan(&planner, &format!("k{i}"), body)).await;
        assert_eq!(created.status, StatusCode::CREATED, "{:?}", created.body);
        receipt_ids.push(created.body["receipt_id"].as_str().expect("id").to_owned());
    }
    let (status, page) = raw_get(&service, &reader, "/v1/receipts?expand=plan").await;
    assert_eq!(status, StatusCode::OK);
    let page: ReceivedPage = serde_json::from_slice(&page).expect("a feed page");
    assert_eq!(page.receipts.len(), receipt_ids.len());
    for (plan, receipt_id) in page.receipts.iter().zip(&receipt_ids) {
        assert_eq!(&plan.receipt.receipt_id, receipt_id);
        assert_eq!(
            hash_as_received(plan),
            plan.receipt.content_hash,
            "on a page"
        );
        let stored = app.stored(receipt_id).expect("stored");
        assert_eq!(plan.content.get(), stored.content, "the stored text");
        let emoji = plan.content.get().find("😀").expect("😀");
        let ligature = plan.content.get().find("ﬁ").expect("ﬁ");
        assert!(emoji < ligature, "RFC 8785 order: {}", plan.content.get());

        let (status, by_id) = raw_get(&service, &reader, &format!("/v1/plans/{receipt_id}")).await;
        assert_eq!(status, StatusCode::OK);
        let by_id: ReceivedPlan = serde_json::from_slice(&by_id).expect("a plan");
        assert_eq!(
            hash_as_received(&by_id),
            by_id.receipt.content_hash,
            "by id"
        );
        assert_eq!(by_id.content.get(), plan.content.get(), "the same bytes");
        assert_eq!(by_id.approved_inputs.get(), plan.approved_inputs.get());
    }
}

/// A plan of about `bytes` bytes of content.
fn plan_of_size(run: &str, bytes: usize) -> String {
    let filler = "x".repeat(bytes);
    serde_json::json!({
        "run_id": run,
        "approved_inputs": [{"id": "forecast-v12"}],
        "content": {"filler": filler},
    })
    .to_string()
}

/// With `expand=plan`, a page stops early once its plans would pass the
/// page budget (one larger plan is a page of one) and says where to go on:
/// following `next` reads every plan once.
async fn an_expanded_page_ends_at_its_byte_budget_and_next_reads_on(db: TestDb) {
    let mut app = TestApp::new(db);
    app.http.feed_page_bytes = 25_000;
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let reader = app.login("orders", &[Permission::ReceiptsRead]);
    let service = app.service().await;
    let mut sent = Vec::new();
    for (i, size) in [10_000, 10_000, 10_000, 60_000, 10_000]
        .into_iter()
        .enumerate()
    {
        let body = plan_of_size(&format!("run-{i}"), size);
        let created = send(&service, post_plan(&planner, &format!("k{i}"), &body)).await;
        assert_eq!(created.status, StatusCode::CREATED);
        sent.push(created.body["receipt_id"].as_str().expect("id").to_owned());
    }
    let mut uri = "/v1/receipts?expand=plan&limit=1000".to_owned();
    let (mut read, mut sizes) = (Vec::new(), Vec::new());
    loop {
        let (status, body) = raw_get(&service, &reader, &uri).await;
        assert_eq!(status, StatusCode::OK);
        let page: ReceivedPage = serde_json::from_slice(&body).expect("a page");
        if page.receipts.is_empty() {
            break;
        }
        sizes.push(page.receipts.len());
        read.extend(page.receipts.iter().map(|p| p.receipt.receipt_id.clone()));
        uri = format!("/v1/receipts?expand=plan&limit=1000&after={}", page.next);
    }
    assert_eq!(read, sent, "every plan once, in order");
    assert_eq!(
        sizes,
        vec![2, 1, 1, 1],
        "pages of at most 25,000 bytes, or one plan"
    );
    // Without `expand`, the budget does not apply: receipts are small.
    let receipts = send(&service, get(&reader, "/v1/receipts?limit=1000")).await;
    assert_eq!(receipts.body["receipts"].as_array().map(Vec::len), Some(5));
}

/// The cursor after the first receipt of the feed `service` serves.
async fn cursor_after_first<S>(service: &S, reader: &str) -> String
where
    S: actix_web::dev::Service<
            actix_http::Request,
            Response = actix_web::dev::ServiceResponse<actix_web::body::BoxBody>,
            Error = actix_web::Error,
        >,
{
    let page = send(service, get(reader, "/v1/receipts?limit=1")).await;
    assert_eq!(page.status, StatusCode::OK);
    page.body["next"].as_str().expect("next").to_owned()
}

/// A cursor saved against one deployment, sent to another, is refused with
/// its own problem type, not answered with the other feed's later pages.
async fn another_deployments_cursor_is_refused(db: TestDb) {
    let other = match db.backend {
        plan_intake::storage::Backend::Sqlite => TestDb::sqlite(),
        plan_intake::storage::Backend::Postgres => TestDb::postgres().expect("postgres"),
    };
    let (here, there) = (TestApp::new(db), TestApp::new(other));
    let mut services = Vec::new();
    for app in [&here, &there] {
        let planner = app.login("planner-a", &[Permission::PlansSubmit]);
        let reader = app.login("orders", &[Permission::ReceiptsRead]);
        let service = app.service().await;
        for i in 0..3 {
            let body = plan_body(&format!("run-{i}"), "x");
            let created = send(&service, post_plan(&planner, &format!("k{i}"), &body)).await;
            assert_eq!(created.status, StatusCode::CREATED);
        }
        services.push((service, reader));
    }
    let (ours, theirs) = (&services[0], &services[1]);
    let cursor = cursor_after_first(&ours.0, &ours.1).await;
    let refused = send(
        &theirs.0,
        get(&theirs.1, &format!("/v1/receipts?after={cursor}")),
    )
    .await;
    refused.assert_problem(StatusCode::BAD_REQUEST, "cursor-not-in-feed");
    let expanded = send(
        &theirs.0,
        get(
            &theirs.1,
            &format!("/v1/receipts?expand=plan&after={cursor}"),
        ),
    )
    .await;
    expanded.assert_problem(StatusCode::BAD_REQUEST, "cursor-not-in-feed");
    // At home it reads on.
    let page = send(
        &ours.0,
        get(&ours.1, &format!("/v1/receipts?after={cursor}")),
    )
    .await;
    assert_eq!(page.status, StatusCode::OK);
    assert_eq!(page.body["receipts"].as_array().map(Vec::len), Some(2));
}

fn hex(text: &str) -> String {
    text.bytes().map(|b| format!("{b:02x}")).collect()
}

/// A cursor past the end (`v1:4294967296:1`, or one naming no plan) is
/// refused; a `v1` cursor issued before cursors carried their receipt is
/// still read where a plan stands, and `after=now` of an empty feed stays
/// valid.
async fn a_cursor_past_the_end_is_refused_and_an_old_cursor_is_still_read(db: TestDb) {
    let app = TestApp::new(db);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let reader = app.login("orders", &[Permission::ReceiptsRead]);
    let service = app.service().await;

    let now = send(&service, get(&reader, "/v1/receipts?after=now")).await;
    let empty_end = now.body["next"].as_str().expect("next").to_owned();
    let again = send(
        &service,
        get(&reader, &format!("/v1/receipts?after={empty_end}")),
    )
    .await;
    assert_eq!(again.status, StatusCode::OK, "an empty feed's cursor");

    for i in 0..3 {
        let body = plan_body(&format!("run-{i}"), "x");
        let created = send(&service, post_plan(&planner, &format!("k{i}"), &body)).await;
        assert_eq!(created.status, StatusCode::CREATED);
    }
    let from_empty_end = send(
        &service,
        get(&reader, &format!("/v1/receipts?after={empty_end}")),
    )
    .await;
    assert_eq!(
        from_empty_end.body["receipts"].as_array().map(Vec::len),
        Some(3)
    );

    for past in [
        hex("v1:4294967296:1"),
        hex("v1:9223372036854775807:9223372036854775807"),
    ] {
        let refused = send(
            &service,
            get(&reader, &format!("/v1/receipts?after={past}")),
        )
        .await;
        refused.assert_problem(StatusCode::BAD_REQUEST, "cursor-not-in-feed");
    }

    // The first plan's position, as a `v1` cursor wrote it.
    let mut conn = app.conn();
    let position = crate::support::scalar(
        &mut conn,
        "SELECT feed_xid * 0 + id AS n FROM plans ORDER BY feed_xid, id LIMIT 1",
    );
    let xid = crate::support::scalar(
        &mut conn,
        "SELECT feed_xid AS n FROM plans ORDER BY feed_xid, id LIMIT 1",
    );
    let old = hex(&format!("v1:{xid}:{position}"));
    let page = send(&service, get(&reader, &format!("/v1/receipts?after={old}"))).await;
    assert_eq!(page.status, StatusCode::OK, "{:?}", page.body);
    assert_eq!(page.body["receipts"].as_array().map(Vec::len), Some(2));
    let next = page.body["next"].as_str().expect("next");
    assert!(next.starts_with(&hex("v2:")), "handed out as v2: {next}");
    // A `v1` cursor at the end: its empty page hands it back, and that is
    // read again (a follower caught up when it was upgraded).
    let last_id = crate::support::scalar(
        &mut conn,
        "SELECT id AS n FROM plans ORDER BY feed_xid DESC, id DESC LIMIT 1",
    );
    let last_xid = crate::support::scalar(
        &mut conn,
        "SELECT feed_xid AS n FROM plans ORDER BY feed_xid DESC, id DESC LIMIT 1",
    );
    let mut at_end = hex(&format!("v1:{last_xid}:{last_id}"));
    for _ in 0..2 {
        let page = send(
            &service,
            get(&reader, &format!("/v1/receipts?after={at_end}")),
        )
        .await;
        assert_eq!(page.status, StatusCode::OK, "{:?}", page.body);
        assert_eq!(page.body["receipts"].as_array().map(Vec::len), Some(0));
        at_end = page.body["next"].as_str().expect("next").to_owned();
    }
    // A forged anchor on a real position is refused.
    let forged = hex(&format!("v2:{xid}:{position}:0011223344556677"));
    let refused = send(
        &service,
        get(&reader, &format!("/v1/receipts?after={forged}")),
    )
    .await;
    refused.assert_problem(StatusCode::BAD_REQUEST, "cursor-not-in-feed");
}

/// A SQLite file restored from an older backup reuses the ids written after
/// the backup: a cursor taken past the backup's end is refused there (its
/// receipt is not at its position), so the plans written after the restore
/// are not skipped; a cursor from before the backup's end reads them.
#[actix_web::test]
async fn a_cursor_from_before_a_restore_is_refused_where_the_restore_took_it_back() {
    let original = TestDb::sqlite();
    let app = TestApp::new(original);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let reader = app.login("orders", &[Permission::ReceiptsRead]);
    let service = app.service().await;
    let post = |i: usize, marker: &'static str| {
        let service = &service;
        let planner = &planner;
        async move {
            let body = plan_body(&format!("run-{i}"), marker);
            let created = send(service, post_plan(planner, &format!("k{i}"), &body)).await;
            assert_eq!(created.status, StatusCode::CREATED);
        }
    };
    post(0, "x").await;
    post(1, "x").await;
    let at_backup = send(&service, get(&reader, "/v1/receipts?after=now")).await;
    let at_backup = at_backup.body["next"].as_str().expect("next").to_owned();
    let restored = TestDb::sqlite();
    let backup_path = restored.url.trim_start_matches("sqlite://").to_owned();
    execute_batch(&mut app.conn(), &format!("VACUUM INTO '{backup_path}'"));
    for i in 2..5 {
        post(i, "x").await;
    }
    let past_backup = send(&service, get(&reader, "/v1/receipts?after=now")).await;
    let past_backup = past_backup.body["next"].as_str().expect("next").to_owned();

    let restored_app = TestApp::new(restored);
    let restored_service = restored_app.service().await;
    for i in 10..13 {
        let body = plan_body(&format!("run-{i}"), "after-restore");
        let created = send(
            &restored_service,
            post_plan(&planner, &format!("k{i}"), &body),
        )
        .await;
        assert_eq!(created.status, StatusCode::CREATED, "{:?}", created.body);
    }
    let refused = send(
        &restored_service,
        get(&reader, &format!("/v1/receipts?after={past_backup}")),
    )
    .await;
    refused.assert_problem(StatusCode::BAD_REQUEST, "cursor-not-in-feed");
    let page = send(
        &restored_service,
        get(&reader, &format!("/v1/receipts?after={at_backup}")),
    )
    .await;
    assert_eq!(page.status, StatusCode::OK, "{:?}", page.body);
    let runs: Vec<&str> = page.body["receipts"]
        .as_array()
        .expect("receipts")
        .iter()
        .filter_map(|r| r["run_id"].as_str())
        .collect();
    assert_eq!(
        runs,
        ["run-10", "run-11", "run-12"],
        "written after the restore"
    );
}

/// Inserts `count` plans of about `bytes` bytes each (tiny objects, the
/// costliest shape to hold as a tree), around the service: fast, and the
/// service reads them as it reads its own.
fn store_plans(app: &TestApp, prefix: &str, count: usize, bytes: usize) -> Vec<String> {
    let items = vec![r#"{"a":1}"#; bytes / 8].join(",");
    let content = format!(r#"{{"items":[{items}]}}"#);
    let mut conn = app.conn();
    (0..count)
        .map(|i| {
            let receipt_id = format!("rcpt_{prefix}_{i:04}");
            let sql = format!(
                "INSERT INTO plans (receipt_id, maker, run_id, content_hash, request_hash, content,
                                    approved_inputs, permissions, received_at)
                      VALUES ('{receipt_id}', 'planner-a', '{prefix}-{i}', 'h{i}', 'h{i}',
                              '{content}', '[]', '[\"plans:submit\"]', '2026-11-30 10:00:00')"
            );
            execute_batch(&mut conn, &sql);
            receipt_id
        })
        .collect()
}

/// An expanded entry, as far as the test reads it.
#[derive(serde::Deserialize)]
struct Entry {
    receipt: EntryReceipt,
}

#[derive(serde::Deserialize)]
struct EntryReceipt {
    receipt_id: String,
}

/// Every receipt id read by following `next` from `uri_base` (which ends in
/// `?…`), and the service's peak memory after.
fn follow_pages(
    server: &crate::support::process::ServeProcess,
    reader: &str,
    uri_base: &str,
) -> (Vec<String>, usize) {
    let agent = crate::support::process::client();
    let (mut seen, mut pages, mut after) = (Vec::new(), 0, String::new());
    loop {
        // Read whole: a page may be larger than ureq's 10 MB `into_string`.
        let response = agent
            .get(&format!("http://{}{uri_base}{after}", server.addr))
            .set("Authorization", &format!("Bearer {reader}"))
            .call()
            .expect("a page");
        let mut text = String::new();
        std::io::Read::read_to_string(&mut response.into_reader(), &mut text).expect("the page");
        // Only the ids are kept: the plans are skipped as they are read, not
        // built into a tree (60 MiB of small objects would take the test
        // longer than the service).
        let page: FeedPage<Entry> = serde_json::from_str(&text).expect("a feed page");
        if page.receipts.is_empty() {
            return (seen, pages);
        }
        pages += 1;
        seen.extend(page.receipts.into_iter().map(|e| e.receipt.receipt_id));
        after = format!("&after={}", page.next);
    }
}

/// Reads of whole plans in bounded memory, against the real binary: 20
/// plans of 512 KB in one page, then 40 plans of 1 MiB asked for with
/// `limit=1000`: every receipt once following `next`, in pages of at most
/// the 16 MiB budget, and the service's peak memory under 128 MiB plus four
/// pages' worth (the rows, the database's copy of them, the page written;
/// a tree of them was 85 times their size).
fn whole_plans_are_read_in_bounded_memory(db: TestDb) {
    let url = db.url.clone();
    let app = TestApp::new(db);
    let reader = app.login("orders", &[Permission::ReceiptsRead]);
    let half = store_plans(&app, "half", 20, 512 * 1024);
    let whole = store_plans(&app, "whole", 40, 1024 * 1024);
    let server = crate::support::process::ServeProcess::start(&url);

    let (first, _) = follow_pages(&server, &reader, "/v1/receipts?expand=plan&limit=20");
    assert_eq!(first[..20], half[..], "20 plans of 512 KB");
    let after_one_page = server.peak_rss_mib();

    let (all, pages) = follow_pages(&server, &reader, "/v1/receipts?expand=plan&limit=1000");
    let expected: Vec<String> = half.iter().chain(&whole).cloned().collect();
    assert_eq!(all, expected, "every receipt once, in order");
    assert!(pages >= 60 * 3 / 4 * 512 / 1024 / 16, "{pages} pages");
    let peak = server.peak_rss_mib();
    let bound = 128.0 + 4.0 * 16.0;
    eprintln!(
        "peak RSS after one page of 10 MiB: {after_one_page:.0} MiB; after 60 plans: {peak:.0} MiB"
    );
    assert!(
        peak < bound,
        "peak RSS {peak:.0} MiB (after one page of 10 MiB: {after_one_page:.0}), bound {bound:.0}"
    );
}

crate::on_both_backends_sync!(whole_plans_are_read_in_bounded_memory);

/// Reads of whole plans take their room among the bytes in flight: with a
/// 1 MiB budget held by a request body still arriving, a plan read waits,
/// then answers 503 with `Retry-After`; once the body is gone it is read.
#[test]
fn a_plan_read_waits_for_room_among_the_bytes_in_flight() {
    use std::io::Write;
    let scratch = TestDb::sqlite();
    let url = scratch.url.clone();
    let app = TestApp::new(scratch);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let ids = store_plans(&app, "plan", 1, 100 * 1024);
    let server = crate::support::process::ServeProcess::start_with(
        &url,
        &["--max-body-bytes-in-flight", "1048576"],
    );
    let mut holder = std::net::TcpStream::connect(&server.addr).expect("connect");
    write!(
        holder,
        "POST /v1/plans HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {planner}\r\nIdempotency-Key: held\r\nContent-Type: application/json\r\nContent-Length: 1048576\r\n\r\n{{"
    )
    .expect("a head and the body's first byte");
    let agent = crate::support::process::client();
    let read = |agent: &ureq::Agent| match agent
        .get(&format!("http://{}/v1/plans/{}", server.addr, ids[0]))
        .set("Authorization", &format!("Bearer {planner}"))
        .call()
    {
        Ok(response) => (
            response.status(),
            response.header("retry-after").map(str::to_owned),
        ),
        Err(ureq::Error::Status(status, response)) => {
            (status, response.header("retry-after").map(str::to_owned))
        }
        Err(e) => panic!("GET: {e}"),
    };
    // The body's room is reserved once its head is read: wait for that.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let busy = loop {
        let answer = read(&agent);
        if answer.0 == 503 {
            break answer;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the read was never held back: {answer:?}"
        );
    };
    assert_eq!(busy.1.as_deref(), Some("1"), "Retry-After");
    drop(holder);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while read(&agent).0 != 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "the room never came back"
        );
    }
}

/// A service on a scratch SQLite file holding `plans` plans, a directory
/// for a follower's cursor file, the cursor file's path (not yet there) and
/// the service's base URL.
fn stage_with_plans(
    plans: usize,
) -> (
    crate::tools::Stage,
    tempfile::TempDir,
    std::path::PathBuf,
    String,
) {
    let stage = crate::tools::Stage::new(TestDb::sqlite());
    crate::tools::post_many(&stage.server.addr, &stage.planner, "run", plans)
        .join()
        .expect("the plans");
    let dir = tempfile::tempdir().expect("tempdir");
    let cursor = dir.path().join("orders.cursor");
    let base = format!("http://{}", stage.server.addr);
    (stage, dir, cursor, base)
}

/// `follow` whose stdout was closed before it started (`>&-`) hands
/// nothing on: exit 74, one line, no cursor saved; the next run with an
/// output delivers every receipt.
#[test]
fn follow_with_a_closed_stdout_exits_74_and_keeps_the_cursor() {
    let (stage, _dir, cursor, base) = stage_with_plans(5);
    let follow = |shell_redirect: &str| {
        let script = format!(
            "exec \"$0\" follow --cursor-file '{}' --from-start --drain {shell_redirect}",
            cursor.display()
        );
        let command = crate::tools::tool(&[], &base, &stage.reader);
        let program = command.get_program().to_owned();
        let envs: Vec<_> = command
            .get_envs()
            .map(|(k, v)| (k.to_owned(), v.map(ToOwned::to_owned)))
            .collect();
        let mut shell = std::process::Command::new("sh");
        shell.arg("-c").arg(script).arg(program);
        for (key, value) in envs {
            match value {
                Some(value) => shell.env(key, value),
                None => shell.env_remove(key),
            };
        }
        shell.output().expect("follow")
    };
    for redirect in [">&-", ">/dev/full"] {
        let out = follow(redirect);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(74), "{redirect}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
        assert!(!stderr.contains("cursor is saved"), "{stderr}");
        assert!(!cursor.exists(), "{redirect}: no cursor saved");
    }
    let out = follow("");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 5);
    assert!(String::from_utf8_lossy(&out.stderr).contains("the cursor is saved"));
}

/// `follow --exec` of a command that cannot start (not found, not
/// executable) stops with exit 71 and one line instead of handing the page
/// to it again for ever; the cursor is not moved.
#[test]
fn follow_exec_of_a_command_that_cannot_start_exits_71() {
    let (stage, dir, cursor, base) = stage_with_plans(2);
    let not_executable = dir.path().join("script.sh");
    std::fs::write(&not_executable, "#!/bin/sh\ncat\n").expect("a script");
    for command in [
        "no-such-command-anywhere".to_owned(),
        not_executable.display().to_string(),
    ] {
        let out = crate::tools::tool(
            &[
                "follow",
                "--cursor-file",
                cursor.to_str().expect("path"),
                "--from-start",
                "--drain",
                "--exec",
                &command,
            ],
            &base,
            &stage.reader,
        )
        .output()
        .expect("follow");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(71), "{command}: {stderr}");
        let ours: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("plan-intake:"))
            .collect();
        assert_eq!(ours.len(), 1, "one line of its own: {stderr}");
        assert!(
            ours[0].contains("not found or is not executable"),
            "{stderr}"
        );
        assert!(!cursor.exists(), "the cursor stays where it was");
    }
}

/// `follow` with a cursor the service cannot place exits 65 with a line
/// that says what to do, and writes nothing.
#[test]
fn follow_with_another_deployments_cursor_exits_65() {
    let (stage, _dir, cursor, base) = stage_with_plans(2);
    let elsewhere = hex("v2:0:1:0011223344556677");
    std::fs::write(&cursor, format!("{elsewhere}\n")).expect("a cursor");
    let out = crate::tools::tool(
        &[
            "follow",
            "--cursor-file",
            cursor.to_str().expect("path"),
            "--drain",
        ],
        &base,
        &stage.reader,
    )
    .output()
    .expect("follow");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(65), "{stderr}");
    assert!(stderr.contains("--from-start"), "{stderr}");
    assert!(out.stdout.is_empty());
    assert_eq!(
        std::fs::read_to_string(&cursor).expect("cursor"),
        format!("{elsewhere}\n")
    );
}

/// Commands whose stdout is a broken pipe end with exit 74 and one line,
/// never a panic: `submit` after storing its plan; `logins add` creates no
/// login whose token nobody received (with stdout closed, too).
#[test]
fn commands_survive_their_output_going_away() {
    let stage = crate::tools::Stage::new(TestDb::sqlite());
    let dir = tempfile::tempdir().expect("tempdir");
    let request = crate::tools::request_file(&dir, "run-1");
    let broken_pipe = || {
        let (reader, writer) = std::io::pipe().expect("a pipe");
        drop(reader);
        writer
    };
    let out = crate::tools::tool(
        &["submit", request.to_str().expect("path")],
        &format!("http://{}", stage.server.addr),
        &stage.planner,
    )
    .stdout(broken_pipe())
    .output()
    .expect("submit");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(74), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stage.app.assert_rows(1, 1);

    let out = std::process::Command::new(crate::support::process::BIN)
        .arg("verify")
        .env("DATABASE_URL", &stage.app.db_ref().url)
        .env("PLAN_INTAKE_LOG", "warn")
        .stdout(broken_pipe())
        .output()
        .expect("verify");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(74), "verify: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    let logins = || stage.app.count("logins");
    let before = logins();
    let db_url = stage.app.db_ref().url.clone();
    let out = std::process::Command::new(crate::support::process::BIN)
        .args(["logins", "add", "lost", "--permission", "receipts:read"])
        .env("DATABASE_URL", &db_url)
        .env("PLAN_INTAKE_LOG", "warn")
        .stdout(broken_pipe())
        .output()
        .expect("logins add");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(74), "{stderr}");
    assert!(!stderr.contains("shown only once"), "{stderr}");
    assert_eq!(logins(), before, "no login without its token");

    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg("exec \"$0\" logins add lost --permission receipts:read >&-")
        .arg(crate::support::process::BIN)
        .env("DATABASE_URL", &db_url)
        .env("PLAN_INTAKE_LOG", "warn")
        .output()
        .expect("logins add");
    assert_eq!(
        out.status.code(),
        Some(74),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(logins(), before, "no login without its token");

    let out = std::process::Command::new(crate::support::process::BIN)
        .args(["logins", "add", "kept", "--permission", "receipts:read"])
        .env("DATABASE_URL", &db_url)
        .env("PLAN_INTAKE_LOG", "warn")
        .output()
        .expect("logins add");
    assert!(out.status.success());
    assert_eq!(logins(), before + 1);
}

/// A cursor file in a directory that does not exist: `follow` says so
/// (74) before it reads or hands on anything, rather than hand a page on
/// and then fail to save where it stands.
#[test]
fn follow_with_its_cursor_in_a_missing_directory_hands_nothing_on() {
    let (stage, dir, _cursor, base) = stage_with_plans(2);
    let cursor = dir.path().join("missing").join("orders.cursor");
    let out = crate::tools::tool(
        &[
            "follow",
            "--cursor-file",
            cursor.to_str().expect("path"),
            "--from-start",
            "--drain",
        ],
        &base,
        &stage.reader,
    )
    .output()
    .expect("follow");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(74), "{stderr}");
    assert!(
        out.stdout.is_empty(),
        "handed on: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(stderr.contains("missing"), "{stderr}");
}

/// `follow --drain` (a batch job) against a port nobody listens on ends,
/// saying it gave up, instead of trying for ever.
#[test]
fn follow_drain_against_a_dead_port_gives_up() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cursor = dir.path().join("orders.cursor");
    let dead = format!("http://127.0.0.1:{}", crate::support::process::free_port());
    let started = std::time::Instant::now();
    let out = crate::tools::tool(
        &[
            "follow",
            "--cursor-file",
            cursor.to_str().expect("path"),
            "--from-start",
            "--drain",
        ],
        &dead,
        "any-token",
    )
    .output()
    .expect("follow");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("gave up after"), "{stderr}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(90),
        "{:?}",
        started.elapsed()
    );
    assert!(!cursor.exists());
}
