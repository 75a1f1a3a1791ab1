//! Failover, on a primary and a standby of the test's own (`pg_basebackup
//! -R`), the service on a libpq multi-host URL with
//! `target_session_attrs=read-write`, never restarted:
//!
//! - to a synchronous standby under 8-way load: every answer is 201, 200 or
//!   503, every 201 is on the new primary, every request resent with its
//!   key lands exactly once, no plan is without its key;
//! - to an asynchronous standby that was behind: what it never received is
//!   lost (that is asynchronous replication), but a reader whose cursor
//!   came from the old primary sees every receipt written after;
//! - and, without a failover, behind a transaction-mode PgBouncer: replays
//!   and feed pages still wait for the synchronous standby's word.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::cluster::TempCluster;
use crate::support::load::{Load, assert_each_answered, every_acknowledged_plan_is_kept_once};
use crate::support::pgbouncer::PgBouncer;
use crate::support::plan_body;
use crate::support::process::{ServeProcess, client, get, login_via_cli, post_plan, run_cli_at};

const CLIENTS: usize = 8;
/// The `application_name` of the service's replication barrier sessions.
const BARRIER_NAME: &str = "plan-intake-replication-barrier";

/// A primary with a database `intake`, and its streaming standby.
fn pair() -> Option<(TempCluster, TempCluster)> {
    let primary = TempCluster::create()?;
    primary.psql("CREATE DATABASE intake");
    let standby = TempCluster::standby_of(&primary);
    wait_for(
        &primary,
        "SELECT COUNT(*) FROM pg_stat_replication WHERE state = 'streaming'",
        "1",
    );
    Some((primary, standby))
}

/// A pair whose standby is synchronous (`synchronous_standby_names = '*'`),
/// a planner's token and a service on both, deadline 3 s.
struct SyncPair {
    primary: TempCluster,
    standby: TempCluster,
    url: String,
    token: String,
    service: ServeProcess,
}

fn sync_pair() -> Option<SyncPair> {
    let (primary, standby) = pair()?;
    make_synchronous(&primary);
    let url = multi_host_url(&primary, &standby);
    let token = login_via_cli(&url, "planner-a", "plans:submit");
    let service = ServeProcess::start_with(&url, &["--request-timeout-ms", "3000"]);
    Some(SyncPair {
        primary,
        standby,
        url,
        token,
        service,
    })
}

/// Makes `primary`'s standby synchronous and waits until it is.
fn make_synchronous(primary: &TempCluster) {
    primary.psql("ALTER SYSTEM SET synchronous_standby_names = '*'");
    primary.psql("SELECT pg_reload_conf()");
    wait_for(
        primary,
        "SELECT string_agg(sync_state, ',') FROM pg_stat_replication",
        "sync",
    );
}

/// Polls `sql` on `cluster` until it answers `expected`.
#[track_caller]
fn wait_for(cluster: &TempCluster, sql: &str, expected: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        // A server restarting its recovery refuses connections meanwhile.
        let answer = cluster.try_psql_in("postgres", sql);
        if answer.as_deref() == Ok(expected) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "`{sql}` still answers {answer:?}, not {expected:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn multi_host_url(primary: &TempCluster, standby: &TempCluster) -> String {
    format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/intake?target_session_attrs=read-write",
        primary.port, standby.port
    )
}

#[test]
fn a_failover_to_a_synchronous_standby_keeps_every_acknowledged_plan() {
    let Some(SyncPair {
        primary,
        standby,
        url,
        token,
        service,
    }) = sync_pair()
    else {
        return;
    };
    assert_durability_told(&service, true);

    let load = Load::start(CLIENTS, &token, |_| service.addr.clone());
    load.wait_for_created(200);
    primary
        .ctl(&["stop", "-m", "immediate"])
        .expect("stop the primary");
    standby.ctl(&["promote"]).expect("promote the standby");
    // The same service goes on writing on the new primary.
    load.wait_for_created(400);
    let sent = load.stop();

    assert_each_answered(&sent, &[200, 201, 503]);
    let new_primary = standby.url("intake");
    every_acknowledged_plan_is_kept_once(sent, &new_primary, &service.addr, &token, CLIENTS);
    // The command line takes the same multi-host URL, the first host now down.
    for command in [
        &["verify"][..],
        &["migrate", "status"],
        &["keys", "prune", "--older-than", "3d"],
    ] {
        let out = run_cli_at(&url, command);
        assert!(
            out.status.success(),
            "{command:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Whether acknowledged commits wait for a standby, as `serve` logged it
/// at start, `/readyz` says it and the gauge shows it.
#[track_caller]
fn assert_durability_told(service: &ServeProcess, waits: bool) {
    let warned = service.log.lock().expect("log").iter().any(|line| {
        line.contains("WARN") && line.contains("a failover may lose acknowledged plans")
    });
    assert_eq!(warned, !waits, "the warning at start");
    let (status, ready) = get(&client(), &service.addr, "", "/readyz");
    assert_eq!(status, 200, "{ready}");
    assert_eq!(ready["commit_waits_for_standby"], waits, "{ready}");
    assert_eq!(ready.get("warning").is_some(), !waits, "{ready}");
    let metrics = service.metrics_text();
    let gauge = format!("plan_intake_commit_waits_for_standby {}", u8::from(waits));
    assert!(metrics.lines().any(|l| l == gauge), "no `{gauge}`");
}

/// GETs `path` until it is not a 503 (the service finding the new primary).
fn get_through_failover(addr: &str, token: &str, path: &str) -> Value {
    let agent = client();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, body) = get(&agent, addr, token, path);
        if status == 200 {
            return body;
        }
        assert!(
            status == 503 && Instant::now() < deadline,
            "{path}: {status} {body}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// POSTs `body` under `key` until the answer is neither a 503 nor no
/// answer at all (the service finding the new primary), for up to 60 s.
fn post_through_failover(addr: &str, token: &str, key: &str, body: &str) -> (u16, Value) {
    let agent = client();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match post_plan(&agent, addr, token, key, body) {
            Ok((503, _)) | Err(_) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            other => return other.expect("an answer within 60 s"),
        }
    }
}

/// A new plan of run `run` (its key too), answered 201; its receipt id.
fn create_through_failover(addr: &str, token: &str, run: &str) -> String {
    let (status, receipt) = post_through_failover(addr, token, run, &plan_body(run, run));
    assert_eq!(status, 201, "{run}: {receipt}");
    receipt["receipt_id"].as_str().expect("id").to_owned()
}

/// Reads from `cursor` (`None`: the start) to the feed's current end; the
/// receipt ids and the cursor there.
fn read_to_end(addr: &str, token: &str, cursor: Option<String>) -> (Vec<String>, String) {
    let mut seen = Vec::new();
    let mut path = "/v1/receipts?limit=100".to_owned();
    if let Some(cursor) = cursor {
        path.push_str(&format!("&after={cursor}"));
    }
    loop {
        let page = get_through_failover(addr, token, &path);
        let receipts = page["receipts"].as_array().expect("receipts").clone();
        let cursor = page["next"].as_str().expect("next").to_owned();
        if receipts.is_empty() {
            return (seen, cursor);
        }
        path = format!("/v1/receipts?limit=100&after={cursor}");
        seen.extend(
            receipts
                .iter()
                .map(|r| r["receipt_id"].as_str().expect("id").to_owned()),
        );
    }
}

#[test]
fn after_a_failover_to_a_standby_that_was_behind_the_feed_skips_nothing_new() {
    let Some((primary, standby)) = pair() else {
        return;
    };
    let url = multi_host_url(&primary, &standby);
    let planner = login_via_cli(&url, "planner-a", "plans:submit");
    let reader = login_via_cli(&url, "orders", "receipts:read");
    let service = ServeProcess::start(&url);
    assert_durability_told(&service, false);
    for i in 0..20 {
        create_through_failover(&service.addr, &planner, &format!("replicated-{i}"));
    }
    wait_for(
        &primary,
        "SELECT bool_and(replay_lsn >= pg_current_wal_lsn()) FROM pg_stat_replication",
        "t",
    );
    // The standby stops receiving; the primary writes on, and more xids go by.
    standby.ctl(&["stop"]).expect("stop the standby");
    for i in 0..30 {
        create_through_failover(&service.addr, &planner, &format!("lost-{i}"));
    }
    let (read, cursor) = read_to_end(&service.addr, &reader, None);
    assert_eq!(read.len(), 50, "the reader reached the old primary's end");

    primary
        .ctl(&["stop", "-m", "immediate"])
        .expect("stop the primary");
    standby.ctl(&["start"]).expect("start the standby");
    standby.ctl(&["promote"]).expect("promote the standby");
    // Before the new timeline's first write, the reader's cursor (past
    // what the standby kept) is placed, not refused: nothing to read yet.
    let (before, _) = read_to_end(&service.addr, &reader, Some(cursor.clone()));
    assert!(before.is_empty(), "{before:?}");
    let written: Vec<String> = (0..40)
        .map(|i| create_through_failover(&service.addr, &planner, &format!("after-{i}")))
        .collect();

    let (after, _) = read_to_end(&service.addr, &reader, Some(cursor));
    let after: HashSet<String> = after.into_iter().collect();
    let missed: Vec<&String> = written.iter().filter(|id| !after.contains(*id)).collect();
    assert!(
        missed.is_empty(),
        "{} of the {} receipts written after the failover were skipped",
        missed.len(),
        written.len()
    );
}

/// A primary fenced read-only (`default_transaction_read_only`, as a
/// failover manager does before promoting), and its standby promoted: the
/// service's pooled connections to the fenced node answer 25006; each is
/// discarded and the write goes on at once on a new connection, which
/// `target_session_attrs=read-write` takes to the new primary. Not one 503.
#[test]
fn pooled_connections_to_a_primary_turned_read_only_are_discarded() {
    let Some((primary, standby)) = pair() else {
        return;
    };
    let url = multi_host_url(&primary, &standby);
    let token = login_via_cli(&url, "planner-a", "plans:submit");
    let service = ServeProcess::start(&url);
    // Every pooled connection open, on the old primary.
    let load = Load::start(CLIENTS, &token, |_| service.addr.clone());
    load.wait_for_created(100);
    assert_each_answered(&load.stop(), &[201]);

    primary.psql("ALTER SYSTEM SET default_transaction_read_only = on");
    primary.psql("SELECT pg_reload_conf()");
    // A new session sees it: the postmaster has reloaded and signalled
    // every session, which applies it before its next statement.
    wait_for(&primary, "SHOW default_transaction_read_only", "on");
    standby.ctl(&["promote"]).expect("promote the standby");
    wait_for(&standby, "SELECT pg_is_in_recovery()", "f");

    let agent = client();
    for i in 0..20 {
        let run = format!("after-fence-{i}");
        let (status, receipt) =
            post_plan(&agent, &service.addr, &token, &run, &plan_body(&run, &run)).expect("answer");
        assert_eq!(status, 201, "{run}: {receipt}");
    }
    let on_new_primary = standby.psql_in(
        "intake",
        "SELECT COUNT(*) FROM plans WHERE run_id LIKE 'after-fence-%'",
    );
    assert_eq!(on_new_primary, "20");
}

/// A synchronous standby that stops taking WAL (its walreceiver SIGSTOPped)
/// and a write whose commit waits for it, terminated by
/// `pg_terminate_backend`: the commit stays visible on the primary, but the
/// service acknowledges neither it nor a replay of it, nor hands it to the
/// feed's reader (503, within the deadline); after the failover it is gone, every plan acknowledged before
/// is there, and the request resent with its key lands once.
#[test]
fn a_commit_cut_short_while_waiting_for_the_standby_is_never_acknowledged() {
    let Some(SyncPair {
        primary,
        standby,
        url,
        token,
        service,
    }) = sync_pair()
    else {
        return;
    };
    let agent = client();
    let acknowledged: Vec<String> = (0..10)
        .map(|i| create_through_failover(&service.addr, &token, &format!("before-{i}")))
        .collect();
    let reader = login_via_cli(&url, "orders", "receipts:read");
    let (status, page) = get(&agent, &service.addr, &reader, "/v1/receipts?limit=1000");
    assert_eq!(status, 200, "the feed before the stall: {page}");
    // A replay before the stall is answered as usual.
    let (status, _) = post_plan(
        &agent,
        &service.addr,
        &token,
        "before-0",
        &plan_body("before-0", "before-0"),
    )
    .expect("answer");
    assert_eq!(status, 200);

    let receiver = standby.pause_wal_receiver();
    let body = plan_body("stalled", "stalled");
    let poster = {
        let (addr, token, body) = (service.addr.clone(), token.clone(), body.clone());
        std::thread::spawn(move || post_plan(&client(), &addr, &token, "k-stalled", &body))
    };
    let waiting_write = "SELECT COUNT(*) FROM pg_stat_activity \
                         WHERE wait_event = 'SyncRep' AND query LIKE '%plan_intake_write%'";
    wait_for(&primary, waiting_write, "1");
    primary.psql(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid IN ({})",
        waiting_write.replace("COUNT(*)", "pid")
    ));
    let (status, answer) = poster.join().expect("poster").expect("an answer");
    assert_eq!(
        status, 503,
        "a commit the standby never had was acknowledged: {answer}"
    );
    assert_eq!(
        primary.psql_in(
            "intake",
            "SELECT COUNT(*) FROM plans WHERE run_id = 'stalled'"
        ),
        "1",
        "the terminated commit is visible on the primary"
    );
    let (status, answer) =
        post_plan(&agent, &service.addr, &token, "k-stalled", &body).expect("an answer");
    assert_eq!(status, 503, "a replay of it was acknowledged: {answer}");
    let (status, page) = get(&agent, &service.addr, &reader, "/v1/receipts?limit=1000");
    assert_eq!(
        status, 503,
        "the feed handed out a receipt the standby lacks: {page}"
    );

    // The link is cut: the primary is gone, and so is what the standby's
    // receiver held unwritten (the standby restarts its recovery).
    primary
        .ctl(&["stop", "-m", "immediate"])
        .expect("stop the primary");
    receiver.kill();
    wait_for(&standby, "SELECT pg_is_in_recovery()", "t");
    standby.ctl(&["promote"]).expect("promote the standby");
    wait_for(&standby, "SELECT pg_is_in_recovery()", "f");
    for receipt in &acknowledged {
        let sql = format!("SELECT COUNT(*) FROM plans WHERE receipt_id = '{receipt}'");
        assert_eq!(
            standby.psql_in("intake", &sql),
            "1",
            "{receipt} was acknowledged and lost"
        );
    }
    assert_eq!(
        standby.psql_in(
            "intake",
            "SELECT COUNT(*) FROM plans WHERE run_id = 'stalled'"
        ),
        "0",
        "the standby never had it"
    );
    // Sent again, it lands once. An attempt made while the instance had
    // not yet seen the new timeline may land and still be answered 503
    // (nothing is acknowledged without proof); the next one replays it.
    let (status, answer) = post_through_failover(&service.addr, &token, "k-stalled", &body);
    assert!(
        status == 201 || (status == 200 && answer["outcome"] == "replayed"),
        "{status}: {answer}"
    );
    assert_eq!(
        standby.psql_in(
            "intake",
            "SELECT COUNT(*) FROM plans WHERE run_id = 'stalled'"
        ),
        "1"
    );
}

/// A commit whose wait for the synchronous standby is cancelled
/// (`pg_cancel_backend`, as a DBA clearing sessions that look stuck does)
/// returns to its session as committed, with a WARNING alone to say the
/// standby may never have it: the service acknowledges it only once a
/// barrier round proves the standby has it, and a barrier round whose own
/// wait is cancelled proves nothing. The soak found it: 123 violations in
/// a failover after cancelled waits (acknowledged plans lost, a verifying
/// reader's 76).
#[test]
fn a_commit_whose_wait_for_the_standby_was_cancelled_is_never_acknowledged() {
    let Some(SyncPair {
        primary,
        standby,
        token,
        service,
        ..
    }) = sync_pair()
    else {
        return;
    };
    let agent = client();
    create_through_failover(&service.addr, &token, "before");
    let receiver = standby.pause_wal_receiver();
    let body = plan_body("cancelled", "cancelled");
    let poster = {
        let (addr, token, body) = (service.addr.clone(), token.clone(), body.clone());
        std::thread::spawn(move || post_plan(&client(), &addr, &token, "k-cancelled", &body))
    };
    let waiting_write = "SELECT COUNT(*) FROM pg_stat_activity \
                         WHERE wait_event = 'SyncRep' AND query LIKE '%plan_intake_write%'";
    wait_for(&primary, waiting_write, "1");
    // Every wait for the standby cancelled, the barrier's too, until the
    // request is answered.
    while !poster.is_finished() {
        primary.psql(
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (status, answer) = poster.join().expect("poster").expect("an answer");
    assert_eq!(
        status, 503,
        "a commit the standby never had was acknowledged: {answer}"
    );
    assert_eq!(
        primary.psql_in(
            "intake",
            "SELECT COUNT(*) FROM plans WHERE run_id = 'cancelled'"
        ),
        "1",
        "the cancelled wait's commit is on the primary"
    );
    // Once the standby has it, the request resent with its key is answered.
    drop(receiver);
    let (status, answer) =
        post_plan(&agent, &service.addr, &token, "k-cancelled", &body).expect("an answer");
    assert_eq!(status, 200, "{answer}");
}

/// Behind a transaction-mode PgBouncer too, the service hands out nothing
/// the synchronous standby has not confirmed: with the standby's receiver
/// stopped, a replay, a feed page, the checkpoint and a receipt's proof
/// wait for the barrier (whose round goes through the pooler like every
/// other statement) and answer 503 at the deadline; once the receiver goes
/// on, all are answered.
#[test]
fn behind_pgbouncer_a_replay_still_waits_for_the_standby() {
    let Some((primary, standby)) = pair() else {
        return;
    };
    make_synchronous(&primary);
    let bouncer = PgBouncer::in_front_of(primary.port, "intake");
    let direct = format!("postgres://postgres@127.0.0.1:{}/intake", primary.port);
    let migrated = run_cli_at(&direct, &["migrate", "run"]);
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let token = login_via_cli(&direct, "planner-a", "plans:submit");
    let reader = login_via_cli(&direct, "orders", "receipts:read");
    let keys = tempfile::tempdir().expect("temp dir");
    let key = crate::evidence::generate_key(keys.path(), "failover");
    let service = ServeProcess::start_with(
        &bouncer.url(),
        &[
            "--no-migrate",
            "--pg-pooler",
            "transaction",
            "--request-timeout-ms",
            "2000",
            "--signing-key",
            key.to_str().expect("utf-8 path"),
        ],
    );
    assert_durability_told(&service, true);
    let agent = client();
    let body = plan_body("behind-pgbouncer", "behind-pgbouncer");
    let answer = |key: &str| post_plan(&agent, &service.addr, &token, key, &body).expect("answer");
    let (status, created) = answer("k-1");
    assert_eq!(status, 201, "{created}");
    assert_eq!(answer("k-1").0, 200, "a replay with the standby streaming");
    let proof_path = format!(
        "/v1/receipts/{}/proof",
        created["receipt_id"].as_str().expect("a receipt id")
    );
    let logged = Instant::now();
    while get(&agent, &service.addr, &reader, &proof_path).0 != 200 {
        assert!(
            logged.elapsed() < Duration::from_secs(20),
            "the receipt never joined the log"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(get(&agent, &service.addr, &reader, "/v1/checkpoint").0, 200);

    let receiver = standby.pause_wal_receiver();
    let (status, replay) = answer("k-1");
    assert_eq!(
        status, 503,
        "a replay was answered without the standby's word: {replay}"
    );
    let (status, page) = get(&agent, &service.addr, &reader, "/v1/receipts?limit=10");
    assert_eq!(
        status, 503,
        "a feed page was answered without the standby's word: {page}"
    );
    for path in ["/v1/checkpoint", proof_path.as_str()] {
        let (status, _) = get(&agent, &service.addr, &reader, path);
        assert_eq!(
            status, 503,
            "{path} was answered without the standby's word"
        );
    }

    drop(receiver);
    let (status, replay) = answer("k-1");
    assert_eq!(status, 200, "{replay}");
    let (status, page) = get(&agent, &service.addr, &reader, "/v1/receipts?limit=10");
    assert_eq!(status, 200, "{page}");
    for path in ["/v1/checkpoint", proof_path.as_str()] {
        assert_eq!(get(&agent, &service.addr, &reader, path).0, 200, "{path}");
    }
}

/// One failed barrier round strands nobody: with the synchronous standby's
/// receiver stalled, replays wait for the barrier; its session is
/// terminated and the primary restarted under them; once the primary and
/// the standby are back, every replay is answered 200 within a couple of
/// rounds, not 503 at its deadline (20 s here).
#[test]
fn a_failed_barrier_round_is_begun_again_for_its_waiters() {
    let Some((primary, standby)) = pair() else {
        return;
    };
    make_synchronous(&primary);
    let url = multi_host_url(&primary, &standby);
    let token = login_via_cli(&url, "planner-a", "plans:submit");
    let service = ServeProcess::start_with(&url, &["--request-timeout-ms", "20000"]);
    let body = plan_body("run-1", "x");
    let (status, first) = post_through_failover(&service.addr, &token, "k", &body);
    assert_eq!(status, 201, "{first}");

    let receiver = standby.pause_wal_receiver();
    let replays: Vec<_> = (0..3)
        .map(|_| {
            let (addr, token, body) = (service.addr.clone(), token.clone(), body.clone());
            std::thread::spawn(move || {
                let answer = post_plan(&client(), &addr, &token, "k", &body);
                (answer, Instant::now())
            })
        })
        .collect();
    let barrier_waits = format!(
        "SELECT COUNT(*) FROM pg_stat_activity \
          WHERE application_name = '{}' AND wait_event = 'SyncRep'",
        BARRIER_NAME
    );
    wait_for(&primary, &barrier_waits, "1");
    primary.psql(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = '{}'",
        BARRIER_NAME
    ));
    primary.restart_immediate();
    drop(receiver);
    let back = Instant::now();
    for replay in replays {
        let (answer, at) = replay.join().expect("replay");
        let (status, receipt) = answer.expect("an answer");
        assert_eq!(status, 200, "{receipt}");
        assert_eq!(receipt["receipt_id"], first["receipt_id"]);
        assert!(
            at.saturating_duration_since(back) < Duration::from_secs(10),
            "answered {:?} after the primary was back",
            at.saturating_duration_since(back)
        );
    }
}

/// Commits wait for a synchronous standby and the only one is gone (as
/// under Patroni's `synchronous_mode_strict` with the leader alone): no
/// write can complete, and the service says so where a load balancer and
/// an operator look, `/readyz` (503, `commits-blocked`) and the gauge
/// `plan_intake_commits_blocked`; once the standby is back, ready again.
#[test]
fn readyz_tells_when_no_commit_can_complete() {
    let Some(SyncPair {
        primary,
        standby,
        service,
        ..
    }) = sync_pair()
    else {
        return;
    };
    assert_durability_told(&service, true);
    let gauge = |value: u8| {
        let line = format!("plan_intake_commits_blocked {value}");
        service.metrics_text().lines().any(|l| l == line)
    };
    assert!(gauge(0));

    standby
        .ctl(&["stop", "-m", "fast"])
        .expect("stop the standby");
    wait_for(&primary, "SELECT COUNT(*) FROM pg_stat_replication", "0");
    let (status, problem) = get(&client(), &service.addr, "", "/readyz");
    assert_eq!(status, 503, "{problem}");
    assert_eq!(
        problem["type"], "https://plan-intake.dev/problems/commits-blocked",
        "{problem}"
    );
    assert!(gauge(1), "the gauge after /readyz");

    standby.ctl(&["start"]).expect("start the standby");
    wait_for(
        &primary,
        "SELECT string_agg(sync_state, ',') FROM pg_stat_replication",
        "sync",
    );
    let (status, ready) = get(&client(), &service.addr, "", "/readyz");
    assert_eq!(status, 200, "{ready}");
    assert_eq!(ready["commits_blocked"], false, "{ready}");
    assert!(gauge(0), "the gauge after the standby came back");
}
