//! The soak in the suite: runs of 30 s side by side, with a fixed seed on
//! Postgres and on SQLite and with a random seed on Postgres (printed, to
//! repeat it), the whole history checked at the end (`crates/soak`); and
//! short runs with a known defect switched on, which the checker must
//! report. The long run is by hand: README, "The soak".

use crate::support::process::BIN;

fn soak(seed: u64, sqlite: bool) {
    // Together the fixed and the random seed soak Postgres for a minute.
    let Some(outcome) = soak_with(seed, 30, &[], &[], sqlite) else {
        return;
    };
    let said = outcome
        .violations
        .iter()
        .chain(&outcome.summary)
        .cloned()
        .collect::<Vec<_>>()
        .join("\n");
    eprintln!("{said}");
    assert!(outcome.violations.is_empty(), "{said}");
    let last = outcome.summary.last().expect("a summary");
    let acknowledged: u64 = last
        .split(", ")
        .find_map(|part| part.strip_suffix(" acknowledgements"))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(acknowledged > 100, "{said}");
    assert!(!last.contains(" 0 faults"), "the nemesis struck: {said}");
}

/// A soak of `seconds` (its history kept in target/soak/); `None` without
/// Postgres.
fn soak_with(
    seed: u64,
    seconds: u64,
    env: &[(&str, &str)],
    faults: &[&str],
    sqlite: bool,
) -> Option<plan_intake_soak::Outcome> {
    if !sqlite && !crate::support::postgres_available() {
        return None;
    }
    let mut server = url::Url::parse(&crate::support::postgres_base_url()).expect("a URL");
    server.set_path("");
    // Kept after the run (a failure's evidence): target/soak/.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/soak");
    std::fs::create_dir_all(&dir).expect("target/soak");
    let options = plan_intake_soak::Options {
        seed,
        seconds,
        instances: 2,
        planners: 3,
        bin: BIN.into(),
        postgres: (!sqlite).then(|| server.as_str().trim_end_matches('/').to_owned()),
        history: dir.join(format!(
            "history-{seed}-{}-{}{}.jsonl",
            env.len(),
            faults.len(),
            if sqlite { "-sqlite" } else { "" }
        )),
        env: env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        faults: faults.iter().map(|f| (*f).to_owned()).collect(),
        pgbouncer: true,
    };
    let outcome = plan_intake_soak::run(&options).expect("the soak ran");
    if !outcome.violations.is_empty() {
        eprintln!("(history: {})", options.history.display());
    }
    Some(outcome)
}

#[test]
fn a_short_soak_with_a_fixed_seed_keeps_every_promise() {
    soak(7, false);
}

/// One instance on a SQLite file, under the same planners, readers and
/// nemesis.
#[test]
fn a_short_soak_on_sqlite_keeps_every_promise() {
    soak(7, true);
}

#[test]
fn a_short_soak_with_a_random_seed_keeps_every_promise() {
    let seed = rand::random::<u64>() % 1_000_000;
    eprintln!(
        "soak: seed {seed} (its draws again: cargo run -p plan-intake-soak -- --seed {seed} --seconds 30 --planners 3)"
    );
    soak(seed, false);
}

/// The checker can fail: with a known defect switched on (a replay
/// answered with a receipt of its own, `test-seams`), a short soak
/// reports it.
#[test]
fn a_soak_finds_a_replay_answered_with_a_new_receipt() {
    let Some(outcome) = soak_with(
        11,
        8,
        &[("PLAN_INTAKE_TEST_DEFECT_NEW_RECEIPT_ON_REPLAY", "1")],
        &[],
        false,
    ) else {
        return;
    };
    let said = outcome.violations.join("\n");
    assert!(
        outcome
            .violations
            .iter()
            .any(|v| v.contains("receipts: {") || v.contains("is not stored")),
        "the defect found: {said}\n{}",
        outcome.summary.join("\n")
    );
}

/// The checker can fail: with a reader's cursor saved before its page is
/// handed on (`test-seams`), a reader killed while its consumer works on a
/// page loses that page, and a short soak of reader kills reports it.
#[test]
fn a_soak_finds_a_cursor_saved_before_its_page() {
    let Some(outcome) = soak_with(
        13,
        12,
        &[("PLAN_INTAKE_TEST_DEFECT_CURSOR_BEFORE_PAGE", "1")],
        &["kill -9 of a reader"],
        false,
    ) else {
        return;
    };
    let said = outcome.violations.join("\n");
    assert!(
        outcome
            .violations
            .iter()
            .any(|v| v.contains("reader exec handed on") && v.contains(" missing")),
        "the defect found: {said}\n{}",
        outcome.summary.join("\n")
    );
}

/// The control for the test above: the same seed and reader kills
/// without the defect keep every promise, so what it reports is the
/// defect's.
#[test]
fn a_soak_of_reader_kills_alone_keeps_every_promise() {
    let Some(outcome) = soak_with(13, 12, &[], &["kill -9 of a reader"], false) else {
        return;
    };
    let said = outcome
        .violations
        .iter()
        .chain(&outcome.summary)
        .cloned()
        .collect::<Vec<_>>()
        .join("\n");
    assert!(outcome.violations.is_empty(), "{said}");
    assert!(
        said.contains("kill -9 of a reader: "),
        "readers were killed: {said}"
    );
}
