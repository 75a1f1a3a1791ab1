//! Signed receipts. The service's Ed25519 keys are C2SP signed-note keys
//! (`PRIVATE+KEY+name+id+…` in a file or a variable, never in the
//! database; `name+id+…` published); a receipt is signed over its RFC 8785
//! form without `signature` and `outcome`, and the same bytes are its leaf
//! in the receipt log. Anyone holding the published keys checks it offline
//! ([`verify_receipt`]).

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use signed_note::{Signer as _, StandardSigner, StandardVerifier};

use super::receipt::Receipt;

pub use plan_intake_wire::ReceiptSignature;

/// A signature as stored in `plans.receipt_signature`: `key_id` and the
/// signature, one space between.
pub trait StoredSignature: Sized {
    fn stored(&self) -> String;
    /// The stored form read back; `None` for a value not of that form.
    fn from_stored(stored: &str) -> Option<Self>;
}

impl StoredSignature for ReceiptSignature {
    fn stored(&self) -> String {
        format!("{} {}", self.key_id, self.ed25519)
    }

    fn from_stored(stored: &str) -> Option<Self> {
        let (key_id, ed25519) = stored.split_once(' ')?;
        Some(Self {
            key_id: key_id.to_owned(),
            ed25519: ed25519.to_owned(),
        })
    }
}

/// A key the service signs with: its private half, its name and id, and
/// its verifier key. `Debug` shows only the id.
pub struct SigningKey {
    signer: StandardSigner,
    key_id: String,
    verifier_key: String,
}

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SigningKey")
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

/// A key that cannot be used, and why (never the key itself).
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("not a signed-note private key (PRIVATE+KEY+name+id+key): {0}")]
    Malformed(String),
    /// A public key given where the private one belongs.
    #[error(
        "this is a public (verifier) key, not the private one: give the file `signing-keys generate` wrote without `.pub`"
    )]
    PublicWherePrivate,
    #[error("{0} is not a valid key name (no spaces or `+`)")]
    BadName(String),
}

impl SigningKey {
    /// A new key named `name`, from 32 random bytes of the OS-seeded CSPRNG.
    pub fn generate(name: &str) -> Result<(Self, String), KeyError> {
        if !signed_note::is_key_name_valid(name) {
            return Err(KeyError::BadName(name.to_owned()));
        }
        let seed: [u8; 32] = rand::random();
        let public = ed25519_dalek::SigningKey::from_bytes(&seed).verifying_key();
        let verifier_key = signed_note::new_ed25519_verifier_key(name, &public);
        let id = verifier_key
            .split('+')
            .nth(1)
            .unwrap_or_default()
            .to_owned();
        let mut encoded = vec![1u8];
        encoded.extend_from_slice(&seed);
        let private = format!("PRIVATE+KEY+{name}+{id}+{}", BASE64.encode(encoded));
        Ok((Self::from_private(&private)?, private))
    }

    /// A key from its private text (`PRIVATE+KEY+name+id+key`), surrounding
    /// whitespace ignored.
    pub fn from_private(text: &str) -> Result<Self, KeyError> {
        let text = text.trim();
        if !text.starts_with("PRIVATE+KEY+") && StandardVerifier::new(text).is_ok() {
            return Err(KeyError::PublicWherePrivate);
        }
        let signer = StandardSigner::new(text).map_err(|e| KeyError::Malformed(e.to_string()))?;
        // PRIVATE+KEY+name+id+key: the key is base64, which may hold `+`.
        let seed = text
            .splitn(5, '+')
            .nth(4)
            .and_then(|key| BASE64.decode(key).ok())
            .and_then(|bytes| <[u8; 32]>::try_from(bytes.get(1..)?).ok())
            .ok_or_else(|| KeyError::Malformed("its key is not 1 + 32 bytes".to_owned()))?;
        let public = ed25519_dalek::SigningKey::from_bytes(&seed).verifying_key();
        let verifier_key = signed_note::new_ed25519_verifier_key(signer.name(), &public);
        Ok(Self {
            key_id: format!("{}+{:08x}", signer.name(), signer.key_id()),
            signer,
            verifier_key,
        })
    }

    /// `name+id`: what a receipt's signature names.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// `name+id+key`: what `GET /v1/signing-keys` publishes.
    pub fn verifier_key(&self) -> &str {
        &self.verifier_key
    }

    /// The signed-note signer, for checkpoints.
    pub fn note_signer(&self) -> &StandardSigner {
        &self.signer
    }

    /// `receipt`'s signature (deterministic: Ed25519 signs the same bytes
    /// alike every time).
    pub fn sign(&self, receipt: &Receipt) -> Result<ReceiptSignature, String> {
        let form = signed_form(receipt).map_err(|e| e.to_string())?;
        let signature = self.signer.sign(&form).map_err(|e| e.to_string())?;
        Ok(ReceiptSignature {
            key_id: self.key_id.clone(),
            ed25519: BASE64.encode(signature),
        })
    }
}

pub use plan_intake_wire::evidence::{
    BadSignature, KeysError, PublishedKey, PublishedKeys, TrustedKeys, signed_form, verify_receipt,
};

#[cfg(test)]
mod tests {
    use super::*;

    fn receipt() -> Receipt {
        Receipt {
            receipt_id: "rcpt_1".to_owned(),
            maker: "planner-a".to_owned(),
            run_id: "run-é".to_owned(),
            content_hash: "c".repeat(64),
            request_hash: "r".repeat(64),
            approved_inputs: vec!["in-1".to_owned()],
            permissions: vec!["plans:submit".to_owned()],
            received_at: "2026-12-02T10:00:00.000000Z".to_owned(),
            signature: None,
            outcome: Some(crate::intake::Outcome::Created),
            extra: Default::default(),
        }
    }

    #[test]
    fn a_signed_receipt_verifies_and_a_changed_one_does_not() {
        let (key, private) = SigningKey::generate("plan-intake.test").expect("key");
        assert!(private.starts_with("PRIVATE+KEY+plan-intake.test+"));
        let again = SigningKey::from_private(&format!("{private}\n")).expect("read back");
        assert_eq!(again.verifier_key(), key.verifier_key());
        let mut signed = receipt();
        signed.signature = Some(key.sign(&signed).expect("signed"));
        assert_eq!(
            signed.signature,
            again.sign(&receipt()).ok(),
            "deterministic"
        );
        let keys = TrustedKeys::parse(key.verifier_key()).expect("keys");
        assert_eq!(verify_receipt(&signed, &keys), Ok(()));
        signed.outcome = Some(crate::intake::Outcome::Replayed);
        assert_eq!(
            verify_receipt(&signed, &keys),
            Ok(()),
            "outcome is not signed"
        );
        signed.run_id = "run-e".to_owned();
        assert!(matches!(
            verify_receipt(&signed, &keys),
            Err(BadSignature::Mismatch(_))
        ));
        let (other, _) = SigningKey::generate("plan-intake.test").expect("key");
        let strangers = TrustedKeys::parse(other.verifier_key()).expect("keys");
        assert!(matches!(
            verify_receipt(&signed, &strangers),
            Err(BadSignature::UnknownKey(_))
        ));
    }

    #[test]
    fn the_signed_form_is_rfc_8785() {
        let text = String::from_utf8(signed_form(&receipt()).expect("form")).expect("utf-8");
        assert!(text.starts_with(r#"{"approved_inputs":["in-1"],"content_hash":""#));
        assert!(text.contains(r#""run_id":"run-é""#), "{text}");
        assert!(!text.contains("outcome") && !text.contains("signature"));
    }

    /// The example of C2SP signed-note (and Go's `note` package): its
    /// verifier key verifies its signed note.
    #[test]
    fn the_signed_note_spec_example_verifies() {
        let vkey = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW";
        let note = "If you think cryptography is the answer to your problem,\n\
                    then you don't know what your problem is.\n\
                    \n\
                    \u{2014} PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n";
        let skey = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz";
        let key = SigningKey::from_private(skey).expect("the spec's key");
        assert_eq!(key.verifier_key(), vkey);
        assert_eq!(key.key_id(), "PeterNeumann+c74f20a3");
        let keys = TrustedKeys::parse(vkey).expect("keys");
        let parsed = signed_note::Note::from_bytes(note.as_bytes()).expect("a note");
        assert!(parsed.verify(&keys.note_verifiers()).is_ok());
        let forged = note.replace("cryptography", "cryptographY");
        let parsed = signed_note::Note::from_bytes(forged.as_bytes()).expect("a note");
        assert!(parsed.verify(&keys.note_verifiers()).is_err());
    }
}
