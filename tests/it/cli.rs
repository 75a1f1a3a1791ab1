//! The command line as an operator uses it: the real binary, a real database.

use std::process::Command;

use plan_intake::storage::MigrateOnOpen;

use crate::support::TestDb;

use crate::support::process::{BIN, run_cli as plan_intake};

/// `migrate run`, as an operator does before the first login.
fn migrated(db: &TestDb) {
    let out = plan_intake(db, &["migrate", "run"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn logins_add_prints_only_the_token_and_stores_only_its_hash(db: TestDb) {
    migrated(&db);
    let out = plan_intake(
        &db,
        &["logins", "add", "planner-a", "--permission", "plans:submit"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    let token = stdout.strip_suffix('\n').expect("one line");
    assert!(
        !token.contains('\n'),
        "stdout holds more than the token: {stdout:?}"
    );
    assert!(
        token.starts_with("pit_") && token.len() == 4 + 64,
        "{token}"
    );
    assert!(token[4..].bytes().all(|b| b.is_ascii_hexdigit()));

    let database = db.open_with(MigrateOnOpen::Skip);
    let mut conn = database.conn().expect("connection");
    let rows = plan_intake::storage::logins::list(&mut conn).expect("list");
    assert_eq!(rows.len(), 1);
    assert_eq!(
        rows[0].token_hash,
        plan_intake::intake::login::token_hash(token)
    );
    assert!(!rows[0].token_hash.contains(&token[4..]));
    let found = plan_intake::intake::login::login_for_token(&database, token).expect("lookup");
    assert_eq!(found.map(|l| l.name), Some("planner-a".to_owned()));

    let list = plan_intake(&db, &["logins", "list"]);
    let listed = String::from_utf8_lossy(&list.stdout);
    assert!(
        listed.contains("planner-a") && !listed.contains(&token[4..]),
        "{listed}"
    );

    let revoke = plan_intake(&db, &["logins", "revoke", "planner-a"]);
    assert!(revoke.status.success());
    assert_eq!(
        plan_intake::intake::login::login_for_token(&database, token).expect("lookup"),
        None
    );
}

fn bad_input_is_one_line_and_a_non_zero_exit(db: TestDb) {
    for args in [
        &["logins", "add", "planner-a", "--permission", "admin"][..],
        &["logins", "add", "bad name", "--permission", "plans:submit"][..],
        &["logins", "revoke", "nobody"][..],
    ] {
        let out = plan_intake(&db, args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?} printed to stdout");
    }
    let out = Command::new(BIN)
        .args(["migrate", "status", "--database-url", "mysql://localhost/x"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("unsupported database URL scheme"),
        "{stderr}"
    );
}

fn serve_no_migrate_refuses_a_database_with_pending_migrations(db: TestDb) {
    db.create_empty();
    let out = plan_intake(&db, &["serve", "--no-migrate", "--bind", "127.0.0.1:0"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("pending")
            && stderr.contains("2026-11-30-000001_create_logins")
            && stderr.contains("`plan-intake migrate run`"),
        "{stderr}"
    );

    let run = plan_intake(&db, &["migrate", "run"]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let status = plan_intake(&db, &["migrate", "status"]);
    let listed = String::from_utf8_lossy(&status.stdout);
    assert!(
        listed.lines().all(|l| l.starts_with("applied"))
            && listed.lines().count() == crate::schema::MIGRATION_HISTORY.len(),
        "{listed}"
    );
}

/// A token rotates without changing the login: the old one works through
/// its grace period (and `logins list` says until when), a zero grace ends
/// it at once, a revoke ends both; a revoked login is never rotated back
/// in (refused in one line that names `logins reinstate`, nothing
/// changed), and `logins reinstate` brings it back under a new token only.
fn logins_rotate_keeps_the_identity_and_honours_the_grace_period(db: TestDb) {
    let token = |out: std::process::Output| {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .expect("utf-8")
            .trim()
            .to_owned()
    };
    migrated(&db);
    let first = token(plan_intake(
        &db,
        &["logins", "add", "planner-a", "--permission", "plans:submit"],
    ));
    let second = token(plan_intake(
        &db,
        &["logins", "rotate", "planner-a", "--grace", "1h"],
    ));
    assert!(second.starts_with("pit_") && second != first);
    let database = db.open_with(MigrateOnOpen::Skip);
    let who = |t: &str| {
        plan_intake::intake::login::login_for_token(&database, t)
            .expect("lookup")
            .map(|login| login.name)
    };
    assert_eq!(
        who(&first).as_deref(),
        Some("planner-a"),
        "the old token in its grace period"
    );
    assert_eq!(who(&second).as_deref(), Some("planner-a"));
    let listed = plan_intake(&db, &["logins", "list"]);
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.contains("active; the replaced token works until "),
        "{listed}"
    );

    let third = token(plan_intake(
        &db,
        &["logins", "rotate", "planner-a", "--grace", "0s"],
    ));
    assert_eq!(
        who(&first),
        None,
        "only the last token before a rotation is kept"
    );
    assert_eq!(
        who(&second),
        None,
        "a zero grace ends the old token at once"
    );
    assert_eq!(who(&third).as_deref(), Some("planner-a"));

    assert!(
        plan_intake(&db, &["logins", "revoke", "planner-a"])
            .status
            .success()
    );
    assert_eq!(who(&third), None);
    let refused = plan_intake(&db, &["logins", "rotate", "planner-a"]);
    let said = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{said}");
    assert!(refused.stdout.is_empty(), "no token for a revoked login");
    assert_eq!(said.trim().lines().count(), 1, "{said}");
    assert!(
        said.contains("revoked") && said.contains("plan-intake logins reinstate planner-a"),
        "{said}"
    );
    let listed = plan_intake(&db, &["logins", "list"]);
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.contains("\trevoked ") && !listed.contains("active"),
        "still revoked: {listed}"
    );
    assert_eq!(who(&third), None, "a revoked token never comes back");

    let fourth = token(plan_intake(&db, &["logins", "reinstate", "planner-a"]));
    assert_eq!(who(&fourth).as_deref(), Some("planner-a"));
    assert_eq!(who(&third), None, "a revoked token never comes back");
    let again = plan_intake(&db, &["logins", "reinstate", "planner-a"]);
    assert_eq!(
        again.status.code(),
        Some(1),
        "only a revoked login is reinstated"
    );

    let unknown = plan_intake(&db, &["logins", "rotate", "nobody"]);
    assert!(!unknown.status.success());
    let bad_grace = plan_intake(&db, &["logins", "rotate", "planner-a", "--grace", "soon"]);
    assert_eq!(bad_grace.status.code(), Some(2));
}

crate::on_both_backends_sync!(
    logins_rotate_keeps_the_identity_and_honours_the_grace_period,
    logins_add_prints_only_the_token_and_stores_only_its_hash,
    bad_input_is_one_line_and_a_non_zero_exit,
    serve_no_migrate_refuses_a_database_with_pending_migrations,
);

/// What a new user meets: a bare command prints its help; clap's message
/// stays whole (the missing argument named, the allowed values listed); a
/// bad address or log filter stops with exit 2, and a bad login name with
/// exit 1, before anything is opened.
/// No password reaches a log line, an error line or `--help`, whatever the
/// URL's form. (The test server trusts local connections, so a password in
/// the URL is accepted and ignored.)
#[test]
fn passwords_never_appear_in_logs_errors_or_help() {
    let Some(db) = TestDb::postgres() else {
        return;
    };
    const SECRET: &str = "s3cr3t";
    let (scheme, rest) = db.url.split_once("://").expect("a URL");
    let (user, after_user) = rest.split_once('@').expect("a user");
    let working = [
        format!("{scheme}://{user}:{SECRET}-pw@{after_user}"),
        format!("{scheme}://{user}:%73{}%2Dpw@{after_user}", &SECRET[1..]),
        format!("{}&password={SECRET}-pw", db.url),
    ];
    let unreachable = [
        format!("postgres://{user}:{SECRET}-pw@127.0.0.1:1/db"),
        format!("postgres://{user}:{SECRET}-pw@127.0.0.1:1,127.0.0.1:2/db?connect_timeout=2"),
        format!("postgres://{user}@127.0.0.1:1/db?password={SECRET}-pw"),
    ];
    let mut written = Vec::new();
    for url in working.iter().chain(&unreachable) {
        for args in [&["serve", "--help"][..], &["migrate", "status"][..]] {
            let out = crate::support::process::run_cli_at(url, args);
            written.push(format!(
                "{args:?} {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    for url in &unreachable {
        let out = crate::support::process::run_cli_at(url, &["migrate", "status"]);
        assert!(!out.status.success(), "{url} was reached");
    }
    let server = crate::support::process::ServeProcess::start(&working[0]);
    let served = server.log.lock().expect("log").join("\n");
    assert!(served.contains("plan-intake starting"), "{served}");
    written.push(served);
    for text in &written {
        assert!(
            !text.contains(SECRET) && !text.contains(&SECRET[1..]),
            "a password was written: {text}"
        );
    }
}

#[test]
fn the_command_line_explains_itself() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let dir = tempfile::tempdir().expect("dir");
        let out = Command::new(BIN)
            .args(args)
            .envs(env.iter().copied())
            .current_dir(dir.path())
            .output()
            .expect("run");
        let created = std::fs::read_dir(dir.path())
            .map(|d| d.count())
            .unwrap_or(0);
        (out, created)
    };
    for bare in [&[][..], &["migrate"][..], &["logins"][..]] {
        let (out, _) = run(bare, &[]);
        assert_eq!(out.status.code(), Some(2), "{bare:?}");
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            text.contains("Usage:") && text.contains("Commands:"),
            "{bare:?}: {text}"
        );
    }
    let (out, _) = run(&["logins", "add", "x"], &[]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--permission"));
    let (out, _) = run(&["--log-format", "yaml", "verify"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("text") && stderr.contains("json"),
        "{stderr}"
    );
    let (out, created) = run(&["serve", "--bind", "nonsense"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--bind"));
    assert_eq!(created, 0, "nothing opened for a bad address");
    let (out, created) = run(
        &["logins", "add", "bad name", "--permission", "plans:submit"],
        &[],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("login name"));
    assert_eq!(created, 0, "a refused login name creates no database");
    let (out, created) = run(&["migrate", "status"], &[("PLAN_INTAKE_LOG", "a=b=c[")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("PLAN_INTAKE_LOG"));
    assert_eq!(created, 0);
}

/// The operations guide's configuration table says what `serve --help`
/// says: the same flags, each with its environment variable and, where it
/// has one, its default. Defaults are stated once, in the code; this keeps
/// the guide from drifting from them.
#[test]
fn the_configuration_table_matches_serve_help() {
    let out = Command::new(BIN)
        .args(["serve", "--help"])
        .output()
        .expect("run");
    let help = String::from_utf8_lossy(&out.stdout);
    let from_help = options_in_help(&help);
    let guide = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/OPERATIONS.md"))
        .expect("docs/OPERATIONS.md");
    let from_guide = configuration_table(&guide);
    let flags = |options: &[HelpOption]| -> Vec<String> {
        let mut flags: Vec<String> = options.iter().map(|o| o.flag.clone()).collect();
        flags.sort();
        flags
    };
    assert_eq!(
        flags(&from_guide),
        flags(&from_help),
        "the configuration table of docs/OPERATIONS.md and `serve --help` list different flags"
    );
    for documented in &from_guide {
        let Some(actual) = from_help.iter().find(|o| o.flag == documented.flag) else {
            continue;
        };
        assert_eq!(documented.env, actual.env, "{}", documented.flag);
        if let Some(default) = &actual.default {
            assert_eq!(
                documented.default.as_ref(),
                Some(default),
                "{}: docs/OPERATIONS.md's default differs from --help",
                documented.flag
            );
        }
    }
}

#[derive(Debug)]
struct HelpOption {
    flag: String,
    env: Option<String>,
    default: Option<String>,
}

/// Each `--flag` of clap's long help with its `[env: …]` and `[default: …]`;
/// switches without an environment variable (`--no-migrate`, `--help`) are
/// left out, as the guide's table leaves them.
fn options_in_help(help: &str) -> Vec<HelpOption> {
    let mut options: Vec<HelpOption> = Vec::new();
    for line in help.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("--") {
            let name = rest.split_whitespace().next().unwrap_or_default();
            options.push(HelpOption {
                flag: format!("--{name}"),
                env: None,
                default: None,
            });
        } else if let Some(option) = options.last_mut() {
            if let Some(env) = line.strip_prefix("[env: ") {
                option.env = Some(env.trim_end_matches(['=', ']']).to_owned());
            } else if let Some(default) = line.strip_prefix("[default: ") {
                option.default = Some(default.trim_end_matches(']').to_owned());
            }
        }
    }
    options.retain(|o| o.env.is_some());
    options
}

/// The rows of the guide's `## Configuration` table that name a flag: the
/// flag, the variable, and the first `code` span of the default column.
fn configuration_table(guide: &str) -> Vec<HelpOption> {
    let section = guide
        .split("## Configuration")
        .nth(1)
        .expect("a Configuration section");
    section
        .lines()
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let code = |cell: &str| cell.split('`').nth(1).map(str::to_owned);
            let flag = code(cells.get(1)?)?;
            let env = code(cells.get(2)?);
            let default = code(cells.get(3)?);
            flag.starts_with("--")
                .then_some(HelpOption { flag, env, default })
        })
        .collect()
}

/// No database by accident: against a SQLite file that does not exist
/// (a typo), every command but `migrate run` (and `serve`) exits non-zero
/// with one line naming the path and `migrate run`, and creates nothing;
/// `migrate run` creates and migrates it.
#[test]
fn only_migrate_run_and_serve_create_a_database() {
    let dir = tempfile::tempdir().expect("temp dir");
    let typo = dir.path().join("plan-intke.db");
    let url = format!("sqlite://{}", typo.display());
    let key = crate::evidence::generate_key(dir.path(), "k");
    let keys = format!("{}.pub", key.display());
    let keys = keys.as_str();
    for args in [
        &["logins", "list"][..],
        &["logins", "add", "x", "--permission", "plans:submit"][..],
        &["logins", "revoke", "x"][..],
        &["migrate", "status"][..],
        &["migrate", "print"][..],
        &["migrate", "revert"][..],
        &["verify"][..],
        &["keys", "prune", "--older-than", "30d"][..],
        &["audit", "--keys", keys][..],
    ] {
        let out = Command::new(BIN)
            .args(args)
            .env("DATABASE_URL", &url)
            .output()
            .expect("run plan-intake");
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {said}");
        assert!(
            said.contains(&typo.display().to_string()) && said.contains("plan-intake migrate run"),
            "{args:?}: {said}"
        );
        assert_eq!(said.trim().lines().count(), 1, "{args:?}: {said}");
        assert!(!typo.exists(), "{args:?} created {}", typo.display());
    }
    let created = Command::new(BIN)
        .args(["migrate", "run"])
        .env("DATABASE_URL", &url)
        .output()
        .expect("run plan-intake");
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let listed = Command::new(BIN)
        .args(["logins", "list"])
        .env("DATABASE_URL", &url)
        .output()
        .expect("run plan-intake");
    assert!(listed.status.success() && typo.exists());
}

/// Secrets are never echoed: a private key given where public ones belong
/// (`receipts verify --keys`, `audit --keys`: both files are
/// `receipts.key*`) is refused as a private key, naming what to give
/// instead, without a character of it; a public key given to `serve
/// --signing-key` is named as one.
#[test]
fn a_key_in_the_wrong_place_is_named_never_printed() {
    let dir = tempfile::tempdir().expect("temp dir");
    let private = crate::evidence::generate_key(dir.path(), "receipts.key");
    let secret = std::fs::read_to_string(&private).expect("the private key");
    // PRIVATE+KEY+name+id+base64, whose base64 may itself hold a `+`: the
    // whole of it (its last `+`-separated piece may be a letter or two,
    // found in any message).
    let secret_part = secret
        .trim()
        .splitn(5, '+')
        .nth(4)
        .expect("the key's base64");
    let receipt = dir.path().join("r.json");
    std::fs::write(&receipt, "{}").expect("a receipt file");
    let db = TestDb::sqlite();
    let private = private.to_str().expect("utf-8 path");
    for args in [
        &[
            "receipts",
            "verify",
            receipt.to_str().expect("utf-8"),
            "--keys",
            private,
        ][..],
        &["audit", "--keys", private][..],
    ] {
        let out = plan_intake(&db, args);
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {said}");
        assert!(
            said.contains("is a private key") && said.contains(".pub"),
            "{args:?}: {said}"
        );
        for leaked in [secret_part, "PRIVATE+KEY+receipts.key"] {
            assert!(!said.contains(leaked), "{args:?} printed the key: {said}");
            assert!(!String::from_utf8_lossy(&out.stdout).contains(leaked));
        }
    }
    let public = format!("{private}.pub");
    let out = plan_intake(
        &db,
        &["serve", "--signing-key", &public, "--bind", "127.0.0.1:0"],
    );
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("public (verifier) key"), "{said}");
}

/// One log format: with `--log-format json` every line a command writes on
/// stderr is one JSON object: `submit`'s derived key, its retries and its
/// final error; `logins add`'s note; `migrate run`'s; a command line clap
/// refuses.
#[test]
fn with_json_logs_every_stderr_line_is_one_json_object() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("json.db").display());
    let request = dir.path().join("plan.json");
    std::fs::write(&request, crate::support::plan_body("run-json", "x")).expect("a request");
    let nothing_listens = format!("http://127.0.0.1:{}", crate::support::process::free_port());
    type Run<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)]);
    let runs: [Run; 4] = [
        (&["migrate", "run"], &[]),
        (
            &["logins", "add", "planner-a", "--permission", "plans:submit"],
            &[],
        ),
        (
            &[
                "submit",
                request.to_str().expect("utf-8"),
                "--max-attempts",
                "3",
                "--retry-base-ms",
                "1",
            ],
            &[
                ("PLAN_INTAKE_URL", nothing_listens.as_str()),
                ("PLAN_INTAKE_TOKEN", "pit_0"),
            ],
        ),
        (&["logins", "frobnicate"], &[]),
    ];
    for (args, env) in runs {
        let out = Command::new(BIN)
            .args(args)
            .arg("--log-format")
            .arg("json")
            .env("DATABASE_URL", &url)
            .envs(env.iter().copied())
            .output()
            .expect("run plan-intake");
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!said.trim().is_empty(), "{args:?} said nothing");
        for line in said.lines() {
            let object: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|_| panic!("{args:?}: not one JSON object: {line:?}"));
            assert!(
                object["level"].is_string() && object.get("timestamp").is_some(),
                "{args:?}: {line}"
            );
        }
        if args[0] == "submit" {
            assert!(said.contains("idempotency-key: submit-"), "{said}");
            assert!(said.contains("\"exit\":75"), "{said}");
        }
    }
}

/// Every positional argument of every command has a help text, and a
/// listing cut short by its reader (`migrate print | head`) ends quietly.
#[test]
fn every_argument_is_explained_and_a_listing_cut_short_ends_quietly() {
    let commands: [&[&str]; 10] = [
        &["submit"],
        &["receipts", "verify"],
        &["logins", "add"],
        &["logins", "revoke"],
        &["logins", "rotate"],
        &["logins", "reinstate"],
        &["migrate", "grants"],
        &["keys", "prune"],
        &["follow"],
        &["audit"],
    ];
    for command in commands {
        let out = Command::new(BIN)
            .args(command)
            .arg("-h")
            .output()
            .expect("run -h");
        let help = String::from_utf8_lossy(&out.stdout);
        let arguments = help
            .split_once("Arguments:\n")
            .map(|(_, rest)| rest.split("\n\n").next().unwrap_or_default());
        for line in arguments.unwrap_or_default().lines() {
            let explained = line
                .trim()
                .split_once("  ")
                .is_some_and(|(_, text)| !text.trim().is_empty());
            assert!(explained, "{command:?}: no help for {line:?}");
        }
    }

    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("cut.db").display());
    std::fs::File::create(dir.path().join("cut.db")).expect("an empty database");
    let printed = Command::new("bash")
        .args([
            "-c",
            r#"set -o pipefail; "$0" migrate print 2>"$1" | head -n 1 >/dev/null; echo $?"#,
            BIN,
            dir.path().join("stderr").to_str().expect("utf-8"),
        ])
        .env("DATABASE_URL", &url)
        .output()
        .expect("run migrate print | head");
    let said = std::fs::read_to_string(dir.path().join("stderr")).unwrap_or_default();
    assert_eq!(said, "", "migrate print | head says nothing");
    assert_eq!(
        String::from_utf8_lossy(&printed.stdout).trim(),
        "0",
        "migrate print | head exits 0"
    );
}
