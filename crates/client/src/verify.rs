//! The verified feed (feature `verify`): a follower that hands on a
//! receipt only once it is proven to be the next leaf of the signed
//! receipt log after the last one it handed on. The keys are pinned by
//! the reader; nothing the service says at run time adds one.
//!
//! A receipt signed by a key the reader has not pinned (the new key of a
//! rotation) is held to its leaf, which checkpoints signed by a pinned
//! key prove (they carry the old key's signature beside the new one's
//! while it is rotated out), and its signature to the key the service
//! publishes under that id: a row written around the service under a
//! made-up key, or with a forged signature, does not pass.
//!
//! What it holds between pages ([`Verified`], saved with the cursor): how
//! many leaves it handed on, the right edge of their tree (the roots of
//! its perfect subtrees, so the next leaves extend it without the rest),
//! and the last checkpoint it met. Each page: every receipt's signature
//! under the pinned keys; its leaves (each receipt's signed form) appended
//! to the tree; then one request (`GET /v1/checkpoint/extension`) for the
//! newest checkpoint with two consistency proofs: that the tree extended
//! is a prefix of the checkpoint's, and that the checkpoint extends the
//! last one saved. A receipt dropped, added, repeated, reordered or
//! changed, a cursor jumped ahead, a checkpoint of another log or a log
//! rolled back each fail one of these.

use serde_json::value::RawValue;
use tlog_tiles::{Hash, node_hash, record_hash};

use plan_intake_wire::Receipt;
use plan_intake_wire::evidence::{
    BadSignature, CheckpointExtension, TrustedKeys, VerifiedCheckpoint, signed_form,
    verify_checkpoint, verify_receipt_form,
};

/// What a verifying follower proved so far; saved with each cursor.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Verified {
    /// Leaves handed on: the log index of the next receipt.
    pub size: u64,
    /// Roots of the perfect subtrees of the tree of `size` leaves, the
    /// largest (leftmost) first.
    edge: Vec<Hash>,
    /// The last checkpoint met: its size, root and origin.
    checkpoint: Option<(u64, Hash, String)>,
}

/// Why a page cannot be handed on: what was proven (the log index of the
/// first leaf that fails, where known) and which check failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Unverified {
    /// One line: the log index, the check.
    pub message: String,
    /// The page's leaves as a whole are not the log's: which one first is
    /// found with [`Extended::locate`].
    pub locatable: bool,
}

fn unverified(message: String) -> Unverified {
    Unverified {
        message,
        locatable: false,
    }
}

/// A page's leaves appended, not yet proven in a checkpoint.
#[derive(Debug, Clone)]
pub struct Extended {
    before: Verified,
    after: Verified,
    /// The leaves' hashes, in order (to locate a failure).
    leaves: Vec<Hash>,
    /// Receipts signed by a key the reader does not pin: log index, the
    /// receipt and its signed form.
    unpinned: Vec<(u64, Receipt, Vec<u8>)>,
    /// Log indexes of receipts kept before the log's first key (unsigned,
    /// held to their leaves alone).
    unsigned: Vec<u64>,
}

impl Extended {
    /// Whether each key the page's receipts are signed by and the reader
    /// does not pin is among `published`.
    pub fn unpinned_known(&self, published: Option<&TrustedKeys>) -> bool {
        self.unpinned.iter().all(|(_, receipt, _)| {
            published.is_some_and(|published| {
                receipt
                    .signature
                    .as_ref()
                    .is_some_and(|s| published.knows(&s.key_id))
            })
        })
    }

    /// The keys the page's receipts are signed by that the reader does not
    /// pin, each once.
    pub fn unpinned_keys(&self) -> Vec<&str> {
        let mut ids: Vec<&str> = self
            .unpinned
            .iter()
            .filter_map(|(_, receipt, _)| Some(receipt.signature.as_ref()?.key_id.as_str()))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Where the first receipt under a key the reader does not pin stands:
    /// `log index N (receipt R)`.
    pub fn first_unpinned(&self) -> Option<String> {
        self.unpinned.first().map(|(index, receipt, _)| {
            format!("log index {index} (receipt {})", receipt.receipt_id)
        })
    }

    /// Each receipt signed by a key the reader does not pin (a rotation's
    /// new one), its signature checked under the key published with that
    /// id (`published`: what `GET /v1/signing-keys` answered). That adds no
    /// trust: the receipt is still held to the leaf a checkpoint signed by
    /// a pinned key proves. The appender logs what the table holds, so
    /// without it a row written around the service under a made-up key,
    /// or with a forged signature under a published one, would pass as a
    /// rotation's.
    pub fn check_unpinned(&self, published: &TrustedKeys) -> Result<(), Unverified> {
        for (index, receipt, form) in &self.unpinned {
            verify_receipt_form(receipt, form, published).map_err(|e| {
                let why = match e {
                    BadSignature::UnknownKey(key_id) => format!(
                        "signed by key {key_id}, which the reader does not pin and GET /v1/signing-keys does not list: written around the service"
                    ),
                    other => format!(
                        "signature check under the key the service publishes (not pinned by the reader): {other}"
                    ),
                };
                unverified(format!(
                    "log index {index} (receipt {}): {why}",
                    receipt.receipt_id
                ))
            })?;
        }
        Ok(())
    }

    /// The log indexes of the page's receipts kept before the log's first
    /// key: unsigned, each held to its leaf under a signed checkpoint.
    pub fn unsigned(&self) -> &[u64] {
        &self.unsigned
    }

    /// The size the checkpoint must prove: leaves handed on after this page.
    pub fn size(&self) -> u64 {
        self.after.size
    }

    /// The size of the last checkpoint saved, to be proven extended.
    pub fn since(&self) -> Option<u64> {
        self.before.checkpoint.as_ref().map(|(size, _, _)| *size)
    }

    /// `&since=P` for the extension request, or nothing.
    pub(crate) fn since_query(&self) -> String {
        self.since()
            .map(|since| format!("&since={since}"))
            .unwrap_or_default()
    }

    /// The root of the tree of the first `size` leaves of this page's
    /// tree (from the state before the page and its leaves).
    fn root_at(&self, size: u64) -> Option<Hash> {
        let mut tree = self.before.clone();
        let take = usize::try_from(size.checked_sub(tree.size)?).ok()?;
        for leaf in self.leaves.get(..take)? {
            tree.push(*leaf);
        }
        tree.root()
    }
}

impl Extended {
    /// The first leaf of the page that is not the log's, found by asking
    /// (`ask(size)`: the extension answer for a tree of `size` leaves) for
    /// halves of the page: the smallest prefix the log does not hold ends
    /// with it. `None` if an answer cannot be had or checked.
    pub fn locate(
        &self,
        keys: &TrustedKeys,
        mut ask: impl FnMut(u64) -> Option<CheckpointExtension>,
    ) -> Option<String> {
        let mut locator = self.locator(keys);
        while let Some(size) = locator.next_size() {
            if !locator.answered(&ask(size)?) {
                return None;
            }
        }
        Some(locator.found())
    }

    /// The search [`Extended::locate`] runs, one answer at a time (for a
    /// caller that awaits its answers).
    pub fn locator<'a>(&'a self, keys: &'a TrustedKeys) -> Locator<'a> {
        Locator {
            extended: self,
            keys,
            good: self.before.size,
            bad: self.after.size,
            against: 0,
        }
    }
}

/// A search for the first leaf of a page that is not the log's: prefixes
/// up to `good` leaves are the log's, up to `bad` not.
pub struct Locator<'a> {
    extended: &'a Extended,
    keys: &'a TrustedKeys,
    good: u64,
    bad: u64,
    /// The size of the last checkpoint an answer was checked against.
    against: u64,
}

impl Locator<'_> {
    /// The tree size to ask about next; `None` once found.
    pub fn next_size(&self) -> Option<u64> {
        (self.bad - self.good > 1).then(|| self.good + (self.bad - self.good) / 2)
    }

    /// The answer for [`Locator::next_size`]; `false` if it cannot be
    /// checked (the search ends there).
    pub fn answered(&mut self, answer: &CheckpointExtension) -> bool {
        let Some(middle) = self.next_size() else {
            return false;
        };
        let (Ok(checkpoint), Ok(proof), Some(ours)) = (
            verify_checkpoint(&answer.checkpoint, self.keys),
            parse_proof(&answer.proof),
            self.extended.root_at(middle),
        ) else {
            return false;
        };
        self.against = checkpoint.size;
        if prefix_holds(&proof, checkpoint.size, checkpoint.root, middle, ours).is_ok() {
            self.good = middle;
        } else {
            self.bad = middle;
        }
        true
    }

    /// The line naming the leaf found.
    pub fn found(&self) -> String {
        let index = self.bad - 1;
        let against = if self.against == 0 {
            String::new()
        } else {
            format!(
                " (consistency with the checkpoint of {} leaves)",
                self.against
            )
        };
        format!(
            "log index {index}: the receipt handed there is not the log's leaf {index}{against}; every receipt before it was verified"
        )
    }
}

impl Verified {
    /// The size of the last checkpoint met: how many receipts the log held
    /// then.
    pub fn logged(&self) -> Option<u64> {
        self.checkpoint.as_ref().map(|(size, _, _)| *size)
    }

    /// The tree's root (`None` for the empty tree).
    fn root(&self) -> Option<Hash> {
        let mut hashes = self.edge.iter().rev();
        let last = *hashes.next()?;
        Some(hashes.fold(last, |right, left| node_hash(*left, right)))
    }

    fn push(&mut self, leaf: Hash) {
        self.edge.push(leaf);
        self.size += 1;
        // Each trailing 1 bit of the new size merges two equal subtrees.
        let mut merges = self.size.trailing_zeros();
        while merges > 0 {
            let right = self.edge.pop();
            let left = self.edge.pop();
            if let (Some(left), Some(right)) = (left, right) {
                self.edge.push(node_hash(left, right));
            }
            merges -= 1;
        }
    }

    /// Lines to save after the cursor's: `verified SIZE`, `edge HASH…`,
    /// `checkpoint SIZE ROOT ORIGIN`.
    pub fn to_lines(&self) -> String {
        let mut text = format!("verified {}\nedge", self.size);
        for hash in &self.edge {
            text.push(' ');
            text.push_str(&hash.to_string());
        }
        text.push('\n');
        if let Some((size, root, origin)) = &self.checkpoint {
            text.push_str(&format!("checkpoint {size} {root} {origin}\n"));
        }
        text
    }

    /// The state saved by [`Verified::to_lines`]; `None` if `text` holds
    /// none (a cursor saved by a follower that did not verify).
    pub fn from_lines(text: &str) -> Result<Option<Self>, String> {
        let mut state = None::<Self>;
        for line in text.lines() {
            let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
            match word {
                "verified" => {
                    let size = rest
                        .parse()
                        .map_err(|_| format!("{line:?} is not `verified SIZE`"))?;
                    state = Some(Self {
                        size,
                        ..Self::default()
                    });
                }
                "edge" => {
                    let state = state.as_mut().ok_or("`edge` before `verified`")?;
                    state.edge = rest
                        .split_whitespace()
                        .map(|h| Hash::parse_hash(h).map_err(|_| format!("{h:?} is not a hash")))
                        .collect::<Result<_, _>>()?;
                }
                "checkpoint" => {
                    let state = state.as_mut().ok_or("`checkpoint` before `verified`")?;
                    let mut parts = rest.splitn(3, ' ');
                    let size = parts.next().and_then(|s| s.parse().ok());
                    let root = parts.next().and_then(|h| Hash::parse_hash(h).ok());
                    let origin = parts.next();
                    match (size, root, origin) {
                        (Some(size), Some(root), Some(origin)) => {
                            state.checkpoint = Some((size, root, origin.to_owned()));
                        }
                        _ => return Err(format!("{line:?} is not `checkpoint SIZE ROOT ORIGIN`")),
                    }
                }
                _ => {}
            }
        }
        if let Some(state) = &state
            && state.edge.len() != state.size.count_ones() as usize
        {
            return Err(format!(
                "the saved edge holds {} hashes, not the {} of a tree of {} leaves",
                state.edge.len(),
                state.size.count_ones(),
                state.size
            ));
        }
        Ok(state)
    }

    /// The proof at a checkpoint the reader trusts (`note`, its signature
    /// checked under `keys`), from the service's answer where to start
    /// there: its edge must hash to the checkpoint's root. Receipts before
    /// it are not verified; the ones after it are, as from the start.
    pub fn at_checkpoint(
        note: &str,
        keys: &TrustedKeys,
        start: &plan_intake_wire::evidence::CheckpointStart,
    ) -> Result<Verified, Unverified> {
        let checkpoint = verify_checkpoint(note, keys)
            .map_err(|e| unverified(format!("the starting checkpoint: signature check: {e}")))?;
        let size = checkpoint.size;
        let fail = |check: &str| {
            unverified(format!(
                "log index {size} (the starting checkpoint's end; nothing handed on): {check}"
            ))
        };
        let edge = parse_proof(&start.edge).map_err(|e| fail(&format!("the tree's edge: {e}")))?;
        let state = Verified {
            size,
            edge,
            checkpoint: Some((size, checkpoint.root, checkpoint.origin)),
        };
        if state.edge.len() != size.count_ones() as usize
            || state.root().unwrap_or(tlog_tiles::EMPTY_HASH) != checkpoint.root
        {
            return Err(fail(
                "the service's edge of the tree does not hash to the checkpoint's root",
            ));
        }
        Ok(state)
    }

    /// Whether the service's newest checkpoint (`None`: it has none)
    /// still holds what this proof verified: the same log, at least as many
    /// leaves as were handed on and as the checkpoint saved, and the same
    /// root at that checkpoint's size. Fewer is a log rolled back (a
    /// restore, a failover that lost commits): nothing the service does
    /// later can bring those leaves back as they were.
    pub fn held_by(&self, newest: Option<&VerifiedCheckpoint>) -> Result<(), Unverified> {
        let held = self.size.max(self.logged().unwrap_or(0));
        let rolled_back = |newest_size: u64, what: String| {
            unverified(format!(
                "log index {newest_size}: {what}, but {held} verified before (the receipts handed on to log index {} and a checkpoint of {held}): the log was rolled back (a restore, or a failover that lost commits); receipts at log indexes {newest_size} to {} may come again as others",
                self.size.saturating_sub(1),
                held - 1
            ))
        };
        let Some(newest) = newest else {
            return match held {
                0 => Ok(()),
                _ => Err(rolled_back(
                    0,
                    "the service has no signed checkpoint".to_owned(),
                )),
            };
        };
        if let Some((size, root, origin)) = &self.checkpoint {
            if newest.origin != *origin {
                return Err(unverified(format!(
                    "log index 0: the service's newest checkpoint is of the log {:?}, not {origin:?}: another deployment's",
                    newest.origin
                )));
            }
            if newest.size == *size && newest.root != *root {
                return Err(unverified(format!(
                    "log index {}: the service's newest checkpoint of {size} leaves has another root than the one verified before: the log forked at or before this index",
                    size.saturating_sub(1)
                )));
            }
        }
        if newest.size < held {
            return Err(rolled_back(
                newest.size,
                format!(
                    "the service's newest checkpoint holds {} receipts",
                    newest.size
                ),
            ));
        }
        Ok(())
    }

    /// The service's answer where to start after this proof's last leaf
    /// (`GET /v1/checkpoint/start`) agrees with what was verified: its
    /// edge is this tree's.
    pub fn check_start(
        &self,
        start: &plan_intake_wire::evidence::CheckpointStart,
    ) -> Result<(), Unverified> {
        let edge = parse_proof(&start.edge).map_err(|e| {
            unverified(format!(
                "log index {}: the service's edge of the tree: {e}",
                self.size
            ))
        })?;
        if edge != self.edge {
            return Err(unverified(format!(
                "log index {}: the service's edge of the tree of {} leaves is not the one verified: the log forked before this index",
                self.size, self.size
            )));
        }
        Ok(())
    }

    /// An empty page after this proof: refused while a checkpoint met
    /// before holds receipts beyond it (an honest feed gives every logged
    /// receipt; this one withholds some, or its cursor moved).
    pub fn check_empty(&self) -> Result<(), Unverified> {
        match self.logged() {
            Some(logged) if logged > self.size => Err(unverified(format!(
                "log index {}: the feed gives no receipt after it, but a checkpoint verified before holds {logged}: receipts withheld",
                self.size
            ))),
            _ => Ok(()),
        }
    }

    /// Checks each entry's signature and appends its leaf. `expand`: each
    /// entry is `{receipt, …}`. Every receipt must be signed.
    pub fn extend(
        &self,
        keys: &TrustedKeys,
        entries: &[Box<RawValue>],
        expand: bool,
    ) -> Result<Extended, Unverified> {
        self.extend_after_prelude(keys, entries, expand, 0)
    }

    /// [`Verified::extend`], where the log's first `unsigned_prelude`
    /// leaves may carry no signature: receipts kept before the log's first
    /// key, each held to its leaf alone. The count is the reader's to give
    /// (out of band, as `plan-intake audit` reports it): a leaf is the
    /// receipt's form without its signature, so no checkpoint says whether
    /// one was there, and a count taken from the service or the feed would
    /// let anything between them strip signatures unseen.
    pub fn extend_after_prelude(
        &self,
        keys: &TrustedKeys,
        entries: &[Box<RawValue>],
        expand: bool,
        unsigned_prelude: u64,
    ) -> Result<Extended, Unverified> {
        let mut after = self.clone();
        let mut leaves = Vec::with_capacity(entries.len());
        let mut unpinned = Vec::new();
        let mut unsigned = Vec::new();
        for entry in entries {
            let index = after.size;
            let receipt = receipt_of(entry, expand)
                .map_err(|why| unverified(format!("log index {index}: {why}")))?;
            let leaf = signed_form(&receipt).map_err(|e| {
                unverified(format!(
                    "log index {index}: its signed form cannot be made: {e}"
                ))
            })?;
            match verify_receipt_form(&receipt, &leaf, keys) {
                Ok(()) => {}
                // A key the reader has not pinned yet (a rotation's new
                // one): the receipt is still held to the leaf a checkpoint
                // signed by a pinned key proves, like every other, and its
                // signature to the key published under that id
                // (`Extended::check_unpinned`).
                Err(BadSignature::UnknownKey(_)) => {
                    unpinned.push((index, receipt.clone(), leaf.clone()));
                }
                // Kept before the log's first key, as the reader says: no
                // signature to check, the leaf still held to a signed
                // checkpoint like every other.
                Err(BadSignature::Unsigned) if index < unsigned_prelude => unsigned.push(index),
                Err(BadSignature::Unsigned) => {
                    return Err(unverified(format!(
                        "log index {index} (receipt {}): it carries no signature. Only the receipts a deployment kept before its log's first key may (`plan-intake audit` counts them; give that count with --unsigned-prelude N); any other was written around the service, by an instance started without --signing-key, or stripped on the way",
                        receipt.receipt_id
                    )));
                }
                Err(e) => {
                    return Err(unverified(format!(
                        "log index {index} (receipt {}): signature check: {e}",
                        receipt.receipt_id
                    )));
                }
            }
            let hash = record_hash(&leaf);
            leaves.push(hash);
            after.push(hash);
        }
        Ok(Extended {
            before: self.clone(),
            after,
            leaves,
            unpinned,
            unsigned,
        })
    }

    /// The page's tree proven a prefix of the newest checkpoint, and that
    /// checkpoint proven to extend the last one saved: the state to save.
    pub fn prove(
        extended: &Extended,
        answer: &CheckpointExtension,
        keys: &TrustedKeys,
    ) -> Result<Verified, Unverified> {
        let first = extended.before.size;
        let last = extended.after.size.saturating_sub(1);
        let fail = |check: String| {
            unverified(format!(
                "log index {first} (the page's first, to {last}; every receipt before it verified): {check}"
            ))
        };
        let checkpoint = verify_checkpoint(&answer.checkpoint, keys)
            .map_err(|e| fail(format!("checkpoint signature check: {e}")))?;
        let (size, root) = (checkpoint.size, checkpoint.root);
        let mut proven = extended.after.clone();
        if let Some((saved, saved_root, origin)) = &extended.before.checkpoint {
            if *origin != checkpoint.origin {
                return Err(fail(format!(
                    "the checkpoint is of another log (origin {:?}, not {origin:?})",
                    checkpoint.origin
                )));
            }
            if size < *saved {
                return Err(fail(format!(
                    "the newest checkpoint ({size} leaves) is older than one verified before ({saved} leaves): the log was rolled back"
                )));
            }
            let since = parse_proof(answer.since_proof.as_deref().unwrap_or_default())
                .map_err(|e| fail(format!("consistency with the saved checkpoint: {e}")))?;
            prefix_holds(&since, size, root, *saved, *saved_root).map_err(|()| {
                fail(format!(
                    "the checkpoint of {size} leaves does not extend the one of {saved} saved before (a fork)"
                ))
            })?;
        }
        if size < extended.after.size {
            return Err(fail(format!(
                "the newest checkpoint holds {size} leaves, fewer than the page reaches"
            )));
        }
        let proof = parse_proof(&answer.proof).map_err(|e| fail(format!("consistency: {e}")))?;
        let ours = extended.after.root().unwrap_or(root);
        if prefix_holds(&proof, size, root, extended.after.size, ours).is_err() {
            return Err(Unverified {
                message: format!(
                    "log indexes {first} to {last}: the receipts are not the log's leaves there, in that order (consistency with the checkpoint of {size} leaves): one was dropped, added, repeated, reordered or changed"
                ),
                locatable: true,
            });
        }
        proven.checkpoint = Some((size, root, checkpoint.origin));
        Ok(proven)
    }
}

/// Whether the tree of `old` leaves with root `old_root` is a prefix of
/// the tree of `size` leaves with root `root`.
fn prefix_holds(proof: &[Hash], size: u64, root: Hash, old: u64, old_root: Hash) -> Result<(), ()> {
    match old {
        0 => Ok(()),
        _ if old == size => (proof.is_empty() && old_root == root)
            .then_some(())
            .ok_or(()),
        _ => tlog_tiles::check_tree(&proof.to_vec(), size, root, old, old_root).map_err(|_| ()),
    }
}

fn parse_proof(lines: &[String]) -> Result<Vec<Hash>, String> {
    lines
        .iter()
        .map(|h| Hash::parse_hash(h).map_err(|_| format!("{h:?} is not a base64 hash")))
        .collect()
}

/// The receipt in a feed entry, read as the wire type reads it (a member
/// given twice refused; unknown members kept, and so signed).
fn receipt_of(entry: &RawValue, expand: bool) -> Result<Receipt, String> {
    if expand {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Expanded<'a> {
            #[serde(borrow)]
            receipt: &'a RawValue,
            #[serde(borrow)]
            approved_inputs: &'a RawValue,
            #[serde(borrow)]
            content: &'a RawValue,
        }
        let expanded: Expanded = serde_json::from_str(entry.get())
            .map_err(|e| format!("not a plan with its receipt: {e}"))?;
        let receipt = receipt_of(expanded.receipt, false)?;
        // The plan is held to the hashes its (signed) receipt was given.
        let hashes = plan_intake_wire::hashing::hashes_of_stored(
            expanded.approved_inputs.get(),
            expanded.content.get(),
            &receipt.run_id,
        );
        if hashes.content_hash != receipt.content_hash
            || hashes.request_hash != receipt.request_hash
        {
            return Err(format!(
                "receipt {}: its plan's content or approved inputs are not what the receipt was given for (they hash to {})",
                receipt.receipt_id, hashes.content_hash
            ));
        }
        return Ok(receipt);
    }
    Receipt::parse(entry.get()).map_err(|e| format!("not a receipt: {e}"))
}
