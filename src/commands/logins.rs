//! `plan-intake logins`: the only way to create, list, revoke or rotate one.

use std::time::Duration;

use clap::Subcommand;
use plan_intake::intake::Permission;
use plan_intake::intake::login as logins;
use plan_intake::intake::receipt::format_timestamp;
use plan_intake::storage::{MigrateOnOpen, PgPooler};

use super::{CommandError, DatabaseArgs, open_single, say};

#[derive(Subcommand)]
pub enum LoginsAction {
    /// Create a login; prints only its token on stdout
    Add {
        name: String,
        /// plans:submit or receipts:read; repeat for several
        #[arg(long = "permission", required = true)]
        permissions: Vec<Permission>,
    },
    /// List logins (never tokens)
    List,
    /// Revoke a login's token at once
    Revoke { name: String },
    /// Issue a new token for a login (prints only the token); the old one
    /// keeps working for the grace period. Keys and receipts stay the login's.
    Rotate {
        name: String,
        /// How long the old token keeps working, e.g. 24h, 30m, 0s
        #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
        grace: Duration,
    },
}

pub fn run(db: &DatabaseArgs, action: LoginsAction) -> Result<(), CommandError> {
    // Logins live in the migrated schema; a fresh database is made ready
    // first (directly; through a transaction pooler it must be migrated).
    let migrate = match db.pg_pooler {
        PgPooler::None => MigrateOnOpen::Apply,
        PgPooler::Transaction => MigrateOnOpen::RequireNonePending,
    };
    // Input is checked before anything is opened: a refused command
    // creates no database file.
    if let LoginsAction::Add { name, .. } = &action {
        logins::validate_name(name)?;
    }
    let mut conn = open_single(db, migrate)?;
    match action {
        LoginsAction::Add { name, permissions } => {
            // Printed before the login is committed: no login without its token.
            logins::create_handed_over(&mut conn, &name, &permissions, |token| {
                plan_intake::stdout::line(token)
            })?;
            eprintln!("created login `{name}`; the token above is shown only once");
        }
        LoginsAction::List => {
            for login in logins::list(&mut conn)? {
                let state = match login.revoked_at {
                    Some(at) => format!("revoked {}", format_timestamp(&at)),
                    None => "active".to_owned(),
                };
                say!(
                    "{}\t{}\tcreated {}\t{state}",
                    login.name,
                    login.permissions,
                    format_timestamp(&login.created_at)
                );
            }
        }
        LoginsAction::Revoke { name } => {
            logins::revoke(&mut conn, &name)?;
            eprintln!("revoked login `{name}`");
        }
        LoginsAction::Rotate { name, grace } => {
            logins::rotate_handed_over(&mut conn, &name, grace, |token| {
                plan_intake::stdout::line(token)
            })?;
            eprintln!(
                "new token for login `{name}`, shown only once; the previous one works for {} more",
                humantime::format_duration(grace)
            );
        }
    }
    Ok(())
}
