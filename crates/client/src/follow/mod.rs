//! Following the feed, in feed order, every receipt handed on with the
//! position after it. The loop here owns the rules (reading, proving,
//! waiting, retrying); each way of handing on is a [`Sink`] of its own
//! (`sink`). A cursor file's sinks hand each page on before its cursor is
//! saved (at least once: a crash between repeats the page, never skips
//! one); a sink that keeps both in one transaction (a consumer's database,
//! a caller's code given [`Position`]s) gets every receipt exactly once.

use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::value::RawValue;

use plan_intake_wire::feed::{
    CURSOR_NOT_IN_FEED, DEFAULT_LIMIT, FeedCursor, FeedPage, MAX_LIMIT, MAX_WAIT,
};

use super::{Backoff, Client, Exchange};

mod evidence;
mod lag;
mod sink;

pub(crate) use evidence::*;
pub use lag::Lag;
pub(crate) use lag::LagReport;
pub(crate) use sink::{CursorFile, Hand, Handler};
pub use sink::{Position, Refusal, Sink};

/// What to follow and where to hand it. The defaults are the CLI's.
#[derive(Debug, Clone)]
pub struct FollowOptions {
    /// Where [`follow`] keeps its cursor between pages and runs (the other
    /// ways of following keep a [`Position`] instead and ignore it).
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

/// The command line's defaults with no cursor file: for the ways of
/// following that keep a [`Position`] instead ([`follow_from`],
/// [`follow_into`]).
impl Default for FollowOptions {
    fn default() -> Self {
        Self::new(PathBuf::new())
    }
}

/// How far a run got before it stopped cleanly (drained, or asked to stop).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Followed {
    /// Non-empty pages handed on.
    pub pages: u64,
    /// Receipts handed on.
    pub receipts: u64,
    /// Whether this run saved a position (the cursor file, or a sink's):
    /// it may not have, when it stopped before it had anything to save.
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
    /// A sink cannot keep pages (a consumer's database without the
    /// inbox's tables, or refusing them): nothing of the page was kept.
    #[error("cannot keep the page: {0}")]
    Sink(String),
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
            Self::CursorFile { .. } | Self::Output(_) | Self::Sink(_) => 74,
            Self::Exec { .. } => 71,
            Self::Unverified(_) => 76,
            Self::Unexpected(_) => 1,
        }
    }
}

/// A page with its entries kept as sent, to be handed on byte for byte.
pub type Page = FeedPage<Box<RawValue>>;

/// Follows the feed from the cursor in `options.cursor_file`, each page
/// written to `out` (or, with `exec`, to `CMD`) before its cursor is saved,
/// until `stop` is set (the page in hand is finished and its cursor saved
/// first) or, with `drain`, until a page comes back empty. An unreachable
/// or restarting service is waited out; only answers that will not change
/// end it.
pub fn follow(
    client: &Client,
    options: &FollowOptions,
    stop: &AtomicBool,
    out: &mut dyn Write,
) -> Result<Followed, FollowError> {
    check_options(options)?;
    let hand = match &options.exec {
        Some(command) => Hand::Exec(command.clone()),
        None => Hand::Output(out),
    };
    let mut file = CursorFile::new(&options.cursor_file, hand)?;
    follow_into(client, options, stop, &mut file)
}

/// Exactly once into the caller's own store: each page is handed to
/// `handle` with the [`Position`] after it, to be committed together in
/// one transaction; `saved` is the position committed last (`None`: start
/// at the feed's first receipt with `from_start`, else at its end, which
/// comes to `handle` at once as a page with no receipts). An `Err` from
/// `handle` (nothing committed) hands the same page again after a backoff.
/// A page may hold no receipts: only the position moved; commit it all the
/// same. A database's COMMIT can land with its answer lost: read the
/// stored position in the page's own transaction, and if it is `position`
/// already, the page was kept by that try (return `Ok`); if it is neither
/// that nor the one you committed last, someone else moved it (implement
/// [`Sink`] to answer [`Refusal::Moved`], as the CLI's inbox does). Runs as [`follow`] does; `cursor_file` and `exec` are not used.
pub fn follow_from<H, E>(
    client: &Client,
    options: &FollowOptions,
    stop: &AtomicBool,
    saved: Option<Position>,
    handle: H,
) -> Result<Followed, FollowError>
where
    H: FnMut(&Page, &Position) -> Result<(), E>,
    E: std::fmt::Display,
{
    follow_into(client, options, stop, &mut Handler { saved, handle })
}

/// Follows the feed into `sink`: the one loop every way of handing on
/// runs. Starts from `sink`'s saved position (else as `from_start` says),
/// hands each page on with the position after it, and stops as [`follow`]
/// does.
pub fn follow_into(
    client: &Client,
    options: &FollowOptions,
    stop: &AtomicBool,
    sink: &mut dyn Sink,
) -> Result<Followed, FollowError> {
    check_options(options)?;
    let saved = sink.saved()?;
    check_start(options, saved.is_some())?;
    let mut run = Run {
        client,
        options,
        stop,
        backoff: backoff_of(options),
        #[cfg(feature = "verify")]
        published: None,
    };
    let mut done = Followed::default();
    let Some((mut cursor, mut proof)) = run.starting_cursor(saved, sink, &mut done)? else {
        return Ok(done);
    };
    // Where the page in hand ended; `Moved`: on from the position saved now.
    macro_rules! delivered {
        ($delivery:expr) => {
            match $delivery {
                Delivery::Taken => {}
                Delivery::Stopped => return Ok(done),
                Delivery::Moved => {
                    let saved = sink.saved()?;
                    let Some(start) = run.starting_cursor(saved, sink, &mut done)? else {
                        return Ok(done);
                    };
                    (cursor, proof) = start;
                    continue;
                }
            }
        };
    }
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
            if let Some(position) = moved_by_empty(options, cursor.as_ref(), &page, &proof) {
                delivered!(run.deliver(sink, &page, cursor.as_ref(), &position)?);
                done.cursor_saved = true;
                cursor = Some(page.next);
            }
            if options.drain || stop.load(Ordering::SeqCst) {
                return Ok(done);
            }
            continue;
        }
        let Some(proven) = run.prove(&proof, &page)? else {
            return Ok(done);
        };
        let position = Position::after(&page.next, &lines_of_proof(&proven));
        delivered!(run.deliver(sink, &page, cursor.as_ref(), &position)?);
        proof = proven;
        lag.handed_on(&page, logged_beyond(&proof));
        done.handed_on(&page);
        cursor = Some(page.next);
        if stop.load(Ordering::SeqCst) {
            return Ok(done);
        }
    }
}

/// An empty page moves the position only if its cursor moved (the feed's
/// end as the service places it), so a restart starts there. Not when
/// verifying: an empty page proves nothing, and a `next` moved ahead would
/// skip receipts (an honest service answers an empty page with the cursor
/// it was sent).
pub(crate) fn moved_by_empty(
    options: &FollowOptions,
    cursor: Option<&FeedCursor>,
    page: &Page,
    proof: &Proof,
) -> Option<Position> {
    if verifying(options) || cursor == Some(&page.next) {
        return None;
    }
    Some(Position::after(&page.next, &lines_of_proof(proof)))
}

impl Followed {
    /// A page handed on with its position.
    pub(crate) fn handed_on(&mut self, page: &Page) {
        self.cursor_saved = true;
        self.pages += 1;
        self.receipts += page.receipts.len() as u64;
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
    Ok(())
}

/// Where to start, checked once the sink said whether it holds a position:
/// a checkpoint that is not one under the pinned keys is a mistake of the
/// caller's, not evidence against the log. (With a position saved it is
/// not used: keys changed since, it need not hold under them.)
pub(crate) fn check_start(options: &FollowOptions, saved: bool) -> Result<(), FollowError> {
    #[cfg(feature = "verify")]
    if let (Some(keys), Some(note)) = (&options.verify, &options.from_checkpoint)
        && !saved
    {
        plan_intake_wire::evidence::verify_checkpoint(note, keys).map_err(|e| {
            FollowError::Options(format!(
                "the checkpoint to start from (--from-checkpoint) is not one signed by a pinned key (--keys): {e}"
            ))
        })?;
    }
    #[cfg(not(feature = "verify"))]
    let _ = (options, saved);
    Ok(())
}

/// Where a run starts.
pub(crate) enum Start {
    /// The saved cursor, and the lines after it (a verifying follower's
    /// proof so far).
    Saved(FeedCursor, String),
    /// Nothing saved, `from_start`: the feed's first receipt.
    First,
    /// Nothing saved: the feed's current end, to be saved before the first
    /// page.
    AtEnd,
}

pub(crate) fn start_of(options: &FollowOptions, saved: Option<&Position>) -> Start {
    match saved {
        Some(position) => Start::Saved(position.cursor(), position.proof_lines().to_owned()),
        None if options.from_start => Start::First,
        None => Start::AtEnd,
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
        400 if answer.is_problem(CURSOR_NOT_IN_FEED) && options.cursor_file.as_os_str().is_empty() => FollowError::BadCursor(
            "the service cannot place the saved position's cursor in its feed: it was saved against another deployment, or the database was restored to an earlier state, or it lies past the feed's end. Receipts after it cannot be placed, so none are skipped. Reconcile downstream (an inbox: docs/OPERATIONS.md, \"Back up and restore\"), then start over from no saved position".to_owned(),
        ),
        400 if answer.is_problem(CURSOR_NOT_IN_FEED) => FollowError::BadCursor(format!(
            "the service cannot place the cursor in {} in its feed: it was saved against another deployment, or the database was restored to an earlier state, or it lies past the feed's end. Receipts after it cannot be placed, so none are skipped. Keep the file (move it aside) and reconcile downstream; then remove it and pass --from-start to read the whole feed again, downstream skipping the receipt ids it has (nothing missed), or remove it alone to start at the feed's current end (skipping every receipt kept since the cursor's)",
            options.cursor_file.display(),
        )),
        // The options were checked before anything was sent: what the
        // service refuses is the cursor.
        400 if options.cursor_file.as_os_str().is_empty() => FollowError::BadCursor(format!(
            "the saved position holds no cursor the service reads ({})",
            answer.summary()
        )),
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
    /// The saved position's cursor; with none, the feed's start
    /// (`from_start`: no cursor) or its current end, saved at once so that
    /// a crash before the first page cannot move the start past receipts
    /// written meanwhile. `None`: asked to stop before a start was known.
    /// The proof so far comes with it (verifying: the saved one, or none
    /// at the feed's start).
    fn starting_cursor(
        &mut self,
        saved: Option<Position>,
        sink: &mut dyn Sink,
        done: &mut Followed,
    ) -> Result<Option<(Option<FeedCursor>, Proof)>, FollowError> {
        let mut saved = saved;
        loop {
            let Some(start) = self.start_once(saved, sink, done)? else {
                return Ok(None);
            };
            match start {
                Ok(started) => return Ok(Some(started)),
                Err(Moved) => saved = sink.saved()?,
            }
        }
    }

    /// [`Run::starting_cursor`] once: `Err(Moved)` when the start at the
    /// feed's end found another position saved meanwhile.
    #[allow(clippy::type_complexity)]
    fn start_once(
        &mut self,
        saved: Option<Position>,
        sink: &mut dyn Sink,
        done: &mut Followed,
    ) -> Result<Option<Result<(Option<FeedCursor>, Proof), Moved>>, FollowError> {
        let (cursor, proof) = match start_of(self.options, saved.as_ref()) {
            Start::Saved(cursor, rest) => {
                let proof = proof_of_saved(self.options, &rest, &sink.keeper())?;
                #[cfg(feature = "verify")]
                if let Some(verified) = &proof {
                    return Ok(self.resume(verified)?.map(Ok));
                }
                return Ok(Some(Ok((Some(cursor), proof))));
            }
            Start::First => return Ok(Some(Ok((None, fresh_proof(self.options))))),
            #[cfg(feature = "verify")]
            Start::AtEnd if self.options.verify.is_some() => {
                let Some(keys) = self.options.verify.clone() else {
                    return Err(no_proof());
                };
                let Some(started) = self.start_at_checkpoint(&keys)? else {
                    return Ok(None);
                };
                started
            }
            Start::AtEnd => {
                let Some(end) = self.fetch(Some(FeedCursor::NOW), Duration::ZERO)? else {
                    return Ok(None);
                };
                (end.next, fresh_proof(self.options))
            }
        };
        let position = Position::after(&cursor, &lines_of_proof(&proof));
        let start = Page {
            receipts: Vec::new(),
            next: cursor.clone(),
        };
        match self.deliver(sink, &start, None, &position)? {
            Delivery::Taken => {
                done.cursor_saved = true;
                Ok(Some(Ok((Some(cursor), proof))))
            }
            Delivery::Stopped => Ok(None),
            Delivery::Moved => Ok(Some(Err(Moved))),
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

    /// Hands `page` to `sink` with `position`, again after a backoff while
    /// the sink says not now.
    fn deliver(
        &self,
        sink: &mut dyn Sink,
        page: &Page,
        after: Option<&FeedCursor>,
        position: &Position,
    ) -> Result<Delivery, FollowError> {
        let mut failures = 0u32;
        loop {
            let why = match sink.take(page, after, position) {
                Ok(()) => return Ok(Delivery::Taken),
                Err(Refusal::Stop(error)) => return Err(error),
                Err(Refusal::Moved) => return Ok(moved(sink.keeper())),
                Err(Refusal::Again(why)) => why,
            };
            failures += 1;
            drained_out(self.options, failures, &why)?;
            let delay = handed_again(&self.backoff, failures, page.receipts.len(), &why);
            if pause_unless_stopped(self.stop, delay) {
                return Ok(Delivery::Stopped);
            }
        }
    }
}

/// How handing a page on ended, both APIs'.
pub(crate) enum Delivery {
    /// Kept with its position.
    Taken,
    /// Asked to stop before the sink took it (the page was not kept and
    /// comes again on the next run).
    Stopped,
    /// The sink's saved position moved: go on from it.
    Moved,
}

/// A start at the feed's end that found another position saved meanwhile.
pub(crate) struct Moved;

/// A sink's position moved under the follower: told, and gone on from.
pub(crate) fn moved(keeper: String) -> Delivery {
    tracing::warn!(
        "{keeper} moved under this follower (its previous run's last COMMIT landing late, or another follower on the same store): nothing of the page was kept; going on from the position saved there"
    );
    Delivery::Moved
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_cursor_replaces_the_old_one_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("orders.cursor");
        let save =
            |cursor| sink::save_position(&path, &Position::after(&FeedCursor::new(cursor), ""));
        save("c-1").expect("save");
        save("c-2").expect("save again");
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
