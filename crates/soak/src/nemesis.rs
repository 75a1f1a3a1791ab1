//! The nemesis: until the end of the run, every 1-4 s, one fault drawn at
//! random on an instance drawn at random: kill -9 (started again), a
//! SIGSTOP of 1-5 s (a long GC pause, a frozen VM: its transactions and
//! key rows held meanwhile), or a graceful restart. Each is recorded with
//! how long the instance took to answer `/readyz` again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{RngExt, SeedableRng};
use serde_json::json;

use crate::history::History;
use crate::system::System;

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

pub fn run(system: Arc<System>, history: Arc<History>, seed: u64, until: Instant) -> Faults {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut faults = Faults {
        recovered: BTreeMap::new(),
    };
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(rng.random_range(1_000..4_000)));
        if Instant::now() >= until {
            break;
        }
        let instance = rng.random_range(0..system.count());
        let kind = match rng.random_range(0..3) {
            0 => "kill -9",
            1 => "SIGSTOP",
            _ => "graceful restart",
        };
        let paused = Duration::from_millis(rng.random_range(1_000..5_000));
        history
            .record(json!({"kind": "fault", "fault": kind, "instance": instance, "begins": true}));
        let began = Instant::now();
        let done = match kind {
            "kill -9" => system.kill_9(instance),
            "SIGSTOP" => {
                system.pause(instance);
                std::thread::sleep(paused);
                system.resume(instance);
                system.await_ready(instance, Duration::from_secs(30))
            }
            _ => system.restart(instance),
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
