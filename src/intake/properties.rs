//! Property tests of the body rules and the hashes, over generated documents.

use proptest::prelude::*;
use proptest::test_runner::TestRng;
use rand::seq::SliceRandom;
use serde_json::{Map, Value, json};

use super::body::{self, BodyError};
use super::hashing;

/// Any I-JSON value: integers within ±2^53, finite doubles, any strings.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (-(1i64 << 53)..=(1i64 << 53)).prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        ".*".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(".{0,8}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn json_object() -> impl Strategy<Value = Map<String, Value>> {
    prop::collection::btree_map("[a-z]{1,6}", json_value(), 0..6)
        .prop_map(|m| m.into_iter().collect())
}

/// `value` as JSON text with its object members in a shuffled order and
/// random white space between tokens.
fn render_shuffled(value: &Value, rng: &mut TestRng, out: &mut String) {
    let space = |rng: &mut TestRng, out: &mut String| {
        let choices = ["", " ", "\n", "\t", "  \r\n "];
        out.push_str(choices[rng.random_range(0..choices.len())]);
    };
    space(rng, out);
    match value {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                render_shuffled(item, rng, out);
            }
            out.push(']');
        }
        Value::Object(members) => {
            let mut members: Vec<_> = members.iter().collect();
            members.shuffle(rng);
            out.push('{');
            for (i, (key, item)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                space(rng, out);
                out.push_str(&Value::String(key.clone()).to_string());
                space(rng, out);
                out.push(':');
                render_shuffled(item, rng, out);
            }
            out.push('}');
        }
        leaf => out.push_str(&leaf.to_string()),
    }
    space(rng, out);
}

fn submission_body(content: &Map<String, Value>) -> Value {
    json!({
        "run_id": "run-1",
        "approved_inputs": [{"id": "in-1", "digest": "blake3:00"}, {"id": "in-2"}],
        "content": content,
    })
}

fn hashes_of(text: &str) -> hashing::Hashes {
    let submission = body::parse(text.as_bytes()).expect("a valid body");
    hashing::canonicalize(&submission).hashes
}

fn count_leaves(value: &Value) -> usize {
    match value {
        Value::Array(items) => items.iter().map(count_leaves).sum(),
        Value::Object(members) => members.values().map(count_leaves).sum(),
        _ => 1,
    }
}

/// Changes one leaf somewhere in `value` (chosen by `pick`); false if it has none.
fn mutate_one_leaf(value: &mut Value, pick: &mut usize) -> bool {
    match value {
        Value::Array(items) => items.iter_mut().any(|item| mutate_one_leaf(item, pick)),
        Value::Object(members) => members.values_mut().any(|item| mutate_one_leaf(item, pick)),
        leaf => {
            if *pick > 0 {
                *pick -= 1;
                return false;
            }
            let changed = match &*leaf {
                Value::Null => Value::from(0),
                Value::Bool(b) => Value::Bool(!*b),
                Value::Number(n) if n.as_f64() == Some(0.0) => Value::from(1),
                // Doubling changes every finite non-zero number (overflow gives null).
                Value::Number(n) => Value::from(n.as_f64().unwrap_or(1.0) * 2.0),
                Value::String(s) => Value::String(format!("{s}x")),
                other => other.clone(),
            };
            *leaf = changed;
            true
        }
    }
}

/// Any JSON value serde_json writes, integers of the whole i64 and u64
/// ranges included (most beyond 2^53 are not exactly doubles).
fn wide_json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-(1i64 << 53)..=(1i64 << 53)).prop_map(Value::from),
        (0u32..64).prop_map(|shift| Value::from(1u64 << shift)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        "[a-z\"\\\\]{0,4}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 32, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::btree_map("[a-z]{1,3}", inner, 0..5)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// Whether `value` holds an integer whose RFC 8785 form (the shortest
/// text of its nearest double, `36028797018963970` for 2^55) is another
/// number than the one written: what the service refuses to store.
fn holds_an_integer_its_form_would_change(value: &Value) -> bool {
    let changed = |written: i128, nearest: f64| {
        serde_json_canonicalizer::to_string(&Value::from(nearest))
            .ok()
            .and_then(|form| form.parse::<i128>().ok())
            != Some(written)
    };
    match value {
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => changed(i128::from(i), i as f64),
            (None, Some(u)) => changed(i128::from(u), u as f64),
            _ => false,
        },
        Value::Array(items) => items.iter().any(holds_an_integer_its_form_would_change),
        Value::Object(members) => members.values().any(holds_an_integer_its_form_would_change),
        _ => false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// The stored content is the crate's RFC 8785 form of what serde_json
    /// itself reads, for numbers of any size: an oracle outside the
    /// one-pass parse's own number code (which the tree path shares). A
    /// body is refused only for an integer its RFC 8785 form would change.
    #[test]
    fn the_content_is_the_crates_form_of_serde_jsons_own_reading(
        members in prop::collection::btree_map("[a-z]{1,3}", wide_json_value(), 0..6)
    ) {
        let content: Map<String, Value> = members.into_iter().collect();
        let text = submission_body(&content).to_string();
        let content = Value::Object(content);
        match body::parse(text.as_bytes()) {
            Ok(submission) => {
                prop_assert!(!holds_an_integer_its_form_would_change(&content), "{}", text);
                let expected = serde_json_canonicalizer::to_string(&content).expect("canonical");
                prop_assert_eq!(submission.content, expected);
            }
            Err(_) => prop_assert!(holds_an_integer_its_form_would_change(&content), "{}", text),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn hashes_ignore_member_order_and_white_space(content in json_object(), seed in any::<u64>()) {
        let body = submission_body(&content);
        let mut rng = TestRng::from_seed(proptest::test_runner::RngAlgorithm::ChaCha, &seed.to_le_bytes().repeat(4));
        let mut shuffled = String::new();
        render_shuffled(&body, &mut rng, &mut shuffled);
        prop_assert_eq!(hashes_of(&body.to_string()), hashes_of(&shuffled));
    }

    #[test]
    fn hashes_change_with_any_value(content in json_object(), pick in 0usize..32) {
        let mut changed = content.clone();
        let mut as_value = Value::Object(changed.clone());
        let leaves = count_leaves(&as_value);
        prop_assume!(leaves > 0);
        let mut index = pick % leaves;
        prop_assert!(mutate_one_leaf(&mut as_value, &mut index));
        if let Value::Object(members) = as_value {
            changed = members;
        }
        let before = hashes_of(&submission_body(&content).to_string());
        let after = hashes_of(&submission_body(&changed).to_string());
        prop_assert_ne!(before.content_hash, after.content_hash);
        prop_assert_ne!(before.request_hash, after.request_hash);
    }

    #[test]
    fn no_byte_string_makes_the_body_rules_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = body::parse(&bytes);
    }

    #[test]
    fn every_refusal_names_its_field(document in prop::collection::btree_map(
        prop_oneof![Just("run_id".to_owned()), Just("approved_inputs".to_owned()), Just("content".to_owned()), "[a-z]{1,4}"],
        json_value(),
        0..5,
    )) {
        let text = Value::Object(document.into_iter().collect()).to_string();
        match body::parse(text.as_bytes()) {
            Ok(submission) => prop_assert!(!submission.run_id.as_str().trim().is_empty()),
            Err(BodyError::Invalid(errors)) => {
                prop_assert!(!errors.is_empty());
                for error in errors {
                    prop_assert!(!error.field.is_empty(), "unnamed field: {:?}", error);
                    prop_assert!(!error.message.is_empty());
                }
            }
            Err(BodyError::Malformed(m)) => prop_assert!(false, "valid JSON called malformed: {}", m),
        }
    }
}

/// Fractions a double holds exactly, written as a literal's tail.
const EXACT_FRACTIONS: [&str; 8] = ["", ".5", ".25", ".75", ".125", ".375", ".625", ".875"];

/// A decimal literal's exact value, worked out independently of the body rules:
/// digits without leading or trailing zeros and the power of ten of the last.
fn exact(text: &str) -> (bool, String, i64) {
    let negative = text.starts_with('-');
    let text = text.trim_start_matches('-');
    let (mantissa, exp) = match text.split_once(['e', 'E']) {
        Some((m, e)) => (m, e.parse::<i64>().unwrap_or(0)),
        None => (text, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let mut digits = format!("{int}{frac}");
    let mut power = exp - frac.len() as i64;
    while digits.ends_with('0') {
        digits.pop();
        power += 1;
    }
    let digits = digits.trim_start_matches('0').to_owned();
    if digits.is_empty() {
        (false, digits, 0)
    } else {
        (negative, digits, power)
    }
}

proptest! {
    /// For any number literal: the body rules refuse it, or what is kept (the
    /// canonical content that is stored and hashed) has exactly its value.
    #[test]
    fn accepted_numbers_are_stored_with_exactly_the_value_sent(
        negative in any::<bool>(),
        int in "[0-9]{1,22}",
        frac in proptest::option::of("[0-9]{1,22}"),
        exp in proptest::option::of(-330i32..330),
    ) {
        let mut literal = String::new();
        if negative { literal.push('-'); }
        let int = int.trim_start_matches('0');
        literal.push_str(if int.is_empty() { "0" } else { int });
        if let Some(frac) = &frac { literal.push('.'); literal.push_str(frac); }
        if let Some(exp) = exp { literal.push_str(&format!("e{exp}")); }
        let body = format!(r#"{{"run_id":"r","approved_inputs":[{{"id":"i"}}],"content":{{"n":{literal}}}}}"#);
        match body::parse(body.as_bytes()) {
            Ok(submission) => {
                let parts = hashing::canonicalize(&submission);
                let stored: Value = serde_json::from_str(parts.content).expect("stored JSON");
                let kept = stored["n"].to_string();
                prop_assert_eq!(exact(&kept), exact(&literal), "sent {} kept {}", literal, kept);
            }
            Err(BodyError::Invalid(errors)) => {
                prop_assert_eq!(errors[0].field.as_str(), "content.n");
            }
            Err(other) => prop_assert!(false, "{literal}: {other:?}"),
        }
    }

    /// Exponents anywhere up to ±2^63 and past it: zero stays zero, any
    /// other value beyond a double's range is refused, and nothing panics
    /// (the arithmetic is checked in every build).
    #[test]
    fn extreme_exponents_keep_zero_and_refuse_the_rest(
        negative in any::<bool>(),
        int in "[0-9]{1,5}",
        frac in proptest::option::of("[0-9]{1,5}"),
        exp in prop_oneof![
            any::<i64>().prop_map(|e| e.to_string()),
            Just(i64::MIN.to_string()),
            Just(format!("+{}", i64::MAX)),
            "[+-]?[0-9]{19,40}",
        ],
    ) {
        let mut literal = String::new();
        if negative { literal.push('-'); }
        literal.push_str(&int);
        if let Some(frac) = &frac { literal.push('.'); literal.push_str(frac); }
        literal.push('e');
        literal.push_str(&exp);
        let zero = int.bytes().chain(frac.iter().flat_map(|f| f.bytes())).all(|b| b == b'0');
        let magnitude_at_least_400 = exp
            .trim_start_matches(['+', '-'])
            .parse::<u128>()
            .map_or(true, |e| e >= 400);
        // A leading zero before other digits is not JSON: only `0` itself.
        prop_assume!(int == "0" || !int.starts_with('0'));
        let body = format!(r#"{{"run_id":"r","approved_inputs":[{{"id":"i"}}],"content":{{"n":{literal}}}}}"#);
        let parsed = body::parse(body.as_bytes());
        if zero {
            let submission = parsed.map_err(|e| TestCaseError::fail(format!("{literal}: {e:?}")))?;
            let parts = hashing::canonicalize(&submission);
            prop_assert_eq!(parts.content, r#"{"n":0}"#);
        } else if magnitude_at_least_400 {
            prop_assert!(
                matches!(&parsed, Err(BodyError::Invalid(errors)) if errors[0].field == "content.n"),
                "{} was not refused: {:?}", literal, parsed
            );
        }
    }

    /// Two bodies that differ only in one number are never the same plan.
    #[test]
    fn bodies_differing_in_a_number_never_hash_alike(
        a_int in 0u64..(1 << 40),
        a_frac in prop::sample::select(EXACT_FRACTIONS.to_vec()),
        b_int in 0u64..(1 << 40),
        b_frac in prop::sample::select(EXACT_FRACTIONS.to_vec()),
    ) {
        // Numbers every double holds exactly (below 2^40, eighths), so both
        // bodies must be accepted: a refusal fails the test.
        let (a, b) = (format!("{a_int}{a_frac}"), format!("{b_int}{b_frac}"));
        prop_assume!((a_int, a_frac) != (b_int, b_frac));
        let body = |n: &str| format!(r#"{{"run_id":"r","approved_inputs":[{{"id":"i"}}],"content":{{"n":{n}}}}}"#);
        let accepted = |n: &str| {
            body::parse(body(n).as_bytes()).unwrap_or_else(|e| panic!("{n} was refused: {e:?}"))
        };
        let (x, y) = (accepted(&a), accepted(&b));
        let (x, y) = (hashing::canonicalize(&x), hashing::canonicalize(&y));
        prop_assert_ne!(x.hashes.content_hash, y.hashes.content_hash);
    }
}

/// The number rule against an oracle that shares none of its code:
/// `tests/fixtures/number_cases.json`, written by Python's `decimal` and
/// `repr(float)` laid out as ECMAScript does (`number_cases.py`). Each
/// literal is kept or refused as the oracle says, and a kept one is stored
/// as exactly the oracle's RFC 8785 text.
#[test]
fn numbers_are_kept_or_refused_as_an_independent_oracle_says() {
    #[derive(serde::Deserialize)]
    struct Case {
        literal: String,
        kept: bool,
        canonical: Option<String>,
    }
    let cases: Vec<Case> =
        serde_json::from_str(include_str!("../../tests/fixtures/number_cases.json"))
            .expect("the fixture");
    assert!(cases.len() > 1000 && cases.iter().filter(|c| c.kept).count() > 500);
    let mut wrong = Vec::new();
    for case in &cases {
        let body = format!(
            r#"{{"run_id":"r","approved_inputs":[{{"id":"i"}}],"content":{{"n":{}}}}}"#,
            case.literal
        );
        let stored = body::parse(body.as_bytes())
            .ok()
            .map(|submission| hashing::canonicalize(&submission).content.to_owned());
        let expected = case
            .canonical
            .as_ref()
            .map(|text| format!(r#"{{"n":{text}}}"#));
        match (case.kept, &stored) {
            (true, Some(content)) if Some(content) == expected.as_ref() => {}
            (false, None) => {}
            _ => wrong.push(format!(
                "{}: oracle {:?}, service {stored:?}",
                case.literal, expected
            )),
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} cases differ:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
}

/// Pieces that, spliced in anywhere, break a body in each way the rules
/// tell apart: syntax, duplicates (also in objects past the small-object
/// scan), inexact numbers, surrogates, wrong types, member order.
const SPLICES: &[&str] = &[
    "\"",
    ",",
    "{",
    "}",
    "[",
    "]",
    ":",
    "\\",
    "-",
    "0",
    ".",
    "01",
    " ",
    "null",
    "1e400",
    "9007199254740993",
    "1.50",
    "-0",
    "1E2",
    "\"\\ud800\"",
    "\"\\u00e9\\n\"",
    "\u{e000}",
    "\u{1f600}",
    "\"a\":1,",
    "\"aa\":0,",
    "\"b\":[],",
    "\"x\":{\"y\":1,\"y\":2},",
    "\"content\":5,",
    "\"content\":[1],",
    "\"content\":{},",
    "\"run_id\":1e2,",
    "\"approved_inputs\":{},",
    "\"extra\":{\"deep\":[[[1.25]]]},",
];

/// `text` with each edit applied: (what, where, which piece): insert a
/// piece, delete a few characters, or cut the rest off.
fn edited(text: &str, edits: &[(u8, prop::sample::Index, prop::sample::Index)]) -> String {
    let mut text = text.to_owned();
    for (what, place, piece) in edits {
        let mut at = place.index(text.len() + 1);
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        match what % 3 {
            0 => text.insert_str(at, SPLICES[piece.index(SPLICES.len())]),
            1 => {
                let mut end = (at + 1 + piece.index(3)).min(text.len());
                while !text.is_char_boundary(end) {
                    end += 1;
                }
                text.replace_range(at..end, "");
            }
            _ => text.truncate(at),
        }
    }
    text
}

/// Any top-level document: the three fields (any value) and others, an
/// object of up to 40 members in the content so that duplicates are also
/// found past the short scan.
fn any_document() -> impl Strategy<Value = Value> {
    let content = prop_oneof![
        json_object().prop_map(Value::Object),
        prop::collection::btree_map("[a-c]{1,3}", json_value(), 0..40)
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        json_value(),
    ];
    (
        content,
        prop::collection::btree_map("[a-z]{1,4}", json_value(), 0..3),
        any::<bool>(),
    )
        .prop_map(|(content, extra, valid_fields)| {
            let mut body = if valid_fields {
                submission_body(&Map::new())
            } else {
                json!({"run_id": 7, "approved_inputs": "x"})
            };
            body["content"] = content;
            for (name, value) in extra {
                body[name] = value;
            }
            body
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    /// The one-pass parse (content canonicalized as it is read, no tree)
    /// answers every body exactly as the tree and the crate did: the same
    /// submission and stored text, or the same refusal, word for word.
    #[test]
    fn the_one_pass_parse_answers_as_the_tree_did(
        document in any_document(),
        seed in any::<u64>(),
        edits in prop::collection::vec((any::<u8>(), any::<prop::sample::Index>(), any::<prop::sample::Index>()), 0..3),
    ) {
        let mut rng = TestRng::from_seed(proptest::test_runner::RngAlgorithm::ChaCha, &seed.to_le_bytes().repeat(4));
        let mut text = String::new();
        render_shuffled(&document, &mut rng, &mut text);
        let text = edited(&text, &edits);
        prop_assert_eq!(body::parse(text.as_bytes()), body::parse_with_a_tree(text.as_bytes()), "{}", text);
    }
}

#[test]
fn the_one_pass_parse_orders_and_refuses_as_the_tree_did() {
    let nested = |depth: usize| format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
    let many = |n: usize, repeat: Option<usize>| {
        let mut members: Vec<String> = (0..n).map(|i| format!("\"m{}\":{i}", n - i)).collect();
        if let Some(i) = repeat {
            members.push(format!("\"m{}\":0", n - i));
        }
        format!("{{{}}}", members.join(","))
    };
    let contents = [
        // RFC 8785 sorts by UTF-16 code units: U+E000 after U+1F600's surrogates.
        "{\"\u{e000}\":1,\"\u{1f600}\":2,\"z\":3,\"\u{7f}\":4,\"\":5}".to_owned(),
        r#"{"b":{"d":1,"c":[{"f":1,"e":2}]},"a":"\"\\\/\b\f\n\r\t\u0001\u001f\u007f"}"#.to_owned(),
        format!(r#"{{"deep":{}}}"#, nested(62)),
        format!(r#"{{"deep":{}}}"#, nested(63)),
        format!(r#"{{"deep":{{"x":{}}}}}"#, nested(62)),
        many(200, None),
        many(200, Some(3)),
        many(200, Some(150)),
        many(17, Some(16)),
        r#"{"n":[1.0,1e2,-0,0.000,1E-7,123456789012345678,5e-324,1e21,1e-7]}"#.to_owned(),
    ];
    for content in contents {
        let text =
            format!(r#"{{"run_id":"r","approved_inputs":[{{"id":"i"}}],"content":{content}}}"#);
        let one_pass = body::parse(text.as_bytes());
        assert_eq!(
            one_pass,
            body::parse_with_a_tree(text.as_bytes()),
            "{content}"
        );
        if let Ok(submission) = one_pass {
            let value: Value = serde_json::from_str(&submission.content).expect("stored JSON");
            assert_eq!(
                submission.content,
                serde_json_canonicalizer::to_string(&value).expect("canonical")
            );
        }
    }
}

proptest! {
    /// The small parts written by hand are what the crate makes of them:
    /// any text (controls, quotes, astral characters) and any inputs.
    #[test]
    fn small_parts_are_written_as_the_crate_writes_them(
        text in any::<String>(),
        inputs in prop::collection::vec((any::<String>(), proptest::option::of(any::<String>())), 0..4),
    ) {
        let mut written = String::new();
        super::ijson::write_string(&mut written, &text);
        prop_assert_eq!(written, serde_json_canonicalizer::to_string(&Value::from(text.as_str())).expect("canonical"));
        let inputs: Vec<body::ApprovedInput> = inputs
            .into_iter()
            .map(|(id, digest)| body::ApprovedInput { id, digest })
            .collect();
        let as_value = serde_json::to_value(&inputs).expect("inputs as a value");
        prop_assert_eq!(hashing::canonical_inputs(&inputs), serde_json_canonicalizer::to_string(&as_value).expect("canonical"));
    }
}
