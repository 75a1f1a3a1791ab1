//! What plan-intake's callers send and get back, shared by the service,
//! its client (`plan-intake-client`) and the OpenAPI document: the plan
//! request and the rules it must meet (`body`), the two hashes a receipt
//! carries (`hashing`), the receipt ([`Receipt`]) and how the service took
//! a plan ([`Outcome`]), the
//! RFC 9457 problem every error answers ([`Problem`]), the feed's pages,
//! cursors and bounds (`feed`), and the full-jitter backoff both sides
//! retry with ([`RetryPolicy`]).
//!
//! Features: `openapi` derives the types' OpenAPI schemas (the server's
//! document); `reference` adds the tree-building parse the one-pass one is
//! held to in the server's property tests. Numbers are kept exact by
//! `plan-intake-json` without any serde_json feature, so linking this crate
//! changes nothing in how a program's own types read JSON.
//!
#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

pub mod body;
#[cfg(feature = "evidence")]
pub mod evidence;
pub mod feed;
pub mod hashing;
pub mod retry;

/// I-JSON reading and RFC 8785 writing (`plan-intake-json`).
pub use plan_intake_json as ijson;
pub use retry::RetryPolicy;

use serde::{Deserialize, Serialize};

/// Where every problem type lives: a problem's `type` is this and a slug.
pub const PROBLEM_BASE: &str = "https://plan-intake.dev/problems/";

/// How the service took a plan: the `outcome` of an answer to
/// `POST /v1/plans`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// This request wrote the plan: 201.
    Created,
    /// Same maker and key, same request: the stored receipt, 200.
    Replayed,
    /// A new key for a plan this maker already sent for this run: 200.
    AlreadyReceived,
}

impl Outcome {
    /// The outcome as the service writes it: `created`, `replayed` or
    /// `already_received`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Created => "created",
            Outcome::Replayed => "replayed",
            Outcome::AlreadyReceived => "already_received",
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A receipt as the service answers it. `outcome` is present only in
/// answers to `POST /v1/plans`; `signature` only when the service signs.
///
/// Forward-compatible: a later version of the service may add members.
/// Clients must ignore and keep members they do not know: this type keeps
/// them in `extra`, writes them back out, and the signature covers them
/// like every other member, so one can neither break an older reader nor
/// escape the signature. Read it with [`Receipt::parse`], which
/// refuses a member given twice, so no reader can be shown one receipt
/// while another was verified.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Receipt {
    /// The receipt's id (`rcpt_` and 32 hex digits), named by `Location`
    pub receipt_id: String,
    /// The login that submitted the plan
    pub maker: String,
    /// The plan's `run_id`, as sent
    pub run_id: String,
    /// blake3 over the RFC 8785 form of `{approved_inputs, content}`
    pub content_hash: String,
    /// blake3 over the RFC 8785 form of `{run_id, approved_inputs, content}`
    pub request_hash: String,
    /// The ids of the plan's approved inputs, in the order sent
    pub approved_inputs: Vec<String>,
    /// The maker's permissions when the plan was received
    pub permissions: Vec<String>,
    /// When the plan was received: RFC 3339, UTC, to the microsecond
    pub received_at: String,
    /// The service's signature over this receipt; absent when the service
    /// signs none (started without a key)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<ReceiptSignature>,
    /// How the service took the plan; only in answers to POST.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// Members this version does not know, as received: kept, printed and
    /// signed over. Clients must ignore and keep them.
    #[serde(flatten)]
    #[cfg_attr(feature = "openapi", schema(ignore))]
    pub extra: std::collections::BTreeMap<String, serde_json::Value>,
}

/// Why a text is not a receipt.
#[derive(Debug, thiserror::Error)]
pub enum ReceiptError {
    /// Not I-JSON: a member given twice, a lone surrogate, an inexact number.
    #[error("not a receipt: {}", json_error_text(.0))]
    NotIJson(plan_intake_json::JsonError),
    /// JSON, but not a receipt (a known member missing or of another type).
    #[error("not a receipt: {0}")]
    Shape(#[from] serde_json::Error),
}

/// What an I-JSON refusal says, with its path when it has one.
fn json_error_text(error: &plan_intake_json::JsonError) -> String {
    match error {
        plan_intake_json::JsonError::Syntax(message) => message.clone(),
        plan_intake_json::JsonError::NotIJson { path, message } if path.is_empty() => {
            message.clone()
        }
        plan_intake_json::JsonError::NotIJson { path, message } => format!("{path}: {message}"),
    }
}

impl Receipt {
    /// A receipt from the service's JSON: every member this version knows,
    /// typed, and the others kept in `extra`; a member given twice (at any
    /// depth) is refused.
    pub fn parse(text: &str) -> Result<Self, ReceiptError> {
        plan_intake_json::parse(text.as_bytes()).map_err(ReceiptError::NotIJson)?;
        Ok(serde_json::from_str(text)?)
    }
}

/// A receipt's signature. A member this version does not know is ignored
/// (it is not signed over: what the signature covers is the receipt).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReceiptSignature {
    /// The signing key: `name+id` (8 hex digits), the start of its
    /// verifier key in `GET /v1/signing-keys`
    pub key_id: String,
    /// The Ed25519 signature over the receipt's RFC 8785 form without
    /// `signature` and `outcome`, in base64
    pub ed25519: String,
}

/// An RFC 9457 problem: every error answer's body.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Problem {
    /// A URI naming the kind of problem, under `https://plan-intake.dev/problems/`.
    #[serde(rename = "type")]
    #[cfg_attr(feature = "openapi", schema(rename = "type"))]
    pub kind: String,
    /// A short summary of the problem type
    pub title: String,
    /// The HTTP status of the answer
    pub status: u16,
    /// What happened this time, and what to do
    pub detail: String,
    /// Present on validation failures: one entry per refused field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub errors: Option<Vec<body::FieldError>>,
}

impl Problem {
    /// Whether this is the problem type `slug` (as in [`feed::CURSOR_NOT_IN_FEED`]).
    pub fn is(&self, slug: &str) -> bool {
        self.kind.strip_prefix(PROBLEM_BASE) == Some(slug)
    }
}
