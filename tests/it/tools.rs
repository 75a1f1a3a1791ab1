//! The callers' tools, as real processes against a real service:
//! `plan-intake submit` (retries under one key) and `plan-intake follow`
//! (every receipt at least once, the cursor saved after each page).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use plan_intake::intake::Permission;
use serde_json::Value;

use crate::support::process::{BIN, ServeProcess, client, free_port, get, post_plan};
use crate::support::{TestApp, TestDb, execute_batch, plan_body, scalar};

/// A scratch database with a planner's and a reader's login, and the
/// service on it (fields drop in order: the service before its database).
pub(crate) struct Stage {
    pub(crate) server: ServeProcess,
    pub(crate) planner: String,
    pub(crate) reader: String,
    pub(crate) app: TestApp,
}

impl Stage {
    pub(crate) fn new(scratch: TestDb) -> Self {
        let url = scratch.url.clone();
        let app = TestApp::new(scratch);
        let planner = app.login("planner-a", &[Permission::PlansSubmit]);
        let reader = app.login("orders", &[Permission::ReceiptsRead]);
        Self {
            server: ServeProcess::start(&url),
            planner,
            reader,
            app,
        }
    }
}

/// `plan-intake ARGS…` as a caller runs it: the service's URL and a token
/// in the environment, nothing of the database.
pub(crate) fn tool(args: &[&str], url: &str, token: &str) -> Command {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env_remove("DATABASE_URL")
        .env("PLAN_INTAKE_URL", url)
        .env("PLAN_INTAKE_TOKEN", token)
        .env("PLAN_INTAKE_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// A plan request in a file of its own.
pub(crate) fn request_file(dir: &tempfile::TempDir, run: &str) -> std::path::PathBuf {
    let path = dir.path().join(format!("{run}.json"));
    std::fs::write(&path, plan_body(run, run)).expect("write the request");
    path
}

/// `submit FILE` against `bind` retrying quickly, and its stderr lines.
fn start_submit(
    file: &std::path::Path,
    bind: &str,
    token: &str,
) -> (Child, mpsc::Receiver<String>) {
    let mut submit = tool(
        &[
            "submit",
            file.to_str().expect("path"),
            "--retry-base-ms",
            "20",
        ],
        &format!("http://{bind}"),
        token,
    )
    .spawn()
    .expect("start submit");
    let lines = stderr_lines(&mut submit);
    (submit, lines)
}

/// Stderr lines of a running child, as they come.
fn stderr_lines(child: &mut Child) -> mpsc::Receiver<String> {
    let stderr = child.stderr.take().expect("stderr");
    let (sender, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = sender.send(line);
        }
    });
    lines
}

/// Blocks until a line containing `needle` arrives; every line seen.
#[track_caller]
fn await_line(lines: &mpsc::Receiver<String>, needle: &str) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                let found = line.contains(needle);
                seen.push(line);
                if found {
                    return seen;
                }
            }
            Err(_) => panic!("no line with `{needle}` within 30 s; saw {seen:?}"),
        }
    }
}

#[track_caller]
pub(crate) fn wait_with_deadline(child: &mut Child, what: &str) -> ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        assert!(Instant::now() < deadline, "{what} did not exit within 60 s");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The one line a successful `submit` prints: its receipt.
#[track_caller]
fn receipt_printed_by(submit: &mut Child) -> Value {
    let status = wait_with_deadline(submit, "submit");
    let mut text = String::new();
    submit
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut text)
        .expect("read stdout");
    assert!(status.success(), "{status}: {text}");
    assert_eq!(text.lines().count(), 1, "one line: {text}");
    serde_json::from_str(&text).expect("a JSON receipt")
}

/// Requests the service has answered on `POST /v1/plans`, by status, from `/metrics`.
fn plan_posts(server: &ServeProcess) -> Vec<(String, u64)> {
    let text = server.metrics_text();
    let prefix = "plan_intake_http_request_duration_seconds_count{route=\"/v1/plans\",status=\"";
    text.lines()
        .filter_map(|line| line.strip_prefix(prefix))
        .filter_map(|rest| {
            let (status, count) = rest.split_once("\"} ")?;
            Some((status.to_owned(), count.trim().parse().ok()?))
        })
        .collect()
}

fn submit_started_before_the_service_lands_once_it_is_up(scratch: TestDb) {
    let url = scratch.url.clone();
    let app = TestApp::new(scratch);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let dir = tempfile::tempdir().expect("tempdir");
    let file = request_file(&dir, "run-early");
    let bind = format!("127.0.0.1:{}", free_port());

    let (mut submit, lines) = start_submit(&file, &bind, &token);
    // It has tried, found nothing listening, and is waiting to try again.
    let seen = await_line(&lines, "retrying in");
    assert!(
        seen.iter()
            .any(|l| l.starts_with("idempotency-key: submit-")),
        "{seen:?}"
    );
    let _server = ServeProcess::start_on(&url, &bind, &[]);
    let receipt = receipt_printed_by(&mut submit);
    assert_eq!(receipt["outcome"], "created");
    assert!(
        app.stored(receipt["receipt_id"].as_str().expect("id"))
            .is_some()
    );
    app.assert_rows(1, 1);
}

/// The write is held by a table lock while its request is in flight; the
/// service is killed with SIGKILL; its orphaned backend then commits the
/// plan (the answer is lost), and a new service comes up on the same port.
/// submit, retrying under its one key, gets that plan's receipt.
#[test]
fn submit_rides_out_a_service_killed_with_sigkill_mid_write() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let schema = scratch.schema.clone().expect("schema");
    let url = scratch.postgres_url_with(&[]);
    let app = TestApp::new(scratch);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let dir = tempfile::tempdir().expect("tempdir");
    let file = request_file(&dir, "run-killed");
    let bind = format!("127.0.0.1:{}", free_port());
    let server = ServeProcess::start_on(&url, &bind, &[]);

    let mut holder = app.conn();
    execute_batch(
        &mut holder,
        &format!("BEGIN; LOCK TABLE \"{schema}\".plans IN SHARE MODE"),
    );
    let (mut submit, lines) = start_submit(&file, &bind, &token);
    let mut observer = app.conn();
    let waiting_write = format!(
        "SELECT COUNT(*) AS n FROM pg_stat_activity WHERE application_name = '{schema}' \
         AND wait_event_type = 'Lock' AND query LIKE '%plan_intake_write%'"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while scalar(&mut observer, &waiting_write) == 0 {
        assert!(
            Instant::now() < deadline,
            "the write never reached the lock"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    server.kill_9();
    // The service is gone; its backend still holds the request and commits it.
    await_line(&lines, "retrying in");
    execute_batch(&mut holder, "COMMIT");
    let _restarted = ServeProcess::start_on(&url, &bind, &[]);

    let receipt = receipt_printed_by(&mut submit);
    let outcome = receipt["outcome"].as_str().expect("outcome");
    assert!(matches!(outcome, "created" | "replayed"), "{receipt}");
    assert!(
        app.stored(receipt["receipt_id"].as_str().expect("id"))
            .is_some()
    );
    app.assert_rows(1, 1);
}

/// A 422 is final: exit 65 after exactly one request, the problem on
/// stderr; a wrong token is 77 with nothing written.
fn refusals_are_final(scratch: TestDb) {
    let stage = Stage::new(scratch);
    let (app, server, token) = (&stage.app, &stage.server, &stage.planner);
    let base = format!("http://{}", server.addr);

    let mut submit = tool(&["submit", "-"], &base, token)
        .stdin(Stdio::piped())
        .spawn()
        .expect("start submit");
    submit
        .stdin
        .take()
        .expect("stdin")
        .write_all(br#"{"run_id":"","approved_inputs":[],"content":{}}"#)
        .expect("write the request");
    let out = submit.wait_with_output().expect("submit");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(65), "{stderr}");
    assert!(out.stdout.is_empty());
    assert!(
        stderr.contains("422") && stderr.contains("run_id"),
        "{stderr}"
    );
    assert_eq!(plan_posts(server), vec![("422".to_owned(), 1)]);

    let dir = tempfile::tempdir().expect("tempdir");
    let file = request_file(&dir, "run-denied");
    let out = tool(
        &["submit", file.to_str().expect("path")],
        &base,
        "not-a-token",
    )
    .output()
    .expect("submit");
    assert_eq!(
        out.status.code(),
        Some(77),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = tool(&["submit", file.to_str().expect("path")], &base, token)
        .env_remove("PLAN_INTAKE_TOKEN")
        .output()
        .expect("submit");
    assert_eq!(out.status.code(), Some(2), "no token is a bad command line");
    app.assert_rows(0, 0);
}

/// The same file twice: `created`, then `replayed`, under one derived key.
fn the_same_file_twice_is_one_plan(scratch: TestDb) {
    let stage = Stage::new(scratch);
    let (app, server, token) = (&stage.app, &stage.server, &stage.planner);
    let dir = tempfile::tempdir().expect("tempdir");
    let file = request_file(&dir, "run-twice");
    let run = || {
        let out = tool(
            &["submit", file.to_str().expect("path")],
            &format!("http://{}", server.addr),
            token,
        )
        .output()
        .expect("submit");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{stderr}");
        let stdout = String::from_utf8(out.stdout).expect("utf-8");
        assert_eq!(stdout.lines().count(), 1, "one line: {stdout}");
        let key = stderr
            .lines()
            .find_map(|l| l.strip_prefix("idempotency-key: "))
            .expect("the key on stderr")
            .to_owned();
        (serde_json::from_str::<Value>(&stdout).expect("JSON"), key)
    };
    let (first, first_key) = run();
    let (second, second_key) = run();
    assert_eq!(first["outcome"], "created");
    assert_eq!(second["outcome"], "replayed");
    assert_eq!(first_key, second_key);
    assert_eq!(first["receipt_id"], second["receipt_id"]);
    app.assert_rows(1, 1);
}

/// Complete JSON lines from a follower's stdout, on a channel; a last line
/// cut short by SIGKILL is not a delivery and is dropped.
pub(crate) fn delivered_lines(stdout: ChildStdout) -> mpsc::Receiver<String> {
    let (sender, lines) = mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        loop {
            let mut line = Vec::new();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) if line.last() != Some(&b'\n') => return,
                Ok(_) => {
                    let text = String::from_utf8(line).expect("utf-8");
                    let receipt: Value = serde_json::from_str(&text).expect("a JSON line");
                    let id = receipt["receipt_id"]
                        .as_str()
                        .expect("receipt_id")
                        .to_owned();
                    if sender.send(id).is_err() {
                        return;
                    }
                }
            }
        }
    });
    lines
}

/// Receives until `count` lines have come.
#[track_caller]
pub(crate) fn take(lines: &mpsc::Receiver<String>, count: usize) -> Vec<String> {
    (0..count)
        .map(|i| {
            lines
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| panic!("only {i} of {count} receipts within 30 s"))
        })
        .collect()
}

/// The whole feed, in feed order, as one reader sees it.
pub(crate) fn feed_order(addr: &str, reader: &str) -> Vec<String> {
    let (status, page) = get(&client(), addr, reader, "/v1/receipts?limit=1000");
    assert_eq!(status, 200, "{page}");
    page["receipts"]
        .as_array()
        .expect("receipts")
        .iter()
        .map(|r| r["receipt_id"].as_str().expect("id").to_owned())
        .collect()
}

pub(crate) fn post_many(
    addr: &str,
    token: &str,
    prefix: &str,
    count: usize,
) -> std::thread::JoinHandle<()> {
    let (addr, token, prefix) = (addr.to_owned(), token.to_owned(), prefix.to_owned());
    std::thread::spawn(move || {
        let agent = client();
        for i in 0..count {
            let run = format!("{prefix}-{i}");
            let (status, body) =
                post_plan(&agent, &addr, &token, &run, &plan_body(&run, &run)).expect("answer");
            assert_eq!(status, 201, "{body}");
        }
    })
}

const PAGE: usize = 20;

/// A follower killed with SIGKILL in the middle of a stream of 500 plans,
/// then started again on its cursor file: every receipt, in feed order,
/// and at most one page twice.
fn follow_killed_mid_stream_skips_nothing(scratch: TestDb) {
    let stage = Stage::new(scratch);
    let (server, planner, reader) = (&stage.server, &stage.planner, &stage.reader);
    let base = format!("http://{}", server.addr);
    let dir = tempfile::tempdir().expect("tempdir");
    let cursor = dir.path().join("orders.cursor");
    let follow_args = [
        "follow",
        "--cursor-file",
        cursor.to_str().expect("path"),
        "--from-start",
        "--limit",
        "20",
    ];

    let writer = post_many(&server.addr, planner, "run", 500);
    let mut first = tool(&follow_args, &base, reader).spawn().expect("follow");
    let first_lines = delivered_lines(first.stdout.take().expect("stdout"));
    let mut delivered = take(&first_lines, 150);
    first.kill().expect("SIGKILL");
    first.wait().expect("reap");
    delivered.extend(first_lines.iter());

    let mut second = tool(&follow_args, &base, reader).spawn().expect("follow");
    let second_lines = delivered_lines(second.stdout.take().expect("stdout"));
    writer.join().expect("500 plans written");
    let feed = feed_order(&server.addr, reader);
    assert_eq!(feed.len(), 500);
    // The second run starts where the saved cursor is: at most one page back.
    let mut seen: std::collections::HashSet<String> = delivered.iter().cloned().collect();
    let mut again = Vec::new();
    while seen.len() < feed.len() {
        let id = take(&second_lines, 1).remove(0);
        seen.insert(id.clone());
        again.push(id);
    }
    let repeated = again.iter().take_while(|id| delivered.contains(id)).count();
    assert!(repeated <= PAGE, "{repeated} receipts delivered twice");
    assert_eq!(
        again[..repeated],
        delivered[delivered.len() - repeated..],
        "what comes twice is the tail of the first run"
    );
    delivered.extend(again.into_iter().skip(repeated));
    assert_eq!(delivered, feed, "every receipt once, in feed order");

    // SIGTERM: exit 0 with the cursor saved; a drain from it finds nothing new.
    let pid = second.id().to_string();
    Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    let status = wait_with_deadline(&mut second, "follow");
    assert!(status.success(), "{status}");
    let out = tool(
        &[
            "follow",
            "--cursor-file",
            cursor.to_str().expect("path"),
            "--from-start",
            "--drain",
        ],
        &base,
        reader,
    )
    .output()
    .expect("follow --drain");
    assert!(out.status.success());
    assert!(out.stdout.is_empty(), "nothing after the saved cursor");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("--from-start is ignored") && said.contains("orders.cursor"),
        "an ignored --from-start is told: {said}"
    );
}

/// A CMD that fails twice gets the same page a third time; the cursor does
/// not move until it succeeds, and the page is delivered once.
#[test]
fn a_failing_command_gets_its_page_again_and_the_cursor_waits() {
    let scratch = TestDb::sqlite();
    let stage = Stage::new(scratch);
    let (server, planner, reader) = (&stage.server, &stage.planner, &stage.reader);
    let base = format!("http://{}", server.addr);
    let dir = tempfile::tempdir().expect("tempdir");
    let cursor = dir.path().join("orders.cursor");
    let cursor_arg = cursor.to_str().expect("path");

    // An empty feed: the cursor file is made, at the start.
    let out = tool(
        &[
            "follow",
            "--cursor-file",
            cursor_arg,
            "--from-start",
            "--drain",
        ],
        &base,
        reader,
    )
    .output()
    .expect("follow");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let start = std::fs::read_to_string(&cursor).expect("a cursor at the start");
    post_many(&server.addr, planner, "run", 3)
        .join()
        .expect("3 plans");

    let script = format!(
        r#"d={dir}; n=$(cat "$d/count" 2>/dev/null || echo 0); n=$((n+1)); echo $n > "$d/count"
cat "$d/orders.cursor" >> "$d/cursor-seen"
if [ "$n" -lt 3 ]; then cat > /dev/null; exit 1; fi
cat >> "$d/delivered""#,
        dir = dir.path().display()
    );
    let out = tool(
        &[
            "follow",
            "--cursor-file",
            cursor_arg,
            "--drain",
            "--exec",
            &script,
        ],
        &base,
        reader,
    )
    .output()
    .expect("follow --exec");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stderr.matches("handed to it again").count(), 2, "{stderr}");

    let read = |name: &str| std::fs::read_to_string(dir.path().join(name)).expect(name);
    assert_eq!(read("count").trim(), "3");
    assert_eq!(
        read("cursor-seen"),
        start.repeat(3),
        "the cursor waited for CMD"
    );
    let delivered: Vec<String> = read("delivered")
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("JSON")["receipt_id"].to_string())
        .collect();
    assert_eq!(delivered.len(), 3, "the page, once");
    assert_ne!(
        read("orders.cursor"),
        start,
        "the cursor moved after CMD exited 0"
    );
}

/// The service restarted under a running follower: it waits the restart
/// out and goes on, with nothing skipped and nothing repeated.
#[test]
fn a_service_restart_under_a_follower_changes_nothing() {
    let scratch = TestDb::sqlite();
    let url = scratch.url.clone();
    let app = TestApp::new(scratch);
    let planner = app.login("planner-a", &[Permission::PlansSubmit]);
    let reader = app.login("orders", &[Permission::ReceiptsRead]);
    let bind = format!("127.0.0.1:{}", free_port());
    let server = ServeProcess::start_on(&url, &bind, &[]);
    let base = format!("http://{bind}");
    let dir = tempfile::tempdir().expect("tempdir");
    let cursor = dir.path().join("orders.cursor");

    let mut follower = tool(
        &[
            "follow",
            "--cursor-file",
            cursor.to_str().expect("path"),
            "--limit",
            "10",
            "--wait-secs",
            "5",
        ],
        &base,
        &reader,
    )
    .spawn()
    .expect("follow");
    let lines = delivered_lines(follower.stdout.take().expect("stdout"));
    // Started at the end: the cursor file says so before any plan is sent.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cursor.exists() {
        assert!(Instant::now() < deadline, "no cursor file");
        std::thread::sleep(Duration::from_millis(5));
    }
    post_many(&bind, &planner, "before", 50)
        .join()
        .expect("50 plans");
    let mut delivered = take(&lines, 50);
    assert!(server.terminate().success());
    let _restarted = ServeProcess::start_on(&url, &bind, &[]);
    post_many(&bind, &planner, "after", 50)
        .join()
        .expect("50 more");
    delivered.extend(take(&lines, 50));
    assert_eq!(
        delivered,
        feed_order(&bind, &reader),
        "every receipt once, in order"
    );

    let pid = follower.id().to_string();
    Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    let status = wait_with_deadline(&mut follower, "follow");
    assert!(status.success(), "{status}");
    // The reader's channel ends at the follower's end of output: nothing
    // more came before it.
    assert_eq!(
        lines.recv_timeout(Duration::from_secs(20)),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected),
        "nothing more"
    );
}

crate::on_both_backends_sync!(
    submit_started_before_the_service_lands_once_it_is_up,
    refusals_are_final,
    the_same_file_twice_is_one_plan,
    follow_killed_mid_stream_skips_nothing,
);

/// The derived key is the service's own view of the request: every body it
/// takes as the same request (member order, white space, members it
/// ignores, number spellings it writes the same) gets `submit-` and the hex
/// of the receipt's `request_hash`, so each resend is a replay.
#[test]
fn every_spelling_of_one_request_gets_its_request_hash_as_key() {
    let stage = Stage::new(TestDb::sqlite());
    let base = format!("http://{}", stage.server.addr);
    let dir = tempfile::tempdir().expect("tempdir");
    let variants = [
        r#"{"run_id":"run-v","approved_inputs":[{"id":"a","digest":"blake3:00"}],"content":{"b":[1.5,2],"a":"x"}}"#,
        "{ \"content\" : { \"a\" : \"x\" , \"b\" : [ 1.5 , 2 ] } ,\n  \"approved_inputs\" : [ { \"digest\" : \"blake3:00\" , \"id\" : \"a\" } ] ,\n  \"run_id\" : \"run-v\" }",
        r#"{"run_id":"run-v","approved_inputs":[{"id":"a","digest":"blake3:00"}],"content":{"b":[15e-1,2.0],"a":"x"},"note":"ignored by the service"}"#,
        r#"{"run_id":"run-v","approved_inputs":[{"id":"a","digest":"blake3:00"}],"content":{"a":"\u0078","b":[1.50,2e0]}}"#,
    ];
    let mut answers = Vec::new();
    for (i, body) in variants.iter().enumerate() {
        let file = dir.path().join(format!("v{i}.json"));
        std::fs::write(&file, body).expect("write");
        let out = tool(
            &["submit", file.to_str().expect("path")],
            &base,
            &stage.planner,
        )
        .output()
        .expect("submit");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "variant {i}: {stderr}");
        let key = stderr
            .lines()
            .find_map(|l| l.strip_prefix("idempotency-key: "))
            .expect("the key")
            .to_owned();
        let receipt: Value = serde_json::from_slice(&out.stdout).expect("receipt");
        answers.push((key, receipt));
    }
    let (first_key, first) = &answers[0];
    assert_eq!(first["outcome"], "created");
    let hex = first["request_hash"]
        .as_str()
        .and_then(|h| h.strip_prefix("blake3:"))
        .expect("request_hash");
    assert_eq!(first_key, &format!("submit-{hex}"));
    for (i, (key, receipt)) in answers.iter().enumerate().skip(1) {
        assert_eq!(key, first_key, "variant {i}");
        assert_eq!(receipt["outcome"], "replayed", "variant {i}: {receipt}");
        assert_eq!(receipt["receipt_id"], first["receipt_id"]);
    }
    stage.app.assert_rows(1, 1);
}

/// `--key` goes out exactly as typed: an RFC 8941 string stays one (the
/// service unquotes it), so `"\"abc\""` and `abc` are two keys; a key the
/// service would refuse is refused before anything is sent (exit 2).
#[test]
fn an_explicit_key_is_sent_as_typed() {
    let stage = Stage::new(TestDb::sqlite());
    let base = format!("http://{}", stage.server.addr);
    let dir = tempfile::tempdir().expect("tempdir");
    let submit = |run: &str, key: &str| {
        let file = request_file(&dir, run);
        tool(
            &["submit", file.to_str().expect("path"), "--key", key],
            &base,
            &stage.planner,
        )
        .output()
        .expect("submit")
    };
    let plain = submit("run-1", "abc");
    assert!(
        plain.status.success(),
        "{}",
        String::from_utf8_lossy(&plain.stderr)
    );
    // Another request under the quoted key `"abc"` (quotes included) is a
    // new plan, not a reuse of `abc`.
    let quoted = submit("run-2", r#""\"abc\"""#);
    let stderr = String::from_utf8_lossy(&quoted.stderr);
    assert!(quoted.status.success(), "{stderr}");
    assert!(stderr.contains(r#"idempotency-key: "\"abc\"""#), "{stderr}");
    let receipt: Value = serde_json::from_slice(&quoted.stdout).expect("receipt");
    assert_eq!(receipt["outcome"], "created");
    let key_of = |run: &str| {
        scalar(
            &mut stage.app.conn(),
            &format!(
                "SELECT COUNT(*) AS n FROM intake_keys k JOIN plans p ON p.id = k.plan_id \
                  WHERE p.run_id = '{run}' AND k.idempotency_key = '\"abc\"'"
            ),
        )
    };
    assert_eq!(key_of("run-2"), 1, "stored under the key the service read");
    let escaped = submit("run-3", r#""\"x""#);
    assert!(
        escaped.status.success(),
        "{}",
        String::from_utf8_lossy(&escaped.stderr)
    );
    let refused = submit("run-4", "has space");
    assert_eq!(refused.status.code(), Some(2));
    stage.app.assert_rows(3, 3);
}

/// `submit`'s retries are bounded by its time (`--timeout-secs`), not by a
/// count that runs out in seconds: against a port where nothing listens it
/// keeps trying, well past 8 attempts, until its time is nearly up; an
/// attempt count is a cap only when given. A TLS handshake against a
/// plain-HTTP port is no temporary failure: one attempt, one clear line.
#[test]
fn submit_retries_for_its_time_and_not_against_the_wrong_scheme() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = request_file(&dir, "run-bounded");
    let nothing = format!("http://127.0.0.1:{}", free_port());
    let started = Instant::now();
    let out = tool(
        &[
            "submit",
            file.to_str().expect("path"),
            "--timeout-secs",
            "3",
            "--retry-base-ms",
            "10",
        ],
        &nothing,
        "pit_0",
    )
    .output()
    .expect("submit");
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{said}");
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "gave up after {:?}: {said}",
        started.elapsed()
    );
    let attempts: u32 = said
        .split("gave up after ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next()?.parse().ok())
        .unwrap_or(0);
    assert!(attempts > 8, "{attempts} attempts: {said}");
    let capped = tool(
        &[
            "submit",
            file.to_str().expect("path"),
            "--max-attempts",
            "2",
            "--retry-base-ms",
            "1",
        ],
        &nothing,
        "pit_0",
    )
    .output()
    .expect("submit");
    assert!(
        String::from_utf8_lossy(&capped.stderr).contains("gave up after 2 attempt(s)"),
        "{}",
        String::from_utf8_lossy(&capped.stderr)
    );

    let stage = Stage::new(TestDb::sqlite());
    let out = tool(
        &["submit", file.to_str().expect("path")],
        &format!("https://{}", stage.server.addr),
        &stage.planner,
    )
    .output()
    .expect("submit");
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("TLS handshake failed"), "{said}");
    assert!(!said.contains("retrying"), "not retried: {said}");
}

/// `follow --exec CMD` hands CMD the page's facts (how many receipts, the
/// first and last receipt id, the cursor read after and the one saved
/// once it exits 0) and never the reader's token; a cursor file that holds
/// no cursor is named, with what to do.
#[test]
fn follow_tells_its_command_the_page_and_never_the_token() {
    let stage = Stage::new(TestDb::sqlite());
    let (server, planner, reader) = (&stage.server, &stage.planner, &stage.reader);
    let base = format!("http://{}", server.addr);
    let dir = tempfile::tempdir().expect("tempdir");
    let cursor = dir.path().join("orders.cursor");
    post_many(&server.addr, planner, "run", 3)
        .join()
        .expect("3 plans");
    let script = format!(
        "cat > /dev/null; env | grep '^PLAN_INTAKE_' | sort > {}",
        dir.path().join("env").display()
    );
    let out = tool(
        &[
            "follow",
            "--cursor-file",
            cursor.to_str().expect("path"),
            "--from-start",
            "--drain",
            "--exec",
            &script,
        ],
        &base,
        reader,
    )
    .output()
    .expect("follow --exec");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let env = std::fs::read_to_string(dir.path().join("env")).expect("CMD's environment");
    assert!(
        !env.contains("PLAN_INTAKE_TOKEN") && !env.contains(reader.as_str()),
        "{env}"
    );
    let feed = feed_order(&server.addr, reader);
    let saved = std::fs::read_to_string(&cursor).expect("the cursor saved");
    for expected in [
        "PLAN_INTAKE_PAGE_RECEIPTS=3".to_owned(),
        format!("PLAN_INTAKE_PAGE_FIRST={}", feed[0]),
        format!("PLAN_INTAKE_PAGE_LAST={}", feed[2]),
        "PLAN_INTAKE_PAGE_AFTER=\n".to_owned(),
        format!("PLAN_INTAKE_PAGE_NEXT={}", saved.trim()),
    ] {
        assert!(env.contains(&expected), "{expected}: {env}");
    }

    std::fs::write(&cursor, "not-a-cursor\n").expect("a cursor file that holds none");
    let out = tool(
        &[
            "follow",
            "--cursor-file",
            cursor.to_str().expect("path"),
            "--drain",
        ],
        &base,
        reader,
    )
    .output()
    .expect("follow");
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(65), "{said}");
    assert!(
        said.contains(&cursor.display().to_string()) && said.contains("remove it"),
        "{said}"
    );
}
