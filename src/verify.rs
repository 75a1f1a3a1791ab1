//! `plan-intake verify`: checks, against the configured backend, that the
//! database upholds the guarantees. Contention and the blank-run rule are
//! tried in a scratch store of its own, always removed afterwards; the
//! schema's names and migrations are read from the configured database.

use std::io::Write;
use std::process::{Command, Stdio};

use diesel::RunQueryDsl;

use crate::intake::login::LoginError;
use crate::intake::{IdempotencyKey, Intake, Permission, RetryPolicy, SubmitError, body};
use crate::metrics::Metrics;
use crate::storage::catalog;
use crate::storage::{
    Backend, Database, DatabaseTarget, DbConn, MigrateOnOpen, PoolOptions, ScratchSchema,
    StorageError, migrations,
};
use crate::with_conn;

/// Processes that race for one key.
pub const CONTENDERS: usize = 8;
const CONTENDER_LOGIN: &str = "verify-contender";
const CONTENDER_KEY: &str = "verify-one-key";
/// What a contender prints once it is set up, before it waits for the gate.
const CONTENDER_READY: &str = "ready";
/// How a contender gets its login's token (never on a command line).
const CONTENDER_TOKEN_VAR: &str = "PLAN_INTAKE_VERIFY_TOKEN";
const CONTENDER_BODY: &str = r#"{"run_id":"verify-run","approved_inputs":[{"id":"verify-input"}],"content":{"verify":true}}"#;

pub struct Check {
    pub name: &'static str,
    /// What was found: what holds, or why the check failed.
    pub result: Result<String, VerifyError>,
}

/// A check that failed: the guarantee was found broken, or the check could
/// not be made (with its cause).
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// The check ran and found a guarantee broken; the finding says how.
    #[error("{0}")]
    Broken(String),
    #[error("{what}")]
    CouldNot {
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error(transparent)]
    Query(#[from] diesel::result::Error),
    #[error(transparent)]
    Login(#[from] LoginError),
    #[error(transparent)]
    Submit(#[from] SubmitError),
    /// The report could not be written: stdout is closed, full or a
    /// broken pipe.
    #[error("cannot write the report to stdout")]
    Output(#[source] std::io::Error),
}

impl VerifyError {
    fn could_not(
        what: &'static str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        VerifyError::CouldNot {
            what,
            source: source.into(),
        }
    }
}

/// A check of the database through one connection: what it found.
type DatabaseCheck = fn(&mut DbConn) -> Result<String, VerifyError>;

/// Runs every check, printing one line each; returns how many failed.
pub fn run(url: &str) -> Result<usize, VerifyError> {
    let target = DatabaseTarget::parse(url)?;
    let options = PoolOptions {
        max_size: 2,
        ..PoolOptions::default()
    };
    let configured = Database::open(url, &options, MigrateOnOpen::Skip)?;
    let mut conn = configured.conn()?;

    let on_the_database: [(&'static str, DatabaseCheck); 5] = [
        ("migrations applied", migrations_applied),
        ("pinned names", pinned_names),
        ("feed positions behind the next write", feed_invariant),
        ("key rows match their plans", keys_match_their_plans),
        ("transaction isolation", isolation),
    ];
    let mut checks: Vec<Check> = on_the_database
        .into_iter()
        .map(|(name, check)| Check {
            name,
            result: check(&mut conn),
        })
        .collect();
    match Scratch::create(&target) {
        Ok(scratch) => {
            checks.push(Check {
                name: "blank run refused by the table (in verify's own scratch store)",
                result: blank_run_refused(scratch.url()),
            });
            checks.push(Check {
                name: "one winner among contending processes (in verify's own scratch store)",
                result: one_winner(scratch.url()),
            });
        }
        Err(e) => checks.push(Check {
            name: "scratch store",
            result: Err(e),
        }),
    }

    let mut failed = 0;
    for check in &checks {
        let line = match &check.result {
            Ok(detail) => format!("ok    {}: {detail}", check.name),
            Err(e) => {
                failed += 1;
                format!("FAIL  {}: {}", check.name, crate::report::chain(e))
            }
        };
        crate::stdout::line(&line).map_err(VerifyError::Output)?;
    }
    Ok(failed)
}

fn migrations_applied(conn: &mut DbConn) -> Result<String, VerifyError> {
    let pending = migrations::pending(conn)?;
    if pending.is_empty() {
        Ok("none pending".to_owned())
    } else {
        Err(VerifyError::Broken(format!(
            "pending: {}",
            pending.join(", ")
        )))
    }
}

/// A key row holds the request hash of the request it was first answered
/// for, and points at that request's plan: both hashes are the same one
/// (the same maker, run and content make the same request).
fn keys_match_their_plans(conn: &mut DbConn) -> Result<String, VerifyError> {
    match crate::storage::plans::keys_not_matching_their_plans(conn)? {
        0 => Ok("every key's request hash is its plan's".to_owned()),
        n => Err(VerifyError::Broken(format!(
            "{n} key row(s) hold a request hash other than their plan's: \
             a key there would replay a receipt for a request it never kept"
        ))),
    }
}

/// The isolation the service's guarantees rely on: READ COMMITTED, which
/// it pins on each of its Postgres sessions; said when the database's or
/// role's default is another (other clients run at that one, and behind a
/// transaction pooler the service refuses to start).
fn isolation(conn: &mut DbConn) -> Result<String, VerifyError> {
    match conn {
        DbConn::Sqlite(_) => Ok("SQLite: one writer at a time, serializable".to_owned()),
        DbConn::Postgres(pg) => {
            let default = crate::storage::default_isolation(pg)
                .map_err(|e| VerifyError::could_not("read default_transaction_isolation", e))?;
            Ok(if default == crate::storage::READ_COMMITTED {
                "the database's and role's default is read committed, as the service's sessions run"
                    .to_owned()
            } else {
                format!(
                    "the database's or role's default_transaction_isolation is '{default}': the service pins read committed on each of its sessions (behind a transaction pooler, where it cannot, it refuses to start)"
                )
            })
        }
    }
}

fn feed_invariant(conn: &mut DbConn) -> Result<String, VerifyError> {
    match crate::storage::feed::feed_invariant(conn)? {
        Ok(()) => Ok("every stored position is behind the next write's".to_owned()),
        Err((highest, next)) => Err(VerifyError::Broken(format!(
            "a stored feed position ({highest}) is not behind the next write's ({next}): \
             new receipts would sort before readers' cursors"
        ))),
    }
}

fn pinned_names(conn: &mut DbConn) -> Result<String, VerifyError> {
    let live = catalog::live_names(conn)?;
    let pinned = catalog::pinned_names();
    let missing: Vec<String> = pinned
        .iter()
        .filter(|n| !live.contains(n))
        .map(|(t, n)| format!("{t}.{n}"))
        .collect();
    let unexpected: Vec<String> = live
        .iter()
        .filter(|n| !pinned.contains(n))
        .map(|(t, n)| format!("{t}.{n}"))
        .collect();
    if missing.is_empty() && unexpected.is_empty() {
        Ok(format!("{} names match", pinned.len()))
    } else {
        Err(VerifyError::Broken(format!(
            "missing [{}], unexpected [{}]",
            missing.join(", "),
            unexpected.join(", ")
        )))
    }
}

fn blank_run_refused(url: &str) -> Result<String, VerifyError> {
    let db = Database::open(url, &PoolOptions::default(), MigrateOnOpen::Skip)?;
    let mut conn = db.conn()?;
    let tab = match conn.backend() {
        Backend::Postgres => "chr(9)",
        Backend::Sqlite => "char(9)",
    };
    let mut stored = Vec::new();
    for run in ["NULL", "''", "'   '", tab] {
        let sql = format!(
            "INSERT INTO plans (receipt_id, maker, run_id, content_hash, request_hash, content,
                                approved_inputs, permissions, received_at)
             VALUES ('rcpt_verify_blank', 'verify', {run}, 'h', 'h', '{{}}', '[]', '[]', '2026-01-01 00:00:00')"
        );
        if with_conn!(&mut *conn, c => diesel::sql_query(&sql).execute(c)).is_ok() {
            stored.push(run);
        }
    }
    if stored.is_empty() {
        Ok("NULL, empty, spaces and tab all refused".to_owned())
    } else {
        Err(VerifyError::Broken(format!(
            "the table stored run_id = {}",
            stored.join(", ")
        )))
    }
}

/// Starts `CONTENDERS` real processes that submit one plan under one key at
/// the same moment; exactly one may create it.
fn one_winner(url: &str) -> Result<String, VerifyError> {
    let db = Database::open(url, &PoolOptions::default(), MigrateOnOpen::Skip)?;
    let mut conn = db.conn()?;
    let token =
        crate::intake::login::create(&mut conn, CONTENDER_LOGIN, &[Permission::PlansSubmit])?;
    let exe = std::env::current_exe()
        .map_err(|e| VerifyError::could_not("cannot find this binary", e))?;
    let mut contenders = Contenders(Vec::new());
    for _ in 0..CONTENDERS {
        // The URL (and any password in it) goes by the environment, never
        // on a command line other users can read.
        let child = Command::new(&exe)
            .arg("verify-contender")
            .env("DATABASE_URL", url)
            .env(CONTENDER_TOKEN_VAR, &token)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| VerifyError::could_not("cannot start a contender", e))?;
        contenders.0.push(child);
    }
    // The start gate, a real barrier: each process says `ready` once it is
    // connected, signed in and holding its parsed plan; only when all have
    // said so is any told to go.
    let mut answers = Vec::new();
    for child in &mut contenders.0 {
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| VerifyError::Broken("a contender has no output to read".to_owned()))?;
        let mut reader = std::io::BufReader::new(stdout);
        let mut line = String::new();
        std::io::BufRead::read_line(&mut reader, &mut line)
            .map_err(|e| VerifyError::could_not("cannot read a contender", e))?;
        if line.trim() != CONTENDER_READY {
            return Err(VerifyError::Broken(format!(
                "a contender did not get ready: {}",
                contender_stderr(child)
            )));
        }
        answers.push(reader);
    }
    for child in &mut contenders.0 {
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(b"go\n");
        }
    }
    let mut outcomes = Vec::new();
    for mut answer in answers {
        let Some(mut child) = contenders.next() else {
            break;
        };
        let mut said = String::new();
        std::io::Read::read_to_string(&mut answer, &mut said)
            .map_err(|e| VerifyError::could_not("cannot read a contender", e))?;
        let status = child
            .wait()
            .map_err(|e| VerifyError::could_not("cannot wait for a contender", e))?;
        if !status.success() {
            return Err(VerifyError::Broken(format!(
                "a contender failed: {}",
                contender_stderr(&mut child)
            )));
        }
        outcomes.push(said.trim().to_owned());
    }
    let created = outcomes.iter().filter(|o| *o == "created").count();
    let replayed = outcomes.iter().filter(|o| *o == "replayed").count();
    let plans = count(&mut conn, "plans")?;
    if created == 1 && replayed == CONTENDERS - 1 && plans == 1 {
        Ok(format!(
            "{CONTENDERS} processes, 1 created, {replayed} replayed, 1 plan row"
        ))
    } else {
        Err(VerifyError::Broken(format!(
            "outcomes {outcomes:?}, {plans} plan rows"
        )))
    }
}

/// What a contender wrote to stderr (it has stopped, or is about to be).
fn contender_stderr(child: &mut std::process::Child) -> String {
    let mut text = String::new();
    if let Some(mut stderr) = child.stderr.take() {
        let _ = child.kill();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
    }
    text.trim().to_owned()
}

/// The contending processes still running; any left when verify stops
/// early (an error) are killed, not left behind.
struct Contenders(Vec<std::process::Child>);

impl Contenders {
    fn next(&mut self) -> Option<std::process::Child> {
        if self.0.is_empty() {
            None
        } else {
            Some(self.0.remove(0))
        }
    }
}

impl Drop for Contenders {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The body of one contending process (`plan-intake verify-contender`):
/// waits for the start gate on stdin, submits, prints the outcome.
pub fn contend(url: &str) -> Result<String, VerifyError> {
    let db = Database::open(url, &PoolOptions::default(), MigrateOnOpen::Skip)?;
    let intake = Intake::new(db, RetryPolicy::default(), Metrics::new());
    let token = std::env::var(CONTENDER_TOKEN_VAR)
        .map_err(|e| VerifyError::could_not("the contender was given no token", e))?;
    let deadline = crate::deadline::Deadline::after(std::time::Duration::from_secs(60));
    let caller = intake
        .sign_in(&deadline, &token)
        .map_err(|e| VerifyError::could_not("the contender cannot sign in", e))?
        .ok_or_else(|| VerifyError::Broken("the contender's login is not active".to_owned()))?;
    let key = IdempotencyKey::parse(CONTENDER_KEY)
        .map_err(|e| VerifyError::could_not("the contender's key is refused", e))?;
    let submission = body::parse(CONTENDER_BODY.as_bytes())
        .map_err(|e| VerifyError::could_not("the contender's plan is refused", e))?;
    crate::stdout::line(CONTENDER_READY).map_err(VerifyError::Output)?;
    let mut gate = String::new();
    std::io::stdin()
        .read_line(&mut gate)
        .map_err(|e| VerifyError::could_not("cannot read the start gate", e))?;
    let accepted = intake.submit(&caller, &key, &submission, &deadline)?;
    Ok(accepted.outcome.as_str().to_owned())
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

fn count(conn: &mut DbConn, table: &str) -> Result<i64, VerifyError> {
    let sql = format!("SELECT COUNT(*) AS n FROM {table}");
    Ok(with_conn!(conn, c => diesel::sql_query(&sql).get_result::<Count>(c))?.n)
}

/// A migrated store of verify's own: a fresh schema in the configured
/// Postgres database, or a temporary SQLite file. Removed on drop.
enum Scratch {
    Schema(ScratchSchema),
    File {
        url: String,
        path: std::path::PathBuf,
    },
}

impl Scratch {
    fn create(target: &DatabaseTarget) -> Result<Self, VerifyError> {
        let scratch = match target {
            DatabaseTarget::Postgres(url) => Scratch::Schema(
                ScratchSchema::create(url, "plan_intake_verify")
                    .map_err(|e| VerifyError::could_not("cannot create a scratch schema", e))?,
            ),
            DatabaseTarget::Sqlite(_) => {
                let path = std::env::temp_dir().join(format!(
                    "plan-intake-verify-{}_{:08x}.db",
                    std::process::id(),
                    rand::random::<u32>()
                ));
                Scratch::File {
                    url: format!("sqlite://{}", path.display()),
                    path,
                }
            }
        };
        // Migrated quietly: these migrations are the scratch store's, and a
        // line saying "applied migration" would read as the configured
        // database's.
        let db = Database::open(
            scratch.url(),
            &PoolOptions::default(),
            MigrateOnOpen::Create,
        )
        .map_err(|e| VerifyError::could_not("cannot create the scratch store", e))?;
        let mut conn = db
            .conn()
            .map_err(|e| VerifyError::could_not("cannot migrate the scratch store", e))?;
        migrations::run_pending(&mut conn)
            .map_err(|e| VerifyError::could_not("cannot migrate the scratch store", e))?;
        Ok(scratch)
    }

    fn url(&self) -> &str {
        match self {
            Scratch::Schema(schema) => &schema.url,
            Scratch::File { url, .. } => url,
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Scratch::File { path, .. } = self {
            for suffix in ["", "-wal", "-shm"] {
                let mut file = path.clone().into_os_string();
                file.push(suffix);
                let _ = std::fs::remove_file(file);
            }
        }
    }
}
