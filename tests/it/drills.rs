//! An operator's disaster drills, through the real binary on both
//! backends: a checkpoint kept before it is handed out, and what a
//! verifying reader does when the database behind the service is
//! restored, rolled back or loses a row.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::evidence::{
    arg, checkpoint_of_at_least, checkpoint_size, generate_key, serve_signed, submit, write,
};
use crate::on_both_backends_sync;
use crate::support::TestDb;
use crate::support::process::{ServeProcess, login_via_cli};
use crate::tools::tool;
use plan_intake::storage::Backend;

on_both_backends_sync!(
    a_checkpoint_is_kept_before_it_is_handed_out,
    a_restore_is_named_by_every_verifying_reader,
    no_valid_plan_breaks_the_tiles,
    a_log_signed_later_is_verified_from_its_start_and_never_taken_unsigned,
    the_checkpoint_is_kept_by_default_where_operators_keep_state,
    a_restore_that_stands_starts_a_new_log,
    a_stored_hash_changed_by_hand_is_recomputed_from_the_leaves,
);

/// The second line of a checkpoint note: its root.
fn root_of(note: &str) -> &str {
    note.lines().nth(2).unwrap_or_default()
}

fn kept(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// `--checkpoint-file` holds a checkpoint before any reader can be handed
/// it: with the round that signs it held between its writes and its
/// COMMIT, the file already holds it. Killed there, the service starts
/// again (the database still holds every receipt of that round) and signs
/// the very tree the file holds.
fn a_checkpoint_is_kept_before_it_is_handed_out(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let file = dir.path().join("last.checkpoint");
    let args = ["--signing-key", arg(&key), "--checkpoint-file", arg(&file)];
    let stalled = ServeProcess::start_env(
        &db.url,
        "127.0.0.1:0",
        &args,
        &[("PLAN_INTAKE_TEST_STALL_APPEND", "3")],
    );
    let token = login_via_cli(&db.url, "planner-a", "plans:submit");
    submit(&stalled.addr, &token, "kept", 3);
    const STALLED: &str = "written, not committed, root ";
    let said = stalled.await_said(STALLED);
    let stalled_root = said
        .split_once(STALLED)
        .map(|(_, root)| root.lines().next().unwrap_or_default().trim().to_owned())
        .unwrap_or_default();
    let in_file = kept(&file);
    assert!(
        checkpoint_size(&in_file) >= 3 && root_of(&in_file) == stalled_root,
        "the round is not committed, yet the file holds: {in_file:?} (the round's root {stalled_root})"
    );
    stalled.kill_9();

    let service = ServeProcess::start_with(&db.url, &args);
    let signed = checkpoint_of_at_least(&service.addr, checkpoint_size(&in_file));
    if checkpoint_size(&signed) == checkpoint_size(&in_file) {
        assert_eq!(root_of(&signed), root_of(&in_file), "{signed}");
    }
    assert_eq!(kept(&file), signed, "the file keeps what is handed out");
    drop(service);
}

/// What one `follow --verify --drain` run did.
struct Followed {
    code: Option<i32>,
    stderr: String,
    /// The receipt ids it handed on, in order.
    handed: Vec<String>,
}

/// `follow --verify --drain` with the cursor file `cursor` and `more`.
fn follow(addr: &str, keys: &Path, reader: &str, cursor: &Path, more: &[&str]) -> Followed {
    let mut args = vec![
        "follow",
        "--verify",
        "--keys",
        arg(keys),
        "--cursor-file",
        arg(cursor),
        "--drain",
        "--limit",
        "3",
    ];
    args.extend(more);
    let out = tool(&args, &format!("http://{addr}"), reader)
        .output()
        .expect("follow");
    let handed = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| {
            let receipt: Value = serde_json::from_str(line).expect("a receipt line");
            receipt["receipt_id"].as_str().expect("an id").to_owned()
        })
        .collect();
    Followed {
        code: out.status.code(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        handed,
    }
}

fn ids(receipts: &[Value]) -> Vec<String> {
    receipts
        .iter()
        .map(|r| r["receipt_id"].as_str().expect("an id").to_owned())
        .collect()
}

/// A backup of the database as an operator takes one: `VACUUM INTO` for
/// SQLite, `pg_dump` of the schema for Postgres.
fn back_up(db: &TestDb, dir: &Path) -> PathBuf {
    match db.backend {
        Backend::Sqlite => {
            let path = dir.join("backup.db");
            crate::evidence::tamper(db, &format!("VACUUM INTO '{}'", path.display()));
            path
        }
        Backend::Postgres => {
            let schema = db.schema.as_deref().expect("a scratch schema");
            let dump = Command::new("pg_dump")
                .args(["-d", &crate::support::postgres_base_url(), "-n", schema])
                .args(["--no-owner"])
                .output()
                .expect("pg_dump");
            assert!(
                dump.status.success(),
                "{}",
                String::from_utf8_lossy(&dump.stderr)
            );
            write(dir, "backup.sql", &String::from_utf8_lossy(&dump.stdout))
        }
    }
}

/// The backup restored in place, under whatever runs on the database:
/// SQLite's backup API (`sqlite3 .restore`), or the schema dropped and the
/// dump played back.
fn restore(db: &TestDb, backup: &Path) {
    let out = match db.backend {
        Backend::Sqlite => {
            let file = db.url.trim_start_matches("sqlite://");
            Command::new("sqlite3")
                .args([file, ".timeout 20000"])
                .arg(format!(".restore '{}'", backup.display()))
                .output()
                .expect("sqlite3")
        }
        Backend::Postgres => {
            let schema = db.schema.as_deref().expect("a scratch schema");
            Command::new("psql")
                .args(["-q", "-v", "ON_ERROR_STOP=1", "-d"])
                .arg(crate::support::postgres_base_url())
                .args(["-c", &format!("DROP SCHEMA \"{schema}\" CASCADE")])
                .args(["-f", arg(backup)])
                .output()
                .expect("psql")
        }
    };
    assert!(
        out.status.success(),
        "the restore: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The drill: a verifying reader follows; the database is backed up, more
/// plans arrive and are followed, and the backup is restored, first under
/// the running service and then served by a fresh one. Every verifying
/// reader that verified past the backup exits 76 naming the rollback (and
/// the fork, once the restored log grows past it), never 65, never a
/// wait; so does a new one started from a checkpoint kept before the
/// restore that the restored log does not hold. One started from a
/// checkpoint the restored log extends goes on.
fn a_restore_is_named_by_every_verifying_reader(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let keys = PathBuf::from(format!("{}.pub", key.display()));
    let service = serve_signed(&db.url, &[&key]);
    let planner = login_via_cli(&db.url, "planner-a", "plans:submit");
    let reader = login_via_cli(&db.url, "orders", "receipts:read");
    let cursor = dir.path().join("orders.cursor");

    let kept = ids(&submit(&service.addr, &planner, "kept", 4));
    let run = follow(&service.addr, &keys, &reader, &cursor, &["--from-start"]);
    assert_eq!((run.code, &run.handed), (Some(0), &kept), "{}", run.stderr);
    let backed_up = write(
        dir.path(),
        "backed-up.checkpoint",
        &checkpoint_of_at_least(&service.addr, 4),
    );
    let backup = back_up(&db, dir.path());

    let lost = ids(&submit(&service.addr, &planner, "lost", 3));
    let run = follow(&service.addr, &keys, &reader, &cursor, &[]);
    assert_eq!((run.code, &run.handed), (Some(0), &lost), "{}", run.stderr);
    let verified = checkpoint_of_at_least(&service.addr, 7);
    let verified_path = write(dir.path(), "verified.checkpoint", &verified);

    // Swapped under the running service; it takes plans on.
    restore(&db, &backup);
    submit(&service.addr, &planner, "after-restore", 2);
    let run = follow(&service.addr, &keys, &reader, &cursor, &[]);
    assert_eq!(run.code, Some(76), "{}", run.stderr);
    assert!(
        run.stderr.contains("rolled back") && run.handed.is_empty(),
        "{}",
        run.stderr
    );
    assert!(
        !run.stderr.contains("remove"),
        "no advice that discards the proof: {}",
        run.stderr
    );
    service.terminate();

    // Served by a fresh instance. On SQLite the checkpoint kept beside the
    // file by default refuses the start; the runbook moves it aside (as
    // evidence) and starts with a new one. It then signs the restored log
    // on, 6 leaves and then more than the 7 verified, a fork of them.
    if db.backend == Backend::Sqlite {
        let said = crate::support::process::serve_refused(&db.url, &["--signing-key", arg(&key)]);
        assert!(
            said.contains("does not extend the checkpoint kept in"),
            "{said}"
        );
    }
    let after_restore = dir.path().join("after-restore.checkpoint");
    let service = ServeProcess::start_with(
        &db.url,
        &[
            "--signing-key",
            arg(&key),
            "--checkpoint-file",
            arg(&after_restore),
        ],
    );
    checkpoint_of_at_least(&service.addr, 6);
    let run = follow(&service.addr, &keys, &reader, &cursor, &[]);
    assert_eq!(run.code, Some(76), "{}", run.stderr);
    assert!(run.stderr.contains("rolled back"), "{}", run.stderr);
    let more = ids(&submit(&service.addr, &planner, "more", 2));
    checkpoint_of_at_least(&service.addr, 8);
    let run = follow(&service.addr, &keys, &reader, &cursor, &[]);
    assert_eq!(run.code, Some(76), "{}", run.stderr);
    assert!(
        run.stderr.contains("fork") && run.handed.is_empty(),
        "{}",
        run.stderr
    );

    // New readers: from the checkpoint verified before the restore, 76;
    // from the one kept at the backup, which the restored log extends,
    // every receipt after it.
    let fresh = |name: &str, checkpoint: &Path| {
        follow(
            &service.addr,
            &keys,
            &reader,
            &dir.path().join(name),
            &["--from-checkpoint", arg(checkpoint)],
        )
    };
    let run = fresh("from-verified.cursor", &verified_path);
    assert_eq!(run.code, Some(76), "{}", run.stderr);
    assert!(run.handed.is_empty(), "{}", run.stderr);
    let run = fresh("from-backup.cursor", &backed_up);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(run.handed.len(), 4, "{}", run.stderr);
    assert_eq!(run.handed[2..], more[..], "{}", run.stderr);
    drop(service);
}

/// A plan naming `inputs` approved inputs of 256 characters each.
fn plan_with_inputs(run: &str, inputs: usize) -> String {
    let inputs: Vec<Value> = (0..inputs)
        .map(|i| serde_json::json!({ "id": format!("{i:04}{}", "x".repeat(252)) }))
        .collect();
    serde_json::json!({ "run_id": run, "approved_inputs": inputs, "content": {} }).to_string()
}

/// A plan whose receipt would not fit a leaf of the log's tiles (65,535
/// bytes) is refused (422 naming the limit, nothing written); the largest
/// that fits is kept and logged, and its entry bundle is served.
fn no_valid_plan_breaks_the_tiles(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let service = serve_signed(&db.url, &[&key]);
    let planner = login_via_cli(&db.url, "planner-a", "plans:submit");
    let agent = crate::support::process::client();
    let (status, problem) = crate::support::process::post_plan(
        &agent,
        &service.addr,
        &planner,
        "too-large",
        &plan_with_inputs("too-large", 1000),
    )
    .expect("an answer");
    let text = problem.to_string();
    assert_eq!(status, 422, "{text}");
    assert!(
        text.contains("validation-failed")
            && text.contains("approved_inputs")
            && text.contains("65535"),
        "{text}"
    );
    let database = db.open_with(plan_intake::storage::MigrateOnOpen::Skip);
    let mut conn = database.conn().expect("connection");
    assert_eq!(crate::support::count_rows(&mut conn, "plans"), 0);
    assert_eq!(crate::support::count_rows(&mut conn, "intake_keys"), 0);
    drop(conn);

    // 240 inputs of 256 characters: a receipt of about 63 KB.
    let receipt = crate::support::process::keep_plan(
        &agent,
        &service.addr,
        &planner,
        "largest",
        &plan_with_inputs("largest", 240),
    );
    let leaf = plan_intake_wire::evidence::signed_form(
        &plan_intake_wire::Receipt::parse(&receipt.to_string()).expect("a receipt"),
    )
    .expect("its signed form");
    assert!(
        leaf.len() > 60_000 && leaf.len() <= 65_535,
        "{}",
        leaf.len()
    );
    checkpoint_of_at_least(&service.addr, 1);
    let reader = login_via_cli(&db.url, "orders", "receipts:read");
    let bundle = crate::support::process::client()
        .get(&format!(
            "http://{}/v1/log/tile/entries/000.p/1",
            service.addr
        ))
        .set("Authorization", &format!("Bearer {reader}"))
        .call()
        .expect("the entry bundle");
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut bundle.into_reader(), &mut bytes).expect("read");
    assert_eq!(bytes.len(), 2 + leaf.len());
    assert_eq!(
        &bytes[2..],
        &leaf[..],
        "the leaf is the receipt's signed form"
    );
    drop(service);
}

/// Signing turned on after receipts were kept unsigned (the README's
/// order: the Quickstart, then `serve --signing-key`): a verifying reader
/// from the feed's first receipt holds those to their leaves and goes on.
/// The count of those is the reader's to give (`--unsigned-prelude`, as
/// `audit` counts it). Once the log is signed, an instance without a key
/// refuses to start, and one started before says it is not ready and
/// refuses plans; an unsigned receipt after signed ones stops every
/// verifying reader at its leaf with 76.
fn a_log_signed_later_is_verified_from_its_start_and_never_taken_unsigned(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let keys = PathBuf::from(format!("{}.pub", key.display()));
    let unsigned = ServeProcess::start(&db.url);
    let planner = login_via_cli(&db.url, "planner-a", "plans:submit");
    let reader = login_via_cli(&db.url, "orders", "receipts:read");
    let mut kept = ids(&submit(&unsigned.addr, &planner, "unsigned", 3));
    let signed = serve_signed(&db.url, &[&key]);
    kept.extend(ids(&submit(&signed.addr, &planner, "signed", 2)));
    checkpoint_of_at_least(&signed.addr, 5);

    // Without the count, the first unsigned receipt is refused: no
    // checkpoint says whether a receipt carried a signature (a proxy could
    // strip them), so the reader is told how many were kept unsigned.
    let refused = dir.path().join("refused.cursor");
    let run = follow(&signed.addr, &keys, &reader, &refused, &["--from-start"]);
    assert_eq!(run.code, Some(76), "{}", run.stderr);
    assert!(
        run.stderr.contains("log index 0") && run.stderr.contains("--unsigned-prelude"),
        "{}",
        run.stderr
    );
    let public = crate::evidence::signing_keys_file(&signed.addr, dir.path());
    let (code, said) = crate::evidence::audit(&db.url, &public, &[]);
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("--unsigned-prelude 3"), "{said}");

    let cursor = dir.path().join("orders.cursor");
    let prelude = ["--from-start", "--unsigned-prelude", "3"];
    let run = follow(&signed.addr, &keys, &reader, &cursor, &prelude);
    assert_eq!((run.code, &run.handed), (Some(0), &kept), "{}", run.stderr);
    assert!(
        run.stderr.contains("before the log's first key"),
        "{}",
        run.stderr
    );

    let said = crate::support::process::serve_refused(&db.url, &[]);
    assert!(
        said.contains("is signed") && said.contains("--signing-key"),
        "{said}"
    );
    let (status, ready) = crate::evidence::get_text(&unsigned.addr, None, "/readyz");
    assert_eq!(status, 503, "{ready}");
    assert!(ready.contains("unsigned-on-a-signed-log"), "{ready}");

    // It refuses plans rather than keep them unsigned after signed ones.
    let agent = crate::support::process::client();
    let (status, problem) = crate::support::process::post_plan(
        &agent,
        &unsigned.addr,
        &planner,
        "late",
        &crate::support::plan_body("late", "late"),
    )
    .expect("an answer");
    assert_eq!(status, 503, "{problem}");
    assert!(
        problem.to_string().contains("unsigned-on-a-signed-log"),
        "{problem}"
    );
    // One written around the service, unsigned after signed leaves, stops
    // a verifying reader at its leaf.
    crate::evidence::tamper(
        &db,
        &crate::support::hand_written_plan_sql(
            "rcpt_by_hand",
            "planner-a",
            "'by-hand'",
            "blake3:by-hand",
        ),
    );
    checkpoint_of_at_least(&signed.addr, 6);
    let run = follow(&signed.addr, &keys, &reader, &cursor, &prelude[1..]);
    assert_eq!(run.code, Some(76), "{}", run.stderr);
    assert!(
        run.stderr.contains("log index 5") && run.stderr.contains("rcpt_by_hand"),
        "{}",
        run.stderr
    );
    assert!(run.handed.is_empty(), "{}", run.stderr);
    drop((unsigned, signed));
}

/// With no `--checkpoint-file`, a signing instance keeps its checkpoints
/// beside the SQLite file, or (Postgres) in the state directory systemd
/// gives the unit (`STATE_DIRECTORY`).
fn the_checkpoint_is_kept_by_default_where_operators_keep_state(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let state = dir.path().join("state");
    std::fs::create_dir(&state).expect("a state directory");
    let service = ServeProcess::start_env(
        &db.url,
        "127.0.0.1:0",
        &["--signing-key", arg(&key)],
        &[("STATE_DIRECTORY", arg(&state))],
    );
    let planner = login_via_cli(&db.url, "planner-a", "plans:submit");
    submit(&service.addr, &planner, "kept", 2);
    let note = checkpoint_of_at_least(&service.addr, 2);
    let file = match db.backend {
        Backend::Sqlite => PathBuf::from(format!(
            "{}.checkpoint",
            db.url.trim_start_matches("sqlite://")
        )),
        Backend::Postgres => state.join("receipt-log.checkpoint"),
    };
    assert_eq!(kept(&file), note, "{}", file.display());
    drop(service);
}

/// The runbook for a restore that is to stand: the checkpoint file refuses
/// the restored database; `receipts new-log` (as the owner, every instance
/// stopped) empties the log, printing its newest checkpoint; the service
/// starts a new log under a new key and name, which takes every plan the
/// database holds from the first. A reader of the old log is told it is
/// another log (76); one pinned to both keys reads the new one whole.
fn a_restore_that_stands_starts_a_new_log(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let old_key = generate_key(dir.path(), "k1");
    let new_key = generate_key(dir.path(), "k2");
    let old_file = dir.path().join("old.checkpoint");
    let old_args = [
        "--signing-key",
        arg(&old_key),
        "--log-origin",
        "drill.example/receipts-1",
        "--checkpoint-file",
        arg(&old_file),
    ];
    let service = ServeProcess::start_with(&db.url, &old_args);
    let planner = login_via_cli(&db.url, "planner-a", "plans:submit");
    let reader = login_via_cli(&db.url, "orders", "receipts:read");
    let old_keys = PathBuf::from(format!("{}.pub", old_key.display()));
    let cursor = dir.path().join("old.cursor");
    let mut kept = ids(&submit(&service.addr, &planner, "kept", 3));
    let run = follow(
        &service.addr,
        &old_keys,
        &reader,
        &cursor,
        &["--from-start"],
    );
    assert_eq!((run.code, &run.handed), (Some(0), &kept), "{}", run.stderr);
    let backup = back_up(&db, dir.path());
    submit(&service.addr, &planner, "lost", 2);
    let run = follow(&service.addr, &old_keys, &reader, &cursor, &[]);
    assert_eq!((run.code, run.handed.len()), (Some(0), 2), "{}", run.stderr);
    service.terminate();
    restore(&db, &backup);

    let said = crate::support::process::serve_refused(&db.url, &old_args);
    assert!(
        said.contains("does not extend the checkpoint kept in"),
        "{said}"
    );
    let count = |table: &str| {
        let database = db.open_with(plan_intake::storage::MigrateOnOpen::Skip);
        let mut conn = database.conn().expect("connection");
        crate::support::count_rows(&mut conn, table)
    };
    let asked = crate::support::process::run_cli_at(&db.url, &["receipts", "new-log"]);
    assert_eq!(asked.status.code(), Some(2), "{asked:?}");
    assert_eq!(count("receipt_log"), 3, "nothing changed without --yes");
    let done = crate::support::process::run_cli_at(&db.url, &["receipts", "new-log", "--yes"]);
    let printed = String::from_utf8_lossy(&done.stdout);
    assert!(done.status.success(), "{done:?}");
    assert!(
        printed.starts_with("drill.example/receipts-1\n3\n"),
        "the old newest checkpoint: {printed}"
    );
    assert_eq!(count("receipt_log"), 0);
    assert_eq!(count("receipt_log_checkpoints"), 0);

    let new_file = dir.path().join("new.checkpoint");
    let service = ServeProcess::start_with(
        &db.url,
        &[
            "--signing-key",
            arg(&new_key),
            "--log-origin",
            "drill.example/receipts-2",
            "--checkpoint-file",
            arg(&new_file),
        ],
    );
    kept.extend(ids(&submit(&service.addr, &planner, "new", 1)));
    let note = checkpoint_of_at_least(&service.addr, 4);
    assert!(note.starts_with("drill.example/receipts-2\n4\n"), "{note}");

    let run = follow(&service.addr, &old_keys, &reader, &cursor, &[]);
    assert_eq!(run.code, Some(76), "{}", run.stderr);
    assert!(
        run.stderr.contains("newest checkpoint") && run.handed.is_empty(),
        "{}",
        run.stderr
    );
    let both = dir.path().join("both.pub");
    let keys_text = [&old_key, &new_key]
        .iter()
        .map(|key| std::fs::read_to_string(format!("{}.pub", key.display())).expect("a key"))
        .collect::<String>();
    std::fs::write(&both, keys_text).expect("both keys");
    let run = follow(
        &service.addr,
        &both,
        &reader,
        &dir.path().join("new.cursor"),
        &["--from-start"],
    );
    assert_eq!((run.code, &run.handed), (Some(0), &kept), "{}", run.stderr);
    drop(service);
}

/// The async follower resumes as the blocking one does: from its proof
/// (after the plan row at its cursor was deleted, it goes on past it), and
/// a restore to before what it verified is 76 naming the rollback.
#[actix_web::test]
async fn an_async_follower_resumes_from_its_proof_and_names_a_restore() {
    use plan_intake_client::asynchronous::{AsyncClient, follow as follow_async};
    use plan_intake_client::wire::evidence::TrustedKeys;
    use plan_intake_client::{FollowError, FollowOptions};

    let db = TestDb::sqlite();
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let keys_text = std::fs::read_to_string(format!("{}.pub", key.display())).expect("key");
    let keys = TrustedKeys::parse(&keys_text).expect("pinned keys");
    let service = serve_signed(&db.url, &[&key]);
    let planner = login_via_cli(&db.url, "planner-a", "plans:submit");
    let reader = login_via_cli(&db.url, "orders", "receipts:read");
    let options = FollowOptions {
        from_start: true,
        limit: 2,
        wait: std::time::Duration::ZERO,
        drain: true,
        retry_base: std::time::Duration::from_millis(20),
        verify: Some(keys),
        ..FollowOptions::new(dir.path().join("async.cursor"))
    };
    let client = AsyncClient::new(&format!("http://{}", service.addr), &reader).expect("client");
    let run = || async {
        let handed = std::sync::Mutex::new(Vec::<String>::new());
        let ended = follow_async(&client, &options, |page| {
            for entry in &page.receipts {
                let receipt: Value = serde_json::from_str(entry.get()).expect("json");
                let id = receipt["receipt_id"].as_str().expect("an id").to_owned();
                handed.lock().expect("handed").push(id);
            }
            async { Ok::<(), String>(()) }
        })
        .await;
        (ended, handed.into_inner().expect("handed"))
    };

    let first = ids(&submit(&service.addr, &planner, "first", 3));
    let (ended, handed) = run().await;
    assert!(ended.is_ok(), "{ended:?}");
    assert_eq!(handed, first);
    let backup = back_up(&db, dir.path());
    crate::evidence::tamper(
        &db,
        &format!(
            "DELETE FROM intake_keys WHERE plan_id = (SELECT id FROM plans WHERE receipt_id = '{0}');
             DELETE FROM plans WHERE receipt_id = '{0}';",
            first[2]
        ),
    );
    let later = ids(&submit(&service.addr, &planner, "later", 2));
    let (ended, handed) = run().await;
    assert!(ended.is_ok(), "{ended:?}");
    assert_eq!(handed, later, "gone past the deleted row, none twice");

    restore(&db, &backup);
    let (ended, handed) = run().await;
    match ended {
        Err(FollowError::Unverified(why)) => assert!(why.contains("rolled back"), "{why}"),
        other => panic!("not refused: {other:?}"),
    }
    assert!(handed.is_empty());
    drop(service);
}

/// The checkpoint's long poll is public, so its waiting is bounded: from
/// one address at most `MAX_PER_ADDRESS` readers wait; the next is answered
/// at once (404 `not-logged-yet`), costing nothing while it would wait.
#[test]
fn waiting_for_a_checkpoint_is_bounded_per_address() {
    use plan_intake::http::evidence::ExtensionWaiters;
    let db = TestDb::sqlite();
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let service = serve_signed(&db.url, &[&key]);
    let planner = login_via_cli(&db.url, "planner-a", "plans:submit");
    submit(&service.addr, &planner, "one", 1);
    checkpoint_of_at_least(&service.addr, 1);
    let ask = |addr: String| {
        std::thread::spawn(move || {
            let asked = std::time::Instant::now();
            let (status, _) =
                crate::evidence::get_text(&addr, None, "/v1/checkpoint/extension?size=1000&wait=8");
            (status, asked.elapsed())
        })
    };
    let waiting: Vec<_> = (0..ExtensionWaiters::MAX_PER_ADDRESS)
        .map(|_| ask(service.addr.clone()))
        .collect();
    let gauge = format!(
        "plan_intake_checkpoint_waiting_readers {}",
        ExtensionWaiters::MAX_PER_ADDRESS
    );
    let began = std::time::Instant::now();
    while !service.metrics_text().lines().any(|l| l == gauge) {
        assert!(
            began.elapsed() < std::time::Duration::from_secs(6),
            "the readers never all waited"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (status, took) = ask(service.addr.clone()).join().expect("the one past");
    assert_eq!(status, 404);
    assert!(
        took < std::time::Duration::from_secs(4),
        "the reader past the bound waited {took:?}"
    );
    for waiter in waiting {
        let (status, took) = waiter.join().expect("a waiter");
        assert_eq!(status, 404);
        assert!(took >= std::time::Duration::from_secs(7), "{took:?}");
    }
}

/// The stuck-log runbook's mend: a stored hash changed by hand (the log
/// stuck, proofs wrong) is recomputed from the leaves by `receipts rehash
/// --yes`, only because the leaves still make the newest checkpoint's
/// tree; the service then appends and signs on. A changed leaf is
/// refused (65) and nothing is written.
fn a_stored_hash_changed_by_hand_is_recomputed_from_the_leaves(db: TestDb) {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    let keys = PathBuf::from(format!("{}.pub", key.display()));
    let planner = login_via_cli(&db.url, "planner-a", "plans:submit");
    let service = serve_signed(&db.url, &[&key]);
    submit(&service.addr, &planner, "before", 5);
    let signed = checkpoint_of_at_least(&service.addr, 5);
    drop(service);
    let hashes = |db: &TestDb| {
        let database = db.open_with(plan_intake::storage::MigrateOnOpen::Skip);
        let mut conn = database.conn().expect("connection");
        crate::support::scalar(&mut conn, "SELECT count(*) AS n FROM receipt_log_hashes")
    };
    let stored = hashes(&db);
    crate::evidence::tamper(
        &db,
        "UPDATE receipt_log_hashes SET hash = receipt_log_hashes.hash || receipt_log_hashes.hash WHERE hash_index = 2",
    );
    let (code, said) = crate::evidence::audit(&db.url, &keys, &[]);
    assert_eq!(code, 65, "{said}");
    assert!(said.contains("stored hashes differ"), "{said}");

    let rehash = |yes: bool| {
        let mut args = vec!["receipts", "rehash"];
        if yes {
            args.push("--yes");
        }
        let out = crate::support::process::run_cli_at(&db.url, &args);
        (
            out.status.code().unwrap_or(-1),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let (code, said) = rehash(false);
    assert_eq!(code, 2, "{said}");
    assert!(said.contains("would rewrite"), "{said}");
    assert_eq!(
        crate::evidence::audit(&db.url, &keys, &[]).0,
        65,
        "nothing written yet"
    );
    let (code, said) = rehash(true);
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("rewrote the receipt log's"), "{said}");
    assert_eq!(hashes(&db), stored);
    let (code, said) = crate::evidence::audit(&db.url, &keys, &[]);
    assert_eq!(code, 0, "{said}");
    let (code, said) = rehash(true);
    assert_eq!(code, 0, "{said}");
    assert!(said.contains("nothing to rewrite"), "{said}");

    // The log goes on from the tree it signed.
    let service = serve_signed(&db.url, &[&key]);
    submit(&service.addr, &planner, "after", 2);
    let newer = checkpoint_of_at_least(&service.addr, 7);
    assert!(checkpoint_size(&newer) > checkpoint_size(&signed));
    drop(service);

    // A leaf changed: recomputing cannot mend it, and writes nothing.
    crate::evidence::tamper(
        &db,
        "CREATE TABLE leaf_saved AS SELECT leaf_hash FROM receipt_log WHERE leaf_index = 1;
         UPDATE receipt_log SET leaf_hash = (SELECT leaf_hash FROM receipt_log WHERE leaf_index = 0) WHERE leaf_index = 1",
    );
    let (code, said) = rehash(true);
    assert_eq!(code, 65, "{said}");
    assert!(said.contains("a leaf changed"), "{said}");
    assert_eq!(crate::evidence::audit(&db.url, &keys, &[]).0, 65);
    crate::evidence::tamper(
        &db,
        "UPDATE receipt_log SET leaf_hash = (SELECT leaf_hash FROM leaf_saved) WHERE leaf_index = 1",
    );
    assert_eq!(crate::evidence::audit(&db.url, &keys, &[]).0, 0);

    // Leaves past the newest checkpoint (its row removed by hand): no
    // signed tree holds them, so nothing is written.
    crate::evidence::tamper(
        &db,
        "DELETE FROM receipt_log_checkpoints WHERE tree_size = (SELECT max(tree_size) FROM receipt_log_checkpoints);
         UPDATE receipt_log_hashes SET hash = receipt_log_hashes.hash || receipt_log_hashes.hash WHERE hash_index = 2",
    );
    let (code, said) = rehash(true);
    assert_eq!(code, 65, "{said}");
    assert!(said.contains("added or removed by hand"), "{said}");
}
