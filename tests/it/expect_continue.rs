//! `Expect: 100-continue` against the real binary: a `POST /v1/plans` is
//! told `100 Continue` only once its body will be read (the caller signed
//! in, allowed, under the size limit, within its login's share and its
//! body's room reserved); any other answer comes first, without the 100,
//! and closes the connection. Each request here sends its head alone and
//! reads what comes back before sending any body.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use plan_intake::intake::Permission;

use crate::support::process::ServeProcess;
use crate::support::{TestApp, TestDb, plan_body};

fn connect(server: &ServeProcess) -> TcpStream {
    let stream = TcpStream::connect(&server.addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    stream
}

/// Writes the head of a `POST /v1/plans` declaring `length` bytes, with
/// `Expect: 100-continue` when `expect`; no body.
fn send_head(stream: &mut TcpStream, token: &str, key: &str, length: usize, expect: bool) {
    let expect = if expect {
        "Expect: 100-continue\r\n"
    } else {
        ""
    };
    write!(
        stream,
        "POST /v1/plans HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nIdempotency-Key: {key}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n{expect}\r\n"
    )
    .expect("write the head");
}

/// Reads until one whole head has arrived: its text; what came after it
/// stays in `pending`.
fn read_head(stream: &mut TcpStream, pending: &mut Vec<u8>) -> String {
    loop {
        if let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
            let head: Vec<u8> = pending.drain(..end + 4).collect();
            return String::from_utf8_lossy(&head).into_owned();
        }
        let mut chunk = [0u8; 4096];
        let n = stream
            .read(&mut chunk)
            .expect("a head within the read timeout");
        assert!(
            n > 0,
            "closed before a whole head: {}",
            String::from_utf8_lossy(pending)
        );
        pending.extend_from_slice(&chunk[..n]);
    }
}

/// A refusal: the first bytes are the final answer `status`, never a
/// `100 Continue`; it is problem+json, says `Connection: close`, and the
/// service does close the connection (its body was never read). The head.
fn assert_refused_without_continue(mut stream: TcpStream, status: u16) -> String {
    let mut first = [0u8; 12];
    stream.read_exact(&mut first).expect("an answer");
    assert_eq!(
        String::from_utf8_lossy(&first),
        format!("HTTP/1.1 {status}"),
        "the first bytes"
    );
    let mut rest = Vec::new();
    // The service lingers for its client disconnect timeout, then closes.
    stream
        .read_to_end(&mut rest)
        .expect("the connection closed within the read timeout");
    let whole = format!(
        "{}{}",
        String::from_utf8_lossy(&first),
        String::from_utf8_lossy(&rest)
    );
    assert!(!whole.contains("HTTP/1.1 100"), "{whole}");
    let (head, _) = whole.split_once("\r\n\r\n").expect("a whole head");
    let lower = head.to_ascii_lowercase();
    assert!(lower.contains("\r\nconnection: close"), "{head}");
    assert!(
        lower.contains("\r\ncontent-type: application/problem+json"),
        "{head}"
    );
    lower
}

/// The value of one sample line in Prometheus text (0 when absent).
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|line| {
            line.strip_prefix(series)
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0.0)
}

/// An unknown token declaring half a megabyte: 401 at once, no 100, and
/// counted like any other refusal.
#[test]
fn an_unknown_token_is_refused_before_any_continue() {
    let scratch = TestDb::sqlite();
    let url = scratch.url.clone();
    let _app = TestApp::new(scratch);
    let server = ServeProcess::start(&url);
    let mut stream = connect(&server);
    send_head(&mut stream, "pit_nobody_knows_this", "k-1", 500_000, true);
    let head = assert_refused_without_continue(stream, 401);
    assert!(head.contains("\r\nwww-authenticate: bearer"), "{head}");
    let metrics = server.metrics_text();
    assert_eq!(
        sample(
            &metrics,
            "plan_intake_outcomes_total{outcome=\"unauthorized\"}"
        ),
        1.0,
        "{metrics}"
    );
}

/// A signed-in planner declaring 50 MB, over the 1 MiB limit: 413, no 100.
#[test]
fn a_body_over_the_limit_is_refused_before_any_continue() {
    let scratch = TestDb::sqlite();
    let url = scratch.url.clone();
    let app = TestApp::new(scratch);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let server = ServeProcess::start(&url);
    let mut stream = connect(&server);
    send_head(&mut stream, &token, "k-1", 50 * 1000 * 1000, true);
    assert_refused_without_continue(stream, 413);
    app.assert_rows(0, 0);
}

/// A signed-in planner with a small valid plan: `100 Continue`, then, once
/// the body is sent, 201; the plan is kept once.
#[test]
fn an_admitted_submission_gets_continue_then_its_answer() {
    let scratch = TestDb::sqlite();
    let url = scratch.url.clone();
    let app = TestApp::new(scratch);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let server = ServeProcess::start(&url);
    let body = plan_body("run-1", "x");
    let mut stream = connect(&server);
    send_head(&mut stream, &token, "k-1", body.len(), true);
    let mut pending = Vec::new();
    let interim = read_head(&mut stream, &mut pending);
    assert_eq!(interim, "HTTP/1.1 100 Continue\r\n\r\n");
    stream.write_all(body.as_bytes()).expect("the body");
    let answer = read_head(&mut stream, &mut pending);
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("\r\nlocation: /v1/receipts/"),
        "{answer}"
    );
    app.assert_rows(1, 1);
}

/// What was reserved before the 100 is the request's, not taken again by
/// the route: with a share of one submission per login and room for one
/// body of 600 kB among the bodies in flight, a second reservation of
/// either would be a 429 or a 503 after the 100.
#[test]
fn what_was_reserved_before_the_continue_is_not_reserved_again() {
    let scratch = TestDb::sqlite();
    let url = scratch.url.clone();
    let app = TestApp::new(scratch);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let server = ServeProcess::start_with(
        &url,
        &[
            "--max-inflight-per-login",
            "1",
            "--max-body-bytes-in-flight",
            "1048576",
        ],
    );
    let body = plan_body("run-1", &"x".repeat(600_000));
    let mut stream = connect(&server);
    send_head(&mut stream, &token, "k-1", body.len(), true);
    let mut pending = Vec::new();
    let interim = read_head(&mut stream, &mut pending);
    assert_eq!(interim, "HTTP/1.1 100 Continue\r\n\r\n");
    stream.write_all(body.as_bytes()).expect("the body");
    let answer = read_head(&mut stream, &mut pending);
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    app.assert_rows(1, 1);
}

/// With every byte of the bodies in flight held by another request (its
/// head declares the whole budget, its body never comes), a submission
/// with `Expect` waits its second for room, then gets 503 with
/// `Retry-After` and no 100. Once the holder is gone, the same is told 100.
#[test]
fn no_room_for_the_body_is_a_503_before_any_continue() {
    let scratch = TestDb::sqlite();
    let url = scratch.url.clone();
    let app = TestApp::new(scratch);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let server = ServeProcess::start_with(&url, &["--max-body-bytes-in-flight", "1048576"]);

    // The holder asks with `Expect` too: its 100 says its room is reserved.
    let mut holder = connect(&server);
    send_head(&mut holder, &token, "k-holder", 1_048_576, true);
    let mut held = Vec::new();
    assert_eq!(
        read_head(&mut holder, &mut held),
        "HTTP/1.1 100 Continue\r\n\r\n"
    );

    let body = plan_body("run-1", "x");
    let mut stream = connect(&server);
    send_head(&mut stream, &token, "k-1", body.len(), true);
    let head = assert_refused_without_continue(stream, 503);
    assert!(head.contains("\r\nretry-after: "), "{head}");

    drop(holder);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut stream = connect(&server);
        send_head(&mut stream, &token, "k-1", body.len(), true);
        let mut pending = Vec::new();
        let first = read_head(&mut stream, &mut pending);
        if first == "HTTP/1.1 100 Continue\r\n\r\n" {
            stream.write_all(body.as_bytes()).expect("the body");
            let answer = read_head(&mut stream, &mut pending);
            assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
            break;
        }
        assert!(first.starts_with("HTTP/1.1 503"), "{first}");
        assert!(
            Instant::now() < deadline,
            "the holder's room never came back"
        );
    }
    app.assert_rows(1, 1);
}
