//! What callers read back: the receipt, and the full plan behind it.

use serde::Serialize;
use serde_json::Value;

use super::body::ApprovedInput;
use crate::storage::plans::{PlanRow, ReceiptRow};

/// The receipt as the HTTP contract shows it. `outcome` is present only in
/// answers to `POST /v1/plans`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Receipt {
    pub receipt_id: String,
    pub maker: String,
    pub run_id: String,
    pub content_hash: String,
    pub request_hash: String,
    pub approved_inputs: Vec<String>,
    pub permissions: Vec<String>,
    pub received_at: String,
    /// `created`, `replayed` or `already_received`; only in answers to POST.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub outcome: Option<&'static str>,
}

/// A plan with its receipt: `GET /v1/plans/{receipt_id}`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct PlanView {
    pub receipt: Receipt,
    pub approved_inputs: Vec<ApprovedInput>,
    #[schema(value_type = Object)]
    pub content: Value,
}

/// A stored row whose JSON columns cannot be read back: never the caller's fault.
#[derive(Debug, thiserror::Error)]
#[error("plan {receipt_id} has an unreadable {column} column")]
pub struct CorruptRow {
    receipt_id: String,
    column: &'static str,
    source: serde_json::Error,
}

impl Receipt {
    pub fn from_row(row: &ReceiptRow, outcome: Option<&'static str>) -> Result<Self, CorruptRow> {
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
            outcome,
        })
    }
}

impl PlanView {
    pub fn from_row(row: &PlanRow) -> Result<Self, CorruptRow> {
        Ok(Self {
            receipt: Receipt::from_row(&row.receipt_row(), None)?,
            approved_inputs: stored_inputs(&row.receipt_id, &row.approved_inputs)?,
            content: serde_json::from_str(&row.content).map_err(|source| CorruptRow {
                receipt_id: row.receipt_id.clone(),
                column: "content",
                source,
            })?,
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
    at.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
}
