//! Hostile and greedy traffic against the real binary: one planner cannot
//! take the service from another, slow clients are cut, and a stranger's
//! body costs nothing.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use plan_intake::intake::Permission;

use crate::support::process::{ServeProcess, client, post_plan};
use crate::support::{TestApp, TestDb, plan_body};

/// One login floods with 64 connections; every request of another login is
/// answered 2xx within its deadline, the flooder only 2xx or 429 (with
/// `Retry-After`), and the 429s are counted as `throttled`.
fn a_flooding_planner_cannot_starve_another(db: TestDb) {
    let url = db.url.clone();
    let app = TestApp::new(db);
    let flooder = app.login("flooder", &[Permission::PlansSubmit]);
    let other = app.login("other", &[Permission::PlansSubmit]);
    let server = ServeProcess::start_with(&url, &["--max-inflight-per-login", "4"]);
    let stop = AtomicBool::new(false);
    let (flood, others) = std::thread::scope(|scope| {
        let flooders: Vec<_> = (0..64)
            .map(|c| {
                let (stop, addr, token) = (&stop, &server.addr, &flooder);
                scope.spawn(move || {
                    let agent = client();
                    let mut statuses = Vec::new();
                    let mut i = 0;
                    while !stop.load(Ordering::Relaxed) || i == 0 {
                        let key = format!("flood-{c}-{i}");
                        let body = plan_body(&key, "x");
                        match post_plan(&agent, addr, token, &key, &body) {
                            Ok((status, _)) => statuses.push(status),
                            Err(e) => panic!("the flooder got no answer: {e}"),
                        }
                        i += 1;
                    }
                    statuses
                })
            })
            .collect();
        let agent = client();
        let mut others = Vec::new();
        for i in 0..30 {
            let key = format!("other-{i}");
            let started = Instant::now();
            let answer = post_plan(&agent, &server.addr, &other, &key, &plan_body(&key, "y"));
            others.push((answer, started.elapsed()));
        }
        stop.store(true, Ordering::Relaxed);
        let flood: Vec<u16> = flooders
            .into_iter()
            .flat_map(|f| f.join().expect("flooder"))
            .collect();
        (flood, others)
    });
    for (answer, took) in &others {
        let (status, body) = answer.as_ref().expect("an answer");
        assert_eq!(*status, 201, "{body}");
        assert!(*took < Duration::from_secs(10), "took {took:?}");
    }
    assert!(
        flood.iter().all(|s| [200, 201, 429].contains(s)),
        "{:?}",
        flood
            .iter()
            .filter(|s| ![200, 201, 429].contains(*s))
            .collect::<Vec<_>>()
    );
    let throttled = flood.iter().filter(|s| **s == 429).count();
    assert!(throttled > 0, "64 connections never met a share of 4");
    let metrics = client()
        .get(&format!("http://{}/metrics", server.addr))
        .call()
        .expect("metrics")
        .into_string()
        .expect("text");
    assert!(
        metrics.contains(&format!(
            "plan_intake_outcomes_total{{outcome=\"throttled\"}} {throttled}"
        )),
        "{throttled} throttled: {metrics}"
    );
    app.assert_rows(
        flood.iter().filter(|s| **s == 201).count() as i64 + 30,
        flood.iter().filter(|s| **s == 201).count() as i64 + 30,
    );
}

/// Connections that trickle a request one byte a second are cut after the
/// client timeout, while a planner's plans and `/healthz` are answered at
/// once.
fn slow_clients_are_cut_and_others_are_served(db: TestDb) {
    let url = db.url.clone();
    let app = TestApp::new(db);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let slowpoke = app.login("slowpoke", &[Permission::PlansSubmit]);
    let server = ServeProcess::start_with(&url, &["--client-timeout-ms", "1000"]);
    // The slow bodies are another login's: past its share they get 429.
    let head = format!(
        "POST /v1/plans HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {slowpoke}\r\nIdempotency-Key: slow\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    );
    // Half trickle their head, half send the head and trickle the body;
    // each keeps how far it has got.
    let request = format!("{head}{}", "{".repeat(100));
    let mut tricklers: Vec<(std::net::TcpStream, usize)> = (0..500)
        .map(|i| {
            let mut stream = std::net::TcpStream::connect(&server.addr).expect("connect");
            let sent = if i % 2 == 1 { head.len() } else { 1 };
            stream
                .write_all(&request.as_bytes()[..sent])
                .expect("the first bytes");
            (stream, sent)
        })
        .collect();
    let agent = client();
    let started = Instant::now();
    for i in 0..10 {
        let key = format!("fast-{i}");
        let begun = Instant::now();
        let (status, body) =
            post_plan(&agent, &server.addr, &token, &key, &plan_body(&key, "x")).expect("answer");
        assert_eq!(status, 201, "{body}");
        assert!(
            begun.elapsed() < Duration::from_secs(2),
            "{:?}",
            begun.elapsed()
        );
        let begun = Instant::now();
        let health = agent
            .get(&format!("http://{}/healthz", server.addr))
            .call()
            .expect("healthz");
        assert_eq!(health.status(), 200);
        assert!(
            begun.elapsed() < Duration::from_millis(50),
            "{:?}",
            begun.elapsed()
        );
        // One more byte a second from each trickler, while it may.
        if started.elapsed() < Duration::from_millis(300 * (i + 1)) {
            for (stream, sent) in &mut tricklers {
                if stream
                    .write_all(&request.as_bytes()[*sent..*sent + 1])
                    .is_ok()
                {
                    *sent += 1;
                }
            }
        }
    }
    // Past the client timeout, every trickler has been answered 408 (429
    // past its login's share) or cut.
    for (i, (stream, _)) in tricklers.iter_mut().enumerate() {
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut answer = Vec::new();
        let read = stream.read_to_end(&mut answer);
        let text = String::from_utf8_lossy(&answer);
        assert!(
            read.is_ok()
                && (text.is_empty()
                    || text.starts_with("HTTP/1.1 408")
                    || text.starts_with("HTTP/1.1 429")),
            "trickler {i}: {read:?} {text}"
        );
    }
    app.assert_rows(10, 10);
}

crate::on_both_backends_sync!(
    a_flooding_planner_cannot_starve_another,
    slow_clients_are_cut_and_others_are_served,
);
