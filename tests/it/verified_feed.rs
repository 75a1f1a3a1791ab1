//! `follow --verify`: the ordering system hands on a receipt only once it
//! is proven to be the signed log's next leaf. Through a proxy of the
//! test's own that tampers with the feed (a receipt dropped, two swapped,
//! one repeated, one forged with its signature kept, a page's `next`
//! jumped ahead), and after rows edited or deleted in the database once
//! logged, each run exits 76 naming the log index, and its saved cursor
//! never passes the last verified receipt; an honest run through the same
//! proxy hands on every receipt once and resumes from its saved proof.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use crate::evidence::{generate_key, tamper};
use crate::on_both_backends_sync;
use crate::support::TestDb;
use crate::support::http_proxy::HttpProxy;
use crate::support::process::{ServeProcess, client, keep_plan, login_via_cli};
use crate::tools::tool;

on_both_backends_sync!(
    a_checkpoint_of_another_deployment_with_the_same_key_is_refused,
    a_follower_killed_mid_page_resumes_verification_from_its_saved_proof,
    a_follower_pinned_to_the_old_key_verifies_across_a_rotation,
    an_expanded_plan_is_held_to_its_receipt,
    a_follower_says_how_far_behind_it_is,
    the_log_is_served_as_c2sp_tiles,
    a_follower_starts_at_a_checkpoint_and_verifies_what_follows,
    a_follower_with_no_checkpoint_trusts_the_first_it_sees_and_says_so,
    a_receipt_under_a_key_nobody_published_is_named,
    a_reader_waiting_for_a_checkpoint_gets_one_at_once,
    an_empty_page_moving_the_cursor_ahead_skips_nothing,
    receipts_withheld_by_an_empty_page_are_named,
    an_honest_feed_is_handed_on_once_and_verification_resumes,
    each_tampering_is_named_and_nothing_past_it_is_saved,
    rows_edited_or_deleted_after_they_were_logged_are_named,
    a_next_moved_ahead_is_never_resumed_from,
    a_deleted_row_at_the_cursor_is_gone_past,
);

/// Receipts each test writes.
const PLANS: usize = 7;

/// A signing service with `PLANS` plans kept and logged.
struct Logged {
    dir: tempfile::TempDir,
    service: ServeProcess,
    reader: String,
    /// The signing key's public file: the keys the reader pins.
    keys: PathBuf,
    /// Receipt ids in feed order.
    ids: Vec<String>,
}

fn logged(db: &TestDb) -> Logged {
    let dir = tempfile::tempdir().expect("temp dir");
    let key = generate_key(dir.path(), "k1");
    logged_with(db, dir, key)
}

/// As [`logged`], signing with `key` (in `dir`).
fn logged_with(db: &TestDb, dir: tempfile::TempDir, key: PathBuf) -> Logged {
    let service = ServeProcess::start_with(&db.url, &["--signing-key", path_arg(&key)]);
    let planner = login_via_cli(&db.url, "planner-a", "plans:submit");
    let reader = login_via_cli(&db.url, "orders", "receipts:read");
    let agent = client();
    let ids = (0..PLANS)
        .map(|i| {
            let run = format!("run-{i}");
            let body = format!(
                r#"{{"run_id":"{run}","approved_inputs":[{{"id":"forecast-v12"}}],"content":{{"run":"{run}"}}}}"#
            );
            let receipt = keep_plan(&agent, &service.addr, &planner, &format!("key-{run}"), &body);
            receipt["receipt_id"].as_str().expect("an id").to_owned()
        })
        .collect();
    Logged {
        keys: PathBuf::from(format!("{}.pub", key.display())),
        dir,
        service,
        reader,
        ids,
    }
}

fn path_arg(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// What one `follow --verify --from-start --drain` run did.
struct Run {
    code: Option<i32>,
    stderr: String,
    /// The receipt ids it handed on, in order.
    handed: Vec<String>,
    /// How many leaves its cursor file says were verified (0: no file).
    verified: u64,
}

/// A proxy in front of the logged service that hands each answer's body
/// (and the path it answered) to `rewrite`.
fn rewriting_proxy(
    logged: &Logged,
    rewrite: impl Fn(&str, Vec<u8>) -> Vec<u8> + Send + Sync + 'static,
) -> HttpProxy {
    HttpProxy::start(
        logged.service.addr.clone(),
        Arc::new(str::to_owned),
        Arc::new(rewrite),
    )
}

/// `follow --verify --from-start --drain` in pages of `limit`, then `more`.
fn follow_args(logged: &Logged, cursor: &Path, limit: u32, more: &[&str]) -> Vec<String> {
    let limit = limit.to_string();
    let keys = path_arg(&logged.keys);
    let cursor = path_arg(cursor);
    let args = [
        "follow",
        "--verify",
        "--keys",
        keys,
        "--cursor-file",
        cursor,
    ];
    let paging = ["--from-start", "--drain", "--limit", &limit];
    args.iter()
        .chain(&paging)
        .chain(more)
        .map(|arg| (*arg).to_owned())
        .collect()
}

fn follow_verified(url: &str, logged: &Logged, cursor: &str, limit: u32) -> Run {
    follow_verified_with(url, logged, cursor, limit, &[])
}

fn follow_verified_with(
    url: &str,
    logged: &Logged,
    cursor: &str,
    limit: u32,
    more: &[&str],
) -> Run {
    follow_verified_from(url, logged, cursor, limit, more, true)
}

/// As [`follow_verified_with`]; without `from_start`, a follower with no
/// cursor file starts at a checkpoint.
fn follow_verified_from(
    url: &str,
    logged: &Logged,
    cursor: &str,
    limit: u32,
    more: &[&str],
    from_start: bool,
) -> Run {
    let cursor = logged.dir.path().join(cursor);
    let mut args = follow_args(logged, &cursor, limit, more);
    args.retain(|arg| from_start || arg != "--from-start");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = tool(&args, url, &logged.reader).output().expect("follow");
    let handed = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| {
            let entry: Value = serde_json::from_str(line).expect("a receipt line");
            let receipt = entry.get("receipt").unwrap_or(&entry);
            receipt["receipt_id"].as_str().expect("an id").to_owned()
        })
        .collect();
    let verified = std::fs::read_to_string(&cursor)
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("verified ")?.parse().ok())
        })
        .unwrap_or(0);
    Run {
        code: out.status.code(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        handed,
        verified,
    }
}

/// A run refused at log index `index`, having handed on and saved exactly
/// the first `handed` receipts (the pages before the one refused).
#[track_caller]
fn refused_at(run: &Run, index: usize, handed: usize, ids: &[String]) {
    assert_eq!(run.code, Some(76), "{}", run.stderr);
    assert!(
        run.stderr.contains(&format!("log index {index}")),
        "names log index {index}: {}",
        run.stderr
    );
    assert_eq!(run.handed, ids[..handed], "{}", run.stderr);
    assert_eq!(run.verified, handed as u64, "the saved proof");
}

fn an_honest_feed_is_handed_on_once_and_verification_resumes(db: TestDb) {
    let logged = logged(&db);
    let proxy = HttpProxy::honest(logged.service.addr.clone());
    let first = follow_verified(&proxy.url, &logged, "orders.cursor", 3);
    assert_eq!(first.code, Some(0), "{}", first.stderr);
    assert_eq!(first.handed, logged.ids);
    assert_eq!(first.verified, PLANS as u64);

    // More plans; the next run goes on from the saved proof.
    let planner = login_via_cli(&db.url, "planner-b", "plans:submit");
    let agent = client();
    let more: Vec<String> = (0..3)
        .map(|i| {
            let run = format!("more-{i}");
            let body = format!(
                r#"{{"run_id":"{run}","approved_inputs":[{{"id":"forecast-v12"}}],"content":{{}}}}"#
            );
            keep_plan(&agent, &logged.service.addr, &planner, &run, &body)["receipt_id"]
                .as_str()
                .expect("an id")
                .to_owned()
        })
        .collect();
    let second = follow_verified(&proxy.url, &logged, "orders.cursor", 3);
    assert_eq!(second.code, Some(0), "{}", second.stderr);
    assert_eq!(second.handed, more, "each receipt once, none again");
    assert_eq!(second.verified, (PLANS + 3) as u64);
}

/// What the tampering proxy does to feed pages.
#[derive(Clone, Copy, Debug)]
enum Tampering {
    /// The receipt at this feed index is left out.
    Drop(usize),
    /// This receipt and the next change places.
    Swap(usize),
    /// This receipt comes twice.
    Repeat(usize),
    /// This receipt's run is changed, its signature kept.
    Forge(usize),
}

/// Applies `tampering` to every feed page (its receipts hold the feed's
/// indexes `ids` gives them).
fn tampered(page: Vec<u8>, tampering: Tampering, ids: &[String]) -> Vec<u8> {
    let Ok(mut page) = serde_json::from_slice::<Value>(&page) else {
        return page;
    };
    let Some(receipts) = page["receipts"].as_array_mut() else {
        return serde_json::to_vec(&page).expect("json");
    };
    let at = |receipts: &[Value], index: usize| {
        receipts
            .iter()
            .position(|r| r["receipt_id"].as_str() == Some(&ids[index]))
    };
    match tampering {
        Tampering::Drop(index) => {
            if let Some(i) = at(receipts, index) {
                receipts.remove(i);
            }
        }
        Tampering::Swap(index) => {
            if let (Some(i), Some(j)) = (at(receipts, index), at(receipts, index + 1)) {
                receipts.swap(i, j);
            }
        }
        Tampering::Repeat(index) => {
            if let Some(i) = at(receipts, index) {
                let copy = receipts[i].clone();
                receipts.insert(i + 1, copy);
            }
        }
        Tampering::Forge(index) => {
            if let Some(i) = at(receipts, index) {
                receipts[i]["run_id"] = Value::from("run-forged");
            }
        }
    }
    serde_json::to_vec(&page).expect("json")
}

fn each_tampering_is_named_and_nothing_past_it_is_saved(db: TestDb) {
    let logged = logged(&db);
    let ids = Arc::new(logged.ids.clone());
    // Pages of two: (tampering, the index named, receipts handed on
    // before it). A dropped receipt leaves a page that is the log's
    // prefix: the next page is refused, at the index it left empty.
    for (n, (tampering, named, handed)) in [
        (Tampering::Drop(3), 3, 3),
        (Tampering::Swap(4), 4, 4),
        (Tampering::Repeat(2), 3, 2),
        (Tampering::Forge(5), 5, 4),
    ]
    .into_iter()
    .enumerate()
    {
        let ids = Arc::clone(&ids);
        let proxy = rewriting_proxy(&logged, move |target: &str, body: Vec<u8>| {
            if target.starts_with("/v1/receipts?") {
                tampered(body, tampering, &ids)
            } else {
                body
            }
        });
        let run = follow_verified(&proxy.url, &logged, &format!("tampered-{n}.cursor"), 2);
        refused_at(&run, named, handed, &logged.ids);
    }

    // A page's `next` jumped ahead: the request after the first page is
    // sent for the page after the second.
    let cursors = page_cursors(&logged, 2);
    let (skipped_from, skipped_to) = (cursors[0].clone(), cursors[1].clone());
    let proxy = HttpProxy::start(
        logged.service.addr.clone(),
        Arc::new(move |target: &str| {
            let after = format!("after={skipped_from}");
            if target.contains(&after) {
                target.replace(&after, &format!("after={skipped_to}"))
            } else {
                target.to_owned()
            }
        }),
        Arc::new(|_: &str, body: Vec<u8>| body),
    );
    let run = follow_verified(&proxy.url, &logged, "jumped.cursor", 2);
    refused_at(&run, 2, 2, &logged.ids);
}

/// An empty page whose `next` jumps ahead (a proxy answering the first
/// request so) moves a verifying follower nowhere: it saves nothing and
/// asks again from where it stood, so nothing is skipped.
fn an_empty_page_moving_the_cursor_ahead_skips_nothing(db: TestDb) {
    let logged = logged(&db);
    let cursors = page_cursors(&logged, 2);
    let ahead = cursors[1].clone();
    let answered = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let proxy = rewriting_proxy(&logged, move |target: &str, body: Vec<u8>| {
        let first = target.starts_with("/v1/receipts?")
            && !answered.swap(true, std::sync::atomic::Ordering::SeqCst);
        if first {
            format!(r#"{{"receipts":[],"next":"{ahead}"}}"#).into_bytes()
        } else {
            body
        }
    });
    // The empty first page ends a --drain run: with nothing saved.
    let run = follow_verified(&proxy.url, &logged, "empty.cursor", 2);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(run.handed.is_empty());
    assert!(!logged.dir.path().join("empty.cursor").exists());
    let run = follow_verified(&proxy.url, &logged, "empty.cursor", 2);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(run.handed, logged.ids, "every receipt, from the first");
}

/// A feed that withholds receipts the log already holds (an empty page
/// after the first, the checkpoint met with it holding all seven) stops a
/// verifying follower at the first withheld index.
fn receipts_withheld_by_an_empty_page_are_named(db: TestDb) {
    let logged = logged(&db);
    crate::evidence::checkpoint_of_at_least(&logged.service.addr, PLANS as u64);
    let pages = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let proxy = rewriting_proxy(&logged, move |target: &str, body: Vec<u8>| {
        if !target.starts_with("/v1/receipts?")
            || pages.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0
        {
            return body;
        }
        let mut page: Value = serde_json::from_slice(&body).expect("a page");
        page["receipts"] = Value::Array(Vec::new());
        serde_json::to_vec(&page).expect("json")
    });
    let run = follow_verified(&proxy.url, &logged, "withheld.cursor", 2);
    refused_at(&run, 2, 2, &logged.ids);
    assert!(run.stderr.contains("receipts withheld"), "{}", run.stderr);
}

/// The `next` of each page of `limit` receipts, read from the service.
fn page_cursors(logged: &Logged, limit: usize) -> Vec<String> {
    let agent = client();
    let mut cursors = Vec::new();
    let mut after = String::new();
    loop {
        let mut path = format!("/v1/receipts?limit={limit}");
        if !after.is_empty() {
            path.push_str(&format!("&after={after}"));
        }
        let (status, page) =
            crate::support::process::get(&agent, &logged.service.addr, &logged.reader, &path);
        assert_eq!(status, 200, "{page}");
        if page["receipts"].as_array().is_none_or(Vec::is_empty) {
            return cursors;
        }
        after = page["next"].as_str().expect("next").to_owned();
        cursors.push(after.clone());
    }
}

fn rows_edited_or_deleted_after_they_were_logged_are_named(db: TestDb) {
    let logged = logged(&db);
    let url = format!("http://{}", logged.service.addr);
    // Logged first: an honest run proves all of it.
    let honest = follow_verified(&url, &logged, "honest.cursor", 2);
    assert_eq!(honest.code, Some(0), "{}", honest.stderr);

    // An edit of a signed member (the permissions) of index 5.
    tamper(
        &db,
        &format!(
            "UPDATE plans SET permissions = '[\"plans:submit\",\"receipts:read\"]' WHERE receipt_id = '{}';",
            logged.ids[5]
        ),
    );
    let run = follow_verified(&url, &logged, "edited.cursor", 2);
    refused_at(&run, 5, 4, &logged.ids);

    // Index 3 deleted, its key row first.
    tamper(
        &db,
        &format!(
            "DELETE FROM intake_keys WHERE plan_id = (SELECT id FROM plans WHERE receipt_id = '{0}');
             DELETE FROM plans WHERE receipt_id = '{0}';",
            logged.ids[3]
        ),
    );
    let run = follow_verified(&url, &logged, "deleted.cursor", 2);
    refused_at(&run, 3, 2, &logged.ids);
}

/// `service` restarted, signing with `keys` (the first signs receipts).
fn restart_signing_with(service: ServeProcess, db: &TestDb, keys: &[&Path]) -> ServeProcess {
    let args: Vec<&str> = keys
        .iter()
        .flat_map(|key| ["--signing-key", path_arg(key)])
        .collect();
    service.terminate();
    ServeProcess::start_with(&db.url, &args)
}

/// SQL: a plan `rcpt_by_hand` written around the service, its receipt
/// claiming a signature by `key_id` (of zeros).
fn by_hand_under(key_id: &str) -> String {
    format!(
        "{};
         {}",
        crate::support::hand_written_plan_sql(
            "rcpt_by_hand",
            "planner-a",
            "'by-hand'",
            "blake3:by-hand"
        ),
        signed_as_by_hand(key_id)
    )
}

/// SQL: `rcpt_by_hand`'s receipt now claims a signature by `key_id`.
fn signed_as_by_hand(key_id: &str) -> String {
    let zeros = BASE64_ZEROS.trim_end_matches('=').repeat(2);
    format!(
        "UPDATE plans SET receipt_signature = '{key_id} {zeros}=='
          WHERE receipt_id = 'rcpt_by_hand';"
    )
}

/// A plan written around the service under a key nobody pinned (a DBA's
/// row: the log takes what the table holds) would pass as a rotation's new
/// key; the service publishes no such key, so it is named.
fn a_receipt_under_a_key_nobody_published_is_named(db: TestDb) {
    let mut logged = logged(&db);
    // The service also holds a second key (a rotation's), which it
    // publishes and the reader does not pin.
    let old = logged.dir.path().join("k1");
    let new = generate_key(logged.dir.path(), "k2");
    let new_id = {
        let public = std::fs::read_to_string(format!("{}.pub", new.display())).expect("public key");
        let mut parts = public.trim().split('+');
        format!(
            "{}+{}",
            parts.next().expect("a name"),
            parts.next().expect("an id")
        )
    };
    logged.service = restart_signing_with(logged.service, &db, &[&old, &new]);
    // Under the published key, a signature that does not hold.
    tamper(&db, &by_hand_under(&new_id));
    crate::evidence::checkpoint_of_at_least(&logged.service.addr, PLANS as u64 + 1);
    let url = format!("http://{}", logged.service.addr);
    let cases = [
        (
            "forged.cursor",
            None,
            "signature check under the key the service publishes",
        ),
        // Under a key nobody published (the signature is not in the leaf,
        // so the log still holds the row).
        (
            "by-hand.cursor",
            Some(signed_as_by_hand("bogus+00000000")),
            "signed by key bogus+00000000, which the reader does not pin and GET /v1/signing-keys does not list",
        ),
    ];
    for (cursor, edit, said) in cases {
        if let Some(edit) = edit {
            tamper(&db, &edit);
        }
        let run = follow_verified(&url, &logged, cursor, 2);
        refused_at(&run, PLANS, PLANS - 1, &logged.ids);
        assert!(run.stderr.contains(said), "{}", run.stderr);
    }

    // A key list that cannot be read names the receipt that needed it.
    let proxy = rewriting_proxy(&logged, |target: &str, body: Vec<u8>| {
        if target == "/v1/signing-keys" {
            b"<html>cached</html>".to_vec()
        } else {
            body
        }
    });
    let run = follow_verified(&proxy.url, &logged, "garbled.cursor", 2);
    refused_at(&run, PLANS, PLANS - 1, &logged.ids);
    assert!(
        run.stderr.contains(&format!(
            "log index {PLANS} (receipt rcpt_by_hand): signed by a key the reader does not pin, and GET /v1/signing-keys"
        )),
        "{}",
        run.stderr
    );
}

/// Another deployment signing with the same key (so under the same derived
/// origin) answers the checkpoint requests after the first page: its
/// checkpoint does not extend the one the follower saved, so the second
/// page is refused, the first kept.
fn a_checkpoint_of_another_deployment_with_the_same_key_is_refused(db: TestDb) {
    let logged = logged(&db);
    let other_db = match db.backend {
        plan_intake::storage::Backend::Sqlite => TestDb::sqlite(),
        plan_intake::storage::Backend::Postgres => TestDb::postgres().expect("a scratch Postgres"),
    };
    let key = logged.dir.path().join("k1");
    let other_dir = tempfile::tempdir().expect("temp dir");
    let other_key = other_dir.path().join("k1");
    std::fs::copy(&key, &other_key).expect("the same key");
    let other = logged_with(&other_db, other_dir, other_key);
    crate::evidence::checkpoint_of_at_least(&other.service.addr, PLANS as u64);
    let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let other_addr = other.service.addr.clone();
    let proxy = rewriting_proxy(&logged, move |target: &str, body: Vec<u8>| {
        let checkpoint = target.starts_with("/v1/checkpoint/extension");
        if !checkpoint || asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            return body;
        }
        let (_, other_body) = crate::evidence::get_text(&other_addr, None, target);
        other_body.into_bytes()
    });
    let run = follow_verified(&proxy.url, &logged, "other.cursor", 2);
    refused_at(&run, 2, 2, &logged.ids);
    assert!(
        run.stderr.contains("does not extend the one of"),
        "{}",
        run.stderr
    );
}

/// Killed (SIGKILL) while its CMD holds the second page: the next run
/// starts from the proof saved with the first page's cursor, hands the
/// second page again, and verifies to the end.
fn a_follower_killed_mid_page_resumes_verification_from_its_saved_proof(db: TestDb) {
    let logged = logged(&db);
    let url = format!("http://{}", logged.service.addr);
    let dir = logged.dir.path();
    let (handed, held, resumed) = (
        dir.join("handed.jsonl"),
        dir.join("held"),
        dir.join("resumed"),
    );
    // Each page appended to `handed`; the second one, before `resumed`
    // exists, is held: CMD says its pid in `held` and sleeps.
    let command = format!(
        "cat >> {handed}; if [ $(wc -l < {handed}) -eq 4 ] && [ ! -e {resumed} ]; then echo $$ > {held}.tmp; mv {held}.tmp {held}; exec sleep 600; fi",
        handed = path_arg(&handed),
        held = path_arg(&held),
        resumed = path_arg(&resumed),
    );
    let cursor = dir.join("killed.cursor");
    let args = follow_args(&logged, &cursor, 2, &["--exec", &command]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut first = tool(&args, &url, &logged.reader).spawn().expect("follow");
    let start = std::time::Instant::now();
    let holder = loop {
        if let Ok(pid) = std::fs::read_to_string(&held) {
            break pid.trim().to_owned();
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "the second page never reached CMD"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    first.kill().expect("SIGKILL the follower");
    let _ = first.wait();
    let _ = std::process::Command::new("kill")
        .args(["-9", &holder])
        .status();
    let saved = std::fs::read_to_string(&cursor).expect("the first page's cursor");
    assert!(saved.contains("verified 2\n"), "{saved}");

    std::fs::write(&resumed, "").expect("let CMD go on");
    let second = tool(&args, &url, &logged.reader)
        .output()
        .expect("follow again");
    assert_eq!(
        second.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    let ids: Vec<String> = std::fs::read_to_string(&handed)
        .expect("handed")
        .lines()
        .map(|line| {
            let receipt: Value = serde_json::from_str(line).expect("a receipt line");
            receipt["receipt_id"].as_str().expect("an id").to_owned()
        })
        .collect();
    let expected: Vec<String> = logged.ids[..4]
        .iter()
        .chain(&logged.ids[2..])
        .cloned()
        .collect();
    assert_eq!(ids, expected, "the held page again, then the rest, once");
    let saved = std::fs::read_to_string(&cursor).expect("the cursor");
    assert!(saved.contains(&format!("verified {PLANS}\n")), "{saved}");
}

/// Plans `prefix-0`… written to `service`; their receipt ids.
fn write_plans(service: &ServeProcess, planner: &str, prefix: &str, count: usize) -> Vec<String> {
    let agent = client();
    (0..count)
        .map(|i| {
            let run = format!("{prefix}-{i}");
            let body = format!(
                r#"{{"run_id":"{run}","approved_inputs":[{{"id":"forecast-v12"}}],"content":{{}}}}"#
            );
            keep_plan(&agent, &service.addr, planner, &run, &body)["receipt_id"]
                .as_str()
                .expect("an id")
                .to_owned()
        })
        .collect()
}

/// Rotated (`--signing-key NEW --signing-key OLD`), each checkpoint is
/// signed by both keys, so a follower pinned to the old key alone goes on
/// verifying (the new key's receipts held to their leaves); once the old
/// key is gone, that follower stops (76) and one that pinned the new key
/// too goes on.
fn a_follower_pinned_to_the_old_key_verifies_across_a_rotation(db: TestDb) {
    let mut logged = logged(&db);
    let planner = login_via_cli(&db.url, "planner-b", "plans:submit");
    let first = follow_verified(
        &format!("http://{}", logged.service.addr),
        &logged,
        "old.cursor",
        3,
    );
    assert_eq!(first.code, Some(0), "{}", first.stderr);

    let old = logged.dir.path().join("k1");
    let new = generate_key(logged.dir.path(), "k2");
    // The key list as a cache kept it from before the rotation.
    let (_, stale_keys) = crate::evidence::get_text(&logged.service.addr, None, "/v1/signing-keys");
    logged.service = restart_signing_with(logged.service, &db, &[&new, &old]);
    let rotated = write_plans(&logged.service, &planner, "rotated", 3);
    let note = crate::evidence::checkpoint_of_at_least(&logged.service.addr, (PLANS + 3) as u64);
    assert_eq!(
        note.lines().filter(|l| l.starts_with("— ")).count(),
        2,
        "signed by both keys: {note}"
    );
    // The new key's receipts are held to the key the service publishes,
    // asked again while an answer from before the rotation lacks it.
    let served_stale = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let proxy = rewriting_proxy(&logged, move |target: &str, body: Vec<u8>| {
        let keys = target == "/v1/signing-keys";
        if keys && !served_stale.swap(true, std::sync::atomic::Ordering::SeqCst) {
            stale_keys.clone().into_bytes()
        } else {
            body
        }
    });
    let during = follow_verified(&proxy.url, &logged, "old.cursor", 3);
    assert_eq!(during.code, Some(0), "{}", during.stderr);
    assert_eq!(during.handed, rotated);
    assert!(
        during.stderr.contains("/v1/signing-keys does not list key"),
        "{}",
        during.stderr
    );

    logged.service.terminate();
    logged.service = ServeProcess::start_with(&db.url, &["--signing-key", path_arg(&new)]);
    write_plans(&logged.service, &planner, "after", 1);
    crate::evidence::checkpoint_of_at_least(&logged.service.addr, (PLANS + 4) as u64);
    let after = follow_verified(
        &format!("http://{}", logged.service.addr),
        &logged,
        "old.cursor",
        3,
    );
    assert_eq!(after.code, Some(76), "{}", after.stderr);
    assert!(
        after.stderr.contains("checkpoint signature check"),
        "{}",
        after.stderr
    );
    // The line names the key that signed and the one the reader pins.
    let key_id = |key: &Path| -> String {
        let public = std::fs::read_to_string(format!("{}.pub", key.display())).expect("public key");
        public
            .trim()
            .splitn(3, '+')
            .take(2)
            .collect::<Vec<_>>()
            .join("+")
    };
    assert!(
        after
            .stderr
            .contains(&format!("signed by {}", key_id(&new)))
            && after.stderr.contains(&format!("pins {}", key_id(&old))),
        "{}",
        after.stderr
    );
    assert!(after.handed.is_empty());

    // The reader adds the new key: it goes on from where it stopped.
    let both = logged.dir.path().join("both.pub");
    let keys = [&old, &new]
        .iter()
        .map(|key| std::fs::read_to_string(format!("{}.pub", key.display())).expect("public key"))
        .collect::<String>();
    std::fs::write(&both, keys).expect("both keys");
    logged.keys = both;
    let added = follow_verified(
        &format!("http://{}", logged.service.addr),
        &logged,
        "old.cursor",
        3,
    );
    assert_eq!(added.code, Some(0), "{}", added.stderr);
    assert_eq!(added.handed.len(), 1);
}

/// With `--expand`, each plan's content and approved inputs are held to
/// the hashes its signed receipt was given: a content changed on the way
/// stops the follower at its index.
fn an_expanded_plan_is_held_to_its_receipt(db: TestDb) {
    let logged = logged(&db);
    let url = format!("http://{}", logged.service.addr);
    let honest = follow_verified_with(&url, &logged, "expanded.cursor", 2, &["--expand"]);
    assert_eq!(honest.code, Some(0), "{}", honest.stderr);
    assert_eq!(honest.handed, logged.ids);

    let changed = logged.ids[3].clone();
    let proxy = rewriting_proxy(&logged, move |target: &str, body: Vec<u8>| {
        if !target.starts_with("/v1/receipts?") {
            return body;
        }
        let mut page: Value = serde_json::from_slice(&body).expect("a page");
        for entry in page["receipts"].as_array_mut().into_iter().flatten() {
            if entry["receipt"]["receipt_id"].as_str() == Some(&changed) {
                entry["content"] = serde_json::json!({"run": "changed"});
            }
        }
        serde_json::to_vec(&page).expect("json")
    });
    let run = follow_verified_with(&proxy.url, &logged, "changed.cursor", 2, &["--expand"]);
    refused_at(&run, 3, 2, &logged.ids);
    assert!(
        run.stderr.contains("not what the receipt was given for"),
        "{}",
        run.stderr
    );
}

/// Each page (`--lag-every-secs 0`), the follower says how far behind the
/// feed's end it is: verifying, the receipts the log holds beyond it (7
/// logged, pages of 2: 5, 3, 1, then 0 at the short last page).
fn a_follower_says_how_far_behind_it_is(db: TestDb) {
    let logged = logged(&db);
    crate::evidence::checkpoint_of_at_least(&logged.service.addr, PLANS as u64);
    let cursor = logged.dir.path().join("lag.cursor");
    let args = follow_args(&logged, &cursor, 2, &["--lag-every-secs", "0"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = tool(
        &args,
        &format!("http://{}", logged.service.addr),
        &logged.reader,
    )
    .env("PLAN_INTAKE_LOG", "info")
    .output()
    .expect("follow");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    let behind: Vec<&str> = said
        .lines()
        .filter_map(|line| {
            let (_, rest) = line.split_once("following: ")?;
            rest.split(" receipt(s)").next()
        })
        .collect();
    assert_eq!(behind, ["5", "3", "1", "0", "0"], "{said}");
}

/// The log as C2SP `tlog-tiles` under `/v1/log/`, read with plain GETs by
/// an independent implementation (`tests/fixtures/rfc6962.py tiles`): 260
/// leaves, so a full level-0 tile, a partial one and a level-1 tile; full
/// tiles are cached as immutable, partial ones are not, and a tile beyond
/// the tree or outside the layout is a 404.
fn the_log_is_served_as_c2sp_tiles(db: TestDb) {
    let logged = logged(&db);
    let planner = login_via_cli(&db.url, "planner-b", "plans:submit");
    write_plans(&logged.service, &planner, "tiled", 260 - PLANS);
    crate::evidence::checkpoint_of_at_least(&logged.service.addr, 260);
    let base = format!("http://{}/v1/log", logged.service.addr);
    crate::evidence::independent_check_as(&["tiles", &base], Some(&logged.reader));

    let cache_as = |path: &str, token: Option<&str>| -> (u16, Option<String>) {
        let mut request = client().get(&format!("{base}/{path}"));
        if let Some(token) = token {
            request = request.set("Authorization", &format!("Bearer {token}"));
        }
        match request.call() {
            Ok(answer) => (
                answer.status(),
                answer.header("cache-control").map(str::to_owned),
            ),
            Err(ureq::Error::Status(status, _)) => (status, None),
            Err(e) => panic!("GET {path}: {e}"),
        }
    };
    let cache = |path: &str| cache_as(path, None);
    let immutable = Some("public, max-age=31536000, immutable".to_owned());
    assert_eq!(cache("tile/0/000"), (200, immutable.clone()));
    // The entries are the receipts: a login that may read every one.
    assert_eq!(cache("tile/entries/000").0, 401);
    assert_eq!(cache_as("tile/entries/000", Some(&planner)).0, 403);
    // Answered to a login: no shared cache may keep it for the next.
    let private = Some("private, max-age=31536000, immutable".to_owned());
    assert_eq!(
        cache_as("tile/entries/000", Some(&logged.reader)),
        (200, private.clone())
    );
    // Kept once read: the same answer again.
    assert_eq!(
        cache_as("tile/entries/000", Some(&logged.reader)),
        (200, private)
    );
    assert_eq!(cache("tile/0/001.p/4"), (200, Some("no-cache".to_owned())));
    for missing in [
        "tile/0/002",
        "tile/0/001",
        "tile/1/000",
        "tile/0/1",
        "tile/x/000",
        // One spelling per tile: percent-encoded digits are another URL.
        "tile/0/%30%30%30",
        "tile/0/0%300",
        "tile/%30/000",
    ] {
        assert_eq!(cache(missing).0, 404, "{missing}");
    }
    assert_eq!(
        cache_as("tile/entries/%30%30%30", Some(&logged.reader)).0,
        404
    );
    assert_eq!(cache("tile/0/000?bust=1").0, 400);
}

/// `--from-checkpoint FILE`: the follower trusts the checkpoint it is given
/// (7 leaves), has the service prove where that tree ends, and hands on
/// only the receipts after it, verified. A service that lies about the
/// tree's edge, or hands a cursor to another place in the feed, is caught
/// before anything is handed on.
fn a_follower_starts_at_a_checkpoint_and_verifies_what_follows(db: TestDb) {
    let logged = logged(&db);
    let note = crate::evidence::checkpoint_of_at_least(&logged.service.addr, PLANS as u64);
    let given = logged.dir.path().join("given.checkpoint");
    std::fs::write(&given, &note).expect("save the checkpoint");
    let planner = login_via_cli(&db.url, "planner-c", "plans:submit");
    let after = write_plans(&logged.service, &planner, "after", 3);
    let from = ["--from-checkpoint", path_arg(&given)];
    let url = format!("http://{}", logged.service.addr);

    let run = follow_verified_from(&url, &logged, "given.cursor", 2, &from, false);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(run.handed, after, "{}", run.stderr);
    assert_eq!(run.verified, PLANS as u64 + 3);

    let start_of_feed = {
        let (status, body) = crate::evidence::get_text(
            &logged.service.addr,
            Some(&logged.reader),
            "/v1/checkpoint/start?size=0",
        );
        assert_eq!(status, 200, "{body}");
        serde_json::from_str::<Value>(&body).expect("json")["after"].clone()
    };
    type Lie = Box<dyn Fn(&mut Value) + Send + Sync>;
    let lies: [(&str, Lie); 2] = [
        (
            "does not hash to the checkpoint's root",
            Box::new(|start: &mut Value| start["edge"][0] = Value::from(BASE64_ZEROS)),
        ),
        (
            "log index 7: the receipt handed there is not the log's leaf 7",
            Box::new(move |start: &mut Value| start["after"] = start_of_feed.clone()),
        ),
    ];
    for (n, (said, lie)) in lies.into_iter().enumerate() {
        let proxy = rewriting_proxy(&logged, move |target: &str, body: Vec<u8>| {
            if !target.starts_with("/v1/checkpoint/start") {
                return body;
            }
            let mut start: Value = serde_json::from_slice(&body).expect("json");
            lie(&mut start);
            serde_json::to_vec(&start).expect("json")
        });
        let run = follow_verified_from(
            &proxy.url,
            &logged,
            &format!("lied-{n}.cursor"),
            2,
            &from,
            false,
        );
        assert_eq!(run.code, Some(76), "{}", run.stderr);
        assert!(run.handed.is_empty(), "{:?}", run.handed);
        assert!(run.stderr.contains(said), "{}", run.stderr);
    }

    // A service whose newest checkpoint is older than the one given (a
    // restore took its log back): refused at once, nothing saved.
    let later = crate::evidence::checkpoint_of_at_least(&logged.service.addr, PLANS as u64 + 3);
    let later_file = logged.dir.path().join("later.checkpoint");
    std::fs::write(&later_file, &later).expect("save the checkpoint");
    let older = note.clone();
    let proxy = rewriting_proxy(&logged, move |target: &str, body: Vec<u8>| {
        if target == "/v1/checkpoint" {
            older.clone().into_bytes()
        } else {
            body
        }
    });
    let run = follow_verified_from(
        &proxy.url,
        &logged,
        "rolled-back.cursor",
        2,
        &["--from-checkpoint", path_arg(&later_file)],
        false,
    );
    assert_eq!(run.code, Some(76), "{}", run.stderr);
    assert!(run.handed.is_empty(), "{:?}", run.handed);
    assert!(
        run.stderr.contains(&format!(
            "log index {PLANS} (starting at the checkpoint given"
        )) && run.stderr.contains("its log was rolled back"),
        "{}",
        run.stderr
    );
    assert!(!logged.dir.path().join("rolled-back.cursor").exists());

    // A file that is not a checkpoint under the pinned keys is a mistake
    // of the command line (2), not evidence against the log (76).
    let not_a_checkpoint = logged.dir.path().join("not.checkpoint");
    std::fs::write(&not_a_checkpoint, "hello\n").expect("write");
    let run = follow_verified_from(
        &url,
        &logged,
        "mistaken.cursor",
        2,
        &["--from-checkpoint", path_arg(&not_a_checkpoint)],
        false,
    );
    assert_eq!(run.code, Some(2), "{}", run.stderr);
    assert!(
        run.stderr
            .contains("(--from-checkpoint) is not one signed by a pinned key (--keys)"),
        "{}",
        run.stderr
    );
    assert!(!logged.dir.path().join("mistaken.cursor").exists());
    // Beside a cursor file it is not used (the keys may have changed
    // since), so it stops nothing.
    let run = follow_verified_from(
        &url,
        &logged,
        "given.cursor",
        2,
        &["--from-checkpoint", path_arg(&not_a_checkpoint)],
        false,
    );
    assert_eq!(run.code, Some(0), "{}", run.stderr);
}

/// A hash of 32 zero bytes, base64.
const BASE64_ZEROS: &str = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

/// With no cursor file, `--from-start` or `--from-checkpoint`, a verifying
/// follower starts at the newest checkpoint, says that it trusts it, and
/// verifies everything after it from there.
fn a_follower_with_no_checkpoint_trusts_the_first_it_sees_and_says_so(db: TestDb) {
    let logged = logged(&db);
    crate::evidence::checkpoint_of_at_least(&logged.service.addr, PLANS as u64);
    let url = format!("http://{}", logged.service.addr);
    let first = follow_verified_from(&url, &logged, "trusting.cursor", 2, &[], false);
    assert_eq!(first.code, Some(0), "{}", first.stderr);
    assert!(first.handed.is_empty(), "{:?}", first.handed);
    assert!(
        first
            .stderr
            .contains("trusting the first checkpoint seen (7 receipts)"),
        "{}",
        first.stderr
    );
    let planner = login_via_cli(&db.url, "planner-d", "plans:submit");
    let after = write_plans(&logged.service, &planner, "later", 2);
    let second = follow_verified_from(&url, &logged, "trusting.cursor", 2, &[], false);
    assert_eq!(second.code, Some(0), "{}", second.stderr);
    assert_eq!(second.handed, after, "{}", second.stderr);
    assert!(!second.stderr.contains("trusting"), "{}", second.stderr);
}

/// A verifying follower asks for the checkpoint holding its page with
/// `wait`: the service appends for it at once instead of at its next
/// second, and a service that signs nothing says so without waiting.
fn a_reader_waiting_for_a_checkpoint_gets_one_at_once(db: TestDb) {
    let logged = logged(&db);
    let planner = login_via_cli(&db.url, "planner-w", "plans:submit");
    let json_of = |answer: ureq::Response| -> Value {
        let text = answer.into_string().unwrap_or_default();
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    };
    let extension = |addr: &str, query: &str| -> (u16, Value) {
        let answer = client()
            .get(&format!("http://{addr}/v1/checkpoint/extension?{query}"))
            .set("Authorization", &format!("Bearer {}", logged.reader))
            .call();
        match answer {
            Ok(answer) => (answer.status(), json_of(answer)),
            Err(ureq::Error::Status(status, answer)) => (status, json_of(answer)),
            Err(e) => panic!("GET extension: {e}"),
        }
    };
    let size_of = |answer: &Value| -> u64 {
        let note = answer["checkpoint"].as_str().expect("a checkpoint");
        note.lines()
            .nth(1)
            .and_then(|n| n.parse().ok())
            .expect("a size")
    };
    for round in 0..3 {
        let kept = write_plans(&logged.service, &planner, &format!("waited-{round}"), 1);
        assert_eq!(kept.len(), 1);
        // Asked right after the 201: no checkpoint holds the plan yet
        // unless the appender runs for the asker.
        let size = PLANS as u64 + round + 1;
        let (status, answer) = extension(&logged.service.addr, &format!("size={size}&wait=30"));
        assert_eq!(status, 200, "{answer}");
        assert!(size_of(&answer) >= size, "{answer}");
    }
    let (status, answer) = extension(&logged.service.addr, "size=1&wait=61");
    assert_eq!(status, 400, "{answer}");

    // An instance without a key (on a database of its own: one whose log
    // is signed refuses to start without one).
    let unsigned_db = match db.backend {
        plan_intake::storage::Backend::Sqlite => TestDb::sqlite(),
        plan_intake::storage::Backend::Postgres => TestDb::postgres().expect("Postgres"),
    };
    let unsigned = ServeProcess::start(&unsigned_db.url);
    let asked = std::time::Instant::now();
    let beyond = PLANS + 10;
    let (status, answer) = extension(&unsigned.addr, &format!("size={beyond}&wait=60"));
    assert_eq!(status, 404, "{answer}");
    let kind = answer["type"].as_str().unwrap_or_default();
    assert!(kind.ends_with("not-logged-yet"), "{answer}");
    assert!(
        asked.elapsed() < std::time::Duration::from_secs(30),
        "a service that signs nothing kept the reader waiting"
    );
}

/// The async follower verifies by the same code: an honest run hands on
/// every receipt; through a proxy that drops one, it stops at its index
/// with nothing past the last verified page handed on.
#[actix_web::test]
async fn an_async_follower_verifies_too() {
    use plan_intake_client::asynchronous::{AsyncClient, follow};
    use plan_intake_client::wire::evidence::TrustedKeys;
    use plan_intake_client::{FollowError, FollowOptions};

    let db = TestDb::sqlite();
    let logged = logged(&db);
    let keys = TrustedKeys::parse(&std::fs::read_to_string(&logged.keys).expect("keys"))
        .expect("pinned keys");
    let options = |cursor: &str| FollowOptions {
        from_start: true,
        limit: 2,
        wait: std::time::Duration::ZERO,
        drain: true,
        retry_base: std::time::Duration::from_millis(20),
        verify: Some(keys.clone()),
        ..FollowOptions::new(logged.dir.path().join(cursor))
    };
    let run = |url: String, cursor: &'static str| {
        let lag = Arc::new(plan_intake_client::Lag::default());
        let options = FollowOptions {
            lag: Some(lag.clone()),
            ..options(cursor)
        };
        let reader = logged.reader.clone();
        async move {
            let client = AsyncClient::new(&url, &reader).expect("a client");
            let handed = std::sync::Mutex::new(Vec::<String>::new());
            let behind = std::sync::Mutex::new(Vec::new());
            let ended = follow(&client, &options, |page| {
                behind.lock().expect("behind").push(lag.receipts());
                let ids: Vec<String> = page
                    .receipts
                    .iter()
                    .map(|entry| {
                        let receipt: Value = serde_json::from_str(entry.get()).expect("json");
                        receipt["receipt_id"].as_str().expect("an id").to_owned()
                    })
                    .collect();
                handed.lock().expect("handed").extend(ids);
                async { Ok::<(), String>(()) }
            })
            .await;
            let behind = behind.into_inner().expect("behind");
            (ended, handed.into_inner().expect("handed"), behind, lag)
        }
    };

    let (ended, handed, behind, lag) =
        run(format!("http://{}", logged.service.addr), "async.cursor").await;
    assert!(ended.is_ok(), "{ended:?}");
    assert_eq!(handed, logged.ids);
    // How far behind, read by the caller while it follows: unknown before
    // the first page, then the receipts the log holds beyond the last one
    // handed on, and none at the end.
    let expected: Vec<Option<u64>> = std::iter::once(None)
        .chain((1..PLANS.div_ceil(2)).map(|page| Some((PLANS - 2 * page) as u64)))
        .collect();
    assert_eq!(behind, expected);
    assert_eq!(lag.receipts(), Some(0));

    let ids = Arc::new(logged.ids.clone());
    let proxy = rewriting_proxy(&logged, move |target: &str, body: Vec<u8>| {
        if target.starts_with("/v1/receipts?") {
            tampered(body, Tampering::Drop(3), &ids)
        } else {
            body
        }
    });
    let (ended, handed, _, _) = run(proxy.url.clone(), "async-dropped.cursor").await;
    match ended {
        Err(FollowError::Unverified(why)) => assert!(why.contains("log index 3"), "{why}"),
        other => panic!("not refused: {other:?}"),
    }
    assert_eq!(handed, logged.ids[..3]);

    // A row written around the service under a key nobody published.
    tamper(&db, &by_hand_under("bogus+00000000"));
    crate::evidence::checkpoint_of_at_least(&logged.service.addr, PLANS as u64 + 1);
    let (ended, handed, _, _) = run(
        format!("http://{}", logged.service.addr),
        "async-by-hand.cursor",
    )
    .await;
    match ended {
        Err(FollowError::Unverified(why)) => assert!(
            why.contains(&format!("log index {PLANS}")) && why.contains("does not list"),
            "{why}"
        ),
        other => panic!("not refused: {other:?}"),
    }
    assert_eq!(handed, logged.ids[..PLANS - 1]);
}

/// A page whose `next` jumps ahead (a proxy rewriting the first page's)
/// stops the follower at the next page with 76; resumed against the
/// honest service it goes on from what it proved (its leaf count), not
/// from the cursor it was handed, and hands on the rest once.
fn a_next_moved_ahead_is_never_resumed_from(db: TestDb) {
    let logged = logged(&db);
    crate::evidence::checkpoint_of_at_least(&logged.service.addr, PLANS as u64);
    let cursors = page_cursors(&logged, 2);
    let ahead = cursors[2].clone();
    let answered = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let proxy = rewriting_proxy(&logged, move |target: &str, body: Vec<u8>| {
        if !target.starts_with("/v1/receipts?")
            || answered.swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return body;
        }
        let mut page: Value = serde_json::from_slice(&body).expect("a page");
        page["next"] = Value::from(ahead.as_str());
        serde_json::to_vec(&page).expect("json")
    });
    let run = follow_verified(&proxy.url, &logged, "ahead.cursor", 2);
    refused_at(&run, 2, 2, &logged.ids);
    let honest = format!("http://{}", logged.service.addr);
    let run = follow_verified(&honest, &logged, "ahead.cursor", 2);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(run.handed, logged.ids[2..], "{}", run.stderr);
}

/// The plan row of the last receipt a follower handed on, deleted around
/// the service: `GET /v1/checkpoint/start` still places the feed after
/// that leaf (200, not 500), and the follower goes on past it with the
/// receipts that follow, none twice, none missing.
fn a_deleted_row_at_the_cursor_is_gone_past(db: TestDb) {
    let logged = logged(&db);
    let url = format!("http://{}", logged.service.addr);
    let run = follow_verified(&url, &logged, "orders.cursor", 3);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(run.handed, logged.ids);
    tamper(
        &db,
        &format!(
            "DELETE FROM intake_keys WHERE plan_id = (SELECT id FROM plans WHERE receipt_id = '{0}');
             DELETE FROM plans WHERE receipt_id = '{0}';",
            logged.ids[PLANS - 1]
        ),
    );
    let (status, start) = crate::evidence::get_text(
        &logged.service.addr,
        Some(&logged.reader),
        &format!("/v1/checkpoint/start?size={PLANS}"),
    );
    assert_eq!(status, 200, "{start}");
    let planner = login_via_cli(&db.url, "planner-b", "plans:submit");
    let later = write_plans(&logged.service, &planner, "later", 2);
    let run = follow_verified(&url, &logged, "orders.cursor", 3);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(run.handed, later, "{}", run.stderr);
}
