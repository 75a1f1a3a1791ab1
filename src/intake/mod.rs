//! The domain: what a valid submission is, how it is hashed, the submit
//! flow with its outcomes, who may read what, the feed, and logins. Past
//! `body::parse` nothing re-checks the input. The door calls in here and
//! gets domain types back; only this room calls `storage`.
//!
//! Every entry point is a method of [`Intake`], below, in five groups:
//! who is calling, the write, reads by id, the feed, and operations. The
//! work behind them lives in one module each: `login` (sign-in), `submit`
//! (the write path), `read` (who may see what), `feed` (pages).

/// The plan request and its rules, shared with the client (`crates/wire`).
pub use plan_intake_wire::body;
pub mod feed;
/// The plan's two hashes, shared with the client (`crates/wire`).
pub use plan_intake_wire::hashing;
pub mod idempotency_key;
/// I-JSON reading and RFC 8785 writing, a crate of its own (`crates/json`).
pub use plan_intake_json as ijson;
pub mod log_rounds;
pub mod login;
#[cfg(test)]
mod properties;
pub mod read;
pub mod receipt;
pub mod receipt_log;
pub mod retention;
/// The full-jitter backoff, shared with the client (`crates/wire`).
pub use plan_intake_wire::retry;
pub mod signing;
pub mod submit;

use tokio::sync::watch;

pub use body::{ApprovedInput, RunId, Submission};
pub use idempotency_key::IdempotencyKey;
pub use login::{Caller, Login, LoginError, Permission};
/// The RFC 9457 problem every error answers (`crates/wire`).
pub use plan_intake_wire::{PROBLEM_BASE, Problem};
pub use read::{ReadById, ReadError, Readiness};
pub use receipt::{PlanView, Receipt};
pub use retry::RetryPolicy;
pub use submit::{Accepted, Outcome, SubmitError};

use crate::deadline::Deadline;
use crate::metrics::Metrics;
use crate::storage::Database;
use feed::{Cursor, Page};
use login::KnownLogins;

/// The domain's one facade, for the door and the tools: the database, the
/// retry policy, the counters and the logins recently found. Cheap to
/// clone; shared by every worker. A method that reads or writes the
/// database blocks (call it from `web::block`), but `submit_queued`, which
/// is awaited; the ones that answer from memory (`known_caller`,
/// `may_look_up`, `feed_changes`, …) do not.
#[derive(Clone)]
pub struct Intake {
    db: Database,
    pub retry: RetryPolicy,
    pub metrics: Metrics,
    known: std::sync::Arc<KnownLogins>,
    strangers: std::sync::Arc<login::StrangerBudget>,
    /// The key new receipts and checkpoints are signed with; `None`: the
    /// service signs nothing and keeps no log.
    signing: Option<std::sync::Arc<signing::SigningKey>>,
    /// Keys being rotated out: they sign each checkpoint beside `signing`,
    /// so a reader pinned to one keeps verifying until it adds the new.
    cosigning: Vec<std::sync::Arc<signing::SigningKey>>,
    /// Why the receipt log's appender cannot go on, while it cannot (set by
    /// the appender; `/readyz` tells it).
    log_stuck: Told,
    /// A reader waiting for a checkpoint asks the appender for a round.
    log_rounds: log_rounds::LogRounds,
    /// Why the signing key cannot be published, while it cannot (set by its
    /// recorder; `/readyz` tells it).
    key_unpublished: Told,
    /// This instance signs nothing and the database's log is signed (its
    /// origin): plans are refused (503) rather than kept unsigned, which
    /// would stop every verifying reader at their leaf.
    signed_log_found: Told,
    /// When a write last found the database's storage full, until one
    /// lands again (`/readyz`, `plan_intake_storage_full`).
    storage_full: StorageFullness,
}

/// When a write last found the storage full (milliseconds since the Unix
/// epoch; 0: none since a write landed).
#[derive(Clone, Default)]
struct StorageFullness(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl StorageFullness {
    /// How long `/readyz` says so after the last write that found it full:
    /// then a balancer sends traffic again, and a write finds out.
    const TOLD_FOR: std::time::Duration = std::time::Duration::from_secs(30);

    fn now_millis() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .max(1)
    }

    fn failed(&self) {
        self.0
            .store(Self::now_millis(), std::sync::atomic::Ordering::Relaxed);
    }

    /// A write landed: whether the storage had been found full.
    fn landed(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed) != 0
            && self.0.swap(0, std::sync::atomic::Ordering::Relaxed) != 0
    }

    fn full_lately(&self) -> bool {
        let at = self.0.load(std::sync::atomic::Ordering::Relaxed);
        at != 0 && Self::now_millis().saturating_sub(at) < Self::TOLD_FOR.as_millis() as u64
    }
}

/// A reason one thread tells and `/readyz` reads, while it holds.
#[derive(Clone, Default)]
struct Told(std::sync::Arc<std::sync::Mutex<Option<String>>>);

impl Told {
    fn set(&self, reason: Option<String>) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = reason;
    }

    fn get(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

impl Intake {
    pub fn new(db: Database, retry: RetryPolicy, metrics: Metrics) -> Self {
        metrics.expect_retry_classes(
            crate::storage::errors::TransientCause::ALL
                .iter()
                .map(|cause| cause.as_str()),
        );
        db.observe_batches(metrics.write_batches(match db.backend {
            crate::storage::Backend::Postgres => "postgres",
            crate::storage::Backend::Sqlite => "sqlite",
        }));
        Self {
            db,
            retry,
            metrics,
            known: std::sync::Arc::default(),
            strangers: std::sync::Arc::default(),
            signing: None,
            cosigning: Vec::new(),
            log_stuck: Told::default(),
            log_rounds: log_rounds::LogRounds::default(),
            key_unpublished: Told::default(),
            signed_log_found: Told::default(),
            storage_full: StorageFullness::default(),
        }
    }

    /// This facade, signing new receipts and the log's checkpoints with `key`.
    pub fn signing_with(mut self, key: std::sync::Arc<signing::SigningKey>) -> Self {
        self.signing = Some(key);
        self
    }

    /// This facade, also signing the log's checkpoints with `keys` (keys
    /// being rotated out; receipts are signed by the new key alone).
    pub fn cosigning_with(mut self, keys: Vec<std::sync::Arc<signing::SigningKey>>) -> Self {
        self.cosigning = keys;
        self
    }

    /// The database this facade stands in front of: for the tests' seams
    /// only (`tests/it/layers.rs` holds every room to never call it).
    #[cfg(feature = "test-seams")]
    pub fn database(&self) -> &Database {
        &self.db
    }

    /// Which backend the plans are kept on.
    pub fn backend(&self) -> crate::storage::Backend {
        self.db.backend
    }

    /// The key new receipts are signed with, if any.
    pub fn signing_key(&self) -> Option<&signing::SigningKey> {
        self.signing.as_deref()
    }

    // Who is calling.

    /// The caller that owns `token`, if a recent lookup found its login
    /// active: no database work, so the door may ask before it reads a
    /// body. `None` means "look it up", never "refuse".
    pub fn known_caller(&self, token: &str) -> Option<Caller> {
        let token_hash = login::token_hash(token);
        let login = self.known.get(&token_hash)?;
        Some(Caller { login, token_hash })
    }

    /// Whether `token` may be looked up now: always when a login showed it
    /// lately, else while the strangers' lookups of this second last
    /// ([`login::StrangerBudget`]). Asked before the lookup is queued, so
    /// a turned-away stranger costs no blocking thread and no connection.
    pub fn may_look_up(&self, token: &str) -> bool {
        if self.known.familiar(&login::token_hash(token)) {
            return true;
        }
        if self.strangers.try_take() {
            self.metrics.stranger_lookup();
            true
        } else {
            false
        }
    }

    /// With the strangers' lookups used up: what a token that arrived at
    /// `since` does next ([`login::Reread`]).
    pub fn reread_for(&self, since: std::time::Instant) -> login::Reread {
        self.strangers.reread_for(since)
    }

    /// Remembers every active login (one read of `logins`): at start, so
    /// that planners are familiar after a restart, and when the strangers'
    /// lookups are used up, so that a new login's token is found. `begun`:
    /// when the read was handed out ([`login::Reread::Mine`]).
    pub fn remember_active_logins(
        &self,
        begun: std::time::Instant,
        deadline: &Deadline,
    ) -> Result<(), ReadError> {
        login::remember_active(&self.db, &self.known, deadline)?;
        self.strangers.reread_completed(begun);
        Ok(())
    }

    /// Whether a login showed `token` lately (or it was read with every
    /// active login).
    pub fn familiar(&self, token: &str) -> bool {
        self.known.familiar(&login::token_hash(token))
    }

    /// A stranger turned away before any lookup, counted.
    pub fn turn_away(&self) {
        self.metrics.stranger("turned_away");
    }

    /// The caller that owns `token`, if its login is active: one indexed
    /// lookup, remembered for [`Intake::known_caller`].
    pub fn sign_in(&self, deadline: &Deadline, token: &str) -> Result<Option<Caller>, ReadError> {
        let token_hash = login::token_hash(token);
        let Some(login) = login::find_by_hash(&self.db, deadline, &token_hash)? else {
            self.unknown(&token_hash);
            return Ok(None);
        };
        self.known.remember(&token_hash, &login);
        Ok(Some(Caller { login, token_hash }))
    }

    /// The active login that owns `token`, if any (always looked up: a
    /// read is answered from the database's word), remembered as familiar.
    pub fn authenticate(
        &self,
        deadline: &Deadline,
        token: &str,
    ) -> Result<Option<Login>, ReadError> {
        let token_hash = login::token_hash(token);
        let found = login::find_by_hash(&self.db, deadline, &token_hash)?;
        match &found {
            Some(login) => self.known.remember(&token_hash, login),
            None => self.unknown(&token_hash),
        }
        Ok(found)
    }

    /// A token found to name no active login: counted when it was a
    /// stranger's, forgotten when it was familiar (revoked since).
    fn unknown(&self, token_hash: &str) {
        if self.known.familiar(token_hash) {
            self.known.forget(token_hash);
        } else {
            self.metrics.stranger("unauthorized");
        }
    }

    // The write.

    /// Keeps `submission` once for a signed-in `caller`, whose token the
    /// write checks again, giving up at `deadline`.
    pub fn submit(
        &self,
        caller: &Caller,
        key: &IdempotencyKey,
        submission: &Submission,
        deadline: &Deadline,
    ) -> Result<Accepted, SubmitError> {
        self.refuse_unsigned_on_signed_log()?;
        let parts = hashing::canonicalize(submission);
        submit::check_receipt_size(&caller.login, submission, &parts)?;
        let written = self.write_from(caller, key, submission, &parts, deadline, None);
        self.after_write(caller, &written);
        written
    }

    /// What a write's answer tells beyond itself: a token found revoked,
    /// storage no longer full.
    fn after_write(&self, caller: &Caller, written: &Result<Accepted, SubmitError>) {
        match written {
            Err(SubmitError::Unauthorized) => self.known.forget(&caller.token_hash),
            // A replay reads; only a write that landed says there is room.
            Ok(accepted)
                if accepted.outcome != plan_intake_wire::Outcome::Replayed
                    && self.storage_full.landed() =>
            {
                tracing::info!("a write landed again: the database's storage is no longer full");
                self.metrics.set_storage_full(false);
            }
            _ => {}
        }
    }

    /// [`Intake::submit`] for an async caller: the write's first attempt is
    /// awaited on the writers' queue, with no thread of its own. `Err`: an
    /// outcome that needs blocking work (a retry, a re-read, a wait for the
    /// standby), to be finished by [`Intake::submit_after`].
    pub async fn submit_queued(
        &self,
        caller: &Caller,
        key: &IdempotencyKey,
        submission: &Submission,
        deadline: &Deadline,
    ) -> Result<Result<Accepted, SubmitError>, submit::FirstAttempt> {
        if let Err(refused) = self.refuse_unsigned_on_signed_log() {
            return Ok(Err(refused));
        }
        let parts = hashing::canonicalize(submission);
        if let Err(refused) = submit::check_receipt_size(&caller.login, submission, &parts) {
            return Ok(Err(refused));
        }
        let answer = self
            .first_attempt(caller, key, submission, &parts, deadline)
            .await;
        if let Ok(written) = &answer {
            self.after_write(caller, written);
        }
        answer
    }

    /// The rest of a write [`Intake::submit_queued`] began (blocking).
    pub fn submit_after(
        &self,
        caller: &Caller,
        key: &IdempotencyKey,
        submission: &Submission,
        deadline: &Deadline,
        first: submit::FirstAttempt,
    ) -> Result<Accepted, SubmitError> {
        let parts = hashing::canonicalize(submission);
        let written = self.write_from(caller, key, submission, &parts, deadline, Some(first));
        self.after_write(caller, &written);
        written
    }

    // Reads by id.

    /// The receipt `receipt_id` (`T` = [`Receipt`]) or its whole plan
    /// (`T` = [`PlanView`]), if `login` may see it, once the synchronous
    /// standby has it.
    pub fn read_by_id<T: ReadById>(
        &self,
        login: &Login,
        receipt_id: &str,
        deadline: &Deadline,
    ) -> Result<Option<T>, ReadError> {
        let found = read::readable::<T>(&self.db, login, receipt_id, deadline)?;
        self.replicated(found, deadline)?
            .map(|row| T::answer(row).map_err(Into::into))
            .transpose()
    }

    /// The bytes of the plan `receipt_id`'s content and approved inputs,
    /// if `login` may see it: what reading it will hold.
    pub fn plan_bytes(
        &self,
        login: &Login,
        receipt_id: &str,
        deadline: &Deadline,
    ) -> Result<Option<u64>, ReadError> {
        Ok(self
            .db
            .read(deadline, |conn| {
                crate::storage::plans::stored_bytes(conn, receipt_id)
            })?
            .filter(|(maker, _)| read::may_see(login, maker))
            .map(|(_, bytes)| u64::try_from(bytes).unwrap_or(0)))
    }

    /// Once every commit read or made since `deadline` was made is on the
    /// synchronous standby (at once without one); `Err` when that cannot
    /// be known (its wait cancelled, a failover since).
    pub fn await_replicated(
        &self,
        deadline: &Deadline,
    ) -> Result<(), crate::storage::StorageError> {
        self.db.await_replicated(deadline)
    }

    /// `found`, once the synchronous standby has it too (nothing to wait
    /// for when nothing was found).
    fn replicated<T>(&self, found: Option<T>, deadline: &Deadline) -> Result<Option<T>, ReadError> {
        if found.is_some() {
            self.db.await_replicated(deadline)?;
        }
        Ok(found)
    }

    // The feed.

    /// The end of the settled feed (`after=now`).
    pub fn feed_end(&self, deadline: &Deadline) -> Result<Cursor, ReadError> {
        feed::end(&self.db, deadline)
    }

    /// How many whole plans after `after` one expanded page holds: up to
    /// `limit`, within `budget` bytes (at least one), and their bytes.
    pub fn feed_extent(
        &self,
        after: Cursor,
        limit: i64,
        budget: u64,
        deadline: &Deadline,
    ) -> Result<feed::Extent, ReadError> {
        feed::extent(&self.db, after, limit, budget, deadline)
    }

    /// Up to `limit` receipts after `after`, in feed order; with `expand`,
    /// whole plans. A page that holds any is answered once they are on the
    /// synchronous standby, like every receipt the service hands out.
    pub fn feed_page(
        &self,
        after: Cursor,
        limit: i64,
        expand: bool,
        deadline: &Deadline,
    ) -> Result<Page, ReadError> {
        let page = feed::page(&self.db, &self.metrics, after, limit, expand, deadline)?;
        if !page.entries.is_empty() {
            self.db.await_replicated(deadline)?;
        }
        Ok(page)
    }

    /// Changes whenever a plan may have joined the feed, written by this
    /// instance or (heard by its listener) another. Does not block.
    pub fn feed_changes(&self) -> watch::Receiver<u64> {
        self.db.feed_signal().subscribe()
    }

    // The receipt log.

    /// One append round (blocking): the receipts settled since the last
    /// leaf, appended and under a new signed checkpoint. `Ok(None)`: no
    /// key (no log), or another instance appends now. `signed`: the last
    /// checkpoint this process signed, which the new one must extend.
    pub fn append_receipts(
        &self,
        origin: &str,
        limit: i64,
        signed: Option<(u64, tlog_tiles::Hash)>,
        keep: Option<&receipt_log::KeepCheckpoint>,
    ) -> Result<
        Option<crate::storage::receipt_log::Appended>,
        Box<dyn std::error::Error + Send + Sync>,
    > {
        let Some(key) = self.signing_key() else {
            return Ok(None);
        };
        let writer = receipt_log::LogSigner {
            key,
            cosigners: &self.cosigning,
            origin,
            keep,
        };
        let mut conn = self.db.conn()?;
        Ok(self.db.between_batches(|| {
            crate::storage::receipt_log::append(
                &mut conn,
                limit,
                &writer,
                signed,
                crate::clock::now_micros(),
            )
        })?)
    }

    /// Between the appender and readers waiting for a checkpoint.
    pub fn log_rounds(&self) -> &log_rounds::LogRounds {
        &self.log_rounds
    }

    /// Whether the log as stored extends the checkpoint of `signed` leaves
    /// and root kept outside the database (checked before the appender
    /// starts: a database restored to before it is never signed over).
    pub fn check_receipt_log_extends(
        &self,
        signed: (u64, tlog_tiles::Hash),
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let mut conn = self.db.conn()?;
        let leaf_of = |row: &crate::storage::plans::ReceiptRow| receipt_log::leaf_of(row);
        Ok(crate::storage::receipt_log::check_extends(
            &mut conn, signed, &leaf_of,
        )?)
    }

    /// Seconds the oldest receipt settled in the feed but not in the log has
    /// waited since it was received (0: the log holds every one).
    pub fn receipt_log_lag(&self, deadline: &Deadline) -> Result<f64, ReadError> {
        let oldest = self
            .db
            .read(deadline, crate::storage::receipt_log::oldest_unlogged)?;
        Ok(oldest.map_or(0.0, |received| {
            let waited = crate::clock::now_micros() - received;
            waited.num_microseconds().unwrap_or(i64::MAX) as f64 / 1e6
        }))
    }

    /// The appender says why it cannot go on (`None`: it goes on again):
    /// `/readyz` answers 503 `receipt-log-stuck` with the reason meanwhile,
    /// and the gauge `plan_intake_receipt_log_stuck` is 1.
    pub fn set_receipt_log_stuck(&self, reason: Option<String>) {
        self.metrics.set_receipt_log_stuck(reason.is_some());
        self.log_stuck.set(reason);
    }

    /// Records that this instance's key signs now (`GET /v1/signing-keys`
    /// tells when each key was in use). While it cannot be recorded, the
    /// key is unpublished, and `/readyz` answers 503
    /// `signing-key-unpublished` with why.
    pub fn record_key_use(&self, deadline: &Deadline) -> Result<(), ReadError> {
        let Some(key) = self.signing_key() else {
            return Ok(());
        };
        let recorded = self.publish_key(key, true, deadline).and_then(|()| {
            // Published under its id, but is it this key? A row replaced
            // around the service would make every receipt fail its check.
            let published = self
                .db
                .read(deadline, crate::storage::receipt_log::signing_keys)?;
            let ours = published
                .iter()
                .any(|(id, verifier, _, _)| id == key.key_id() && verifier == key.verifier_key());
            Ok(ours)
        });
        self.key_unpublished.set(match &recorded {
            Ok(true) => None,
            Ok(false) => Some(format!(
                "GET /v1/signing-keys publishes another verifier key under {} (its row was replaced around the service)",
                key.key_id()
            )),
            Err(error) => Some(crate::report::chain(error)),
        });
        recorded.map(|_| ())
    }

    /// Keeps `key` published; `signs_now`: this instance signs with it
    /// (else an older key, kept for rotation, whose times stay).
    pub fn publish_key(
        &self,
        key: &signing::SigningKey,
        signs_now: bool,
        deadline: &Deadline,
    ) -> Result<(), ReadError> {
        let now = crate::clock::now_micros();
        self.db.read(deadline, |conn| {
            crate::storage::receipt_log::publish_key(
                conn,
                key.key_id(),
                key.verifier_key(),
                now,
                signs_now,
            )
        })?;
        Ok(())
    }

    /// Every key that has signed, and the one signing now.
    pub fn published_keys(&self, deadline: &Deadline) -> Result<signing::PublishedKeys, ReadError> {
        let rows = self
            .db
            .read(deadline, crate::storage::receipt_log::signing_keys)?;
        Ok(signing::PublishedKeys {
            signing_now: self.signing_key().map(|k| k.key_id().to_owned()),
            keys: rows
                .into_iter()
                .map(
                    |(key_id, verifier_key, first, last)| signing::PublishedKey {
                        key_id,
                        verifier_key,
                        first_used_at: receipt::format_timestamp(&first),
                        last_used_at: receipt::format_timestamp(&last),
                    },
                )
                .collect(),
        })
    }

    /// The newest signed checkpoint's note, if the log has one, once the
    /// synchronous standby has it: a checkpoint handed out and then lost
    /// in a failover would look like a fork.
    pub fn checkpoint(&self, deadline: &Deadline) -> Result<Option<String>, ReadError> {
        let found = self
            .db
            .read(deadline, crate::storage::receipt_log::latest_checkpoint)?
            .map(|c| c.note);
        self.replicated(found, deadline)
    }

    /// How many leaves the newest checkpoint holds (0: none yet): what a
    /// waiting reader looks at before it asks for proofs.
    pub fn newest_checkpoint_size(&self, deadline: &Deadline) -> Result<u64, ReadError> {
        let found = self
            .db
            .read(deadline, crate::storage::receipt_log::latest_checkpoint)?;
        Ok(found.map_or(0, |c| u64::try_from(c.tree_size).unwrap_or(0)))
    }

    /// The newest checkpoint with the consistency proofs to it from the
    /// trees of `size` and `since` leaves (`GET
    /// /v1/checkpoint/extension`); `None` while it holds fewer than `size`.
    /// Answered once the synchronous standby has the checkpoint.
    pub fn checkpoint_extension(
        &self,
        size: u64,
        since: Option<u64>,
        deadline: &Deadline,
    ) -> Result<Option<receipt_log::CheckpointExtension>, ReadError> {
        use crate::storage::receipt_log::{ProofError, extension};
        let answer = Some(proof_read(&self.db, deadline, |conn| {
            extension(conn, size, since)
        })?);
        let texts =
            |hashes: Vec<tlog_tiles::Hash>| hashes.iter().map(ToString::to_string).collect();
        match answer {
            Some(Ok((checkpoint, proof, since_proof))) => {
                let found = receipt_log::CheckpointExtension {
                    checkpoint: checkpoint.note,
                    proof: texts(proof),
                    since_proof: since_proof.map(texts),
                };
                self.replicated(Some(found), deadline)
            }
            Some(Err(ProofError::Database(e))) => Err(crate::storage::StorageError::from(e).into()),
            Some(Err(ProofError::Tree(e))) => Err(ReadError::Corrupt(e.into())),
            Some(Err(rolled_back @ ProofError::RolledBack { .. })) => {
                Err(ReadError::RolledBack(format!(
                    "{rolled_back}: the log was rolled back (a restore, or a failover that lost commits)"
                )))
            }
            _ => Ok(None),
        }
    }

    /// Where a verifying reader starts at the checkpoint of `size` leaves
    /// (`GET /v1/checkpoint/start`): the tree's right edge and the feed
    /// cursor after its last leaf. `None` while the newest checkpoint
    /// holds fewer. A last leaf whose plan is gone (deleted around the
    /// service) is placed after the last plan before it that is there.
    pub fn checkpoint_start(
        &self,
        size: u64,
        deadline: &Deadline,
    ) -> Result<Option<receipt_log::CheckpointStart>, ReadError> {
        use crate::storage::receipt_log::{ProofError, start_at};
        let answer = Some(proof_read(&self.db, deadline, |conn| start_at(conn, size))?);
        match answer {
            Some(Ok((edge, last))) => {
                let after = match last {
                    Some((position, receipt_id)) => {
                        feed::Cursor::after_receipt(position, &receipt_id).encode()
                    }
                    // No leaf's plan is left: the feed's start.
                    None => feed::Cursor::default().encode(),
                };
                let found = receipt_log::CheckpointStart {
                    edge: edge.iter().map(ToString::to_string).collect(),
                    after,
                };
                self.replicated(Some(found), deadline)
            }
            Some(Err(ProofError::Database(e))) => Err(crate::storage::StorageError::from(e).into()),
            Some(Err(ProofError::Tree(e))) => Err(ReadError::Corrupt(e.into())),
            _ => Ok(None),
        }
    }

    /// A C2SP `tlog-tiles` resource of the log at its newest checkpoint:
    /// a hash tile, or an entry bundle (each leaf recomputed from its
    /// plan's row, as the appender made it). `None` beyond the tree.
    /// Answered once the synchronous standby has the checkpoint.
    pub fn log_tile(
        &self,
        tile: receipt_log::TileRequest,
        deadline: &Deadline,
    ) -> Result<Option<Vec<u8>>, ReadError> {
        use crate::storage::receipt_log::{ProofError, hash_tile, logged_receipts};
        let corrupt = |e: String| ReadError::Corrupt(e.into());
        let answer = Some(proof_read(&self.db, deadline, |conn| match tile {
            receipt_log::TileRequest::Hashes {
                level,
                index,
                width,
            } => hash_tile(conn, level, index, width).map(|data| data.map(Ok)),
            receipt_log::TileRequest::Entries { index, width } => {
                logged_receipts(conn, index.saturating_mul(256), width).map(|rows| {
                    rows.map(|rows| {
                        let leaves = rows
                            .iter()
                            .map(|row| {
                                let row = row.as_ref().ok_or("a logged plan is gone")?;
                                let receipt =
                                    <Receipt as receipt::ReceiptOfRow>::from_row(row, None)
                                        .map_err(|e| e.to_string())?;
                                signing::signed_form(&receipt).map_err(|e| e.to_string())
                            })
                            .collect::<Result<Vec<_>, String>>()?;
                        receipt_log::entry_bundle(&leaves)
                    })
                })
            }
        })?);
        match answer {
            Some(Ok(Some(Ok(data)))) => self.replicated(Some(data), deadline),
            Some(Ok(Some(Err(e)))) => Err(corrupt(e)),
            Some(Err(ProofError::Database(e))) => Err(crate::storage::StorageError::from(e).into()),
            Some(Err(ProofError::Tree(e))) => Err(corrupt(e)),
            _ => Ok(None),
        }
    }

    /// The origin of the log in the database (its newest checkpoint's
    /// first line), if it has one; read at start, not handed out.
    pub fn stored_log_origin(&self, deadline: &Deadline) -> Result<Option<String>, ReadError> {
        let found = self
            .db
            .read(deadline, crate::storage::receipt_log::latest_checkpoint)?;
        Ok(found.and_then(|c| c.note.lines().next().map(str::to_owned)))
    }

    /// The `tlog-proof` of `receipt_id` in the newest checkpoint, if
    /// `login` may see the receipt: `Some(None)` while it is not in one yet.
    /// A proof is answered once the synchronous standby has its checkpoint.
    pub fn receipt_proof(
        &self,
        login: &Login,
        receipt_id: &str,
        deadline: &Deadline,
    ) -> Result<Option<Option<String>>, ReadError> {
        if read::readable::<Receipt>(&self.db, login, receipt_id, deadline)?.is_none() {
            return Ok(None);
        }
        use crate::storage::receipt_log::{ProofError, inclusion_proof};
        let answer = Some(proof_read(&self.db, deadline, |conn| {
            inclusion_proof(conn, receipt_id)
        })?);
        match answer {
            Some(Ok((index, proof, checkpoint))) => {
                let text = receipt_log::proof_text(index, &proof, &checkpoint.note);
                Ok(Some(self.replicated(Some(text), deadline)?))
            }
            Some(Err(ProofError::NotYet | ProofError::RolledBack { .. })) => Ok(Some(None)),
            Some(Err(ProofError::Database(e))) => Err(crate::storage::StorageError::from(e).into()),
            Some(Err(ProofError::Tree(e))) => Err(ReadError::Corrupt(e.into())),
            None => Ok(Some(None)),
        }
    }

    /// The consistency proof from the tree of `old` leaves to the one of
    /// `new`, one base64 hash a line; `None` unless `0 < old <= new <=` the
    /// newest checkpoint's size. Answered once the synchronous standby has
    /// the checkpoints it joins.
    pub fn consistency_proof(
        &self,
        old: u64,
        new: u64,
        deadline: &Deadline,
    ) -> Result<Option<String>, ReadError> {
        use crate::storage::receipt_log::{ProofError, consistency_proof};
        let answer = Some(proof_read(&self.db, deadline, |conn| {
            consistency_proof(conn, old, new)
        })?);
        match answer {
            Some(Ok(proof)) => {
                let text = proof.iter().map(|h| format!("{h}\n")).collect();
                self.replicated(Some(text), deadline)
            }
            Some(Err(ProofError::Database(e))) => Err(crate::storage::StorageError::from(e).into()),
            Some(Err(ProofError::Tree(e))) => Err(ReadError::Corrupt(e.into())),
            _ => Ok(None),
        }
    }

    // Operations.

    /// Ready to serve: the database answers and no migration is pending;
    /// and whether an acknowledged plan survives a failover (the gauge
    /// `plan_intake_commit_waits_for_standby` follows).
    pub fn readiness(&self, deadline: &Deadline) -> Result<Readiness, ReadError> {
        let signing = self.signing_key().is_some();
        let (durability, foreign_isolation) = self.db.readiness(deadline, signing)?;
        let mut readiness = read::readiness_of(&durability);
        if let Some(default) = foreign_isolation {
            let said = format!(
                "the database's or role's default_transaction_isolation is '{default}': this service pins READ COMMITTED on each of its sessions, but other clients of the database run at '{default}'"
            );
            readiness.warning = Some(match readiness.warning.take() {
                Some(warning) => format!("{warning}; {said}"),
                None => said,
            });
        }
        self.metrics
            .set_commit_waits_for_standby(readiness.commit_waits_for_standby);
        self.metrics.set_commits_blocked(readiness.commits_blocked);
        if let Some(reason) = self.key_unpublished.get() {
            return Err(ReadError::NotSetUp(read::NotSetUp::SigningKeyUnpublished(
                reason,
            )));
        }
        if let Some(reason) = self.log_stuck.get() {
            return Err(ReadError::NotSetUp(read::NotSetUp::ReceiptLogStuck(reason)));
        }
        if self.storage_full.full_lately() {
            return Err(ReadError::NotSetUp(read::NotSetUp::StorageFull));
        }
        // Refused at start; an instance started before the log was signed
        // learns it here.
        if !signing && let Some(origin) = self.find_signed_log(deadline)? {
            return Err(ReadError::NotSetUp(read::NotSetUp::UnsignedOnSignedLog(
                origin,
            )));
        }
        Ok(readiness)
    }

    /// For an instance that signs nothing: the origin of the database's
    /// receipt log if it is signed, remembered so that plans are refused
    /// from then on (`serve` asks every few seconds, `/readyz` each time).
    pub fn find_signed_log(&self, deadline: &Deadline) -> Result<Option<String>, ReadError> {
        let found = self.stored_log_origin(deadline)?;
        if found.is_some() {
            self.signed_log_found.set(found.clone());
        }
        Ok(found)
    }

    /// Refuses a plan an instance without a key would keep unsigned in a
    /// signed log.
    fn refuse_unsigned_on_signed_log(&self) -> Result<(), SubmitError> {
        if self.signing.is_some() {
            return Ok(());
        }
        match self.signed_log_found.get() {
            Some(origin) => Err(SubmitError::NotSetUp(read::NotSetUp::UnsignedOnSignedLog(
                origin,
            ))),
            None => Ok(()),
        }
    }

    /// Brings the pool's gauges up to date, for a scrape.
    pub fn record_pool_gauges(&self) {
        let pool = self.db.pool_state();
        self.metrics
            .set_pool(pool.connections, pool.idle_connections, self.db.waiters());
        self.metrics
            .set_barrier_waiting(self.db.replication_waiters());
    }
}

/// A read of the log's proofs whose database error goes back to
/// `Database::read`, which drops a connection found dead and reads again
/// (a failover, a PgBouncer restarted); the other errors are answers.
/// Handed back as a value, a dead connection's error was a 500 (the soak
/// found it: PgBouncer killed under a verifying reader's wait).
fn proof_read<T>(
    db: &crate::storage::Database,
    deadline: &Deadline,
    mut step: impl FnMut(
        &mut crate::storage::DbConn,
    ) -> Result<T, crate::storage::receipt_log::ProofError>,
) -> Result<Result<T, crate::storage::receipt_log::ProofError>, crate::storage::StorageError> {
    use crate::storage::receipt_log::ProofError;
    db.read(deadline, |conn| match step(conn) {
        Err(ProofError::Database(e)) => Err(e),
        other => Ok(other),
    })
}
