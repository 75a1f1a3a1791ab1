//! Least privilege: migrations and logins by the owner, the service as a
//! role holding only what `plan-intake migrate grants ROLE` prints, with
//! `PUBLIC`'s CREATE on the schema revoked. Everything the running service
//! does works; whatever would change the schema or the logins is refused in
//! one clear line.

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};

use crate::support::process::{ServeProcess, client, get, post_plan, run_cli, run_cli_at};
use crate::support::{TestDb, plan_body, postgres_base_url};

/// A login role of the cluster, dropped (after the scratch schema that held
/// its grants) when the test ends.
struct Role(String);

impl Drop for Role {
    fn drop(&mut self) {
        if let Ok(mut admin) = PgConnection::establish(&postgres_base_url()) {
            let _ = admin.batch_execute(&format!(
                "DROP OWNED BY {0}; DROP ROLE IF EXISTS {0}",
                self.0
            ));
        }
    }
}

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).trim().to_owned()
}

#[test]
fn the_service_runs_as_a_role_that_may_only_read_and_write_rows() {
    let role = Role(format!("pi_service_{:08x}", rand::random::<u32>()));
    let Some(db) = TestDb::postgres() else {
        return;
    };
    let schema = db.schema.clone().expect("schema");
    drop(db.open()); // the owner migrates
    let mut admin = PgConnection::establish(&postgres_base_url()).expect("connect");
    admin
        .batch_execute(&format!(
            "CREATE ROLE {0} LOGIN; REVOKE CREATE ON SCHEMA {schema} FROM PUBLIC;",
            role.0
        ))
        .expect("create the service role");

    let grants = run_cli(&db, &["migrate", "grants", &role.0]);
    assert!(grants.status.success(), "{}", stderr(&grants));
    let statements = stdout(&grants);
    // Rows are only added, but for the receipt log's one state row and
    // the signing keys' times of use.
    let updates: Vec<&str> = statements
        .lines()
        .filter(|l| l.contains("UPDATE"))
        .collect();
    assert!(
        !statements.contains("ALL")
            && !statements.contains("DELETE")
            && updates.len() == 2
            && updates[0].contains(".receipt_log_state TO")
            && updates[1].contains(".signing_keys TO"),
        "{statements}"
    );
    admin
        .batch_execute(&statements)
        .expect("the printed grants apply");

    let planner = run_cli(
        &db,
        &["logins", "add", "planner-a", "--permission", "plans:submit"],
    );
    let orders = run_cli(
        &db,
        &["logins", "add", "orders", "--permission", "receipts:read"],
    );
    let (planner, orders) = (stdout(&planner), stdout(&orders));

    let as_service = db.url.replacen("postgres@", &format!("{}@", role.0), 1);
    assert_ne!(as_service, db.url);
    let keys = tempfile::tempdir().expect("temp dir");
    let key = keys.path().join("k1");
    let key = key.to_str().expect("utf-8 path");
    let made = run_cli(&db, &["signing-keys", "generate", "--out", key]);
    assert!(made.status.success(), "{}", stderr(&made));
    let service = ServeProcess::start_with(&as_service, &["--no-migrate", "--signing-key", key]);
    let agent = client();
    let addr = &service.addr;
    assert_eq!(get(&agent, addr, "", "/readyz").0, 200);
    let body = plan_body("run-1", "x");
    let (created, receipt) = post_plan(&agent, addr, &planner, "k1", &body).expect("answer");
    assert_eq!(created, 201, "{receipt}");
    let (replayed, again) = post_plan(&agent, addr, &planner, "k1", &body).expect("answer");
    assert_eq!(
        (replayed, &again["receipt_id"]),
        (200, &receipt["receipt_id"])
    );
    let id = receipt["receipt_id"].as_str().unwrap_or_default();
    assert_eq!(
        get(&agent, addr, &planner, &format!("/v1/receipts/{id}")).0,
        200
    );
    assert_eq!(
        get(&agent, addr, &orders, &format!("/v1/plans/{id}")).0,
        200
    );
    let (status, page) = get(&agent, addr, &orders, "/v1/receipts");
    assert_eq!(status, 200);
    assert_eq!(page["receipts"].as_array().map(Vec::len), Some(1));
    // The role appends the receipt log (its proof is served), and cannot
    // change what was appended.
    let proof_path = format!("/v1/receipts/{id}/proof");
    let start = std::time::Instant::now();
    while get(&agent, addr, &planner, &proof_path).0 != 200 {
        assert!(
            start.elapsed().as_secs() < 30,
            "the receipt was never logged"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let mut as_role = PgConnection::establish(&as_service).expect("connect as the role");
    for tamper in [
        "UPDATE receipt_log SET leaf_hash = leaf_hash",
        "DELETE FROM receipt_log_checkpoints",
        "UPDATE plans SET content = content",
    ] {
        assert!(
            as_role.batch_execute(tamper).is_err(),
            "the role may: {tamper}"
        );
    }

    // Read-only commands work as the role; changing ones are refused clearly.
    let status = run_cli_at(&as_service, &["migrate", "status"]);
    assert!(status.status.success(), "{}", stderr(&status));
    let verify_free = run_cli_at(&as_service, &["migrate", "run"]);
    assert!(
        verify_free.status.success(),
        "nothing pending: {}",
        stderr(&verify_free)
    );
    // verify reads as the role; only its trial store, a schema of its own,
    // needs a privilege the role lacks, and it says so in its line.
    let verified = run_cli_at(&as_service, &["verify"]);
    assert!(!verified.status.success());
    let report = stdout(&verified);
    let failing: Vec<&str> = report.lines().filter(|l| l.starts_with("FAIL")).collect();
    assert_eq!(failing.len(), 1, "{report}");
    assert!(
        failing[0].contains("cannot create a scratch schema"),
        "{report}"
    );
    assert!(
        report.contains("ok    migrations applied") && report.contains("ok    pinned names"),
        "{report}"
    );
    for args in [
        &["logins", "add", "x", "--permission", "plans:submit"][..],
        &["logins", "revoke", "planner-a"][..],
        &["logins", "rotate", "planner-a"][..],
        &["logins", "reinstate", "planner-a"][..],
        &["migrate", "revert"][..],
    ] {
        let refused = run_cli_at(&as_service, args);
        assert!(
            !refused.status.success(),
            "{args:?} succeeded as the service role"
        );
        let line = stderr(&refused);
        assert_eq!(line.lines().count(), 1, "{line}");
        assert!(line.contains("needs the owner"), "{line}");
    }

    // The last migration drops the receipt log, which holds a leaf now.
    let revert = run_cli(&db, &["migrate", "revert", "--yes"]);
    assert!(revert.status.success(), "{}", stderr(&revert));
    let refused = run_cli_at(&as_service, &["migrate", "run"]);
    assert!(!refused.status.success());
    let line = stderr(&refused);
    assert!(
        line.contains("needs the owner") && line.lines().count() == 1,
        "{line}"
    );
    let not_ready = run_cli_at(
        &as_service,
        &["serve", "--no-migrate", "--bind", "127.0.0.1:0"],
    );
    assert!(
        stderr(&not_ready).contains("pending"),
        "{}",
        stderr(&not_ready)
    );
    drop(service);
}

/// `keys prune` runs as a role holding the service's grants and the one
/// `migrate grants ROLE --pruner` prints; without it, the delete is refused.
#[test]
fn keys_prune_runs_as_a_role_with_the_pruner_grant() {
    let role = Role(format!("pi_pruner_{:08x}", rand::random::<u32>()));
    let Some(db) = TestDb::postgres() else {
        return;
    };
    drop(db.open());
    let mut admin = PgConnection::establish(&postgres_base_url()).expect("connect");
    admin
        .batch_execute(&format!("CREATE ROLE {0} LOGIN", role.0))
        .expect("create the role");
    let service_grants = run_cli(&db, &["migrate", "grants", &role.0]);
    admin
        .batch_execute(&stdout(&service_grants))
        .expect("the service's grants apply");
    let as_role = db.url.replacen("postgres@", &format!("{}@", role.0), 1);
    let token = stdout(&run_cli(
        &db,
        &["logins", "add", "planner-a", "--permission", "plans:submit"],
    ));
    let service = ServeProcess::start_with(&as_role, &["--no-migrate"]);
    let (status, _) = post_plan(
        &client(),
        &service.addr,
        &token,
        "k1",
        &plan_body("run-1", "x"),
    )
    .expect("answer");
    assert_eq!(status, 201);

    let refused = run_cli_at(
        &as_role,
        &[
            "keys",
            "prune",
            "--older-than",
            "0s",
            "--allow-short-retention",
        ],
    );
    assert!(!refused.status.success(), "pruned without the grant");
    assert_eq!(stderr(&refused).lines().count(), 1, "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains(&format!("plan-intake migrate grants {} --pruner", role.0)),
        "the refusal names the grant that fixes it: {}",
        stderr(&refused)
    );

    let grant = run_cli(&db, &["migrate", "grants", &role.0, "--pruner"]);
    let grant = stdout(&grant);
    assert_eq!(grant.lines().count(), 1, "{grant}");
    assert!(
        grant.contains("DELETE") && grant.contains("intake_keys"),
        "{grant}"
    );
    admin
        .batch_execute(&grant)
        .expect("the pruner grant applies");
    let pruned = run_cli_at(
        &as_role,
        &[
            "keys",
            "prune",
            "--older-than",
            "0s",
            "--allow-short-retention",
        ],
    );
    assert!(pruned.status.success(), "{}", stderr(&pruned));
    assert_eq!(stderr(&pruned), "deleted 1 idempotency keys");
}

/// An upgrade that adds tables, run by the owner while the service's role
/// keeps the grants of the release before: the service refuses to start,
/// naming each privilege it lacks, on which table, and the `migrate
/// grants` line that gives them. Once they are given it starts; a grant
/// taken back under the live service makes it not ready (503
/// `missing-grants`, the same words), and a request that needs it says
/// permission, not an unavailable database; given back, it is ready again.
#[test]
fn an_upgrade_without_new_grants_is_not_ready_and_says_which() {
    let role = Role(format!("pi_upgrade_{:08x}", rand::random::<u32>()));
    let Some(db) = TestDb::postgres() else {
        return;
    };
    drop(db.open());
    // The release before the receipt log: its last two migrations reverted.
    for _ in 0..2 {
        let reverted = run_cli(&db, &["migrate", "revert", "--yes"]);
        assert!(reverted.status.success(), "{}", stderr(&reverted));
    }
    let mut admin = PgConnection::establish(&postgres_base_url()).expect("connect");
    admin
        .batch_execute(&format!("CREATE ROLE {0} LOGIN", role.0))
        .expect("create the role");
    // What that release printed: this one's grants but for the tables it
    // did not have yet.
    let old_grants: Vec<String> = stdout(&run_cli(&db, &["migrate", "grants", &role.0]))
        .lines()
        .filter(|grant| !grant.contains("receipt_log") && !grant.contains("signing_keys"))
        .map(str::to_owned)
        .collect();
    admin
        .batch_execute(&old_grants.join("\n"))
        .expect("the old release's grants apply");
    let upgraded = run_cli(&db, &["migrate", "run"]);
    assert!(upgraded.status.success(), "{}", stderr(&upgraded));

    let keys = tempfile::tempdir().expect("temp dir");
    let key = crate::evidence::generate_key(keys.path(), "upgrade");
    let as_role = db.url.replacen("postgres@", &format!("{}@", role.0), 1);
    let serve_args = [
        "--no-migrate",
        "--signing-key",
        key.to_str().expect("utf-8"),
    ];
    let refused = run_cli_at(
        &as_role,
        &[&["serve", "--bind", "127.0.0.1:0"][..], &serve_args[..]].concat(),
    );
    let said = stderr(&refused);
    assert!(!refused.status.success(), "it started: {said}");
    assert!(
        said.contains("INSERT on receipt_log")
            && said.contains(&format!("plan-intake migrate grants {}", role.0)),
        "{said}"
    );

    let grants = stdout(&run_cli(&db, &["migrate", "grants", &role.0]));
    admin
        .batch_execute(&grants)
        .expect("the new release's grants apply");
    let service = ServeProcess::start_with(&as_role, &serve_args);
    let agent = client();
    assert_eq!(get(&agent, &service.addr, "-", "/readyz").0, 200);

    let table = format!("{}.signing_keys", db.schema.clone().expect("schema"));
    admin
        .batch_execute(&format!("REVOKE SELECT ON TABLE {table} FROM {}", role.0))
        .expect("revoke");
    let operator = crate::support::process::login_via_cli(&db.url, "operator", "receipts:read");
    let (status, ready) = get(&agent, &service.addr, &operator, "/readyz");
    assert_eq!(status, 503, "{ready}");
    let detail = ready["detail"].as_str().unwrap_or_default();
    assert!(
        ready["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("/missing-grants"))
            && detail.contains("SELECT on signing_keys")
            && detail.contains(&format!("plan-intake migrate grants {}", role.0)),
        "{ready}"
    );
    let (status, keys_answer) = get(&agent, &service.addr, "-", "/v1/signing-keys");
    assert_eq!(status, 503, "{keys_answer}");
    assert!(
        keys_answer["detail"]
            .as_str()
            .is_some_and(|d| d.contains("permission")),
        "{keys_answer}"
    );
    admin.batch_execute(&grants).expect("the grants again");
    let (status, ready) = get(&agent, &service.addr, "-", "/readyz");
    assert_eq!(status, 200, "{ready}");
}
