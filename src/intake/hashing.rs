//! RFC 8785 canonical JSON and the two blake3 hashes over it.

use serde_json::{Value, json};

use super::body::Submission;

/// `content_hash` covers what the plan is; `request_hash` also covers the run
/// it was sent for. Both are `blake3:` and 64 hex digits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hashes {
    pub content_hash: String,
    pub request_hash: String,
}

/// The submission's parts as canonical JSON text, stored as the plan's columns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CanonicalParts {
    pub approved_inputs: String,
    pub content: String,
    pub hashes: Hashes,
}

pub fn canonicalize(submission: &Submission) -> Result<CanonicalParts, serde_json::Error> {
    let inputs = submission.approved_inputs_json();
    let content = Value::Object(submission.content.clone());
    let content_doc = json!({"approved_inputs": inputs, "content": content});
    let request_doc = json!({
        "run_id": submission.run_id.as_str(),
        "approved_inputs": inputs,
        "content": content,
    });
    Ok(CanonicalParts {
        approved_inputs: canonical(&inputs)?,
        content: canonical(&content)?,
        hashes: Hashes {
            content_hash: hash(&canonical(&content_doc)?),
            request_hash: hash(&canonical(&request_doc)?),
        },
    })
}

pub fn canonical(value: &Value) -> Result<String, serde_json::Error> {
    serde_json_canonicalizer::to_string(value)
}

pub fn hash(text: &str) -> String {
    format!("blake3:{}", blake3::hash(text.as_bytes()).to_hex())
}
