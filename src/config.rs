//! The HTTP settings and the service's defaults, each written once, and
//! the parsers of the flags that take them (`serve::ServeSettings` is
//! filled from flags and environment). Uses no other room.

use std::time::Duration;

pub const DEFAULT_DATABASE_URL: &str = "sqlite://plan-intake.db";
/// Written once as a macro so that the callers' default URL is built from it.
macro_rules! default_bind {
    () => {
        "127.0.0.1:8080"
    };
}
pub const DEFAULT_BIND: &str = default_bind!();
/// Where `submit` and `follow` find a service started with the defaults.
pub const DEFAULT_SERVICE_URL: &str = concat!("http://", default_bind!());
pub const DEFAULT_BODY_LIMIT: usize = 1024 * 1024;
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_SHUTDOWN_TIMEOUT_SECS: u64 = 30;
pub const DEFAULT_MAX_INFLIGHT_PER_LOGIN: usize = 16;
pub const DEFAULT_MAX_BODY_BYTES_IN_FLIGHT: usize = 64 * 1024 * 1024;
pub const DEFAULT_CLIENT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes of plans one expanded feed page holds before it stops early.
pub const DEFAULT_FEED_PAGE_BYTES: usize = 16 * 1024 * 1024;
/// How long a request waits for room among the bodies in flight before 503.
pub const BODY_BYTES_PATIENCE: Duration = Duration::from_secs(1);
/// How long an idle keep-alive connection stays open.
pub const KEEP_ALIVE: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Largest accepted request body, in bytes; larger is a 413.
    pub body_limit: usize,
    /// Every request that touches the database is answered within this.
    pub request_timeout: Duration,
    /// Submissions one login may have in flight; more is a 429.
    pub max_inflight_per_login: usize,
    /// Bytes of request bodies and expanded reads held at once; past it, a
    /// short wait, then 503.
    pub max_body_bytes_in_flight: usize,
    /// Bytes of plans (content and approved inputs) one expanded feed page
    /// holds before it stops early with its `next`; one larger plan is a
    /// page of one.
    pub feed_page_bytes: usize,
    /// A request's head, and its body, must arrive within this (408).
    pub client_timeout: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            body_limit: DEFAULT_BODY_LIMIT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            max_inflight_per_login: DEFAULT_MAX_INFLIGHT_PER_LOGIN,
            max_body_bytes_in_flight: DEFAULT_MAX_BODY_BYTES_IN_FLIGHT,
            feed_page_bytes: DEFAULT_FEED_PAGE_BYTES,
            client_timeout: DEFAULT_CLIENT_TIMEOUT,
        }
    }
}

/// The receipt log's origin when none is given.
pub const DEFAULT_LOG_ORIGIN: &str = "plan-intake";

/// A default duration as the whole milliseconds a flag takes.
pub fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// An address to listen on that resolves: `HOST:PORT`.
pub fn parse_bind(text: &str) -> Result<String, String> {
    use std::net::ToSocketAddrs;
    let resolves = text
        .to_socket_addrs()
        .is_ok_and(|mut addrs| addrs.next().is_some());
    if resolves {
        Ok(text.to_owned())
    } else {
        Err(format!("must be HOST:PORT, e.g. {DEFAULT_BIND}"))
    }
}

/// 1 MiB to 4 GiB (one permit a byte).
pub fn parse_bytes_in_flight(text: &str) -> Result<usize, &'static str> {
    match text.parse::<usize>() {
        Ok(n) if (1024 * 1024..=u32::MAX as usize).contains(&n) => Ok(n),
        _ => Err("must be a number of bytes from 1048576 to 4294967295"),
    }
}

/// A checkpoint's first line: printable, no spaces at its ends, at most 255 bytes.
pub fn parse_origin(text: &str) -> Result<String, &'static str> {
    let printable = text.chars().all(|c| !c.is_control());
    if text.is_empty() || text.len() > 255 || !printable || text.trim() != text {
        return Err("must be 1 to 255 printable bytes, no spaces at either end");
    }
    Ok(text.to_owned())
}

/// 1 byte to 64 MiB.
pub fn parse_body_limit(text: &str) -> Result<usize, &'static str> {
    match text.parse::<usize>() {
        Ok(n) if (1..=64 * 1024 * 1024).contains(&n) => Ok(n),
        _ => Err("must be a number of bytes from 1 to 67108864"),
    }
}
