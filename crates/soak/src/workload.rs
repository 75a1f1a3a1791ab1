//! The planners and the follower. Planners send through the client crate,
//! retrying as `submit` does, with the duplicates real planners make: the
//! same request again (to any instance), the same plan under a new key,
//! and the same key sent twice at once to two instances.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use plan_intake_client::{Client, FollowOptions, SubmitError, SubmitOptions};
use rand::{RngExt, SeedableRng};
use serde_json::json;

use crate::history::History;
use crate::system::System;

/// A plan a planner sent: its body and the key it went under.
#[derive(Clone)]
struct Sent {
    run_id: String,
    body: String,
    key: String,
}

/// The request hash the service will give `body` (`blake3:…`), by the
/// client crate's own reading of it.
fn request_hash(body: &str) -> String {
    let key = plan_intake_client::derive_key(body.as_bytes());
    format!("blake3:{}", key.strip_prefix("submit-").unwrap_or(&key))
}

fn body(run_id: &str, n: u64) -> String {
    json!({
        "run_id": run_id,
        "approved_inputs": [{"id": "forecast-v12", "digest": "blake3:9f2c"}],
        "content": {"lines": [{"sku": format!("S-{n}"), "qty": n % 7 + 1}]},
    })
    .to_string()
}

/// One submission, recorded: whether it was acknowledged.
fn send(
    system: &System,
    history: &History,
    planner: usize,
    instance: usize,
    sent: &Sent,
    why: &str,
) -> bool {
    // Longer than a run of the nemesis's faults on one instance (each
    // ends within about 20 s, a failover's rebuild included), as a
    // planner's would be: the whole call, sends again after a rotation
    // included.
    let budget = Duration::from_secs(120);
    let began = std::time::Instant::now();
    // A planner whose token was rotated twice while it sent (the first
    // token's grace ends at the second rotation) sends again with the
    // new one, as a real planner reloading its secret would.
    let mut rotated = 0;
    let answer = loop {
        let token = system.planner_token(planner);
        let options = SubmitOptions {
            key: Some(sent.key.clone()),
            timeout: budget
                .saturating_sub(began.elapsed())
                .max(Duration::from_secs(1)),
            ..SubmitOptions::default()
        };
        let answer = Client::new(&system.url(instance), &token)
            .map_err(|e| SubmitError::Unexpected(e.to_string()))
            .and_then(|client| client.submit(sent.body.as_bytes(), &options));
        match answer {
            Err(SubmitError::Denied(_))
                if rotated < 3 && system.planner_token(planner) != token =>
            {
                rotated += 1;
            }
            answer => break answer,
        }
    };
    let mut event = json!({
        "kind": if why == "conflict" { "conflict" } else { "submit" },
        "request_hash": request_hash(&sent.body),
        "planner": planner,
        "instance": instance,
        "why": why,
        "key": sent.key,
        "run_id": sent.run_id,
        "timeout_s": budget.as_secs_f64(),
    });
    event["took_s"] = json!(began.elapsed().as_secs_f64());
    match answer {
        Ok(submitted) => {
            event["outcome"] = json!(submitted.outcome.to_string());
            event["receipt_id"] = json!(submitted.receipt_id);
            event["attempts"] = json!(submitted.attempts);
            history.record(event);
            true
        }
        Err(error) => {
            event["error"] = json!(error.to_string());
            event["refused"] = json!(matches!(error, SubmitError::Refused(_)));
            history.record(event);
            false
        }
    }
}

/// The interleaving migration 000016 closed, aimed at: a batch that finds
/// its first plan kept and then waits for that plan's new key row, which
/// another session holds uncommitted (as a racing instance whose own plan
/// met the kept one does), with its transaction's id given and, were the
/// horizon's lock not taken, no lock on `plans` while readers page past
/// other commits; the rest of its batch then commits behind them.
///
/// On instance `instance`: the soak's own sessions hold three new keys of
/// planner 0's for its newest kept plans. Planner 0's kept plan is sent
/// under the first key, then under the second, so both of the instance's
/// writers wait; then under the third, with a few new plans of the other
/// planners beside it, which queue behind and form one batch when the
/// first key is let go after `hold` (planner 0's maker sorts first, so its
/// plan comes first in the batch). The third key is let go `hold` later,
/// the second last; meanwhile plans commit through the other instance. Every answer is recorded as its planner's. `Ok(false)`
/// when planner 0 has no kept plan yet.
pub fn send_under_held_keys(
    system: &System,
    history: &History,
    instance: usize,
    n: u64,
    hold: Duration,
) -> Result<bool, String> {
    let newest = system.query(
        "SELECT run_id || ' ' || receipt_id FROM plans \
          WHERE run_id ~ '^soak-0-[0-9]+$' ORDER BY id DESC LIMIT 1",
    )?;
    let Some((run_id, receipt_id)) = newest.first().and_then(|row| row.split_once(' ')) else {
        return Ok(false);
    };
    let number = run_id
        .trim_start_matches("soak-0-")
        .parse::<u64>()
        .map_err(|e| format!("{run_id}: {e}"))?;
    let kept = |key: String| Sent {
        run_id: run_id.to_owned(),
        body: body(run_id, number),
        key,
    };
    let keys: Vec<String> = (0..3).map(|k| format!("p0-held-{n}-{k}")).collect();
    // Let go in this order: the first after `hold`, the third after two,
    // the second last.
    let holds = [hold, hold * 3 + Duration::from_millis(500), hold * 2];
    let mut holders = Vec::new();
    for (key, held_for) in keys.iter().zip(holds) {
        holders.push(system.hold_key_row("planner-0", key, receipt_id, held_for)?);
    }
    let planners = system.planner_tokens.lock().map(|t| t.len()).unwrap_or(1);
    std::thread::scope(|scope| -> Result<(), String> {
        for (k, key) in keys.iter().enumerate() {
            let sent = kept(key.clone());
            scope.spawn(move || send(system, history, 0, instance, &sent, "held key"));
            if k < 2 {
                // The instance's writers taken one after the other.
                system.await_lock_waits(k + 1)?;
            }
        }
        for (i, p) in (1..planners).cycle().take(6).enumerate() {
            let run_id = format!("soak-{p}-held-{n}-{i}");
            let new = Sent {
                body: body(&run_id, n),
                key: format!("p{p}-held-{n}-{i}"),
                run_id,
            };
            scope.spawn(move || send(system, history, p, instance, &new, "beside a held key"));
        }
        // Meanwhile plans commit through the other instance (the planners
        // may all be held up on this one), so readers have newer plans to
        // page past while the batch waits.
        let other = (instance + 1) % system.count();
        let third_let_go = &holders[2];
        let mut i = 0;
        while !third_let_go.is_finished() {
            let run_id = format!("soak-1-meanwhile-{n}-{i}");
            let new = Sent {
                body: body(&run_id, n),
                key: format!("p1-meanwhile-{n}-{i}"),
                run_id,
            };
            send(
                system,
                history,
                1 % planners,
                other,
                &new,
                "while a key is held",
            );
            i += 1;
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    })?;
    for holder in holders {
        holder
            .join()
            .map_err(|_| "a key's holder panicked".to_owned())??;
    }
    Ok(true)
}

/// The planner threads; each gives how many answers it was acknowledged.
pub fn planners(
    system: Arc<System>,
    history: Arc<History>,
    stop: Arc<AtomicBool>,
    seed: u64,
) -> Vec<JoinHandle<usize>> {
    let planners = system.planner_tokens.lock().map(|t| t.len()).unwrap_or(0);
    (0..planners)
        .map(|planner| {
            let (system, history, stop) = (system.clone(), history.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (planner as u64 + 1));
                let mut sent: Vec<Sent> = Vec::new();
                let mut acknowledged = 0;
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let instance = rng.random_range(0..system.count());
                    let draw = rng.random_range(0..100);
                    let previous =
                        (!sent.is_empty()).then(|| sent[rng.random_range(0..sent.len())].clone());
                    let ok = match (draw, previous) {
                        // The same request again, to any instance.
                        (0..20, Some(again)) => {
                            send(&system, &history, planner, instance, &again, "retry")
                        }
                        // The same plan under a new key.
                        (20..35, Some(plan)) => {
                            let other = Sent {
                                key: format!("p{planner}-rekey-{n}"),
                                ..plan
                            };
                            send(&system, &history, planner, instance, &other, "new key")
                        }
                        // Other content under a key already used: refused
                        // (422), the key's plan unchanged.
                        (35..40, Some(used)) => {
                            let conflict = Sent {
                                body: body(&format!("{}-changed", used.run_id), n),
                                ..used
                            };
                            send(&system, &history, planner, instance, &conflict, "conflict");
                            false
                        }
                        // The same key twice at once, to two instances: a
                        // new plan, or (every other time) a kept plan
                        // under a new key, whose key rows then race.
                        (40..52, previous) => {
                            let twice = match previous.filter(|_| n.is_multiple_of(2)) {
                                Some(kept) => Sent {
                                    key: format!("p{planner}-twice-{n}"),
                                    ..kept
                                },
                                None => {
                                    let run_id = format!("soak-{planner}-{n}");
                                    Sent {
                                        body: body(&run_id, n),
                                        key: format!("p{planner}-twice-{n}"),
                                        run_id,
                                    }
                                }
                            };
                            sent.push(twice.clone());
                            let other = (instance + 1) % system.count();
                            let (a, b) = std::thread::scope(|scope| {
                                let a = scope.spawn(|| {
                                    send(&system, &history, planner, instance, &twice, "twice")
                                });
                                let b = scope.spawn(|| {
                                    send(&system, &history, planner, other, &twice, "twice")
                                });
                                (a.join().unwrap_or(false), b.join().unwrap_or(false))
                            });
                            acknowledged += usize::from(a);
                            b
                        }
                        // A new plan.
                        _ => {
                            let run_id = format!("soak-{planner}-{n}");
                            let new = Sent {
                                body: body(&run_id, n),
                                key: format!("p{planner}-{n}"),
                                run_id,
                            };
                            sent.push(new.clone());
                            send(&system, &history, planner, instance, &new, "new")
                        }
                    };
                    acknowledged += usize::from(ok);
                }
                acknowledged
            })
        })
        .collect()
}

/// The follower of the feed through instance 0, until `stop`; then, once
/// `drain` is set (the workload over, every instance up), it reads what is
/// left. The receipt ids it handed on, in order.
pub fn follower(
    system: Arc<System>,
    history: Arc<History>,
    stop: Arc<AtomicBool>,
    drain: Arc<AtomicBool>,
) -> JoinHandle<Vec<String>> {
    std::thread::spawn(move || {
        let dir = tempfile::tempdir().ok();
        let cursor = dir
            .as_ref()
            .map(|d| d.path().join("orders.cursor"))
            .unwrap_or_else(|| "soak-orders.cursor".into());
        let mut handed = Vec::new();
        let Ok(client) = Client::new(&system.url(0), &system.reader_token) else {
            return handed;
        };
        let mut options = FollowOptions::new(&cursor);
        options.from_start = true;
        options.wait = Duration::from_secs(1);
        let mut out: Vec<u8> = Vec::new();
        if let Err(e) = plan_intake_client::follow(&client, &options, &stop, &mut out) {
            history.record(json!({"kind": "follower-error", "error": e.to_string()}));
        }
        // Once the workload has stopped and every instance is up: the rest.
        while !drain.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
        }
        options.drain = true;
        options.wait = Duration::ZERO;
        let never = AtomicBool::new(false);
        // A write a killed instance's backend still holds keeps the feed's
        // horizon back for a moment: drain again until every stored plan
        // was handed on, or a pass began with no writer holding `plans`
        // (Postgres; what it did not hand on, none will), or 30 s.
        let until = std::time::Instant::now() + Duration::from_secs(30);
        let writers = "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
                        WHERE c.relname = 'plans' AND l.mode = 'RowExclusiveLock'";
        loop {
            let no_writer = system
                .query(writers)
                .ok()
                .and_then(|rows| rows.first().map(|n| n == "0"))
                .unwrap_or(false);
            if let Err(e) = plan_intake_client::follow(&client, &options, &never, &mut out) {
                history.record(json!({"kind": "follower-error", "error": e.to_string()}));
                break;
            }
            let handed = out.iter().filter(|b| **b == b'\n').count();
            let stored = system
                .query("SELECT count(*) FROM plans")
                .ok()
                .and_then(|rows| rows.first().and_then(|n| n.parse::<usize>().ok()))
                .unwrap_or(0);
            if handed >= stored || no_writer || std::time::Instant::now() >= until {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        for line in String::from_utf8_lossy(&out).lines() {
            if let Ok(receipt) = serde_json::from_str::<serde_json::Value>(line)
                && let Some(id) = receipt["receipt_id"].as_str()
            {
                history.record(json!({"kind": "handed", "receipt_id": id}));
                handed.push(id.to_owned());
            }
        }
        handed
    })
}
