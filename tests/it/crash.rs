//! A Postgres crash under load: the server (a cluster of the test's own) is
//! restarted in immediate mode five times while 8 clients write through one
//! running service. Every answer is 201, 200 or 503; every 201 is durable;
//! without restarting the service, every request retried with its key
//! lands exactly once; no plan is without its key.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::Duration;

use diesel::{Connection, PgConnection};
use plan_intake::storage::DbConn;

use crate::support::cluster::TempCluster;
use crate::support::process::{ServeProcess, client, post_plan, run_cli_at};
use crate::support::{plan_body, scalar, stored_receipt_ids};

const CLIENTS: usize = 8;
const CRASHES: usize = 5;

struct Sent {
    key: String,
    body: String,
    status: u16,
    receipt: Option<String>,
}

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

    let answered = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (addr, token) = (service.addr.clone(), token.clone());
            let (answered, stop) = (Arc::clone(&answered), Arc::clone(&stop));
            thread::spawn(move || {
                let agent = client();
                let mut sent = Vec::new();
                for i in 0.. {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let key = format!("k-{c}-{i}");
                    let body = plan_body(&format!("run-{c}-{i}"), "x");
                    let (status, answer) =
                        post_plan(&agent, &addr, &token, &key, &body).expect("the service answers");
                    answered.fetch_add(1, Ordering::SeqCst);
                    let receipt = answer["receipt_id"].as_str().map(str::to_owned);
                    sent.push(Sent {
                        key,
                        body,
                        status,
                        receipt,
                    });
                }
                sent
            })
        })
        .collect();

    for _ in 0..CRASHES {
        let before = answered.load(Ordering::SeqCst);
        while answered.load(Ordering::SeqCst) < before + 40 {
            thread::sleep(Duration::from_millis(5));
        }
        cluster.restart_immediate();
    }
    let until = answered.load(Ordering::SeqCst) + 40;
    while answered.load(Ordering::SeqCst) < until {
        thread::sleep(Duration::from_millis(5));
    }
    stop.store(true, Ordering::SeqCst);
    let sent: Vec<Sent> = clients
        .into_iter()
        .flat_map(|c| c.join().expect("client thread"))
        .collect();

    let statuses: HashSet<u16> = sent.iter().map(|s| s.status).collect();
    assert!(
        statuses.iter().all(|s| [200, 201, 503].contains(s)),
        "answers other than 201/200/503: {statuses:?}"
    );
    let mut conn = DbConn::Postgres(PgConnection::establish(&url).expect("connect"));
    let stored = stored_receipt_ids(&mut conn);
    for s in sent.iter().filter(|s| s.status == 201) {
        let receipt = s.receipt.as_deref().unwrap_or_default();
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
                    let mut attempts = 0;
                    let (status, answer) = loop {
                        let (status, answer) =
                            post_plan(&agent, &addr, &token, &s.key, &s.body).expect("answer");
                        attempts += 1;
                        if status != 503 || attempts == 50 {
                            break (status, answer);
                        }
                        thread::sleep(Duration::from_millis(100));
                    };
                    assert!([200, 201].contains(&status), "{}: {status} {answer}", s.key);
                    if s.status == 201 {
                        assert_eq!(
                            answer["receipt_id"].as_str(),
                            s.receipt.as_deref(),
                            "{}",
                            s.key
                        );
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
    let by_status = |code| sent.iter().filter(|s| s.status == code).count();
    eprintln!(
        "crash test: {} requests, {} × 201, {} × 503 during {CRASHES} crashes",
        sent.len(),
        by_status(201),
        by_status(503)
    );
    drop(service);
}
