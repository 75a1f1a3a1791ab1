//! Real OS processes: a service killed with SIGKILL under load, and two
//! services racing for one key on one Postgres.

use std::collections::HashMap;
use std::thread;

use plan_intake::intake::Permission;

use crate::support::load::{Load, Sent};
use crate::support::process::{ServeProcess, client, post_plan};
use crate::support::{TestApp, TestDb, plan_body, scalar};

const CLIENTS: usize = 8;

fn kill_9_under_load_then_restart_keeps_every_receipt_once(scratch: TestDb) {
    let url = scratch.url.clone();
    let app = TestApp::new(scratch);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let server = ServeProcess::start(&url);

    let load = Load::start(CLIENTS, &token, |_| server.addr.clone());
    // Kill while every client is mid-stream: after enough plans are in.
    load.wait_for_created(60);
    server.kill_9();
    let sent = load.stop();
    let unexpected: Vec<&(u16, serde_json::Value)> = sent
        .iter()
        .filter_map(|s| s.answer.as_ref())
        .filter(|(status, _)| *status != 201)
        .collect();
    assert!(
        unexpected.is_empty(),
        "answers other than 201: {unexpected:?}"
    );

    let mut conn = app.conn();
    for s in sent.iter().filter_map(Sent::created_receipt) {
        assert!(
            app.stored(s).is_some(),
            "receipt {s} was answered 201 but is not in the database"
        );
    }
    let orphans = scalar(
        &mut conn,
        "SELECT COUNT(*) AS n FROM plans p WHERE NOT EXISTS (SELECT 1 FROM intake_keys k WHERE k.plan_id = p.id)",
    );
    assert_eq!(orphans, 0, "a plan lacks its key row");

    let restarted = ServeProcess::start(&url);
    let agent = client();
    for s in &sent {
        let (status, receipt) =
            post_plan(&agent, &restarted.addr, &token, &s.key, &s.body).expect("answer");
        assert!(
            status == 201 || status == 200,
            "resend of {} got {status}: {receipt}",
            s.key
        );
        if let Some(original) = s.created_receipt() {
            assert_eq!(status, 200, "{} was created twice", s.key);
            assert_eq!(receipt["receipt_id"], original);
        }
    }
    assert_eq!(app.count("plans"), sent.len() as i64, "one plan per run");
    let duplicated_runs = scalar(
        &mut conn,
        "SELECT COUNT(*) AS n FROM (SELECT run_id FROM plans GROUP BY run_id HAVING COUNT(*) > 1) d",
    );
    assert_eq!(duplicated_runs, 0);
}

#[test]
fn kill_9_under_load_on_sqlite() {
    kill_9_under_load_then_restart_keeps_every_receipt_once(TestDb::sqlite());
}

#[test]
fn kill_9_under_load_on_postgres() {
    if let Some(db) = TestDb::postgres() {
        kill_9_under_load_then_restart_keeps_every_receipt_once(db);
    }
}

#[test]
fn two_services_on_one_postgres_keep_one_plan_for_one_key() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let url = scratch.url.clone();
    let app = TestApp::new(scratch);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let servers = [ServeProcess::start(&url), ServeProcess::start(&url)];
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let body = plan_body("run-1", "x");

    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (addrs, token, body) = (addrs.clone(), token.clone(), body.clone());
            thread::spawn(move || {
                let agent = client();
                (0..200 / CLIENTS)
                    .map(|i| {
                        let addr = &addrs[(c + i) % 2];
                        post_plan(&agent, addr, &token, "one-key", &body).expect("answer")
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let answers: Vec<_> = clients
        .into_iter()
        .flat_map(|c| c.join().expect("client"))
        .collect();

    assert_eq!(answers.len(), 200);
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    for (status, _) in &answers {
        *statuses.entry(*status).or_default() += 1;
    }
    assert_eq!(statuses.get(&201), Some(&1), "{statuses:?}");
    assert_eq!(statuses.get(&200), Some(&199), "{statuses:?}");
    let receipts: std::collections::HashSet<_> = answers
        .iter()
        .map(|(_, r)| r["receipt_id"].to_string())
        .collect();
    assert_eq!(receipts.len(), 1);
    app.assert_rows(1, 1);
}
