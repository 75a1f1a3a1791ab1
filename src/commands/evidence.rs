//! The evidence commands' command line: `signing-keys generate`,
//! `receipts verify`, `audit`; and `verify` (the database upholds the
//! guarantees). Their bodies are the library's (`plan_intake::evidence`,
//! `plan_intake::verify`).

use std::path::PathBuf;

use clap::{Args, Subcommand};
use plan_intake::{evidence, verify};

use super::{CommandError, DatabaseArgs, say};

#[derive(Subcommand)]
pub enum SigningKeysAction {
    /// Write a new Ed25519 key pair: PATH (private, mode 0600) and PATH.pub (its C2SP signed-note verifier key)
    Generate {
        /// Where the private key goes; never overwritten
        #[arg(long, value_name = "PATH")]
        out: PathBuf,
        /// The key's name, shown in signatures (no spaces or `+`)
        #[arg(long, default_value = "plan-intake")]
        name: String,
    },
}

#[derive(Subcommand)]
pub enum ReceiptsAction {
    /// Check a receipt's signature and, with --proof, its inclusion in a signed checkpoint; exit 0, or 65 with the reason
    Verify {
        /// The receipt as the service answered it (or a plan read with its receipt)
        file: PathBuf,
        /// The keys to trust: what `GET /v1/signing-keys` answered, or verifier keys one per line
        #[arg(long, value_name = "KEYS")]
        keys: PathBuf,
        /// The receipt's proof, as `GET /v1/receipts/{id}/proof` answered it
        #[arg(long, value_name = "PROOF")]
        proof: Option<PathBuf>,
    },
    /// Recompute the receipt log's stored hashes from its leaves and write them back, as the database's owner with every instance stopped: only where the leaves make the tree of the newest signed checkpoint (a hash row changed by hand leaves the log stuck; a changed leaf is refused, exit 65)
    Rehash {
        #[command(flatten)]
        db: DatabaseArgs,
        /// Write them (without it, nothing changes: what would be written is said, exit 2)
        #[arg(long)]
        yes: bool,
    },
    /// Start a new receipt log, as the database's owner with every instance stopped: the log's leaves, hashes and checkpoints are removed (its newest checkpoint is printed, to keep), and the next `serve` with a new key and --log-origin logs every plan again from the first. After a restore that is to stand, instead of signing a second tree under the old name
    NewLog {
        #[command(flatten)]
        db: DatabaseArgs,
        /// Remove the old log (without it, nothing changes: what would be removed is said)
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Args)]
pub struct AuditArgs {
    #[command(flatten)]
    pub db: DatabaseArgs,
    /// The keys to trust: what `GET /v1/signing-keys` answered, or verifier keys one per line
    #[arg(long, value_name = "KEYS")]
    pub keys: PathBuf,
    /// A checkpoint kept outside the database (`GET /v1/checkpoint`), held against the log too; repeatable
    #[arg(long, value_name = "FILE")]
    pub checkpoint: Vec<PathBuf>,
}

pub fn signing_keys(action: SigningKeysAction) -> Result<(), CommandError> {
    let SigningKeysAction::Generate { out, name } = action;
    say!("{}", evidence::generate(&out, &name)?);
    Ok(())
}

pub fn receipts(action: ReceiptsAction) -> Result<(), CommandError> {
    match action {
        ReceiptsAction::Verify { file, keys, proof } => {
            say!("{}", evidence::verify(&file, &keys, proof.as_deref())?);
        }
        ReceiptsAction::Rehash { db, yes } => {
            say!("{}", evidence::rehash(&db.database_url, yes)?);
        }
        ReceiptsAction::NewLog { db, yes } => {
            say!("{}", evidence::new_log(&db.database_url, yes)?);
        }
    }
    Ok(())
}

pub fn audit(args: AuditArgs) -> Result<(), CommandError> {
    let (lines, outcome) =
        match evidence::audit(&args.db.database_url, &args.keys, &args.checkpoint) {
            Ok(lines) => (lines, Ok(())),
            Err((lines, error)) => (lines, Err(error.into())),
        };
    for line in lines {
        say!("{line}");
    }
    outcome
}

pub fn check(db: &DatabaseArgs) -> Result<(), CommandError> {
    match verify::run(&db.database_url)? {
        0 => Ok(()),
        failed => Err(CommandError::ChecksFailed(failed)),
    }
}

pub fn contend(db: &DatabaseArgs) -> Result<(), CommandError> {
    say!("{}", verify::contend(&db.database_url)?);
    Ok(())
}
