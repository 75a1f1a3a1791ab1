//! Parses a body as I-JSON (RFC 7493), which RFC 8785 canonicalization needs:
//! no duplicate member names, no lone surrogates, and numbers kept exactly.
//!
//! serde_json reads the structure; each number's text, exactly as sent, is
//! read beside it from the body ([`NumberTexts`]; an integer below 2^53,
//! whose value says its text, is written from its value), so no serde_json feature
//! is needed (and none is forced on a program that links this crate: its
//! `arbitrary_precision` would change how that program's own `untagged` and
//! `flatten` types read numbers). A number is accepted only when its RFC 8785 canonical
//! form (the shortest text that round-trips its IEEE 754 double) has exactly
//! the value written: `1.0`, `1e2`, `0.5`, `-0.0`, `123.456` yes;
//! `18446744073709551617`, `9007199254740993.0`, `0.10000000000000000555`,
//! `1e400` no. So what is stored is never a rounded version of what was sent,
//! and two bodies that differ in any number never hash alike.
//!
#![doc = include_str!("../README.md")]

use std::borrow::Cow;
use std::cmp::Ordering;
use std::collections::HashSet;
use std::fmt;
use std::ops::Range;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// Deepest nesting of arrays and objects accepted (serde_json's own limit,
/// 128, would answer a less precise syntax error).
pub const MAX_DEPTH: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonError {
    /// Not JSON at all: a 400.
    Syntax(String),
    /// JSON, but not I-JSON: a 422 naming the offending value's path
    /// (`content.lines[1].qty`; empty for the whole body).
    NotIJson { path: String, message: String },
}

/// The whole body as a `Value` tree (for small documents and tests; a plan
/// goes through [`parse_members`], which builds no tree of its content).
pub fn parse(bytes: &[u8]) -> Result<Value, JsonError> {
    checked(bytes, WholeValue)
}

/// A body checked as I-JSON in one pass, when it is an object: the members
/// named in `kept` come back as values; the member named `canonical`, when
/// it is an object, as its RFC 8785 text (built as it is read, no tree),
/// otherwise as a value like the kept ones; every other member is checked
/// and dropped.
#[derive(Debug, PartialEq)]
pub enum Members {
    Object {
        kept: Map<String, Value>,
        canonical: Option<String>,
    },
    /// I-JSON, but not an object.
    NotObject,
}

pub fn parse_members(bytes: &[u8], kept: &[&str], canonical: &str) -> Result<Members, JsonError> {
    checked(
        bytes,
        SomeMembers {
            kept,
            canonical,
            capacity: bytes.len(),
        },
    )
}

/// What [`checked`] reads a body as, whatever serde_json reads it from.
trait Reading {
    type Output;

    fn read<'de, R: serde_json::de::Read<'de>>(
        self,
        strict: StrictVisitor<'_>,
        deserializer: &mut serde_json::Deserializer<R>,
    ) -> Result<Self::Output, serde_json::Error>;
}

/// [`parse`]'s reading: the whole body as a tree.
struct WholeValue;

impl Reading for WholeValue {
    type Output = Value;

    fn read<'de, R: serde_json::de::Read<'de>>(
        self,
        strict: StrictVisitor<'_>,
        deserializer: &mut serde_json::Deserializer<R>,
    ) -> Result<Value, serde_json::Error> {
        strict.deserialize(deserializer)
    }
}

/// [`parse_members`]'s reading.
struct SomeMembers<'k> {
    kept: &'k [&'k str],
    canonical: &'k str,
    /// The body's size: room for the canonical member's text, which is
    /// rarely longer than the body.
    capacity: usize,
}

impl Reading for SomeMembers<'_> {
    type Output = Members;

    fn read<'de, R: serde_json::de::Read<'de>>(
        self,
        strict: StrictVisitor<'_>,
        deserializer: &mut serde_json::Deserializer<R>,
    ) -> Result<Members, serde_json::Error> {
        use serde::Deserializer as _;
        deserializer.deserialize_any(RootVisitor {
            strict,
            kept: self.kept,
            canonical: self.canonical,
            capacity: self.capacity,
        })
    }
}

/// Runs `reading` over the whole of `bytes` and sorts its failure into
/// syntax (400) or not I-JSON (422, with the path a refusal recorded).
fn checked<T: Reading>(bytes: &[u8], reading: T) -> Result<T::Output, JsonError> {
    let refusal: std::cell::RefCell<Option<(String, String)>> = Default::default();
    let failed_at: std::cell::RefCell<Option<String>> = Default::default();
    // A body that is UTF-8 throughout (every valid one) is checked so once,
    // not string by string; one that is not is read as bytes, so that its
    // error is serde_json's, where it stops.
    let text = std::str::from_utf8(bytes).ok();
    let numbers = NumberTexts::new(bytes, text);
    let strict = StrictVisitor {
        depth: 0,
        at: None,
        refusal: &refusal,
        failed_at: &failed_at,
        numbers: &numbers,
    };
    let parsed = match text {
        Some(text) => {
            let mut deserializer = serde_json::Deserializer::from_str(text);
            reading
                .read(strict, &mut deserializer)
                .and_then(|value| deserializer.end().map(|()| value))
        }
        None => {
            let mut deserializer = serde_json::Deserializer::from_slice(bytes);
            reading
                .read(strict, &mut deserializer)
                .and_then(|value| deserializer.end().map(|()| value))
        }
    };
    match parsed {
        Ok(value) => Ok(value),
        Err(e) if e.classify() == serde_json::error::Category::Data => {
            let (path, message) = refusal
                .take()
                .unwrap_or_else(|| (String::new(), e.to_string()));
            Err(JsonError::NotIJson { path, message })
        }
        // serde_json refuses a lone surrogate, and a number too large for a
        // double, as syntax errors; but both are JSON, and what I-JSON
        // forbids is their value: a 422. Told apart by what stands in the
        // body where serde_json stopped, never by the words of its message.
        Err(e) if e.classify() == serde_json::error::Category::Syntax => {
            match stopped_at(bytes, e.line(), e.column()) {
                Some(Stop::Surrogate) => Err(JsonError::NotIJson {
                    path: failed_at.take().unwrap_or_default(),
                    message: "a lone surrogate in a \\u escape".to_owned(),
                }),
                Some(Stop::Number) => Err(JsonError::NotIJson {
                    path: failed_at.take().unwrap_or_default(),
                    message: "a number is not exactly representable as an IEEE 754 double"
                        .to_owned(),
                }),
                None => Err(JsonError::Syntax(e.to_string())),
            }
        }
        Err(e) => Err(JsonError::Syntax(e.to_string())),
    }
}

/// What a syntax error stopped at, where it is I-JSON's concern.
#[derive(Debug, PartialEq, Eq)]
enum Stop {
    /// Just after a `\\uD800`–`\\uDFFF` escape.
    Surrogate,
    /// Inside or just after a number.
    Number,
}

/// What stands in `bytes` just before serde_json's error position (1-based
/// `line`, and `column` in bytes): a surrogate escape among the last few
/// bytes, or a number's last character.
fn stopped_at(bytes: &[u8], line: usize, column: usize) -> Option<Stop> {
    let line_start = if line <= 1 {
        0
    } else {
        bytes
            .iter()
            .enumerate()
            .filter(|(_, b)| **b == b'\n')
            .nth(line - 2)
            .map(|(at, _)| at + 1)?
    };
    let end = (line_start + column).min(bytes.len());
    let window = &bytes[end.saturating_sub(14)..end];
    let surrogate = window.windows(6).any(|escape| {
        escape[0] == b'\\'
            && escape[1] == b'u'
            && std::str::from_utf8(&escape[2..])
                .ok()
                .and_then(|hex| u16::from_str_radix(hex, 16).ok())
                .is_some_and(|unit| (0xD800..=0xDFFF).contains(&unit))
    });
    if surrogate {
        return Some(Stop::Surrogate);
    }
    let start = bytes[..end]
        .iter()
        .rposition(|b| !in_number(b))
        .map_or(0, |at| at + 1);
    let token = std::str::from_utf8(&bytes[start..end]).ok()?;
    is_json_number(token).then_some(Stop::Number)
}

/// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`: a well-formed number.
fn is_json_number(token: &str) -> bool {
    fn digits(text: &str) -> usize {
        text.bytes().take_while(u8::is_ascii_digit).count()
    }
    let rest = token.strip_prefix('-').unwrap_or(token);
    let whole = digits(rest);
    if whole == 0 || (whole > 1 && rest.starts_with('0')) {
        return false;
    }
    let mut rest = &rest[whole..];
    if let Some(fraction) = rest.strip_prefix('.') {
        let n = digits(fraction);
        if n == 0 {
            return false;
        }
        rest = &fraction[n..];
    }
    if let Some(exponent) = rest.strip_prefix(['e', 'E']) {
        let exponent = exponent.strip_prefix(['+', '-']).unwrap_or(exponent);
        let n = digits(exponent);
        if n == 0 {
            return false;
        }
        rest = &exponent[n..];
    }
    rest.is_empty()
}

/// Each number's text as it stands in the body, in the order serde_json
/// reads them: a scan that skips strings and stops at the next number
/// token. serde_json visits every value of the body in document order and
/// the readers here visit all of them, so the n-th number visited is the
/// n-th number token outside a string.
struct NumberTexts<'b> {
    bytes: &'b [u8],
    /// The same bytes, when they are UTF-8 throughout.
    text: Option<&'b str>,
    next: std::cell::Cell<usize>,
    /// Number tokens passed over since `next`, not yet scanned.
    skipped: std::cell::Cell<usize>,
}

impl<'b> NumberTexts<'b> {
    fn new(bytes: &'b [u8], text: Option<&'b str>) -> Self {
        Self {
            bytes,
            text,
            next: std::cell::Cell::new(0),
            skipped: std::cell::Cell::new(0),
        }
    }

    /// The text of the next number token, past the one returned before
    /// and those skipped since.
    fn next_text(&self) -> Option<&'b str> {
        for _ in 0..self.skipped.replace(0) {
            self.next_token()?;
        }
        let token = self.next_token()?;
        match self.text {
            Some(text) => text.get(token),
            None => std::str::from_utf8(&self.bytes[token]).ok(),
        }
    }

    /// Passes over the next number token without reading its text (an
    /// integer whose value says its text): the scan is made only when a
    /// later number's text is asked for, and not at all when none is.
    fn skip(&self) {
        self.skipped.set(self.skipped.get() + 1);
    }

    /// Where the next number token stands.
    fn next_token(&self) -> Option<Range<usize>> {
        let bytes = self.bytes;
        let mut at = self.next.get();
        while let Some(&byte) = bytes.get(at) {
            match byte {
                b'"' => {
                    at += 1;
                    while let Some(&inside) = bytes.get(at) {
                        at += match inside {
                            b'\\' => 2,
                            b'"' => 1,
                            _ => {
                                at += 1;
                                continue;
                            }
                        };
                        if inside == b'"' {
                            break;
                        }
                    }
                }
                b'-' | b'0'..=b'9' => {
                    let start = at;
                    at = number_end(bytes, at);
                    self.next.set(at);
                    return Some(start..at);
                }
                _ => at += 1,
            }
        }
        self.next.set(at);
        None
    }
}

/// Where the number token starting at `at` ends, by JSON's grammar
/// (`-?digits(.digits)?([eE][+-]?digits)?`), as serde_json reads it: what
/// follows (`5-1`'s `-1`) is not the number's, and serde_json refuses it
/// as a syntax error, whether the number was skipped or read.
fn number_end(bytes: &[u8], mut at: usize) -> usize {
    let digits = |mut at: usize| {
        while bytes.get(at).is_some_and(u8::is_ascii_digit) {
            at += 1;
        }
        at
    };
    if bytes.get(at) == Some(&b'-') {
        at += 1;
    }
    at = digits(at);
    if bytes.get(at) == Some(&b'.') {
        at = digits(at + 1);
    }
    if matches!(bytes.get(at), Some(b'e' | b'E')) {
        at += 1;
        if matches!(bytes.get(at), Some(b'+' | b'-')) {
            at += 1;
        }
        at = digits(at);
    }
    at
}

/// A byte that may stand inside a JSON number.
fn in_number(byte: &u8) -> bool {
    byte.is_ascii_digit() || matches!(byte, b'.' | b'e' | b'E' | b'+' | b'-')
}

/// One step of the path from the root to the value being read.
enum Step<'a> {
    Member(&'a str),
    Index(usize),
}

/// The path to a value, as a chain of steps back to the root.
struct At<'a> {
    parent: Option<&'a At<'a>>,
    step: Step<'a>,
}

/// `content.lines[1].qty`
fn render(at: Option<&At<'_>>) -> String {
    let mut steps = Vec::new();
    let mut cursor = at;
    while let Some(node) = cursor {
        steps.push(&node.step);
        cursor = node.parent;
    }
    let mut path = String::new();
    for step in steps.into_iter().rev() {
        match step {
            Step::Member(name) => {
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(name);
            }
            Step::Index(i) => path.push_str(&format!("[{i}]")),
        }
    }
    path
}

/// Builds a `Value`, refusing what I-JSON forbids; `depth` counts the
/// arrays and objects around the value being read, `at` is its path, and a
/// refusal records that path for the answer.
#[derive(Clone, Copy)]
struct StrictVisitor<'a> {
    depth: usize,
    at: Option<&'a At<'a>>,
    refusal: &'a std::cell::RefCell<Option<(String, String)>>,
    /// The path of the innermost value serde_json failed to read (a number
    /// beyond any double, a lone surrogate), recorded on the way out.
    failed_at: &'a std::cell::RefCell<Option<String>>,
    numbers: &'a NumberTexts<'a>,
}

impl<'de> DeserializeSeed<'de> for StrictVisitor<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'a> StrictVisitor<'a> {
    fn nested<E: de::Error>(self) -> Result<Self, E> {
        if self.depth >= MAX_DEPTH {
            return Err(self.refuse(format!(
                "arrays and objects nest deeper than {MAX_DEPTH} levels"
            )));
        }
        Ok(Self {
            depth: self.depth + 1,
            ..self
        })
    }

    fn at(self, at: &'a At<'a>) -> Self {
        Self {
            at: Some(at),
            ..self
        }
    }

    fn refuse<E: de::Error>(self, message: String) -> E {
        self.refusal
            .replace(Some((render(self.at), message.clone())));
        E::custom(message)
    }

    /// Records, once, that reading the value at this path failed: the
    /// innermost container sees the failure first.
    fn failed<E>(self, error: E) -> E {
        let mut failed_at = self.failed_at.borrow_mut();
        if failed_at.is_none() {
            *failed_at = Some(render(self.at));
        }
        error
    }

    /// The text of the number serde_json has just read.
    fn number_text<E: de::Error>(self) -> Result<&'a str, E> {
        self.numbers
            .next_text()
            .ok_or_else(|| self.refuse("a number whose text was not found".to_owned()))
    }

    /// The number just read, as sent, kept only if canonicalization keeps
    /// its value.
    fn number<E: de::Error>(self) -> Result<Value, E> {
        let text = self.number_text()?;
        Ok(match self.exact(text)? {
            Exact::Small(exact) => Value::Number(exact.into()),
            Exact::Checked { number, .. } => Value::Number(number),
        })
    }

    /// `text`, refused unless its RFC 8785 form has exactly its value.
    fn exact<E: de::Error>(self, text: &str) -> Result<Exact, E> {
        // Most numbers are small integers, exact in any double: no need to
        // round-trip them (the check below costs a parse and a format).
        if let Some(exact) = small_integer(text) {
            return Ok(Exact::Small(exact));
        }
        let refused = || {
            self.refuse(format!(
                "number {text} is not exactly representable as an IEEE 754 double"
            ))
        };
        let number = exact_double(text).ok_or_else(refused)?;
        let canonical = serde_json_canonicalizer::to_string(&number).map_err(|_| refused())?;
        if same_decimal(text, &canonical) {
            Ok(Exact::Checked { number, canonical })
        } else {
            Err(refused())
        }
    }
}

/// A number that passed the exactness check.
enum Exact {
    /// A plain integer below 2^53: its text is its RFC 8785 form.
    Small(i64),
    /// Any other: the number as sent, and its RFC 8785 form.
    Checked {
        number: serde_json::Number,
        canonical: String,
    },
}

/// `text` (a well-formed JSON number) as a `Number`: an integer that fits
/// 64 bits as one, any other as the double nearest its value (Rust's
/// parse rounds correctly; whether that double is exactly the value
/// written is checked by the caller). `None` beyond a double's range.
fn exact_double(text: &str) -> Option<serde_json::Number> {
    if !text.contains(['.', 'e', 'E']) {
        if let Ok(integer) = text.parse::<i64>() {
            if text != "-0" {
                return Some(integer.into());
            }
        } else if let Ok(integer) = text.parse::<u64>() {
            return Some(integer.into());
        }
    }
    serde_json::Number::from_f64(text.parse::<f64>().ok()?)
}

/// An integer serde_json read as one (`visit_u64`, `visit_i64`: written
/// as digits with a sign only if negative, no fraction, exponent or
/// leading zero, and never `-0`), when it is below 2^53 in magnitude: then
/// it is exactly a double, and its RFC 8785 form is its decimal digits,
/// exactly as written.
fn exact_integer(value: i64) -> Option<i64> {
    const EXACT: i64 = 1 << 53;
    (-EXACT < value && value < EXACT).then_some(value)
}

/// An integer written without sign tricks, fraction or exponent, and with
/// at most 15 digits: below 2^53, so exactly a double. (`-0` is left to the
/// full check, which keeps it as written.)
fn small_integer(text: &str) -> Option<i64> {
    let digits = text.strip_prefix('-').unwrap_or(text);
    let plain = !digits.is_empty()
        && digits.len() <= 15
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'))
        && text != "-0";
    if plain { text.parse().ok() } else { None }
}

/// A decimal number's value as (negative, significant digits, exponent of
/// the last digit), with zero written one way: `1.50e1` and `15` alike, and
/// zero alike whatever its exponent (`0e99999999999999999999` is 0). The
/// exponent is exact, however it was written: `None` only for a non-zero
/// number whose exponent is beyond any double's (refused by the caller).
fn decimal(text: &str) -> Option<(bool, String, i128)> {
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(at) => (&unsigned[..at], Some(&unsigned[at + 1..])),
        None => (unsigned, None),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits: String = whole.chars().chain(fraction.chars()).collect();
    let trimmed_end = digits.trim_end_matches('0');
    let significant = trimmed_end.trim_start_matches('0');
    if significant.is_empty() {
        return Some((false, String::new(), 0));
    }
    // i128 holds any exponent a 1 MiB body's number can need for a value
    // that is not zero; one that does not parse is far beyond a double's.
    let written: i128 = match exponent {
        Some(text) => text.parse().ok()?,
        None => 0,
    };
    let exponent = written
        .checked_sub(i128::try_from(fraction.len()).ok()?)?
        .checked_add(i128::try_from(digits.len() - trimmed_end.len()).ok()?)?;
    Some((negative, significant.to_owned(), exponent))
}

/// Whether two JSON number texts have exactly the same value.
fn same_decimal(a: &str, b: &str) -> bool {
    matches!((decimal(a), decimal(b)), (Some(x), Some(y)) if x == y)
}

impl<'de> Visitor<'de> for StrictVisitor<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an I-JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        match exact_integer(v) {
            Some(v) => {
                self.numbers.skip();
                Ok(Value::Number(v.into()))
            }
            None => self.number(),
        }
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        match i64::try_from(v).ok().and_then(exact_integer) {
            Some(v) => {
                self.numbers.skip();
                Ok(Value::Number(v.into()))
            }
            None => self.number(),
        }
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Value, E> {
        self.number()
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
        loop {
            let at = At {
                parent: self.at,
                step: Step::Index(items.len()),
            };
            match seq
                .next_element_seed(inner.at(&at))
                .map_err(|e| inner.at(&at).failed(e))?
            {
                Some(item) => items.push(item),
                None => break,
            }
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Value, A::Error> {
        let mut map = Map::new();
        let mut first = true;
        while let Some(key) = access.next_key::<String>().map_err(|e| self.failed(e))? {
            first = false;
            let inner = self.nested()?;
            if map.contains_key(&key) {
                return Err(self.refuse(format!("duplicate member name `{key}`")));
            }
            let at = At {
                parent: self.at,
                step: Step::Member(&key),
            };
            let value = access
                .next_value_seed(inner.at(&at))
                .map_err(|e| inner.at(&at).failed(e))?;
            map.insert(key, value);
        }
        if first {
            self.nested::<A::Error>()?;
        }
        Ok(Value::Object(map))
    }
}

/// A member name as read: borrowed from the body unless it had escapes.
struct Name;

impl<'de> DeserializeSeed<'de> for Name {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Name {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v))
    }
}

/// One object's member names so far, to refuse a duplicate: those on the
/// names stack from `base`, scanned while they are few, and in a set too
/// once they are not (a body of 100,000 members must not cost 10^10
/// comparisons).
struct Names<'de> {
    base: usize,
    set: Option<HashSet<Cow<'de, str>>>,
}

impl<'de> Names<'de> {
    const SCAN_UP_TO: usize = 16;

    /// An object whose names go on `stack` from its present top.
    fn on(stack: &[Cow<'de, str>]) -> Self {
        Self {
            base: stack.len(),
            set: None,
        }
    }

    fn contains(&self, stack: &[Cow<'de, str>], name: &str) -> bool {
        match &self.set {
            Some(set) => set.contains(name),
            None => stack[self.base..].iter().any(|seen| seen == name),
        }
    }

    /// The name read before, if any.
    fn last<'s>(&self, stack: &'s [Cow<'de, str>]) -> Option<&'s Cow<'de, str>> {
        stack[self.base..].last()
    }

    fn push(&mut self, stack: &mut Vec<Cow<'de, str>>, name: Cow<'de, str>) {
        if let Some(set) = &mut self.set {
            set.insert(name.clone());
        } else if stack.len() - self.base >= Self::SCAN_UP_TO {
            let mut set: HashSet<_> = stack[self.base..].iter().cloned().collect();
            set.insert(name.clone());
            self.set = Some(set);
        }
        stack.push(name);
    }
}

/// RFC 8785's member order: by UTF-16 code units (which differs from
/// UTF-8's byte order only between U+E000–U+FFFF and the astral planes).
fn utf16_order(a: &str, b: &str) -> Ordering {
    if a.is_ascii() && b.is_ascii() {
        a.cmp(b)
    } else {
        a.encode_utf16().cmp(b.encode_utf16())
    }
}

/// `text` as an RFC 8785 string: only `"`, `\` and controls escaped, the
/// short escapes where JSON has them, `\u00xx` (lower-case hex) otherwise.
pub fn write_string(out: &mut String, text: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push('"');
    // Most names and values need no escape: one check, one copy.
    if !text
        .bytes()
        .any(|byte| byte < 0x20 || byte == b'"' || byte == b'\\')
    {
        out.push_str(text);
        out.push('"');
        return;
    }
    let mut plain_from = 0;
    for (at, byte) in text.bytes().enumerate() {
        let short = match byte {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x08 => "\\b",
            0x0c => "\\f",
            0x00..=0x1f => "",
            _ => continue,
        };
        // Every byte matched above is ASCII, so `at` is a char boundary.
        out.push_str(&text[plain_from..at]);
        if short.is_empty() {
            out.push_str("\\u00");
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0xf)]));
        } else {
            out.push_str(short);
        }
        plain_from = at + 1;
    }
    out.push_str(&text[plain_from..]);
    out.push('"');
}

/// Where canonical text is written, with the stacks of the objects being
/// written (innermost last): their member names and each member's span in
/// `out`. Shared by every object of one value, so that an object costs no
/// allocation of its own.
#[derive(Default)]
struct Canon<'de> {
    out: String,
    names: Vec<Cow<'de, str>>,
    spans: Vec<Range<usize>>,
}

impl Canon<'_> {
    fn with_capacity(capacity: usize) -> Self {
        Self {
            out: String::with_capacity(capacity),
            ..Self::default()
        }
    }
}

/// Checks a value as [`StrictVisitor`] does, at the same points and with
/// the same refusals, but writes its RFC 8785 text to `canon.out` instead
/// of building a tree: an object's members are written as they come and
/// reordered in place at its end, when they did not come sorted.
struct CanonicalWriter<'a, 'o, 'de> {
    strict: StrictVisitor<'a>,
    canon: &'o mut Canon<'de>,
}

impl<'de> DeserializeSeed<'de> for CanonicalWriter<'_, '_, 'de> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> CanonicalWriter<'_, '_, 'de> {
    fn number<E: de::Error>(self) -> Result<(), E> {
        let text = self.strict.number_text()?;
        match self.strict.exact(text)? {
            Exact::Small(_) => self.canon.out.push_str(text),
            Exact::Checked { canonical, .. } => self.canon.out.push_str(&canonical),
        }
        Ok(())
    }

    /// A map whose opening was read: `{}` or an object.
    fn map_from<A: MapAccess<'de>>(self, access: A, opening: Opening<'de>) -> Result<(), A::Error> {
        match opening {
            Opening::EmptyObject => {
                self.strict.nested::<A::Error>()?;
                self.canon.out.push_str("{}");
                Ok(())
            }
            Opening::Object(first) => self.object_from(access, first),
        }
    }

    /// The rest of an object whose first member name, `first`, was read.
    fn object_from<A: MapAccess<'de>>(
        self,
        mut access: A,
        first: Cow<'de, str>,
    ) -> Result<(), A::Error> {
        let Self { strict, canon } = self;
        canon.out.push('{');
        let body_start = canon.out.len();
        let mut names = Names::on(&canon.names);
        let spans_base = canon.spans.len();
        let mut sorted = true;
        let mut next = Some(first);
        while let Some(name) = next {
            let inner = strict.nested()?;
            if names.contains(&canon.names, &name) {
                return Err(strict.refuse(format!("duplicate member name `{name}`")));
            }
            if let Some(previous) = names.last(&canon.names) {
                sorted &= utf16_order(previous, &name) == Ordering::Less;
                canon.out.push(',');
            }
            let member_start = canon.out.len();
            write_string(&mut canon.out, &name);
            canon.out.push(':');
            let at = At {
                parent: strict.at,
                step: Step::Member(&name),
            };
            access
                .next_value_seed(CanonicalWriter {
                    strict: inner.at(&at),
                    canon: &mut *canon,
                })
                .map_err(|e| inner.at(&at).failed(e))?;
            canon.spans.push(member_start..canon.out.len());
            names.push(&mut canon.names, name);
            next = access.next_key_seed(Name).map_err(|e| strict.failed(e))?;
        }
        if !sorted {
            let written = canon.out[body_start..].to_owned();
            let members = &canon.names[names.base..];
            let mut order: Vec<usize> = (0..members.len()).collect();
            order.sort_unstable_by(|&a, &b| utf16_order(&members[a], &members[b]));
            canon.out.truncate(body_start);
            for (i, member) in order.into_iter().enumerate() {
                if i > 0 {
                    canon.out.push(',');
                }
                let span = &canon.spans[spans_base + member];
                canon
                    .out
                    .push_str(&written[span.start - body_start..span.end - body_start]);
            }
        }
        canon.names.truncate(names.base);
        canon.spans.truncate(spans_base);
        canon.out.push('}');
        Ok(())
    }
}

impl<'de> Visitor<'de> for CanonicalWriter<'_, '_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an I-JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<(), E> {
        self.canon.out.push_str(if v { "true" } else { "false" });
        Ok(())
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        match exact_integer(v) {
            Some(v) => {
                self.strict.numbers.skip();
                self.canon.out.push_str(itoa::Buffer::new().format(v));
                Ok(())
            }
            None => self.number(),
        }
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        match i64::try_from(v).ok().and_then(exact_integer) {
            Some(v) => {
                self.strict.numbers.skip();
                self.canon.out.push_str(itoa::Buffer::new().format(v));
                Ok(())
            }
            None => self.number(),
        }
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.number()
    }

    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        write_string(&mut self.canon.out, v);
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        self.canon.out.push_str("null");
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let Self { strict, canon } = self;
        let inner = strict.nested()?;
        canon.out.push('[');
        let mut index = 0;
        loop {
            let before = canon.out.len();
            if index > 0 {
                canon.out.push(',');
            }
            let at = At {
                parent: strict.at,
                step: Step::Index(index),
            };
            let seed = CanonicalWriter {
                strict: inner.at(&at),
                canon: &mut *canon,
            };
            if seq
                .next_element_seed(seed)
                .map_err(|e| inner.at(&at).failed(e))?
                .is_none()
            {
                canon.out.truncate(before);
                break;
            }
            index += 1;
        }
        canon.out.push(']');
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<(), A::Error> {
        let opening = Opening::read(&mut access).map_err(|e| self.strict.failed(e))?;
        self.map_from(access, opening)
    }
}

/// What a map's first entry makes of it.
enum Opening<'de> {
    EmptyObject,
    /// An object, and the name of its first member.
    Object(Cow<'de, str>),
}

impl<'de> Opening<'de> {
    fn read<A: MapAccess<'de>>(access: &mut A) -> Result<Self, A::Error> {
        Ok(match access.next_key_seed(Name)? {
            None => Self::EmptyObject,
            Some(name) => Self::Object(name),
        })
    }
}

/// What the member named `canonical` was: an object, as RFC 8785 text, or
/// another value (for the caller to refuse with its type).
enum Content {
    Object(String),
    Other(Value),
}

struct ContentVisitor<'a> {
    strict: StrictVisitor<'a>,
    /// Room to reserve for the text.
    capacity: usize,
}

impl<'de> DeserializeSeed<'de> for ContentVisitor<'_> {
    type Value = Content;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Content, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ContentVisitor<'_> {
    type Value = Content;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an I-JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Content, E> {
        self.strict.visit_bool(v).map(Content::Other)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Content, E> {
        self.strict.visit_i64(v).map(Content::Other)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Content, E> {
        self.strict.visit_u64(v).map(Content::Other)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Content, E> {
        self.strict.visit_f64(v).map(Content::Other)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Content, E> {
        self.strict.visit_str(v).map(Content::Other)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Content, E> {
        self.strict.visit_unit().map(Content::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Content, A::Error> {
        self.strict.visit_seq(seq).map(Content::Other)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Content, A::Error> {
        let opening = Opening::read(&mut access).map_err(|e| self.strict.failed(e))?;
        let mut canon = Canon::with_capacity(self.capacity);
        CanonicalWriter {
            strict: self.strict,
            canon: &mut canon,
        }
        .map_from(access, opening)?;
        // Room made for a body mostly of other members is given back.
        if canon.out.len() < canon.out.capacity() / 2 {
            canon.out.shrink_to_fit();
        }
        Ok(Content::Object(canon.out))
    }
}

/// The body's top level for [`parse_members`].
struct RootVisitor<'a, 'k> {
    strict: StrictVisitor<'a>,
    kept: &'k [&'k str],
    canonical: &'k str,
    /// Room to reserve for the canonical member's text.
    capacity: usize,
}

impl RootVisitor<'_, '_> {
    /// Checks a value that is not an object, for [`Members::NotObject`].
    fn not_object<'de, E>(
        self,
        check: impl FnOnce(CanonicalWriter<'_, '_, 'de>) -> Result<(), E>,
    ) -> Result<Members, E> {
        check(CanonicalWriter {
            strict: self.strict,
            canon: &mut Canon::default(),
        })
        .map(|()| Members::NotObject)
    }
}

impl<'de> Visitor<'de> for RootVisitor<'_, '_> {
    type Value = Members;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an I-JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Members, E> {
        Ok(Members::NotObject)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Members, E> {
        self.not_object(|writer| writer.visit_i64(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Members, E> {
        self.not_object(|writer| writer.visit_u64(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Members, E> {
        self.not_object(|writer| writer.visit_f64(v))
    }

    fn visit_str<E>(self, _: &str) -> Result<Members, E> {
        Ok(Members::NotObject)
    }

    fn visit_unit<E>(self) -> Result<Members, E> {
        Ok(Members::NotObject)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Members, A::Error> {
        self.not_object(|writer| writer.visit_seq(seq))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Members, A::Error> {
        let strict = self.strict;
        let mut next = match Opening::read(&mut access).map_err(|e| strict.failed(e))? {
            Opening::EmptyObject => {
                strict.nested::<A::Error>()?;
                None
            }
            Opening::Object(first) => Some(first),
        };
        let mut seen = Vec::new();
        let mut names = Names::on(&seen);
        let mut kept = Map::new();
        let mut canonical = None;
        let mut dropped = Canon::default();
        while let Some(name) = next {
            let inner = strict.nested()?;
            if names.contains(&seen, &name) {
                return Err(strict.refuse(format!("duplicate member name `{name}`")));
            }
            let at = At {
                parent: strict.at,
                step: Step::Member(&name),
            };
            let inner = inner.at(&at);
            if name == self.canonical {
                match access
                    .next_value_seed(ContentVisitor {
                        strict: inner,
                        capacity: self.capacity,
                    })
                    .map_err(|e| inner.failed(e))?
                {
                    Content::Object(text) => canonical = Some(text),
                    Content::Other(value) => {
                        kept.insert(name.to_string(), value);
                    }
                }
            } else if self.kept.contains(&&*name) {
                let value = access.next_value_seed(inner).map_err(|e| inner.failed(e))?;
                kept.insert(name.to_string(), value);
            } else {
                dropped.out.clear();
                access
                    .next_value_seed(CanonicalWriter {
                        strict: inner,
                        canon: &mut dropped,
                    })
                    .map_err(|e| inner.failed(e))?;
            }
            names.push(&mut seen, name);
            next = access.next_key_seed(Name).map_err(|e| strict.failed(e))?;
        }
        Ok(Members::Object { kept, canonical })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_duplicate_members_at_any_depth() {
        assert!(matches!(
            parse(br#"{"a":1,"a":2}"#),
            Err(JsonError::NotIJson { .. })
        ));
        assert!(matches!(
            parse(br#"{"x":{"b":1,"b":1}}"#),
            Err(JsonError::NotIJson { path, .. }) if path == "x"
        ));
    }

    #[test]
    fn refuses_lone_surrogates_and_inexact_integers() {
        assert!(matches!(
            parse(br#"{"a":"\ud800"}"#),
            Err(JsonError::NotIJson { .. })
        ));
        assert!(matches!(
            parse(b"9007199254740993"),
            Err(JsonError::NotIJson { .. })
        ));
        assert!(matches!(
            parse(b"-9007199254740993"),
            Err(JsonError::NotIJson { .. })
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

    /// Integers read by value skip the scan for their text; the text of a
    /// later number must still be its own, not a skipped integer's.
    #[test]
    fn numbers_after_integers_keep_their_own_text() {
        let body = br#"{"c":{"a":[1,-2,9007199254740991,-9007199254740991,"3.5",0.5,{"x":7},1e2,-0,9007199254740992,10.0]}}"#;
        let Ok(Members::Object { canonical, .. }) = parse_members(body, &[], "c") else {
            panic!("parsed");
        };
        assert_eq!(
            canonical.as_deref(),
            Some(
                r#"{"a":[1,-2,9007199254740991,-9007199254740991,"3.5",0.5,{"x":7},100,0,9007199254740992,10]}"#
            )
        );
        let tree = parse(body).expect("parsed");
        assert_eq!(tree["c"]["a"][2], Value::from(9007199254740991u64));
        assert_eq!(tree["c"]["a"][5], Value::from(0.5));
        assert!(matches!(
            parse_members(br#"{"c":{"a":[1,2,9007199254740993]}}"#, &[], "c"),
            Err(JsonError::NotIJson { path, .. }) if path == "c.a[2]"
        ));
    }

    /// What follows a number by JSON's grammar is not the number's: `5-1`
    /// is a syntax error (400) whether the `5` is skipped or read.
    #[test]
    fn a_number_ends_where_its_grammar_does() {
        for body in [
            &br#"{"c":{"n":5-1}}"#[..],
            br#"{"c":{"n":5.0-1}}"#,
            br#"{"c":[12-]}"#,
            br#"{"c":[1e5+2]}"#,
        ] {
            assert!(
                matches!(parse_members(body, &[], "c"), Err(JsonError::Syntax(_))),
                "{}",
                String::from_utf8_lossy(body)
            );
            assert!(matches!(parse(body), Err(JsonError::Syntax(_))));
        }
        let Ok(Members::Object { canonical, .. }) =
            parse_members(br#"{"c":{"a":[1,-0.5e-1,2E+2,3,1.5]}}"#, &[], "c")
        else {
            panic!("parsed");
        };
        assert_eq!(canonical.as_deref(), Some(r#"{"a":[1,-0.05,200,3,1.5]}"#));
    }

    #[test]
    fn refuses_nesting_past_the_limit() {
        let nested = |depth: usize| format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        assert!(parse(nested(MAX_DEPTH).as_bytes()).is_ok());
        assert!(matches!(
            parse(nested(MAX_DEPTH + 1).as_bytes()),
            Err(JsonError::NotIJson { .. })
        ));
        assert!(parse(nested(100_000).as_bytes()).is_err());
    }

    #[test]
    fn a_number_is_kept_exactly_or_refused_with_its_path() {
        for fine in [
            "1.0",
            "1e2",
            "0.5",
            "-0.0",
            "123.456",
            "1E-7",
            "9007199254740992",
            "1e21",
        ] {
            let doc = format!(r#"{{"n":{fine}}}"#);
            assert!(parse(doc.as_bytes()).is_ok(), "{fine} was refused");
        }
        for refused in [
            "18446744073709551617",
            "9007199254740993.0",
            "0.10000000000000000555",
            "100000000000000000000.5",
            "1e400",
            "-1e400",
            "9007199254740993",
            "1152921504606846976",
        ] {
            let doc = format!(r#"{{"a":[{{"n":1}},{{"n":{refused}}}]}}"#);
            match parse(doc.as_bytes()) {
                Err(JsonError::NotIJson { path, .. }) => assert_eq!(path, "a[1].n", "{refused}"),
                other => panic!("{refused}: {other:?}"),
            }
        }
    }

    #[test]
    fn extreme_exponents_are_exact_or_refused() {
        for zero in [
            "0e+9223372036854775807",
            "0e-9223372036854775809",
            "0.0e99999999999999999999",
            "-0.000e-99999999999999999999999",
        ] {
            let value = parse(format!(r#"{{"n":{zero}}}"#).as_bytes())
                .unwrap_or_else(|e| panic!("{zero}: {e:?}"));
            assert_eq!(
                serde_json_canonicalizer::to_string(&value).expect("canonical"),
                r#"{"n":0}"#,
                "{zero}"
            );
        }
        for beyond in [
            "1e-9223372036854775808",
            "1e+9223372036854775808",
            "1e99999999999999999999999999999999999999999",
            "-2.5e-400",
        ] {
            assert!(
                matches!(
                    parse(format!(r#"{{"n":{beyond}}}"#).as_bytes()),
                    Err(JsonError::NotIJson { .. })
                ),
                "{beyond}"
            );
        }
    }

    #[test]
    fn syntax_errors_near_numbers_and_escapes_stay_syntax_errors() {
        for text in [
            &br#"{"a":01}"#[..],
            br#"{"a":1 "b":2}"#,
            br#"{"a":1.}"#,
            br#"{"a":-}"#,
            br#"{"a":"\u12"}"#,
            br#"{"a":"\ud8"}"#,
        ] {
            assert!(
                matches!(parse(text), Err(JsonError::Syntax(_))),
                "{}",
                String::from_utf8_lossy(text)
            );
        }
        for text in [
            &br#"{"a":"\udc00"}"#[..],
            br#"{"a":"x\ud83d"}"#,
            b"{\"a\":\n  \"\\uDBFF\\u0041\"}",
        ] {
            assert!(
                matches!(parse(text), Err(JsonError::NotIJson { .. })),
                "{}: {:?}",
                String::from_utf8_lossy(text),
                parse(text)
            );
        }
    }

    #[test]
    fn well_formed_numbers_are_told_from_others() {
        for good in ["0", "-0", "1.5", "1e2", "-12.5E-3", "9007199254740993"] {
            assert!(is_json_number(good), "{good}");
        }
        for bad in ["", "-", "01", "1.", ".5", "1e", "1e+", "+1", "1.2.3"] {
            assert!(!is_json_number(bad), "{bad}");
        }
    }

    #[test]
    fn small_integers_take_the_short_way_and_keep_their_value() {
        assert_eq!(small_integer("0"), Some(0));
        assert_eq!(small_integer("-123456789012345"), Some(-123456789012345));
        assert_eq!(small_integer("1234567890123456"), None);
        assert_eq!(small_integer("-0"), None);
        assert_eq!(small_integer("1.0"), None);
        assert_eq!(small_integer("1e2"), None);
    }

    #[test]
    fn decimals_compare_by_value() {
        assert!(same_decimal("1.50e1", "15"));
        assert!(same_decimal("-0.0", "0"));
        assert!(same_decimal("0.000", "0"));
        assert!(same_decimal("1e2", "100"));
        assert!(!same_decimal("0.10000000000000000555", "0.1"));
        assert!(!same_decimal("-1", "1"));
    }

    #[test]
    fn keeps_a_valid_document() {
        assert_eq!(
            parse(br#" {"b": [1, 2.5, "x", null, true], "a": {}} "#),
            Ok(serde_json::json!({"a": {}, "b": [1, 2.5, "x", null, true]}))
        );
    }
}
