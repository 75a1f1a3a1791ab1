//! What callers read back: the receipt, and the full plan behind it.

use serde::Serialize;
use serde_json::value::RawValue;

use super::Outcome;
use super::body::ApprovedInput;
use super::signing::StoredSignature;
use crate::storage::plans::{PlanRow, ReceiptRow};

/// The receipt as the HTTP contract shows it (`crates/wire`).
pub use plan_intake_wire::Receipt;

/// A plan with its receipt: `GET /v1/plans/{receipt_id}`. The approved
/// inputs and the content are handed out as stored, byte for byte (their
/// RFC 8785 text), never re-serialized: a reader's blake3 over
/// `{"approved_inputs":…,"content":…}` built from them is `content_hash`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct PlanView {
    pub receipt: Receipt,
    #[schema(value_type = Vec<ApprovedInput>)]
    pub approved_inputs: Box<RawValue>,
    #[schema(value_type = Object)]
    pub content: Box<RawValue>,
}

/// A stored row whose JSON columns cannot be read back: never the caller's fault.
#[derive(Debug, thiserror::Error)]
#[error("plan {receipt_id} has an unreadable {column} column")]
pub struct CorruptRow {
    receipt_id: String,
    column: &'static str,
    source: serde_json::Error,
}

/// A receipt from its stored row (a wire type, so a trait of the domain's).
pub trait ReceiptOfRow: Sized {
    fn from_row(row: &ReceiptRow, outcome: Option<Outcome>) -> Result<Self, CorruptRow>;
}

impl ReceiptOfRow for Receipt {
    fn from_row(row: &ReceiptRow, outcome: Option<Outcome>) -> Result<Self, CorruptRow> {
        let inputs = stored_inputs(&row.receipt_id, &row.approved_inputs)?;
        let permissions: Vec<String> =
            serde_json::from_str(&row.permissions).map_err(|source| CorruptRow {
                receipt_id: row.receipt_id.clone(),
                column: "permissions",
                source,
            })?;
        Ok(Self {
            receipt_id: row.receipt_id.clone(),
            maker: row.maker.clone(),
            run_id: row.run_id.clone(),
            content_hash: row.content_hash.clone(),
            request_hash: row.request_hash.clone(),
            approved_inputs: inputs.into_iter().map(|i| i.id).collect(),
            permissions,
            received_at: format_timestamp(&row.received_at),
            signature: row
                .receipt_signature
                .as_deref()
                .and_then(<_ as StoredSignature>::from_stored),
            outcome,
            extra: Default::default(),
        })
    }
}

impl PlanView {
    /// The row's JSON columns are checked to be JSON (no tree is built) and
    /// kept as they are.
    pub fn from_row(row: PlanRow) -> Result<Self, CorruptRow> {
        let receipt = Receipt::from_row(&row.receipt_row(), None)?;
        let PlanRow {
            receipt_id,
            content,
            approved_inputs,
            ..
        } = row;
        let raw = |text: String, column: &'static str| {
            RawValue::from_string(text).map_err(|source| CorruptRow {
                receipt_id: receipt_id.clone(),
                column,
                source,
            })
        };
        Ok(Self {
            receipt,
            approved_inputs: raw(approved_inputs, "approved_inputs")?,
            content: raw(content, "content")?,
        })
    }
}

fn stored_inputs(receipt_id: &str, stored: &str) -> Result<Vec<ApprovedInput>, CorruptRow> {
    serde_json::from_str(stored).map_err(|source| CorruptRow {
        receipt_id: receipt_id.to_owned(),
        column: "approved_inputs",
        source,
    })
}

/// `2026-11-30T10:00:00.000000Z`: UTC, microseconds, as both backends store it.
pub fn format_timestamp(at: &chrono::NaiveDateTime) -> String {
    use chrono::{Datelike, Timelike};
    const LAYOUT: &str = "%Y-%m-%dT%H:%M:%S%.6fZ";
    // Written directly (chrono interprets its layout anew on every call, on
    // every receipt); chrono itself for what a plain layout cannot show:
    // years past four digits, a leap second.
    let year = at.year();
    if !(0..=9999).contains(&year) || at.nanosecond() >= 1_000_000_000 {
        return at.format(LAYOUT).to_string();
    }
    format!(
        "{year:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z",
        at.month(),
        at.day(),
        at.hour(),
        at.minute(),
        at.second(),
        at.nanosecond() / 1_000
    )
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, NaiveDate};

    use super::format_timestamp;

    #[test]
    fn timestamps_read_as_chrono_writes_them() {
        let mut instants: Vec<chrono::NaiveDateTime> = (0..2_000i64)
            .map(|i| {
                let secs = i * 7_919_777_777 % 253_402_300_799;
                let nanos = u32::try_from(i * 123_456_789 % 1_000_000_000).expect("nanos");
                DateTime::from_timestamp(secs, nanos)
                    .expect("in range")
                    .naive_utc()
            })
            .collect();
        let leap = NaiveDate::from_ymd_opt(2016, 12, 31)
            .and_then(|d| d.and_hms_nano_opt(23, 59, 59, 1_500_000_000))
            .expect("a leap second");
        let far = NaiveDate::from_ymd_opt(12_345, 1, 2)
            .and_then(|d| d.and_hms_micro_opt(3, 4, 5, 6))
            .expect("a five-digit year");
        instants.extend([leap, far]);
        for at in instants {
            assert_eq!(
                format_timestamp(&at),
                at.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string(),
                "{at:?}"
            );
        }
    }
}
