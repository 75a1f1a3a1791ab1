//! The domain: what a valid submission is, how it is hashed, the submit
//! flow with its outcomes, who may read what, and logins. Past
//! `body::parse` nothing re-checks the input. The door calls in here and
//! gets domain types back; only this room calls `storage`.

pub mod body;
pub mod feed;
pub mod hashing;
pub mod idempotency_key;
pub mod ijson;
pub mod login;
#[cfg(test)]
mod properties;
pub mod read;
pub mod receipt;
pub mod retention;
pub mod retry;
pub mod submit;

pub use body::{ApprovedInput, RunId, Submission};
pub use idempotency_key::IdempotencyKey;
pub use login::{Login, LoginError, Permission};
pub use read::{Caller, ReadError};
pub use receipt::{PlanView, Receipt};
pub use retry::RetryPolicy;
pub use submit::{Accepted, Intake, Outcome, SubmitError};
