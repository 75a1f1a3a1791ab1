//! `plan-intake inbox`: the ordering system's inbox tables, created in the
//! consumer's database by its owner or printed for its DBA. `follow --into`
//! never creates them.

use clap::Subcommand;
use plan_intake::inbox::{self, Backend, InboxError};

use super::{CommandError, say, tell};

#[derive(Subcommand)]
pub enum InboxAction {
    /// Create the inbox's tables in the consumer's database (run as a role that may create tables there): the inbox's migrations not yet run, each once
    Migrate {
        /// The consumer's database: postgres://…, postgresql://…, sqlite://PATH or a plain SQLite path (not the service's)
        #[arg(long, value_name = "DATABASE_URL")]
        into: String,
    },
    /// Print every inbox migration as one SQL script (one transaction, recording each in plan_intake_inbox_migrations), for the consumer's DBA
    Sql {
        /// The consumer's database kind
        #[arg(value_enum)]
        backend: Backend,
    },
}

pub fn run(action: InboxAction) -> Result<(), CommandError> {
    match action {
        InboxAction::Migrate { into } => {
            let ran = inbox::migrate(&into).map_err(inbox_error)?;
            for version in &ran {
                say!("{version}");
            }
            tell!(
                "{} inbox migration(s) run; {} in all",
                ran.len(),
                inbox::MIGRATIONS.len()
            );
        }
        InboxAction::Sql { backend } => {
            plan_intake::stdout::line(inbox::sql(backend).trim_end())
                .map_err(CommandError::Output)?;
        }
    }
    Ok(())
}

/// An inbox that cannot be opened or migrated: the follower's own error
/// (exit 74), its message whole.
pub fn inbox_error(error: InboxError) -> CommandError {
    use plan_intake_client::FollowError;
    CommandError::Follow(match error {
        // As a cursor file that holds no cursor: 65.
        InboxError::BadPosition(_) => FollowError::BadCursor(error.to_string()),
        _ => FollowError::Sink(error.to_string()),
    })
}
