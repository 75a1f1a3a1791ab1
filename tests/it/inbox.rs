//! `follow --into`: every receipt exactly once in the ordering system's own
//! database. A follower is killed over and over while planners write (at
//! random instants, and aborted at every seam of its transaction: begun,
//! rows written, position written, committed), the consumer's Postgres is
//! restarted under it, and at the end the inbox equals the feed: each
//! receipt once, in feed order, byte for byte as sent, each verifying
//! offline under the service's key.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel::sql_types::Text;
use diesel::{PgConnection, SqliteConnection, sql_query};
use rand::{RngExt, SeedableRng};
use serde_json::value::RawValue;

use crate::evidence::generate_key;
use crate::support::TestDb;
use crate::support::cluster::TempCluster;
use crate::support::process::{BIN, ServeProcess, client, keep_plan, login_via_cli, run_cli_at};

/// Where a run aborts itself: each seam of the page's transaction, at
/// the first and the second transaction that writes (`lost`, the answer
/// to a COMMIT that landed, is tried apart: the run goes on).
const SEAMS: [&str; 4] = ["begun", "rows", "position", "committed"];

/// A signing service on SQLite, its planner writing until told to stop.
struct Fed {
    dir: tempfile::TempDir,
    _db: TestDb,
    service: ServeProcess,
    reader: String,
    /// The service's public key file, as `receipts verify` takes it.
    keys: PathBuf,
    stop: Arc<AtomicBool>,
    planner: Option<std::thread::JoinHandle<usize>>,
}

impl Fed {
    fn start() -> Self {
        let db = TestDb::sqlite();
        let dir = tempfile::tempdir().expect("temp dir");
        let key = generate_key(dir.path(), "k1");
        let key_arg = key.to_str().expect("utf-8 path");
        let service = ServeProcess::start_with(&db.url, &["--signing-key", key_arg]);
        let planner = login_via_cli(&db.url, "planner-a", "plans:submit");
        let reader = login_via_cli(&db.url, "orders", "receipts:read");
        let stop = Arc::new(AtomicBool::new(false));
        let writing = {
            let (addr, stop) = (service.addr.clone(), stop.clone());
            std::thread::spawn(move || {
                let agent = client();
                let mut written = 0;
                while !stop.load(Ordering::SeqCst) {
                    let run = format!("run-{written}");
                    let body = format!(
                        r#"{{"run_id":"{run}","approved_inputs":[{{"id":"forecast-v12"}}],"content":{{"run":"{run}"}}}}"#
                    );
                    keep_plan(&agent, &addr, &planner, &run, &body);
                    written += 1;
                    // A planner's pace, so that plans keep coming across
                    // the followers' runs rather than all before them.
                    std::thread::sleep(Duration::from_millis(5));
                }
                written
            })
        };
        Self {
            keys: PathBuf::from(format!("{}.pub", key.display())),
            dir,
            _db: db,
            service,
            reader,
            stop,
            planner: Some(writing),
        }
    }

    /// Stops the planner; how many plans it kept.
    fn stop_writing(&mut self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        self.planner
            .take()
            .map(|p| p.join().expect("the planner"))
            .unwrap_or_default()
    }

    /// `follow --into URL --from-start` in pages of `limit`.
    fn follower(&self, into: &str, limit: u32, more: &[&str], env: &[(&str, &str)]) -> Child {
        self.command(into, limit, more, env)
            .spawn()
            .expect("start a follower")
    }

    /// The follower's command, its output discarded.
    fn command(&self, into: &str, limit: u32, more: &[&str], env: &[(&str, &str)]) -> Command {
        let mut command = Command::new(BIN);
        command
            .args(["follow", "--into", into, "--from-start", "--wait-secs", "1"])
            .args(["--limit", &limit.to_string()])
            .args(more)
            .env("PLAN_INTAKE_URL", format!("http://{}", self.service.addr))
            .env("PLAN_INTAKE_TOKEN", &self.reader)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        command
    }

    /// The whole feed, each entry byte for byte: (receipt id, receipt).
    fn feed(&self) -> Vec<(String, String)> {
        let agent = client();
        let mut after: Option<String> = None;
        let mut entries = Vec::new();
        loop {
            let mut path = format!("http://{}/v1/receipts?limit=1000", self.service.addr);
            if let Some(after) = &after {
                path.push_str(&format!("&after={after}"));
            }
            let text = agent
                .get(&path)
                .set("Authorization", &format!("Bearer {}", self.reader))
                .call()
                .expect("a feed page")
                .into_string()
                .expect("the page");
            let page: plan_intake_client::wire::feed::FeedPage<Box<RawValue>> =
                serde_json::from_str(&text).expect("a feed page");
            if page.receipts.is_empty() {
                return entries;
            }
            for entry in &page.receipts {
                let id: serde_json::Value = serde_json::from_str(entry.get()).expect("a receipt");
                let id = id["receipt_id"].as_str().expect("an id").to_owned();
                entries.push((id, entry.get().to_owned()));
            }
            after = Some(page.next.as_str().to_owned());
        }
    }
}

/// Waits for `child` to end by itself (an abort at its seam, a drain), at
/// most `within`; kills it after that. Its exit status, if it ended.
fn ended(mut child: Child, within: Duration) -> Option<std::process::ExitStatus> {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if let Some(status) = child.try_wait().expect("wait for the follower") {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

#[derive(QueryableByName)]
struct InboxRow {
    #[diesel(sql_type = Text)]
    receipt_id: String,
    #[diesel(sql_type = Text)]
    receipt: String,
}

const IN_ORDER: &str = "SELECT receipt_id, receipt FROM plan_intake_inbox ORDER BY inbox_seq";

/// The inbox, in its own order: (receipt id, receipt).
pub(crate) fn inbox(url: &str) -> Vec<(String, String)> {
    let rows: Vec<InboxRow> = if url.starts_with("postgres") {
        let mut conn = PgConnection::establish(url).expect("the consumer's database");
        sql_query(IN_ORDER).load(&mut conn).expect("the inbox")
    } else {
        let mut conn = SqliteConnection::establish(url).expect("the consumer's database");
        sql_query(IN_ORDER).load(&mut conn).expect("the inbox")
    };
    rows.into_iter()
        .map(|r| (r.receipt_id, r.receipt))
        .collect()
}

/// Drains into the inbox until it holds `expected` receipts (a drain ends
/// at its first empty page, which may come before the feed settled).
fn drain_into(fed: &Fed, into: &str, more: &[&str], expected: usize) {
    let drain: Vec<&str> = more.iter().copied().chain(["--drain"]).collect();
    for _ in 0..20 {
        let status = ended(
            fed.follower(into, 100, &drain, &[]),
            Duration::from_secs(60),
        );
        assert!(
            status.is_some_and(|s| s.success()),
            "a drain ended {status:?}"
        );
        if inbox(into).len() >= expected {
            return;
        }
    }
}

/// The inbox equals the feed, and each row verifies offline.
fn assert_inbox_is_the_feed(fed: &Fed, into: &str, more: &[&str], seed: u64) {
    let feed = fed.feed();
    drain_into(fed, into, more, feed.len());
    let kept = inbox(into);
    let feed_ids: Vec<&str> = feed.iter().map(|(id, _)| id.as_str()).collect();
    let kept_ids: Vec<&str> = kept.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        kept_ids, feed_ids,
        "the inbox's receipts, then the feed's (seed {seed})"
    );
    assert_eq!(
        kept, feed,
        "each receipt byte for byte as sent (seed {seed})"
    );
    for (n, (id, receipt)) in kept.iter().enumerate() {
        let file = fed.dir.path().join(format!("{id}.json"));
        std::fs::write(&file, receipt).expect("write the receipt");
        if n + 1 == kept.len() {
            // The last one as an ordering system would: the command.
            let said = run_cli_at(
                "unused.db",
                &["receipts", "verify", path(&file), "--keys", path(&fed.keys)],
            );
            assert!(said.status.success(), "receipts verify: {said:?}");
        } else {
            plan_intake::evidence::verify(&file, &fed.keys, None)
                .unwrap_or_else(|e| panic!("row {n} ({id}) does not verify: {e}"));
        }
    }
}

fn path(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

/// Rows in the inbox now.
fn rows_in(url: &str) -> Option<i64> {
    const COUNT: &str = "SELECT count(*) AS n FROM plan_intake_inbox";
    let counted: QueryResult<Count> = if url.starts_with("postgres") {
        PgConnection::establish(url)
            .ok()
            .map_or(Err(diesel::result::Error::NotFound), |mut c| {
                sql_query(COUNT).get_result(&mut c)
            })
    } else {
        SqliteConnection::establish(url)
            .ok()
            .map_or(Err(diesel::result::Error::NotFound), |mut c| {
                sql_query(COUNT).get_result(&mut c)
            })
    };
    counted.ok().map(|c| c.n)
}

/// Waits until the inbox holds at least `rows` rows (polled: the state a
/// user sees), at most 60 s; whether it did.
fn grows_to(url: &str, rows: i64) -> bool {
    let until = Instant::now() + Duration::from_secs(60);
    while Instant::now() < until {
        if rows_in(url).is_some_and(|n| n >= rows) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// A follower that must still be running: no run ends by itself.
#[track_caller]
fn still_running(run: &mut Child, what: &str, seed: u64) {
    let ended = run.try_wait().expect("look at the follower");
    assert!(
        ended.is_none(),
        "{what}: the follower ended by itself, {ended:?} (seed {seed})"
    );
}

/// Runs followers into `into` (`owner`: the same inbox, read as its
/// owner) and ends each: one aborting at each seam of its first and second
/// transactions; one whose first and one whose second COMMIT's answer is
/// lost (it must go on, writing nothing twice); then `kills` killed at
/// random instants of up to `window_ms`, each still running when killed.
/// `midway`, once half of them are done, runs under a follower that has
/// kept a page, which must keep another after it.
fn kill_followers(
    fed: &Fed,
    into: &str,
    owner: &str,
    more: &[&str],
    kills: usize,
    window_ms: u64,
    midway: impl FnOnce(),
) -> u64 {
    let seed: u64 = rand::random();
    eprintln!("inbox kills: seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for nth in ["1", "2"] {
        for seam in SEAMS {
            let at = format!("{seam}:{nth}");
            let limit = rng.random_range(1..=7);
            let run = fed.follower(
                into,
                limit,
                more,
                &[("PLAN_INTAKE_TEST_INBOX_CRASH_AT", &at)],
            );
            let status = ended(run, Duration::from_secs(30));
            assert!(
                status.is_some_and(|s| !s.success()),
                "a follower told to abort at {at} ended {status:?} (seed {seed})"
            );
        }
    }
    for nth in 1..=2 {
        // A page a transaction: past the lost one only if its retry found
        // the page kept and wrote nothing.
        let before = rows_in(owner).expect("the inbox");
        let at = format!("lost:{nth}");
        let said = fed.dir.path().join(format!("lost-{nth}.log"));
        let mut run = fed
            .command(into, 1, more, &[("PLAN_INTAKE_TEST_INBOX_CRASH_AT", &at)])
            .stderr(std::fs::File::create(&said).expect("the follower's log"))
            .spawn()
            .expect("start a follower");
        assert!(
            grows_to(owner, before + nth + 1),
            "past a COMMIT whose answer was lost ({at}, seed {seed})"
        );
        still_running(&mut run, &at, seed);
        run.kill().expect("kill the follower");
        run.wait().expect("reap the follower");
        let said = std::fs::read_to_string(&said).unwrap_or_default();
        assert!(
            said.contains("(test seam) the COMMIT's answer was lost"),
            "the answer was lost ({at}): {said}"
        );
    }
    let mut midway = Some(midway);
    for n in 0..kills {
        let limit = rng.random_range(1..=20);
        let mut run = fed.follower(into, limit, more, &[]);
        if n == kills / 2
            && let Some(midway) = midway.take()
        {
            let before = rows_in(owner).expect("the inbox");
            assert!(
                grows_to(owner, before + 1),
                "a page kept before (seed {seed})"
            );
            midway();
            let after = rows_in(owner).unwrap_or(before + 1).max(before + 1);
            assert!(
                grows_to(owner, after + 1),
                "a page kept after, by the same follower (seed {seed})"
            );
            still_running(&mut run, "midway", seed);
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(0..window_ms)));
        still_running(&mut run, "before its kill", seed);
        run.kill().expect("kill the follower");
        run.wait().expect("reap the follower");
    }
    seed
}

/// Postgres, the consumer's own cluster, the follower under a role with
/// only the grants the README gives; restarted mid-run.
#[test]
fn a_follower_killed_anywhere_keeps_each_receipt_once_in_a_postgres_inbox() {
    let Some(cluster) = TempCluster::create() else {
        return;
    };
    let owner = format!("postgres://postgres@127.0.0.1:{}/postgres", cluster.port);
    let migrated = run_cli_at("unused.db", &["inbox", "migrate", "--into", &owner]);
    assert!(migrated.status.success(), "inbox migrate: {migrated:?}");
    // The README's grants, no more.
    cluster.psql(
        "CREATE ROLE orders_inbox LOGIN; \
         GRANT SELECT, INSERT ON plan_intake_inbox TO orders_inbox; \
         GRANT SELECT, UPDATE ON plan_intake_inbox_position TO orders_inbox",
    );
    let into = format!(
        "postgres://orders_inbox@127.0.0.1:{}/postgres",
        cluster.port
    );
    let mut fed = Fed::start();
    let seed = kill_followers(&fed, &into, &owner, &[], 100, 120, || {
        cluster
            .ctl(&["restart", "-m", "immediate"])
            .expect("restart the consumer's Postgres");
    });
    let written = fed.stop_writing();
    assert_inbox_is_the_feed(&fed, &owner, &[], seed);
    assert!(
        inbox(&owner).len() >= written,
        "the planner's {written} plans"
    );
}

/// SQLite: the same, on a file of the consumer's.
#[test]
fn a_follower_killed_anywhere_keeps_each_receipt_once_in_a_sqlite_inbox() {
    let mut fed = Fed::start();
    let into = fed.dir.path().join("orders.db");
    let into = path(&into).to_owned();
    let migrated = run_cli_at("unused.db", &["inbox", "migrate", "--into", &into]);
    assert!(migrated.status.success(), "inbox migrate: {migrated:?}");
    // Verifying and expanded: each page waits for its checkpoint, so the
    // kills come later.
    let keys = path(&fed.keys).to_owned();
    let more = ["--verify", "--keys", keys.as_str(), "--expand"];
    let seed = kill_followers(&fed, &into, &into, &more, 30, 400, || {});
    let written = fed.stop_writing();
    assert_inbox_is_the_feed(&fed, &into, &more, seed);
    let mut conn = SqliteConnection::establish(&into).expect("the inbox");
    let expanded: Count = sql_query(
        "SELECT count(*) AS n FROM plan_intake_inbox WHERE approved_inputs IS NOT NULL AND content IS NOT NULL",
    )
    .get_result(&mut conn)
    .expect("count");
    let verified: Count = sql_query(
        "SELECT verified_leaves AS n FROM plan_intake_inbox_position WHERE checkpoint IS NOT NULL",
    )
    .get_result(&mut conn)
    .expect("the verified position");
    let kept = inbox(&into).len() as i64;
    assert_eq!(
        expanded.n, kept,
        "every row with the plan's inputs and content"
    );
    assert_eq!(
        verified.n, kept,
        "the position: every row verified (seed {seed})"
    );
    // Its position emptied beside the rows it kept: no guess where to go on.
    sql_query("UPDATE plan_intake_inbox_position SET position = NULL")
        .execute(&mut conn)
        .expect("empty the position");
    let refused = fed
        .command(&into, 10, &more, &[])
        .stderr(Stdio::piped())
        .output()
        .expect("run the follower");
    assert_eq!(refused.status.code(), Some(65), "{refused:?}");
    assert_eq!(inbox(&into).len() as i64, kept, "nothing written");
    assert!(
        inbox(&into).len() >= written,
        "the planner's {written} plans"
    );
}
