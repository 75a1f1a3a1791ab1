//! The `Idempotency-Key` header: bare, or an RFC 8941 string (`"KEY"` with
//! `\"` and `\\` escapes). Both forms of the same text are the same key.

pub const MAX_KEY_CHARS: usize = 255;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    pub fn parse(header: &str) -> Result<Self, String> {
        let text = match header.strip_prefix('"') {
            Some(quoted) => unquote(quoted)?,
            None => header.to_owned(),
        };
        if text.is_empty() {
            return Err("Idempotency-Key must not be empty".to_owned());
        }
        if text.len() > MAX_KEY_CHARS {
            return Err(format!(
                "Idempotency-Key must be at most {MAX_KEY_CHARS} characters"
            ));
        }
        if !text.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            return Err(
                "Idempotency-Key may hold only visible ASCII characters (0x21-0x7E)".to_owned(),
            );
        }
        Ok(Self(text))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The inside of an RFC 8941 sf-string, after its opening quote.
fn unquote(rest: &str) -> Result<String, String> {
    let malformed = || "Idempotency-Key is not a valid RFC 8941 string".to_owned();
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(escaped @ ('"' | '\\')) => out.push(escaped),
                _ => return Err(malformed()),
            },
            '"' => {
                return if chars.as_str().is_empty() {
                    Ok(out)
                } else {
                    Err(malformed())
                };
            }
            c => out.push(c),
        }
    }
    Err(malformed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_and_quoted_forms_are_one_key() {
        let bare = IdempotencyKey::parse("abc-123").expect("bare");
        assert_eq!(IdempotencyKey::parse("\"abc-123\"").expect("quoted"), bare);
        assert_eq!(
            IdempotencyKey::parse(r#""a\"b\\c""#)
                .expect("escaped")
                .as_str(),
            r#"a"b\c"#
        );
    }

    #[test]
    fn refuses_malformed_keys() {
        for bad in [
            "",
            "\"\"",
            "has space",
            "\"open",
            "\"a\"b\"",
            r#""bad\x""#,
            "é",
        ] {
            assert!(
                IdempotencyKey::parse(bad).is_err(),
                "{bad:?} should be refused"
            );
        }
        assert!(IdempotencyKey::parse(&"k".repeat(255)).is_ok());
        assert!(IdempotencyKey::parse(&"k".repeat(256)).is_err());
    }
}
