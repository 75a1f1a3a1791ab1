//! RFC 8785 canonical JSON and the two blake3 hashes over it.

use serde_json::Value;

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
    // Each part is canonicalized once, by the crate. The two documents are
    // then composed from those parts: RFC 8785 output of an object is its
    // members sorted by name, each `"name":value` with the value in its own
    // canonical form, so a canonical value can be placed inside verbatim.
    // The names below are ASCII and already in that order (a test checks the
    // composition against the crate's output for whole documents).
    let inputs = canonical(&submission.approved_inputs_json())?;
    let content = serde_json_canonicalizer::to_string(&submission.content)?;
    let run_id = canonical(&Value::from(submission.run_id.as_str()))?;
    let content_doc = format!(r#"{{"approved_inputs":{inputs},"content":{content}}}"#);
    let request_doc =
        format!(r#"{{"approved_inputs":{inputs},"content":{content},"run_id":{run_id}}}"#);
    Ok(CanonicalParts {
        hashes: Hashes {
            content_hash: hash(&content_doc),
            request_hash: hash(&request_doc),
        },
        approved_inputs: inputs,
        content,
    })
}

pub fn canonical(value: &Value) -> Result<String, serde_json::Error> {
    serde_json_canonicalizer::to_string(value)
}

pub fn hash(text: &str) -> String {
    format!("blake3:{}", blake3::hash(text.as_bytes()).to_hex())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::intake::body;

    /// The composed documents are exactly what the crate makes of whole ones.
    #[test]
    fn composed_documents_equal_the_canonical_whole() {
        let text = r#"{"run_id":"r\u00e9 \"x\"","approved_inputs":[{"id":"b","digest":"d"},{"id":"a"}],
                      "content":{"z":1.50,"a":[3,{"\u20ac":null,"b":true}],"é":"\ud83d\ude00"}}"#;
        let submission = body::parse(text.as_bytes()).expect("valid");
        let parts = canonicalize(&submission).expect("canonical");
        let inputs = submission.approved_inputs_json();
        let content = Value::Object(submission.content.clone());
        let whole_content = json!({"approved_inputs": inputs, "content": content});
        let whole_request = json!({"run_id": submission.run_id.as_str(), "approved_inputs": inputs, "content": content});
        assert_eq!(
            parts.hashes.content_hash,
            hash(&canonical(&whole_content).expect("c"))
        );
        assert_eq!(
            parts.hashes.request_hash,
            hash(&canonical(&whole_request).expect("c"))
        );
        assert_eq!(parts.content, canonical(&content).expect("c"));
    }
}
