//! A Postgres crash under load: the server (a cluster of the test's own) is
//! restarted in immediate mode five times while 8 clients write through one
//! running service. Every answer is 201, 200 or 503; every 201 is durable;
//! without restarting the service, every request retried with its key
//! lands exactly once; no plan is without its key.

use std::sync::Arc;
use std::thread;

use diesel::{Connection, PgConnection};
use plan_intake::storage::DbConn;

use crate::support::cluster::TempCluster;
use crate::support::load::{Load, Sent, assert_each_answered, resend};
use crate::support::process::{ServeProcess, client, run_cli_at};
use crate::support::{scalar, stored_receipt_ids};

const CLIENTS: usize = 8;
const CRASHES: usize = 5;

#[test]
fn postgres_restarted_in_immediate_mode_under_load_keeps_every_receipt_once() {
    let Some(cluster) = TempCluster::create() else {
        return;
    };
    let url = cluster.url("postgres");
    let service = ServeProcess::start_with(&url, &["--request-timeout-ms", "3000"]);
    let token = run_cli_at(
        &url,
        &["logins", "add", "planner-a", "--permission", "plans:submit"],
    );
    let token = String::from_utf8_lossy(&token.stdout).trim().to_owned();

    let load = Load::start(CLIENTS, &token, |_| service.addr.clone());
    for _ in 0..CRASHES {
        load.wait_for_answers(40);
        cluster.restart_immediate();
    }
    load.wait_for_answers(40);
    let sent = load.stop();

    assert_each_answered(&sent, &[200, 201, 503]);
    let mut conn = DbConn::Postgres(PgConnection::establish(&url).expect("connect"));
    let stored = stored_receipt_ids(&mut conn);
    for receipt in sent.iter().filter_map(Sent::created_receipt) {
        assert!(stored.contains(receipt), "a 201 was lost: {receipt}");
    }

    // The same service, every request again with its key, until it lands
    // (8 clients at once, as before).
    let sent = Arc::new(sent);
    let resenders: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (sent, addr, token) = (Arc::clone(&sent), service.addr.clone(), token.clone());
            thread::spawn(move || {
                let agent = client();
                for s in sent.iter().skip(c).step_by(CLIENTS) {
                    let (status, answer) = resend(&agent, &addr, &token, s);
                    assert!([200, 201].contains(&status), "{}: {status} {answer}", s.key);
                    if let Some(receipt) = s.created_receipt() {
                        assert_eq!(answer["receipt_id"].as_str(), Some(receipt), "{}", s.key);
                    }
                }
            })
        })
        .collect();
    for resender in resenders {
        resender.join().expect("every retry lands");
    }
    let plans = scalar(&mut conn, "SELECT COUNT(*) AS n FROM plans");
    assert_eq!(plans, sent.len() as i64, "one plan per key");
    let keyless = scalar(
        &mut conn,
        "SELECT COUNT(*) AS n FROM plans p WHERE NOT EXISTS (SELECT 1 FROM intake_keys k WHERE k.plan_id = p.id)",
    );
    assert_eq!(keyless, 0, "a plan without its key");
    let by_status = |code| sent.iter().filter(|s| s.status() == Some(code)).count();
    eprintln!(
        "crash test: {} requests, {} × 201, {} × 503 during {CRASHES} crashes",
        sent.len(),
        by_status(201),
        by_status(503)
    );
    drop(service);
}
