//! RFC 8785 canonical JSON and the two blake3 hashes over it.

#[cfg(test)]
use serde_json::Value;

use crate::body::{ApprovedInput, Submission};
use crate::ijson::write_string;

/// `content_hash` covers what the plan is; `request_hash` also covers the run
/// it was sent for. Both are `blake3:` and 64 hex digits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hashes {
    /// blake3 over the RFC 8785 form of `{approved_inputs, content}`.
    pub content_hash: String,
    /// blake3 over the RFC 8785 form of `{run_id, approved_inputs, content}`.
    pub request_hash: String,
}

/// The submission's parts as canonical JSON text, stored as the plan's columns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CanonicalParts<'a> {
    /// The approved inputs' RFC 8785 text, as stored.
    pub approved_inputs: String,
    /// The content's RFC 8785 text, as stored.
    pub content: &'a str,
    /// The request's two hashes.
    pub hashes: Hashes,
}

/// A submission's stored parts in their RFC 8785 form, and its hashes.
pub fn canonicalize(submission: &Submission) -> CanonicalParts<'_> {
    // The content is already canonical (`body::parse` wrote it so), and the
    // small parts are written here in their RFC 8785 form. The two
    // documents are hashed as compositions of those parts: RFC 8785 output
    // of an object is its members sorted by name, each `"name":value` with
    // the value in its own canonical form, so a canonical value can be
    // placed inside verbatim. The names below are ASCII and already in that
    // order (tests check the parts and the composition against the crate's
    // output for whole documents). Hashed piece by piece: a 1 MiB content
    // is not copied.
    let inputs = canonical_inputs(&submission.approved_inputs);
    let content = submission.content.as_str();
    let hashes = hashes_of_stored(&inputs, content, submission.run_id.as_str());
    CanonicalParts {
        hashes,
        approved_inputs: inputs,
        content,
    }
}

/// The two hashes of a plan from its stored parts: the approved inputs'
/// and the content's RFC 8785 text, and the run id. What the write hashed,
/// and what an audit recomputes from a row.
pub fn hashes_of_stored(inputs: &str, content: &str, run_id: &str) -> Hashes {
    let mut run_id_json = String::with_capacity(run_id.len() + 2);
    write_string(&mut run_id_json, run_id);
    // The two documents share everything up to the content's end: hashed
    // once, then each finished from a copy of the hasher's state.
    let mut shared = blake3::Hasher::new();
    for piece in [r#"{"approved_inputs":"#, inputs, r#","content":"#, content] {
        shared.update(piece.as_bytes());
    }
    let finish = |pieces: &[&str]| {
        let mut hasher = shared.clone();
        for piece in pieces {
            hasher.update(piece.as_bytes());
        }
        format!("blake3:{}", hasher.finalize().to_hex())
    };
    let content_hash = finish(&["}"]);
    let request_hash = finish(&[r#","run_id":"#, &run_id_json, "}"]);
    Hashes {
        content_hash,
        request_hash,
    }
}

/// `[{"digest":…,"id":…},…]`, `digest` left out when absent: the approved
/// inputs in their RFC 8785 form ("digest" sorts before "id").
pub fn canonical_inputs(inputs: &[ApprovedInput]) -> String {
    let mut out = String::with_capacity(2 + inputs.len() * 48);
    out.push('[');
    for (i, input) in inputs.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push('{');
        if let Some(digest) = &input.digest {
            out.push_str(r#""digest":"#);
            write_string(&mut out, digest);
            out.push(',');
        }
        out.push_str(r#""id":"#);
        write_string(&mut out, &input.id);
        out.push('}');
    }
    out.push(']');
    out
}

/// RFC 8785 through the crate, for the tests that hold the one-pass
/// writer to it.
#[cfg(test)]
pub fn canonical(value: &Value) -> Result<String, serde_json::Error> {
    serde_json_canonicalizer::to_string(value)
}

/// `blake3:` and the hex of blake3 over `text` (the tests' reference).
#[cfg(test)]
pub fn hash(text: &str) -> String {
    format!("blake3:{}", blake3::hash(text.as_bytes()).to_hex())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::body;

    /// The composed documents are exactly what the crate makes of whole ones.
    #[test]
    fn composed_documents_equal_the_canonical_whole() {
        let text = r#"{"run_id":"r\u00e9 \"x\"","approved_inputs":[{"id":"b","digest":"d"},{"id":"a"}],
                      "content":{"z":1.50,"a":[3,{"\u20ac":null,"b":true}],"é":"\ud83d\ude00"}}"#;
        let submission = body::parse(text.as_bytes()).expect("valid");
        let parts = canonicalize(&submission);
        let inputs = submission.approved_inputs_json();
        let content: Value = serde_json::from_str(&submission.content).expect("stored JSON");
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

    /// Fixed bodies, fixed hashes: a change to parsing, canonical form or
    /// composition that moved a stored hash would break every replay.
    #[test]
    fn hashes_of_fixed_bodies_never_drift() {
        let pinned = [
            (
                r#"{"run_id":"run-1","approved_inputs":[{"id":"forecast-v12","digest":"blake3:00ff"}],"content":{"a":1}}"#,
                "blake3:7b026f5cbca8579b98508ad60810d0c1fa46184c06c5334364077028d2e04406",
                "blake3:0745d7344bba8e86c03c7e44aed3997b0b515b5f67b276a3ac866c0bf7ecba40",
            ),
            (
                r#"{"content":{"lines":[{"sku":"A-1","qty":3},{"qty":1.5,"sku":"B-2"}],"note":"n"},"approved_inputs":[{"id":"b"},{"id":"a","digest":"d"}],"run_id":"r\u00e9"}"#,
                "blake3:e569bd113dc7c7bb4844795b4fe11f12a96560ffe13b5895fa9f2914d8b71617",
                "blake3:56413dc754ef0e0bf6b3eb3c0cd8dad7bb5e794dfa1ce1258c9bdccbcc2c6546",
            ),
            (
                r#"{"run_id":"x","approved_inputs":[{"id":"i"}],"content":{"n":[1e2,0.5,-0,1E-7,100000000000000000000],"s":"\ud83d\ude00\u20ac","o":{}}}"#,
                "blake3:f96637f65d2f0e321c7c06ddbc2c8e3e2101189734f1881e17a111a557e44023",
                "blake3:a6554a4c4babf6549c3b7c15528ffe9a82403e178d42f452520b1a6e59d18bbc",
            ),
        ];
        for (text, content_hash, request_hash) in pinned {
            let submission = body::parse(text.as_bytes()).expect("valid");
            let parts = canonicalize(&submission);
            assert_eq!(parts.hashes.content_hash, content_hash, "{text}");
            assert_eq!(parts.hashes.request_hash, request_hash, "{text}");
        }
    }
}
