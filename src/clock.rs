//! The service's one clock: now, in UTC, cut to the microseconds both
//! backends keep, so a timestamp written is the timestamp read back.

use chrono::{DurationRound, NaiveDateTime, TimeDelta, Utc};

/// Now, in UTC, to the microsecond.
pub fn now_micros() -> NaiveDateTime {
    let now = Utc::now();
    now.duration_trunc(TimeDelta::microseconds(1))
        .unwrap_or(now)
        .naive_utc()
}
