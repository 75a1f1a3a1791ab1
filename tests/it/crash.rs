//! A Postgres crash under load: the server (a cluster of the test's own) is
//! restarted in immediate mode five times while 8 clients write through one
//! running service. Every answer is 201, 200 or 503; every 201 is durable;
//! without restarting the service, every request retried with its key
//! lands exactly once; no plan is without its key.

use crate::support::cluster::TempCluster;
use crate::support::load::{Load, assert_each_answered, every_acknowledged_plan_is_kept_once};
use crate::support::process::{ServeProcess, login_via_cli};

const CLIENTS: usize = 8;
const CRASHES: usize = 5;

#[test]
fn postgres_restarted_in_immediate_mode_under_load_keeps_every_receipt_once() {
    let Some(cluster) = TempCluster::create() else {
        return;
    };
    let url = cluster.url("postgres");
    let service = ServeProcess::start_with(&url, &["--request-timeout-ms", "3000"]);
    let token = login_via_cli(&url, "planner-a", "plans:submit");

    let load = Load::start(CLIENTS, &token, |_| service.addr.clone());
    for _ in 0..CRASHES {
        load.wait_for_answers(40);
        cluster.restart_immediate();
    }
    load.wait_for_answers(40);
    let sent = load.stop();

    assert_each_answered(&sent, &[200, 201, 503]);
    let sent = every_acknowledged_plan_is_kept_once(sent, &url, &service.addr, &token, CLIENTS);
    let by_status = |code| sent.iter().filter(|s| s.status() == Some(code)).count();
    eprintln!(
        "crash test: {} requests, {} × 201, {} × 503 during {CRASHES} crashes",
        sent.len(),
        by_status(201),
        by_status(503)
    );
    drop(service);
}
