//! Submitting one plan: every attempt under one key, so whatever happened
//! to an earlier attempt (lost answer, killed service, timeout mid-COMMIT),
//! the service answers the same receipt and keeps one plan.

use std::time::{Duration, Instant};

use super::{Answer, Backoff, Client, Exchange};

/// How hard to try. The defaults are the CLI's.
#[derive(Debug, Clone)]
pub struct SubmitOptions {
    /// The `Idempotency-Key`; `None`: derived from the body ([`derive_key`]).
    pub key: Option<String>,
    /// Attempts in all, the first included; `None`: as many as `timeout`
    /// allows (the default: retries are bounded by time, not by count).
    pub max_attempts: Option<u32>,
    /// Cap of the first retry's random delay; doubles per retry up to
    /// [`MAX_RETRY_DELAY`].
    pub retry_base: Duration,
    /// The whole call, every attempt and wait included.
    pub timeout: Duration,
}

impl SubmitOptions {
    /// The longest whole call the command line takes (`--timeout-secs`); the
    /// service keeps idempotency keys at least twice as long.
    pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
}

impl Default for SubmitOptions {
    fn default() -> Self {
        Self {
            key: None,
            max_attempts: None,
            retry_base: DEFAULT_RETRY_BASE,
            timeout: Duration::from_secs(60),
        }
    }
}

/// The first retry's cap unless told otherwise, for `submit` and `follow`.
pub const DEFAULT_RETRY_BASE: Duration = Duration::from_millis(100);

/// No retry waits longer than this (unless the service's `Retry-After` asks).
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(5);

/// The least time worth one more attempt before the call's deadline.
const LAST_ATTEMPT: Duration = Duration::from_millis(200);

/// How the service took the plan.
pub use plan_intake_wire::Outcome;

/// The service kept the plan.
#[derive(Debug, Clone)]
pub struct Submitted {
    /// How the service took the plan.
    pub outcome: Outcome,
    /// The receipt JSON as the service sent it, `outcome` included, on one line.
    pub receipt: String,
    /// The same receipt, read: a member this version does not know is kept
    /// in its `extra`; a member given twice is no receipt.
    pub parsed: plan_intake_wire::Receipt,
    /// The receipt's id.
    pub receipt_id: String,
    /// The key every attempt carried.
    pub key: String,
    /// Attempts made, this one included.
    pub attempts: u32,
}

/// Why no receipt came back. [`SubmitError::exit_code`] is the CLI's exit.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// 400, 413, 415 or 422: this body will never be taken; fix it, do not retry.
    #[error("refused: {0}")]
    Refused(String),
    /// 401 or 403: the token is wrong, revoked, or lacks `plans:submit`.
    #[error("not allowed: {0}")]
    Denied(String),
    /// Attempts or time ran out on answers worth retrying.
    #[error("gave up after {attempts} attempt(s) in {:.1} s; last answer: {last}{}", elapsed.as_secs_f64(), ran_out.note())]
    GaveUp {
        /// Attempts made.
        attempts: u32,
        /// Time spent, every attempt and wait included.
        elapsed: Duration,
        /// What ran out.
        ran_out: RanOut,
        /// The last answer, or that none came.
        last: LastAnswer,
    },
    /// Any other answer (another 4xx, a success without a receipt).
    #[error("unexpected answer: {0}")]
    Unexpected(String),
    /// The service cannot be reached at this URL, and trying again will not
    /// change that (a bad URL, a scheme the other end does not speak).
    #[error("cannot reach the service: {0}")]
    Unreachable(String),
}

impl SubmitError {
    /// sysexits: 65 data error, 77 no permission, 75 try again later, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Refused(_) => 65,
            Self::Denied(_) => 77,
            Self::GaveUp { .. } => 75,
            Self::Unexpected(_) | Self::Unreachable(_) => 1,
        }
    }
}

/// What ran out before a receipt came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RanOut {
    /// Every attempt allowed was made.
    Attempts,
    /// The next wait would have passed the call's timeout.
    Time {
        /// The wait that did not fit.
        next_wait: Duration,
    },
    /// The service failed (5xx) twice: a fault of its own, not of the moment.
    ServerErrors,
}

impl RanOut {
    /// What the give-up line adds after the last answer.
    fn note(&self) -> String {
        match self {
            Self::Time { next_wait } => format!(" (no time left to wait {next_wait:?})"),
            Self::Attempts | Self::ServerErrors => String::new(),
        }
    }
}

impl std::fmt::Display for RanOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Attempts => f.write_str("no attempts left"),
            Self::Time { next_wait } => {
                write!(f, "no time left to wait {} ms", next_wait.as_millis())
            }
            Self::ServerErrors => f.write_str("the service failed twice"),
        }
    }
}

/// The last answer before the client gave up, for a caller to act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LastAnswer {
    /// The service answered `status`; `summary` is its problem's detail
    /// (or the start of its body).
    Status {
        /// The HTTP status.
        status: u16,
        /// The problem's detail, or the start of the body.
        summary: String,
    },
    /// No answer: a refused or dropped connection, a timeout, DNS.
    NoAnswer(String),
}

impl std::fmt::Display for LastAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Status { summary, .. } => f.write_str(summary),
            Self::NoAnswer(why) => write!(f, "no answer: {why}"),
        }
    }
}

/// The key the CLI uses when none is given: `submit-` and the hex of the
/// `request_hash` the service will give the request, computed by the
/// service's own parsing and canonical form, so every body the service
/// takes as the same request (however spaced, ordered, its numbers
/// spelled, with members it ignores) gets the same key. A body the service
/// would refuse gets blake3 of its bytes (the service then refuses it).
pub fn derive_key(body: &[u8]) -> String {
    match plan_intake_wire::body::parse(body) {
        Ok(submission) => {
            let hashes = plan_intake_wire::hashing::canonicalize(&submission).hashes;
            let hex = hashes
                .request_hash
                .strip_prefix("blake3:")
                .unwrap_or(&hashes.request_hash)
                .to_owned();
            format!("submit-{hex}")
        }
        Err(_) => format!("submit-{}", blake3::hash(body).to_hex()),
    }
}

/// What to do with one attempt's answer.
enum Verdict {
    Done(Box<Submitted>),
    Stop(SubmitError),
    /// Worth no further attempt, though not the body's fault.
    GiveUp(LastAnswer),
    Retry {
        why: LastAnswer,
        retry_after: Option<Duration>,
    },
}

impl Client {
    /// POSTs `body` (`{run_id, approved_inputs, content}`) to `/v1/plans`
    /// until the service answers with a receipt or a final refusal.
    ///
    /// Retried, with the same key, until `options.timeout` (and, if given,
    /// `options.max_attempts`) runs out: no answer (refused, dropped or
    /// timed-out connection), 408, 429, 502, 503 and 504; a 500 once. Never
    /// retried: every other 4xx, and a URL the other end cannot answer (a
    /// TLS handshake with a plain-HTTP port). Retries wait with full
    /// jitter, at least `Retry-After`.
    pub fn submit(&self, body: &[u8], options: &SubmitOptions) -> Result<Submitted, SubmitError> {
        let mut attempts = Attempts::new(body, options);
        loop {
            let left = attempts.begin();
            let exchange = Exchange::from_ureq(
                self.agent
                    .post(&self.url("/v1/plans"))
                    .timeout(left)
                    .set("Authorization", &self.authorization)
                    .set("Idempotency-Key", attempts.key())
                    .set("Content-Type", "application/json")
                    .send_bytes(body),
            );
            match attempts.answered(exchange) {
                Next::Finished(result) => return *result,
                Next::Wait(wait) => std::thread::sleep(wait),
            }
        }
    }
}

/// One submit's attempts, and the rules that decide after each one: the
/// blocking and the async API both drive this, so they retry alike.
pub(crate) struct Attempts {
    key: String,
    backoff: Backoff,
    started: Instant,
    deadline: Instant,
    max_attempts: Option<u32>,
    server_errors: u32,
    attempt: u32,
}

/// What follows an attempt.
pub(crate) enum Next {
    Finished(Box<Result<Submitted, SubmitError>>),
    /// Wait this long, then make the next attempt.
    Wait(Duration),
}

impl Attempts {
    pub(crate) fn new(body: &[u8], options: &SubmitOptions) -> Self {
        let started = Instant::now();
        Self {
            key: options.key.clone().unwrap_or_else(|| derive_key(body)),
            backoff: Backoff {
                base: options.retry_base,
                cap: MAX_RETRY_DELAY,
            },
            started,
            // `Duration::MAX` is "no bound", not an overflow.
            deadline: started
                .checked_add(options.timeout)
                .unwrap_or_else(|| started + Duration::from_secs(100 * 365 * 24 * 3600)),
            max_attempts: options.max_attempts,
            server_errors: 0,
            attempt: 0,
        }
    }

    /// The key every attempt carries.
    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    /// Starts the next attempt: the time it may take.
    pub(crate) fn begin(&mut self) -> Duration {
        self.attempt += 1;
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// Judges the attempt's exchange: finished, or the wait before the next.
    pub(crate) fn answered(&mut self, exchange: Exchange) -> Next {
        let attempt = self.attempt;
        let gave_up = |ran_out: RanOut, last: LastAnswer| {
            Next::Finished(Box::new(Err(SubmitError::GaveUp {
                attempts: attempt,
                elapsed: self.started.elapsed(),
                ran_out,
                last,
            })))
        };
        let (why, retry_after) = match judge(exchange, &self.key, attempt, &mut self.server_errors)
        {
            Verdict::Done(submitted) => return Next::Finished(Box::new(Ok(*submitted))),
            Verdict::Stop(error) => return Next::Finished(Box::new(Err(error))),
            Verdict::GiveUp(last) => return gave_up(RanOut::ServerErrors, last),
            Verdict::Retry { why, retry_after } => (why, retry_after),
        };
        let wait = self.backoff.delay(attempt, retry_after);
        if self.max_attempts.is_some_and(|cap| attempt >= cap) {
            return gave_up(RanOut::Attempts, why);
        }
        // The whole time is used: a wait that would pass the deadline is
        // cut short for one more attempt before it, unless the service
        // asked for longer (`Retry-After`) or too little is left for an
        // attempt.
        let left = self.deadline.saturating_duration_since(Instant::now());
        // Never sooner than the service asked: a wait cut to fit the
        // deadline must still be at least its `Retry-After`.
        let asked_longer =
            retry_after.is_some_and(|asked| asked >= left.saturating_sub(LAST_ATTEMPT));
        if asked_longer || left <= LAST_ATTEMPT {
            return gave_up(RanOut::Time { next_wait: wait }, why);
        }
        let wait = wait.min(left - LAST_ATTEMPT);
        tracing::warn!(
            attempt,
            key = %self.key,
            "{why}; retrying in {} ms with the same key",
            wait.as_millis()
        );
        Next::Wait(wait)
    }
}

fn judge(exchange: Exchange, key: &str, attempt: u32, server_errors: &mut u32) -> Verdict {
    let answer = match exchange {
        Exchange::Answer(answer) => answer,
        Exchange::NoAnswer(why) => {
            return Verdict::Retry {
                why: LastAnswer::NoAnswer(why),
                retry_after: None,
            };
        }
        Exchange::Unreachable(why) => return Verdict::Stop(SubmitError::Unreachable(why)),
    };
    match answer.status {
        200 | 201 => match receipt_of(&answer, key, attempt) {
            Some(submitted) => Verdict::Done(Box::new(submitted)),
            None => Verdict::Stop(SubmitError::Unexpected(answer.summary())),
        },
        400 | 413 | 415 | 422 => Verdict::Stop(SubmitError::Refused(answer.summary())),
        401 | 403 => Verdict::Stop(SubmitError::Denied(answer.summary())),
        408 | 429 | 502 | 503 | 504 => Verdict::Retry {
            why: answer.last(),
            retry_after: answer.retry_after,
        },
        // A 500 is a fault of the service, not of the moment: once more,
        // in case it was the moment after all.
        500..=599 if *server_errors == 0 => {
            *server_errors += 1;
            Verdict::Retry {
                why: answer.last(),
                retry_after: answer.retry_after,
            }
        }
        500..=599 => Verdict::GiveUp(answer.last()),
        _ => Verdict::Stop(SubmitError::Unexpected(answer.summary())),
    }
}

fn receipt_of(answer: &Answer, key: &str, attempt: u32) -> Option<Submitted> {
    let parsed = plan_intake_wire::Receipt::parse(&answer.body).ok()?;
    let outcome = parsed.outcome?;
    // The service answers compact JSON; a proxy that pretty-printed it
    // still yields one line.
    let receipt = if answer.body.contains('\n') {
        serde_json::from_str::<serde_json::Value>(&answer.body)
            .ok()?
            .to_string()
    } else {
        answer.body.trim().to_owned()
    };
    Some(Submitted {
        outcome,
        receipt,
        receipt_id: parsed.receipt_id.clone(),
        parsed,
        key: key.to_owned(),
        attempts: attempt,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_request_gets_the_same_key_however_it_is_spaced() {
        let a =
            derive_key(br#"{"run_id":"r","approved_inputs":[{"id":"x"}],"content":{"a":1,"b":2}}"#);
        let b = derive_key(
            b"{ \"content\": {\"b\": 2.0, \"a\": 1},\n \"approved_inputs\": [{\"id\":\"x\"}], \"run_id\": \"r\", \"note\": 1 }",
        );
        let other =
            derive_key(br#"{"run_id":"r","approved_inputs":[{"id":"x"}],"content":{"a":1,"b":3}}"#);
        assert_eq!(a, b);
        assert_ne!(a, other);
        // A body the service refuses gets the hash of its bytes.
        assert_ne!(derive_key(b"not json"), derive_key(b"not json "));
        assert!(a.len() <= 255 && a.bytes().all(|c| (0x21..=0x7e).contains(&c)));
    }

    fn busy(retry_after: Duration) -> Exchange {
        Exchange::Answer(crate::Answer {
            status: 503,
            retry_after: Some(retry_after),
            body: String::new(),
        })
    }

    /// No bound on time (`Duration::MAX`) is no bound, not an overflow.
    #[test]
    fn an_unbounded_timeout_waits_as_asked() {
        let options = SubmitOptions {
            timeout: Duration::MAX,
            ..SubmitOptions::default()
        };
        let mut attempts = Attempts::new(b"{}", &options);
        attempts.begin();
        match attempts.answered(busy(Duration::from_secs(3))) {
            Next::Wait(wait) => assert!(wait >= Duration::from_secs(3), "{wait:?}"),
            Next::Finished(result) => panic!("gave up: {result:?}"),
        }
    }

    /// With less time left than `Retry-After` (once the last attempt's
    /// own time is kept), it gives up rather than retry sooner than asked.
    #[test]
    fn a_retry_is_never_sooner_than_retry_after() {
        let options = SubmitOptions {
            timeout: Duration::from_millis(1150),
            ..SubmitOptions::default()
        };
        let mut attempts = Attempts::new(b"{}", &options);
        attempts.begin();
        match attempts.answered(busy(Duration::from_secs(1))) {
            Next::Wait(wait) => panic!("retried after {wait:?}, sooner than asked"),
            Next::Finished(result) => assert!(
                matches!(
                    *result,
                    Err(SubmitError::GaveUp {
                        ran_out: RanOut::Time { .. },
                        ..
                    })
                ),
                "{result:?}"
            ),
        }
    }
}
