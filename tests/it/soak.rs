//! The soak in the suite: two short runs side by side, one with a fixed
//! seed and one with a random seed (printed, to repeat it): two instances
//! on a Postgres database of their own under seeded planners, a follower
//! and the nemesis, the whole history checked at the end
//! (`crates/soak`). The long run is by hand: README, "The soak".

use crate::support::process::BIN;

fn soak(seed: u64) {
    if !crate::support::postgres_available() {
        return;
    }
    let mut server = url::Url::parse(&crate::support::postgres_base_url()).expect("a URL");
    server.set_path("");
    // Kept after the run (a failure's evidence): target/soak/.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/soak");
    std::fs::create_dir_all(&dir).expect("target/soak");
    let options = plan_intake_soak::Options {
        seed,
        seconds: 20,
        instances: 2,
        planners: 3,
        bin: BIN.into(),
        postgres: server.as_str().trim_end_matches('/').to_owned(),
        history: dir.join(format!("history-{seed}.jsonl")),
    };
    let outcome = plan_intake_soak::run(&options).expect("the soak ran");
    let said = outcome
        .violations
        .iter()
        .chain(&outcome.summary)
        .cloned()
        .collect::<Vec<_>>()
        .join("\n");
    eprintln!("{said}");
    assert!(
        outcome.violations.is_empty(),
        "{said}\n(history: {})",
        options.history.display()
    );
    let last = outcome.summary.last().expect("a summary");
    let acknowledged: u64 = last
        .split(", ")
        .find_map(|part| part.strip_suffix(" acknowledgements"))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(acknowledged > 100, "{said}");
    assert!(!last.contains(" 0 faults"), "the nemesis struck: {said}");
}

#[test]
fn a_short_soak_with_a_fixed_seed_keeps_every_promise() {
    soak(7);
}

#[test]
fn a_short_soak_with_a_random_seed_keeps_every_promise() {
    let seed = rand::random::<u64>() % 1_000_000;
    eprintln!(
        "soak: seed {seed} (its draws again: cargo run -p plan-intake-soak -- --seed {seed} --seconds 20 --planners 3)"
    );
    soak(seed);
}
