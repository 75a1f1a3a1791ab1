//! Parses a body as I-JSON (RFC 7493), which RFC 8785 canonicalization needs:
//! no duplicate member names, no lone surrogates, and integers no larger than
//! an IEEE 754 double holds exactly.

use std::fmt;

use serde::de::{self, Deserialize, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// The largest integer every double represents exactly (2^53).
const MAX_EXACT_INTEGER: u64 = 1 << 53;
/// Deepest nesting of arrays and objects accepted (serde_json's own limit,
/// 128, would answer a less precise syntax error).
pub const MAX_DEPTH: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonError {
    /// Not JSON at all: a 400.
    Syntax(String),
    /// JSON, but not I-JSON: a 422.
    NotIJson(String),
}

pub fn parse(bytes: &[u8]) -> Result<Value, JsonError> {
    match serde_json::from_slice::<StrictValue>(bytes) {
        Ok(StrictValue(value)) => Ok(value),
        Err(e) if e.classify() == serde_json::error::Category::Data => {
            Err(JsonError::NotIJson(e.to_string()))
        }
        // serde_json refuses a lone surrogate while parsing, with one of these
        // two messages ("unexpected end of hex escape" arises only after a
        // leading surrogate); I-JSON is what forbids it, so it is a 422.
        Err(e)
            if e.to_string().contains("surrogate")
                || e.to_string().contains("unexpected end of hex escape") =>
        {
            Err(JsonError::NotIJson(e.to_string()))
        }
        Err(e) => Err(JsonError::Syntax(e.to_string())),
    }
}

struct StrictValue(Value);

impl<'de> Deserialize<'de> for StrictValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        StrictVisitor { depth: 0 }
            .deserialize(deserializer)
            .map(StrictValue)
    }
}

/// Builds a `Value`, refusing what I-JSON forbids; `depth` counts the
/// arrays and objects around the value being read.
#[derive(Clone, Copy)]
struct StrictVisitor {
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for StrictVisitor {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl StrictVisitor {
    fn nested<E: de::Error>(self) -> Result<Self, E> {
        if self.depth >= MAX_DEPTH {
            return Err(E::custom(format!(
                "arrays and objects nest deeper than {MAX_DEPTH} levels"
            )));
        }
        Ok(Self {
            depth: self.depth + 1,
        })
    }
}

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an I-JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        if v.unsigned_abs() > MAX_EXACT_INTEGER {
            return Err(inexact(v));
        }
        Ok(Value::from(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        if v > MAX_EXACT_INTEGER {
            return Err(inexact(v));
        }
        Ok(Value::from(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        serde_json::Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom(format!("number {v} is not finite")))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let inner = self.nested()?;
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(item) = seq.next_element_seed(inner)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Value, A::Error> {
        let inner = self.nested()?;
        let mut map = Map::new();
        while let Some(key) = access.next_key::<String>()? {
            if map.contains_key(&key) {
                return Err(de::Error::custom(format!("duplicate member name `{key}`")));
            }
            let value = access.next_value_seed(inner)?;
            map.insert(key, value);
        }
        Ok(Value::Object(map))
    }
}

fn inexact<E: de::Error>(v: impl fmt::Display) -> E {
    E::custom(format!(
        "number {v} is not exactly representable as an IEEE 754 double"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_duplicate_members_at_any_depth() {
        assert!(matches!(
            parse(br#"{"a":1,"a":2}"#),
            Err(JsonError::NotIJson(_))
        ));
        assert!(matches!(
            parse(br#"{"x":{"b":1,"b":1}}"#),
            Err(JsonError::NotIJson(_))
        ));
    }

    #[test]
    fn refuses_lone_surrogates_and_inexact_integers() {
        assert!(matches!(
            parse(br#"{"a":"\ud800"}"#),
            Err(JsonError::NotIJson(_))
        ));
        assert!(matches!(
            parse(b"9007199254740993"),
            Err(JsonError::NotIJson(_))
        ));
        assert!(matches!(
            parse(b"-9007199254740993"),
            Err(JsonError::NotIJson(_))
        ));
        assert_eq!(
            parse(b"9007199254740992"),
            Ok(Value::from(9007199254740992u64))
        );
    }

    #[test]
    fn syntax_errors_are_not_ijson_errors() {
        assert!(matches!(parse(b"{\"a\":"), Err(JsonError::Syntax(_))));
        assert!(matches!(parse(b"not json"), Err(JsonError::Syntax(_))));
        assert!(matches!(parse(b"{} {}"), Err(JsonError::Syntax(_))));
    }

    #[test]
    fn refuses_nesting_past_the_limit() {
        let nested = |depth: usize| format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        assert!(parse(nested(MAX_DEPTH).as_bytes()).is_ok());
        assert!(matches!(
            parse(nested(MAX_DEPTH + 1).as_bytes()),
            Err(JsonError::NotIJson(_))
        ));
        assert!(parse(nested(100_000).as_bytes()).is_err());
    }

    #[test]
    fn keeps_a_valid_document() {
        assert_eq!(
            parse(br#" {"b": [1, 2.5, "x", null, true], "a": {}} "#),
            Ok(serde_json::json!({"a": {}, "b": [1, 2.5, "x", null, true]}))
        );
    }
}
