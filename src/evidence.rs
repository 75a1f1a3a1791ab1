//! The evidence commands: `signing-keys generate`, `receipts verify`
//! (offline: files only) and `audit` (the log recomputed from the tables).
//! Each returns what to print and the exit status.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::intake::receipt_log;
use crate::intake::signing::{SigningKey, TrustedKeys};
use crate::storage::{Database, MigrateOnOpen, PoolOptions};

/// Exit status of a check that found the evidence does not hold (sysexits' EX_DATAERR).
pub const EXIT_UNVERIFIED: u8 = 65;

/// A command that could not run: what to say, and the exit status.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct EvidenceError {
    pub message: String,
    pub exit: u8,
}

fn fail(exit: u8, message: impl Into<String>) -> EvidenceError {
    EvidenceError {
        message: message.into(),
        exit,
    }
}

fn read(path: &Path, what: &str) -> Result<String, EvidenceError> {
    std::fs::read_to_string(path)
        .map_err(|e| fail(66, format!("cannot read {what} {}: {e}", path.display())))
}

/// Reads a signing key from `path` (the key alone, surrounding white space ignored).
pub fn load_key_file(path: &Path) -> Result<Arc<SigningKey>, EvidenceError> {
    use std::os::unix::fs::PermissionsExt as _;
    let text = read(path, "the signing key")?;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        tracing::warn!(
            file = %path.display(),
            "the signing key file may be read by others than its owner: chmod 600 it"
        );
    }
    SigningKey::from_private(&text)
        .map(Arc::new)
        .map_err(|e| fail(1, format!("signing key {}: {e}", path.display())))
}

/// Reads a signing key from the environment variable `name`.
pub fn load_key_env(name: &str) -> Result<Arc<SigningKey>, EvidenceError> {
    let text = std::env::var(name).map_err(|_| {
        fail(
            1,
            format!("the environment variable {name} holds no signing key"),
        )
    })?;
    SigningKey::from_private(&text)
        .map(Arc::new)
        .map_err(|e| fail(1, format!("signing key in {name}: {e}")))
}

/// Writes a new key pair: `out` (private, mode 0600) and `out.pub`. Never
/// overwrites. Returns the line to print.
pub fn generate(out: &Path, name: &str) -> Result<String, EvidenceError> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let (key, private) = SigningKey::generate(name).map_err(|e| fail(2, e.to_string()))?;
    let public: PathBuf = format!("{}.pub", out.display()).into();
    for path in [out, public.as_path()] {
        if path.exists() {
            return Err(fail(
                73,
                format!("{} exists: not overwritten", path.display()),
            ));
        }
    }
    let write = |path: &Path, text: &str, mode: u32| {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(path)
            .and_then(|mut file| {
                file.write_all(text.as_bytes())?;
                file.write_all(b"\n")?;
                file.sync_all()
            })
            .map_err(|e| fail(73, format!("cannot write {}: {e}", path.display())))
    };
    write(out, &private, 0o600)?;
    write(&public, key.verifier_key(), 0o644)?;
    Ok(format!(
        "wrote {} (private, keep it out of the database) and {} (public): key {}",
        out.display(),
        public.display(),
        key.key_id()
    ))
}

/// The keys in `path`, pinned by the reader (a private key refused as one).
pub fn trusted_keys(path: &Path) -> Result<TrustedKeys, EvidenceError> {
    let keys = TrustedKeys::parse(&read(path, "the keys")?)
        .map_err(|e| fail(EXIT_UNVERIFIED, format!("{}: {e}", path.display())))?;
    if keys.is_empty() {
        return Err(fail(
            EXIT_UNVERIFIED,
            format!("{} holds no key", path.display()),
        ));
    }
    Ok(keys)
}

/// `receipts verify`: the line to print when everything holds.
pub fn verify(receipt: &Path, keys: &Path, proof: Option<&Path>) -> Result<String, EvidenceError> {
    let keys = trusted_keys(keys)?;
    let text = read(receipt, "the receipt")?;
    let proof_text = proof.map(|p| read(p, "the proof")).transpose()?;
    let verified = receipt_log::verify_offline(&text, &keys, proof_text.as_deref())
        .map_err(|reason| fail(EXIT_UNVERIFIED, format!("{}: {reason}", receipt.display())))?;
    Ok(match verified.included {
        None => format!(
            "receipt {}: signature by {} holds",
            verified.receipt_id, verified.key_id
        ),
        Some((index, checkpoint)) => format!(
            "receipt {}: signature by {} holds; leaf {index} of {} at {} leaves (checkpoint signed by {})",
            verified.receipt_id,
            verified.key_id,
            checkpoint.origin,
            checkpoint.size,
            checkpoint.signers.join(", ")
        ),
    })
}

/// `audit`: every finding's line, and a summary last; `Err` when anything
/// was found (exit 65) or the audit could not run.
pub fn audit(
    database_url: &str,
    keys: &Path,
    checkpoints: &[PathBuf],
) -> Result<Vec<String>, (Vec<String>, EvidenceError)> {
    let no_lines = |e: EvidenceError| (Vec::new(), e);
    let keys = trusted_keys(keys).map_err(no_lines)?;
    let mut extra = Vec::new();
    for path in checkpoints {
        extra.push((
            path.display().to_string(),
            read(path, "the checkpoint").map_err(no_lines)?,
        ));
    }
    let db = owner_database(database_url).map_err(no_lines)?;
    let report = receipt_log::audit(&db, &keys, &extra)
        .map_err(|e| no_lines(fail(1, crate::report::chain(&e))))?;
    let mut lines = report.findings.clone();
    if report.unsigned_prelude > 0 {
        lines.push(format!(
            "audit: the first {n} receipts in the feed were kept before the log's first key, unsigned: a verifying reader from the start passes `follow --verify --unsigned-prelude {n}`",
            n = report.unsigned_prelude
        ));
    }
    let summary = format!(
        "audit: {} plans ({} unsigned), {} leaves, {} checkpoints: {}",
        report.plans,
        report.unsigned,
        report.leaves,
        report.checkpoints,
        if report.findings.is_empty() {
            "the log holds".to_owned()
        } else {
            format!("{} finding(s)", report.findings.len())
        }
    );
    if report.findings.is_empty() {
        lines.push(summary);
        Ok(lines)
    } else {
        Err((lines, fail(EXIT_UNVERIFIED, summary)))
    }
}

/// The database as its owner's one-off commands open it: one connection,
/// no feed listener, nothing migrated (a pending migration refuses).
fn owner_database(database_url: &str) -> Result<Database, EvidenceError> {
    let options = PoolOptions {
        max_size: 1,
        feed_listener: false,
        ..PoolOptions::default()
    };
    Database::open(database_url, &options, MigrateOnOpen::RequireNonePending)
        .map_err(|e| fail(1, crate::report::chain(&e)))
}

/// sysexits' EX_TEMPFAIL: try again once every instance is stopped.
const EXIT_TEMPFAIL: u8 = 75;

/// `receipts rehash`: the log's stored hashes recomputed from its leaves
/// and written back, only where they make the tree of its newest signed
/// checkpoint (the stuck-log runbook's mend for a hash row changed by
/// hand). Without `yes` nothing is written: exit 2, saying what would be.
pub fn rehash(database_url: &str, yes: bool) -> Result<String, EvidenceError> {
    let db = owner_database(database_url)?;
    let mut conn = db.conn().map_err(|e| fail(1, crate::report::chain(&e)))?;
    use crate::storage::receipt_log::RewriteError;
    let rewritten = crate::storage::receipt_log::rewrite_hashes(
        &mut conn,
        |state_size, leaves, newest, stored| match receipt_log::recomputed_hashes(
            state_size, leaves, newest, stored,
        )
        .map_err(RewriteError::Refused)?
        {
            Some((_, said)) if !yes => Err(RewriteError::WouldWrite(format!(
                "would rewrite {said}; nothing was written: stop every instance, then run it again with --yes"
            ))),
            Some((hashes, said)) => Ok(Some((hashes, format!("rewrote {said}")))),
            None => Ok(None),
        },
    );
    match rewritten {
        Ok(Some(said)) => Ok(said),
        Ok(None) => {
            Ok("the receipt log's stored hashes are its leaves': nothing to rewrite".to_owned())
        }
        Err(RewriteError::WouldWrite(said)) => Err(fail(2, said)),
        Err(RewriteError::Refused(why)) => Err(fail(EXIT_UNVERIFIED, why)),
        Err(RewriteError::Busy) => Err(fail(EXIT_TEMPFAIL, RewriteError::Busy.to_string())),
        Err(RewriteError::Database(e)) => Err(fail(1, crate::report::chain(&e))),
    }
}

/// `receipts new-log`: what the receipt log holds, and (with `yes`) the
/// log emptied for a new one, its old newest checkpoint returned for the
/// operator to keep. Without `yes`, nothing is changed: exit 2, saying
/// what would be removed.
pub fn new_log(database_url: &str, yes: bool) -> Result<String, EvidenceError> {
    let db = owner_database(database_url)?;
    let mut conn = db.conn().map_err(|e| fail(1, crate::report::chain(&e)))?;
    let failed = |e: diesel::result::Error| fail(1, crate::report::chain(&e));
    let (leaves, checkpoints, newest) =
        crate::storage::receipt_log::log_extent(&mut conn).map_err(failed)?;
    let origin = newest
        .as_ref()
        .and_then(|c| c.note.lines().next())
        .unwrap_or("(none)")
        .to_owned();
    if !yes {
        return Err(fail(
            2,
            format!(
                "this removes the receipt log {origin:?} from the database: {leaves} leaves and {checkpoints} checkpoints (plans, their signatures and the published keys stay). Stop every instance, keep the log's checkpoints outside the database, then run it again with --yes; start the instances with a new key and a new --log-origin"
            ),
        ));
    }
    let old = crate::storage::receipt_log::start_new_log(&mut conn).map_err(failed)?;
    Ok(match old {
        Some(checkpoint) => format!(
            "{}\n(the old log {origin:?}'s newest checkpoint, above: keep it. Its {leaves} leaves and {checkpoints} checkpoints are removed; start the instances with a new key and a new --log-origin)",
            checkpoint.note.trim_end()
        ),
        None => format!("the receipt log held no checkpoint; its {leaves} leaves are removed"),
    })
}
