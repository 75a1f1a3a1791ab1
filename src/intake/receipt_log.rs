//! The receipt log, the domain's side: what a leaf is (a receipt's signed
//! form), checkpoints as C2SP `tlog-checkpoint` signed notes, proofs as
//! C2SP `tlog-proof` text, the offline check of a receipt and its proof,
//! and the audit that recomputes the log from the tables.

use std::collections::HashMap;

use tlog_tiles::{Checkpoint, Hash};

use super::hashing::hashes_of_stored;
use super::receipt::{Receipt, ReceiptOfRow};
use super::signing::{BadSignature, SigningKey, TrustedKeys, signed_form, verify_receipt};
use crate::storage::plans::ReceiptRow;
use crate::storage::receipt_log::{self as log_tables, LogWriter, WriterError};
use crate::storage::{Database, StorageError};

/// The first line of a C2SP `tlog-proof`.
pub const PROOF_HEADER: &str = "c2sp.org/tlog-proof@v1";

/// Signs the log's checkpoints with `key`, and `cosigners` beside it (keys
/// being rotated out), under `origin`.
pub struct LogSigner<'a> {
    pub key: &'a SigningKey,
    pub cosigners: &'a [std::sync::Arc<SigningKey>],
    pub origin: &'a str,
    /// Keeps each checkpoint outside the database (`serve
    /// --checkpoint-file`) once signed and before the round commits: a
    /// checkpoint is never handed out before it is kept.
    pub keep: Option<&'a KeepCheckpoint>,
}

/// Keeps a signed checkpoint note somewhere durable; an error fails the
/// round, which then commits nothing.
pub type KeepCheckpoint = dyn Fn(&str) -> std::io::Result<()> + Send + Sync;

impl LogWriter for LogSigner<'_> {
    fn leaf(&self, row: &ReceiptRow) -> Result<Vec<u8>, WriterError> {
        leaf_of(row)
    }

    fn checkpoint(&self, size: u64, root: Hash) -> Result<String, WriterError> {
        let mut keys = vec![self.key];
        keys.extend(self.cosigners.iter().map(|k| &**k));
        let note = checkpoint_note(&keys, self.origin, size, root)?;
        if let Some(keep) = self.keep {
            keep(&note)
                .map_err(|e| format!("cannot keep the checkpoint before it is published: {e}"))?;
        }
        Ok(note)
    }
}

/// A receipt's leaf in the log: its signed form, from its plan's row.
pub fn leaf_of(row: &ReceiptRow) -> Result<Vec<u8>, WriterError> {
    let receipt = Receipt::from_row(row, None)?;
    Ok(signed_form(&receipt)?)
}

/// The signed note of a checkpoint: origin, size and root hash, signed by
/// each of `keys` (C2SP allows several: the new key and the one rotated out).
pub fn checkpoint_note(
    keys: &[&SigningKey],
    origin: &str,
    size: u64,
    root: Hash,
) -> Result<String, String> {
    let text = Checkpoint::new(origin, size, root, "")
        .map_err(|_| format!("{origin:?} is not a checkpoint origin"))?
        .to_bytes();
    let mut note = signed_note::Note::new(&text, &[]).map_err(|e| e.to_string())?;
    let signers: Vec<&dyn signed_note::Signer> = keys
        .iter()
        .map(|k| k.note_signer() as &dyn signed_note::Signer)
        .collect();
    note.add_sigs(&signers).map_err(|e| e.to_string())?;
    String::from_utf8(note.to_bytes()).map_err(|e| e.to_string())
}

/// `proof` of leaf `index` under `checkpoint`, as C2SP `tlog-proof` text.
pub fn proof_text(index: u64, proof: &[Hash], checkpoint: &str) -> String {
    let mut text = format!("{PROOF_HEADER}\nindex {index}\n");
    for hash in proof {
        text.push_str(&format!("{hash}\n"));
    }
    text.push('\n');
    text.push_str(checkpoint);
    text
}

pub use plan_intake_wire::evidence::{
    CheckpointExtension, CheckpointStart, VerifiedCheckpoint, verify_checkpoint,
};

/// Hashes (or entries) in a full tile of the log (C2SP `tlog-tiles`,
/// height 8).
pub const TILE_WIDTH: u32 = 256;

/// A C2SP `tlog-tiles` resource of the log, its path after `/v1/log/`:
/// `tile/<L>/<N>[.p/<W>]` (`W` hashes of level `8·L` from the
/// `N`-th tile's start) or `tile/entries/<N>[.p/<W>]` (`W` leaves).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileRequest {
    Hashes { level: u8, index: u64, width: u32 },
    Entries { index: u64, width: u32 },
}

impl TileRequest {
    /// The tile a path names; `None` for any path the layout does not have.
    pub fn parse(path: &str) -> Option<Self> {
        let rest = path.strip_prefix("tile/")?;
        let (kind, rest) = rest.split_once('/')?;
        let (index, width) = match rest.split_once(".p/") {
            Some((index, width)) => {
                let width: u32 = width.parse().ok().filter(|w| (1..TILE_WIDTH).contains(w))?;
                (index, width)
            }
            None => (rest, TILE_WIDTH),
        };
        let index = parse_tile_index(index)?;
        if kind == "entries" {
            let tile = Self::Entries { index, width };
            return (tile.path() == path).then_some(tile);
        }
        let level: u8 = kind.parse().ok().filter(|l| *l <= 63)?;
        let tile = Self::Hashes {
            level,
            index,
            width,
        };
        // One spelling per tile (no `x000/…`, `08`, `+8`): what is cached
        // as immutable is cached under one name.
        (tile.path() == path).then_some(tile)
    }

    /// The tile's path, as C2SP spells it.
    pub fn path(&self) -> String {
        let (kind, index, width) = match self {
            Self::Hashes {
                level,
                index,
                width,
            } => (level.to_string(), *index, *width),
            Self::Entries { index, width } => ("entries".to_owned(), *index, *width),
        };
        let mut groups = vec![format!("{:03}", index % 1000)];
        let mut rest = index / 1000;
        while rest > 0 {
            groups.push(format!("x{:03}", rest % 1000));
            rest /= 1000;
        }
        groups.reverse();
        let partial = if width == TILE_WIDTH {
            String::new()
        } else {
            format!(".p/{width}")
        };
        format!("tile/{kind}/{}{partial}", groups.join("/"))
    }

    /// The tree size that holds this tile whole: its last leaf (or the
    /// last leaf under its last hash) plus one.
    pub fn end(&self) -> u64 {
        let (level, index, width) = match self {
            Self::Hashes {
                level,
                index,
                width,
            } => (u32::from(*level), *index, *width),
            Self::Entries { index, width } => (0, *index, *width),
        };
        let leaves = index
            .saturating_mul(u64::from(TILE_WIDTH))
            .saturating_add(u64::from(width));
        leaves.checked_shl(8 * level).unwrap_or(u64::MAX)
    }

    /// A full tile never changes.
    pub fn is_full(&self) -> bool {
        match self {
            Self::Hashes { width, .. } | Self::Entries { width, .. } => *width == TILE_WIDTH,
        }
    }
}

/// `x001/x234/067` as 1234067: groups of three digits, all but the last
/// prefixed with `x`.
fn parse_tile_index(text: &str) -> Option<u64> {
    let groups: Vec<&str> = text.split('/').collect();
    let (last, leading) = groups.split_last()?;
    let mut index: u64 = 0;
    for group in leading
        .iter()
        .map(|g| g.strip_prefix('x'))
        .chain([Some(*last)])
    {
        let group = group?;
        if group.len() != 3 || !group.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        index = index.checked_mul(1000)?.checked_add(group.parse().ok()?)?;
    }
    Some(index)
}

/// An entry bundle: each leaf's bytes after their length (big-endian
/// 16 bits), as C2SP `tlog-tiles` writes them.
pub fn entry_bundle(leaves: &[Vec<u8>]) -> Result<Vec<u8>, String> {
    let mut bundle = Vec::with_capacity(leaves.iter().map(|l| l.len() + 2).sum());
    for leaf in leaves {
        let length = u16::try_from(leaf.len()).map_err(|_| {
            format!(
                "a leaf of {} bytes does not fit an entry bundle",
                leaf.len()
            )
        })?;
        bundle.extend_from_slice(&length.to_be_bytes());
        bundle.extend_from_slice(leaf);
    }
    Ok(bundle)
}

/// An HTTP problem (`{"type": …, "title": …}`) saved where a proof was
/// meant to be (`curl … > receipt.tlog-proof` of a 404): its type's last
/// part and its status, for the error that says so.
fn problem_saved_as_proof(text: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_str(text.trim()).ok()?;
    let kind = value.get("type")?.as_str()?;
    let name = kind.rsplit('/').next().unwrap_or(kind);
    Some(
        match value.get("status").and_then(serde_json::Value::as_u64) {
            Some(status) => format!("{status} {name}"),
            None => name.to_owned(),
        },
    )
}

/// A `tlog-proof` read back: the leaf index, its inclusion proof and the
/// checkpoint's signed note.
pub struct ParsedProof {
    pub index: u64,
    pub hashes: Vec<Hash>,
    pub checkpoint: String,
}

pub fn parse_proof(text: &str) -> Result<ParsedProof, String> {
    let (head, checkpoint) = text
        .split_once("\n\n")
        .ok_or("no blank line before its checkpoint")?;
    let mut lines = head.lines();
    if lines.next() != Some(PROOF_HEADER) {
        return Err(format!("its first line is not {PROOF_HEADER}"));
    }
    let mut line = lines.next().ok_or("no index line")?;
    if line.starts_with("extra ") {
        line = lines.next().ok_or("no index line")?;
    }
    let index = line
        .strip_prefix("index ")
        .and_then(|n| n.parse::<u64>().ok())
        .ok_or_else(|| format!("{line:?} is not an index line"))?;
    let hashes = lines
        .map(|l| Hash::parse_hash(l).map_err(|_| format!("{l:?} is not a base64 hash")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ParsedProof {
        index,
        hashes,
        checkpoint: checkpoint.to_owned(),
    })
}

/// What an offline check found to hold.
#[derive(Debug)]
pub struct Verified {
    pub receipt_id: String,
    pub key_id: String,
    /// With a proof: the leaf's index and the checkpoint it is included in.
    pub included: Option<(u64, VerifiedCheckpoint)>,
}

/// A plan read with its receipt (`GET /v1/plans/{id}`), its parts as the
/// service handed them out.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanDocument {
    receipt: Receipt,
    approved_inputs: Box<serde_json::value::RawValue>,
    content: Box<serde_json::value::RawValue>,
}

/// Checks a receipt (`receipt`: the service's JSON for it, or a plan read
/// with its receipt, whose content must then hash to the receipt's
/// `content_hash`) against `keys`, and with `proof`, its inclusion in a
/// checkpoint those keys signed. No service, no database.
pub fn verify_offline(
    receipt: &str,
    keys: &TrustedKeys,
    proof: Option<&str>,
) -> Result<Verified, String> {
    let receipt: Receipt = match Receipt::parse(receipt) {
        Ok(receipt) => receipt,
        Err(not_a_receipt) => {
            let plan: PlanDocument = serde_json::from_str(receipt)
                .map_err(|_| format!("not a receipt as the service answers it: {not_a_receipt}"))?;
            let hashes = hashes_of_stored(
                plan.approved_inputs.get(),
                plan.content.get(),
                &plan.receipt.run_id,
            );
            if hashes.content_hash != plan.receipt.content_hash
                || hashes.request_hash != plan.receipt.request_hash
            {
                return Err(format!(
                    "plan {}: its content or approved inputs are not what its receipt was given for (they hash to {})",
                    plan.receipt.receipt_id, hashes.content_hash
                ));
            }
            plan.receipt
        }
    };
    verify_receipt(&receipt, keys).map_err(|e| e.to_string())?;
    let leaf = signed_form(&receipt).map_err(|e| e.to_string())?;
    let receipt_id = receipt.receipt_id.clone();
    let key_id = receipt
        .signature
        .as_ref()
        .map(|s| s.key_id.clone())
        .unwrap_or_default();
    let included = match proof {
        None => None,
        Some(text) => {
            let proof = parse_proof(text).map_err(|e| match problem_saved_as_proof(text) {
                Some(problem) => format!(
                    "the proof file holds the service's answer {problem}, not a proof: fetch it again (a receipt's proof is 404 not-logged-yet for the few seconds before the log holds it)"
                ),
                None => format!("the proof is malformed: {e}"),
            })?;
            let checkpoint = verify_checkpoint(&proof.checkpoint, keys)
                .map_err(|e| format!("the proof's checkpoint: {e}"))?;
            if proof.index >= checkpoint.size {
                return Err(format!(
                    "the proof's index {} is outside its checkpoint of {} leaves",
                    proof.index, checkpoint.size
                ));
            }
            tlog_tiles::check_record(
                &proof.hashes,
                checkpoint.size,
                checkpoint.root,
                proof.index,
                tlog_tiles::record_hash(&leaf),
            )
            .map_err(|_| {
                format!(
                    "receipt {receipt_id} is not leaf {} of the checkpoint of {} leaves: the receipt or the proof was changed",
                    proof.index, checkpoint.size
                )
            })?;
            Some((proof.index, checkpoint))
        }
    };
    Ok(Verified {
        receipt_id,
        key_id,
        included,
    })
}

/// What an audit found: one line per finding, and what it looked at.
#[derive(Debug, Default)]
pub struct AuditReport {
    pub plans: usize,
    /// Plans whose receipt carries no signature (written by an instance
    /// without a key); their content is still checked against their hashes.
    pub unsigned: usize,
    /// How many plans stand in the feed before the first one a key signed:
    /// the log's leaves kept before its first key, which a verifying
    /// reader from the start is told (`follow --unsigned-prelude N`).
    pub unsigned_prelude: usize,
    pub leaves: usize,
    pub checkpoints: usize,
    pub findings: Vec<String>,
}

/// Past this many, findings of one kind are summed up in one more line.
const FINDINGS_OF_A_KIND: usize = 3;

/// Recomputes the log from the tables, read in one snapshot, and holds
/// it against every checkpoint (stored, and `extra` ones an auditor kept):
/// each plan's hashes against its content, each receipt's signature, each
/// leaf against its receipt and its place in the feed, the stored tree
/// against its leaves, each checkpoint's signature and root, and where a
/// checkpoint stops extending the one before. `keys`: the keys the
/// auditor trusts.
pub fn audit(
    db: &Database,
    keys: &TrustedKeys,
    extra: &[(String, String)],
) -> Result<AuditReport, StorageError> {
    let data = log_tables::audit_data(&mut *db.conn()?)?;
    let mut report = AuditReport {
        plans: data.plans.len(),
        leaves: data.leaves.len(),
        checkpoints: data.checkpoints.len() + extra.len(),
        ..AuditReport::default()
    };
    let findings = &mut report.findings;

    for (key_id, verifier_key, _, _) in &data.keys {
        if !keys.trusts(verifier_key) {
            findings.push(format!(
                "signing key {key_id}: published by the database but not among the keys you trust (added or replaced around the service?)"
            ));
        }
    }

    // Each plan: its hashes from its content, its receipt's signature.
    let mut by_receipt: HashMap<&str, (usize, Vec<u8>)> = HashMap::new();
    // Which plans carry a signature a trusted key made, and which none.
    let mut signed_by_a_key = vec![false; data.plans.len()];
    let mut unsigned_places = Vec::new();
    // Receipts signed by a key the auditor does not trust: the key, how
    // many, the first and the last in feed order.
    let mut untrusted: Vec<(String, usize, String, String)> = Vec::new();
    for (place, (_, row)) in data.plans.iter().enumerate() {
        let hashes = hashes_of_stored(&row.approved_inputs, &row.content, &row.run_id);
        if hashes.content_hash != row.content_hash {
            findings.push(format!(
                "plan {}: its content or approved inputs were changed after it was received (they hash to {}, its receipt says {})",
                row.receipt_id, hashes.content_hash, row.content_hash
            ));
        } else if hashes.request_hash != row.request_hash {
            findings.push(format!(
                "plan {}: its run id was changed after it was received (the request hashes to {}, its receipt says {})",
                row.receipt_id, hashes.request_hash, row.request_hash
            ));
        }
        match Receipt::from_row(&row.receipt_row(), None) {
            Ok(receipt) => {
                match verify_receipt(&receipt, keys) {
                    Ok(()) => signed_by_a_key[place] = true,
                    Err(BadSignature::Unsigned) => {
                        report.unsigned += 1;
                        unsigned_places.push(place);
                    }
                    // Counted per key: after a rotation, every receipt
                    // the new key signed, told once.
                    Err(BadSignature::UnknownKey(key)) => {
                        match untrusted.iter_mut().find(|(k, ..)| *k == key) {
                            Some((_, count, _, last)) => {
                                *count += 1;
                                last.clone_from(&row.receipt_id);
                            }
                            None => untrusted.push((
                                key,
                                1,
                                row.receipt_id.clone(),
                                row.receipt_id.clone(),
                            )),
                        }
                    }
                    Err(bad) => findings.push(format!("receipt {}: {bad}", row.receipt_id)),
                }
                match signed_form(&receipt) {
                    Ok(form) => {
                        by_receipt.insert(&row.receipt_id, (place, form));
                    }
                    Err(e) => findings.push(format!("receipt {}: {e}", row.receipt_id)),
                }
            }
            Err(corrupt) => findings.push(format!("receipt {}: {corrupt}", row.receipt_id)),
        }
    }

    for (key, count, first, last) in untrusted {
        findings.push(if count == 1 {
            format!("receipt {first}: the receipt is signed by {key}, which is not among the trusted keys")
        } else {
            format!(
                "{count} receipts, from {first} to {last} in feed order, are signed by {key}, which is not among the trusted keys (after a rotation: add the new key's .pub to the keys you trust)"
            )
        });
    }

    // Unsigned rows come only from before the log's first key: one
    // standing in the feed after a receipt a key signed (its place, which
    // an edit of the row cannot move), or received while a key was in use
    // (between its first and last recorded use), lost its signature (an
    // edit that also dropped it, before or after the log took it) or was
    // written around the service. Its own `received_at` alone decides
    // nothing: the same edit may have moved it.
    let first_signed = signed_by_a_key.iter().position(|signed| *signed);
    report.unsigned_prelude = first_signed.unwrap_or(0);
    let findings = &mut report.findings;
    let mut unsigned_findings = Vec::new();
    for &place in &unsigned_places {
        let row = &data.plans[place].1;
        let signing_then = data
            .keys
            .iter()
            .find(|(_, _, first, last)| (*first..=*last).contains(&row.received_at));
        let after_signed = first_signed.is_some_and(|first| first < place);
        if after_signed {
            unsigned_findings.push(format!(
                "plan {}: carries no signature, but stands in the feed after a receipt a key signed (only receipts kept before the log's first key may be unsigned): its signature was removed, or it was written around the service (or by an instance started without a key)",
                row.receipt_id
            ));
        } else if let Some((key_id, _, first, last)) = signing_then {
            unsigned_findings.push(format!(
                "plan {}: carries no signature, but was received ({}) while key {key_id} was signing ({} to {}): its signature was removed, or it was written around the service (or by an instance started without a key)",
                row.receipt_id,
                super::receipt::format_timestamp(&row.received_at),
                super::receipt::format_timestamp(first),
                super::receipt::format_timestamp(last)
            ));
        }
    }
    let more = unsigned_findings.len().saturating_sub(FINDINGS_OF_A_KIND);
    findings.extend(unsigned_findings.into_iter().take(FINDINGS_OF_A_KIND));
    if more > 0 {
        findings.push(format!(
            "… and {more} more plans without a signature where one was due"
        ));
    }

    // Each leaf: its receipt still there, unchanged, in feed order.
    let mut stored_leaves: Vec<Hash> = Vec::with_capacity(data.leaves.len());
    let mut last_place: Option<usize> = None;
    for (expected, leaf) in data.leaves.iter().enumerate() {
        let index = leaf.leaf_index;
        if usize::try_from(index).ok() != Some(expected) {
            findings.push(format!(
                "leaf {index}: the log's leaves are not numbered 0, 1, 2, … (expected {expected})"
            ));
        }
        let stored_hash = <[u8; 32]>::try_from(leaf.leaf_hash.as_slice())
            .map(Hash)
            .unwrap_or_default();
        stored_leaves.push(stored_hash);
        match by_receipt.get(leaf.receipt_id.as_str()) {
            None => findings.push(format!(
                "receipt {} (leaf {index}): removed from the plans table after it was logged",
                leaf.receipt_id
            )),
            Some((place, form)) => {
                if tlog_tiles::record_hash(form) != stored_hash {
                    findings.push(format!(
                        "receipt {} (leaf {index}): changed after it was logged",
                        leaf.receipt_id
                    ));
                }
                if last_place.is_some_and(|last| *place <= last) {
                    findings.push(format!(
                        "receipt {} (leaf {index}): out of feed order (the plans were reordered, or the log was written around the service)",
                        leaf.receipt_id
                    ));
                }
                last_place = Some(*place);
            }
        }
    }

    // Each plan the log has passed: in the log.
    let logged: std::collections::HashSet<&str> =
        data.leaves.iter().map(|l| l.receipt_id.as_str()).collect();
    let to = data.logged_to;
    for (place, (xid, row)) in data.plans.iter().enumerate() {
        if (*xid, row.id) <= (to.xid, to.id) && !logged.contains(row.receipt_id.as_str()) {
            // A receipt the service signed was written through it: the log
            // passed its position before it committed (a skipped position,
            // a bug to report). Anything else is likelier a write around it.
            let likelier = if signed_by_a_key[place] {
                "a skipped position is likelier: a trusted key signed it, so the service wrote it, and the log passed its place in the feed before it committed (a bug: report it)"
            } else {
                "a write around the service is likelier: no trusted key signed it"
            };
            findings.push(format!(
                "plan {} (feed position {}/{}): in the feed before the log's end but not in the log; {likelier}",
                row.receipt_id, xid, row.id
            ));
        }
    }

    // The stored tree and the state row against the leaves.
    let tree = MemoryTree::of(&stored_leaves);
    if data.state_size != tree.size() {
        findings.push(format!(
            "the log's state says {} leaves, but it holds {}: the next append would skip or repeat receipts",
            data.state_size,
            tree.size()
        ));
    }
    let stored_hashes: Vec<(u64, &[u8])> = data
        .hashes
        .iter()
        .map(|(i, h)| (u64::try_from(*i).unwrap_or(u64::MAX), h.as_slice()))
        .collect();
    let expected: Vec<(u64, &[u8])> = tree
        .hashes
        .iter()
        .enumerate()
        .map(|(i, h)| (i as u64, h.0.as_slice()))
        .collect();
    if let Some(at) = (0..stored_hashes.len().max(expected.len()))
        .find(|&i| stored_hashes.get(i) != expected.get(i))
    {
        findings.push(format!(
            "the log's stored hashes differ from its leaves from stored hash {at} on: proofs served from them are wrong"
        ));
    }

    // Each checkpoint against the tree of the stored leaves; where one
    // stops extending the one before.
    let mut checkpoints: Vec<(String, VerifiedCheckpoint, bool)> = Vec::new();
    let mut mismatched = Vec::new();
    let named = data
        .checkpoints
        .iter()
        .map(|c| (format!("checkpoint {}", c.tree_size), c.note.clone()))
        .chain(
            extra
                .iter()
                .map(|(name, note)| (format!("checkpoint {name}"), note.clone())),
        );
    // Checkpoints failing for one reason (a key the reader does not pin,
    // after a rotation) are one finding, with how many and which.
    let mut failing: Vec<(String, Vec<String>)> = Vec::new();
    for (name, note) in named {
        match verify_checkpoint(&note, keys) {
            Err(e) => {
                let reason = e.to_string();
                match failing.iter_mut().find(|(r, _)| *r == reason) {
                    Some((_, names)) => names.push(name),
                    None => failing.push((reason, vec![name])),
                }
            }
            Ok(checkpoint) if checkpoint.size > tree.size() => findings.push(format!(
                "{name}: signed for {} leaves, but the log has {}: leaves were removed",
                checkpoint.size,
                tree.size()
            )),
            Ok(checkpoint) => {
                let matches = tree.root(checkpoint.size) == Some(checkpoint.root);
                if !matches {
                    mismatched.push(format!(
                        "{name}: its root hash for {} leaves is not the root of the log's leaves",
                        checkpoint.size
                    ));
                }
                checkpoints.push((name, checkpoint, matches));
            }
        }
    }
    for (reason, names) in failing {
        match &names[..] {
            [one] => findings.push(format!("{one}: {reason}")),
            [first, .., last] => findings.push(format!(
                "{} checkpoints, from {first} to {last}: {reason}",
                names.len()
            )),
            [] => {}
        }
    }
    let more = mismatched.len().saturating_sub(FINDINGS_OF_A_KIND);
    findings.extend(mismatched.into_iter().take(FINDINGS_OF_A_KIND));
    if more > 0 {
        findings.push(format!(
            "… and {more} more checkpoints whose root is not the log's"
        ));
    }
    checkpoints.sort_by_key(|(_, c, _)| c.size);
    for pair in checkpoints.windows(2) {
        let ((old_name, old, old_matches), (new_name, new, new_matches)) = (&pair[0], &pair[1]);
        if old.size == new.size && old.root != new.root {
            findings.push(format!(
                "{old_name} and {new_name}: two different trees of {} leaves signed (the log forked, or one was forged)",
                new.size
            ));
        } else if *old_matches && !new_matches {
            findings.push(format!(
                "{new_name}: not an extension of {old_name}: the log forked after {} leaves, or it was forged",
                old.size
            ));
        }
    }
    Ok(report)
}

/// Stored hashes as rows: (index, hash).
pub type StoredHashRows = Vec<log_tables::HashRow>;

/// The stored hashes the leaves make (`receipts rehash`), when they are
/// not what is stored: only if the leaves are exactly the newest
/// checkpoint's (as many as it and the state row say, its signed note's
/// root at that size), so that what is written is the tree the log
/// already signed. `Ok(None)`: the stored hashes are the leaves'.
pub fn recomputed_hashes(
    state_size: u64,
    leaves: &[Vec<u8>],
    newest: Option<&log_tables::CheckpointRow>,
    stored: &[(i64, Vec<u8>)],
) -> Result<Option<(StoredHashRows, String)>, String> {
    let cannot = "recomputing cannot mend it; `plan-intake audit` names what changed (restore the log's tables, or `receipts new-log`)";
    let mut hashes = Vec::with_capacity(leaves.len());
    for (index, leaf) in leaves.iter().enumerate() {
        let hash = <[u8; 32]>::try_from(leaf.as_slice())
            .map(Hash)
            .map_err(|_| format!("leaf {index}'s hash is not 32 bytes; {cannot}"))?;
        hashes.push(hash);
    }
    let tree = MemoryTree::of(&hashes);
    let recomputed: StoredHashRows = tree
        .hashes
        .iter()
        .enumerate()
        .map(|(i, h)| (i64::try_from(i).unwrap_or(i64::MAX), h.0.to_vec()))
        .collect();
    let Some(first) =
        (0..recomputed.len().max(stored.len())).find(|&i| recomputed.get(i) != stored.get(i))
    else {
        return Ok(None);
    };
    // Something to write: only the tree the log signed.
    let Some(checkpoint) = newest else {
        return Err(format!(
            "the log holds {} leaves but no checkpoint: no signed tree to hold them to; {cannot}",
            leaves.len()
        ));
    };
    let signed_size = u64::try_from(checkpoint.tree_size).unwrap_or(u64::MAX);
    if leaves.len() as u64 != signed_size || state_size != signed_size {
        return Err(format!(
            "the log holds {} leaves and its state says {state_size}, but its newest checkpoint has {signed_size}: every round signs what it appends, so leaves were added or removed by hand; {cannot}",
            leaves.len()
        ));
    }
    // The note is what was signed: its size and root, not the row's
    // columns beside it, are what the leaves must make.
    let noted = note_size_and_root(&checkpoint.note);
    if noted != Some((signed_size, checkpoint.root().unwrap_or_default())) {
        return Err(format!(
            "the newest checkpoint's row does not match its signed note; {cannot}"
        ));
    }
    if tree.root(signed_size) != noted.map(|(_, root)| root) {
        return Err(format!(
            "the log's {} leaves do not make the tree of its newest checkpoint ({signed_size} leaves): a leaf changed; {cannot}",
            tree.size()
        ));
    }
    let said = format!(
        "the receipt log's {} stored hashes from its {} leaves (they differ from stored hash {first} on); the tree has the newest checkpoint's root",
        recomputed.len(),
        tree.size()
    );
    Ok(Some((recomputed, said)))
}

/// A checkpoint note's size and root (its second and third lines).
fn note_size_and_root(note: &str) -> Option<(u64, Hash)> {
    use base64::Engine as _;
    let mut lines = note.lines().skip(1);
    let size = lines.next()?.parse().ok()?;
    let root = base64::engine::general_purpose::STANDARD
        .decode(lines.next()?)
        .ok()?;
    Some((size, Hash(<[u8; 32]>::try_from(root.as_slice()).ok()?)))
}

/// A tree held in memory, for the audit: every stored hash, by index.
struct MemoryTree {
    size: u64,
    hashes: Vec<Hash>,
}

impl tlog_tiles::HashReader for MemoryTree {
    fn read_hashes(&self, indexes: &[u64]) -> Result<Vec<Hash>, tlog_tiles::Error> {
        indexes
            .iter()
            .map(|&i| {
                usize::try_from(i)
                    .ok()
                    .and_then(|i| self.hashes.get(i).copied())
                    .ok_or(tlog_tiles::Error::IndexesNotInTree)
            })
            .collect()
    }
}

impl MemoryTree {
    fn of(leaves: &[Hash]) -> Self {
        let mut tree = Self {
            size: 0,
            hashes: Vec::new(),
        };
        for leaf in leaves {
            let mut stored = tlog_tiles::stored_hashes_for_record_hash(tree.size, *leaf, &tree)
                .unwrap_or_default();
            tree.hashes.append(&mut stored);
            tree.size += 1;
        }
        tree
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn root(&self, size: u64) -> Option<Hash> {
        (size <= self.size)
            .then(|| tlog_tiles::tree_hash(size, self).ok())
            .flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 6962's tree of the test vectors Go's tlog and the CT projects
    /// use: the root of the first n leaves of `leaf_inputs` (from
    /// certificate-transparency-go's merkle tests).
    #[test]
    fn roots_match_the_rfc_6962_reference_vectors() {
        let inputs: [&[u8]; 8] = [
            b"",
            b"\x00",
            b"\x10",
            b"\x20\x21",
            b"\x30\x31",
            b"\x40\x41\x42\x43",
            b"\x50\x51\x52\x53\x54\x55\x56\x57",
            b"\x60\x61\x62\x63\x64\x65\x66\x67\x68\x69\x6a\x6b\x6c\x6d\x6e\x6f",
        ];
        let roots = [
            "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
            "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
            "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
            "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
            "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
            "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
            "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
        ];
        let leaves: Vec<Hash> = inputs.iter().map(|i| tlog_tiles::record_hash(i)).collect();
        let tree = MemoryTree::of(&leaves);
        for (n, want) in roots.iter().enumerate() {
            let root = tree.root(n as u64 + 1).expect("a root");
            let hex: String = root.0.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(&hex, want, "root of the first {} leaves", n + 1);
        }
        let (key, _) = SigningKey::generate("plan-intake.test").expect("key");
        let keys = TrustedKeys::parse(key.verifier_key()).expect("keys");
        let note = checkpoint_note(
            &[&key],
            "plan-intake.test/log",
            8,
            tree.root(8).expect("root"),
        )
        .expect("signed");
        let checkpoint = verify_checkpoint(&note, &keys).expect("verifies");
        assert_eq!(
            (checkpoint.size, checkpoint.origin.as_str()),
            (8, "plan-intake.test/log")
        );
        for index in 0..8u64 {
            let proof = tlog_tiles::prove_record(8, index, &tree).expect("proof");
            let text = proof_text(index, &proof, &note);
            let parsed = parse_proof(&text).expect("parses");
            assert_eq!((parsed.index, parsed.hashes.len()), (index, proof.len()));
            assert!(
                tlog_tiles::check_record(
                    &parsed.hashes,
                    8,
                    checkpoint.root,
                    index,
                    leaves[index as usize]
                )
                .is_ok()
            );
        }
    }

    /// A checkpoint carries the signatures of the new key and the one
    /// rotated out; a reader pinned to either verifies it. A note that
    /// carries a valid and an invalid signature by the same key is refused,
    /// whichever comes first.
    #[test]
    fn checkpoints_carry_both_keys_of_a_rotation_and_no_bad_twin() {
        use base64::Engine as _;
        let (new, _) = SigningKey::generate("new").expect("key");
        let (old, _) = SigningKey::generate("old").expect("key");
        let root = tlog_tiles::record_hash(b"leaf");
        let note = checkpoint_note(&[&new, &old], "plan-intake.test/log", 1, root).expect("note");
        for key in [&new, &old] {
            let pinned = TrustedKeys::parse(key.verifier_key()).expect("keys");
            let checkpoint = verify_checkpoint(&note, &pinned).expect("verifies");
            assert_eq!(checkpoint.signers, [key.key_id()]);
        }
        // A twin of the old key's signature line with its last byte flipped.
        let line = note
            .lines()
            .find(|l| l.starts_with("— old "))
            .expect("the old key's line");
        let (prefix, b64) = line.rsplit_once(' ').expect("a signature");
        let mut bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .expect("base64");
        if let Some(last) = bytes.last_mut() {
            *last ^= 1;
        }
        let twin = format!(
            "{prefix} {}",
            base64::engine::general_purpose::STANDARD.encode(bytes)
        );
        let pinned = TrustedKeys::parse(old.verifier_key()).expect("keys");
        for forged in [
            note.replace(line, &format!("{line}\n{twin}")),
            note.replace(line, &format!("{twin}\n{line}")),
        ] {
            let refused = verify_checkpoint(&forged, &pinned).expect_err("refused");
            assert!(
                refused.contains("old+") || refused.contains("old"),
                "{refused}"
            );
        }
    }

    #[test]
    fn tile_paths_read_as_c2sp_writes_them() {
        let hashes = |level, index, width| TileRequest::Hashes {
            level,
            index,
            width,
        };
        assert_eq!(TileRequest::parse("tile/0/000"), Some(hashes(0, 0, 256)));
        assert_eq!(
            TileRequest::parse("tile/1/x001/x234/067.p/8"),
            Some(hashes(1, 1_234_067, 8))
        );
        assert_eq!(
            TileRequest::parse("tile/entries/x001/002"),
            Some(TileRequest::Entries {
                index: 1002,
                width: 256
            })
        );
        for bad in [
            "tile/0/0",
            "tile/0/001/002",
            "tile/00/000",
            "tile/0/000.p/0",
            "tile/0/000.p/256",
            "tile/64/000",
            "tile/entries/x1/000",
            "checkpoint",
            "tile/0/",
            "tile/0/x000/000",
            "tile/0/000.p/08",
            "tile/0/000.p/+8",
            "tile/entries/x000/001",
        ] {
            assert_eq!(TileRequest::parse(bad), None, "{bad}");
        }
        assert_eq!(
            entry_bundle(&[b"ab".to_vec(), Vec::new()]).expect("bundle"),
            b"\x00\x02ab\x00\x00"
        );
    }
}
