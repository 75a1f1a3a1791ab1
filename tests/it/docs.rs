//! The docs as a newcomer follows them: README.md's shell blocks run in
//! order in one shell, and the client README's examples run against a
//! live service. A command that fails as printed fails here.

use std::path::Path;
use std::process::Command;

use crate::support::process::{BIN, ServeProcess, free_port, login_via_cli};

/// The README's `sh` blocks that the suite does not run, each for its
/// reason: `cargo test` is the suite itself, and `cargo bench` is minutes
/// of release-built load. Any other block runs.
const NOT_RUN: &[(&str, &str)] = &[
    ("cargo test", "the suite itself"),
    ("cargo bench", "the benchmark: minutes of load, run by hand"),
    (
        "plan-intake-soak",
        "the soak: a minute of faults, run by hand",
    ),
];

/// Fenced blocks of `lang` in `markdown`, in order, each with the line it
/// starts on.
fn blocks(markdown: &str, lang: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let mut open: Option<(usize, String)> = None;
    for (number, line) in markdown.lines().enumerate() {
        match &mut open {
            None if line.trim_end() == format!("```{lang}") => {
                open = Some((number + 1, String::new()));
            }
            Some(_) if line.starts_with("```") => found.extend(open.take()),
            Some((_, text)) => {
                text.push_str(line);
                text.push('\n');
            }
            None => {}
        }
    }
    found
}

/// One README block as the test shell runs it: the binary is this build's
/// (`cargo run --release [-q] --` is the same program, built by cargo
/// test), the service's address a free port, and what a reader leaves
/// running in another terminal (`serve`, a `follow` without `--drain`)
/// runs in the background, the service waited for until it answers.
fn as_run(block: &str, port: u16, names: &[(&str, String)]) -> String {
    let mut script = String::new();
    let mut logical = String::new();
    for line in block.lines() {
        let mut line = line.to_owned();
        for (name, value) in names {
            line = line.replace(name, value);
        }
        let line = line
            .replace("cargo run --release -q --", "plan-intake")
            .replace("cargo run --release --", "plan-intake")
            .replace("127.0.0.1:8080", &format!("127.0.0.1:{port}"))
            .replace("localhost:8080", &format!("127.0.0.1:{port}"));
        logical.push_str(&line);
        if line.ends_with('\\') {
            logical.push('\n');
            continue;
        }
        let whole = std::mem::take(&mut logical);
        let command = whole.split(" #").next().unwrap_or("").trim_end();
        if command.contains("plan-intake serve") {
            script.push_str(&format!(
                "stop_service\n{command} >>service.log 2>&1 &\nSERVICE_PID=$!\nready\n"
            ));
        } else if command.contains("plan-intake follow") && !command.contains("--drain") {
            script.push_str(&format!(
                "{command} >>follower.log 2>&1 &\nFOLLOWER_PID=$!\n"
            ));
        } else {
            script.push_str(&whole);
            script.push('\n');
        }
    }
    script
}

/// The shell functions every run uses: `ready` waits until the service
/// answers `/readyz` with 200 (or says why it died), `stop_service` stops
/// it (as the reader's Ctrl-C in its terminal would), and on exit nothing
/// is left running.
fn prelude(port: u16) -> String {
    format!(
        "set -euo pipefail
ready() {{
  for _ in $(seq 1 200); do
    curl -sf -o /dev/null http://127.0.0.1:{port}/readyz && return 0
    kill -0 $SERVICE_PID 2>/dev/null || {{ cat service.log >&2; return 1; }}
    sleep 0.05
  done
  echo 'the service never answered ready' >&2; cat service.log >&2; return 1
}}
stop_service() {{
  if [ -n \"${{SERVICE_PID:-}}\" ]; then kill -TERM $SERVICE_PID; wait $SERVICE_PID || true; SERVICE_PID=; fi
}}
trap 'kill ${{FOLLOWER_PID:-}} 2>/dev/null || true; stop_service' EXIT
"
    )
}

/// A scratch directory with `plan-intake` (this build) on its PATH.
fn workplace() -> (tempfile::TempDir, std::path::PathBuf, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).expect("bin dir");
    std::os::unix::fs::symlink(BIN, bin.join("plan-intake")).expect("link the binary");
    let work = dir.path().join("work");
    std::fs::create_dir(&work).expect("work dir");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    (dir, work, path)
}

fn said_by(out: &std::process::Output) -> String {
    format!(
        "{}\n--- stderr\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn the_readme_runs_as_printed() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("README.md");
    let (_dir, work, path) = workplace();
    let port = free_port();

    let mut script = prelude(port);
    let mut ran = Vec::new();
    for (line, block) in blocks(&readme, "sh") {
        if let Some((_, why)) = NOT_RUN.iter().find(|(marker, _)| block.contains(marker)) {
            eprintln!("README.md:{line}: not run ({why})");
            continue;
        }
        script.push_str(&format!("echo '@@ README.md:{line}'\n"));
        script.push_str(&as_run(&block, port, &[]));
        ran.push(line);
    }
    // The follower the README leaves running hands on what comes after
    // it started: the signed plan, sent by the evidence block.
    script.push_str(
        "for _ in $(seq 1 300); do
  grep -q run-2026-12-01-signed orders.jsonl 2>/dev/null && break
  sleep 0.1
done
echo '@@ orders.jsonl'; cat orders.jsonl
",
    );
    let out = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(&work)
        .env("PATH", &path)
        .env("PLAN_INTAKE_BIND", format!("127.0.0.1:{port}"))
        .env("PLAN_INTAKE_LOG", "warn")
        .env_remove("DATABASE_URL")
        .env_remove("PLAN_INTAKE_URL")
        .env_remove("PLAN_INTAKE_TOKEN")
        .output()
        .expect("run bash");
    let said = said_by(&out);
    assert!(out.status.success(), "the README's commands: {said}");
    assert_eq!(ran.len(), 6, "the README's runnable blocks: {ran:?}");
    let part = |from: &str| -> String {
        let start = said
            .find(from)
            .unwrap_or_else(|| panic!("{from} in {said}"));
        let rest = &said[start + from.len()..];
        rest[..rest.find("@@").unwrap_or(rest.len())].to_owned()
    };
    let quickstart = part(&format!("@@ README.md:{}", ran[0]));
    assert!(quickstart.contains("HTTP/1.1 201 Created"), "{said}");
    assert!(
        quickstart.matches("\"receipt_id\":\"rcpt_").count() == 2,
        "the POST's receipt and the one read back: {said}"
    );
    let submit = part(&format!("@@ README.md:{}", ran[1]));
    assert!(
        submit.contains("\"outcome\":\"created\"") && submit.contains("\"outcome\":\"replayed\""),
        "{said}"
    );
    let drained = part(&format!("@@ README.md:{}", ran[2]));
    assert!(
        drained.contains("run-2026-11-30-a") && drained.contains("run-2026-12-01-a"),
        "the follower drains both receipts: {said}"
    );
    let inbox = part(&format!("@@ README.md:{}", ran[3]));
    assert!(
        inbox.contains("2026-12-05-000001_create_plan_intake_inbox")
            && said.contains("stopped after 2 receipt(s) in 1 page(s); the inbox holds them"),
        "the inbox made, then both receipts kept in it: {said}"
    );
    let kept = crate::inbox::inbox(&work.join("orders.db").display().to_string());
    assert_eq!(kept.len(), 2, "the inbox's rows: {kept:?}");
    let evidence = part(&format!("@@ README.md:{}", ran[4]));
    assert!(
        evidence.contains("holds; leaf 2 of"),
        "the signed receipt, the log's third leaf, verified with its proof: {said}"
    );
    let verified = part(&format!("@@ README.md:{}", ran[5]));
    assert!(
        verified.contains("run-2026-11-30-a") && verified.contains("run-2026-12-01-signed"),
        "the verifying follower hands on every receipt: {said}"
    );
    assert!(
        part("@@ orders.jsonl").contains("run-2026-12-01-signed"),
        "the follower left running hands on the signed plan: {said}"
    );
}

/// The client README's examples (its crate doc, so doctests) run against
/// a signing service: a planner, a follower and the async pair, with the
/// verifying follower's pinned keys read from the service's `.pub` file.
#[test]
fn the_client_readme_examples_run_against_a_live_service() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("intake.db").display());
    let key = crate::evidence::generate_key(dir.path(), "receipts.key");
    let planner = login_via_cli(&url, "planner-a", "plans:submit");
    let reader = login_via_cli(&url, "orders", "receipts:read");
    let service = ServeProcess::start_with(&url, &["--signing-key", crate::evidence::arg(&key)]);
    // A plan before any example runs (rustdoc runs them in the order of
    // their names, not the README's), for the followers to find.
    crate::support::process::keep_plan(
        &crate::support::process::client(),
        &service.addr,
        &planner,
        "before-the-examples",
        r#"{"run_id":"run-before-the-examples","approved_inputs":[{"id":"forecast-v12"}],"content":{}}"#,
    );
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let cursor = dir.path().join("orders.cursor");
    let out = Command::new(cargo)
        .args([
            "test",
            "--quiet",
            "--locked",
            "--doc",
            "-p",
            "plan-intake-client",
            "--features",
            "async,verify",
            "--",
            // The followers share one cursor file: one after the other
            // (whichever runs second resumes from the first's cursor).
            "--test-threads",
            "1",
        ])
        .current_dir(root)
        // A cargo of its own, beside the one running this test.
        .env("CARGO_TARGET_DIR", root.join("target/dependent-check"))
        .env_remove("RUSTFLAGS")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env("PLAN_INTAKE_URL", format!("http://{}", service.addr))
        .env("PLAN_INTAKE_TOKEN", &planner)
        .env("PLAN_INTAKE_READER_TOKEN", &reader)
        .env("PLAN_INTAKE_KEYS", format!("{}.pub", key.display()))
        .env("ORDERS_CURSOR", &cursor)
        .env("ORDERS_STORE", dir.path().join("orders.store.json"))
        .output()
        .expect("run cargo");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the client README's examples: {said}");
    assert!(
        said.contains("test result: ok.") && !said.contains(" 0 passed"),
        "{said}"
    );
    // What they did, seen from the service: both plans kept, once each,
    // and the followers' cursor saved after them.
    let agent = crate::support::process::client();
    for run in ["run-2026-12-01-a", "run-2026-12-01-b"] {
        let (status, page) =
            crate::support::process::get(&agent, &service.addr, &reader, "/v1/receipts?limit=100");
        assert_eq!(status, 200, "{page}");
        let runs: Vec<_> = page["receipts"]
            .as_array()
            .expect("receipts")
            .iter()
            .filter(|r| r["run_id"] == run)
            .collect();
        assert_eq!(runs.len(), 1, "{run} kept once: {page}");
    }
    assert!(
        std::fs::read_to_string(&cursor).is_ok_and(|c| !c.trim().is_empty()),
        "the follower saved its cursor"
    );
    // The exactly-once example's store: the feed's receipts, each once, in
    // order, with the position after them.
    let store: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("orders.store.json")).expect("the example's store"),
    )
    .expect("JSON");
    let (_, page) =
        crate::support::process::get(&agent, &service.addr, &reader, "/v1/receipts?limit=100");
    let feed: Vec<String> = page["receipts"]
        .as_array()
        .expect("receipts")
        .iter()
        .map(|r| r.to_string())
        .collect();
    let kept: Vec<String> = store["receipts"]
        .as_array()
        .expect("the store's receipts")
        .iter()
        .map(|r| {
            let text = r.as_str().expect("a receipt as sent");
            serde_json::from_str::<serde_json::Value>(text)
                .expect("JSON")
                .to_string()
        })
        .collect();
    // The async example may write its plan after this one drained.
    assert!(
        !kept.is_empty() && feed.starts_with(&kept),
        "the store holds the feed as far as it read, each receipt once: {kept:?} {feed:?}"
    );
    assert!(store["position"].is_string(), "and the position: {store}");
}

/// OPERATIONS.md's `sh` blocks that the suite does not run, each for its
/// reason. Any other block runs.
const OPERATIONS_NOT_RUN: &[(&str, &str)] = &[("cargo test", "the suite itself, under a CPU hog")];

/// OPERATIONS.md's shell blocks, each in a shell of its own with
/// `DATABASE_URL` the owner's (as an operator has it), against a scratch
/// Postgres database behind a real PgBouncer: `db`, `pgbouncer` and the
/// owner's and admin's URLs name that database; the service role is a
/// role of the test's own; `/etc/plan-intake/` is a directory of the
/// scratch place. Each `serve` must answer `/readyz` 200.
#[test]
fn operations_runs_as_printed() {
    let Some(bouncer) = crate::support::pgbouncer::PgBouncer::start() else {
        return;
    };
    let operations =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/OPERATIONS.md"))
            .expect("OPERATIONS.md");
    let (_dir, work, path) = workplace();
    std::fs::create_dir(work.join("etc")).expect("etc");
    let port = free_port();
    let direct = bouncer.direct_url();
    let role = format!(
        "docs_svc_{}_{:06x}",
        std::process::id(),
        rand::random::<u32>() & 0xff_ffff
    );
    let (host_port, database) = direct
        .trim_start_matches("postgres://postgres@")
        .split_once('/')
        .expect("host and database");
    let as_role = format!("postgres://{role}:docs-password@{host_port}/{database}");
    // Longest first: a URL is replaced before the names inside it.
    let names: Vec<(&str, String)> = vec![
        ("postgres://plan_intake_service:…@db/plans", as_role.clone()),
        ("postgres://svc@pgbouncer:6432/plans", bouncer.url()),
        ("postgres://owner@db:5432/plans", direct.clone()),
        ("postgres://svc@db:5432/plans", direct.clone()),
        ("postgres://owner@db/plans", direct.clone()),
        ("postgres://admin@db/plans", direct.clone()),
        ("plan_intake_service", role.clone()),
        ("PASSWORD '…'", "PASSWORD 'docs-password'".to_owned()),
        ("/etc/plan-intake/", "etc/".to_owned()),
    ];
    let mut ran = Vec::new();
    let mut outputs = Vec::new();
    for (line, block) in blocks(&operations, "sh") {
        if let Some((_, why)) = OPERATIONS_NOT_RUN
            .iter()
            .find(|(marker, _)| block.contains(marker))
        {
            eprintln!("OPERATIONS.md:{line}: not run ({why})");
            continue;
        }
        let script = format!("{}{}", prelude(port), as_run(&block, port, &names));
        let out = Command::new("bash")
            .arg("-c")
            .arg(&script)
            .current_dir(&work)
            .env("PATH", &path)
            .env("DATABASE_URL", &direct)
            .env("PLAN_INTAKE_BIND", format!("127.0.0.1:{port}"))
            .env("PLAN_INTAKE_LOG", "warn")
            .env_remove("PLAN_INTAKE_URL")
            .env_remove("PLAN_INTAKE_TOKEN")
            .output()
            .expect("run bash");
        let said = said_by(&out);
        assert!(
            out.status.success(),
            "OPERATIONS.md:{line}, as printed:\n{block}\n{said}"
        );
        ran.push(line);
        outputs.push(said);
    }
    let mut admin = <diesel::PgConnection as diesel::Connection>::establish(
        &crate::support::postgres_base_url(),
    )
    .expect("connect");
    drop(bouncer);
    let _ = diesel::connection::SimpleConnection::batch_execute(
        &mut admin,
        &format!("DROP ROLE IF EXISTS {role}"),
    );
    assert_eq!(ran.len(), 6, "OPERATIONS' runnable blocks: {ran:?}");
    // The reference list: every check of `verify` passed, and the grants
    // printed for the role.
    assert!(outputs[1].contains("GRANT"), "{}", outputs[1]);
    // The least-privilege task: the role made, its grants given, a login.
    assert!(outputs[2].contains("CREATE ROLE"), "{}", outputs[2]);
    // The signing key made where the task says.
    assert!(work.join("etc/receipts.key.pub").exists());
    // The upgrade: every check of `verify` held (it exits non-zero on any).
    assert!(
        outputs[4].contains("ok    migrations applied"),
        "{}",
        outputs[4]
    );
    // The rotation: a new token written, the login active again.
    let token = std::fs::read_to_string(work.join("planner-a.token")).unwrap_or_default();
    assert!(token.trim().starts_with("pit_"), "{token}");
    assert!(outputs[5].contains("planner-a"), "{}", outputs[5]);
}

/// The README's first command, `cargo run --release -- serve`, needs one
/// binary among the workspace's default members: a second one (a tool
/// crate added to them) makes `cargo run` refuse to choose. Read from
/// `cargo metadata`, which builds nothing.
#[test]
fn cargo_run_has_one_binary_to_run() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .current_dir(root)
        .output()
        .expect("cargo metadata");
    assert!(out.status.success(), "{}", said_by(&out));
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let defaults: Vec<&str> = metadata["workspace_default_members"]
        .as_array()
        .expect("workspace_default_members")
        .iter()
        .filter_map(|id| id.as_str())
        .collect();
    let binaries: Vec<String> = metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .filter(|package| {
            package["id"]
                .as_str()
                .is_some_and(|id| defaults.contains(&id))
        })
        .flat_map(|package| package["targets"].as_array().cloned().unwrap_or_default())
        .filter(|target| {
            target["kind"]
                .as_array()
                .is_some_and(|kinds| kinds.iter().any(|k| k == "bin"))
        })
        .filter_map(|target| target["name"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(binaries, ["plan-intake"], "the default members' binaries");
}
