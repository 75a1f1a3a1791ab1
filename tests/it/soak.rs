//! The soak in the suite: runs of 15 s side by side, with a fixed seed on
//! Postgres (a primary and a synchronous standby of the soak's own) and on
//! SQLite and with a random seed on Postgres (printed, to repeat it), and
//! 20 s of the database's own faults (the primary restarted immediately,
//! failovers), the whole history checked at the end (`crates/soak`); and
//! short runs with a known defect switched on, which the checker must
//! report. The long run is by hand: README, "The soak".

use crate::support::process::BIN;

/// Where a soak's database is (`plan_intake_soak::Database`, the shared
/// server's URL filled in).
#[derive(Clone, Copy)]
enum Backend {
    /// A primary and a synchronous standby of the soak's own.
    Replicated,
    /// The same with the standby asynchronous and behind at each failover.
    ReplicatedLossy,
    /// A database on the suite's Postgres server.
    Server,
    Sqlite,
}

/// The violations and the summary, one line each.
fn said(outcome: &plan_intake_soak::Outcome) -> String {
    outcome
        .violations
        .iter()
        .chain(&outcome.summary)
        .cloned()
        .collect::<Vec<_>>()
        .join("\n")
}

fn soak(seed: u64, backend: Backend) {
    // With the failovers' and the defects' soaks, Postgres soaks for more
    // than a minute in all.
    soak_of(seed, 15, &[], backend);
}

/// A soak of `seconds` drawing from `faults` (every kind when empty) that
/// must keep every promise.
fn soak_of(seed: u64, seconds: u64, faults: &[&str], backend: Backend) -> String {
    let Some(outcome) = soak_with(seed, seconds, &[], faults, backend) else {
        return String::new();
    };
    let said = said(&outcome);
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
    said
}

/// A soak of `seconds` (its history kept in target/soak/); `None` without
/// Postgres.
fn soak_with(
    seed: u64,
    seconds: u64,
    env: &[(&str, &str)],
    faults: &[&str],
    backend: Backend,
) -> Option<plan_intake_soak::Outcome> {
    let sqlite = matches!(backend, Backend::Sqlite);
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
        database: match backend {
            Backend::Replicated => plan_intake_soak::Database::Replicated,
            Backend::ReplicatedLossy => plan_intake_soak::Database::ReplicatedLossy,
            Backend::Server => {
                plan_intake_soak::Database::Server(server.as_str().trim_end_matches('/').to_owned())
            }
            Backend::Sqlite => plan_intake_soak::Database::Sqlite,
        },
        history: dir.join(format!(
            "history-{seed}-{}-{}-{}.jsonl",
            env.len(),
            faults.len(),
            match backend {
                Backend::Replicated => "replicated",
                Backend::ReplicatedLossy => "lossy",
                Backend::Server => "server",
                Backend::Sqlite => "sqlite",
            }
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
    soak(7, Backend::Replicated);
}

/// One instance on a SQLite file, under the same planners, readers and
/// nemesis.
#[test]
fn a_short_soak_on_sqlite_keeps_every_promise() {
    soak(7, Backend::Sqlite);
}

#[test]
fn a_short_soak_with_a_random_seed_keeps_every_promise() {
    let seed = rand::random::<u64>() % 1_000_000;
    eprintln!(
        "soak: seed {seed} (its draws again: cargo run -p plan-intake-soak -- --seed {seed} --seconds 15 --planners 3)"
    );
    soak(seed, Backend::Replicated);
}

/// The database's own faults under load, each at least once: the primary
/// crashed and recovered; a failover to the synchronous standby (the old
/// primary rebuilt as the new standby); and one after the link between
/// the nodes is held and every commit waiting for the standby cancelled
/// (committed on the primary alone, their sessions told they succeeded).
/// Nothing acknowledged may be lost, and the log and the readers go on
/// across each new timeline.
#[test]
fn a_soak_of_primary_restarts_and_failovers_keeps_every_promise() {
    let said = soak_of(
        19,
        20,
        &[
            "primary restarted immediately",
            "failover to the synchronous standby",
            "failover after cancelled standby waits",
        ],
        Backend::Replicated,
    );
    if said.is_empty() {
        return;
    }
    for kind in [
        "primary restarted immediately: ",
        "failover to the synchronous standby: ",
        "failover after cancelled standby waits: ",
    ] {
        assert!(said.contains(kind), "{kind}: {said}");
    }
    // Further down: how many waits were cancelled, which must be some.
    let cancelled = said
        .split("waits for the standby cancelled: ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next()?.parse::<u64>().ok());
    assert!(cancelled.is_some_and(|n| n > 0), "{said}");
    assert!(said.contains("its standby in sync"), "{said}");
    // Each failover promoted the standby: a new timeline each.
    let number_after = |text: &str| -> Option<u64> {
        let at = said.find(text)? + text.len();
        said[at..].split([' ', ',']).next()?.parse().ok()
    };
    let failovers = number_after("failover to the synchronous standby: ")
        .zip(number_after("failover after cancelled standby waits: "))
        .map(|(plain, cancelled)| plain + cancelled);
    let timeline = number_after("on timeline ");
    assert_eq!(timeline, failovers.map(|n| n + 1), "{said}");
}

/// The control for the test above, so what it shows is the synchronous
/// standby's: the same failovers to a standby that is asynchronous and a
/// second behind lose acknowledged plans, and the checker says so.
#[test]
fn a_soak_finds_the_plans_a_lossy_failover_lost() {
    let Some(outcome) = soak_with(
        19,
        10,
        &[],
        &["failover to the synchronous standby"],
        Backend::ReplicatedLossy,
    ) else {
        return;
    };
    let said = said(&outcome);
    eprintln!(
        "{} violations; {}",
        outcome.violations.len(),
        outcome.summary.join("\n")
    );
    let found = |what: &dyn Fn(&String) -> bool| outcome.violations.iter().any(what);
    assert!(
        found(&|v| v.contains("acknowledged receipt") && v.ends_with("is not stored")),
        "the loss found: {said}"
    );
    // A key the lost plan was sent under, sent again, lands anew: a
    // second receipt for one key.
    assert!(found(&|v| v.contains("answered 2 receipts")), "{said}");
    // The verifying reader had verified past what the failover lost: it
    // stops with 76, following or draining at the end.
    assert!(
        found(&|v| v.starts_with("violation: seed 19: reader verify")
            && v.contains("ended exit status: 76")),
        "{said}"
    );
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
        Backend::Server,
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

/// The checker can fail: with the write function as before migration
/// 000016 (no lock on `plans` of its own, so the feed's horizon is not
/// held while a batch that found its plan kept waits for a key row), a
/// kept plan sent again under a key another session holds lets the rest
/// of its batch commit behind what readers were handed, and a short soak
/// of such sends reports the receipts the readers missed.
#[test]
fn a_soak_finds_a_batch_written_behind_the_readers() {
    let Some(outcome) = soak_with(
        17,
        8,
        &[("PLAN_INTAKE_TEST_DEFECT_NO_HORIZON_LOCK", "1")],
        &["a kept plan under a held key"],
        Backend::Server,
    ) else {
        return;
    };
    let said = said(&outcome);
    assert!(
        outcome
            .violations
            .iter()
            .any(|v| v.contains("handed on") && v.contains(" missing")),
        "the defect found: {said}"
    );
}

/// The control for the test above: the same seed and sends under held
/// keys, with the write function as shipped, keep every promise.
#[test]
fn a_soak_of_kept_plans_under_held_keys_keeps_every_promise() {
    let said = soak_of(17, 8, &["a kept plan under a held key"], Backend::Server);
    if said.is_empty() {
        return;
    }
    assert!(said.contains("a kept plan under a held key: "), "{said}");
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
        Backend::Server,
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
    let Some(outcome) = soak_with(13, 12, &[], &["kill -9 of a reader"], Backend::Server) else {
        return;
    };
    let said = said(&outcome);
    assert!(outcome.violations.is_empty(), "{said}");
    assert!(
        said.contains("kill -9 of a reader: "),
        "readers were killed: {said}"
    );
}
