//! The receipt log is kept, or the service says so: what the appender
//! could never get past refuses the start; what arises later makes the
//! service not ready (503 `receipt-log-stuck`, the gauge at 1) until a
//! round succeeds again; the log's lag behind the feed is exported; the
//! signing key's use is recorded whatever the appender does.

use std::time::{Duration, Instant};

use crate::evidence::generate_key;
use crate::support::process::{ServeProcess, client, keep_plan, login_via_cli, serve_refused};
use crate::support::{TestDb, execute_batch, plan_body, scalar};

fn arg(path: &std::path::Path) -> &str {
    path.to_str().expect("a utf-8 path")
}

/// A metric's value as the service's `/metrics` shows it.
fn metric(service: &ServeProcess, name: &str) -> Option<f64> {
    service
        .metrics_text()
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{name} ")))
        .and_then(|value| value.trim().parse().ok())
}

/// `/readyz`: the status and the body.
fn readyz(service: &ServeProcess) -> (u16, serde_json::Value) {
    readyz_as(service, None)
}

/// `/readyz` asked with a login's token (the detail is told to a login).
fn readyz_as(service: &ServeProcess, token: Option<&str>) -> (u16, serde_json::Value) {
    let mut request = client().get(&format!("http://{}/readyz", service.addr));
    if let Some(token) = token {
        request = request.set("Authorization", &format!("Bearer {token}"));
    }
    let response = match request.call() {
        Ok(response) => response,
        Err(ureq::Error::Status(_, response)) => response,
        Err(e) => panic!("GET /readyz: {e}"),
    };
    let status = response.status();
    let body = response
        .into_string()
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default();
    (status, body)
}

/// Long enough for a busy machine (the whole suite beside a CPU hog).
const PATIENCE: Duration = Duration::from_secs(60);

#[track_caller]
fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < PATIENCE, "never: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Polls `/readyz` until its answer is `expected`; else fails with the
/// last answer seen.
#[track_caller]
fn wait_for_readyz(
    service: &ServeProcess,
    token: Option<&str>,
    what: &str,
    mut expected: impl FnMut(u16, &serde_json::Value) -> bool,
) {
    let start = Instant::now();
    loop {
        let (status, body) = readyz_as(service, token);
        if expected(status, &body) {
            return;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "never: {what}; the last answer: {status} {body}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn submit(service: &ServeProcess, token: &str, prefix: &str, count: usize) {
    let agent = client();
    for i in 0..count {
        let run = format!("{prefix}-{i}");
        keep_plan(&agent, &service.addr, token, &run, &plan_body(&run, &run));
    }
}

/// A checkpoint file that holds another log's checkpoint (the runbook's
/// "new log under a new origin" with the old file kept): `serve` refuses
/// to start, naming the file and both origins, instead of signing
/// receipts it would never log.
fn a_checkpoint_file_of_another_log_refuses_the_start(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let kept = dir.path().join("last.checkpoint");
    let args = ["--signing-key", arg(&key), "--checkpoint-file", arg(&kept)];
    let service = ServeProcess::start_with(&db.url, &args);
    let token = login_via_cli(&db.url, "planner-a", "plans:submit");
    submit(&service, &token, "first", 2);
    wait_for("the checkpoint kept in the file", || {
        std::fs::read_to_string(&kept).is_ok_and(|note| note.contains("\n2\n"))
    });
    service.terminate();

    // Another deployment's database (the name in this one is refused
    // before the file is read).
    let another = match db.backend {
        plan_intake::storage::Backend::Sqlite => TestDb::sqlite(),
        plan_intake::storage::Backend::Postgres => TestDb::postgres().expect("Postgres"),
    };
    let said = serve_refused(
        &another.url,
        &[&["--log-origin", "example.com/another-log"][..], &args[..]].concat(),
    );
    assert!(
        said.contains(&kept.display().to_string()) && said.contains("example.com/another-log"),
        "{said}"
    );
}

/// A log that stops extending what was signed (its stored hashes changed
/// under the service): the service goes on taking and signing plans, but
/// is not ready, says why, sets the gauge, exports the log's lag, and keeps
/// recording its key's use; once the hashes are mended, the next round
/// appends and it is ready again.
fn a_log_that_cannot_be_appended_to_makes_the_service_not_ready(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let service = ServeProcess::start_with(&db.url, &["--signing-key", arg(&key)]);
    let token = login_via_cli(&db.url, "planner-a", "plans:submit");
    submit(&service, &token, "logged", 3);
    let database = db.open();
    let mut conn = database.conn().expect("a connection");
    wait_for("three leaves logged", || {
        scalar(&mut conn, "SELECT COUNT(*) AS n FROM receipt_log") == 3
    });
    assert_eq!(readyz(&service).0, 200);
    assert_eq!(metric(&service, "plan_intake_receipt_log_stuck"), Some(0.0));

    // The stored hashes changed (kept aside first): no new tree extends
    // the one signed.
    execute_batch(
        &mut conn,
        "CREATE TABLE kept_hashes AS SELECT * FROM receipt_log_hashes;
         UPDATE receipt_log_hashes SET hash = receipt_log_checkpoints.root_hash
           FROM receipt_log_checkpoints;",
    );
    submit(&service, &token, "unlogged", 1);
    wait_for_readyz(
        &service,
        Some(&token),
        "/readyz saying the log is stuck",
        |status, body| {
            status == 503
                && body["type"]
                    .as_str()
                    .is_some_and(|t| t.ends_with("/receipt-log-stuck"))
                && body["detail"]
                    .as_str()
                    .is_some_and(|d| d.contains("is not an extension of the checkpoint"))
        },
    );
    assert_eq!(metric(&service, "plan_intake_receipt_log_stuck"), Some(1.0));
    // A stranger is told the reason's type, never its detail.
    let (status, told) = readyz(&service);
    assert_eq!(status, 503, "{told}");
    assert!(
        told["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("/receipt-log-stuck"))
            && !told.to_string().contains("extension"),
        "{told}"
    );
    wait_for("the lag of the unlogged receipt exported", || {
        metric(&service, "plan_intake_receipt_log_lag_seconds").is_some_and(|lag| lag > 0.0)
    });
    // Plans are still taken and signed meanwhile, and the key's use kept.
    submit(&service, &token, "meanwhile", 1);
    assert_eq!(
        scalar(&mut conn, "SELECT COUNT(*) AS n FROM signing_keys"),
        1,
        "the key's use is recorded by a thread of its own"
    );

    execute_batch(
        &mut conn,
        "DELETE FROM receipt_log_hashes;
         INSERT INTO receipt_log_hashes SELECT * FROM kept_hashes;
         DROP TABLE kept_hashes;",
    );
    wait_for_readyz(
        &service,
        None,
        "ready again once the log is mended",
        |status, _| status == 200,
    );
    wait_for("every receipt logged", || {
        scalar(&mut conn, "SELECT COUNT(*) AS n FROM receipt_log") == 5
    });
    assert_eq!(metric(&service, "plan_intake_receipt_log_stuck"), Some(0.0));
    wait_for("no lag once every receipt is logged", || {
        metric(&service, "plan_intake_receipt_log_lag_seconds") == Some(0.0)
    });
}

/// A signing key whose published row was replaced around the service
/// (another verifier key under its id): receipts it signs could not be
/// checked against `GET /v1/signing-keys`, so the service is not ready
/// and says why (503 `signing-key-unpublished`).
fn a_key_published_as_another_makes_the_service_not_ready(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let other = generate_key(dir.path(), "k2");
    let service = ServeProcess::start_with(&db.url, &["--signing-key", arg(&key)]);
    assert_eq!(readyz(&service).0, 200);
    service.terminate();
    let other_public =
        std::fs::read_to_string(format!("{}.pub", other.display())).expect("the other public key");
    let database = db.open();
    let mut conn = database.conn().expect("a connection");
    execute_batch(
        &mut conn,
        &format!(
            "UPDATE signing_keys SET verifier_key = '{}'",
            other_public.trim()
        ),
    );
    let service = ServeProcess::start_with(&db.url, &["--signing-key", arg(&key)]);
    let token = login_via_cli(&db.url, "operator", "receipts:read");
    wait_for_readyz(
        &service,
        Some(&token),
        "/readyz saying the key is not published",
        |status, body| {
            status == 503
                && body["type"]
                    .as_str()
                    .is_some_and(|t| t.ends_with("/signing-key-unpublished"))
                && body["detail"]
                    .as_str()
                    .is_some_and(|d| d.contains("another verifier key"))
        },
    );
}

crate::on_both_backends_sync!(
    a_deployment_names_its_log_never_by_the_shared_default,
    a_key_published_as_another_makes_the_service_not_ready,
    a_checkpoint_file_of_another_log_refuses_the_start,
    a_log_that_cannot_be_appended_to_makes_the_service_not_ready,
);

/// A new log is never signed under the shared default origin: asked for
/// it, `serve` refuses; given none, it derives one from the signing key
/// (`plan-intake/KEYID`) and says so; restarted with another key, the
/// log keeps the name it has; renaming it is refused.
fn a_deployment_names_its_log_never_by_the_shared_default(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let said = serve_refused(
        &db.url,
        &["--signing-key", arg(&key), "--log-origin", "plan-intake"],
    );
    assert!(
        said.contains("--log-origin plan-intake is every deployment's default"),
        "{said}"
    );

    let service = ServeProcess::start_with(&db.url, &["--signing-key", arg(&key)]);
    let token = login_via_cli(&db.url, "planner-a", "plans:submit");
    submit(&service, &token, "named", 1);
    let note = crate::evidence::checkpoint_of_at_least(&service.addr, 1);
    let public = std::fs::read_to_string(format!("{}.pub", key.display())).expect("public key");
    let key_id = public
        .trim()
        .split('+')
        .nth(1)
        .expect("the key's id")
        .to_owned();
    let origin = note.lines().next().expect("an origin").to_owned();
    assert_eq!(origin, format!("plan-intake/{key_id}"), "{note}");
    service.terminate();

    // Restarted with a new key (a rotation): the log keeps its name, not
    // one derived from the new key.
    let new_key = generate_key(dir.path(), "k2");
    let service = ServeProcess::start_with(
        &db.url,
        &["--signing-key", arg(&new_key), "--signing-key", arg(&key)],
    );
    submit(&service, &token, "again", 1);
    let note = crate::evidence::checkpoint_of_at_least(&service.addr, 2);
    assert_eq!(note.lines().next(), Some(origin.as_str()), "{note}");
    service.terminate();

    // Renamed, the log would be one tree under two names: refused.
    let said = serve_refused(
        &db.url,
        &[
            "--signing-key",
            arg(&new_key),
            "--log-origin",
            "example.com/renamed",
        ],
    );
    assert!(
        said.contains(&format!(
            "the receipt log in the database is named {origin:?}"
        )),
        "{said}"
    );
}
