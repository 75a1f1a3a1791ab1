//! Load as the process tests make it: clients posting new plans to running
//! services until told to stop, and a resend of each with its key.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use serde_json::Value;

use super::plan_body;
use super::process::{client, post_plan};

/// One request a client sent, and its answer (`None`: no HTTP answer came
/// back, and that client stopped there).
pub struct Sent {
    pub key: String,
    pub body: String,
    pub answer: Option<(u16, Value)>,
}

impl Sent {
    pub fn status(&self) -> Option<u16> {
        self.answer.as_ref().map(|(status, _)| *status)
    }

    /// The receipt id of a 201.
    pub fn created_receipt(&self) -> Option<&str> {
        match &self.answer {
            Some((201, receipt)) => receipt["receipt_id"].as_str(),
            _ => None,
        }
    }
}

/// `clients` threads, client `c` posting to `addr(c)` with `token`: each
/// request a new plan under a new key (`k-{c}-{i}`, run `run-{c}-{i}`).
pub struct Load {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicUsize>,
    created: Arc<AtomicUsize>,
    clients: Vec<JoinHandle<Vec<Sent>>>,
}

/// Waits until `reached()`; panics instead of hanging if every client has
/// stopped first (none of them heard an answer).
fn wait_until(clients: &[JoinHandle<Vec<Sent>>], what: &str, reached: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while !reached() {
        assert!(
            !clients.iter().all(JoinHandle::is_finished),
            "every load client stopped before {what}: the service gave no answer"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        thread::sleep(Duration::from_millis(5));
    }
}

impl Load {
    pub fn start(clients: usize, token: &str, addr: impl Fn(usize) -> String) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicUsize::new(0));
        let created = Arc::new(AtomicUsize::new(0));
        let clients = (0..clients)
            .map(|c| {
                let (addr, token) = (addr(c), token.to_owned());
                let (stop, answered, created) = (
                    Arc::clone(&stop),
                    Arc::clone(&answered),
                    Arc::clone(&created),
                );
                thread::spawn(move || {
                    let agent = client();
                    let mut sent = Vec::new();
                    for i in 0.. {
                        if stop.load(Ordering::SeqCst) {
                            break;
                        }
                        let key = format!("k-{c}-{i}");
                        let body = plan_body(&format!("run-{c}-{i}"), "x");
                        let answer = post_plan(&agent, &addr, &token, &key, &body).ok();
                        let gone = answer.is_none();
                        if let Some((status, _)) = &answer {
                            answered.fetch_add(1, Ordering::SeqCst);
                            if *status == 201 {
                                created.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                        sent.push(Sent { key, body, answer });
                        if gone {
                            break;
                        }
                    }
                    sent
                })
            })
            .collect();
        Self {
            stop,
            answered,
            created,
            clients,
        }
    }

    /// Returns once `more` further requests have been answered.
    pub fn wait_for_answers(&self, more: usize) {
        let until = self.answered.load(Ordering::SeqCst) + more;
        wait_until(&self.clients, "enough answers", || {
            self.answered.load(Ordering::SeqCst) >= until
        });
    }

    /// Returns once `count` plans in all have been answered 201.
    pub fn wait_for_created(&self, count: usize) {
        wait_until(&self.clients, "enough plans were created", || {
            self.created.load(Ordering::SeqCst) >= count
        });
    }

    /// Stops every client after its request in flight; what they all sent.
    pub fn stop(self) -> Vec<Sent> {
        self.stop.store(true, Ordering::SeqCst);
        self.clients
            .into_iter()
            .flat_map(|c| c.join().expect("load client"))
            .collect()
    }
}

/// Every request got an HTTP answer, and each status is one of `allowed`.
pub fn assert_each_answered(sent: &[Sent], allowed: &[u16]) {
    let statuses: std::collections::HashSet<Option<u16>> = sent.iter().map(Sent::status).collect();
    assert!(
        statuses
            .iter()
            .all(|s| s.is_some_and(|s| allowed.contains(&s))),
        "answers other than {allowed:?} (None: no answer): {statuses:?}"
    );
}

/// POSTs `sent` again with its key until it is not a 503 (at most 50 tries,
/// 100 ms apart); the last answer.
pub fn resend(agent: &ureq::Agent, addr: &str, token: &str, sent: &Sent) -> (u16, Value) {
    let mut attempts = 0;
    loop {
        let answer = post_plan(agent, addr, token, &sent.key, &sent.body).expect("an answer");
        attempts += 1;
        if answer.0 != 503 || attempts == 50 {
            return answer;
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// After a fault: every 201 in `sent` is stored in the database at `url`;
/// then, through the same service at `addr`, every request again with its
/// key (`clients` at once) lands exactly once: a 201's replay is its
/// receipt, one plan per key, none without its key row. Gives `sent` back.
pub fn every_acknowledged_plan_is_kept_once(
    sent: Vec<Sent>,
    url: &str,
    addr: &str,
    token: &str,
    clients: usize,
) -> Arc<Vec<Sent>> {
    use diesel::Connection;
    let mut conn = plan_intake::storage::DbConn::Postgres(
        diesel::PgConnection::establish(url).expect("connect"),
    );
    let stored = super::stored_receipt_ids(&mut conn);
    for receipt in sent.iter().filter_map(Sent::created_receipt) {
        assert!(stored.contains(receipt), "a 201 was lost: {receipt}");
    }
    let sent = Arc::new(sent);
    let resenders: Vec<_> = (0..clients)
        .map(|c| {
            let (sent, addr, token) = (Arc::clone(&sent), addr.to_owned(), token.to_owned());
            thread::spawn(move || {
                let agent = client();
                for s in sent.iter().skip(c).step_by(clients) {
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
    let plans = super::scalar(&mut conn, "SELECT COUNT(*) AS n FROM plans");
    assert_eq!(plans, sent.len() as i64, "one plan per key");
    let keyless = super::scalar(
        &mut conn,
        "SELECT COUNT(*) AS n FROM plans p WHERE NOT EXISTS (SELECT 1 FROM intake_keys k WHERE k.plan_id = p.id)",
    );
    assert_eq!(keyless, 0, "a plan without its key");
    sent
}
