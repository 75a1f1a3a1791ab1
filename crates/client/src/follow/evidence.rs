//! The verifying follower's rules, both APIs': the evidence it asks for and how each answer is judged.

use super::*;

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
pub(crate) fn proof_of_saved(
    options: &FollowOptions,
    rest: &str,
    keeper: &str,
) -> Result<Proof, FollowError> {
    if options.verify.is_none() {
        return Ok(None);
    }
    match crate::verify::Verified::from_lines(rest) {
        Ok(Some(proof)) => Ok(Some(proof)),
        Ok(None) => Err(FollowError::BadCursor(format!(
            "{keeper} was saved by a follower that did not verify: what it handed on was never proven, so verification cannot start there. Remove it and pass --from-start to verify the whole feed, or --from-checkpoint FILE to start at a checkpoint",
        ))),
        Err(why) => Err(FollowError::BadCursor(format!(
            "{keeper} holds no proof a verifying follower can go on from ({why}): remove it and pass --from-start to verify the whole feed, or --from-checkpoint FILE to start at a checkpoint",
        ))),
    }
}
#[cfg(not(feature = "verify"))]
pub(crate) fn proof_of_saved(
    _options: &FollowOptions,
    _rest: &str,
    _keeper: &str,
) -> Result<Proof, FollowError> {
    Ok(NoProof)
}
