//! The HTTP settings and the service's defaults, each written once;
//! `commands::serve` fills them from flags and environment. Uses no other
//! room.

use std::time::Duration;

pub const DEFAULT_DATABASE_URL: &str = "sqlite://plan-intake.db";
pub const DEFAULT_BIND: &str = "127.0.0.1:8080";
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
