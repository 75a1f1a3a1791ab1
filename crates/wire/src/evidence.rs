//! The evidence a reader checks without trusting the service (feature
//! `evidence`): what a receipt's signature covers (which is also its leaf
//! in the receipt log), the published keys, keys a reader pins, a
//! receipt's signature check, and a checkpoint's (a C2SP `tlog-checkpoint`
//! signed note). The server signs and the client verifies with this one
//! module.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Serialize};
use signed_note::{StandardVerifier, Verifier as _};
use tlog_tiles::{Checkpoint, Hash};

use crate::Receipt;

/// What a receipt's signature covers, and its leaf in the receipt log:
/// the receipt's RFC 8785 text without `signature` and `outcome`, unknown
/// members included. (It never holds a raw newline, which every signed
/// note's text ends with, so one key can sign both without one passing
/// for the other.)
pub fn signed_form(receipt: &Receipt) -> Result<Vec<u8>, serde_json::Error> {
    let bare = Receipt {
        signature: None,
        outcome: None,
        ..receipt.clone()
    };
    serde_json_canonicalizer::to_vec(&bare)
}

/// A published key: its verifier key, and when it was in use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PublishedKey {
    /// `name+id`, as receipts' signatures name it
    pub key_id: String,
    /// The C2SP signed-note verifier key: `name+id+base64(0x01 ‖ Ed25519 public key)`
    pub verifier_key: String,
    /// When this key first signed (UTC)
    pub first_used_at: String,
    /// When this key was last seen signing (UTC); it may still be in use
    pub last_used_at: String,
}

/// `GET /v1/signing-keys`: every key that has signed receipts or checkpoints.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PublishedKeys {
    /// The key new receipts are signed with; absent when the service signs none
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signing_now: Option<String>,
    /// Every key that ever signed, so old receipts stay verifiable
    pub keys: Vec<PublishedKey>,
}

/// Keys that cannot be trusted as given (never repeating them: a private
/// key or a token given by mistake ends up in logs otherwise).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeysError {
    /// Not a verifier key.
    #[error("not a signed-note verifier key (name+id+key): {0}")]
    MalformedPublic(String),
    /// A private key given where public ones belong (its line).
    #[error(
        "key {0} of the file is a private key (PRIVATE+KEY+…), not a public one: give the public keys instead, the `.pub` file `signing-keys generate` wrote beside it or what GET /v1/signing-keys answers (keep the private file to the service)"
    )]
    PrivateWherePublic(usize),
}

/// A verifier's key id as receipts name it: `name+id` (hex).
fn id_of(verifier: &StandardVerifier) -> String {
    format!("{}+{:08x}", verifier.name(), verifier.key_id())
}

/// Verifier keys a reader trusts, pinned out of band: what `GET
/// /v1/signing-keys` answered (JSON), or verifier keys one per line (`#`
/// starts a comment).
#[derive(Clone)]
pub struct TrustedKeys {
    /// `(name+id, verifier key, its verifier)`: parsed once, since a
    /// verifying follower checks every receipt (an Ed25519 key's point is
    /// decompressed when it is parsed).
    keys: Vec<(String, String, StandardVerifier)>,
}

impl std::fmt::Debug for TrustedKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.keys.iter().map(|(id, _, _)| id))
            .finish()
    }
}

impl TrustedKeys {
    /// The keys in `text`, each checked to be a verifier key.
    pub fn parse(text: &str) -> Result<Self, KeysError> {
        let vkeys: Vec<String> = match serde_json::from_str::<PublishedKeys>(text) {
            Ok(published) => published
                .keys
                .into_iter()
                .map(|key| key.verifier_key)
                .collect(),
            Err(_) => text
                .lines()
                .map(str::trim)
                .filter(|line| !line.is_empty() && !line.starts_with('#'))
                .map(str::to_owned)
                .collect(),
        };
        let mut keys = Vec::new();
        for (line, vkey) in vkeys.into_iter().enumerate() {
            if vkey.contains("PRIVATE+KEY") {
                return Err(KeysError::PrivateWherePublic(line + 1));
            }
            let verifier = StandardVerifier::new(&vkey)
                .map_err(|e| KeysError::MalformedPublic(format!("key {}: {e}", line + 1)))?;
            keys.push((id_of(&verifier), vkey, verifier));
        }
        Ok(Self { keys })
    }

    /// The keys of `GET /v1/signing-keys`'s answer as a reader that does
    /// not trust them reads it: a key it cannot parse (a kind it does not
    /// know) is left out, not a reason to read none.
    pub fn published(text: &str) -> Result<Self, String> {
        let published: PublishedKeys =
            serde_json::from_str(text).map_err(|e| format!("not the keys' JSON: {e}"))?;
        let keys = published
            .keys
            .into_iter()
            .filter_map(|key| {
                let verifier = StandardVerifier::new(&key.verifier_key).ok()?;
                Some((id_of(&verifier), key.verifier_key, verifier))
            })
            .collect();
        Ok(Self { keys })
    }

    /// No key at all.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether `verifier_key` is one of these, byte for byte.
    pub fn trusts(&self, verifier_key: &str) -> bool {
        self.keys.iter().any(|(_, vkey, _)| vkey == verifier_key)
    }

    /// Whether `key_id` (`name+id`) is one of these.
    pub fn knows(&self, key_id: &str) -> bool {
        self.verifier(key_id).is_some()
    }

    /// The verifier of `key_id`, if trusted.
    fn verifier(&self, key_id: &str) -> Option<&StandardVerifier> {
        self.keys
            .iter()
            .find(|(id, _, _)| id == key_id)
            .map(|(_, _, verifier)| verifier)
    }

    /// Every trusted key's id (`name+id`), as signatures name them.
    pub fn note_verifier_names(&self) -> Vec<String> {
        self.keys.iter().map(|(id, _, _)| id.clone()).collect()
    }

    /// Every trusted key as a signed-note verifier list, for checkpoints.
    pub fn note_verifiers(&self) -> signed_note::VerifierList {
        signed_note::VerifierList::new(
            self.keys
                .iter()
                .map(|(_, _, verifier)| {
                    Box::new(verifier.clone()) as Box<dyn signed_note::Verifier>
                })
                .collect(),
        )
    }
}

/// Why a receipt's signature does not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadSignature {
    /// No `signature` member.
    #[error("the receipt carries no signature")]
    Unsigned,
    /// Signed by a key the reader does not trust.
    #[error("the receipt is signed by {0}, which is not among the trusted keys")]
    UnknownKey(String),
    /// The signature is not base64.
    #[error("the receipt's signature is not base64")]
    NotBase64,
    /// The signature does not match the receipt.
    #[error(
        "the signature by {0} does not match the receipt: it was changed after it was signed, or signed by another key"
    )]
    Mismatch(String),
}

/// Whether `receipt`'s own signature holds under `keys`.
pub fn verify_receipt(receipt: &Receipt, keys: &TrustedKeys) -> Result<(), BadSignature> {
    let signature = receipt.signature.as_ref().ok_or(BadSignature::Unsigned)?;
    let form =
        signed_form(receipt).map_err(|_| BadSignature::Mismatch(signature.key_id.clone()))?;
    verify_receipt_form(receipt, &form, keys)
}

/// [`verify_receipt`] with the receipt's signed form made already (a
/// verifying follower makes it once, for the signature and the leaf).
pub fn verify_receipt_form(
    receipt: &Receipt,
    form: &[u8],
    keys: &TrustedKeys,
) -> Result<(), BadSignature> {
    let signature = receipt.signature.as_ref().ok_or(BadSignature::Unsigned)?;
    let verifier = keys
        .verifier(&signature.key_id)
        .ok_or_else(|| BadSignature::UnknownKey(signature.key_id.clone()))?;
    let bytes = BASE64
        .decode(&signature.ed25519)
        .map_err(|_| BadSignature::NotBase64)?;
    if verifier.verify(form, &bytes) {
        Ok(())
    } else {
        Err(BadSignature::Mismatch(signature.key_id.clone()))
    }
}

/// `GET /v1/checkpoint/extension?size=S&since=P`: the newest checkpoint
/// and what proves it extends the trees a reader holds, in one answer (a
/// verifying follower asks once per page).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CheckpointExtension {
    /// The newest checkpoint: a C2SP `tlog-checkpoint` signed note
    pub checkpoint: String,
    /// The RFC 6962 consistency proof from the tree of `size` leaves to
    /// the checkpoint's tree, base64 hashes (empty for a size of 0 or the
    /// checkpoint's own)
    pub proof: Vec<String>,
    /// The same from the tree of `since` leaves, when asked and at most
    /// the checkpoint's size (absent otherwise: a checkpoint older than a
    /// tree the reader holds proves nothing about it)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since_proof: Option<Vec<String>>,
}

/// `GET /v1/checkpoint/start?size=N`: where a verifying reader starts at
/// a checkpoint of N leaves it trusts. Nothing here need be trusted: the
/// edge is held to the checkpoint's root, and a cursor elsewhere hands
/// receipts that are not the leaves after N.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CheckpointStart {
    /// The roots of the perfect subtrees of the tree of N leaves, largest
    /// (leftmost) first, base64: they hash together to its root
    pub edge: Vec<String>,
    /// The feed cursor after leaf N - 1 (the leaf index is the feed
    /// position): `after` for the page that starts at leaf N
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub after: crate::feed::FeedCursor,
}

/// A checkpoint whose signature holds under trusted keys.
#[derive(Debug, Clone)]
pub struct VerifiedCheckpoint {
    /// The log's origin line.
    pub origin: String,
    /// How many leaves the tree holds.
    pub size: u64,
    /// The tree's RFC 6962 root hash.
    pub root: Hash,
    /// Who signed it (`name+id`, each verified).
    pub signers: Vec<String>,
}

/// `note` as a checkpoint signed by at least one of `keys`, every
/// signature it carries by a trusted key holding (a note with a valid and
/// an invalid signature by the same key is refused).
pub fn verify_checkpoint(note: &str, keys: &TrustedKeys) -> Result<VerifiedCheckpoint, String> {
    let parsed = signed_note::Note::from_bytes(note.as_bytes())
        .map_err(|e| format!("not a signed note: {e}"))?;
    let verifiers = keys.note_verifiers();
    let signatures = note
        .as_bytes()
        .get(parsed.text().len() + 1..)
        .unwrap_or_default();
    let (signed, _) = parsed.verify(&verifiers).map_err(|e| {
        // Named, so a reader pinned to other keys (a rotation it was not
        // told of) knows which `.pub` it lacks.
        let signers: Vec<String> = signatures
            .split(|&b| b == b'\n')
            .filter_map(|line| signed_note::Signature::from_bytes(line).ok())
            .map(|s| format!("{}+{:08x}", s.name(), s.id()))
            .collect();
        let pinned = keys.note_verifier_names();
        format!(
            "its signature does not hold under the trusted keys ({e}): it is signed by {} and the reader pins {}: a key rotation or a new log the reader was not given the key of (pin that key's .pub beside the old one), or not this log's checkpoint",
            if signers.is_empty() { "no key".to_owned() } else { signers.join(", ") },
            if pinned.is_empty() { "no key".to_owned() } else { pinned.join(", ") },
        )
    })?;
    // The reader above checks one signature per key; every one must hold.
    for line in signatures.split_inclusive(|&b| b == b'\n') {
        let Ok(signature) =
            signed_note::Signature::from_bytes(line.strip_suffix(b"\n").unwrap_or(line))
        else {
            continue;
        };
        if let Ok(verifier) =
            signed_note::Verifiers::verifier(&verifiers, signature.name(), signature.id())
            && !verifier.verify(parsed.text(), signature.signature())
        {
            return Err(format!(
                "it carries a signature by {}+{:08x} that does not hold beside one that does",
                signature.name(),
                signature.id()
            ));
        }
    }
    let checkpoint = Checkpoint::from_bytes(parsed.text())
        .map_err(|_| "its text is not a checkpoint (origin, size, root hash)".to_owned())?;
    Ok(VerifiedCheckpoint {
        origin: checkpoint.origin().to_owned(),
        size: checkpoint.size(),
        root: *checkpoint.hash(),
        signers: signed
            .iter()
            .map(|s| format!("{}+{:08x}", s.name(), s.id()))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key of a kind the reader cannot read leaves the others usable.
    #[test]
    fn a_published_key_that_cannot_be_read_is_left_out() {
        let key = |verifier_key: &str| PublishedKey {
            key_id: "unused".to_owned(),
            verifier_key: verifier_key.to_owned(),
            first_used_at: "2026-12-04T00:00:00Z".to_owned(),
            last_used_at: "2026-12-04T00:00:00Z".to_owned(),
        };
        let answer = serde_json::to_string(&PublishedKeys {
            signing_now: None,
            keys: vec![
                key("future+00000001+AQID"),
                key("PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"),
            ],
        })
        .expect("json");
        let published = TrustedKeys::published(&answer).expect("read");
        assert!(published.knows("PeterNeumann+c74f20a3"));
        assert!(!published.knows("future+00000001"));
        assert!(
            TrustedKeys::parse(&answer).is_err(),
            "a pinned list is strict"
        );
        assert!(TrustedKeys::published("<html>cached</html>").is_err());
    }
}
