//! The nemesis: until the end of the run, every 1-4 s, one step drawn at
//! random (`KINDS`): on an instance drawn at random, kill -9 (started
//! again), a SIGSTOP of 1-20 s (a long GC pause, a frozen VM: on Postgres
//! as a statement writing plans leaves it, so mid-batch), a graceful
//! restart, or on
//! Postgres its connections to the database (through a fault proxy) cut,
//! cut right after one forwarded a `COMMIT` (its outcome unknown to the
//! instance), or stalled for 1-5 s; with the soak's own primary and
//! standby, the primary restarted immediately (a crash) or a failover to
//! the synchronous standby, the old primary rebuilt as the new standby;
//! kill -9
//! of a reader (started again); or the routine, on the live system:
//! `logins rotate` of a planner's login while it sends, `keys prune`,
//! `migrate run`, `audit` and `verify`, each of which must succeed, and a
//! signing-key rotation across the instances in the documented order. Each is
//! recorded with how long until its instance answered `/readyz` again (a
//! command: how long it took).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{RngExt, SeedableRng};
use serde_json::json;

use crate::history::History;
use crate::system::System;
use crate::workload;

pub struct Faults {
    /// Per kind, the time from each fault until its instance was ready.
    recovered: BTreeMap<&'static str, Vec<Duration>>,
}

impl Faults {
    pub fn count(&self) -> usize {
        self.recovered.values().map(Vec::len).sum()
    }

    pub fn kinds(&self) -> usize {
        self.recovered.len()
    }

    /// One line per kind: p50, p99 and max of the time to ready again.
    pub fn recovery_lines(&self) -> Vec<String> {
        self.recovered
            .iter()
            .map(|(kind, times)| {
                let mut sorted = times.clone();
                sorted.sort();
                let at = |p: f64| {
                    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
                    sorted.get(i).map_or(0.0, Duration::as_secs_f64)
                };
                format!(
                    "soak: {kind}: {} faults, ready again after p50 {:.2} s, p99 {:.2} s, max {:.2} s",
                    sorted.len(),
                    at(0.5),
                    at(0.99),
                    at(1.0)
                )
            })
            .collect()
    }
}

/// What the nemesis draws from, with weights: faults of an instance,
/// a reader killed, and the routine an operator runs on a live system.
const KINDS: [(&str, u32); 18] = [
    ("kill -9", 15),
    ("SIGSTOP", 15),
    ("graceful restart", 15),
    ("database connections cut", 8),
    ("cut after a COMMIT", 12),
    ("database connections stalled", 8),
    ("a kept plan under a held key", 6),
    ("PgBouncer kill -9", 5),
    ("primary restarted immediately", 4),
    ("failover to the synchronous standby", 4),
    ("failover after cancelled standby waits", 3),
    ("kill -9 of a reader", 15),
    ("logins rotate", 8),
    ("keys prune", 5),
    ("migrate run", 4),
    ("audit", 4),
    ("verify", 4),
    ("signing key rotation", 2),
];

/// Kinds that act on the soak's own primary and standby.
fn needs_the_pair(kind: &str) -> bool {
    kind.contains("primary") || kind.contains("standby")
}

/// The kinds the nemesis knows, for `--faults`.
pub fn kinds() -> Vec<&'static str> {
    KINDS.iter().map(|(kind, _)| *kind).collect()
}

/// Runs until `until`, drawing from `only` (every kind when empty).
pub fn run(
    system: Arc<System>,
    history: Arc<History>,
    seed: u64,
    until: Instant,
    only: &[String],
) -> Faults {
    let kinds: Vec<(&str, u32)> = KINDS
        .iter()
        .filter(|(kind, _)| only.is_empty() || only.iter().any(|o| o == kind))
        // The database's connections pass through a proxy on Postgres only.
        .filter(|(kind, _)| {
            !system.proxies.is_empty()
                || !kind.contains("database connections")
                    && !kind.contains("COMMIT")
                    && !kind.contains("held key")
        })
        .filter(|(kind, _)| system.pgbouncer.is_some() || !kind.starts_with("PgBouncer"))
        // A primary to restart and a standby to fail over to: the soak's own.
        .filter(|(kind, _)| system.pair.is_some() || !needs_the_pair(kind))
        .copied()
        .collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut faults = Faults {
        recovered: BTreeMap::new(),
    };
    let mut rotations = 0;
    let mut struck = 0;
    let total: u32 = kinds.iter().map(|(_, w)| w).sum::<u32>().max(1);
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(rng.random_range(1_000..4_000)));
        if let Err(error) = system.keep_readers_running() {
            history.record(json!({"kind": "fault", "fault": "reader start", "error": error}));
        }
        if Instant::now() >= until {
            break;
        }
        let instance = rng.random_range(0..system.count());
        let mut draw = rng.random_range(0..total);
        let drawn = kinds
            .iter()
            .find(|(_, weight)| {
                if draw < *weight {
                    true
                } else {
                    draw -= weight;
                    false
                }
            })
            .map_or("kill -9", |(kind, _)| *kind);
        // Kinds picked by name come once each first, in their order, so a
        // short run meets every one of them; then they are drawn.
        let kind = if only.is_empty() {
            drawn
        } else {
            kinds.get(struck).map_or(drawn, |(kind, _)| *kind)
        };
        struck += 1;
        let paused = Duration::from_millis(rng.random_range(1_000..5_000));
        // A long GC pause or a frozen VM: up to 20 s.
        let frozen_for = Duration::from_millis(rng.random_range(1_000..20_000));
        let reader = rng.random_range(0..system.readers.len().max(1));
        let planner = rng.random_range(
            0..system
                .planner_tokens
                .lock()
                .map(|t| t.len())
                .unwrap_or(1)
                .max(1),
        );
        history
            .record(json!({"kind": "fault", "fault": kind, "instance": instance, "begins": true}));
        let began = Instant::now();
        let keys = system.keys.display().to_string();
        let routine = |args: &[&str]| match system.cli_status(args) {
            (Some(0), _) => Ok(()),
            (code, said) => Err(format!(
                "plan-intake {} ended {code:?}: {said}",
                args.join(" ")
            )),
        };
        let done = match kind {
            "kill -9" => system.kill_9(instance),
            "SIGSTOP" => {
                // On Postgres, mid-batch: frozen as its next statement
                // writing plans leaves for the database (its answer then
                // waits out the pause), else (none within 5 s, or SQLite,
                // where a stop mid-write holds the database's lock) now.
                let frozen = system.proxies.get(instance).is_some_and(|(proxy, _)| {
                    let pid = system.pid(instance);
                    proxy.at_next_write(
                        Duration::from_secs(5),
                        Box::new(move || {
                            if let Some(pid) = pid {
                                // SAFETY: kill(2) on the instance's pid, a
                                // child the soak has not reaped.
                                unsafe {
                                    libc::kill(pid, libc::SIGSTOP);
                                }
                            }
                        }),
                    )
                });
                if !frozen {
                    system.pause(instance);
                }
                history.record(json!({"kind": "stop", "instance": instance, "mid_batch": frozen, "pause_s": frozen_for.as_secs_f64()}));
                std::thread::sleep(frozen_for);
                system.resume(instance);
                system.await_ready(instance, Duration::from_secs(30))
            }
            "graceful restart" => system.restart(instance),
            "database connections cut" => {
                system.proxies[instance].0.cut_all();
                system.await_ready(instance, Duration::from_secs(30))
            }
            "cut after a COMMIT" => {
                // Its planners keep it writing: a COMMIT comes within seconds.
                let fired = system.proxies[instance]
                    .0
                    .cut_at_next_commit(Duration::from_secs(5));
                history.record(json!({"kind": "commit cut", "instance": instance, "fired": fired}));
                system.await_ready(instance, Duration::from_secs(30))
            }
            "PgBouncer kill -9" => match &system.pgbouncer {
                Some(bouncer) => bouncer
                    .kill_9_and_restart()
                    .and_then(|()| system.await_ready(system.count() - 1, Duration::from_secs(30))),
                None => Ok(()),
            },
            "primary restarted immediately" => match &system.pair {
                Some(pair) => pair
                    .restart_primary_immediately()
                    .and_then(|()| system.all_ready(Duration::from_secs(60))),
                None => Ok(()),
            },
            "failover to the synchronous standby" => match &system.pair {
                Some(pair) => pair
                    .fail_over()
                    .and_then(|()| system.all_ready(Duration::from_secs(60))),
                None => Ok(()),
            },
            "failover after cancelled standby waits" => match &system.pair {
                Some(pair) => pair
                    .fail_over_after_cancelled_waits()
                    .map(|cancelled| {
                        history.record(json!({"kind": "waits cancelled", "cancelled": cancelled}));
                    })
                    .and_then(|()| system.all_ready(Duration::from_secs(60))),
                None => Ok(()),
            },
            "a kept plan under a held key" => {
                workload::send_under_held_keys(
                    &system,
                    &history,
                    instance,
                    struck as u64,
                    // The first key held 1-2 s, the last let go 3-6.5 s on.
                    paused / 3 + Duration::from_millis(700),
                )
                .map(|sent| {
                    history.record(json!({"kind": "held key", "sent": sent}));
                })
            }
            "database connections stalled" => {
                system.proxies[instance].0.stall(paused);
                system.await_ready(instance, Duration::from_secs(30))
            }
            "kill -9 of a reader" => system.kill_reader(reader),
            "logins rotate" => system.rotate_planner(planner),
            "keys prune" => routine(&["keys", "prune", "--older-than", "30d"]),
            "migrate run" => routine(&["migrate", "run"]),
            "audit" => routine(&["audit", "--keys", &keys]),
            "signing key rotation" => {
                rotations += 1;
                system.rotate_signing_key(rotations)
            }
            _ => routine(&["verify"]),
        };
        let took = began.elapsed();
        history.record(json!({
            "kind": "fault",
            "fault": kind,
            "instance": instance,
            "ready_after_s": took.as_secs_f64(),
            "error": done.err(),
        }));
        faults.recovered.entry(kind).or_default().push(took);
    }
    faults
}
