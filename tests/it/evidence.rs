//! Receipts as evidence, through the real binary on both backends: signed
//! receipts verified offline (`receipts verify`) and by an independent
//! RFC 6962 implementation (`tests/fixtures/rfc6962.py`), tampering named
//! by `audit`, a key rotation, two appenders at once, and a kill -9 in the
//! middle of an append.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::on_both_backends_sync;
use crate::support::TestDb;
use crate::support::load::Load;
use crate::support::process::{
    ServeProcess, client, keep_plan, login_via_cli, post_plan, run_cli_at,
};

on_both_backends_sync!(
    signed_receipts_and_their_proofs_verify_offline,
    audit_names_an_edited_plan_a_removed_receipt_a_reordered_feed_and_a_fork,
    a_rotated_key_keeps_old_receipts_verifiable,
    two_instances_appending_under_load_leave_one_consistent_tree,
    a_kill_9_mid_append_resumes_without_a_fork,
    without_a_key_receipts_are_unsigned_and_no_log_is_kept,
    audit_names_an_unsigned_edit_and_receipts_the_log_passed,
    audit_names_a_backdated_unsigned_edit_by_its_place_in_the_feed,
);

/// `signing-keys generate --out DIR/NAME`: the private key's path.
pub(crate) fn generate_key(dir: &Path, name: &str) -> PathBuf {
    let out = dir.join(name);
    let path = out.to_str().expect("utf-8 path");
    let made = run_cli_at(
        "sqlite://unused.db",
        &["signing-keys", "generate", "--out", path],
    );
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let private = std::fs::read_to_string(&out).expect("private key");
    assert!(private.starts_with("PRIVATE+KEY+plan-intake+"));
    let public = std::fs::read_to_string(format!("{path}.pub")).expect("public key");
    assert!(public.starts_with("plan-intake+") && !public.contains("PRIVATE"));
    out
}

pub(crate) fn serve_signed(url: &str, keys: &[&Path]) -> ServeProcess {
    let mut args = Vec::new();
    for key in keys {
        args.push("--signing-key");
        args.push(key.to_str().expect("utf-8 path"));
    }
    ServeProcess::start_with(url, &args)
}

/// A service signing with `key` whose append round that reaches `leaves`
/// leaves stops between its writes and its COMMIT (the test seam), for a
/// test to kill it there.
fn serve_stalling_at(url: &str, key: &Path, leaves: u64) -> ServeProcess {
    ServeProcess::start_env(
        url,
        "127.0.0.1:0",
        &["--signing-key", arg(key)],
        &[("PLAN_INTAKE_TEST_STALL_APPEND", &leaves.to_string())],
    )
}

/// GET `path` as text: the status and the body.
pub(crate) fn get_text(addr: &str, token: Option<&str>, path: &str) -> (u16, String) {
    let mut request = client().get(&format!("http://{addr}{path}"));
    if let Some(token) = token {
        request = request.set("Authorization", &format!("Bearer {token}"));
    }
    let response = match request.call() {
        Ok(response) => response,
        Err(ureq::Error::Status(_, response)) => response,
        Err(e) => panic!("GET {path}: {e}"),
    };
    (
        response.status(),
        response.into_string().expect("text body"),
    )
}

/// The newest checkpoint once it holds at least `size` leaves (within 30 s).
pub(crate) fn checkpoint_of_at_least(addr: &str, size: u64) -> String {
    let start = Instant::now();
    loop {
        let (status, note) = get_text(addr, None, "/v1/checkpoint");
        if status == 200 && checkpoint_size(&note) >= size {
            return note;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no checkpoint of {size} leaves within 30 s; the last: {status} {note}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub(crate) fn checkpoint_size(note: &str) -> u64 {
    note.lines()
        .nth(1)
        .and_then(|l| l.parse().ok())
        .unwrap_or(0)
}

pub(crate) fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write a file");
    path
}

pub(crate) fn arg(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// `plan-intake receipts verify`: its exit status and its output.
fn verify(receipt: &Path, keys: &Path, proof: Option<&Path>) -> (i32, String) {
    let mut args = vec!["receipts", "verify", arg(receipt), "--keys", arg(keys)];
    if let Some(proof) = proof {
        args.extend(["--proof", arg(proof)]);
    }
    let out = run_cli_at("sqlite://unused.db", &args);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// `plan-intake audit --keys KEYS [--checkpoint FILE]…`: exit status and output.
pub(crate) fn audit(url: &str, keys: &Path, checkpoints: &[&Path]) -> (i32, String) {
    let mut args = vec!["audit", "--keys", arg(keys)];
    for checkpoint in checkpoints {
        args.extend(["--checkpoint", arg(checkpoint)]);
    }
    let out = run_cli_at(url, &args);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// The independent check (`tests/fixtures/rfc6962.py ARGS…`) holds.
pub(crate) fn independent_check(args: &[&str]) {
    independent_check_as(args, None);
}

/// [`independent_check`] with a reader's token for the entry bundles.
pub(crate) fn independent_check_as(args: &[&str], token: Option<&str>) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/rfc6962.py");
    let mut command = Command::new("python3");
    command.arg(script).args(args);
    if let Some(token) = token {
        command.env("PLAN_INTAKE_TOKEN", token);
    }
    let out = command.output().expect("run python3");
    assert!(
        out.status.success(),
        "the independent RFC 6962 check failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A plan body unique to `run`.
fn body(run: &str) -> String {
    format!(
        r#"{{"run_id":"{run}","approved_inputs":[{{"id":"forecast-v12"}}],"content":{{"run":"{run}","note":"Größe ✓"}}}}"#
    )
}

/// Submits `count` plans (`{prefix}-0`…); their receipts in order.
pub(crate) fn submit(addr: &str, token: &str, prefix: &str, count: usize) -> Vec<Value> {
    let agent = client();
    (0..count)
        .map(|i| {
            let run = format!("{prefix}-{i}");
            keep_plan(&agent, addr, token, &format!("key-{run}"), &body(&run))
        })
        .collect()
}

pub(crate) fn signing_keys_file(addr: &str, dir: &Path) -> PathBuf {
    let (status, keys) = get_text(addr, None, "/v1/signing-keys");
    assert_eq!(status, 200, "{keys}");
    write(dir, "keys.json", &keys)
}

fn signed_receipts_and_their_proofs_verify_offline(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let service = serve_signed(&db.url, &[&key]);
    let token = login_via_cli(&db.url, "planner-a", "plans:submit");
    let receipts = submit(&service.addr, &token, "run", 7);
    let first = checkpoint_of_at_least(&service.addr, 7);
    let first_path = write(dir.path(), "first.checkpoint", &first);

    // A replay answers the signature the plan was first answered with.
    let (status, replayed) = post_plan(
        &client(),
        &service.addr,
        &token,
        "key-run-3",
        &body("run-3"),
    )
    .expect("answer");
    assert_eq!(
        (status, &replayed["outcome"]),
        (200, &Value::from("replayed"))
    );
    assert_eq!(replayed["signature"], receipts[3]["signature"]);
    assert!(receipts[3]["signature"]["ed25519"].is_string());

    let keys = signing_keys_file(&service.addr, dir.path());
    for receipt in &receipts {
        let id = receipt["receipt_id"].as_str().expect("an id");
        let receipt_path = write(dir.path(), &format!("{id}.json"), &receipt.to_string());
        let (status, proof) = get_text(
            &service.addr,
            Some(&token),
            &format!("/v1/receipts/{id}/proof"),
        );
        assert_eq!(status, 200, "{proof}");
        assert!(
            proof.starts_with("c2sp.org/tlog-proof@v1\nindex "),
            "{proof}"
        );
        let proof_path = write(dir.path(), &format!("{id}.tlog-proof"), &proof);
        let (code, said) = verify(&receipt_path, &keys, Some(&proof_path));
        assert_eq!(code, 0, "{said}");
        assert!(said.contains("signature by plan-intake+"), "{said}");
        independent_check(&["inclusion", arg(&receipt_path), arg(&proof_path)]);
    }
    // Read back by id, the receipt verifies too (same signature, no outcome).
    let id = receipts[0]["receipt_id"].as_str().expect("an id");
    let (_, read) = get_text(&service.addr, Some(&token), &format!("/v1/receipts/{id}"));
    let read_path = write(dir.path(), "read.json", &read);
    assert_eq!(verify(&read_path, &keys, None).0, 0);

    // A plan read with its receipt verifies, and its content is held to
    // the receipt's hash; a receipt with a member twice is refused.
    let (_, plan) = get_text(&service.addr, Some(&token), &format!("/v1/plans/{id}"));
    let plan_path = write(dir.path(), "plan.json", &plan);
    let (code, said) = verify(&plan_path, &keys, None);
    assert_eq!(code, 0, "{said}");
    let edited = write(
        dir.path(),
        "edited-plan.json",
        &plan.replacen("Größe", "Grösse", 1),
    );
    let (code, said) = verify(&edited, &keys, None);
    assert_eq!(code, 65, "{said}");
    assert!(
        said.contains("not what its receipt was given for"),
        "{said}"
    );
    let twice = read.replacen('{', r#"{"maker":"mallory","#, 1);
    let twice_path = write(dir.path(), "twice.json", &twice);
    let (code, said) = verify(&twice_path, &keys, None);
    assert_eq!(code, 65, "{said}");
    assert!(said.contains("duplicate member name `maker`"), "{said}");

    // A changed receipt, a changed proof and an unknown key are refused (65).
    let mut changed = receipts[1].clone();
    changed["run_id"] = Value::from("run-99");
    let changed_path = write(dir.path(), "changed.json", &changed.to_string());
    let (code, said) = verify(&changed_path, &keys, None);
    assert_eq!(code, 65, "{said}");
    assert!(said.contains("does not match the receipt"), "{said}");
    let id1 = receipts[1]["receipt_id"].as_str().expect("an id");
    let (_, proof) = get_text(
        &service.addr,
        Some(&token),
        &format!("/v1/receipts/{id1}/proof"),
    );
    let original = write(dir.path(), "r1.json", &receipts[1].to_string());
    let moved = proof.replacen("index 1\n", "index 2\n", 1);
    let moved_path = write(dir.path(), "moved.tlog-proof", &moved);
    let (code, said) = verify(&original, &keys, Some(&moved_path));
    assert_eq!(code, 65, "{said}");
    let other_key = generate_key(dir.path(), "stranger");
    let strangers = PathBuf::from(format!("{}.pub", other_key.display()));
    let (code, said) = verify(&original, &strangers, None);
    assert_eq!(code, 65, "{said}");
    assert!(said.contains("not among the trusted keys"), "{said}");

    // The log grows; the newer checkpoint extends the first (consistency
    // proof from the service, checked independently), and the audit holds.
    submit(&service.addr, &token, "later", 6);
    let second = checkpoint_of_at_least(&service.addr, 13);
    let second_path = write(dir.path(), "second.checkpoint", &second);
    let (status, consistency) = get_text(
        &service.addr,
        None,
        &format!(
            "/v1/checkpoint/consistency?old={}&new={}",
            checkpoint_size(&first),
            checkpoint_size(&second)
        ),
    );
    assert_eq!(status, 200, "{consistency}");
    let consistency_path = write(dir.path(), "consistency", &consistency);
    independent_check(&[
        "consistency",
        arg(&first_path),
        arg(&second_path),
        arg(&consistency_path),
    ]);
    let (code, said) = audit(&db.url, &keys, &[&first_path]);
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("13 plans (0 unsigned), 13 leaves"), "{said}");
    drop(service);
}

/// Runs `sql` on the scratch database, around the service.
pub(crate) fn tamper(db: &TestDb, sql: &str) {
    let database = db.open_with(plan_intake::storage::MigrateOnOpen::Skip);
    let mut conn = database.conn().expect("connection");
    crate::support::execute_batch(&mut conn, sql);
}

fn audit_names_an_edited_plan_a_removed_receipt_a_reordered_feed_and_a_fork(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let service = serve_signed(&db.url, &[&key]);
    let token = login_via_cli(&db.url, "planner-a", "plans:submit");
    let mut receipts = submit(&service.addr, &token, "run", 3);
    let early = checkpoint_of_at_least(&service.addr, 3);
    receipts.extend(submit(&service.addr, &token, "more", 3));
    let logged = checkpoint_of_at_least(&service.addr, 6);
    let keys = signing_keys_file(&service.addr, dir.path());
    service.terminate();
    let (code, said) = audit(&db.url, &keys, &[]);
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("6 plans (0 unsigned), 6 leaves"), "{said}");
    let id = |i: usize| {
        receipts[i]["receipt_id"]
            .as_str()
            .expect("an id")
            .to_owned()
    };

    // A checkpoint signed with the service's own key for another tree
    // (say, a restored backup that went another way) is not an extension.
    let signer = plan_intake::intake::signing::SigningKey::from_private(
        &std::fs::read_to_string(&key).expect("key"),
    )
    .expect("the key");
    let origin = early.lines().next().expect("the log's origin");
    let forge = |size: u64, name: &str| {
        let note = plan_intake::intake::receipt_log::checkpoint_note(
            &[&signer],
            origin,
            size,
            tlog_tiles::record_hash(b"another tree"),
        )
        .expect("signed");
        write(dir.path(), name, &note)
    };
    let (beyond, forked, twin) = (forge(7, "7"), forge(5, "5"), forge(6, "6"));
    let early_path = write(dir.path(), "early.checkpoint", &early);
    let logged_path = write(dir.path(), "logged.checkpoint", &logged);
    let (code, said) = audit(
        &db.url,
        &keys,
        &[&early_path, &logged_path, &beyond, &forked, &twin],
    );
    assert_eq!(code, 65, "{said}");
    for line in [
        "signed for 7 leaves, but the log has 6",
        "/5: its root hash for 5 leaves is not the root of the log's leaves",
        "not an extension of",
        "two different trees of 6 leaves signed",
    ] {
        assert!(said.contains(line), "{line}: {said}");
    }

    // An edited plan, a removed receipt, a feed reordered: each named.
    // Moved to the feed's end: SQLite orders the feed by id (its key rows
    // follow it), Postgres by feed_xid.
    let (order_column, keys_follow) = match db.backend {
        plan_intake::storage::Backend::Postgres => ("feed_xid", String::new()),
        plan_intake::storage::Backend::Sqlite => (
            "id",
            format!(
                "PRAGMA foreign_keys = OFF; UPDATE intake_keys SET plan_id = plan_id + 1000000
                  WHERE plan_id = (SELECT id FROM plans WHERE receipt_id = '{}');",
                id(0)
            ),
        ),
    };
    tamper(
        &db,
        &format!(
            "{keys_follow}
             UPDATE plans SET content = '{{\"run\":\"edited\"}}' WHERE receipt_id = '{}';
             DELETE FROM intake_keys WHERE plan_id = (SELECT id FROM plans WHERE receipt_id = '{}');
             DELETE FROM plans WHERE receipt_id = '{}';
             UPDATE plans SET {order_column} = {order_column} + 1000000 WHERE receipt_id = '{}';
             UPDATE plans SET permissions = '[\"plans:submit\",\"receipts:read\"]' WHERE receipt_id = '{}';",
            id(1),
            id(3),
            id(3),
            id(0),
            id(5),
        ),
    );
    let (code, said) = audit(&db.url, &keys, &[&logged_path]);
    assert_eq!(code, 65, "{said}");
    let lines: Vec<&str> = said.lines().collect();
    let names = |needle: &str, receipt: &str| {
        lines
            .iter()
            .any(|l| l.contains(needle) && l.contains(receipt))
    };
    assert!(
        names("content or approved inputs were changed", &id(1)),
        "{said}"
    );
    assert!(names("removed from the plans table", &id(3)), "{said}");
    assert!(names("out of feed order", ""), "{said}");
    assert!(names("changed after it was logged", &id(5)), "{said}");
    assert!(names("does not match the receipt", &id(5)), "{said}");
    // Rows changed under the log never pass for a forked log.
    assert!(
        !said.contains("not an extension") && !said.contains("root hash"),
        "{said}"
    );
    assert!(said.contains("finding(s)"), "{said}");
}

fn a_rotated_key_keeps_old_receipts_verifiable(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let old_key = generate_key(dir.path(), "old");
    let new_key = generate_key(dir.path(), "new");
    let service = serve_signed(&db.url, &[&old_key]);
    let token = login_via_cli(&db.url, "planner-a", "plans:submit");
    let before = submit(&service.addr, &token, "before", 3);
    checkpoint_of_at_least(&service.addr, 3);
    service.terminate();

    // The new key signs; the old one stays published.
    let service = serve_signed(&db.url, &[&new_key, &old_key]);
    let after = submit(&service.addr, &token, "after", 3);
    checkpoint_of_at_least(&service.addr, 6);
    let old_id = before[0]["signature"]["key_id"].as_str().expect("key id");
    let new_id = after[0]["signature"]["key_id"].as_str().expect("key id");
    assert_ne!(old_id, new_id);
    let (_, replayed) = post_plan(
        &client(),
        &service.addr,
        &token,
        "key-before-0",
        &body("before-0"),
    )
    .expect("answer");
    assert_eq!(
        replayed["signature"], before[0]["signature"],
        "a replay keeps its signature"
    );

    let (_, published) = get_text(&service.addr, None, "/v1/signing-keys");
    let published: Value = serde_json::from_str(&published).expect("json");
    assert_eq!(published["signing_now"], Value::from(new_id));
    let ids: Vec<&str> = published["keys"]
        .as_array()
        .expect("keys")
        .iter()
        .filter_map(|k| k["key_id"].as_str())
        .collect();
    assert!(
        ids.contains(&old_id) && ids.contains(&new_id),
        "{published}"
    );
    let keys = signing_keys_file(&service.addr, dir.path());
    for receipt in before.iter().chain(&after) {
        let path = write(dir.path(), "receipt.json", &receipt.to_string());
        let (code, said) = verify(&path, &keys, None);
        assert_eq!(code, 0, "{said}");
    }
    let (code, said) = audit(&db.url, &keys, &[]);
    assert_eq!(code, 0, "{said}");
    // An auditor who trusts only the new key is told of the other.
    let only_new = PathBuf::from(format!("{}.pub", new_key.display()));
    let (code, said) = audit(&db.url, &only_new, &[]);
    assert_eq!(code, 65, "{said}");
    assert!(
        said.contains(&format!(
            "signing key {old_id}: published by the database but not among the keys you trust"
        )),
        "{said}"
    );
    // An auditor still holding the keys saved before the rotation is told
    // of the new key once, not once per receipt and checkpoint it signed.
    let only_old = PathBuf::from(format!("{}.pub", old_key.display()));
    let (code, said) = audit(&db.url, &only_old, &[]);
    assert_eq!(code, 65, "{said}");
    assert!(
        said.contains(&format!(
            "3 receipts, from {} to {} in feed order, are signed by {new_id}",
            after[0]["receipt_id"].as_str().unwrap_or_default(),
            after[2]["receipt_id"].as_str().unwrap_or_default()
        )),
        "{said}"
    );
    assert!(
        said.contains(": 2 finding(s)"),
        "the key published, the receipts it signed: {said}"
    );
    drop(service);
}

fn two_instances_appending_under_load_leave_one_consistent_tree(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let one = serve_signed(&db.url, &[&key]);
    let two = serve_signed(&db.url, &[&key]);
    let token = login_via_cli(&db.url, "planner-a", "plans:submit");
    let addrs = [one.addr.clone(), two.addr.clone()];
    let load = Load::start(8, &token, |client| addrs[client % 2].clone());
    load.wait_for_created(300);
    let sent = load.stop();
    let created = sent.iter().filter(|s| s.status() == Some(201)).count() as u64;
    let last = checkpoint_of_at_least(&one.addr, created);
    assert_eq!(checkpoint_of_at_least(&two.addr, created), last);
    let keys = signing_keys_file(&one.addr, dir.path());
    let (code, said) = audit(&db.url, &keys, &[]);
    assert_eq!(code, 0, "{said}");
    assert!(
        said.contains(&format!("{created} plans (0 unsigned), {created} leaves")),
        "{said}"
    );
    // They took turns: no round of either failed (a collision would).
    for instance in [&one, &two] {
        let metrics = instance.metrics_text();
        assert!(
            metrics.contains("plan_intake_receipt_log_rounds_failed_total 0"),
            "{metrics}"
        );
    }
    drop((one, two));
}

fn a_kill_9_mid_append_resumes_without_a_fork(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let service = serve_signed(&db.url, &[&key]);
    let token = login_via_cli(&db.url, "planner-a", "plans:submit");
    submit(&service.addr, &token, "before", 3);
    let before = checkpoint_of_at_least(&service.addr, 3);
    let before_path = write(dir.path(), "before.checkpoint", &before);
    let keys = signing_keys_file(&service.addr, dir.path());
    service.terminate();

    // An appender that stops once its append reaches 7 leaves, written but
    // not committed, is killed there (rounds below 7 commit as usual).
    let stalled = serve_stalling_at(&db.url, &key, 7);
    submit(&stalled.addr, &token, "during", 4);
    const STALLED: &str = "append to 7 leaves written, not committed, root ";
    let stalled_root = stalled
        .await_said(STALLED)
        .split_once(STALLED)
        .map(|(_, root)| root.trim().to_owned())
        .unwrap_or_default();
    stalled.kill_9();
    let database = db.open_with(plan_intake::storage::MigrateOnOpen::Skip);
    let mut conn = database.conn().expect("connection");
    let committed = crate::support::count_rows(&mut conn, "receipt_log");
    assert!((3..7).contains(&committed), "{committed} leaves committed");
    drop(conn);

    // The next appender resumes from the committed tree: one tree, the
    // checkpoint from before the kill extended, nothing forked.
    let service = serve_signed(&db.url, &[&key]);
    let after = checkpoint_of_at_least(&service.addr, 7);
    assert_eq!(checkpoint_size(&after), 7);
    assert_eq!(
        after.lines().nth(2),
        Some(stalled_root.as_str()),
        "the resumed tree is the one the killed round had built"
    );
    let after_path = write(dir.path(), "after.checkpoint", &after);
    let (_, consistency) = get_text(
        &service.addr,
        None,
        "/v1/checkpoint/consistency?old=3&new=7",
    );
    let consistency_path = write(dir.path(), "consistency", &consistency);
    independent_check(&[
        "consistency",
        arg(&before_path),
        arg(&after_path),
        arg(&consistency_path),
    ]);
    let (code, said) = audit(&db.url, &keys, &[&before_path, &after_path]);
    assert_eq!(code, 0, "{said}");
    drop(service);
}

fn without_a_key_receipts_are_unsigned_and_no_log_is_kept(db: TestDb) {
    let service = ServeProcess::start(&db.url);
    assert!(
        service.said("receipts are not signed"),
        "the start does not say so"
    );
    let token = login_via_cli(&db.url, "planner-a", "plans:submit");
    let receipt = &submit(&service.addr, &token, "run", 1)[0];
    assert!(receipt.get("signature").is_none(), "{receipt}");
    let (status, ready) = get_text(&service.addr, None, "/readyz");
    assert_eq!(status, 200);
    assert!(ready.contains(r#""receipts_signed":false"#), "{ready}");
    let (status, problem) = get_text(&service.addr, None, "/v1/checkpoint");
    assert_eq!(status, 404, "{problem}");
    assert!(problem.contains("not-logged-yet"), "{problem}");
    drop(service);
}

/// A database restored to before a checkpoint the service signed: with
/// `--checkpoint-file` the service refuses to sign over it; without, it
/// signs a fork, which `audit` names given the checkpoint kept before.
#[test]
fn a_restored_database_is_never_signed_over_with_a_checkpoint_file() {
    let db = TestDb::sqlite();
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let kept = dir.path().join("last.checkpoint");
    let args = ["--signing-key", arg(&key), "--checkpoint-file", arg(&kept)];
    let service = ServeProcess::start_with(&db.url, &args);
    let token = login_via_cli(&db.url, "planner-a", "plans:submit");
    submit(&service.addr, &token, "before", 3);
    checkpoint_of_at_least(&service.addr, 3);
    let keys = signing_keys_file(&service.addr, dir.path());
    service.terminate();
    let backup = dir.path().join("backup.db");
    tamper(&db, &format!("VACUUM INTO '{}'", backup.display()));

    let service = ServeProcess::start_with(&db.url, &args);
    submit(&service.addr, &token, "lost", 2);
    let published = checkpoint_of_at_least(&service.addr, 5);
    let published_path = write(dir.path(), "published.checkpoint", &published);
    service.terminate();
    assert_eq!(std::fs::read_to_string(&kept).expect("kept"), published);

    // The restore: the backup, taken before the last two plans.
    let file = db.url.trim_start_matches("sqlite://").to_owned();
    for stale in ["-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{file}{stale}"));
    }
    std::fs::copy(&backup, &file).expect("restore the backup");
    // Known at start: the service refuses to start rather than sign.
    let said = crate::support::process::serve_refused(&db.url, &args);
    assert!(
        said.contains("does not extend the checkpoint kept in")
            && said.contains("is not an extension of the checkpoint of size 5"),
        "{said}"
    );

    // Without the file, the fork is signed, and the audit names it.
    let service = serve_signed(&db.url, &[&key]);
    submit(&service.addr, &token, "after", 2);
    checkpoint_of_at_least(&service.addr, 5);
    service.terminate();
    let (code, said) = audit(&db.url, &keys, &[&published_path]);
    assert_eq!(code, 65, "{said}");
    assert!(
        said.contains("two different trees of 5 leaves signed"),
        "{said}"
    );
}

/// The gaps an audit must see. A signed plan edited before the log took it
/// (its permissions changed and its signature removed, while the appender
/// was held back): the log holds the edit, so only the missing signature
/// tells, and a plan received while a key was signing must carry one. A
/// signed plan placed behind the log's end, never logged (a skipped
/// position: the likelier cause, since the service signed it), and an
/// unsigned one written there by hand (a write around the service is
/// likelier): each named with its place and its likelier cause.
fn audit_names_an_unsigned_edit_and_receipts_the_log_passed(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let service = serve_signed(&db.url, &[&key]);
    let token = login_via_cli(&db.url, "planner-a", "plans:submit");
    submit(&service.addr, &token, "logged", 2);
    checkpoint_of_at_least(&service.addr, 2);
    let keys = signing_keys_file(&service.addr, dir.path());
    service.terminate();

    // Two more plans, signed, whose round (one: none runs before both are
    // in, or on SQLite the stalled round would hold the second's write) is
    // held before its COMMIT and killed there: neither is logged.
    let stalled = ServeProcess::start_env(
        &db.url,
        "127.0.0.1:0",
        &["--signing-key", arg(&key)],
        &[
            ("PLAN_INTAKE_TEST_STALL_APPEND", "3"),
            ("PLAN_INTAKE_TEST_APPEND_FROM", "4"),
        ],
    );
    let held = submit(&stalled.addr, &token, "held", 2);
    stalled.await_said("written, not committed");
    stalled.kill_9();
    let id = |receipt: &Value| receipt["receipt_id"].as_str().expect("an id").to_owned();
    let (edited, skipped) = (id(&held[0]), id(&held[1]));
    // Behind the log's end: Postgres orders the feed by feed_xid, SQLite by
    // id (its key row follows it).
    let behind = |receipt: &str, to: i64| match db.backend {
        plan_intake::storage::Backend::Postgres => {
            format!("UPDATE plans SET feed_xid = {to} WHERE receipt_id = '{receipt}';")
        }
        plan_intake::storage::Backend::Sqlite => format!(
            "PRAGMA foreign_keys = OFF;
             UPDATE intake_keys SET plan_id = {to}
              WHERE plan_id = (SELECT id FROM plans WHERE receipt_id = '{receipt}');
             UPDATE plans SET id = {to} WHERE receipt_id = '{receipt}';"
        ),
    };
    tamper(
        &db,
        &format!(
            "UPDATE plans SET receipt_signature = NULL,
                              permissions = '[\"plans:submit\",\"receipts:read\"]'
              WHERE receipt_id = '{edited}';
             {}
             {};
             {}",
            behind(&skipped, -1),
            crate::support::hand_written_plan_sql(
                "rcpt_by_hand",
                "planner-a",
                "'by-hand'",
                "blake3:by-hand"
            ),
            behind("rcpt_by_hand", -2),
        ),
    );
    // The next appender logs the edited plan as it now stands (kept
    // without a checkpoint file: with the default one, the stalled round's
    // checkpoint kept there refuses the start over the edited rows).
    let service = ServeProcess::start_with(
        &db.url,
        &["--signing-key", arg(&key), "--no-checkpoint-file"],
    );
    checkpoint_of_at_least(&service.addr, 3);
    service.terminate();

    let (code, said) = audit(&db.url, &keys, &[]);
    assert_eq!(code, 65, "{said}");
    let line = |receipt: &str| {
        said.lines()
            .find(|l| l.contains(receipt) && l.contains("not in the log"))
            .unwrap_or_default()
            .to_owned()
    };
    assert!(
        said.lines()
            .any(|l| l.contains(&edited) && l.contains("carries no signature")),
        "the unsigned edit: {said}"
    );
    assert!(
        line(&skipped).contains("a skipped position is likelier"),
        "{said}"
    );
    assert!(
        line("rcpt_by_hand").contains("a write around the service is likelier"),
        "{said}"
    );
}

/// A signed plan whose row, before the log took it, was given a
/// permission, moved three days back (before the key's first use) and
/// stripped of its signature: the log takes it as it stands, and `audit`
/// names it by its place in the feed (after a signed receipt), not by the
/// time the edit moved.
fn audit_names_a_backdated_unsigned_edit_by_its_place_in_the_feed(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let service = serve_signed(&db.url, &[&key]);
    let token = login_via_cli(&db.url, "planner-a", "plans:submit");
    submit(&service.addr, &token, "logged", 2);
    checkpoint_of_at_least(&service.addr, 2);
    let keys = signing_keys_file(&service.addr, dir.path());
    service.terminate();

    // The third plan is held back from the log (no round below 4 commits).
    let held = ServeProcess::start_env(
        &db.url,
        "127.0.0.1:0",
        &["--signing-key", arg(&key)],
        &[("PLAN_INTAKE_TEST_APPEND_FROM", "4")],
    );
    let edited = submit(&held.addr, &token, "edited", 1)[0]["receipt_id"]
        .as_str()
        .expect("an id")
        .to_owned();
    held.terminate();
    let three_days_back = match db.backend {
        plan_intake::storage::Backend::Postgres => "received_at - interval '3 days'",
        plan_intake::storage::Backend::Sqlite => "datetime(received_at, '-3 days')",
    };
    tamper(
        &db,
        &format!(
            "UPDATE plans SET receipt_signature = NULL,
                              permissions = '[\"plans:submit\",\"receipts:read\"]',
                              received_at = {three_days_back}
              WHERE receipt_id = '{edited}';"
        ),
    );
    let service = serve_signed(&db.url, &[&key]);
    checkpoint_of_at_least(&service.addr, 3);
    service.terminate();
    let (code, said) = audit(&db.url, &keys, &[]);
    assert_eq!(code, 65, "{said}");
    assert!(
        said.lines()
            .any(|l| l.contains(&edited) && l.contains("carries no signature")),
        "{said}"
    );
}

/// The public evidence costs the database a bounded number of reads a
/// second for callers it does not know: past them a consistency proof is
/// 503 `busy` with `Retry-After`, before any connection is taken, and
/// counted; a familiar reader's token is never turned away.
#[test]
fn public_reads_past_their_budget_are_turned_away_before_the_database() {
    let db = TestDb::sqlite();
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let planner = login_via_cli(&db.url, "planner-a", "plans:submit");
    let reader = login_via_cli(&db.url, "orders", "receipts:read");
    let service = serve_signed(&db.url, &[&key]);
    submit(&service.addr, &planner, "budget", 3);
    checkpoint_of_at_least(&service.addr, 3);
    let path = "/v1/checkpoint/consistency?old=1&new=3";
    let agent = client();
    let mut turned_away = None;
    for _ in 0..5_000 {
        match agent.get(&format!("http://{}{path}", service.addr)).call() {
            Ok(response) => {
                let _ = response.into_string();
            }
            Err(ureq::Error::Status(status, response)) => {
                let retry_after = response.header("retry-after").map(str::to_owned);
                turned_away = Some((
                    status,
                    retry_after,
                    response.into_string().unwrap_or_default(),
                ));
                break;
            }
            Err(e) => panic!("GET {path}: {e}"),
        }
    }
    let (status, retry_after, body) =
        turned_away.expect("a stranger turned away within 5,000 reads");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("/problems/busy"), "{body}");
    assert!(retry_after.is_some(), "{body}");
    // The reader the service knows is answered at once, budget or not.
    let (status, proof) = get_text(&service.addr, Some(&reader), path);
    assert_eq!(status, 200, "{proof}");
    let refused = service
        .metrics_text()
        .lines()
        .find_map(|l| l.strip_prefix("plan_intake_public_reads_refused_total "))
        .and_then(|n| n.parse::<f64>().ok())
        .expect("the counter");
    assert!(refused >= 1.0, "{refused}");
}
