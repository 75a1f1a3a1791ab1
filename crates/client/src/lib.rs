#![deny(missing_docs)]
#![doc = include_str!("../README.md")]
//!
//! It talks to the service only through its HTTP API, as any other client
//! would.

#[cfg(feature = "async")]
pub mod asynchronous;
mod follow;
mod submit;
#[cfg(feature = "verify")]
pub mod verify;

use std::io::Read;
use std::time::Duration;

/// The types the service and this client share (`plan-intake-wire`): the
/// receipt a submit returns, problems, the feed's page and cursor.
pub use plan_intake_wire as wire;

pub use follow::{
    FollowError, FollowOptions, Followed, Lag, Page, Position, Refusal, Sink, follow, follow_from,
    follow_into,
};
pub use submit::{
    DEFAULT_RETRY_BASE, LastAnswer, MAX_RETRY_DELAY, Outcome, RanOut, SubmitError, SubmitOptions,
    Submitted, derive_key,
};

/// The service's address and the caller's token, over one keep-alive agent.
#[derive(Clone)]
pub struct Client {
    base: String,
    authorization: String,
    agent: ureq::Agent,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        f.debug_struct("Client").field("base", &self.base).finish()
    }
}

/// A client that cannot be made: a URL the client cannot talk to, or no token.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The service's URL is not `http://` or `https://`.
    #[error("`{0}` is not an http:// or https:// URL")]
    BadUrl(String),
    /// No token was given.
    #[error("the token is empty")]
    EmptyToken,
}

impl Client {
    /// `base_url` is the service's root, e.g. `http://127.0.0.1:8080`.
    pub fn new(base_url: &str, token: &str) -> Result<Self, ClientError> {
        let (base, authorization) = base_and_authorization(base_url, token)?;
        Ok(Self {
            base,
            authorization,
            agent: ureq::AgentBuilder::new()
                .timeout_connect(CONNECT_TIMEOUT)
                .build(),
        })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

/// How long a connection may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The service's root without a trailing `/`, and the `Authorization`
/// header's value; both APIs' clients are made from these.
fn base_and_authorization(base_url: &str, token: &str) -> Result<(String, String), ClientError> {
    let parsed = url::Url::parse(base_url).map_err(|_| ClientError::BadUrl(base_url.into()))?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host().is_none() {
        return Err(ClientError::BadUrl(base_url.into()));
    }
    let token = token.trim();
    if token.is_empty() {
        return Err(ClientError::EmptyToken);
    }
    Ok((
        base_url.trim_end_matches('/').to_owned(),
        format!("Bearer {token}"),
    ))
}

/// What one HTTP exchange gave: an answer of any status, or none at all.
#[derive(Debug)]
enum Exchange {
    Answer(Answer),
    /// No answer: refused or dropped connection, timeout, DNS.
    NoAnswer(String),
    /// No answer, and none will come by trying again: the URL cannot be
    /// used, or the other end does not speak the protocol its scheme names
    /// (`https://` to a plain-HTTP port).
    Unreachable(String),
}

#[derive(Debug)]
struct Answer {
    status: u16,
    retry_after: Option<Duration>,
    body: String,
}

impl Exchange {
    fn from_ureq(result: Result<ureq::Response, ureq::Error>) -> Self {
        let response = match result {
            Ok(response) | Err(ureq::Error::Status(_, response)) => response,
            Err(ureq::Error::Transport(transport)) => return Self::of_transport(&transport),
        };
        let status = response.status();
        // Seconds only: the service sends no HTTP dates.
        let retry_after = response
            .header("Retry-After")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        // The whole body, however large an expanded feed page is (ureq's
        // `into_string` stops at 10 MB).
        let mut body = String::new();
        match response.into_reader().read_to_string(&mut body) {
            Ok(_) => Self::Answer(Answer {
                status,
                retry_after,
                body,
            }),
            Err(e) => Self::NoAnswer(format!("the answer ({status}) was cut short: {e}")),
        }
    }
}

impl Exchange {
    /// A failure before any answer: worth a retry (refused, dropped, timed
    /// out, DNS), or not.
    fn of_transport(transport: &ureq::Transport) -> Self {
        use ureq::ErrorKind;
        let why = transport.to_string();
        match transport.kind() {
            ErrorKind::InvalidUrl
            | ErrorKind::UnknownScheme
            | ErrorKind::InsecureRequestHttpsOnly => Self::Unreachable(why),
            // What came back is no HTTP (`http://` to a TLS port).
            ErrorKind::BadStatus => Self::Unreachable(format!(
                "{why} (does the URL's scheme match the service's: http:// or https://?)"
            )),
            // A TLS handshake answered with bytes that are not TLS
            // (`https://` to a plain-HTTP port): the data is invalid, which
            // a refused or dropped connection never is.
            _ if invalid_data_below(transport) => Self::handshake_failed(&why),
            _ => Self::NoAnswer(why),
        }
    }

    /// A TLS handshake answered with what is not TLS.
    fn handshake_failed(why: &str) -> Self {
        Self::Unreachable(format!(
            "{why} (the TLS handshake failed: does the service speak https? plan-intake serve speaks plain http unless a TLS proxy is in front)"
        ))
    }
}

/// Whether an I/O error of kind `InvalidData` lies below `error`: bytes
/// came back that the protocol cannot read, which a refused or dropped
/// connection never gives.
fn invalid_data_below(error: &(dyn std::error::Error + 'static)) -> bool {
    source_chain(error).any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::InvalidData)
    })
}

/// `error` and every error below it.
fn source_chain<'a>(
    error: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(error), |e| e.source())
}

impl Answer {
    /// This answer as the last one before giving up.
    fn last(&self) -> submit::LastAnswer {
        submit::LastAnswer::Status {
            status: self.status,
            summary: self.summary(),
        }
    }

    /// Whether the body is the service's problem of type `slug`.
    fn is_problem(&self, slug: &str) -> bool {
        serde_json::from_str::<plan_intake_wire::Problem>(&self.body).is_ok_and(|p| p.is(slug))
    }

    /// A problem+json's `detail` (or `title`) and `errors`, else the start
    /// of the body. Read leniently: a proxy's problem may lack members the
    /// service's always has.
    fn summary(&self) -> String {
        let problem = serde_json::from_str::<serde_json::Value>(&self.body)
            .ok()
            .filter(serde_json::Value::is_object);
        let Some(problem) = problem else {
            let start: String = self.body.chars().take(200).collect();
            return format!("{} {}", self.status, start.trim());
        };
        let text_of = |name: &str| {
            problem
                .get(name)
                .and_then(|v| v.as_str())
                .unwrap_or_default()
        };
        let said = if text_of("detail").is_empty() {
            text_of("title")
        } else {
            text_of("detail")
        };
        let mut text = format!("{} {said}", self.status);
        let errors = problem
            .get("errors")
            .cloned()
            .and_then(|e| serde_json::from_value::<Vec<plan_intake_wire::body::FieldError>>(e).ok())
            .unwrap_or_default();
        for error in errors {
            text.push_str(&format!("; {}: {}", error.field, error.message));
        }
        if self.status == 404 && text_of("type").ends_with("/not-found") {
            // The routes the client asks for always exist at the root: a
            // path in the URL (`…/v1`, a proxy's prefix that is not
            // routed) is the likely cause.
            text.push_str(
                " (not a route of the service: is the URL its root, such as http://127.0.0.1:8080, with no path of its own?)",
            );
        }
        text
    }
}

/// Full-jitter exponential backoff: uniform in `[0, min(cap, base · 2^(n-1))]`
/// before retry `n`, and never less than the service's `Retry-After`.
#[derive(Debug, Clone, Copy)]
struct Backoff {
    base: Duration,
    cap: Duration,
}

impl Backoff {
    fn delay(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        let policy = plan_intake_wire::RetryPolicy {
            max_attempts: u32::MAX,
            base_delay: self.base,
            max_delay: self.cap,
        };
        let jittered = policy.delay(retry, &mut rand::rng());
        retry_after.map_or(jittered, |after| after.max(jittered))
    }
}
