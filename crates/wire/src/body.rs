//! The body rules: a request body becomes a [`Submission`] or a list of precise
//! field errors. Past this module a run is never blank and an input never
//! lacks an id.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use unicode_general_category::{GeneralCategory, get_general_category};
use validator::{Validate, ValidationError, ValidationErrors, ValidationErrorsKind};

use crate::ijson::{self, JsonError, Members};

/// The longest `run_id`, in characters.
pub const MAX_RUN_ID_CHARS: usize = 200;
/// The longest approved input `id`, in characters.
pub const MAX_INPUT_ID_CHARS: usize = 256;
/// The most approved inputs one plan may name.
pub const MAX_APPROVED_INPUTS: u64 = 1000;
/// The longest approved input `digest`, in characters.
pub const MAX_DIGEST_CHARS: usize = 256;
/// The largest receipt, in bytes of its signed form (RFC 8785, without
/// `signature` and `outcome`): a receipt is a leaf of the receipt log, and
/// a C2SP tlog-tiles entry bundle holds leaves of at most 65,535 bytes.
/// Only a plan naming hundreds of long approved input ids comes near it.
pub const MAX_RECEIPT_BYTES: usize = 65_535;
/// The `field` of a problem with the body as a whole.
pub const WHOLE_BODY: &str = "body";

/// One problem with one field, named by its path (`approved_inputs[2].id`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FieldError {
    /// The refused field's path (`approved_inputs[2].id`)
    pub field: String,
    /// Why it was refused
    pub message: String,
}

/// Why a body is refused; the messages are for the caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// Not JSON: 400.
    #[error("{0}")]
    Malformed(String),
    /// JSON that breaks the rules: 422.
    #[error("{}", .0.iter().map(|e| format!("{}: {}", e.field, e.message)).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<FieldError>),
}

/// A run id that is present, not blank and printable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunId(String);

impl RunId {
    /// The run id as sent.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// One approved input: nothing but `id` and an optional `digest` (other
/// fields are refused, and the OpenAPI document says so).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ApprovedInput {
    /// The input's id: not blank, no control or format characters
    pub id: String,
    /// The input's digest, when the planner knows it
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

/// A validated plan submission, as kept.
#[derive(Debug, Clone, PartialEq)]
pub struct Submission {
    /// The planner's run this plan belongs to.
    pub run_id: RunId,
    /// What the plan was made from.
    pub approved_inputs: Vec<ApprovedInput>,
    /// The content object in its RFC 8785 form, as it is stored and hashed.
    pub content: String,
}

impl Submission {
    /// `[{id, digest}]`, `digest` left out when absent, as a value (the
    /// stored text is `hashing::canonical_inputs`).
    #[cfg(test)]
    pub fn approved_inputs_json(&self) -> Value {
        serde_json::to_value(&self.approved_inputs).unwrap_or(Value::Null)
    }
}

/// `POST /v1/plans`'s body as documented (parsing goes through `PlanBody`).
#[cfg(feature = "openapi")]
#[derive(utoipa::ToSchema)]
#[allow(dead_code)] // ok: a schema only
pub struct PlanRequest {
    /// Not blank, at most 200 characters, no control or format characters.
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = r"^[^\u0000-\u001f\u007f-\u009f]*[^\s\u0000-\u001f\u007f-\u009f][^\u0000-\u001f\u007f-\u009f]*$"
    )]
    run_id: String,
    /// 1 to 1000 entries; `id` not blank, at most 256 characters.
    #[schema(min_items = 1, max_items = 1000)]
    approved_inputs: Vec<ApprovedInput>,
    /// The plan itself: any JSON object (I-JSON).
    #[schema(value_type = Object)]
    content: Map<String, Value>,
}

/// The body as sent. Unknown top-level fields (`permissions`, `maker`, …)
/// are ignored: they come from the login, never from the caller.
#[derive(Debug, Deserialize, Validate)]
struct PlanBody {
    #[validate(required(message = "is required"), custom(function = "check_run_id"))]
    run_id: Option<String>,
    #[validate(
        required(message = "is required"),
        length(min = 1, max = MAX_APPROVED_INPUTS, message = "must hold 1 to 1000 entries"),
        nested
    )]
    approved_inputs: Option<Vec<ApprovedInputBody>>,
    #[validate(required(message = "is required and must be a JSON object"))]
    content: Option<Map<String, Value>>,
}

// Serialize: validator records a refused list's value in its error params.
#[derive(Debug, Serialize, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
struct ApprovedInputBody {
    #[validate(custom(function = "check_input_id"))]
    id: String,
    #[validate(custom(function = "check_digest"))]
    digest: Option<String>,
}

/// A plan request read as the service reads it: I-JSON in one pass, the
/// content written in its RFC 8785 form as it is read, the rules of
/// `run_id` and `approved_inputs` applied; or why it is refused.
pub fn parse(bytes: &[u8]) -> Result<Submission, BodyError> {
    // One pass: the content, however large, becomes its RFC 8785 text as it
    // is read (no tree); the two small fields become values for the rules
    // below, with an empty object standing in for the content.
    let parsed = ijson::parse_members(bytes, &["run_id", "approved_inputs"], "content")
        .map_err(json_error)?;
    let Members::Object {
        kept: mut fields,
        canonical: content,
    } = parsed
    else {
        return Err(invalid(WHOLE_BODY, "body must be a JSON object"));
    };
    if content.is_some() {
        fields.insert("content".to_owned(), Value::Object(Map::new()));
    }
    submission(check_fields(fields)?, content)
}

/// The checked fields and the canonical content as a [`Submission`].
fn submission(body: PlanBody, content: Option<String>) -> Result<Submission, BodyError> {
    let (Some(run_id), Some(inputs), Some(content)) = (body.run_id, body.approved_inputs, content)
    else {
        // `validate` refused every missing field, and a content that is not
        // an object failed to deserialize; this arm is unreachable.
        return Err(invalid(
            WHOLE_BODY,
            "run_id, approved_inputs and content are required",
        ));
    };
    Ok(Submission {
        run_id: RunId(run_id),
        approved_inputs: inputs
            .into_iter()
            .map(|input| ApprovedInput {
                id: input.id,
                digest: input.digest,
            })
            .collect(),
        content,
    })
}

fn json_error(e: JsonError) -> BodyError {
    match e {
        JsonError::Syntax(message) => {
            BodyError::Malformed(format!("body is not valid JSON: {message}"))
        }
        JsonError::NotIJson { path, message } => BodyError::Invalid(vec![FieldError {
            field: if path.is_empty() {
                WHOLE_BODY.to_owned()
            } else {
                path
            },
            message: format!("not I-JSON (RFC 7493): {message}"),
        }]),
    }
}

/// The rules for the top-level fields (the content stands in as an object).
fn check_fields(fields: Map<String, Value>) -> Result<PlanBody, BodyError> {
    let body: PlanBody = serde_path_to_error::deserialize(Value::Object(fields)).map_err(|e| {
        let field = e.path().to_string();
        let field = if field == "." {
            WHOLE_BODY.to_owned()
        } else {
            field
        };
        invalid(&field, &e.into_inner().to_string())
    })?;
    body.validate()
        .map_err(|errors| BodyError::Invalid(flatten(&errors)))?;
    Ok(body)
}

/// What `parse` did before it built no tree: the whole body as a `Value`,
/// the content canonicalized by the crate. The reference the one-pass
/// parse is compared with (the server's `intake/properties.rs`), answer
/// for answer; not for use otherwise.
#[cfg(feature = "reference")]
pub fn parse_with_a_tree(bytes: &[u8]) -> Result<Submission, BodyError> {
    let Value::Object(mut fields) = ijson::parse(bytes).map_err(json_error)? else {
        return Err(invalid(WHOLE_BODY, "body must be a JSON object"));
    };
    let content = match fields.remove("content") {
        Some(Value::Object(content)) => {
            fields.insert("content".to_owned(), Value::Object(Map::new()));
            Some(content)
        }
        other => {
            if let Some(other) = other {
                fields.insert("content".to_owned(), other);
            }
            None
        }
    };
    let content =
        content.map(|content| serde_json_canonicalizer::to_string(&content).expect("canonical"));
    submission(check_fields(fields)?, content)
}

fn invalid(field: &str, message: &str) -> BodyError {
    BodyError::Invalid(vec![FieldError {
        field: field.to_owned(),
        message: message.to_owned(),
    }])
}

fn check_run_id(run_id: &str) -> Result<(), ValidationError> {
    check_text(run_id, MAX_RUN_ID_CHARS)
}

fn check_input_id(id: &str) -> Result<(), ValidationError> {
    check_text(id, MAX_INPUT_ID_CHARS)
}

fn check_digest(digest: &str) -> Result<(), ValidationError> {
    check_text(digest, MAX_DIGEST_CHARS)
}

/// Not blank (empty or only Unicode white space), at most `max` characters,
/// no control (Cc) or format (Cf) characters.
fn check_text(text: &str, max: usize) -> Result<(), ValidationError> {
    if text.trim().is_empty() {
        return Err(rule(
            "blank",
            "must not be empty or only white space".into(),
        ));
    }
    if text.chars().count() > max {
        return Err(rule(
            "too_long",
            format!("must be at most {max} characters").into(),
        ));
    }
    if text.chars().any(|c| {
        matches!(
            get_general_category(c),
            GeneralCategory::Control | GeneralCategory::Format
        )
    }) {
        return Err(rule(
            "control_character",
            "must not contain control or format characters".into(),
        ));
    }
    Ok(())
}

fn rule(code: &'static str, message: Cow<'static, str>) -> ValidationError {
    ValidationError::new(code).with_message(message)
}

/// validator's nested error tree as a flat, sorted list of `{field, message}`.
fn flatten(errors: &ValidationErrors) -> Vec<FieldError> {
    let mut out = Vec::new();
    collect(errors, "", &mut out);
    out.sort_by(|a, b| a.field.cmp(&b.field));
    out
}

fn collect(errors: &ValidationErrors, prefix: &str, out: &mut Vec<FieldError>) {
    for (name, kind) in errors.errors() {
        let path = if prefix.is_empty() {
            name.to_string()
        } else {
            format!("{prefix}.{name}")
        };
        match kind {
            ValidationErrorsKind::Field(list) => out.extend(list.iter().map(|e| {
                FieldError {
                    field: path.clone(),
                    message: e
                        .message
                        .as_deref()
                        .map(str::to_owned)
                        .unwrap_or_else(|| e.code.to_string()),
                }
            })),
            ValidationErrorsKind::Struct(inner) => collect(inner, &path, out),
            ValidationErrorsKind::List(items) => {
                for (index, inner) in items {
                    collect(inner, &format!("{path}[{index}]"), out);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(body: &str) -> Vec<String> {
        match parse(body.as_bytes()) {
            Err(BodyError::Invalid(errors)) => errors.into_iter().map(|e| e.field).collect(),
            other => panic!("expected a 422 for {body}, got {other:?}"),
        }
    }

    #[test]
    fn every_blank_run_is_refused_by_name() {
        let rest = r#""approved_inputs":[{"id":"a"}],"content":{}"#;
        for run in [
            "",
            r#""run_id":null,"#,
            r#""run_id":"","#,
            r#""run_id":"   ","#,
            r#""run_id":"\u3000\t","#,
        ] {
            assert_eq!(
                fields(&format!("{{{run}{rest}}}")),
                vec!["run_id"],
                "run: {run}"
            );
        }
    }

    #[test]
    fn names_nested_and_typed_fields() {
        assert_eq!(
            fields(r#"{"run_id":"r","approved_inputs":[{"id":"a"},{"id":" "}],"content":{}}"#),
            vec!["approved_inputs[1].id"]
        );
        assert_eq!(
            fields(r#"{"run_id":"r","approved_inputs":[{"id":"a","extra":1}],"content":{}}"#),
            vec!["approved_inputs[0].extra"]
        );
        assert_eq!(
            fields(r#"{"run_id":7,"approved_inputs":[{"id":"a"}],"content":{}}"#),
            vec!["run_id"]
        );
        assert_eq!(
            fields(r#"{"run_id":"r","approved_inputs":[],"content":[]}"#),
            vec!["content"]
        );
        assert_eq!(
            fields(r#"{"run_id":"r\u200b","approved_inputs":[],"content":{}}"#),
            vec!["approved_inputs", "run_id"]
        );
    }

    #[test]
    fn ignores_claimed_permissions_and_maker() {
        let submission = parse(
            br#"{"run_id":"r","approved_inputs":[{"id":"a","digest":"d"}],"content":{"k":1},
                "permissions":["receipts:read"],"maker":"someone-else"}"#,
        )
        .expect("valid body");
        assert_eq!(submission.run_id.as_str(), "r");
        assert_eq!(submission.approved_inputs.len(), 1);
    }
}
