//! The domain: what a valid submission is, how it is hashed, and the submit
//! flow with its outcomes. Past `body::parse` nothing re-checks the input.

pub mod body;
pub mod feed;
pub mod hashing;
pub mod idempotency_key;
pub mod ijson;
pub mod login;
#[cfg(test)]
mod properties;
pub mod receipt;
pub mod retry;
pub mod submit;

pub use body::{ApprovedInput, RunId, Submission};
pub use idempotency_key::IdempotencyKey;
pub use login::{Login, Permission};
pub use receipt::{PlanView, Receipt};
pub use retry::RetryPolicy;
pub use submit::{Accepted, Intake, Outcome, SubmitError};
