//! The same client for async programs (feature `async`, on reqwest and
//! tokio): [`AsyncClient::submit`] and [`follow`] keep the blocking API's
//! rules, because they drive the same code that makes them (one key per
//! call, which answers are retried, full-jitter backoff no sooner than
//! `Retry-After`, the call's total time, the feed answers' meaning, and a
//! cursor saved only after its page was handled). Only the HTTP exchange
//! and the waiting are async here.
//!
//! Cancelling is dropping the future: a submit dropped mid-attempt may or
//! may not have kept the plan (submit it again with the same key to learn
//! which); a follow dropped at any point has saved the cursor of every
//! page its handler finished, and no other.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use plan_intake_client::asynchronous::{AsyncClient, follow};
//! use plan_intake_client::{FollowOptions, SubmitOptions};
//!
//! let client = AsyncClient::new("http://127.0.0.1:8080", "pit_…")?;
//! let body = br#"{"run_id":"r-1","approved_inputs":[],"content":{}}"#;
//! let submitted = client.submit(body, &SubmitOptions::default()).await?;
//! println!("{}", submitted.receipt);
//!
//! // Each page is handed to the closure; its cursor is saved once it
//! // returns Ok. An Err hands the same page again after a backoff.
//! follow(&client, &FollowOptions::new("orders.cursor"), |page| async move {
//!     for entry in &page.receipts {
//!         println!("{}", entry.get());
//!     }
//!     Ok::<(), std::io::Error>(())
//! })
//! .await?;
//! # Ok(())
//! # }
//! ```

use std::future::Future;
use std::time::Duration;

use plan_intake_wire::feed::FeedCursor;

use super::follow::{
    CursorFile, Delivery, Hand, LagReport, PageVerdict, Position, Proof, Refusal, Start,
    backoff_of, check_empty, check_options, check_start, drained_out, feed_query, fresh_proof,
    handed_again, judge_page, lines_of_proof, logged_beyond, moved, moved_by_empty, proof_of_saved,
    retry_wait, start_of,
};
#[cfg(feature = "verify")]
use super::follow::{
    EXTENSION_WAIT_SECS, ExtensionVerdict, extension_query, judge_extension, no_proof,
};
use super::submit::{Attempts, Next};
use super::{
    Answer, CONNECT_TIMEOUT, ClientError, Exchange, FollowError, FollowOptions, Followed, Page,
    SubmitError, SubmitOptions, Submitted, base_and_authorization, invalid_data_below,
    source_chain,
};

/// The service's address and the caller's token, over one pooled reqwest
/// client (cheap to clone; clones share its connections).
#[derive(Clone)]
pub struct AsyncClient {
    base: String,
    authorization: String,
    http: reqwest::Client,
    /// What `GET /v1/signing-keys` answered, asked once a receipt under a
    /// key the reader does not pin appears (not trusted: see
    /// `Extended::check_unpinned`).
    #[cfg(feature = "verify")]
    published: std::sync::Arc<std::sync::Mutex<Option<plan_intake_wire::evidence::TrustedKeys>>>,
}

impl std::fmt::Debug for AsyncClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        f.debug_struct("AsyncClient")
            .field("base", &self.base)
            .finish()
    }
}

impl AsyncClient {
    /// `base_url` is the service's root, e.g. `http://127.0.0.1:8080`.
    pub fn new(base_url: &str, token: &str) -> Result<Self, ClientError> {
        let (base, authorization) = base_and_authorization(base_url, token)?;
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            // As the blocking client: no proxy from the environment (the
            // token goes where the URL says, and nowhere else).
            .no_proxy()
            .build()
            .map_err(|_| ClientError::BadUrl(base_url.into()))?;
        Ok(Self {
            base,
            authorization,
            http,
            #[cfg(feature = "verify")]
            published: std::sync::Arc::default(),
        })
    }

    /// As [`crate::Client::submit`], awaiting instead of blocking: the same
    /// key on every attempt, the same answers retried, the same waits.
    pub async fn submit(
        &self,
        body: &[u8],
        options: &SubmitOptions,
    ) -> Result<Submitted, SubmitError> {
        let mut attempts = Attempts::new(body, options);
        loop {
            let left = attempts.begin();
            let sent = self
                .http
                .post(format!("{}/v1/plans", self.base))
                .timeout(left)
                .header("Authorization", &self.authorization)
                .header("Idempotency-Key", attempts.key())
                .header("Content-Type", "application/json")
                .body(body.to_vec())
                .send()
                .await;
            match attempts.answered(Exchange::from_reqwest(sent).await) {
                Next::Finished(result) => return *result,
                Next::Wait(wait) => tokio::time::sleep(wait).await,
            }
        }
    }

    /// Without `verify`: every page passes.
    #[cfg(not(feature = "verify"))]
    async fn prove(
        &self,
        _options: &FollowOptions,
        _backoff: &super::Backoff,
        proof: &Proof,
        _page: &Page,
    ) -> Result<Proof, FollowError> {
        Ok(*proof)
    }

    /// With `verify`: the page proven to be the log's next leaves, as the
    /// blocking follower proves it (`crate::verify`), its requests awaited.
    #[cfg(feature = "verify")]
    async fn prove(
        &self,
        options: &FollowOptions,
        backoff: &super::Backoff,
        proof: &Proof,
        page: &Page,
    ) -> Result<Proof, FollowError> {
        use crate::verify::Verified;
        let Some(keys) = &options.verify else {
            return Ok(None);
        };
        let Some(verified) = proof else {
            return Err(no_proof());
        };
        let extended = verified
            .extend_after_prelude(
                keys,
                &page.receipts,
                options.expand,
                options.unsigned_prelude,
            )
            .map_err(|e| FollowError::Unverified(e.message))?;
        let answer = self
            .extension(
                extended.size(),
                &extended.since_query(),
                verified,
                keys,
                backoff,
            )
            .await?;
        match Verified::prove(&extended, &answer, keys) {
            Ok(proven) => {
                self.check_unpinned(&extended, backoff).await?;
                super::follow::warn_unsigned(&extended);
                Ok(Some(proven))
            }
            Err(refused) if refused.locatable => {
                let mut locator = extended.locator(keys);
                while let Some(size) = locator.next_size() {
                    let query = format!("{}{}", self.base, extension_query(size, "", 0));
                    let answer = match self.get(&query).await {
                        Ok(response) if response.status() == 200 => response
                            .text()
                            .await
                            .ok()
                            .and_then(|text| serde_json::from_str(&text).ok()),
                        _ => None,
                    };
                    if !answer.is_some_and(|answer| locator.answered(&answer)) {
                        return Err(FollowError::Unverified(refused.message));
                    }
                }
                Err(FollowError::Unverified(locator.found()))
            }
            Err(refused) => Err(FollowError::Unverified(refused.message)),
        }
    }

    /// The newest checkpoint with its proofs from a tree of `size` leaves,
    /// waited for as the blocking follower waits, `held` to the service's
    /// newest checkpoint meanwhile (a log rolled back is 76 at once).
    #[cfg(feature = "verify")]
    async fn extension(
        &self,
        size: u64,
        since: &str,
        held: &crate::verify::Verified,
        keys: &plan_intake_wire::evidence::TrustedKeys,
        backoff: &super::Backoff,
    ) -> Result<plan_intake_wire::evidence::CheckpointExtension, FollowError> {
        use super::follow::{NEWEST_CHECKPOINT, judge_newest};
        let query = format!(
            "{}{}",
            self.base,
            extension_query(size, since, EXTENSION_WAIT_SECS)
        );
        let began = std::time::Instant::now();
        let mut failures = 0u32;
        loop {
            failures += 1;
            let exchange = Exchange::from_reqwest(self.get(&query).await).await;
            match judge_extension(exchange, size, backoff, failures)? {
                ExtensionVerdict::Answer(answer) => return Ok(answer),
                ExtensionVerdict::Wait(delay) => tokio::time::sleep(delay).await,
                ExtensionVerdict::CheckThenWait(delay) => {
                    let url = format!("{}{NEWEST_CHECKPOINT}", self.base);
                    let newest = Exchange::from_reqwest(self.get(&url).await).await;
                    judge_newest(newest, held, keys)?;
                    let url = format!("{}{}", self.base, super::follow::READINESS);
                    let ready = Exchange::from_reqwest(self.get(&url).await).await;
                    super::follow::tell_readiness(ready, size, began.elapsed());
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    /// Where a verifying follower goes on from what it verified, as the
    /// blocking follower finds it (`follow::Run::resume`).
    #[cfg(feature = "verify")]
    async fn resume(
        &self,
        options: &FollowOptions,
        backoff: &super::Backoff,
        proof: &crate::verify::Verified,
    ) -> Result<(Option<FeedCursor>, Proof), FollowError> {
        use super::follow::{has_resume_point, resumed, start_query};
        let Some(keys) = &options.verify else {
            return Err(no_proof());
        };
        if !has_resume_point(proof) {
            return Ok((None, Some(proof.clone())));
        }
        let extended = proof
            .extend(keys, &[], false)
            .map_err(|e| FollowError::Unverified(e.message))?;
        let answer = self
            .extension(proof.size, &extended.since_query(), proof, keys, backoff)
            .await?;
        let proven = resumed(proof, &extended, &answer, keys)?;
        let start: plan_intake_wire::evidence::CheckpointStart = self
            .evidence(&start_query(proven.size), backoff, |body| {
                serde_json::from_str(body).map_err(|e| e.to_string())
            })
            .await?;
        proven
            .check_start(&start)
            .map_err(|e| FollowError::Unverified(e.message))?;
        Ok((Some(start.after), Some(proven)))
    }

    /// The page's receipts under keys the reader does not pin, held to
    /// the keys the service publishes (asked for once such a key appears).
    #[cfg(feature = "verify")]
    async fn check_unpinned(
        &self,
        extended: &crate::verify::Extended,
        backoff: &super::Backoff,
    ) -> Result<(), FollowError> {
        use super::follow::{
            PUBLISHED_ASKS, PUBLISHED_KEYS, at_unpinned, parse_published, published_again,
            warn_unpinned,
        };
        if extended.unpinned_known(None) {
            // No receipt under a key the reader does not pin.
            return Ok(());
        }
        let mut published = self
            .published
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let mut asked = 0;
        while !extended.unpinned_known(published.as_ref()) && asked < PUBLISHED_ASKS {
            if asked > 0 {
                let why = published_again(extended);
                tokio::time::sleep(retry_wait(backoff, asked, &why, None)).await;
            }
            asked += 1;
            let fetched = self
                .evidence(PUBLISHED_KEYS, backoff, parse_published)
                .await
                .map_err(|e| at_unpinned(extended, e))?;
            *self
                .published
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(fetched.clone());
            published = Some(fetched);
        }
        if let Some(published) = &published {
            extended
                .check_unpinned(published)
                .map_err(|e| FollowError::Unverified(e.message))?;
        }
        if asked > 0 {
            warn_unpinned(extended);
        }
        Ok(())
    }

    /// Where a verifying follower with no cursor starts, as the blocking
    /// follower finds it.
    #[cfg(feature = "verify")]
    async fn start_at_checkpoint(
        &self,
        options: &FollowOptions,
        backoff: &super::Backoff,
    ) -> Result<(FeedCursor, Proof), FollowError> {
        use super::follow::{
            NEWEST_CHECKPOINT, start_from, start_query, starting_checkpoint, still_held,
        };
        let Some(keys) = &options.verify else {
            return Err(no_proof());
        };
        let note = match &options.from_checkpoint {
            Some(note) => note.clone(),
            None => {
                self.evidence(NEWEST_CHECKPOINT, backoff, |body| Ok(body.to_owned()))
                    .await?
            }
        };
        let given = starting_checkpoint(options, &note, keys)?;
        if options.from_checkpoint.is_some() {
            let url = format!("{}{NEWEST_CHECKPOINT}", self.base);
            let first = Exchange::from_reqwest(self.get(&url).await).await;
            super::follow::none_held(&first, &given)?;
            let newest = self
                .evidence(NEWEST_CHECKPOINT, backoff, |body| Ok(body.to_owned()))
                .await?;
            still_held(&given, &newest, keys)?;
        }
        let start = self
            .evidence(&start_query(given.size), backoff, |body| {
                serde_json::from_str(body).map_err(|e| e.to_string())
            })
            .await?;
        start_from(&note, keys, &start)
    }

    /// One piece of public evidence, waited for as the blocking follower
    /// waits for it.
    #[cfg(feature = "verify")]
    async fn evidence<T>(
        &self,
        query: &str,
        backoff: &super::Backoff,
        parse: impl Fn(&str) -> Result<T, String>,
    ) -> Result<T, FollowError> {
        use super::follow::{Evidence, judge_evidence};
        let url = format!("{}{query}", self.base);
        let mut failures = 0u32;
        loop {
            failures += 1;
            let exchange = Exchange::from_reqwest(self.get(&url).await).await;
            match judge_evidence(exchange, query, backoff, failures, &parse)? {
                Evidence::Answer(answer) => return Ok(answer),
                Evidence::Wait(delay) => tokio::time::sleep(delay).await,
            }
        }
    }

    /// A GET of `url`, a piece of evidence, with the reader's token (the
    /// start at a checkpoint places the reader in the feed: for its readers
    /// only; the rest is public, and takes the token as well).
    #[cfg(feature = "verify")]
    async fn get(&self, url: &str) -> Result<reqwest::Response, reqwest::Error> {
        self.http
            .get(url)
            .timeout(Duration::from_secs(30))
            .header("Authorization", &self.authorization)
            .send()
            .await
    }

    /// One feed page past `after`, retried as the blocking follower does
    /// until the service answers it.
    async fn fetch(
        &self,
        options: &FollowOptions,
        after: Option<&str>,
        wait: Duration,
    ) -> Result<Page, FollowError> {
        let url = format!("{}{}", self.base, feed_query(options, after, wait));
        let backoff = backoff_of(options);
        let mut failures = 0u32;
        loop {
            let sent = self
                .http
                .get(&url)
                // The long poll, plus time for the page itself.
                .timeout(wait + Duration::from_secs(30))
                .header("Authorization", &self.authorization)
                .send()
                .await;
            let (why, retry_after) = match judge_page(Exchange::from_reqwest(sent).await, options) {
                PageVerdict::Page(page) => return Ok(page),
                PageVerdict::Stop(error) => return Err(error),
                PageVerdict::Retry { why, retry_after } => (why, retry_after),
            };
            failures += 1;
            super::follow::drained_out(options, failures, &why)?;
            tokio::time::sleep(retry_wait(&backoff, failures, &why, retry_after)).await;
        }
    }
}

/// Follows the feed from the cursor in `options.cursor_file`, handing each
/// non-empty page to `handle`; the page's cursor is saved (fsync, rename)
/// only once `handle` returns `Ok`, and an `Err` hands the same page again
/// after a backoff. Ends with `drain` at the first empty page; otherwise
/// runs until dropped (every page finished by then is saved, no other).
/// The save (a few milliseconds: write, fsync, rename, fsync of the
/// directory) runs inline, with no await inside it, so dropping the future
/// never leaves it half done.
/// `options.exec` belongs to the blocking follower and is refused here.
pub async fn follow<H, F, E>(
    client: &AsyncClient,
    options: &FollowOptions,
    handle: H,
) -> Result<Followed, FollowError>
where
    H: FnMut(Page) -> F,
    F: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    check_options(options)?;
    if options.exec.is_some() {
        return Err(FollowError::Options(
            "exec runs a command per page in the blocking follower; the async one hands each page to its handler".to_owned(),
        ));
    }
    let file = CursorFile::new(&options.cursor_file, Hand::Before)?;
    follow_into(client, options, &mut ThenCursorFile { file, handle }).await
}

/// Exactly once into the caller's own store, as the blocking
/// [`crate::follow_from`]: each page goes to `handle` with the
/// [`Position`] after it, to be committed together; `saved` is the
/// position committed last. A page may hold no receipts (only the
/// position moved): commit it all the same. A database's COMMIT can land
/// with its answer lost: read the stored position in the page's own
/// transaction, and if it is `position` already, that try kept the page
/// (return `Ok`). Runs until dropped or, with
/// `drain`, to the first empty page.
pub async fn follow_from<H, F, E>(
    client: &AsyncClient,
    options: &FollowOptions,
    saved: Option<Position>,
    handle: H,
) -> Result<Followed, FollowError>
where
    H: FnMut(Page, Position) -> F,
    F: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    check_options(options)?;
    follow_into(client, options, &mut WithPosition { saved, handle }).await
}

/// The async follower's sinks: the loop's side of them.
trait AsyncSink {
    fn saved(&mut self) -> Result<Option<Position>, FollowError>;
    fn keeper(&self) -> String;
    async fn take(&mut self, page: &Page, position: &Position) -> Result<(), Refusal>;
}

/// A handler, then the cursor file.
struct ThenCursorFile<H> {
    file: CursorFile<'static>,
    handle: H,
}

impl<H, F, E> AsyncSink for ThenCursorFile<H>
where
    H: FnMut(Page) -> F,
    F: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    fn saved(&mut self) -> Result<Option<Position>, FollowError> {
        self.file.read()
    }

    fn keeper(&self) -> String {
        use super::follow::Sink;
        self.file.keeper()
    }

    async fn take(&mut self, page: &Page, position: &Position) -> Result<(), Refusal> {
        if !page.receipts.is_empty() {
            (self.handle)(page.clone())
                .await
                .map_err(|e| Refusal::Again(format!("the page's handler failed: {e}")))?;
        }
        Ok(self.file.save(position)?)
    }
}

/// A handler that commits each page with its position.
struct WithPosition<H> {
    saved: Option<Position>,
    handle: H,
}

impl<H, F, E> AsyncSink for WithPosition<H>
where
    H: FnMut(Page, Position) -> F,
    F: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    fn saved(&mut self) -> Result<Option<Position>, FollowError> {
        Ok(self.saved.clone())
    }

    fn keeper(&self) -> String {
        "the position given".to_owned()
    }

    async fn take(&mut self, page: &Page, position: &Position) -> Result<(), Refusal> {
        (self.handle)(page.clone(), position.clone())
            .await
            .map_err(|e| Refusal::Again(format!("the page's handler failed: {e}")))
    }
}

/// Hands `page` to `sink` with `position`, again after a backoff while the
/// sink says not now.
async fn deliver(
    sink: &mut impl AsyncSink,
    options: &FollowOptions,
    page: &Page,
    position: &Position,
) -> Result<Delivery, FollowError> {
    let backoff = backoff_of(options);
    let mut failures = 0u32;
    loop {
        let why = match sink.take(page, position).await {
            Ok(()) => return Ok(Delivery::Taken),
            Err(Refusal::Stop(error)) => return Err(error),
            Err(Refusal::Moved) => return Ok(moved(sink.keeper())),
            Err(Refusal::Again(why)) => why,
        };
        failures += 1;
        drained_out(options, failures, &why)?;
        tokio::time::sleep(handed_again(&backoff, failures, page.receipts.len(), &why)).await;
    }
}

/// Where the async loop starts.
enum Began {
    /// From a saved position, or at the feed's first receipt.
    Resumed((Option<FeedCursor>, Proof)),
    /// At the feed's end: saved before the first page.
    AtEnd((FeedCursor, Proof)),
}

/// Where the async loop starts, as the blocking one's
/// `Run::starting_cursor`: the saved position's cursor (verifying: resumed
/// from its proof), the feed's first receipt, or its end, saved before the
/// first page (again from the position saved meanwhile, if it moved).
async fn start(
    client: &AsyncClient,
    options: &FollowOptions,
    sink: &mut impl AsyncSink,
    mut saved: Option<Position>,
    done: &mut Followed,
) -> Result<(Option<FeedCursor>, Proof), FollowError> {
    let backoff = backoff_of(options);
    loop {
        let began = match start_of(options, saved.as_ref()) {
            Start::Saved(cursor, rest) => match proof_of_saved(options, &rest, &sink.keeper())? {
                #[cfg(feature = "verify")]
                Some(verified) => {
                    Began::Resumed(client.resume(options, &backoff, &verified).await?)
                }
                #[allow(unreachable_patterns)]
                proof => Began::Resumed((Some(cursor), proof)),
            },
            Start::First => Began::Resumed((None, fresh_proof(options))),
            #[cfg(feature = "verify")]
            Start::AtEnd if options.verify.is_some() => {
                Began::AtEnd(client.start_at_checkpoint(options, &backoff).await?)
            }
            Start::AtEnd => {
                let end = client
                    .fetch(options, Some(FeedCursor::NOW), Duration::ZERO)
                    .await?;
                Began::AtEnd((end.next, fresh_proof(options)))
            }
        };
        let (cursor, proof) = match began {
            Began::Resumed(resumed) => return Ok(resumed),
            Began::AtEnd(at_end) => at_end,
        };
        let position = Position::after(&cursor, &lines_of_proof(&proof));
        let at_end = Page {
            receipts: Vec::new(),
            next: cursor.clone(),
        };
        match deliver(sink, options, &at_end, &position).await? {
            Delivery::Moved => saved = sink.saved()?,
            Delivery::Taken | Delivery::Stopped => {
                done.cursor_saved = true;
                return Ok((Some(cursor), proof));
            }
        }
    }
}

/// The async loop: the blocking one's rules (`follow::follow_into`),
/// awaited.
async fn follow_into(
    client: &AsyncClient,
    options: &FollowOptions,
    sink: &mut impl AsyncSink,
) -> Result<Followed, FollowError> {
    let saved = sink.saved()?;
    check_start(options, saved.is_some())?;
    let backoff = backoff_of(options);
    let mut done = Followed::default();
    let (mut cursor, mut proof) = start(client, options, sink, saved, &mut done).await?;
    let mut lag = LagReport::new(options);
    // A verifying follower whose cursor the service refuses goes on from
    // what it proved, once in a row.
    #[cfg(feature = "verify")]
    let mut resumed_at: Option<Option<FeedCursor>> = None;
    loop {
        let fetched = client
            .fetch(
                options,
                cursor.as_ref().map(FeedCursor::as_str),
                options.wait,
            )
            .await;
        let page = match fetched {
            #[cfg(feature = "verify")]
            Err(FollowError::BadCursor(why)) if proof.is_some() => {
                if resumed_at.as_ref() == Some(&cursor) {
                    return Err(super::follow::refused_again(&proof, &why));
                }
                let Some(verified) = proof.clone() else {
                    return Err(no_proof());
                };
                (cursor, proof) = client.resume(options, &backoff, &verified).await?;
                resumed_at = Some(cursor.clone());
                continue;
            }
            fetched => fetched?,
        };
        #[cfg(feature = "verify")]
        {
            resumed_at = None;
        }
        if page.receipts.is_empty() {
            if let Err(withheld) = check_empty(&proof) {
                // A log rolled back under the cursor looks the same; the
                // newest checkpoint tells which.
                #[cfg(feature = "verify")]
                if let (Some(keys), Some(verified)) = (&options.verify, &proof) {
                    let url = format!("{}{}", client.base, super::follow::NEWEST_CHECKPOINT);
                    let newest = Exchange::from_reqwest(client.get(&url).await).await;
                    super::follow::judge_newest(newest, verified, keys)?;
                }
                return Err(withheld);
            }
            lag.at_end();
            if let Some(position) = moved_by_empty(options, cursor.as_ref(), &page, &proof) {
                if let Delivery::Moved = deliver(sink, options, &page, &position).await? {
                    let saved = sink.saved()?;
                    (cursor, proof) = start(client, options, sink, saved, &mut done).await?;
                    continue;
                }
                done.cursor_saved = true;
                cursor = Some(page.next);
            }
            if options.drain {
                return Ok(done);
            }
            continue;
        }
        let proven = client.prove(options, &backoff, &proof, &page).await?;
        let position = Position::after(&page.next, &lines_of_proof(&proven));
        if let Delivery::Moved = deliver(sink, options, &page, &position).await? {
            let saved = sink.saved()?;
            (cursor, proof) = start(client, options, sink, saved, &mut done).await?;
            continue;
        }
        proof = proven;
        lag.handed_on(&page, logged_beyond(&proof));
        done.handed_on(&page);
        cursor = Some(page.next);
    }
}

impl Exchange {
    /// What reqwest's exchange gave, read as the blocking client reads
    /// ureq's.
    async fn from_reqwest(sent: Result<reqwest::Response, reqwest::Error>) -> Self {
        let response = match sent {
            Ok(response) => response,
            Err(error) => return Self::of_reqwest_error(&error),
        };
        let status = response.status().as_u16();
        // Seconds only: the service sends no HTTP dates.
        let retry_after = response
            .headers()
            .get("Retry-After")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        match response.text().await {
            Ok(body) => Self::Answer(Answer {
                status,
                retry_after,
                body,
            }),
            Err(e) => Self::NoAnswer(format!(
                "the answer ({status}) was cut short: {}",
                chain_text(&e)
            )),
        }
    }

    fn of_reqwest_error(error: &reqwest::Error) -> Self {
        let why = chain_text(error);
        if error.is_builder() {
            Self::Unreachable(why)
        } else if invalid_data_below(error) {
            Self::handshake_failed(&why)
        } else {
            Self::NoAnswer(why)
        }
    }
}

/// An error and its causes on one line (reqwest's own text is only the
/// outermost: "error sending request").
fn chain_text(error: &(dyn std::error::Error + 'static)) -> String {
    source_chain(error)
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}
