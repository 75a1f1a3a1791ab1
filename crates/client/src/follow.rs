//! Following the feed: every receipt at least once, in feed order. The
//! cursor is saved (written, fsynced, renamed, directory fsynced) only after
//! its page was handed on, so a crash repeats at most the one page in hand
//! and never skips one.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::value::RawValue;

use plan_intake_wire::feed::{
    CURSOR_NOT_IN_FEED, DEFAULT_LIMIT, FeedCursor, FeedPage, MAX_LIMIT, MAX_WAIT,
};

use super::{Backoff, Client, Exchange};

/// What to follow and where to hand it. The defaults are the CLI's.
#[derive(Debug, Clone)]
pub struct FollowOptions {
    /// Where the cursor lives between pages and runs.
    pub cursor_file: PathBuf,
    /// With no cursor file: start at the feed's first receipt, not its end.
    pub from_start: bool,
    /// Each entry is `{receipt, approved_inputs, content}` instead of the receipt.
    pub expand: bool,
    /// Receipts per page, from 1 to `plan_intake_wire::feed::MAX_LIMIT`.
    pub limit: u32,
    /// How long one request waits for a receipt to join the feed, at most
    /// `plan_intake_wire::feed::MAX_WAIT`.
    pub wait: Duration,
    /// Run `sh -c CMD` once per non-empty page, the page's entries as JSON
    /// lines on its stdin; `None`: write them to the output.
    pub exec: Option<String>,
    /// Stop at the first empty page instead of waiting for more (that page
    /// still waits up to `wait`: the command line's `--drain` sets it to 0),
    /// and give up after `DRAIN_TRIES` failed tries in a row instead of
    /// waiting the service out.
    pub drain: bool,
    /// Cap of the first retry's random delay (unreachable service, failing
    /// CMD); doubles per retry up to 5 s.
    pub retry_base: Duration,
    /// Hand on only receipts proven to be the signed log's next leaves,
    /// under these pinned keys (feature `verify`; see [`crate::verify`]).
    /// The proof so far is saved with each cursor. Starts at the feed's
    /// first receipt (`from_start`), from a cursor file a verifying
    /// follower saved, or at a checkpoint (`from_checkpoint`).
    #[cfg(feature = "verify")]
    pub verify: Option<plan_intake_wire::evidence::TrustedKeys>,
    /// Verifying, with no cursor file and not `from_start`: the checkpoint
    /// (a signed note, as `GET /v1/checkpoint` answers it) to start from,
    /// trusted to be the log's; the service proves where it ends. `None`:
    /// the first checkpoint seen is trusted, and said so.
    #[cfg(feature = "verify")]
    pub from_checkpoint: Option<String>,
    /// Verifying: how many of the log's first receipts were kept before
    /// its first key and carry no signature (0: every receipt must be
    /// signed). Given by the reader, as `plan-intake audit` counts them:
    /// no checkpoint says whether a leaf's receipt carried a signature.
    #[cfg(feature = "verify")]
    pub unsigned_prelude: u64,
    /// Where the follower keeps how far behind the feed's end it is, for
    /// the caller to read while it runs (both followers).
    pub lag: Option<std::sync::Arc<Lag>>,
    /// How often that is told at INFO (`following: … behind the feed's end`).
    pub lag_every: Duration,
}

/// How far behind the feed's end a follower is, as of its last page: 0
/// once a page came back short of its limit (it read to the end), else the
/// age of the last receipt it handed on and, when verifying, the receipts
/// the log held beyond it.
#[derive(Debug)]
pub struct Lag {
    /// `u64::MAX`: unknown.
    receipts: AtomicU64,
    millis: AtomicU64,
}

impl Default for Lag {
    fn default() -> Self {
        Self {
            receipts: AtomicU64::new(u64::MAX),
            millis: AtomicU64::new(0),
        }
    }
}

impl Lag {
    /// Receipts between the last one handed on and the feed's end, when
    /// known (at the end; or verifying: the log's newest checkpoint).
    pub fn receipts(&self) -> Option<u64> {
        Some(self.receipts.load(Ordering::Relaxed)).filter(|&n| n != u64::MAX)
    }

    /// Seconds between the last receipt handed on and now, while behind.
    pub fn seconds(&self) -> f64 {
        self.millis.load(Ordering::Relaxed) as f64 / 1000.0
    }

    fn set(&self, receipts: Option<u64>, behind: Duration) {
        self.receipts
            .store(receipts.unwrap_or(u64::MAX), Ordering::Relaxed);
        self.millis.store(
            u64::try_from(behind.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }
}

impl FollowOptions {
    /// How long one request waits for a receipt unless told otherwise.
    pub const DEFAULT_WAIT: Duration = Duration::from_secs(30);
    /// How often the lag is told unless told otherwise.
    pub const DEFAULT_LAG_EVERY: Duration = Duration::from_secs(60);

    /// Following from the cursor kept in `cursor_file`, with the command
    /// line's defaults for everything else.
    pub fn new(cursor_file: impl Into<PathBuf>) -> Self {
        Self {
            cursor_file: cursor_file.into(),
            from_start: false,
            expand: false,
            limit: DEFAULT_LIMIT,
            wait: Self::DEFAULT_WAIT,
            exec: None,
            drain: false,
            retry_base: super::submit::DEFAULT_RETRY_BASE,
            #[cfg(feature = "verify")]
            verify: None,
            #[cfg(feature = "verify")]
            from_checkpoint: None,
            #[cfg(feature = "verify")]
            unsigned_prelude: 0,
            lag: None,
            lag_every: Self::DEFAULT_LAG_EVERY,
        }
    }
}

/// How far a run got before it stopped cleanly (drained, or asked to stop).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Followed {
    /// Non-empty pages handed on.
    pub pages: u64,
    /// Receipts handed on.
    pub receipts: u64,
    /// Whether this run wrote the cursor file (it may not have, when it
    /// stopped before it had anything to save).
    pub cursor_saved: bool,
}

/// Why following cannot go on. [`FollowError::exit_code`] is the CLI's exit.
#[derive(Debug, thiserror::Error)]
pub enum FollowError {
    /// The cursor file cannot be read or written.
    #[error("cursor file {}", path.display())]
    CursorFile {
        /// The cursor file.
        path: PathBuf,
        /// What the file system said.
        #[source]
        source: io::Error,
    },
    /// The cursor file holds nothing, or the service refuses its cursor.
    #[error("bad cursor: {0}")]
    BadCursor(String),
    /// A `limit` or `wait` outside what the service takes; nothing was sent.
    #[error("{0}")]
    Options(String),
    /// 401 or 403: the token is wrong, revoked, or lacks `receipts:read`.
    #[error("not allowed: {0}")]
    Denied(String),
    /// Any other answer, or a service that cannot be reached as addressed.
    #[error("unexpected answer: {0}")]
    Unexpected(String),
    /// The output is gone (a closed pipe): the page was not handed on.
    #[error("cannot write the page")]
    Output(#[source] io::Error),
    /// A page that cannot be proven to be the signed log's next leaves
    /// (`verify`): nothing of it was handed on or saved.
    #[error("not verified: {0}")]
    Unverified(String),
    /// `CMD` cannot be run (not found, not executable).
    #[error("cannot run `sh -c {command}`")]
    Exec {
        /// The command given with `exec`.
        command: String,
        /// Why it cannot be run.
        #[source]
        source: io::Error,
    },
}

impl FollowError {
    /// sysexits: 65 data error, 77 no permission, 74 I/O error, 71 OS error;
    /// 76 (protocol) a page not proven; 2 options out of bounds (a bad
    /// command line); 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::BadCursor(_) => 65,
            Self::Options(_) => 2,
            Self::Denied(_) => 77,
            Self::CursorFile { .. } | Self::Output(_) => 74,
            Self::Exec { .. } => 71,
            Self::Unverified(_) => 76,
            Self::Unexpected(_) => 1,
        }
    }
}

/// A page with its entries kept as sent, to be handed on byte for byte.
pub type Page = FeedPage<Box<RawValue>>;

/// Follows the feed from the cursor in `options.cursor_file` until `stop`
/// is set (the page in hand is finished and its cursor saved first) or, with
/// `drain`, until a page comes back empty. An unreachable or restarting
/// service is waited out; only answers that will not change end it.
pub fn follow(
    client: &Client,
    options: &FollowOptions,
    stop: &AtomicBool,
    out: &mut dyn Write,
) -> Result<Followed, FollowError> {
    let mut run = Run {
        client,
        options,
        stop,
        backoff: backoff_of(options),
        #[cfg(feature = "verify")]
        published: None,
    };
    check_options(options)?;
    check_cursor_writable(&options.cursor_file)?;
    let mut done = Followed::default();
    let Some((mut cursor, saved, mut proof)) = run.starting_cursor()? else {
        return Ok(done);
    };
    done.cursor_saved = saved;
    let mut lag = LagReport::new(options);
    // A verifying follower whose cursor the service refuses goes on from
    // what it proved, once in a row (`Run::resume`).
    #[cfg(feature = "verify")]
    let mut resumed_at: Option<Option<FeedCursor>> = None;
    loop {
        let fetched = run.fetch(cursor.as_ref().map(FeedCursor::as_str), options.wait);
        let page = match fetched {
            #[cfg(feature = "verify")]
            Err(FollowError::BadCursor(why)) if proof.is_some() => {
                if resumed_at.as_ref() == Some(&cursor) {
                    return Err(refused_again(&proof, &why));
                }
                let Some(verified) = proof.clone() else {
                    return Err(no_proof());
                };
                let Some((at, proven)) = run.resume(&verified)? else {
                    return Ok(done);
                };
                (cursor, proof) = (at, proven);
                resumed_at = Some(cursor.clone());
                continue;
            }
            fetched => fetched?,
        };
        let Some(page) = page else {
            return Ok(done);
        };
        #[cfg(feature = "verify")]
        {
            resumed_at = None;
        }
        if page.receipts.is_empty() {
            if let Err(withheld) = check_empty(&proof) {
                // A log rolled back under the cursor looks the same; the
                // newest checkpoint tells which.
                run.judge_rolled_back(&proof)?;
                return Err(withheld);
            }
            lag.at_end();
            done.passed_empty(options, &mut cursor, page.next, &lines_of_proof(&proof))?;
            if options.drain || stop.load(Ordering::SeqCst) {
                return Ok(done);
            }
            continue;
        }
        let Some(proven) = run.prove(&proof, &page)? else {
            return Ok(done);
        };
        #[cfg(feature = "test-seams")]
        defect_cursor_saved_before_page(options, &page, &lines_of_proof(&proven))?;
        if !run.hand_on(&page, cursor.as_ref(), out)? {
            return Ok(done);
        }
        proof = proven;
        lag.handed_on(&page, logged_beyond(&proof));
        done.handed_on(options, &mut cursor, page, &lines_of_proof(&proof))?;
        if stop.load(Ordering::SeqCst) {
            return Ok(done);
        }
    }
}

/// Test seam, a known defect for the soak to find: with
/// `PLAN_INTAKE_TEST_DEFECT_CURSOR_BEFORE_PAGE` set, a page's cursor is
/// saved before the page is handed on, so a crash in between loses it.
#[cfg(feature = "test-seams")]
fn defect_cursor_saved_before_page(
    options: &FollowOptions,
    page: &Page,
    proof: &str,
) -> Result<(), FollowError> {
    if std::env::var_os("PLAN_INTAKE_TEST_DEFECT_CURSOR_BEFORE_PAGE").is_some() {
        save_cursor(&options.cursor_file, &page.next, proof)?;
    }
    Ok(())
}

impl Followed {
    /// An empty page: its cursor is saved if it moved (the feed's end as
    /// the service places it), so a restart starts there. Not when
    /// verifying: an empty page proves nothing, and a `next` moved ahead
    /// would skip receipts (an honest service answers an empty page with
    /// the cursor it was sent).
    pub(crate) fn passed_empty(
        &mut self,
        options: &FollowOptions,
        cursor: &mut Option<FeedCursor>,
        next: FeedCursor,
        proof: &str,
    ) -> Result<(), FollowError> {
        if verifying(options) {
            return Ok(());
        }
        if cursor.as_ref() != Some(&next) {
            save_cursor(&options.cursor_file, &next, proof)?;
            self.cursor_saved = true;
            *cursor = Some(next);
        }
        Ok(())
    }

    /// A page handed on: only now is its cursor saved.
    pub(crate) fn handed_on(
        &mut self,
        options: &FollowOptions,
        cursor: &mut Option<FeedCursor>,
        page: Page,
        proof: &str,
    ) -> Result<(), FollowError> {
        save_cursor(&options.cursor_file, &page.next, proof)?;
        self.cursor_saved = true;
        self.pages += 1;
        self.receipts += page.receipts.len() as u64;
        *cursor = Some(page.next);
        Ok(())
    }
}

/// The retries' backoff: from `retry_base`, capped as submit's.
pub(crate) fn backoff_of(options: &FollowOptions) -> Backoff {
    Backoff {
        base: options.retry_base,
        cap: super::submit::MAX_RETRY_DELAY,
    }
}

/// Bounds the service would refuse, refused before anything is sent.
pub(crate) fn check_options(options: &FollowOptions) -> Result<(), FollowError> {
    if !(1..=MAX_LIMIT).contains(&options.limit) {
        return Err(FollowError::Options(format!(
            "limit {} is outside 1 to {MAX_LIMIT}",
            options.limit
        )));
    }
    if options.wait > MAX_WAIT {
        return Err(FollowError::Options(format!(
            "wait {} s is more than the {} s the service takes",
            options.wait.as_secs_f64(),
            MAX_WAIT.as_secs()
        )));
    }
    #[cfg(feature = "verify")]
    if options.from_start && options.from_checkpoint.is_some() {
        return Err(FollowError::Options(
            "from_start and from_checkpoint both name where to start: give one".to_owned(),
        ));
    }
    // A checkpoint that is not one under the pinned keys is a mistake of
    // the caller's, not evidence against the log. (With a cursor file it
    // is not used: keys changed since, it need not hold under them.)
    #[cfg(feature = "verify")]
    if let (Some(keys), Some(note)) = (&options.verify, &options.from_checkpoint)
        && !options.cursor_file.exists()
    {
        plan_intake_wire::evidence::verify_checkpoint(note, keys).map_err(|e| {
            FollowError::Options(format!(
                "the checkpoint to start from (--from-checkpoint) is not one signed by a pinned key (--keys): {e}"
            ))
        })?;
    }
    Ok(())
}

/// Where a run starts, from its cursor file.
pub(crate) enum Start {
    /// The saved cursor (its first line), and the lines after it (a
    /// verifying follower's proof so far).
    Saved(FeedCursor, String),
    /// No file, `from_start`: the feed's first receipt.
    First,
    /// No file: the feed's current end, to be saved before the first page.
    AtEnd,
}

pub(crate) fn start_of(options: &FollowOptions) -> Result<Start, FollowError> {
    let path = &options.cursor_file;
    match std::fs::read_to_string(path) {
        Ok(text) if text.trim().is_empty() => Err(FollowError::BadCursor(format!(
            "cursor file {} is empty; remove it to start at the feed's end",
            path.display()
        ))),
        Ok(text) => {
            let (cursor, rest) = text.trim_start().split_once('\n').unwrap_or((&text, ""));
            Ok(Start::Saved(
                FeedCursor::new(cursor.trim()),
                rest.to_owned(),
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(if options.from_start {
            Start::First
        } else {
            Start::AtEnd
        }),
        Err(source) => Err(FollowError::CursorFile {
            path: path.clone(),
            source,
        }),
    }
}

/// The feed request for one page past `after`.
pub(crate) fn feed_query(options: &FollowOptions, after: Option<&str>, wait: Duration) -> String {
    let mut query = format!(
        "/v1/receipts?limit={}&wait={}",
        options.limit,
        wait.as_secs()
    );
    if let Some(after) = after {
        query.push_str("&after=");
        query.extend(url::form_urlencoded::byte_serialize(after.as_bytes()));
    }
    if options.expand {
        query.push_str("&expand=plan");
    }
    query
}

/// What one feed request's exchange means.
pub(crate) enum PageVerdict {
    Page(Page),
    Stop(FollowError),
    Retry {
        why: String,
        retry_after: Option<Duration>,
    },
}

/// The rules for a feed answer, both APIs': a page; an answer that will
/// not change (a cursor the service cannot place, no permission); or one
/// to wait out (no answer, 408, 429, 5xx).
pub(crate) fn judge_page(exchange: Exchange, options: &FollowOptions) -> PageVerdict {
    let answer = match exchange {
        Exchange::NoAnswer(why) => {
            return PageVerdict::Retry {
                why: format!("no answer: {why}"),
                retry_after: None,
            };
        }
        Exchange::Unreachable(why) => {
            return PageVerdict::Stop(FollowError::Unexpected(format!(
                "cannot reach the service: {why}"
            )));
        }
        Exchange::Answer(answer) => answer,
    };
    PageVerdict::Stop(match answer.status {
        200 => {
            return match serde_json::from_str::<Page>(&answer.body) {
                Ok(page) => PageVerdict::Page(page),
                Err(e) => PageVerdict::Stop(FollowError::Unexpected(format!(
                    "a page that is not a feed page: {e}"
                ))),
            };
        }
        400 if answer.is_problem(CURSOR_NOT_IN_FEED) => FollowError::BadCursor(format!(
            "the service cannot place the cursor in {} in its feed: it was saved against another deployment, or the database was restored to an earlier state, or it lies past the feed's end. Receipts after it cannot be placed, so none are skipped. Keep the file (move it aside) and reconcile downstream; then remove it and pass --from-start to read the whole feed again, downstream skipping the receipt ids it has (nothing missed), or remove it alone to start at the feed's current end (skipping every receipt kept since the cursor's)",
            options.cursor_file.display(),
        )),
        // The options were checked before anything was sent: what the
        // service refuses is the cursor.
        400 => FollowError::BadCursor(format!(
            "cursor file {} holds no cursor the service reads ({}): remove it to start at the feed's current end, or remove it and pass --from-start to read the whole feed",
            options.cursor_file.display(),
            answer.summary()
        )),
        401 | 403 => FollowError::Denied(answer.summary()),
        408 | 429 | 500..=599 => {
            return PageVerdict::Retry {
                why: answer.summary(),
                retry_after: answer.retry_after,
            };
        }
        _ => FollowError::Unexpected(answer.summary()),
    })
}

/// With `drain` (a batch job), how many failed tries in a row end the run:
/// a service that never answers (a typo in the URL, a port nobody listens
/// on) must not hang the job. Without `drain` the follower waits it out.
pub(crate) const DRAIN_TRIES: u32 = 10;

/// A `drain` run gives up after [`DRAIN_TRIES`] failures in a row.
pub(crate) fn drained_out(
    options: &FollowOptions,
    failures: u32,
    why: &str,
) -> Result<(), FollowError> {
    if options.drain && failures >= DRAIN_TRIES {
        return Err(FollowError::Unexpected(format!(
            "gave up after {failures} tries in a row ({why}): --drain does not wait a service out; without it the follower keeps trying"
        )));
    }
    Ok(())
}

/// The cursor file can be written where it is to be (its directory exists
/// and takes a file), checked before anything is read: a page handed on
/// whose cursor then cannot be saved would come again.
pub(crate) fn check_cursor_writable(path: &Path) -> Result<(), FollowError> {
    let failed = |source| FollowError::CursorFile {
        path: path.to_owned(),
        source,
    };
    let directory = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let mut probe_name = path.file_name().unwrap_or_default().to_owned();
    probe_name.push(".probe");
    let probe = directory.join(probe_name);
    File::create(&probe).map_err(failed)?;
    std::fs::remove_file(&probe).map_err(failed)
}

/// The wait before retrying after the `failures`-th failure, told at WARN.
pub(crate) fn retry_wait(
    backoff: &Backoff,
    failures: u32,
    why: &str,
    retry_after: Option<Duration>,
) -> Duration {
    let delay = backoff.delay(failures, retry_after);
    tracing::warn!(
        failures,
        "reading the feed: {why}; retrying in {} ms",
        delay.as_millis()
    );
    delay
}

/// A page's entries as JSON lines, byte for byte as sent.
pub(crate) fn lines_of(page: &Page) -> Vec<u8> {
    let entries = &page.receipts;
    let mut lines = Vec::with_capacity(entries.iter().map(|e| e.get().len() + 1).sum());
    for entry in entries {
        lines.extend_from_slice(entry.get().as_bytes());
        lines.push(b'\n');
    }
    lines
}

struct Run<'a> {
    client: &'a Client,
    options: &'a FollowOptions,
    stop: &'a AtomicBool,
    backoff: Backoff,
    /// What `GET /v1/signing-keys` answered, asked once a receipt under a
    /// key the reader does not pin appears (not trusted: see
    /// `Extended::check_unpinned`).
    #[cfg(feature = "verify")]
    published: Option<plan_intake_wire::evidence::TrustedKeys>,
}

impl Run<'_> {
    /// The saved cursor; with none, the feed's start (`--from-start`: no
    /// cursor) or its current end, saved at once so that a crash before the
    /// first page cannot move the start past receipts written meanwhile.
    /// `None`: asked to stop before a start was known. With the cursor,
    /// whether it was saved just now.
    /// The proof so far comes with it (verifying: from the file, or none
    /// at the feed's start).
    #[allow(clippy::type_complexity)]
    fn starting_cursor(
        &mut self,
    ) -> Result<Option<(Option<FeedCursor>, bool, Proof)>, FollowError> {
        match start_of(self.options)? {
            Start::Saved(cursor, rest) => {
                let proof = proof_of_saved(self.options, &rest)?;
                #[cfg(feature = "verify")]
                if let Some(verified) = &proof {
                    return Ok(self
                        .resume(verified)?
                        .map(|(cursor, proof)| (cursor, false, proof)));
                }
                Ok(Some((Some(cursor), false, proof)))
            }
            Start::First => Ok(Some((None, false, fresh_proof(self.options)))),
            Start::AtEnd => {
                #[cfg(feature = "verify")]
                if let Some(keys) = &self.options.verify {
                    let Some((cursor, proof)) = self.start_at_checkpoint(keys)? else {
                        return Ok(None);
                    };
                    save_cursor(&self.options.cursor_file, &cursor, &lines_of_proof(&proof))?;
                    return Ok(Some((Some(cursor), true, proof)));
                }
                let Some(end) = self.fetch(Some(FeedCursor::NOW), Duration::ZERO)? else {
                    return Ok(None);
                };
                save_cursor(&self.options.cursor_file, &end.next, "")?;
                Ok(Some((Some(end.next), true, Proof::default())))
            }
        }
    }

    /// Verifying: 76 if the service's newest checkpoint proves the log
    /// rolled back below what `proof` verified.
    #[cfg(feature = "verify")]
    fn judge_rolled_back(&mut self, proof: &Proof) -> Result<(), FollowError> {
        let (Some(keys), Some(verified)) = (&self.options.verify, proof) else {
            return Ok(());
        };
        match self.get_unless_stopped(NEWEST_CHECKPOINT, Duration::ZERO) {
            Some(newest) => judge_newest(newest, verified, keys),
            None => Ok(()),
        }
    }
    #[cfg(not(feature = "verify"))]
    fn judge_rolled_back(&mut self, _proof: &Proof) -> Result<(), FollowError> {
        Ok(())
    }

    /// Without `verify`: every page passes.
    #[cfg(not(feature = "verify"))]
    fn prove(&mut self, _proof: &Proof, _page: &Page) -> Result<Option<Proof>, FollowError> {
        Ok(Some(NoProof))
    }

    /// With `verify`: the page's receipts proven to be the log's next
    /// leaves (waiting, quietly, until a checkpoint covers them). `None`:
    /// asked to stop meanwhile.
    #[cfg(feature = "verify")]
    fn prove(&mut self, proof: &Proof, page: &Page) -> Result<Option<Proof>, FollowError> {
        use crate::verify::Verified;
        let Some(keys) = &self.options.verify else {
            return Ok(Some(None));
        };
        let Some(verified) = proof else {
            return Err(no_proof());
        };
        let extended = verified
            .extend_after_prelude(
                keys,
                &page.receipts,
                self.options.expand,
                self.options.unsigned_prelude,
            )
            .map_err(|e| FollowError::Unverified(e.message))?;
        let since = extended.since_query();
        let Some(answer) = self.extension(extended.size(), &since, verified)? else {
            return Ok(None);
        };
        match Verified::prove(&extended, &answer, keys) {
            Ok(proven) => {
                let mut asked = 0;
                while !extended.unpinned_known(self.published.as_ref()) && asked < PUBLISHED_ASKS {
                    if asked > 0 {
                        let delay =
                            retry_wait(&self.backoff, asked, &published_again(&extended), None);
                        if pause_unless_stopped(self.stop, delay) {
                            return Ok(None);
                        }
                    }
                    asked += 1;
                    let Some(published) = self
                        .evidence(PUBLISHED_KEYS, parse_published)
                        .map_err(|e| at_unpinned(&extended, e))?
                    else {
                        return Ok(None);
                    };
                    self.published = Some(published);
                }
                if let Some(published) = &self.published {
                    extended
                        .check_unpinned(published)
                        .map_err(|e| FollowError::Unverified(e.message))?;
                }
                if asked > 0 {
                    warn_unpinned(&extended);
                }
                warn_unsigned(&extended);
                Ok(Some(Some(proven)))
            }
            Err(refused) if refused.locatable => {
                let located = extended.locate(keys, |size| {
                    let query = extension_query(size, "", 0);
                    match self.get_unless_stopped(&query, Duration::ZERO)? {
                        Exchange::Answer(answer) if answer.status == 200 => {
                            serde_json::from_str(&answer.body).ok()
                        }
                        _ => None,
                    }
                });
                Err(FollowError::Unverified(located.unwrap_or(refused.message)))
            }
            Err(refused) => Err(FollowError::Unverified(refused.message)),
        }
    }

    /// Where a verifying follower with no cursor starts: at the checkpoint
    /// it was given, or the first it sees (trusted, and said so), once the
    /// service proved where that checkpoint's tree ends. `None`: asked to
    /// stop meanwhile.
    #[cfg(feature = "verify")]
    fn start_at_checkpoint(
        &mut self,
        keys: &plan_intake_wire::evidence::TrustedKeys,
    ) -> Result<Option<(FeedCursor, Proof)>, FollowError> {
        let note = match &self.options.from_checkpoint {
            Some(note) => note.clone(),
            None => match self.evidence(NEWEST_CHECKPOINT, |body| Ok(body.to_owned()))? {
                Some(note) => note,
                None => return Ok(None),
            },
        };
        let given = starting_checkpoint(self.options, &note, keys)?;
        if self.options.from_checkpoint.is_some() {
            let Some(first) = self.get_unless_stopped(NEWEST_CHECKPOINT, Duration::ZERO) else {
                return Ok(None);
            };
            none_held(&first, &given)?;
            let Some(newest) = self.evidence(NEWEST_CHECKPOINT, |body| Ok(body.to_owned()))? else {
                return Ok(None);
            };
            still_held(&given, &newest, keys)?;
        }
        let start = self.evidence(&start_query(given.size), |body| {
            serde_json::from_str(body).map_err(|e| e.to_string())
        })?;
        start
            .map(|start| start_from(&note, keys, &start))
            .transpose()
    }

    /// One piece of public evidence, waited for while the service has
    /// none yet or cannot answer. `None`: asked to stop meanwhile.
    #[cfg(feature = "verify")]
    fn evidence<T>(
        &mut self,
        query: &str,
        parse: impl Fn(&str) -> Result<T, String>,
    ) -> Result<Option<T>, FollowError> {
        let mut failures = 0u32;
        loop {
            let Some(exchange) = self.get_unless_stopped(query, Duration::ZERO) else {
                return Ok(None);
            };
            failures += 1;
            match judge_evidence(exchange, query, &self.backoff, failures, &parse)? {
                Evidence::Answer(answer) => return Ok(Some(answer)),
                Evidence::Wait(delay) => {
                    if pause_unless_stopped(self.stop, delay) {
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// The newest checkpoint with its proofs from a tree of `size` leaves
    /// (`GET /v1/checkpoint/extension`), waited for while the log has not
    /// taken them yet. `None`: asked to stop meanwhile.
    /// `held`: what was verified before, held to the service's newest
    /// checkpoint while none extends it (a log rolled back is 76 at once).
    #[cfg(feature = "verify")]
    fn extension(
        &mut self,
        size: u64,
        since: &str,
        held: &crate::verify::Verified,
    ) -> Result<Option<plan_intake_wire::evidence::CheckpointExtension>, FollowError> {
        let query = extension_query(size, since, EXTENSION_WAIT_SECS);
        let waits = Duration::from_secs(EXTENSION_WAIT_SECS);
        let began = std::time::Instant::now();
        let mut failures = 0u32;
        loop {
            let Some(exchange) = self.get_unless_stopped(&query, waits) else {
                return Ok(None);
            };
            failures += 1;
            let delay = match judge_extension(exchange, size, &self.backoff, failures)? {
                ExtensionVerdict::Answer(answer) => return Ok(Some(answer)),
                ExtensionVerdict::Wait(delay) => delay,
                ExtensionVerdict::CheckThenWait(delay) => {
                    let Some(newest) = self.get_unless_stopped(NEWEST_CHECKPOINT, Duration::ZERO)
                    else {
                        return Ok(None);
                    };
                    if let Some(keys) = &self.options.verify {
                        judge_newest(newest, held, keys)?;
                    }
                    let Some(ready) = self.get_unless_stopped(READINESS, Duration::ZERO) else {
                        return Ok(None);
                    };
                    tell_readiness(ready, size, began.elapsed());
                    delay
                }
            };
            if pause_unless_stopped(self.stop, delay) {
                return Ok(None);
            }
        }
    }

    /// Where a verifying follower goes on from what it verified (`proof`,
    /// saved or in hand): the service's newest checkpoint must still hold
    /// it (else 76: rolled back, forked), and the feed cursor after its
    /// last leaf is the service's start there, its edge held to the proof.
    /// The cursor saved beside the proof is not trusted: it is what the
    /// service said, not what was proven (a `next` moved ahead, a row at
    /// it deleted). `None`: asked to stop meanwhile.
    #[cfg(feature = "verify")]
    fn resume(
        &mut self,
        proof: &crate::verify::Verified,
    ) -> Result<Option<(Option<FeedCursor>, Proof)>, FollowError> {
        let Some(keys) = self.options.verify.clone() else {
            return Err(no_proof());
        };
        if !has_resume_point(proof) {
            return Ok(Some((None, Some(proof.clone()))));
        }
        let extended = proof
            .extend(&keys, &[], false)
            .map_err(|e| FollowError::Unverified(e.message))?;
        let Some(answer) = self.extension(proof.size, &extended.since_query(), proof)? else {
            return Ok(None);
        };
        let proven = resumed(proof, &extended, &answer, &keys)?;
        let Some(start) = self.evidence(&start_query(proven.size), |body| {
            serde_json::from_str::<plan_intake_wire::evidence::CheckpointStart>(body)
                .map_err(|e| e.to_string())
        })?
        else {
            return Ok(None);
        };
        proven
            .check_start(&start)
            .map_err(|e| FollowError::Unverified(e.message))?;
        Ok(Some((Some(start.after), Some(proven))))
    }

    /// One page past `after`, retried (with backoff) until the service
    /// answers it. `None`: asked to stop meanwhile.
    fn fetch(&mut self, after: Option<&str>, wait: Duration) -> Result<Option<Page>, FollowError> {
        let query = feed_query(self.options, after, wait);
        let mut failures = 0u32;
        loop {
            let Some(exchange) = self.get_unless_stopped(&query, wait) else {
                return Ok(None);
            };
            let (why, retry_after) = match judge_page(exchange, self.options) {
                PageVerdict::Page(page) => return Ok(Some(page)),
                PageVerdict::Stop(error) => return Err(error),
                PageVerdict::Retry { why, retry_after } => (why, retry_after),
            };
            failures += 1;
            drained_out(self.options, failures, &why)?;
            let delay = retry_wait(&self.backoff, failures, &why, retry_after);
            if pause_unless_stopped(self.stop, delay) {
                return Ok(None);
            }
        }
    }

    /// The GET runs on a thread of its own so that a stop request is obeyed
    /// at once even in the middle of a long poll: no page is in hand then.
    fn get_unless_stopped(&self, query: &str, wait: Duration) -> Option<Exchange> {
        let (sender, answer) = mpsc::channel();
        let request = self
            .client
            .agent
            .get(&self.client.url(query))
            // The long poll, plus time for the page itself.
            .timeout(wait + Duration::from_secs(30))
            .set("Authorization", &self.client.authorization);
        std::thread::spawn(move || {
            let _ = sender.send(Exchange::from_ureq(request.call()));
        });
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return None;
            }
            match answer.recv_timeout(STOP_POLL) {
                Ok(exchange) => return Some(exchange),
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Some(Exchange::NoAnswer("the request thread ended".to_owned()));
                }
            }
        }
    }

    /// Hands one page on: to the output, flushed, or to `CMD` until it exits
    /// 0. `false`: asked to stop before `CMD` took it (the page stays unsaved
    /// and comes again on the next run).
    fn hand_on(
        &mut self,
        page: &Page,
        after: Option<&FeedCursor>,
        out: &mut dyn Write,
    ) -> Result<bool, FollowError> {
        let entries = &page.receipts;
        let lines = lines_of(page);
        let Some(command) = &self.options.exec else {
            out.write_all(&lines)
                .and_then(|()| out.flush())
                .map_err(FollowError::Output)?;
            return Ok(true);
        };
        let mut failures = 0u32;
        loop {
            let why = match run_command(command, &lines, &PageFacts::of(page, after)) {
                Ok(status) if status.success() => return Ok(true),
                // `sh`'s own answer for a command it could not start: not
                // found (127) or not executable (126). Retrying cannot help.
                Ok(status) if matches!(status.code(), Some(126 | 127)) => {
                    return Err(FollowError::Exec {
                        command: command.clone(),
                        source: io::Error::other(format!(
                            "{status}: the command was not found or is not executable"
                        )),
                    });
                }
                Ok(status) => format!("`{command}` {status}"),
                Err(source) => {
                    return Err(FollowError::Exec {
                        command: command.clone(),
                        source,
                    });
                }
            };
            failures += 1;
            let delay = handed_again(&self.backoff, failures, entries.len(), &why);
            if pause_unless_stopped(self.stop, delay) {
                return Ok(false);
            }
        }
    }
}

/// The request for the newest checkpoint and its proofs from `size`
/// leaves (and `since`: `&since=P`, or empty), waiting up to `wait`
/// seconds for a checkpoint that holds them (the service appends for the
/// asker at once).
#[cfg(feature = "verify")]
pub(crate) fn extension_query(size: u64, since: &str, wait: u64) -> String {
    format!("/v1/checkpoint/extension?size={size}{since}&wait={wait}")
}

/// How long one checkpoint request waits for the page's leaves to be
/// logged: well within the request's own time bound.
#[cfg(feature = "verify")]
pub(crate) const EXTENSION_WAIT_SECS: u64 = 10;

/// What one checkpoint-extension exchange means.
#[cfg(feature = "verify")]
pub(crate) enum ExtensionVerdict {
    Answer(plan_intake_wire::evidence::CheckpointExtension),
    /// Ask again after this long.
    Wait(Duration),
    /// Hold what was verified to the service's newest checkpoint first
    /// (the log may have been rolled back), then ask again after this long.
    CheckThenWait(Duration),
}

/// The rules for a checkpoint-extension answer, both APIs': the answer;
/// a wait (quietly while the log has not taken the page yet, which it
/// does within a second or so; told at WARN for a failure); or the end.
#[cfg(feature = "verify")]
pub(crate) fn judge_extension(
    exchange: Exchange,
    size: u64,
    backoff: &Backoff,
    failures: u32,
) -> Result<ExtensionVerdict, FollowError> {
    match exchange {
        Exchange::Answer(answer) if answer.status == 200 => serde_json::from_str(&answer.body)
            .map(ExtensionVerdict::Answer)
            .map_err(|e| {
                FollowError::Unverified(format!(
                    "log index {size}: the service's checkpoint answer is not one: {e}"
                ))
            }),
        Exchange::Answer(answer) if answer.is_problem("not-logged-yet") => {
            let delay = backoff.delay(failures.min(3), answer.retry_after);
            // The service waited for its log already: said on the first
            // such answer, then every tenth (a service that signs nothing
            // never logs anything, and answers at once).
            if failures == 1 || failures.is_multiple_of(10) {
                tracing::warn!(
                    failures,
                    "no signed checkpoint holds log index {} yet (is the service signing? `/readyz` says): waiting",
                    size.saturating_sub(1)
                );
                // A log rolled back never catches up: said at once, not
                // waited for.
                return Ok(ExtensionVerdict::CheckThenWait(delay));
            }
            Ok(ExtensionVerdict::Wait(delay))
        }
        // The service's own word that the log holds fewer leaves than a
        // checkpoint verified before; held to its newest checkpoint.
        Exchange::Answer(answer) if answer.is_problem(LOG_ROLLED_BACK) => {
            Ok(ExtensionVerdict::CheckThenWait(retry_wait(
                backoff,
                failures,
                &answer.summary(),
                answer.retry_after,
            )))
        }
        Exchange::Answer(answer) if matches!(answer.status, 408 | 429 | 500..=599) => {
            Ok(ExtensionVerdict::Wait(retry_wait(
                backoff,
                failures,
                &answer.summary(),
                answer.retry_after,
            )))
        }
        Exchange::NoAnswer(why) => Ok(ExtensionVerdict::Wait(retry_wait(
            backoff,
            failures,
            &format!("no answer: {why}"),
            None,
        ))),
        Exchange::Unreachable(why) => Err(FollowError::Unexpected(format!(
            "cannot reach the service: {why}"
        ))),
        Exchange::Answer(answer) => Err(FollowError::Unexpected(answer.summary())),
    }
}

/// The newest checkpoint, as a signed note.
#[cfg(feature = "verify")]
pub(crate) const NEWEST_CHECKPOINT: &str = "/v1/checkpoint";

/// The problem type of an extension asked from a checkpoint larger than
/// the log's newest.
#[cfg(feature = "verify")]
pub(crate) const LOG_ROLLED_BACK: &str = "log-rolled-back";

/// The service's newest checkpoint (`GET /v1/checkpoint`'s exchange) held
/// against what was verified (`proof`): 76 if it proves the log rolled
/// back, forked or another's; an answer that proves nothing passes.
#[cfg(feature = "verify")]
pub(crate) fn judge_newest(
    exchange: Exchange,
    proof: &crate::verify::Verified,
    keys: &plan_intake_wire::evidence::TrustedKeys,
) -> Result<(), FollowError> {
    let newest = match exchange {
        Exchange::Answer(answer) if answer.status == 200 => {
            let newest = plan_intake_wire::evidence::verify_checkpoint(&answer.body, keys)
                .map_err(|e| {
                    FollowError::Unverified(format!(
                        "log index {}: the service's newest checkpoint: signature check: {e}",
                        proof.size
                    ))
                })?;
            Some(newest)
        }
        Exchange::Answer(answer) if answer.is_problem("not-logged-yet") => None,
        _ => return Ok(()),
    };
    proof
        .held_by(newest.as_ref())
        .map_err(|e| FollowError::Unverified(e.message))
}

/// Where the service says whether it is ready (public; its reason is the
/// problem's type).
#[cfg(feature = "verify")]
pub(crate) const READINESS: &str = "/readyz";

/// While no checkpoint holds log index `size - 1`: what `/readyz`
/// answered, told at WARN when the service says it is not ready (a log
/// that cannot be appended to, a key not recorded), so the wait names why.
#[cfg(feature = "verify")]
pub(crate) fn tell_readiness(exchange: Exchange, size: u64, waited: Duration) {
    let Exchange::Answer(answer) = exchange else {
        return;
    };
    if answer.status == 503 {
        let reason = serde_json::from_str::<serde_json::Value>(&answer.body)
            .ok()
            .and_then(|problem| {
                let kind = problem.get("type")?.as_str()?;
                Some(kind.rsplit('/').next().unwrap_or(kind).to_owned())
            })
            .unwrap_or_else(|| "503".to_owned());
        tracing::warn!(
            reason = %reason,
            waited_seconds = waited.as_secs(),
            "the service is not ready ({reason}): no signed checkpoint holds log index {} yet; waiting, {} s so far (nothing handed on meanwhile)",
            size.saturating_sub(1),
            waited.as_secs()
        );
    }
}

/// The proof after a resume, held to the service's newest checkpoint
/// (`answer`: its extension from what was verified), and the service's
/// place to go on from (`start`) held to it.
#[cfg(feature = "verify")]
pub(crate) fn resumed(
    proof: &crate::verify::Verified,
    extended: &crate::verify::Extended,
    answer: &plan_intake_wire::evidence::CheckpointExtension,
    keys: &plan_intake_wire::evidence::TrustedKeys,
) -> Result<crate::verify::Verified, FollowError> {
    let proven = crate::verify::Verified::prove(extended, answer, keys).map_err(|e| {
        FollowError::Unverified(format!(
            "log index {} (resuming; every receipt before it was verified and handed on): {}",
            proof.size, e.message
        ))
    })?;
    Ok(proven)
}

/// Whether a verifying follower has anything to resume from (a start at
/// the feed's first receipt with nothing handed on has not).
#[cfg(feature = "verify")]
pub(crate) fn has_resume_point(proof: &crate::verify::Verified) -> bool {
    proof.size > 0 || proof.logged().is_some()
}

/// Every key that signed, as the service publishes them (not trusted).
#[cfg(feature = "verify")]
pub(crate) const PUBLISHED_KEYS: &str = "/v1/signing-keys";

/// How often `GET /v1/signing-keys` is asked for a key it does not list
/// before the receipt is refused (a key just rotated in may be listed a
/// moment late; the asks back off from `retry_base`).
#[cfg(feature = "verify")]
pub(crate) const PUBLISHED_ASKS: u32 = 5;

/// The service's published keys, parsed (each key it cannot read left
/// out).
#[cfg(feature = "verify")]
pub(crate) fn parse_published(
    body: &str,
) -> Result<plan_intake_wire::evidence::TrustedKeys, String> {
    plan_intake_wire::evidence::TrustedKeys::published(body)
}

/// Why the published keys are asked for again.
#[cfg(feature = "verify")]
pub(crate) fn published_again(extended: &crate::verify::Extended) -> String {
    format!(
        "GET {PUBLISHED_KEYS} does not list key {} yet",
        extended.unpinned_keys().join(", ")
    )
}

/// A failure to read the published keys, placed at the receipt that
/// needed them.
#[cfg(feature = "verify")]
pub(crate) fn at_unpinned(extended: &crate::verify::Extended, error: FollowError) -> FollowError {
    match (error, extended.first_unpinned()) {
        (FollowError::Unverified(why), Some(at)) => FollowError::Unverified(format!(
            "{at}: signed by a key the reader does not pin, and {why}"
        )),
        (error, _) => error,
    }
}

/// Said once a page holds receipts under keys the reader does not pin
/// (after a rotation): they are held to their leaves, under checkpoints
/// signed by pinned keys, and to the keys the service publishes.
#[cfg(feature = "verify")]
pub(crate) fn warn_unpinned(extended: &crate::verify::Extended) {
    tracing::warn!(
        keys = %extended.unpinned_keys().join(", "),
        "receipts signed by a key the reader does not pin: each is held to its leaf under a checkpoint signed by a pinned key, and its signature to the key GET {PUBLISHED_KEYS} lists; pin that key's .pub to check them under your own copy"
    );
}

/// Said once a page holds receipts kept before the log's first key: they
/// carry no signature, and are held to their leaves alone.
#[cfg(feature = "verify")]
pub(crate) fn warn_unsigned(extended: &crate::verify::Extended) {
    if let (Some(first), Some(last)) = (extended.unsigned().first(), extended.unsigned().last()) {
        tracing::warn!(
            first,
            last,
            "log indexes {first} to {last}: receipts kept before the log's first key, unsigned: each is held to its leaf under a checkpoint signed by a pinned key, and no receipt after a signed one may be unsigned"
        );
    }
}

/// Where a verifying reader starts at the checkpoint of `size` leaves.
#[cfg(feature = "verify")]
pub(crate) fn start_query(size: u64) -> String {
    format!("/v1/checkpoint/start?size={size}")
}

/// What one exchange for a piece of public evidence means.
#[cfg(feature = "verify")]
pub(crate) enum Evidence<T> {
    Answer(T),
    Wait(Duration),
}

/// The rules for a piece of public evidence (`query`), both APIs': an
/// answer; one to wait out (none yet, no answer, 408, 429, 5xx); or one
/// that will not change.
#[cfg(feature = "verify")]
pub(crate) fn judge_evidence<T>(
    exchange: Exchange,
    query: &str,
    backoff: &Backoff,
    failures: u32,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<Evidence<T>, FollowError> {
    let wait = |why: String, retry_after| {
        Ok(Evidence::Wait(retry_wait(
            backoff,
            failures,
            &format!("GET {query}: {why}"),
            retry_after,
        )))
    };
    match exchange {
        Exchange::Answer(answer) if answer.status == 200 => {
            parse(&answer.body).map(Evidence::Answer).map_err(|e| {
                FollowError::Unverified(format!(
                    "GET {query}: the service's answer is not one: {e}"
                ))
            })
        }
        Exchange::Answer(answer)
            if answer.is_problem("not-logged-yet")
                || matches!(answer.status, 408 | 429 | 500..=599) =>
        {
            wait(answer.summary(), answer.retry_after)
        }
        Exchange::NoAnswer(why) => wait(format!("no answer: {why}"), None),
        Exchange::Unreachable(why) => Err(FollowError::Unexpected(format!(
            "cannot reach the service: {why}"
        ))),
        Exchange::Answer(answer) if matches!(answer.status, 401 | 403) => Err(FollowError::Denied(
            format!("GET {query}: {}", answer.summary()),
        )),
        Exchange::Answer(answer) => Err(FollowError::Unexpected(format!(
            "GET {query}: {}",
            answer.summary()
        ))),
    }
}

/// The checkpoint a verifying follower starts at, its
/// signature checked under the pinned keys; one it was not given is
/// trusted as the first it saw, and said so.
#[cfg(feature = "verify")]
pub(crate) fn starting_checkpoint(
    options: &FollowOptions,
    note: &str,
    keys: &plan_intake_wire::evidence::TrustedKeys,
) -> Result<plan_intake_wire::evidence::VerifiedCheckpoint, FollowError> {
    let checkpoint = plan_intake_wire::evidence::verify_checkpoint(note, keys).map_err(|e| {
        FollowError::Unverified(format!("the starting checkpoint: signature check: {e}"))
    })?;
    if options.from_checkpoint.is_none() {
        tracing::warn!(
            origin = %checkpoint.origin,
            "no cursor file and no --from-start: trusting the first checkpoint seen ({} receipts) as the log's; the {} receipts before it are not handed on, and the ones after it are verified against it. Pin one with --from-checkpoint FILE",
            checkpoint.size,
            checkpoint.size
        );
    }
    Ok(checkpoint)
}

/// A checkpoint given to start at (`given`) is one the service's log still
/// holds: its newest checkpoint has as many leaves or more, under the same
/// name, and the same root at the same size. Fewer is a log rolled back (a
/// restore, a failover that lost commits) or another deployment's; the
/// start asked for at `given` would never come.
#[cfg(feature = "verify")]
pub(crate) fn still_held(
    given: &plan_intake_wire::evidence::VerifiedCheckpoint,
    newest: &str,
    keys: &plan_intake_wire::evidence::TrustedKeys,
) -> Result<(), FollowError> {
    let newest = plan_intake_wire::evidence::verify_checkpoint(newest, keys).map_err(|e| {
        FollowError::Unverified(format!(
            "log index {} (the starting checkpoint's end; nothing handed on): the service's newest checkpoint: signature check: {e}",
            given.size
        ))
    })?;
    // The first log index the service's log is known not to hold.
    let (index, refused) = if newest.origin != given.origin {
        (
            0,
            format!(
                "the service's newest checkpoint is of the log {:?}, not {:?}: another deployment's",
                newest.origin, given.origin
            ),
        )
    } else if newest.size < given.size {
        (
            newest.size,
            format!(
                "the service's newest checkpoint holds {} receipts, fewer than the {} of the checkpoint given: its log was rolled back (a restore, or a failover that lost commits)",
                newest.size, given.size
            ),
        )
    } else if newest.size == given.size && newest.root != given.root {
        (
            given.size.saturating_sub(1),
            "the service's newest checkpoint of the same size has another root: the log forked at or before this index".to_owned(),
        )
    } else {
        return Ok(());
    };
    Err(FollowError::Unverified(format!(
        "log index {index} (starting at the checkpoint given; nothing handed on): {refused}"
    )))
}

/// A service with no signed checkpoint at all (`GET /v1/checkpoint`'s
/// `first` answer) holds none of the leaves of a checkpoint given to start
/// at: 76 at once, not a wait for one that never comes.
#[cfg(feature = "verify")]
pub(crate) fn none_held(
    first: &Exchange,
    given: &plan_intake_wire::evidence::VerifiedCheckpoint,
) -> Result<(), FollowError> {
    match first {
        Exchange::Answer(answer) if given.size > 0 && answer.is_problem("not-logged-yet") => {
            Err(FollowError::Unverified(format!(
                "log index 0 (starting at the checkpoint given; nothing handed on): the service has no signed checkpoint, and the one given holds {} receipts: its log was rolled back (a restore to before it signed), or is not the note's",
                given.size
            )))
        }
        _ => Ok(()),
    }
}

/// The cursor and proof a verifying follower starts with at the checkpoint
/// `note`, from the service's answer where to start there.
#[cfg(feature = "verify")]
pub(crate) fn start_from(
    note: &str,
    keys: &plan_intake_wire::evidence::TrustedKeys,
    start: &plan_intake_wire::evidence::CheckpointStart,
) -> Result<(FeedCursor, Proof), FollowError> {
    let verified = crate::verify::Verified::at_checkpoint(note, keys, start)
        .map_err(|e| FollowError::Unverified(e.message))?;
    Ok((start.after.clone(), Some(verified)))
}

/// The service refuses the cursor its own start after what was verified
/// gave: it cannot serve the feed after the last leaf handed on.
#[cfg(feature = "verify")]
pub(crate) fn refused_again(proof: &Proof, why: &str) -> FollowError {
    let size = proof.as_ref().map_or(0, |p| p.size);
    FollowError::Unverified(format!(
        "log index {size}: the service refuses the feed cursor its own start after log index {} gave ({why}); every receipt before it was verified",
        size.saturating_sub(1)
    ))
}

/// A verifying follower with nothing proven to go on from (a bug: it
/// starts at the feed's first receipt, at a checkpoint, or from a cursor
/// it saved).
#[cfg(feature = "verify")]
pub(crate) fn no_proof() -> FollowError {
    FollowError::Unverified(
        "no proof to go on from: a verifying follower starts at the feed's first receipt, at a checkpoint, or from a cursor it saved".to_owned(),
    )
}

/// Keeps [`Lag`] up to date and tells it every `lag_every`.
pub(crate) struct LagReport<'a> {
    options: &'a FollowOptions,
    lag: std::sync::Arc<Lag>,
    told: Option<std::time::Instant>,
}

impl<'a> LagReport<'a> {
    pub(crate) fn new(options: &'a FollowOptions) -> Self {
        Self {
            options,
            lag: options.lag.clone().unwrap_or_default(),
            told: None,
        }
    }

    /// An empty page: the follower stands at the feed's end.
    pub(crate) fn at_end(&mut self) {
        self.lag.set(Some(0), Duration::ZERO);
        self.tell();
    }

    /// A page handed on; `logged_beyond`: receipts the log held past it.
    pub(crate) fn handed_on(&mut self, page: &Page, logged_beyond: Option<u64>) {
        // Short of its limit: the page reached the feed's end (or, with
        // `expand`, its byte budget: a verifying follower knows which).
        let short = page.receipts.len() < self.options.limit as usize;
        if short && logged_beyond.unwrap_or(0) == 0 {
            self.lag.set(Some(0), Duration::ZERO);
        } else {
            let age = page
                .receipts
                .last()
                .and_then(|entry| received_at(entry))
                .and_then(|at| std::time::SystemTime::now().duration_since(at).ok())
                .unwrap_or_default();
            self.lag.set(logged_beyond, age);
        }
        self.tell();
    }

    fn tell(&mut self) {
        if self
            .told
            .is_some_and(|told| told.elapsed() < self.options.lag_every)
        {
            return;
        }
        self.told = Some(std::time::Instant::now());
        let seconds = self.lag.seconds();
        match self.lag.receipts() {
            Some(receipts) => tracing::info!(
                receipts_behind = receipts,
                seconds_behind = seconds,
                "following: {receipts} receipt(s) and {seconds:.1} s behind the feed's end"
            ),
            None => tracing::info!(
                seconds_behind = seconds,
                "following: {seconds:.1} s behind the feed's end"
            ),
        }
    }
}

/// When the receipt in `entry` (or the receipt of an expanded plan) was
/// received.
fn received_at(entry: &RawValue) -> Option<std::time::SystemTime> {
    #[derive(serde::Deserialize)]
    struct Entry {
        received_at: Option<String>,
        receipt: Option<Received>,
    }
    #[derive(serde::Deserialize)]
    struct Received {
        received_at: String,
    }
    let entry: Entry = serde_json::from_str(entry.get()).ok()?;
    let text = entry.received_at.or(entry.receipt.map(|r| r.received_at))?;
    humantime::parse_rfc3339(&text).ok()
}

/// Receipts the log held past the last one handed on (verifying only).
#[cfg(feature = "verify")]
pub(crate) fn logged_beyond(proof: &Proof) -> Option<u64> {
    let proof = proof.as_ref()?;
    Some(proof.logged()?.saturating_sub(proof.size))
}
#[cfg(not(feature = "verify"))]
pub(crate) fn logged_beyond(_proof: &Proof) -> Option<u64> {
    None
}

/// What a verifying follower proved so far, saved after each cursor
/// (nothing without `verify`, or when not verifying).
#[cfg(feature = "verify")]
pub(crate) type Proof = Option<crate::verify::Verified>;
#[cfg(not(feature = "verify"))]
pub(crate) type Proof = NoProof;

/// A follower that cannot verify proves nothing.
#[cfg(not(feature = "verify"))]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct NoProof;

/// An empty page is refused while a checkpoint verified before holds
/// receipts beyond those handed on (verifying only).
#[cfg(feature = "verify")]
pub(crate) fn check_empty(proof: &Proof) -> Result<(), FollowError> {
    match proof {
        Some(proof) => proof
            .check_empty()
            .map_err(|e| FollowError::Unverified(e.message)),
        None => Ok(()),
    }
}
#[cfg(not(feature = "verify"))]
pub(crate) fn check_empty(_proof: &Proof) -> Result<(), FollowError> {
    Ok(())
}

/// The lines saved after the cursor.
#[cfg(feature = "verify")]
pub(crate) fn lines_of_proof(proof: &Proof) -> String {
    proof.as_ref().map(|p| p.to_lines()).unwrap_or_default()
}
#[cfg(not(feature = "verify"))]
pub(crate) fn lines_of_proof(_proof: &Proof) -> String {
    String::new()
}

/// The proof at the feed's first receipt: none yet, an empty tree when
/// verifying.
#[cfg(feature = "verify")]
pub(crate) fn fresh_proof(options: &FollowOptions) -> Proof {
    options
        .verify
        .as_ref()
        .map(|_| crate::verify::Verified::default())
}
#[cfg(not(feature = "verify"))]
pub(crate) fn fresh_proof(_options: &FollowOptions) -> Proof {
    NoProof
}

/// The proof a saved cursor carries: a verifying follower needs it (a
/// cursor saved without one cannot be verified from).
#[cfg(feature = "verify")]
pub(crate) fn proof_of_saved(options: &FollowOptions, rest: &str) -> Result<Proof, FollowError> {
    if options.verify.is_none() {
        return Ok(None);
    }
    match crate::verify::Verified::from_lines(rest) {
        Ok(Some(proof)) => Ok(Some(proof)),
        Ok(None) => Err(FollowError::BadCursor(format!(
            "cursor file {} was saved by a follower that did not verify: what it handed on was never proven, so verification cannot start there. Remove the file and pass --from-start to verify the whole feed, or --from-checkpoint FILE to start at a checkpoint",
            options.cursor_file.display()
        ))),
        Err(why) => Err(FollowError::BadCursor(format!(
            "cursor file {} holds no proof a verifying follower can go on from ({why}): remove it and pass --from-start to verify the whole feed, or --from-checkpoint FILE to start at a checkpoint",
            options.cursor_file.display()
        ))),
    }
}
#[cfg(not(feature = "verify"))]
pub(crate) fn proof_of_saved(_options: &FollowOptions, _rest: &str) -> Result<Proof, FollowError> {
    Ok(NoProof)
}

/// Whether `options` ask for the verified feed.
fn verifying(options: &FollowOptions) -> bool {
    #[cfg(feature = "verify")]
    return options.verify.is_some();
    #[cfg(not(feature = "verify"))]
    {
        let _ = options;
        false
    }
}

/// The wait before a page whose handling failed (`why`) is handed on
/// again, both APIs': backoff without end, told at WARN.
pub(crate) fn handed_again(
    backoff: &Backoff,
    failures: u32,
    receipts: usize,
    why: &str,
) -> Duration {
    let delay = backoff.delay(failures, None);
    tracing::warn!(
        failures,
        receipts,
        "{why}; the page is handed to it again in {} ms",
        delay.as_millis()
    );
    delay
}

/// How often a wait looks at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(50);

/// Sleeps `delay`; `true` (early) when asked to stop.
fn pause_unless_stopped(stop: &AtomicBool, delay: Duration) -> bool {
    // A `Retry-After` of centuries waits as long as a day would (and
    // cannot overflow the clock).
    let delay = delay.min(Duration::from_secs(24 * 3600));
    let until = std::time::Instant::now() + delay;
    loop {
        if stop.load(Ordering::SeqCst) {
            return true;
        }
        let left = until.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        std::thread::sleep(left.min(STOP_POLL));
    }
}

/// What `CMD` is told about the page it is handed, in its environment.
struct PageFacts {
    receipts: usize,
    first: String,
    last: String,
    after: String,
    next: String,
}

impl PageFacts {
    fn of(page: &Page, after: Option<&FeedCursor>) -> Self {
        let receipt_id = |entry: Option<&Box<RawValue>>| {
            #[derive(serde::Deserialize)]
            struct Entry {
                receipt_id: Option<String>,
                receipt: Option<Receipted>,
            }
            #[derive(serde::Deserialize)]
            struct Receipted {
                receipt_id: String,
            }
            entry
                .and_then(|e| serde_json::from_str::<Entry>(e.get()).ok())
                .and_then(|e| e.receipt_id.or(e.receipt.map(|r| r.receipt_id)))
                .unwrap_or_default()
        };
        Self {
            receipts: page.receipts.len(),
            first: receipt_id(page.receipts.first()),
            last: receipt_id(page.receipts.last()),
            after: after.map(|c| c.as_str().to_owned()).unwrap_or_default(),
            next: page.next.as_str().to_owned(),
        }
    }
}

/// `sh -c CMD` with `lines` on its stdin and the page's facts in its
/// environment (`PLAN_INTAKE_PAGE_RECEIPTS`, `_FIRST`, `_LAST`: the count
/// and the first and last receipt ids; `_AFTER`: the cursor the page was
/// read after, empty at the feed's start; `_NEXT`: the cursor saved once
/// CMD exits 0). Never the reader's token: `PLAN_INTAKE_TOKEN` is removed.
/// It runs in a process group of its own, so a Ctrl-C meant for the
/// follower does not cut the page short: the follower finishes the page and
/// then stops.
fn run_command(
    command: &str,
    lines: &[u8],
    page: &PageFacts,
) -> io::Result<std::process::ExitStatus> {
    use std::os::unix::process::CommandExt;
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(command)
        .env_remove("PLAN_INTAKE_TOKEN")
        .env("PLAN_INTAKE_PAGE_RECEIPTS", page.receipts.to_string())
        .env("PLAN_INTAKE_PAGE_FIRST", &page.first)
        .env("PLAN_INTAKE_PAGE_LAST", &page.last)
        .env("PLAN_INTAKE_PAGE_AFTER", &page.after)
        .env("PLAN_INTAKE_PAGE_NEXT", &page.next)
        .stdin(Stdio::piped())
        .process_group(0)
        .spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        // A CMD that exits without reading everything is judged by its exit
        // status, not by the broken pipe.
        let _ = stdin.write_all(lines);
    }
    child.wait()
}

/// Replaces the cursor file so that a crash at any moment leaves either the
/// old cursor or the new one, never a torn one: temp file, fsync, rename,
/// fsync of the directory (which makes the rename itself durable).
/// `proof`: lines saved after the cursor's (a verifying follower's).
pub(crate) fn save_cursor(
    path: &Path,
    cursor: &FeedCursor,
    proof: &str,
) -> Result<(), FollowError> {
    let failed = |source| FollowError::CursorFile {
        path: path.to_owned(),
        source,
    };
    let directory = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let mut temporary_name = path.file_name().unwrap_or_default().to_owned();
    temporary_name.push(".tmp");
    let temporary = directory.join(temporary_name);
    let mut file = File::create(&temporary).map_err(failed)?;
    file.write_all(format!("{cursor}\n{proof}").as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(failed)?;
    drop(file);
    std::fs::rename(&temporary, path).map_err(failed)?;
    File::open(directory)
        .and_then(|dir| dir.sync_all())
        .map_err(failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_cursor_replaces_the_old_one_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("orders.cursor");
        save_cursor(&path, &FeedCursor::new("c-1"), "").expect("save");
        save_cursor(&path, &FeedCursor::new("c-2"), "").expect("save again");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "c-2\n");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("orders.cursor")]);
    }

    /// Bounds the service would refuse are refused first, with nothing sent
    /// and no cursor file written. The stop flag is set, so that without
    /// the check `follow` would return at once (`Ok`) instead of waiting out
    /// the port nobody listens on.
    #[test]
    fn options_outside_the_service_bounds_are_refused_before_any_request() {
        let dir = tempfile::tempdir().expect("tempdir");
        let client = Client::new("http://127.0.0.1:9", "token").expect("a client");
        let stop = AtomicBool::new(true);
        for (limit, wait) in [
            (0, Duration::ZERO),
            (MAX_LIMIT + 1, Duration::ZERO),
            (DEFAULT_LIMIT, MAX_WAIT + Duration::from_secs(1)),
        ] {
            let options = FollowOptions {
                limit,
                wait,
                ..FollowOptions::new(dir.path().join("cursor"))
            };
            let refused = follow(&client, &options, &stop, &mut std::io::sink());
            assert!(
                matches!(refused, Err(FollowError::Options(_))),
                "{limit} {wait:?}: {refused:?}"
            );
            assert!(!dir.path().join("cursor").exists());
        }
    }
}
