//! The async client (`plan_intake_client::asynchronous`, feature `async`)
//! against the real service: answers cut by a proxy after the service
//! kept the plan, a 429 with `Retry-After`, and a follower dropped between
//! pages. Its rules are the blocking client's own code; these tests hold
//! the async transport to them.

use std::io::{BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use plan_intake_client::asynchronous::{AsyncClient, follow};
use plan_intake_client::{FollowOptions, Outcome, SubmitOptions};

use crate::support::http_proxy::read_message;
use crate::support::plan_body;
use crate::support::process::served_sqlite;

/// What the proxy does with one request.
#[derive(Debug, Clone, Copy)]
enum Act {
    /// Forward it, read the service's whole answer, and close the
    /// connection without passing the answer on.
    CutAnswer,
    /// Answer 429 with `Retry-After: SECONDS` itself.
    TooMany(u64),
}

/// One request as the proxy saw it: when, and its `Idempotency-Key`.
#[derive(Debug, Clone)]
struct Seen {
    at: Instant,
    key: Option<String>,
}

/// An HTTP/1.1 proxy in front of the service that acts on requests in
/// turn (`acts`, then forwards every other), one connection to the
/// service per request.
struct AnswerProxy {
    url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl AnswerProxy {
    fn start(upstream: String, acts: Vec<Act>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let acts = Arc::new(Mutex::new(std::collections::VecDeque::from(acts)));
        let log = Arc::clone(&seen);
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let (upstream, acts, log) = (upstream.clone(), Arc::clone(&acts), Arc::clone(&log));
                std::thread::spawn(move || serve_connection(client, &upstream, &acts, &log));
            }
        });
        Self { url, seen }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("seen").clone()
    }
}

/// Requests of one client connection, one after another (keep-alive).
fn serve_connection(
    client: TcpStream,
    upstream: &str,
    acts: &Mutex<std::collections::VecDeque<Act>>,
    seen: &Mutex<Vec<Seen>>,
) {
    let mut reader = BufReader::new(client.try_clone().expect("clone"));
    let mut client = client;
    while let Some((head, body)) = read_message(&mut reader) {
        let key = head.lines().find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("idempotency-key")
                .then(|| value.trim().to_owned())
        });
        seen.lock().expect("seen").push(Seen {
            at: Instant::now(),
            key,
        });
        let act = acts.lock().expect("acts").pop_front();
        if let Some(Act::TooMany(seconds)) = act {
            let problem = r#"{"type":"https://plan-intake.dev/problems/throttled","title":"Too many requests","status":429}"#;
            let _ = write!(
                client,
                "HTTP/1.1 429 Too Many Requests\r\nRetry-After: {seconds}\r\nContent-Type: application/problem+json\r\nContent-Length: {}\r\n\r\n{problem}",
                problem.len()
            );
            continue;
        }
        let mut service = TcpStream::connect(upstream).expect("reach the service");
        service
            .write_all(head.as_bytes())
            .and_then(|()| service.write_all(&body))
            .expect("forward the request");
        let mut answer_reader = BufReader::new(service);
        let Some((answer_head, answer_body)) = read_message(&mut answer_reader) else {
            return;
        };
        if let Some(Act::CutAnswer) = act {
            // The service has answered (the plan is kept); the caller
            // never hears it.
            let _ = client.shutdown(Shutdown::Both);
            return;
        }
        if client
            .write_all(answer_head.as_bytes())
            .and_then(|()| client.write_all(&answer_body))
            .is_err()
        {
            return;
        }
    }
}

fn quick() -> SubmitOptions {
    SubmitOptions {
        retry_base: Duration::from_millis(20),
        timeout: Duration::from_secs(30),
        ..SubmitOptions::default()
    }
}

/// Two answers cut after the service kept the plan: the third attempt,
/// under the same key, gets the same receipt back as a replay, and the
/// database holds one plan.
#[actix_web::test]
async fn async_submit_through_cut_answers_keeps_one_plan() {
    let (app, server, planner, _) = served_sqlite();
    let proxy = AnswerProxy::start(server.addr.clone(), vec![Act::CutAnswer, Act::CutAnswer]);
    let client = AsyncClient::new(&proxy.url, &planner).expect("a client");
    let body = plan_body("run-cut", "x");
    let submitted = client
        .submit(body.as_bytes(), &quick())
        .await
        .expect("a receipt");
    assert_eq!(submitted.attempts, 3);
    assert_eq!(submitted.outcome, Outcome::Replayed);
    let seen = proxy.seen();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(
        seen.iter()
            .all(|s| s.key.as_deref() == Some(&submitted.key)),
        "every attempt under one key: {seen:?}"
    );
    app.assert_rows(1, 1);
}

/// A 429 with `Retry-After: 1`: the next attempt comes no sooner than a
/// second later, and lands.
#[actix_web::test]
async fn async_submit_waits_out_retry_after() {
    let (app, server, planner, _) = served_sqlite();
    let proxy = AnswerProxy::start(server.addr.clone(), vec![Act::TooMany(1)]);
    let client = AsyncClient::new(&proxy.url, &planner).expect("a client");
    let body = plan_body("run-429", "x");
    let submitted = client
        .submit(body.as_bytes(), &quick())
        .await
        .expect("a receipt");
    assert_eq!(submitted.attempts, 2);
    assert_eq!(submitted.outcome, Outcome::Created);
    let seen = proxy.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    let gap = seen[1].at.duration_since(seen[0].at);
    assert!(gap >= Duration::from_secs(1), "retried after {gap:?}");
    app.assert_rows(1, 1);
}

/// A follower dropped while its handler holds the second page saved the
/// first page's cursor only: the next run hands the second page again
/// (and again after its handler fails once), then the rest. Every
/// receipt arrives, in feed order, none skipped.
#[actix_web::test]
async fn an_async_follower_dropped_between_pages_skips_nothing() {
    let (_app, server, planner, reader) = served_sqlite();
    let agent = crate::support::process::client();
    let mut written = Vec::new();
    for i in 0..5 {
        let key = format!("feed-{i}");
        let (status, receipt) = crate::support::process::post_plan(
            &agent,
            &server.addr,
            &planner,
            &key,
            &plan_body(&key, "x"),
        )
        .expect("an answer");
        assert_eq!(status, 201);
        written.push(receipt["receipt_id"].as_str().expect("an id").to_owned());
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let options = FollowOptions {
        from_start: true,
        limit: 2,
        wait: Duration::ZERO,
        drain: true,
        retry_base: Duration::from_millis(10),
        ..FollowOptions::new(dir.path().join("orders.cursor"))
    };
    let client = AsyncClient::new(&format!("http://{}", server.addr), &reader).expect("a client");
    let ids = |page: &plan_intake_client::Page| -> Vec<String> {
        page.receipts
            .iter()
            .map(|entry| {
                let receipt: serde_json::Value =
                    serde_json::from_str(entry.get()).expect("a receipt");
                receipt["receipt_id"].as_str().expect("an id").to_owned()
            })
            .collect()
    };

    // Run 1: the second page's handler never finishes; the run is dropped.
    let pages = Arc::new(Mutex::new(Vec::<Vec<String>>::new()));
    let (second, held) = tokio::sync::oneshot::channel::<()>();
    let second = Mutex::new(Some(second));
    let run = follow(&client, &options, |page| {
        let pages = Arc::clone(&pages);
        let page_ids = ids(&page);
        let signal = (pages.lock().expect("pages").len() == 1)
            .then(|| second.lock().expect("signal").take())
            .flatten();
        async move {
            pages.lock().expect("pages").push(page_ids);
            if let Some(signal) = signal {
                let _ = signal.send(());
                std::future::pending::<()>().await;
            }
            Ok::<(), String>(())
        }
    });
    tokio::select! {
        ended = run => panic!("the run ended: {ended:?}"),
        _ = held => {}
    }
    let first_run = pages.lock().expect("pages").clone();
    assert_eq!(first_run, [written[0..2].to_vec(), written[2..4].to_vec()]);

    // Run 2: from the saved cursor, the first page's handler fails once.
    let failed_once = Mutex::new(false);
    let again = Arc::new(Mutex::new(Vec::<Vec<String>>::new()));
    let done = follow(&client, &options, |page| {
        let fail = !std::mem::replace(&mut *failed_once.lock().expect("flag"), true);
        let again = Arc::clone(&again);
        let page_ids = ids(&page);
        async move {
            again.lock().expect("pages").push(page_ids);
            if fail {
                Err("downstream is busy".to_owned())
            } else {
                Ok(())
            }
        }
    })
    .await
    .expect("drained");
    let second_run = again.lock().expect("pages").clone();
    assert_eq!(
        second_run,
        [
            written[2..4].to_vec(),
            written[2..4].to_vec(),
            written[4..5].to_vec()
        ],
        "the unsaved page again (twice: once refused), then the rest"
    );
    assert_eq!((done.pages, done.receipts), (2, 3));
}

/// Exactly once into the caller's own store (`follow_from`): each page
/// is committed with its position by the handler; a run dropped while its
/// handler holds the second page, and a handler that fails once, leave
/// each receipt in the store once, in feed order.
#[actix_web::test]
async fn an_async_follower_given_positions_keeps_each_receipt_once() {
    use plan_intake_client::Position;
    use plan_intake_client::asynchronous::follow_from;

    let (_app, server, planner, reader) = served_sqlite();
    let agent = crate::support::process::client();
    let written: Vec<String> = (0..5)
        .map(|i| {
            let key = format!("kept-{i}");
            let receipt = crate::support::process::keep_plan(
                &agent,
                &server.addr,
                &planner,
                &key,
                &plan_body(&key, "x"),
            );
            receipt["receipt_id"].as_str().expect("an id").to_owned()
        })
        .collect();
    let options = FollowOptions {
        from_start: true,
        limit: 2,
        wait: Duration::ZERO,
        drain: true,
        retry_base: Duration::from_millis(10),
        ..FollowOptions::default()
    };
    let client = AsyncClient::new(&format!("http://{}", server.addr), &reader).expect("a client");
    // The caller's store: receipt ids and the position after them,
    // replaced together (its "transaction").
    let store = Arc::new(Mutex::new((Vec::<String>::new(), None::<Position>)));
    let commit = |page: &plan_intake_client::Page, position: Position| {
        let mut store = store.lock().expect("store");
        for entry in &page.receipts {
            let receipt: serde_json::Value = serde_json::from_str(entry.get()).expect("a receipt");
            store
                .0
                .push(receipt["receipt_id"].as_str().expect("an id").to_owned());
        }
        store.1 = Some(position);
    };

    // Run 1: the second page's handler never commits; the run is dropped.
    let (second, held) = tokio::sync::oneshot::channel::<()>();
    let second = Mutex::new(Some(second));
    let pages = Mutex::new(0);
    let run = follow_from(&client, &options, None, |page, position| {
        let hold = {
            let mut pages = pages.lock().expect("pages");
            *pages += 1;
            (*pages == 2)
                .then(|| second.lock().expect("signal").take())
                .flatten()
        };
        if hold.is_none() {
            commit(&page, position);
        }
        async move {
            if let Some(hold) = hold {
                let _ = hold.send(());
                std::future::pending::<()>().await;
            }
            Ok::<(), String>(())
        }
    });
    tokio::select! {
        ended = run => panic!("the run ended: {ended:?}"),
        _ = held => {}
    }
    assert_eq!(store.lock().expect("store").0, written[0..2]);

    // Run 2: from the stored position; the first try of its first page
    // fails before committing.
    let saved = store.lock().expect("store").1.clone();
    assert!(saved.is_some(), "a position was committed");
    let failed_once = Mutex::new(false);
    let done = follow_from(&client, &options, saved, |page, position| {
        let fail = !std::mem::replace(&mut *failed_once.lock().expect("flag"), true);
        if !fail {
            commit(&page, position);
        }
        async move {
            if fail {
                Err("the store is busy".to_owned())
            } else {
                Ok(())
            }
        }
    })
    .await
    .expect("drained");
    assert_eq!(done.receipts, 3, "{done:?}");
    assert_eq!(
        store.lock().expect("store").0,
        written,
        "each receipt once, in feed order"
    );
}
